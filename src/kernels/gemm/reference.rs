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

/// `Y[M, N] = X[M, K] * W[N, K]^T` for a bf16 weight, f64 accumulation, unrounded.
pub fn bf16_gemm_f32(x: &[bf16], m: usize, w: &[bf16], n: usize, k: usize) -> Vec<f32> {
    let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let mut y = vec![0.0f32; m * n];
    for col in 0..n {
        let w_row: Vec<f64> = w[col * k..(col + 1) * k]
            .iter()
            .map(|v| v.to_f64())
            .collect();
        for row in 0..m {
            let dot: f64 = x[row * k..(row + 1) * k]
                .iter()
                .zip(&w_row)
                .map(|(a, b)| a * b)
                .sum();
            y[row * n + col] = dot as f32;
        }
    }
    y
}

/// `silu(v) = v / (1 + e^-v)`.
pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// The fused `silu(gate) * up` epilogue on an unrounded `[m, 2I]` product whose columns are
/// `[gate; up]`: returns `[m, I]`, unrounded.
pub fn silu_mul(y: &[f32], m: usize, n: usize) -> Vec<f32> {
    let half = n / 2;
    (0..m)
        .flat_map(|row| (0..half).map(move |i| silu(y[row * n + i]) * y[row * n + half + i]))
        .collect()
}

/// The residual epilogue: `y + residual`, unrounded.
pub fn add_residual(y: &[f32], residual: &[bf16]) -> Vec<f32> {
    y.iter()
        .zip(residual)
        .map(|(a, b)| a + b.to_f32())
        .collect()
}
