//! Family `gemm`: `Y[M, N] = X[M, K] (bf16) * dequant(W[N, K])^T`, fp32 accumulation, bf16 out
//! (`kernels/templates/gemm.cu`).
//!
//! Kernels so far: `gemm_nvfp4_bf16_gemv`, the straightforward one (one warp per output column).
//! The bytes a GEMM must move at least are [`nvfp4_gemm_bytes`]; benches report achieved
//! bandwidth against that.

pub mod reference;

use super::{Nvfp4Weights, check_len, check_u32};
use crate::backend::{Backend, DeviceVec};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "gemm";
/// The straightforward NVFP4 x bf16 kernel: one warp per output column.
pub const KERNEL_GEMM_NVFP4_BF16_GEMV: &str = "gemm_nvfp4_bf16_gemv";

/// The fewest bytes `Y = X * dequant(W)^T` can move: W's packed nibbles and scales, X and Y
/// each once.
pub fn nvfp4_gemm_bytes(m: usize, w: &Nvfp4Weights) -> u64 {
    w.bytes() + 2 * (m * w.cols) as u64 + 2 * (m * w.rows) as u64
}

/// Computes `y = x * dequant(w)^T` for `m` rows: `x` is bf16 `[m, w.cols]`, `y` bf16
/// `[m, w.rows]`, both row-major. `m == 0` does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shapes or a dimension exceeds
/// the kernels' range, [`Error::BackendMismatch`] when buffers live elsewhere,
/// [`Error::Compile`] / [`Error::Cuda`] from the CUDA path.
pub fn nvfp4_gemm(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Nvfp4Weights,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    check_len("gemm input X", x, m * k, &format!("[{m}, {k}]"))?;
    check_len("gemm output Y", y, m * n, &format!("[{m}, {n}]"))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let view = w
                .host_view()
                .ok_or_else(|| backend.mismatch("NVFP4 weights", &w.packed))?;
            let DeviceVec::Host(x) = x else {
                return Err(backend.mismatch("gemm input X", x));
            };
            let DeviceVec::Host(y) = y else {
                return Err(backend.mismatch("gemm output Y", y));
            };
            *y = reference::nvfp4_gemm(x, m, view);
            Ok(())
        }
        Backend::Cuda(cuda) => {
            let (DeviceVec::Cuda(packed), DeviceVec::Cuda(scales)) = (&w.packed, &w.scales) else {
                return Err(backend.mismatch("NVFP4 weights", &w.packed));
            };
            let DeviceVec::Cuda(x) = x else {
                return Err(backend.mismatch("gemm input X", x));
            };
            let DeviceVec::Cuda(y) = y else {
                return Err(backend.mismatch("gemm output Y", y));
            };
            let tiles = &cuda.target().gemm;
            let (m32, n32, k32) = (
                check_u32("gemm M", m)?,
                check_u32("gemm N", n)?,
                check_u32("gemm K", k)?,
            );
            let grid_y = m32.div_ceil(tiles.rows_per_pass);
            if grid_y > 65535 {
                return Err(Error::invalid(
                    "gemm M",
                    format!("{m} rows need {grid_y} row passes; at most 65535 per launch"),
                ));
            }
            let config = LaunchConfig {
                grid_dim: (n32.div_ceil(tiles.warps_per_block), grid_y, 1),
                block_dim: (tiles.warps_per_block * cuda.target().warp_size, 1, 1),
                shared_mem_bytes: 0,
            };
            let function = cuda.function(FAMILY, KERNEL_GEMM_NVFP4_BF16_GEMV)?;
            let mut launch = cuda.stream().launch_builder(&function);
            launch
                .arg(x)
                .arg(packed)
                .arg(scales)
                .arg(&w.global_scale)
                .arg(y)
                .arg(&m32)
                .arg(&n32)
                .arg(&k32);
            // SAFETY: argument types and order match gemm.cu's signature; X, Y and W lengths were
            // checked against (m, n, k) above, which is all the kernel indexes.
            unsafe { launch.launch(config) }.map_err(|e| {
                Error::cuda(
                    format!("launch {KERNEL_GEMM_NVFP4_BF16_GEMV} M={m} N={n} K={k}"),
                    e,
                )
            })?;
            Ok(())
        }
    }
}
