//! Bytes per decoded token and the ceilings they imply: the memory-bandwidth roofline of a
//! Qwen3.5-MoE decode step by part, the speculation model, and a fit of measured forward costs.
//!
//! A decode step of `batch` sequences reads every weight it uses once (shared by the batch),
//! each sequence's KV cache over its context, and each sequence's Gated DeltaNet state (read and
//! written: 2 MiB per GDN layer per sequence in Qwen3.6-35B-A3B). Routed experts are counted by
//! the expected number of distinct experts `batch * rows` tokens select (uniform routing).

use crate::error::{Error, Result};
use crate::model::config::{LayerKind, ModelConfig};

/// How the checkpoint's linears are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Every tensor in bf16.
    Bf16,
    /// NVIDIA ModelOpt NVFP4: experts, shared experts and attention projections in NVFP4
    /// (0.5 + 1/16 bytes per weight); GDN, router, shared-expert gate, embeddings, lm_head and
    /// MTP in bf16.
    Nvfp4,
}

impl Precision {
    fn quantised_bytes(self, elements: f64) -> f64 {
        match self {
            Precision::Bf16 => 2.0 * elements,
            Precision::Nvfp4 => elements * (0.5 + 1.0 / 16.0),
        }
    }
}

/// Bytes one decode step reads, by part.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct StepBytes {
    /// Routed experts (distinct experts selected by the step's tokens).
    pub experts: f64,
    /// Shared experts, router and shared-expert gates.
    pub shared_and_router: f64,
    /// Full-attention projections (q with gate, k, v, o) and q/k norms.
    pub attention: f64,
    /// Gated DeltaNet projections, conv weights and small per-head tensors.
    pub gdn_projections: f64,
    /// Decoder-layer and final norms.
    pub norms: f64,
    /// lm_head (plus one embedding row per token).
    pub lm_head_and_embeddings: f64,
    /// KV cache of the full-attention layers over the context, every sequence.
    pub kv_cache: f64,
    /// Gated DeltaNet recurrent and conv state, read and written, every sequence.
    pub gdn_state: f64,
}

impl StepBytes {
    /// Sum of all parts.
    pub fn total(&self) -> f64 {
        self.experts
            + self.shared_and_router
            + self.attention
            + self.gdn_projections
            + self.norms
            + self.lm_head_and_embeddings
            + self.kv_cache
            + self.gdn_state
    }
}

/// The shape of a step: `batch` sequences, `rows` tokens each (1 for plain decode, n + 1 to
/// verify n drafts), each sequence with `context` tokens in its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence in this forward.
    pub rows: usize,
    /// Context length (tokens already in each sequence's KV cache).
    pub context: usize,
    /// Bytes per cached key or value element: 2 (bf16) or 1 (e4m3), as
    /// [`KvFormat::element_bytes`](crate::kernels::attention::KvFormat::element_bytes).
    pub kv_element_bytes: usize,
}

/// Expected distinct experts chosen by `tokens` tokens each picking `k` of `e` uniformly.
pub fn expected_distinct_experts(e: usize, k: usize, tokens: usize) -> f64 {
    let (e, k) = (e as f64, k as f64);
    e * (1.0 - (1.0 - k / e).powi(tokens as i32))
}

