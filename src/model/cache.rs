//! Per-sequence caches of the runner: a KV cache for every full-attention layer, the conv window
//! and recurrent state for every Gated DeltaNet layer, and a KV cache for every MTP layer.
//!
//! Speculative verification runs the target over `n + 1` tokens and keeps only the accepted
//! prefix. A forward can *record*: it remembers where the sequence stood, and each GDN layer keeps
//! its conv window and recurrent state after every token of the forward; [`SequenceCache::commit`]
//! then keeps the first `k` tokens (KV caches truncated, GDN state taken from the snapshot after
//! token `k`), with no undo pass and no recomputation. (The GPU design keeps this contract with
//! less state traffic; see the `gdn` family.)

use crate::error::{Error, Result};
use crate::model::config::{LayerKind, ModelConfig};

/// Keys and values of one attention layer for one sequence: `[positions][kv_heads][head_dim]`.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Keys, `positions * row` values.
    pub keys: Vec<f32>,
    /// Values, `positions * row` values.
    pub values: Vec<f32>,
    /// `kv_heads * head_dim`.
    pub row: usize,
}

impl KvCache {
    fn new(row: usize) -> Self {
        Self {
            keys: Vec::new(),
            values: Vec::new(),
            row,
        }
    }

    /// Positions held (0 for a cache of rows of no width, as `default()` makes).
    pub fn len(&self) -> usize {
        self.keys.len().checked_div(self.row).unwrap_or(0)
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Keeps the first `positions`.
    pub fn truncate(&mut self, positions: usize) {
        self.keys.truncate(positions.saturating_mul(self.row));
        self.values.truncate(positions.saturating_mul(self.row));
    }
}

/// The state of one Gated DeltaNet layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct GdnCache {
    /// The last `kernel - 1` conv inputs, `[kernel - 1][conv_dim]`.
    pub conv: Vec<f32>,
    /// The recurrent state, `[Hv][dk][dv]` f32.
    pub state: Vec<f32>,
    /// While recording: `(conv, state)` after each token of the current forward.
    pub snapshots: Vec<(Vec<f32>, Vec<f32>)>,
}

/// One decoder layer's cache.
#[derive(Debug, Clone)]
pub enum LayerCache {
    /// Full attention.
    Kv(KvCache),
    /// Gated DeltaNet.
    Gdn(GdnCache),
}

/// Everything one sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    /// One per decoder layer.
    pub layers: Vec<LayerCache>,
    /// One per MTP layer.
    pub mtp: Vec<KvCache>,
    /// Positions the target has processed.
    pub len: usize,
    /// Where the sequence stood before the recorded forward, while one is pending commit.
    pub recorded_from: Option<usize>,
}

/// Elements of one position's keys (or values) in an attention layer's cache, and of a Gated
/// DeltaNet layer's conv window and recurrent state, for `config`.
fn layer_sizes(config: &ModelConfig) -> (usize, usize, usize) {
    let kv_row = config.num_key_value_heads * config.head_dim;
    let conv_len = (config.linear_conv_kernel_dim - 1) * config.linear_conv_dim();
    let state_len =
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim;
    (kv_row, conv_len, state_len)
}

impl SequenceCache {
    /// Empty caches for a new sequence of `config`.
    pub fn new(config: &ModelConfig) -> Self {
        let (kv_row, conv_len, state_len) = layer_sizes(config);
        Self {
            layers: config
                .layer_types
                .iter()
                .map(|kind| match kind {
                    LayerKind::FullAttention => LayerCache::Kv(KvCache::new(kv_row)),
                    LayerKind::LinearAttention => LayerCache::Gdn(GdnCache {
                        conv: vec![0.0; conv_len],
                        state: vec![0.0; state_len],
                        snapshots: Vec::new(),
                    }),
                })
                .collect(),
            mtp: (0..config.mtp_num_hidden_layers)
                .map(|_| KvCache::new(kv_row))
                .collect(),
            len: 0,
            recorded_from: None,
        }
    }

