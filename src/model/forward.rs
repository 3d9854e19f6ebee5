//! The Qwen3.5-MoE forward and the MTP head on the CPU, built from the kernel families' CPU
//! references (`norm`, `attention`, `gdn`, `moe`, `gemm`), so that each step has the same inputs
//! and outputs as the GPU kernel that replaces it.
//!
//! A forward takes a batch of sequences, each with its own tokens and caches; rows of all
//! sequences are concatenated for the projections and the MoE (as the GPU path batches them), and
//! each sequence's rows go through the token mixers with its own caches. Every token goes through
//! the mixers one at a time (the recurrent form of the gated delta rule), so a token's result does
//! not depend on how tokens were grouped into forwards: greedy decoding with speculation is then
//! token-for-token equal to decoding without it.

use crate::error::{Error, Result};
use crate::kernels::attention::reference::{self as attention, AttentionShape};
use crate::kernels::gdn::reference::{self as gdn, DeltaInputs, GdnShape};
use crate::kernels::moe::reference::{self as moe, ExpertRef, MoeShape};
use crate::kernels::norm::reference::rms_norm;
use crate::model::cache::{GdnCache, KvCache, LayerCache, SequenceCache};
use crate::model::config::ModelConfig;
use crate::model::params::{
    AttentionWeights, GdnWeights, LayerWeights, MixerWeights, ModelWeights, MoeWeights,
};

/// A loaded model: its config and weights.
pub struct Model {
    /// The configuration.
    pub config: ModelConfig,
    /// The weights, f32 on the host.
    pub weights: ModelWeights,
    inv_freq: Vec<f32>,
}

/// One sequence's part of a target forward.
pub struct ForwardInput<'a> {
    /// The sequence's caches; its tokens continue at position `cache.len`.
    pub cache: &'a mut SequenceCache,
    /// Tokens to process.
    pub tokens: &'a [u32],
    /// Keep per-token GDN snapshots so that [`SequenceCache::commit`] can keep a prefix.
    pub record: bool,
    /// Logits for every row (`true`) or only the last (`false`).
    pub all_logits: bool,
}

/// One sequence's part of an MTP forward.
pub struct MtpInput<'a> {
    /// The sequence's caches; rows continue at position `cache.mtp[layer].len()`.
    pub cache: &'a mut SequenceCache,
    /// The token of each row: row `p` pairs token `t_{p+1}` ...
    pub tokens: &'a [u32],
    /// ... with hidden `H_p`, `[rows][H]`: the target's output after the final norm (or, for a
    /// chained draft, the previous MTP output after `mtp.norm`).
    pub hidden: &'a [f32],
    /// Which MTP layer runs (the draft step modulo the MTP depth).
    pub layer: usize,
}

/// What a forward returns for one sequence.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[rows][H]`: after the final norm (target) or after `mtp.norm` (MTP).
    pub hidden: Vec<f32>,
    /// `[logit rows][V]`.
    pub logits: Vec<f32>,
}

/// Where one sequence's rows sit in a batch.
struct Segment {
    start: usize,
    rows: usize,
    position: usize,
}