/// Bytes a target forward of `step` reads.
pub fn step_bytes(config: &ModelConfig, precision: Precision, step: Step) -> StepBytes {
    let h = config.hidden_size as f64;
    let tokens = step.batch * step.rows;
    let bf16 = |elements: f64| 2.0 * elements;
    let q = |elements: f64| precision.quantised_bytes(elements);
    let (gdn_layers, full_layers) = config.layer_counts();
    let (gdn_layers, full_layers) = (gdn_layers as f64, full_layers as f64);
    let layers = config.layer_types.len() as f64;

    let expert = 3.0 * h * config.moe_intermediate_size as f64; // gate, up, down
    let distinct =
        expected_distinct_experts(config.num_experts, config.num_experts_per_tok, tokens);
    let shared = 3.0 * h * config.shared_expert_intermediate_size as f64;
    let router = config.num_experts as f64 * h + h; // router + shared-expert gate

    let heads_q = config.num_attention_heads as f64
        * config.head_dim as f64
        * if config.attn_output_gate { 2.0 } else { 1.0 };
    let kv = 2.0 * config.num_key_value_heads as f64 * config.head_dim as f64;
    let o = config.num_attention_heads as f64 * config.head_dim as f64 * h;
    let attention = q(heads_q * h + kv * h + o) + bf16(2.0 * config.head_dim as f64);

    let value_dim = (config.linear_num_value_heads * config.linear_value_head_dim) as f64;
    let value_heads = config.linear_num_value_heads as f64;
    let conv_dim = config.linear_conv_dim() as f64;
    let gdn = bf16(
        conv_dim * h
            + value_dim * h
            + 2.0 * value_heads * h
            + value_dim * h
            + conv_dim * config.linear_conv_kernel_dim as f64,
    ) + bf16(config.linear_value_head_dim as f64)
        + 2.0 * 4.0 * value_heads; // A_log, dt_bias (f32 at most)
    let state =
        value_heads * config.linear_key_head_dim as f64 * config.linear_value_head_dim as f64 * 4.0; // fp32
    let conv_state = (config.linear_conv_kernel_dim as f64 - 1.0) * conv_dim * 2.0;

    StepBytes {
        experts: layers * distinct * q(expert),
        shared_and_router: layers * (q(shared) + bf16(router)),
        attention: full_layers * attention,
        gdn_projections: gdn_layers * gdn,
        norms: bf16((2.0 * layers + 1.0) * h),
        lm_head_and_embeddings: bf16(config.vocab_size as f64 * h) + bf16(tokens as f64 * h),
        kv_cache: full_layers
            * step.batch as f64
            * step.context as f64
            * kv
            * step.kv_element_bytes as f64,
        gdn_state: gdn_layers * step.batch as f64 * 2.0 * (state + conv_state),
    }
}

/// Bytes one MTP draft step reads for `step.batch` sequences (one row each; `step.rows` is not
/// read): `mtp.fc`, one gated-attention MoE layer (all bf16: MTP is never quantised), its norms,
/// its KV over `step.context` (in the step's KV format), and the shared lm_head.
pub fn draft_bytes(config: &ModelConfig, step: Step) -> f64 {
    if config.mtp_num_hidden_layers == 0 {
        return 0.0;
    }
    let mut single = config.clone();
    single.layer_types = vec![LayerKind::FullAttention];
    let layer = step_bytes(&single, Precision::Bf16, Step { rows: 1, ..step });
    let h = config.hidden_size as f64;
    let fc = 2.0 * (2.0 * h) * h;
    let norms = 2.0 * 3.0 * h;
    config.mtp_num_hidden_layers as f64 * (layer.total() - layer.norms) + fc + norms
}

/// Bytes one speculative step reads: the target forward over `step.rows` = n + 1 rows per
/// sequence ([`step_bytes`]) and the n MTP draft steps ([`draft_bytes`]).
pub fn speculative_step_bytes(config: &ModelConfig, precision: Precision, step: Step) -> f64 {
    let drafts = step.rows.saturating_sub(1);
    step_bytes(config, precision, step).total() + drafts as f64 * draft_bytes(config, step)
}

/// Expected tokens a target forward yields with `n` drafts accepted i.i.d. with probability
/// `acceptance`: `(1 - a^(n + 1)) / (1 - a)` (`n + 1` at a = 1).
pub fn tokens_per_forward(n: usize, acceptance: f64) -> f64 {
    if (1.0 - acceptance).abs() < 1e-12 {
        return (n + 1) as f64;
    }
    (1.0 - acceptance.powi(n as i32 + 1)) / (1.0 - acceptance)
}

/// `ms = fixed + per_row * rows`, fitted by least squares.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RowFit {
    /// Cost of a forward independent of its rows, ms.
    pub fixed_ms: f64,
    /// Cost of each verify row, ms.
    pub per_row_ms: f64,
}

