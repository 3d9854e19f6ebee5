//! CPU reference of the `norm` family: f64 inside, f32 at the interfaces.

/// Zero-centred RMSNorm of every `dim`-wide row of `x`: `x * rsqrt(mean(x^2) + eps) * (1 + w)`.
/// `x.len()` is a multiple of `dim`; `weight` has `dim` entries.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let mean_square = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean_square + eps).sqrt();
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| (v as f64 * inv * (1.0 + w as f64)) as f32),
        );
    }
    out
}
