//! Family `norm`: the zero-centred RMSNorm of Qwen3.5-MoE (`x * rsqrt(mean(x^2) + eps) * (1 + w)`,
//! the layer norms and the final norm) fused with the residual add
//! (`kernels/templates/norm.cu`). The residual stream stays f32; the normed output is bf16, what
//! the GEMMs read. Bytes moved per row: the residual read (and written when a delta is added),
//! the delta read, the output written.

pub mod reference;

use super::{check_len, check_u32};
use crate::backend::{Backend, DeviceVec};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "norm";
/// `residual += delta; out = rmsnorm(residual) * (1 + w)`, one block per row.
pub const KERNEL_RMS_NORM_RESIDUAL: &str = "rms_norm_residual";

/// For each of the `rows` rows of `residual` (`[rows][weight.len()]`, f32): adds `delta` (bf16,
/// same shape) when given, then writes `out = bf16(rmsnorm(residual) * (1 + weight))`.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with `rows` and the weight's length,
/// [`Error::BackendMismatch`] when buffers live elsewhere, [`Error::Compile`] /
/// [`Error::Cuda`] from the CUDA path.
pub fn rms_norm_residual(
    backend: &Backend,
    residual: &mut DeviceVec<f32>,
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
        // Transitional: this family still launches through cudarc; it runs on HIP once it
        // moves onto Backend::launch.
        Backend::Hip(_) => Err(backend.no_launch_yet(FAMILY)),
        Backend::Cuda(cuda) => {
            let (DeviceVec::Cuda(r), DeviceVec::Cuda(w), DeviceVec::Cuda(o)) =
                (&mut *residual, weight, &mut *out)
            else {
                return Err(backend.mismatch("norm buffers", residual));
            };
            let dim32 = check_u32("norm width", dim)?;
            let grid = u32::try_from(rows)
                .ok()
                .filter(|&g| g < i32::MAX as u32)
                .ok_or_else(|| Error::invalid("norm rows", format!("{rows} rows in one launch")))?;
            let function = cuda.function(FAMILY, KERNEL_RMS_NORM_RESIDUAL)?;
            let config = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (cuda.target().norm.threads_per_block, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = cuda.stream().launch_builder(&function);
            launch.arg(r);
            let no_delta: u64 = 0;
            match delta {
                Some(DeviceVec::Cuda(d)) => launch.arg(d),
                Some(other) => return Err(backend.mismatch("norm delta", other)),
                None => launch.arg(&no_delta),
            };
            launch.arg(w).arg(&eps).arg(o).arg(&dim32);
            // SAFETY: argument order and types match norm.cu; every buffer holds rows * dim
            // elements (checked above) and the kernel indexes row < rows, i < dim only; a null
            // delta is a 64-bit zero in the pointer's place.
            unsafe { launch.launch(config) }.map_err(|e| {
                Error::cuda(format!("launch {KERNEL_RMS_NORM_RESIDUAL} on {shape}"), e)
            })?;
            Ok(())
        }
    }
}