    /// Checks that this cache is one [`SequenceCache::new`] made for `config` (its fields are
    /// public, so a caller may hand over one of another model): a cache of the right kind and
    /// size for every layer and every MTP layer, keys and values of whole positions.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `sequence` and the first layer that does not fit.
    pub fn check_for(&self, config: &ModelConfig, sequence: usize) -> Result<()> {
        let (kv_row, conv_len, state_len) = layer_sizes(config);
        let kv_fits = |kv: &KvCache| {
            kv.row == kv_row && kv.keys.len() == kv.values.len() && kv.keys.len() % kv_row == 0
        };
        let bad = |what: String| {
            Error::invalid(
                format!("sequence {sequence} cache"),
                format!("{what} does not fit the model's config: not a cache made for this model"),
            )
        };
        if self.layers.len() != config.layer_types.len()
            || self.mtp.len() != config.mtp_num_hidden_layers
        {
            return Err(bad(format!(
                "{} layers and {} MTP layers",
                self.layers.len(),
                self.mtp.len()
            )));
        }
        for (i, (layer, kind)) in self.layers.iter().zip(&config.layer_types).enumerate() {
            let fits = match (layer, kind) {
                (LayerCache::Kv(kv), LayerKind::FullAttention) => kv_fits(kv),
                (LayerCache::Gdn(g), LayerKind::LinearAttention) => {
                    g.conv.len() == conv_len && g.state.len() == state_len
                }
                _ => false,
            };
            if !fits {
                return Err(bad(format!("layer {i}'s cache")));
            }
        }
        if let Some(i) = self.mtp.iter().position(|kv| !kv_fits(kv)) {
            return Err(bad(format!("MTP layer {i}'s cache")));
        }
        Ok(())
    }

    /// Positions the MTP head's caches hold (the first MTP layer's).
    pub fn mtp_len(&self) -> usize {
        self.mtp.first().map_or(0, KvCache::len)
    }

    /// Drops MTP positions from `positions` on (rows computed from drafts rather than from the
    /// target's hidden states).
    pub fn truncate_mtp(&mut self, positions: usize) {
        self.mtp.iter_mut().for_each(|kv| kv.truncate(positions));
    }

    /// After a recorded forward of `t` tokens, keeps the first `keep` (1 ..= t) of them.
    ///
    /// # Errors
    /// [`Error::Invalid`] when no recorded forward is pending, `keep` is out of range, or a GDN
    /// layer holds fewer snapshots than tokens recorded (a cache changed by hand); the recorded
    /// forward then stays pending, for a commit with a valid `keep`.
    pub fn commit(&mut self, keep: usize) -> Result<()> {
        let from = self.recorded_from.ok_or_else(|| {
            Error::invalid("commit", "no recorded forward is pending for this sequence")
        })?;
        let processed = self.len.saturating_sub(from);
        if keep == 0 || keep > processed {
            return Err(Error::invalid(
                "commit",
                format!("keep {keep} of {processed} recorded tokens (1 ..= {processed})"),
            ));
        }
        let short = self.layers.iter().position(|layer| match layer {
            LayerCache::Gdn(gdn) => gdn.snapshots.len() < keep,
            LayerCache::Kv(_) => false,
        });
        if let Some(layer) = short {
            return Err(Error::invalid(
                "commit",
                format!("layer {layer} holds fewer than {keep} recorded states"),
            ));
        }
        self.recorded_from = None;
        for layer in &mut self.layers {
            match layer {
                LayerCache::Kv(kv) => kv.truncate(from + keep),
                LayerCache::Gdn(gdn) => {
                    let (conv, state) = std::mem::take(&mut gdn.snapshots[keep - 1]);
                    gdn.conv = conv;
                    gdn.state = state;
                    gdn.snapshots.clear();
                }
            }
        }
        self.len = from + keep;
        Ok(())
    }
}
