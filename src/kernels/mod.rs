//! Kernel families. Each family lives in one place: its template
//! (`kernels/templates/<family>.cu`), its folder here (`mod.rs`: the typed launch API and shape
//! validation; `reference.rs`: the CPU reference, the oracle of every test), its tests and, for
//! the families with a cost of their own to show (gemm, moe, gdn, attention, verify), its bench,
//! named alike. Callers pass a [`Backend`] and never see the
//! target.

pub mod attention;
pub mod chain;
pub mod check;
pub mod compare;
pub mod dequant;
pub mod gdn;
pub mod gemm;
#[cfg(test)]
mod launch_check;
pub mod moe;
pub mod norm;
pub mod table;
pub mod tokens;
pub mod verify;

use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::formats::nvfp4::{BLOCK, Nvfp4Matrix, Nvfp4View};
use half::bf16;

/// Whether `packed_len` and `scales_len` are what an NVFP4 `[rows, cols]` needs (K a multiple
/// of 16, rows * cols / 2 packed bytes, rows * cols / 16 scales).
fn check_nvfp4_lengths(
    what: &str,
    rows: usize,
    cols: usize,
    packed_len: usize,
    scales_len: usize,
) -> Result<()> {
    let elements = rows.checked_mul(cols);
    let fits = elements
        .is_some_and(|e| cols % BLOCK == 0 && packed_len == e / 2 && scales_len == e / BLOCK);
    if fits {
        return Ok(());
    }
    let need = |per: usize| elements.map_or("more than memory".into(), |e| (e / per).to_string());
    Err(Error::invalid(
        what,
        format!(
            "[{rows}, {cols}] needs K % 16 == 0, {} packed bytes and {} scales; has {packed_len} \
             and {scales_len}",
            need(2),
            need(BLOCK)
        ),
    ))
}

/// An NVFP4 matrix resident on a backend, in the plain row-major layout of [`Nvfp4Matrix`].
pub struct Nvfp4Weights {
    /// Rows (N).
    pub rows: usize,
    /// Columns (K), a multiple of 16.
    pub cols: usize,
    /// Packed nibbles, `rows * cols / 2` bytes.
    pub packed: DeviceVec<u8>,
    /// E4M3 block scales, `rows * cols / 16` bytes.
    pub scales: DeviceVec<u8>,
    /// Per-tensor multiplier.
    pub global_scale: f32,
}

impl Nvfp4Weights {
    /// Copies `matrix` to `backend`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the matrix's buffers disagree with its shape, [`Error::Cuda`] /
    /// [`Error::Hip`] when the copy fails.
    pub fn upload(backend: &Backend, matrix: &Nvfp4Matrix) -> Result<Self> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        check_nvfp4_lengths(
            "NVFP4 matrix",
            rows,
            cols,
            matrix.packed.len(),
            matrix.scales.len(),
        )?;
        Ok(Self {
            rows,
            cols,
            packed: backend.upload(&matrix.packed)?,
            scales: backend.upload(&matrix.scales)?,
            global_scale: matrix.global_scale,
        })
    }

    /// Checks that the buffers hold what `rows` and `cols` say (the fields are public: a caller
    /// may have built or changed them), before a kernel reads `rows * cols` elements of them.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the lengths found and needed.
    pub fn check(&self) -> Result<()> {
        check_nvfp4_lengths(
            "NVFP4 weights",
            self.rows,
            self.cols,
            self.packed.len(),
            self.scales.len(),
        )
    }

    /// The host view, when the weights live on the CPU backend.
    pub(crate) fn host_view(&self) -> Option<Nvfp4View<'_>> {
        match (&self.packed, &self.scales) {
            (DeviceVec::Host(packed), DeviceVec::Host(scales)) => Some(Nvfp4View {
                rows: self.rows,
                cols: self.cols,
                packed,
                scales,
                global_scale: self.global_scale,
            }),
            _ => None,
        }
    }

    /// Bytes a kernel must read to consume the matrix once (packed nibbles + scales).
    pub fn bytes(&self) -> u64 {
        (self.packed.len() + self.scales.len()) as u64
    }
}

