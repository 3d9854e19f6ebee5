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
/// [`Error::Cuda`] from the CUDA path.
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
    let stream = ResidualStream::InPlace(residual);
    norm_rows(backend, stream, written_by, delta, weight, eps, out, rows)
}

/// [`rms_norm_residual`] with the sum going to another buffer: `residual_out = residual +
/// delta` (or a copy of `residual` without one), `residual` left as it was; the norm is
/// `residual_out`'s. The layer whose MoE route launch cannot take the post-attention norm runs
/// this in its place (`moe::moe_block_after_norm`), with no copy ahead of it.
///
/// # Errors
/// As [`rms_norm_residual`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_residual_to(
    backend: &Backend,
    residual: &DeviceVec<f32>,
    written_by: ResidualWriter,
    delta: Option<&DeviceVec<bf16>>,
    weight: &DeviceVec<f32>,
    eps: f32,
    residual_out: &mut DeviceVec<f32>,
    out: &mut DeviceVec<bf16>,
    rows: usize,
) -> Result<()> {
    let stream = ResidualStream::To {
        from: residual,
        to: residual_out,
    };
    norm_rows(backend, stream, written_by, delta, weight, eps, out, rows)
}

/// Where a norm reads the residual stream and leaves it with the delta added.
enum ResidualStream<'a> {
    /// In place.
    InPlace(&'a mut DeviceVec<f32>),
    /// From one buffer to another.
    To {
        from: &'a DeviceVec<f32>,
        to: &'a mut DeviceVec<f32>,
    },
}

/// [`rms_norm_residual`] and [`rms_norm_residual_to`].
#[allow(clippy::too_many_arguments)]
fn norm_rows(
    backend: &Backend,
    stream: ResidualStream<'_>,
    written_by: ResidualWriter,
    delta: Option<&DeviceVec<bf16>>,
    weight: &DeviceVec<f32>,
    eps: f32,
    out: &mut DeviceVec<bf16>,
    rows: usize,
) -> Result<()> {
    let dim = weight.len();
    let shape = format!("[{rows}, {dim}]");
    match &stream {
        ResidualStream::InPlace(residual) => {
            check_len("norm residual", residual, rows * dim, &shape)?
        }
        ResidualStream::To { from, to } => {
            check_len("norm residual", from, rows * dim, &shape)?;
            check_len("norm residual out", to, rows * dim, &shape)?;
        }
    }
    check_len("norm output", out, rows * dim, &shape)?;
    if let Some(delta) = delta {
        check_len("norm delta", delta, rows * dim, &shape)?;
    }
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let r = match stream {
                ResidualStream::InPlace(r) => r,
                ResidualStream::To { from, to } => {
                    backend.copy(from, to)?;
                    to
                }
            };
            let (DeviceVec::Host(r), DeviceVec::Host(w), DeviceVec::Host(o)) =
                (&mut *r, weight, &mut *out)
            else {
                return Err(backend.mismatch("norm buffers", r));
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
                .ok_or_else(|| backend.mismatch("norm output", out))?;
            let dim32 = check_u32("norm width", dim)?;
            let grid = u32::try_from(rows)
                .ok()
                .filter(|&g| g < i32::MAX as u32)
                .ok_or_else(|| Error::invalid("norm rows", format!("{rows} rows in one launch")))?;
            let dims = LaunchDims::linear(grid, target.norm.threads_per_block);
            let (residual, residual_out) = match stream {
                ResidualStream::InPlace(r) => (
                    KernelArg::output(r),
                    KernelArg::optional_output::<f32>(None),
                ),
                ResidualStream::To { from, to } => (KernelArg::input(from), KernelArg::output(to)),
            };
            let args = [
                residual,
                KernelArg::optional_input(delta),
                KernelArg::input(weight),
                KernelArg::f32(eps),
                KernelArg::output(out),
                KernelArg::u32(dim32),
                KernelArg::u32(u32::from(written_by == ResidualWriter::Earlier)),
                residual_out,
            ];
            // SAFETY: the arguments are norm.cu's parameters in order; every buffer holds
            // rows * dim elements (checked above) and the kernel indexes row < rows, i < dim
            // only; no delta is the null pointer, which the kernel tests, and so is no
            // residual_out (the sum then goes back to the residual).
            unsafe { backend.launch(FAMILY, KERNEL_RMS_NORM_RESIDUAL, &dims, &args) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// The sum to another buffer leaves the residual as it was and gives the in-place norm's sum
    /// and output; without a delta the out buffer gets a copy.
    #[test]
    fn the_sum_to_another_buffer_is_the_in_place_norm() {
        let (rows, dim) = (3, 40);
        let mut rng = SplitMix64::new(7);
        let residual = rng.normal_vec(rows * dim, 2.0);
        let delta: Vec<bf16> = rng
            .normal_vec(rows * dim, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let weight = DeviceVec::Host(rng.normal_vec(dim, 0.1));
        let cpu = Backend::Cpu;
        for delta in [Some(DeviceVec::Host(delta)), None] {
            let mut in_place = DeviceVec::Host(residual.clone());
            let mut want = DeviceVec::Host(vec![bf16::ZERO; rows * dim]);
            let written = ResidualWriter::Earlier;
            rms_norm_residual(
                &cpu,
                &mut in_place,
                written,
                delta.as_ref(),
                &weight,
                1e-6,
                &mut want,
                rows,
            )
            .expect("in place");
            let from = DeviceVec::Host(residual.clone());
            let mut to = DeviceVec::Host(vec![f32::NAN; rows * dim]);
            let mut got = DeviceVec::Host(vec![bf16::NAN; rows * dim]);
            rms_norm_residual_to(
                &cpu,
                &from,
                written,
                delta.as_ref(),
                &weight,
                1e-6,
                &mut to,
                &mut got,
                rows,
            )
            .expect("to another buffer");
            let host = |v: &DeviceVec<f32>| match v {
                DeviceVec::Host(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                _ => unreachable!("host buffers"),
            };
            assert_eq!(
                host(&from),
                host(&DeviceVec::Host(residual.clone())),
                "residual changed"
            );
            assert_eq!(host(&to), host(&in_place), "the sums differ");
            let (DeviceVec::Host(got), DeviceVec::Host(want)) = (&got, &want) else {
                unreachable!("host buffers")
            };
            assert_eq!(got, want, "the normed rows differ");
        }
    }
}