impl RowFit {
    /// Fits `(rows, ms)` points.
    ///
    /// # Errors
    /// [`Error::Invalid`] with fewer than two distinct row counts or a non-finite value.
    pub fn fit(points: &[(f64, f64)]) -> Result<Self> {
        if points.iter().any(|(r, m)| !r.is_finite() || !m.is_finite()) {
            return Err(Error::invalid(
                "fit points",
                "every rows and ms value must be a finite number",
            ));
        }
        let n = points.len() as f64;
        let mean_r = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_m = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mean_r).powi(2)).sum();
        if points.len() < 2 || sxx == 0.0 {
            return Err(Error::invalid(
                "fit points",
                "need at least two different row counts",
            ));
        }
        let sxy: f64 = points.iter().map(|p| (p.0 - mean_r) * (p.1 - mean_m)).sum();
        let per_row_ms = sxy / sxx;
        Ok(Self {
            fixed_ms: mean_m - per_row_ms * mean_r,
            per_row_ms,
        })
    }

    /// Reads a CSV with header `rows,ms`.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the line of a malformed row or header, else as [`RowFit::fit`].
    pub fn from_csv(text: &str, file: &str) -> Result<Self> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        match lines.next() {
            Some((_, header)) if header.replace(' ', "") == "rows,ms" => {}
            Some((i, header)) => {
                return Err(Error::invalid(
                    format!("{file}:{}", i + 1),
                    format!("header `{header}` is not `rows,ms`"),
                ));
            }
            None => {
                return Err(Error::invalid(
                    file,
                    "empty; expected a `rows,ms` header and points",
                ));
            }
        }
        let mut points = Vec::new();
        for (i, line) in lines {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let parsed = match fields.as_slice() {
                [rows, ms] => rows.parse::<f64>().ok().zip(ms.parse::<f64>().ok()),
                _ => None,
            };
            points.push(parsed.ok_or_else(|| {
                Error::invalid(
                    format!("{file}:{}", i + 1),
                    format!("`{line}` is not `rows,ms` numbers"),
                )
            })?);
        }
        Self::fit(&points).map_err(|e| match e {
            Error::Invalid { what, reason } => Error::invalid(format!("{file}: {what}"), reason),
            other => other,
        })
    }

    /// Predicted forward cost of `rows` rows, ms.
    pub fn ms(&self, rows: usize) -> f64 {
        self.fixed_ms + self.per_row_ms * rows as f64
    }
}

/// A device's memory bandwidth: the vendor peak and the figure measured in the seeds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DevicePreset {
    /// Preset name on the command line.
    pub name: &'static str,
    /// Vendor peak, bytes/s.
    pub peak: f64,
    /// Measured (device copy or the seeds' stream figure), bytes/s.
    pub measured: f64,
}

/// GB10, Strix Halo and H200, from ../shared/reference/kernels.md: the crate's one record of
/// device bandwidths (kernels/targets.toml describes compile targets, and sm_90a is both the
/// H100 and the H200; every bench measures its own ceiling in the run).
pub const DEVICES: [DevicePreset; 3] = [
    DevicePreset {
        name: "gb10",
        peak: 273e9,
        measured: 218e9,
    },
    DevicePreset {
        name: "strix-halo",
        peak: 256e9,
        measured: 224.2 * 1073741824.0,
    },
    DevicePreset {
        name: "h200",
        peak: 4.8e12,
        measured: 4256e9,
    },
];

/// Parses a byte count or a rate: a number (exponents allowed: `4.8e12`) with an optional unit
/// `B`, `kB`, `MB`, `GB`, `TB` (powers of 1000), `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024),
/// optionally followed by `/s`.
///
/// # Errors
/// [`Error::Invalid`] naming `what` for anything else, or a value that is not positive.
pub fn parse_bytes(what: &str, text: &str) -> Result<f64> {
    let trimmed = text.trim();
    let trimmed = trimmed.strip_suffix("/s").unwrap_or(trimmed).trim();
    // the unit starts at the first letter that is not an exponent's `e` (one followed by a digit
    // or a sign)
    let split = trimmed
        .char_indices()
        .find(|&(i, c)| {
            let exponent = matches!(c, 'e' | 'E')
                && i > 0
                && trimmed[i + 1..]
                    .starts_with(|d: char| d.is_ascii_digit() || d == '+' || d == '-');
            c.is_ascii_alphabetic() && !exponent
        })
        .map_or(trimmed.len(), |(i, _)| i);
    let (number, unit) = trimmed.split_at(split);
    let scale = match unit.trim() {
        "" | "B" => 1.0,
        "kB" | "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1048576.0,
        "GiB" => 1073741824.0,
        "TiB" => 1099511627776.0,
        other => {
            return Err(Error::invalid(
                what,
                format!(
                    "unknown unit `{other}` in `{text}` (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
                ),
            ));
        }
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * scale),
        _ => Err(Error::invalid(
            what,
            format!("`{text}` is not a positive amount"),
        )),
    }
}
