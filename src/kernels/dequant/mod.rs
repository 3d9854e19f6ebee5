//! Family `dequant`: an NVFP4 matrix expanded to bf16 (`kernels/templates/dequant.cu`).
//! Bytes moved: `rows * cols * (1/2 + 1/16)` read, `rows * cols * 2` written.

pub mod reference;

use super::{Nvfp4Weights, check_len};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::formats::nvfp4::BLOCK;
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "dequant";
/// NVFP4 -> bf16, one thread per 16-element block.
pub const KERNEL_DEQUANT_NVFP4_BF16: &str = "dequant_nvfp4_bf16";

/// Writes `dequant(w)` into `out` (bf16, `[w.rows, w.cols]` row-major).
///
/// # Errors
/// [`Error::Invalid`] when `out` or the weights' buffers have the wrong length, [`Error::BackendMismatch`] when the
/// buffers live elsewhere, [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from a device
/// backend.
pub fn dequant_nvfp4(backend: &Backend, w: &Nvfp4Weights, out: &mut DeviceVec<bf16>) -> Result<()> {
    let shape = format!("[{}, {}]", w.rows, w.cols);
    w.check()?;
    check_len("dequant output", out, w.rows * w.cols, &shape)?;
    match backend {
        Backend::Cpu => {
            let view = w
                .host_view()
                .ok_or_else(|| backend.mismatch("NVFP4 weights", &w.packed))?;
            let DeviceVec::Host(out) = out else {
                return Err(backend.mismatch("dequant output", out));
            };
            *out = reference::dequant_nvfp4_bf16(view);
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("NVFP4 weights", &w.packed))?;
            let blocks = (w.rows * w.cols / BLOCK) as u64;
            if blocks == 0 {
                return Ok(());
            }
            let threads = target.dequant.threads_per_block;
            let grid = blocks.div_ceil(threads as u64);
            let grid = u32::try_from(grid)
                .ok()
                .filter(|&g| g <= LaunchDims::MAX_GRID_X)
                .ok_or_else(|| {
                    Error::invalid(
                        "dequant input",
                        format!("{shape} needs {grid} blocks, more than a launch allows"),
                    )
                })?;
            let args = [
                KernelArg::input(&w.packed),
                KernelArg::input(&w.scales),
                KernelArg::f32(w.global_scale),
                KernelArg::output(out),
                KernelArg::u64(blocks),
            ];
            // SAFETY: the arguments are dequant.cu's parameters in order; the buffer lengths
            // were checked above against the block count the kernel indexes.
            unsafe {
                backend.launch(
                    FAMILY,
                    KERNEL_DEQUANT_NVFP4_BF16,
                    &LaunchDims::linear(grid, threads),
                    &args,
                )
            }
        }
    }
}