impl Model {
    /// A model from its parts, as given: `weights` must be what [`ModelWeights::load`] makes of
    /// a checkpoint of `config` ([`Model::load`] does both).
    ///
    /// # Panics
    /// Not here; [`Model::forward`] and [`Model::mtp_forward`] panic on weights whose layers or
    /// shapes disagree with `config`.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        let inv_freq = attention::rope_inv_freq(config.rotary_dim(), config.rope_theta);
        Self {
            config,
            weights,
            inv_freq,
        }
    }

    /// Loads `dir` (config.json and safetensors), checking every tensor first.
    ///
    /// # Errors
    /// As [`ModelConfig::load`], [`crate::formats::safetensors::Checkpoint::open`] and
    /// [`ModelWeights::load`].
    pub fn load(dir: impl AsRef<std::path::Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ModelConfig::load(dir)?;
        let checkpoint = crate::formats::safetensors::Checkpoint::open(dir)?;
        let weights = ModelWeights::load(&checkpoint, &config)?;
        Ok(Self::new(config, weights))
    }

    /// Whether the model has an MTP head.
    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some()
    }

    /// Checks that every token of sequence `sequence` is in the vocabulary.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the sequence, the position in its tokens and the id.
    fn check_tokens(&self, tokens: &[u32], sequence: usize) -> Result<()> {
        let v = self.config.vocab_size;
        match tokens.iter().position(|&t| t as usize >= v) {
            Some(p) => Err(Error::invalid(
                format!("sequence {sequence}, token {p}"),
                format!("id {} is outside the vocabulary of {v}", tokens[p]),
            )),
            None => Ok(()),
        }
    }

    /// The embeddings of `tokens`, `[T][H]`.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            if t as usize >= v {
                return Err(Error::invalid(
                    "token id",
                    format!("{t} is outside the vocabulary of {v}"),
                ));
            }
            x.extend_from_slice(&self.weights.embed[t as usize * h..(t as usize + 1) * h]);
        }
        Ok(x)
    }

    /// Target forward over a batch of sequences.
    ///
    /// # Errors
    /// [`Error::Invalid`], naming the sequence, for a token outside the vocabulary, an empty
    /// token list, a recorded forward still pending commit, or a cache not made for this model.
    pub fn forward(&self, batch: &mut [ForwardInput<'_>]) -> Result<Vec<ForwardOutput>> {
        let h = self.config.hidden_size;
        let mut segments = Vec::with_capacity(batch.len());
        let mut tokens = Vec::new();
        for (i, input) in batch.iter().enumerate() {
            if input.tokens.is_empty() {
                return Err(Error::invalid(
                    format!("forward: sequence {i}"),
                    "no tokens",
                ));
            }
            if input.cache.recorded_from.is_some() {
                return Err(Error::invalid(
                    format!("forward: sequence {i}"),
                    "its last recorded forward was not committed",
                ));
            }
            input.cache.check_for(&self.config, i)?;
            self.check_tokens(input.tokens, i)?;
            segments.push(Segment {
                start: tokens.len(),
                rows: input.tokens.len(),
                position: input.cache.len,
            });
            tokens.extend_from_slice(input.tokens);
        }
        let mut x = self.embed(&tokens)?;
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let mut caches: Vec<(&mut LayerCache, bool)> = batch
                .iter_mut()
                .map(|input| (&mut input.cache.layers[i], input.record))
                .collect();
            self.decoder_layer(layer, &mut x, &segments, &mut caches);
        }
        let hidden = rms_norm(&x, &self.weights.final_norm, self.config.rms_norm_eps);
        let mut outputs = Vec::with_capacity(batch.len());
        for (input, seg) in batch.iter_mut().zip(&segments) {
            let rows = &hidden[seg.start * h..(seg.start + seg.rows) * h];
            let logit_rows = if input.all_logits {
                rows
            } else {
                &rows[(seg.rows - 1) * h..]
            };
            outputs.push(ForwardOutput {
                hidden: rows.to_vec(),
                logits: self.weights.lm_head.apply(logit_rows),
            });
            if input.record {
                input.cache.recorded_from = Some(input.cache.len);
            }
            input.cache.len += seg.rows;
        }
        Ok(outputs)
    }

    /// MTP forward over a batch of sequences: every row's logits and post-`mtp.norm` hidden.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the model has no MTP head, for a token outside the vocabulary,
    /// rows and hidden states that disagree, an MTP layer index out of range, or a cache not made
    /// for this model.
    pub fn mtp_forward(&self, batch: &mut [MtpInput<'_>]) -> Result<Vec<ForwardOutput>> {
        let mtp = self.weights.mtp.as_ref().ok_or_else(|| {
            Error::invalid("MTP", "the checkpoint has no MTP head (mtp.* tensors)")
        })?;
        let (h, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let mut segments = Vec::with_capacity(batch.len());
        let mut tokens = Vec::new();
        let mut hidden = Vec::new();
        let layer = batch.first().map_or(0, |b| b.layer);
        for (i, input) in batch.iter().enumerate() {
            input.cache.check_for(&self.config, i)?;
            self.check_tokens(input.tokens, i)?;
            if input.hidden.len() != input.tokens.len() * h || input.tokens.is_empty() {
                return Err(Error::invalid(
                    "MTP input",
                    format!(
                        "{} tokens with {} hidden values (hidden size {h})",
                        input.tokens.len(),
                        input.hidden.len()
                    ),
                ));
            }
            if input.layer != layer || layer >= mtp.layers.len() {
                return Err(Error::invalid(
                    "MTP layer",
                    format!(
                        "{} (the head has {}; one layer per batch)",
                        input.layer,
                        mtp.layers.len()
                    ),
                ));
            }
            segments.push(Segment {
                start: tokens.len(),
                rows: input.tokens.len(),
                position: input.cache.mtp[layer].len(),
            });
            tokens.extend_from_slice(input.tokens);
            hidden.extend_from_slice(input.hidden);
        }
        let e = rms_norm(&self.embed(&tokens)?, &mtp.pre_fc_norm_embedding, eps);
        let hn = rms_norm(&hidden, &mtp.pre_fc_norm_hidden, eps);
        let joined: Vec<f32> = e
            .chunks_exact(h)
            .zip(hn.chunks_exact(h))
            .flat_map(|(e, h)| e.iter().chain(h).copied())
            .collect();
        let mut x = mtp.fc.apply(&joined);
        let mut caches: Vec<(&mut LayerCache, bool)> = Vec::new();
        // the MTP layer's KV cache lives in the sequence cache's `mtp` list; wrap it for the
        // shared decoder-layer code and unwrap it afterwards
        let mut wrapped: Vec<LayerCache> = batch
            .iter_mut()
            .map(|input| LayerCache::Kv(std::mem::take(&mut input.cache.mtp[layer])))
            .collect();
        caches.extend(wrapped.iter_mut().map(|c| (c, false)));
        self.decoder_layer(&mtp.layers[layer], &mut x, &segments, &mut caches);
        for (input, cache) in batch.iter_mut().zip(wrapped) {
            if let LayerCache::Kv(kv) = cache {
                input.cache.mtp[layer] = kv;
            }
        }
        let out = rms_norm(&x, &mtp.norm, eps);
        Ok(segments
            .iter()
            .map(|seg| {
                let rows = &out[seg.start * h..(seg.start + seg.rows) * h];
                ForwardOutput {
                    hidden: rows.to_vec(),
                    logits: self.weights.lm_head.apply(rows),
                }
            })
            .collect())
    }

    /// `x += mixer(norm(x)); x += moe(norm(x))` over every segment's rows.
    fn decoder_layer(
        &self,
        layer: &LayerWeights,
        x: &mut [f32],
        segments: &[Segment],
        caches: &mut [(&mut LayerCache, bool)],
    ) {
        let (h, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let normed = rms_norm(x, &layer.input_norm, eps);
        for (seg, (cache, record)) in segments.iter().zip(caches.iter_mut()) {
            let rows = &normed[seg.start * h..(seg.start + seg.rows) * h];
            let mixed = match (&layer.mixer, &mut **cache) {
                (MixerWeights::Attention(w), LayerCache::Kv(kv)) => {
                    self.attention(w, rows, kv, seg.position)
                }
                (MixerWeights::Gdn(w), LayerCache::Gdn(state)) => self.gdn(w, rows, state, *record),
                _ => unreachable!("caches are built from the same layer_types as the weights"),
            };
            for (dst, m) in x[seg.start * h..(seg.start + seg.rows) * h]
                .iter_mut()
                .zip(mixed)
            {
                *dst += m;
            }
        }
        let normed = rms_norm(x, &layer.post_attention_norm, eps);
        let out = self.moe(&layer.moe, &normed);
        x.iter_mut().zip(out).for_each(|(dst, m)| *dst += m);
    }

    /// Gated full attention of one sequence's `rows` (normed), appending to its KV cache.
    fn attention(
        &self,
        w: &AttentionWeights,
        rows: &[f32],
        kv: &mut KvCache,
        position: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let (h, heads, hd) = (c.hidden_size, c.num_attention_heads, c.head_dim);
        let shape = AttentionShape {
            heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
        };
        let t = rows.len() / h;
        let q_gate = w.q.apply(rows);
        let mut keys = rms_norm(&w.k.apply(rows), &w.k_norm, c.rms_norm_eps);
        let values = w.v.apply(rows);
        let kv_row = kv.row;
        let mut gated = Vec::with_capacity(t * heads * hd);
        for step in 0..t {
            let pos = position + step;
            let qg = &q_gate[step * 2 * heads * hd..(step + 1) * 2 * heads * hd];
            let query: Vec<f32> = qg
                .chunks_exact(2 * hd)
                .flat_map(|head| head[..hd].iter().copied())
                .collect();
            let mut query = rms_norm(&query, &w.q_norm, c.rms_norm_eps);
            attention::apply_rope(&mut query, hd, pos, &self.inv_freq);
            let key = &mut keys[step * kv_row..(step + 1) * kv_row];
            attention::apply_rope(key, hd, pos, &self.inv_freq);
            kv.keys.extend_from_slice(key);
            kv.values
                .extend_from_slice(&values[step * kv_row..(step + 1) * kv_row]);
            let out = attention::attend(shape, &query, &kv.keys, &kv.values, kv.len());
            for (head, o) in qg.chunks_exact(2 * hd).zip(out.chunks_exact(hd)) {
                let gate = &head[hd..];
                gated.extend(
                    o.iter()
                        .zip(gate)
                        .map(|(&o, &g)| (o as f64 / (1.0 + (-(g as f64)).exp())) as f32),
                );
            }
        }
        w.o.apply(&gated)
    }

    /// Gated DeltaNet of one sequence's `rows` (normed), token by token, updating its state.
    fn gdn(&self, w: &GdnWeights, rows: &[f32], cache: &mut GdnCache, record: bool) -> Vec<f32> {
        let c = &self.config;
        let h = c.hidden_size;
        let shape = GdnShape {
            key_heads: c.linear_num_key_heads,
            value_heads: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
        };
        let (key_dim, conv_dim) = (shape.key_heads * shape.dk, c.linear_conv_dim());
        let hv = shape.value_heads;
        let t = rows.len() / h;
        let mixed = w.qkv.apply(rows);
        let z = w.z.apply(rows);
        let b = w.b.apply(rows);
        let a = w.a.apply(rows);
        let q_scale = 1.0 / (shape.dk as f64).sqrt();
        let mut y = Vec::with_capacity(t * hv * shape.dv);
        cache.snapshots.clear();
        for step in 0..t {
            let conv = gdn::conv1d_silu(
                &mixed[step * conv_dim..(step + 1) * conv_dim],
                1,
                conv_dim,
                &w.conv,
                c.linear_conv_kernel_dim,
                &mut cache.conv,
            );
            let mut q = conv[..key_dim].to_vec();
            let mut k = conv[key_dim..2 * key_dim].to_vec();
            let v = &conv[2 * key_dim..];
            gdn::l2_normalize(&mut q, shape.dk, q_scale);
            gdn::l2_normalize(&mut k, shape.dk, 1.0);
            let (g, beta) = gdn::gates(
                &a[step * hv..(step + 1) * hv],
                &b[step * hv..(step + 1) * hv],
                &w.a_log,
                &w.dt_bias,
            );
            let o = gdn::recurrent(
                shape,
                DeltaInputs {
                    t: 1,
                    q: &q,
                    k: &k,
                    v,
                    g: &g,
                    beta: &beta,
                },
                &mut cache.state,
            );
            y.extend(gdn::gated_rmsnorm(
                &o,
                &z[step * hv * shape.dv..(step + 1) * hv * shape.dv],
                &w.norm,
                shape.dv,
                c.rms_norm_eps,
            ));
            if record {
                cache
                    .snapshots
                    .push((cache.conv.clone(), cache.state.clone()));
            }
        }
        w.out.apply(&y)
    }

    /// The sparse MoE block over all rows.
    fn moe(&self, w: &MoeWeights, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let shape = MoeShape {
            experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            hidden: c.hidden_size,
            intermediate: c.moe_intermediate_size,
            shared_intermediate: c.shared_expert_intermediate_size,
        };
        let t = x.len() / c.hidden_size;
        let routing = moe::route(shape, x, t, &w.router, Some(&w.shared_gate));
        moe::moe_block(
            shape,
            x,
            t,
            &routing,
            |e| ExpertRef {
                gate_up: &w.experts[e].gate_up,
                down: &w.experts[e].down,
            },
            Some(ExpertRef {
                gate_up: &w.shared.gate_up,
                down: &w.shared.down,
            }),
        )
    }
}