/// Checks a buffer's length against the shape a kernel expects.
pub(crate) fn check_len<T>(
    what: &str,
    buffer: &DeviceVec<T>,
    expected: usize,
    shape: &str,
) -> Result<()> {
    if buffer.len() != expected {
        return Err(Error::invalid(
            what,
            format!(
                "{} elements, expected {expected} for shape {shape}",
                buffer.len()
            ),
        ));
    }
    Ok(())
}

/// Checks a dimension fits the kernels' 32-bit indices.
pub(crate) fn check_u32(what: &str, value: usize) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| Error::invalid(what, format!("{value} exceeds the kernels' 32-bit range")))
}

/// `count` `items` (rows, sequences, row passes) as a launch's grid y: at most
/// [`LaunchDims::MAX_GRID_YZ`] of them, else an [`Error::Invalid`] naming `what`.
pub(crate) fn check_grid_y(what: &str, count: u32, items: &str) -> Result<()> {
    if count > LaunchDims::MAX_GRID_YZ {
        return Err(Error::invalid(
            what,
            format!(
                "{count} {items} in one launch (at most {})",
                LaunchDims::MAX_GRID_YZ
            ),
        ));
    }
    Ok(())
}

/// Rows of a bf16 matrix inside a buffer: element (row, col) at `offset + row * stride + col`.
/// What a kernel reads where one GEMM wrote several projections side by side (the Gated DeltaNet
/// `[qkv; z; b; a]`, an attention layer's `[q_gate; k; v]`), or a matrix of its own
/// ([`Bf16Rows::packed`]).
#[derive(Clone, Copy)]
pub struct Bf16Rows<'a> {
    /// The buffer.
    pub data: &'a DeviceVec<bf16>,
    /// Elements before row 0's first column.
    pub offset: usize,
    /// Elements from one row to the next.
    pub stride: usize,
}

impl<'a> Bf16Rows<'a> {
    /// A matrix whose rows are `width` elements, back to back.
    pub fn packed(data: &'a DeviceVec<bf16>, width: usize) -> Self {
        Self {
            data,
            offset: 0,
            stride: width,
        }
    }

    /// Checks that `rows` rows of `width` elements lie inside the buffer (`what` names them in
    /// the error); `aligned`: the kernel reads them with 16-byte loads.
    pub(crate) fn check(&self, what: &str, rows: usize, width: usize, aligned: bool) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let need = self.offset + (rows - 1) * self.stride + width;
        if self.stride < width || self.data.len() < need {
            return Err(Error::invalid(
                what,
                format!(
                    "{rows} rows of {width} at offset {} stride {} need {need} elements; the buffer has {}",
                    self.offset,
                    self.stride,
                    self.data.len()
                ),
            ));
        }
        if aligned && (self.offset % 8 != 0 || self.stride % 8 != 0) {
            return Err(Error::invalid(
                what,
                format!(
                    "offset {} and stride {} must be multiples of 8 (16-byte loads)",
                    self.offset, self.stride
                ),
            ));
        }
        Ok(())
    }

    /// The first `width` elements of each row in `rows` as f32, row after row, for a CPU
    /// reference (`what` names them when the buffer is not on the host).
    pub(crate) fn host_rows(
        &self,
        what: &str,
        rows: std::ops::Range<usize>,
        width: usize,
    ) -> Result<Vec<f32>> {
        let DeviceVec::Host(v) = self.data else {
            return Err(Backend::Cpu.mismatch(what, self.data));
        };
        Ok(rows
            .flat_map(|r| {
                v[self.offset + r * self.stride..][..width]
                    .iter()
                    .map(|x| x.to_f32())
            })
            .collect())
    }

    /// The rows as a kernel argument: the address of row 0 (the buffer from `offset` on).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `offset` is past the buffer.
    pub(crate) fn arg(&self) -> Result<KernelArg<'a>> {
        KernelArg::input_range(self.data, self.offset..self.data.len())
    }
}
