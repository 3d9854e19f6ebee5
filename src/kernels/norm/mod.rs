//! Family `norm`: the zero-centred RMSNorm of Qwen3.5-MoE (`x * rsqrt(mean(x^2) + eps) * (1 + w)`,
//! the layer norms and the final norm) fused with the residual add
//! (`kernels/templates/norm.cu`). The residual stream stays f32; the normed output is bf16, what
//! the GEMMs read. Bytes moved per row: the residual read (and written when a delta is added),
//! the delta read, the output written.

pub mod reference;

use super::{check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "norm";
/// `residual += delta; out = rmsnorm(residual) * (1 + w)`, one block per row.
pub const KERNEL_RMS_NORM_RESIDUAL: &str = "rms_norm_residual";

/// Which launch last wrote the residual stream a norm reads, counted back from the norm. Kernels
/// chain with programmatic dependent launch (`kernels/templates/common/prelude.cuh`): a kernel may
/// read before its wait what only kernels two or more launches back wrote, so a residual that
/// the previous kernel did not write is loaded while that kernel finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidualWriter {
    /// The kernel launched just before the norm (the embedding gather): read after the wait.
    PreviousKernel,
    /// An earlier kernel, or a copy or fill (which the norm's launch waits for in full).
    Earlier,
}

/// For each of the `rows` rows of `residual` (`[rows][weight.len()]`, f32): adds `delta` (bf16,
/// same shape) when given, then writes `out = bf16(rmsnorm(residual) * (1 + weight))`.
/// `written_by` says which launch last wrote `residual`: naming [`ResidualWriter::Earlier`] when
/// the previous kernel wrote it is a data race on the GPU.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with `rows` and the weight's length,
/// [`Error::BackendMismatch`] when buffers live elsewhere, [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`] from a device backend.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_residual(
    backend: &Backend,
    residual: &mut DeviceVec<f32>,
    written_by: ResidualWriter,
    delta: Option<&DeviceVec<bf16>>,
    weight: &DeviceVec<f32>,
    eps: f32,
    out: &mut DeviceVec<bf16>,
    rows: usize,
) -> Result<()> {
    let dim = weight.len();
    let shape = format!("[{rows}, {dim}]");
    check_len("norm residual", residual, rows * dim, &shape)?;
    check_len("norm output", out, rows * dim, &shape)?;
    if let Some(delta) = delta {
        check_len("norm delta", delta, rows * dim, &shape)?;
    }
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(r), DeviceVec::Host(w), DeviceVec::Host(o)) =
                (&mut *residual, weight, &mut *out)
            else {
                return Err(backend.mismatch("norm buffers", residual));
            };
            if let Some(delta) = delta {
                let DeviceVec::Host(d) = delta else {
                    return Err(backend.mismatch("norm delta", delta));
                };
                r.iter_mut().zip(d).for_each(|(r, d)| *r += d.to_f32());
            }
            let normed = reference::rms_norm(r, w, f64::from(eps));
            *o = normed.into_iter().map(bf16::from_f32).collect();
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("norm residual", residual))?;
            let dim32 = check_u32("norm width", dim)?;
            let grid = u32::try_from(rows)
                .ok()
                .filter(|&g| g <= LaunchDims::MAX_GRID_X)
                .ok_or_else(|| Error::invalid("norm rows", format!("{rows} rows in one launch")))?;
            let dims = LaunchDims::linear(grid, target.norm.threads_per_block);
            let args = [
                KernelArg::output(residual),
                KernelArg::optional_input(delta),
                KernelArg::input(weight),
                KernelArg::f32(eps),
                KernelArg::output(out),
                KernelArg::u32(dim32),
                KernelArg::u32(u32::from(written_by == ResidualWriter::Earlier)),
            ];
            // SAFETY: the arguments are norm.cu's parameters in order; every buffer holds
            // rows * dim elements (checked above) and the kernel indexes row < rows, i < dim
            // only; no delta is the null pointer, which the kernel tests.
            unsafe { backend.launch(FAMILY, KERNEL_RMS_NORM_RESIDUAL, &dims, &args) }
        }
    }
}
