//! CPU reference of the `attention` family (../shared/reference/qwen3_5_moe.md, "Gated full
//! attention"): f64 inside, f32 at the interfaces.
//!
//! Layouts (row-major): a query row `[heads][head_dim]`; the KV cache of one sequence
//! `[positions][kv_heads][head_dim]` for keys and for values. Query head `h` reads KV head
//! `h / (heads / kv_heads)`.

/// Head counts and sizes of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Elements per row of the q projection with its output gate: each head's query, then its
    /// gate (`heads * 2 * head_dim`).
    pub fn q_gate_width(&self) -> usize {
        self.heads * 2 * self.head_dim
    }

    /// Elements per row of the k (or the v) projection and per cached position: each KV head's
    /// key (`kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements per row of the layer's projections side by side, `[q_gate | k | v]`.
    pub fn projection_width(&self) -> usize {
        self.q_gate_width() + 2 * self.kv_width()
    }
}

/// RoPE inverse frequencies for `rotary_dim` rotated dimensions: `theta^(-2j / rotary_dim)` for
/// `j < rotary_dim / 2`, computed in f32 as transformers does (the angles then follow its
/// rounding).
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32))
        .collect()
}

/// Rotates the first `2 * inv_freq.len()` dimensions of every `head_dim`-wide head of `x` by
/// `position` (NeoX `rotate_half` pairing: dimension `j` with `j + rotary_dim / 2`); the other
/// dimensions pass through.
pub fn apply_rope(x: &mut [f32], head_dim: usize, position: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (j, &f) in inv_freq.iter().enumerate() {
            let angle = (position as f32 * f) as f64;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[j] as f64, head[j + half] as f64);
            head[j] = (a * cos - b * sin) as f32;
            head[j + half] = (b * cos + a * sin) as f32;
        }
    }
}

/// Attention of one query row (`[heads][head_dim]`, already normed and rotated) over the first
/// `len` positions of a sequence's cache, scale `1/sqrt(head_dim)`: returns `[heads][head_dim]`.
pub fn attend(
    shape: AttentionShape,
    query: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
) -> Vec<f32> {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0f32; heads * head_dim];
    let mut scores = vec![0.0f64; len];
    for h in 0..heads {
        let kv = h / group;
        let q = &query[h * head_dim..(h + 1) * head_dim];
        for (p, score) in scores.iter_mut().enumerate() {
            let k = &keys[(p * kv_heads + kv) * head_dim..][..head_dim];
            *score = q
                .iter()
                .zip(k)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                * scale;
        }
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        for d in 0..head_dim {
            let mut acc = 0.0f64;
            for (p, &w) in scores.iter().enumerate() {
                acc += w * values[(p * kv_heads + kv) * head_dim + d] as f64;
            }
            out[h * head_dim + d] = (acc / total) as f32;
        }
    }
    out
}
