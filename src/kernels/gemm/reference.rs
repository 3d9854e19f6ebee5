//! CPU reference of the `gemm` family.

use crate::formats::nvfp4::Nvfp4View;
use half::bf16;

/// `Y[M, N] = X[M, K] * dequant(W[N, K])^T` with f64 accumulation, before the final bf16
/// rounding (tests compare against this unrounded value). `x` is row-major `[m, w.cols]`.
pub fn nvfp4_gemm_f32(x: &[bf16], m: usize, w: Nvfp4View<'_>) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let mut y = vec![0.0f32; m * n];
    let mut w_row = vec![0.0f64; k];
    for col in 0..n {
        for (c, slot) in w_row.iter_mut().enumerate() {
            *slot = w.value(col, c) as f64;
        }
        for row in 0..m {
            let x_row = &x[row * k..(row + 1) * k];
            let dot: f64 = x_row.iter().zip(&w_row).map(|(a, b)| a * b).sum();
            y[row * n + col] = dot as f32;
        }
    }
    y
}

/// [`nvfp4_gemm_f32`] rounded to bf16: what the kernels return.
pub fn nvfp4_gemm(x: &[bf16], m: usize, w: Nvfp4View<'_>) -> Vec<bf16> {
    nvfp4_gemm_f32(x, m, w)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}
