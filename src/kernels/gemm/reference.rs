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

/// `Y[M, N] = X[M, K] * W[N, K]^T` with f32 activations and weights, f64 accumulation,
/// unrounded: the fp32 path of the model runner's CPU reference.
pub fn f32_gemm(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for (row, x_row) in x.chunks_exact(k).take(m).enumerate() {
        for (col, w_row) in w.chunks_exact(k).take(n).enumerate() {
            let dot: f64 = x_row
                .iter()
                .zip(w_row)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
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

/// The activations of a W4A4 GEMM quantised as the kernels do (`quantize_nvfp4_rows`): NVFP4
/// per 16-element block of each row with `input_scale` as the per-tensor scale.
///
/// # Errors
/// [`crate::Error::Invalid`] for a NaN or infinite activation, K not a multiple of 16, or an
/// `input_scale` that is not positive and finite.
pub fn quantize_activations(
    x: &[bf16],
    m: usize,
    k: usize,
    input_scale: f32,
) -> crate::Result<crate::formats::nvfp4::Nvfp4Matrix> {
    let values: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    crate::formats::nvfp4::Nvfp4Matrix::quantize_with_global_scale(
        "W4A4 activations",
        &values,
        m,
        k,
        input_scale,
    )
}

/// Emulates the W4A4 kernels exactly (`gemm_nvfp4_nvfp4_mma_*`): X quantised per block with
/// `input_scale`, then per 16-block the product of e2m1 codes times both e4m3 block scales,
/// summed, times `alpha = input_scale * weight_scale_2`. Unrounded (f64 accumulation; the
/// hardware adds in fp32 in its own order).
///
/// # Errors
/// As [`quantize_activations`].
pub fn nvfp4_w4a4_f32(
    x: &[bf16],
    m: usize,
    w: Nvfp4View<'_>,
    input_scale: f32,
) -> crate::Result<Vec<f32>> {
    use crate::formats::nvfp4::{BLOCK, e2m1_decode, e4m3_decode};
    let (n, k) = (w.rows, w.cols);
    let xq = quantize_activations(x, m, k, input_scale)?;
    let unpack = |packed: &[u8], i: usize| {
        if i % 2 == 0 {
            packed[i / 2] & 0xf
        } else {
            packed[i / 2] >> 4
        }
    };
    let alpha = f64::from(input_scale) * f64::from(w.global_scale);
    let mut y = vec![0.0f32; m * n];
    for row in 0..m {
        for col in 0..n {
            let mut acc = 0.0f64;
            for block in 0..k / BLOCK {
                let sx = f64::from(e4m3_decode(xq.scales[row * (k / BLOCK) + block]));
                let sw = f64::from(e4m3_decode(w.scales[col * (k / BLOCK) + block]));
                let dot: f64 = (block * BLOCK..(block + 1) * BLOCK)
                    .map(|c| {
                        f64::from(e2m1_decode(unpack(&xq.packed, row * k + c)))
                            * f64::from(e2m1_decode(unpack(w.packed, col * k + c)))
                    })
                    .sum();
                acc += dot * sx * sw;
            }
            y[row * n + col] = (acc * alpha) as f32;
        }
    }
    Ok(y)
}
