//! Family `gemm`: `Y[M, N] = X[M, K] (bf16) * W[N, K]^T` for NVFP4 and bf16 weights, fp32
//! accumulation, bf16 out (`kernels/templates/gemm.cu`).
//!
//! Kernels, by the target's instructions ([`TensorCore`]; every launch goes through
//! [`Backend::launch`], so CUDA and HIP run the same code here):
//! - `gemm_nvfp4_bf16_gemv` (all): the straightforward one (one warp per output column, plain
//!   layout, no tensor cores), kept as the reference GPU version: [`nvfp4_gemm`].
//! - `gemm_{nvfp4,bf16}_bf16_mma_m{8,16,32,48,64}` (mma.sync: sm_90a, sm_121a): the
//!   weight-streaming tensor-core kernels on `mma.sync.m16n8k16`, on weights re-laid out once at
//!   load ([`layout`]) into a [`Linear`]: [`linear`]. W is the A operand, so M = 1..64 rows cost
//!   1..8 MMAs per weight fragment and the weights are read once whatever M is. Each tile gets
//!   1..8 warps ([`mma_plan`]: the fewest that fill the device; with
//!   `gemm.mma_wave_warps_per_tile`, more while the blocks fit one wave, [`wave_plan`]), K is
//!   split across blocks only when even that does not, and the last block of a tile adds the
//!   splits in order (deterministic). Epilogues: residual add, `silu(gate) * up`
//!   ([`RowOrder::GateUp`]). The variants of at least `gemm.mma_x_shared_min_rows` rows (m48
//!   and m64 on sm_90a and sm_121a) stream X through a `cp.async` ring in shared memory that the
//!   block's warps share ([`mma_x_shared`], [`x_shared_plan`]); the others load X fragments
//!   from global memory per group. On targets with thread block clusters, launches of 2 to
//!   `gemm.mma_x_shared_cluster_max_splits` (X-ring variants) or `gemm.mma_cluster_max_splits`
//!   (the others) K splits make each tile group's splits one cluster, whose blocks add their
//!   sums through each other's shared memory in split order (the same bits) instead of through
//!   the L2 ([`cluster_candidates`]).
//! - `gemm_{nvfp4,bf16}_bf16_wgmma_m64` (`wgmma` and `cp.async`: sm_90a): the m64 product on the
//!   warpgroup MMA, a warpgroup per 64 weight rows, X^T and each warp's weights through
//!   shared-memory rings, in place of the mma.sync m48 / m64 variants from `gemm.wgmma_min_rows`
//!   rows or, above 32 rows, for weights of at least `gemm.wgmma_min_tiles` tiles
//!   ([`mma_wgmma`], [`wgmma_plan`]; on sm_90a only the lm_head: it streams large weights at
//!   the copy bandwidth but runs the model's other shapes about twice as slow as mma.sync,
//!   targets.toml) or per call ([`MmaKernel::Wgmma`]); same weights, arguments and split-K
//!   finish.
//! - `gemm_nvfp4_bf16_stream_m{8,16}` (mma.sync and `cp.async`: sm_90a, sm_121a): the NVFP4
//!   weight stream of the mma kernels with the groups in flight in shared-memory rings (cp.async)
//!   instead of registers and X staged in shared memory once per block, for calls of at most
//!   [`STREAM_MAX_ROWS`] rows; chosen per call with [`MmaKernel`] ([`linear_with`]), not by
//!   default.
//! - `quantize_nvfp4_rows` + `gemm_nvfp4_nvfp4_mma_m{8,16,32}` (sm_121a): W4A4 on the
//!   block-scaled FP4 MMA, chosen per model with [`Nvfp4Mode`]; compiled and emulated here
//!   ([`reference::nvfp4_w4a4_f32`]), not run (no GB10).
//! - `gemm_{nvfp4,bf16}_bf16_wmma_m{16,32,64}` (WMMA: gfx1151): the same product on
//!   `v_wmma_f32_16x16x16_bf16`, on the `Wmma*` layouts of [`layout`], one wave per tile over all
//!   of K (no K split, so the split-K scratch is never used there); compiled and launched through
//!   the same API, not yet run on a gfx1151. W4A4 is refused there (no block-scaled FP4 MMA).
//!
//! Why registers in the default kernels: every weight byte is used by exactly one warp, so a
//! `cp.async` stage through shared memory only adds a copy; each lane's global load is its MMA
//! fragment and `mma_stages_*` (targets.toml) groups stay in flight per warp. Measured on the
//! H200 (BENCHMARKS.md): bf16 weights stream at 92% of the copy bandwidth at M = 1; NVFP4 at
//! 65%, latency-bound with its registers limiting the warps per SM (ncu), which is what the
//! `stream` kernels trade shared memory for. At M = 64 re-reading X per tile from L1 / L2 held
//! the GDN in_proj at 524 GB/s (97 us in a B = 64 decode step); X through shared memory: 45 us
//! (ncu, BENCHMARKS.md, ninth session), still far from its 12 us of weights.
//!
//! The bytes a GEMM must move at least are [`Linear::bytes`]; the GEMM bench reports achieved
//! bandwidth against them.

pub mod layout;
pub mod reference;

pub use layout::{RowOrder, TensorCore};

use super::{Nvfp4Weights, check_grid_y, check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims, SplitKScratch};
use crate::error::{Error, Result};
use crate::formats::nvfp4::Nvfp4Matrix;
use crate::target::{GemmTiles, STREAM_GROUP_BYTES, TargetFacts, wgmma_shared_bytes};
use half::bf16;
use layout::{Bf16Fragments, Nvfp4Fragments, WmmaBf16Fragments, WmmaNvfp4Fragments};
use std::sync::MutexGuard;

/// The family name (template and module).
pub const FAMILY: &str = "gemm";
/// The straightforward NVFP4 x bf16 kernel: one warp per output column.
pub const KERNEL_GEMM_NVFP4_BF16_GEMV: &str = "gemm_nvfp4_bf16_gemv";

/// Computes `y = x * dequant(w)^T` for `m` rows: `x` is bf16 `[m, w.grid.cols]`, `y` bf16
/// `[m, w.grid.rows]`, both row-major. `m == 0` does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shapes or a dimension exceeds
/// the kernels' range, [`Error::BackendMismatch`] when buffers live elsewhere,
/// [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the device path.
pub fn nvfp4_gemm(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Nvfp4Weights,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    w.check()?;
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
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = device_target(backend)?;
            let tiles = &target.gemm;
            let (m32, n32, k32) = (
                check_u32("gemm M", m)?,
                check_u32("gemm N", n)?,
                check_u32("gemm K", k)?,
            );
            let grid_y = m32.div_ceil(tiles.rows_per_pass);
            check_grid_y("gemm M", grid_y, &format!("row passes (of {m} rows)"))?;
            let dims = LaunchDims {
                grid: (n32.div_ceil(tiles.warps_per_block), grid_y, 1),
                block: (tiles.warps_per_block * target.warp_size, 1, 1),
                shared_bytes: 0,
                cluster: (1, 1, 1),
            };
            let args = gemv_arguments(x, w, y, [m32, n32, k32]);
            // SAFETY: gemm_nvfp4_bf16_gemv's parameters in order (gemv_arguments); X, Y and W
            // lengths were checked against (m, n, k) above, which is all the kernel indexes.
            unsafe { backend.launch(FAMILY, KERNEL_GEMM_NVFP4_BF16_GEMV, &dims, &args) }
        }
    }
}

/// `gemm_nvfp4_bf16_gemv`'s arguments in its parameter order (x, packed, scales, global_scale,
/// y, m, n, k).
fn gemv_arguments<'a>(
    x: &'a DeviceVec<bf16>,
    w: &'a Nvfp4Weights,
    y: &'a mut DeviceVec<bf16>,
    [m, n, k]: [u32; 3],
) -> [KernelArg<'a>; 8] {
    [
        KernelArg::input(x),
        KernelArg::input(&w.packed),
        KernelArg::input(&w.scales),
        KernelArg::f32(w.global_scale),
        KernelArg::output(y),
        KernelArg::u32(m),
        KernelArg::u32(n),
        KernelArg::u32(k),
    ]
}

/// The target of a device backend (the CPU backend has none: a device launch was asked of it).
fn device_target(backend: &Backend) -> Result<&'static TargetFacts> {
    backend.target().ok_or_else(|| {
        Error::invalid(
            "gemm launch",
            "the CPU backend runs the references, not device kernels",
        )
    })
}

/// The (N, K) of the Qwen3.6-35B-A3B projections the GEMM is tested and benched on:
/// `in_proj_qkv` / `q_proj` (8192, 2048), `in_proj_z` (4096, 2048), `out_proj` / `o_proj`
/// (2048, 4096), one expert's fused gate_up (1024, 2048), one expert's down (2048, 512), and
/// `in_proj_qkv` with `in_proj_z` fused (12288, 2048).
pub const MODEL_SHAPES: [(usize, usize); 6] = [
    (8192, 2048),
    (4096, 2048),
    (2048, 4096),
    (1024, 2048),
    (2048, 512),
    (12288, 2048),
];

/// Most rows of X one tensor-core launch takes; larger M runs in chunks of this many.
pub const MMA_MAX_ROWS: usize = 64;

/// Rows of the `gemm_*_bf16_mma_m*` variants, smallest first (gemm.cu renders the same list); a
/// launch runs the smallest that holds its rows. Why 48: at M = 33..64 these kernels' time is
/// their MMAs, not their bytes (per block about 0.94 us per round of one K group per warp,
/// whether 8 or 86 blocks run: BENCHMARKS.md, thirty-seventh session), and at M = 33..48 the m64
/// variant spends a quarter or more of its MMAs on zero rows.
pub const MMA_VARIANT_ROWS: [usize; 5] = [8, 16, 32, 48, 64];

/// Most rows of X one W4A4 launch takes (the block-scaled kernels stop at 32).
pub const W4A4_MAX_ROWS: usize = 32;

/// The weight format of a [`Linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// NVFP4 weights, bf16 activations (W4A16: dequantised in registers, bf16 tensor-core math).
    Nvfp4,
    /// NVFP4 weights and NVFP4 activations (W4A4: X quantised with the checkpoint's
    /// `input_scale`, block-scaled FP4 tensor-core math; targets with
    /// `instructions.mma_block_scaled_fp4` only, e.g. sm_121a).
    Nvfp4W4a4,
    /// bf16.
    Bf16,
}

/// How an NVFP4 linear multiplies: the per-model runtime choice between W4A16 and W4A4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Nvfp4Mode {
    /// bf16 activations against dequantised weights (every target).
    #[default]
    W4a16,
    /// NVFP4 activations on the block-scaled FP4 MMA (GB10).
    W4a4,
}

impl std::str::FromStr for Nvfp4Mode {
    type Err = Error;
    /// `w4a16` or `w4a4`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "w4a16" => Ok(Self::W4a16),
            "w4a4" => Ok(Self::W4a4),
            other => Err(Error::invalid(
                "NVFP4 mode",
                format!("`{other}` is not one of w4a16, w4a4"),
            )),
        }
    }
}

/// Which tensor-core kernel runs a call on mma.sync targets: the per-call choice that lets the
/// bench and the tests compare the variants; the library's callers use the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MmaKernel {
    /// The target table's choice: `gemm_{nvfp4,bf16}_bf16_mma_m*` (each lane's groups in flight
    /// in registers), or `gemm_*_wgmma_m64` where [`mma_wgmma`] says so.
    #[default]
    Registers,
    /// NVFP4 W4A16 weights only: `gemm_nvfp4_bf16_stream_m{8,16}`, groups in flight in per-warp
    /// shared-memory rings filled by `cp.async`, X staged in shared memory per block (targets
    /// with `instructions.cp_async`). Calls of more than [`STREAM_MAX_ROWS`] rows run
    /// [`MmaKernel::Registers`]: there re-reading X per tile, not the stream, limits.
    Staged,
    /// `gemm_{nvfp4,bf16}_bf16_wgmma_m64` for every launch, whatever its rows and
    /// `gemm.wgmma_min_rows` (NVFP4 W4A16 and bf16 weights, targets with `wgmma` and `cp.async`).
    Wgmma,
}

/// Most rows of X the `gemm_nvfp4_bf16_stream_m*` kernels take (X is staged in shared memory).
pub const STREAM_MAX_ROWS: usize = 16;

enum LinearStorage {
    HostNvfp4(Nvfp4Matrix),
    HostW4a4 {
        matrix: Nvfp4Matrix,
        input_scale: f32,
    },
    HostBf16(Vec<bf16>),
    /// [`Nvfp4Fragments`] for `gemm_nvfp4_bf16_mma_m*`.
    MmaNvfp4 {
        words: DeviceVec<u32>,
        scales: DeviceVec<u16>,
        global_scale: f32,
    },
    /// [`Bf16Fragments`] for `gemm_bf16_bf16_mma_m*`.
    MmaBf16 {
        words: DeviceVec<u32>,
    },
    /// [`layout::W4a4Fragments`] for `gemm_nvfp4_nvfp4_mma_m*`.
    W4a4 {
        words: DeviceVec<u32>,
        scales: DeviceVec<u32>,
        global_scale: f32,
        input_scale: f32,
    },
    /// [`WmmaNvfp4Fragments`] for `gemm_nvfp4_bf16_wmma_m*`.
    WmmaNvfp4 {
        words: DeviceVec<u32>,
        scales: DeviceVec<u32>,
        global_scale: f32,
    },
    /// [`WmmaBf16Fragments`] for `gemm_bf16_bf16_wmma_m*`.
    WmmaBf16 {
        values: DeviceVec<u16>,
    },
}

impl LinearStorage {
    /// The backend the weights live on (`cpu`, `cuda`, `hip`).
    fn backend_name(&self) -> &'static str {
        match self {
            Self::HostNvfp4(_) | Self::HostW4a4 { .. } | Self::HostBf16(_) => "cpu",
            Self::MmaNvfp4 { words, .. }
            | Self::MmaBf16 { words }
            | Self::W4a4 { words, .. }
            | Self::WmmaNvfp4 { words, .. } => words.backend_name(),
            Self::WmmaBf16 { values } => values.backend_name(),
        }
    }
}

/// A linear layer's weight `W[rows, cols]` on a backend, in the layout its kernels consume:
/// the plain matrix on the CPU; on a device, the [`layout`] fragments of the target's
/// [`TensorCore`] (mma.sync or WMMA).
pub struct Linear {
    format: WeightFormat,
    grid: layout::TileGrid,
    storage: LinearStorage,
}

/// What the GEMM does with `X * W^T` before writing Y.
pub enum Epilogue<'a> {
    /// `Y = X * W^T`.
    None,
    /// `Y = X * W^T + residual` (`residual` is `[m, rows]`, may not alias Y).
    Residual(&'a DeviceVec<bf16>),
    /// For a [`RowOrder::GateUp`] weight: `Y[m, i] = silu(gate_i) * up_i`, `[m, rows / 2]`.
    SiluMul,
}

impl Epilogue<'_> {
    /// The `epilogue` argument of the kernels (EPILOGUE_* in gemm.cu).
    fn kernel_code(&self) -> u32 {
        match self {
            Epilogue::None => 0,
            Epilogue::Residual(_) => 1,
            Epilogue::SiluMul => 2,
        }
    }
}

impl Linear {
    /// The device words a GEMM streams (the fragment words of the mma.sync / WMMA layouts, in
    /// the order the tiles are read first), for an earlier launch to ask the L2 for; None for a
    /// weight held on the host.
    pub fn weight_words(&self) -> Option<&DeviceVec<u32>> {
        match &self.storage {
            LinearStorage::MmaNvfp4 { words, .. }
            | LinearStorage::MmaBf16 { words }
            | LinearStorage::W4a4 { words, .. }
            | LinearStorage::WmmaNvfp4 { words, .. } => Some(words),
            _ => None,
        }
    }

    /// An NVFP4 weight. `row_order` is [`RowOrder::GateUp`] for a `[gate; up]` weight that will
    /// run with [`Epilogue::SiluMul`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for a malformed matrix (buffer lengths, NaN scales, odd gate/up rows)
    /// or a device target without tensor-core kernels, [`Error::Cuda`] / [`Error::Hip`] when the
    /// upload fails.
    pub fn nvfp4(backend: &Backend, matrix: &Nvfp4Matrix, row_order: RowOrder) -> Result<Self> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        if cols == 0
            || cols % 16 != 0
            || matrix.packed.len() != rows * cols / 2
            || matrix.scales.len() != rows * cols / 16
        {
            return Err(Error::invalid(
                "NVFP4 weight",
                format!(
                    "[{rows}, {cols}]: K must be a positive multiple of 16 and the buffers match the shape"
                ),
            ));
        }
        let (grid, storage) = match backend.target().map(TensorCore::for_target).transpose()? {
            None => {
                let fragments = Nvfp4Fragments::new(matrix, row_order)?;
                (fragments.grid, LinearStorage::HostNvfp4(matrix.clone()))
            }
            Some(TensorCore::MmaSync) => {
                let fragments = Nvfp4Fragments::new(matrix, row_order)?;
                let storage = LinearStorage::MmaNvfp4 {
                    words: backend.upload(&fragments.words)?,
                    scales: backend.upload(&fragments.scales)?,
                    global_scale: matrix.global_scale,
                };
                (fragments.grid, storage)
            }
            Some(TensorCore::Wmma) => {
                let fragments = WmmaNvfp4Fragments::new(matrix, row_order)?;
                let storage = LinearStorage::WmmaNvfp4 {
                    words: backend.upload(&fragments.words)?,
                    scales: backend.upload(&fragments.scales)?,
                    global_scale: matrix.global_scale,
                };
                (fragments.grid, storage)
            }
        };
        Ok(Self {
            format: WeightFormat::Nvfp4,
            grid,
            storage,
        })
    }

    /// An NVFP4 weight in `mode`: [`Linear::nvfp4`] for W4A16, [`Linear::nvfp4_w4a4`] for W4A4.
    ///
    /// # Errors
    /// As the constructor `mode` selects.
    pub fn nvfp4_in(
        backend: &Backend,
        matrix: &Nvfp4Matrix,
        row_order: RowOrder,
        mode: Nvfp4Mode,
    ) -> Result<Self> {
        match mode {
            Nvfp4Mode::W4a16 => Self::nvfp4(backend, matrix, row_order),
            Nvfp4Mode::W4a4 => Self::nvfp4_w4a4(backend, matrix, row_order),
        }
    }

    /// An NVFP4 weight for W4A4: activations are quantised to NVFP4 with the matrix's
    /// `input_scale` and multiplied on the block-scaled FP4 tensor cores.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the matrix has no `input_scale`, K is not a multiple of 64, a
    /// block scale is NaN, or the device's target has no block-scaled FP4 MMA (use
    /// [`Nvfp4Mode::W4a16`] there); [`Error::Cuda`] / [`Error::Hip`] when the upload fails.
    pub fn nvfp4_w4a4(
        backend: &Backend,
        matrix: &Nvfp4Matrix,
        row_order: RowOrder,
    ) -> Result<Self> {
        let input_scale = matrix.input_scale.ok_or_else(|| {
            Error::invalid(
                "W4A4 weight",
                "the checkpoint has no input_scale for it: W4A4 needs one (use W4A16)",
            )
        })?;
        let fragments = layout::W4a4Fragments::new(matrix, row_order)?;
        let storage = match backend.target() {
            None => LinearStorage::HostW4a4 {
                matrix: matrix.clone(),
                input_scale,
            },
            Some(target) => {
                if !target.instructions.mma_block_scaled_fp4 {
                    return Err(Error::invalid(
                        "W4A4 weight",
                        format!(
                            "target {} has no block-scaled FP4 MMA; run this model with W4A16",
                            target.name
                        ),
                    ));
                }
                LinearStorage::W4a4 {
                    words: backend.upload(&fragments.words)?,
                    scales: backend.upload(&fragments.scales)?,
                    global_scale: matrix.global_scale,
                    input_scale,
                }
            }
        };
        Ok(Self {
            format: WeightFormat::Nvfp4W4a4,
            grid: fragments.grid,
            storage,
        })
    }

    /// A bf16 weight, row-major `[rows, cols]`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `values` does not match the shape, K is not a positive multiple
    /// of 16, or the device target has no tensor-core kernels; [`Error::Cuda`] / [`Error::Hip`]
    /// when the upload fails.
    pub fn bf16(
        backend: &Backend,
        values: &[bf16],
        rows: usize,
        cols: usize,
        row_order: RowOrder,
    ) -> Result<Self> {
        let (grid, storage) = match backend.target().map(TensorCore::for_target).transpose()? {
            None => {
                let grid = layout::TileGrid::for_bf16(values, rows, cols, row_order)?;
                (grid, LinearStorage::HostBf16(values.to_vec()))
            }
            Some(TensorCore::MmaSync) => {
                let fragments = Bf16Fragments::new(values, rows, cols, row_order)?;
                let storage = LinearStorage::MmaBf16 {
                    words: backend.upload(&fragments.words)?,
                };
                (fragments.grid, storage)
            }
            Some(TensorCore::Wmma) => {
                let fragments = WmmaBf16Fragments::new(values, rows, cols, row_order)?;
                let storage = LinearStorage::WmmaBf16 {
                    values: backend.upload(&fragments.values)?,
                };
                (fragments.grid, storage)
            }
        };
        Ok(Self {
            format: WeightFormat::Bf16,
            grid,
            storage,
        })
    }

    /// A second copy of the weight on the same backend (device to device on a device): a layer
    /// of its own with the same values, e.g. to give every layer of a synthetic model separate
    /// weights without laying each out again.
    ///
    /// # Errors
    /// [`Error::BackendMismatch`] for a weight of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when a copy fails.
    pub fn try_clone(&self, backend: &Backend) -> Result<Self> {
        if self.storage.backend_name() != backend.name() {
            return Err(Error::BackendMismatch {
                what: "linear weight".into(),
                expected: backend.name(),
                found: self.storage.backend_name(),
            });
        }
        let storage = match &self.storage {
            LinearStorage::HostNvfp4(m) => LinearStorage::HostNvfp4(m.clone()),
            LinearStorage::HostW4a4 {
                matrix,
                input_scale,
            } => LinearStorage::HostW4a4 {
                matrix: matrix.clone(),
                input_scale: *input_scale,
            },
            LinearStorage::HostBf16(v) => LinearStorage::HostBf16(v.clone()),
            LinearStorage::MmaNvfp4 {
                words,
                scales,
                global_scale,
            } => LinearStorage::MmaNvfp4 {
                words: backend.duplicate(words)?,
                scales: backend.duplicate(scales)?,
                global_scale: *global_scale,
            },
            LinearStorage::MmaBf16 { words } => LinearStorage::MmaBf16 {
                words: backend.duplicate(words)?,
            },
            LinearStorage::W4a4 {
                words,
                scales,
                global_scale,
                input_scale,
            } => LinearStorage::W4a4 {
                words: backend.duplicate(words)?,
                scales: backend.duplicate(scales)?,
                global_scale: *global_scale,
                input_scale: *input_scale,
            },
            LinearStorage::WmmaNvfp4 {
                words,
                scales,
                global_scale,
            } => LinearStorage::WmmaNvfp4 {
                words: backend.duplicate(words)?,
                scales: backend.duplicate(scales)?,
                global_scale: *global_scale,
            },
            LinearStorage::WmmaBf16 { values } => LinearStorage::WmmaBf16 {
                values: backend.duplicate(values)?,
            },
        };
        Ok(Self {
            format: self.format,
            grid: self.grid,
            storage,
        })
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Output features: `rows`, or `rows / 2` for a `[gate; up]` weight.
    pub fn out_features(&self) -> usize {
        match self.grid.row_order {
            RowOrder::Plain => self.grid.rows,
            RowOrder::GateUp => self.grid.rows / 2,
        }
    }

    /// Input features (K).
    pub fn in_features(&self) -> usize {
        self.grid.cols
    }

    /// Weight bytes a kernel streams per call: NVFP4 nibbles + one scale byte per 16, or 2 per
    /// bf16 element (the unpadded matrix: what the roofline counts).
    pub fn weight_bytes(&self) -> u64 {
        let elements = (self.grid.rows * self.grid.cols) as u64;
        match self.format {
            WeightFormat::Nvfp4 | WeightFormat::Nvfp4W4a4 => elements / 2 + elements / 16,
            WeightFormat::Bf16 => 2 * elements,
        }
    }

    /// The fewest bytes `Y = X * W^T` (+ epilogue) moves for `m` rows: weights once, X once, Y
    /// once (and the residual once when used).
    pub fn bytes(&self, m: usize, epilogue: &Epilogue<'_>) -> u64 {
        let io = 2 * (m * self.grid.cols + m * self.out_features()) as u64;
        let residual = if matches!(epilogue, Epilogue::Residual(_)) {
            2 * (m * self.out_features()) as u64
        } else {
            0
        };
        self.weight_bytes() + io + residual
    }
}

/// `y = epilogue(x * w^T)` for `m` rows: `x` bf16 `[m, w.in_features()]`, `y` bf16
/// `[m, w.out_features()]`, row-major. `m == 0` does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shapes, the epilogue does not
/// fit the weight's row order, or a dimension exceeds the kernels' range;
/// [`Error::BackendMismatch`] when buffers or the weight live elsewhere; [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`] from the device path.
pub fn linear(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    epilogue: Epilogue<'_>,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    linear_with(backend, x, m, w, epilogue, y, MmaKernel::default())
}

/// [`linear`] with the tensor-core kernel chosen by the caller (the bench and the tests compare
/// them). [`MmaKernel::Registers`] is [`linear`] itself for every weight.
///
/// # Errors
/// As [`linear`]; also [`Error::Invalid`] when [`MmaKernel::Staged`] or [`MmaKernel::Wgmma`] is
/// asked for a weight or target without that kernel (Staged: not NVFP4 W4A16 on mma.sync, or no
/// `cp.async`; Wgmma: not W4A16 / bf16 on mma.sync, or no `wgmma`). The CPU backend runs the
/// reference whatever the choice.
pub fn linear_with(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    epilogue: Epilogue<'_>,
    y: &mut DeviceVec<bf16>,
    kernel: MmaKernel,
) -> Result<()> {
    let (k, n_out) = (w.grid.cols, w.out_features());
    check_len("linear input X", x, m * k, &format!("[{m}, {k}]"))?;
    check_len("linear output Y", y, m * n_out, &format!("[{m}, {n_out}]"))?;
    match (&epilogue, w.grid.row_order) {
        (Epilogue::SiluMul, RowOrder::Plain) => {
            return Err(Error::invalid(
                "linear epilogue",
                "silu(gate) * up needs a weight built with RowOrder::GateUp",
            ));
        }
        (Epilogue::None | Epilogue::Residual(_), RowOrder::GateUp) => {
            return Err(Error::invalid(
                "linear epilogue",
                "a RowOrder::GateUp weight only runs with Epilogue::SiluMul",
            ));
        }
        (Epilogue::Residual(r), _) => {
            check_len("linear residual", r, m * n_out, &format!("[{m}, {n_out}]"))?
        }
        _ => {}
    }
    if m == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let DeviceVec::Host(x) = x else {
                return Err(backend.mismatch("linear input X", x));
            };
            let product = match &w.storage {
                LinearStorage::HostNvfp4(matrix) => reference::nvfp4_gemm_f32(x, m, matrix.view()),
                LinearStorage::HostW4a4 {
                    matrix,
                    input_scale,
                } => reference::nvfp4_w4a4_f32(x, m, matrix.view(), *input_scale)?,
                LinearStorage::HostBf16(values) => {
                    reference::bf16_gemm_f32(x, m, values, w.grid.rows, k)
                }
                device => {
                    return Err(Error::BackendMismatch {
                        what: "linear weight".into(),
                        expected: "cpu",
                        found: device.backend_name(),
                    });
                }
            };
            let result = match &epilogue {
                Epilogue::None => product,
                Epilogue::SiluMul => reference::silu_mul(&product, m, w.grid.rows),
                Epilogue::Residual(DeviceVec::Host(r)) => reference::add_residual(&product, r),
                Epilogue::Residual(r) => return Err(backend.mismatch("linear residual", r)),
            };
            let DeviceVec::Host(y) = y else {
                return Err(backend.mismatch("linear output Y", y));
            };
            *y = result.into_iter().map(bf16::from_f32).collect();
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => linear_device(backend, x, m, w, &epilogue, y, kernel),
    }
}

/// How a tensor-core launch is partitioned: `warps_per_tile` warps per weight tile (a block
/// holds `warps_per_block / warps_per_tile` tiles), K split in `splits` ranges of
/// `groups_per_split` groups across blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaPlan {
    /// Warps sharing one tile's K groups (1, 2, 4, ... up to the block's warps).
    pub warps_per_tile: u32,
    /// K ranges (grid.y).
    pub splits: u32,
    /// 64-wide K groups per range.
    pub groups_per_split: u32,
}

impl MmaPlan {
    /// The launch of this partition over `n_tiles` tiles: blocks of `warps_per_block` warps
    /// (`warps_per_tile` to a tile), one grid row per K split, `shared_bytes` of dynamic shared
    /// memory.
    fn dims(
        &self,
        n_tiles: u32,
        warps_per_block: u32,
        warp_size: u32,
        shared_bytes: u32,
    ) -> LaunchDims {
        LaunchDims {
            grid: (
                n_tiles.div_ceil(warps_per_block / self.warps_per_tile),
                self.splits,
                1,
            ),
            block: (warps_per_block * warp_size, 1, 1),
            shared_bytes,
            cluster: (1, 1, 1),
        }
    }
}

/// The fewest warps per tile, then the fewest K splits, that give
/// `multiprocessors * min_warps_per_sm` warps work, keeping at least `min_groups_per_split`
/// groups per split and no split empty.
pub fn mma_plan(
    n_tiles: usize,
    k_groups: usize,
    warps_per_block: u32,
    multiprocessors: u32,
    min_warps_per_sm: u32,
    min_groups_per_split: u32,
) -> MmaPlan {
    let wanted = multiprocessors as usize * min_warps_per_sm as usize;
    let n_tiles = n_tiles.max(1);
    let mut warps_per_tile = 1u32;
    while warps_per_tile < warps_per_block && n_tiles * (warps_per_tile as usize) < wanted {
        warps_per_tile *= 2;
    }
    let splits_wanted = wanted.div_ceil(n_tiles * warps_per_tile as usize);
    let most = (k_groups / (min_groups_per_split as usize).max(1)).max(1);
    let splits = splits_wanted.clamp(1, most);
    let groups_per_split = k_groups.div_ceil(splits).max(1);
    MmaPlan {
        warps_per_tile,
        splits: k_groups.div_ceil(groups_per_split).max(1) as u32,
        groups_per_split: groups_per_split as u32,
    }
}

/// [`GemmTiles::mma_wave_warps_per_tile`]: `plan` with its warps per tile doubled (up to
/// `warps_per_block`) while its blocks, `blocks_of` a plan, stay within `resident_blocks` (one
/// wave of the blocks the device holds at once). Only where `plan` keeps K whole: a split plan
/// already gives every warp work and shortens the chains by splitting. More warps per tile
/// shorten each warp's chain over K when the tiles alone leave the SMs half empty (the attention
/// q/k/v at M = 1..16: 576 tiles of 32 groups in 144 blocks, 16 groups per warp).
pub fn wave_plan(
    plan: MmaPlan,
    warps_per_block: u32,
    resident_blocks: u32,
    blocks_of: impl Fn(&MmaPlan) -> u32,
) -> MmaPlan {
    let mut plan = plan;
    while plan.splits == 1 && plan.warps_per_tile < warps_per_block {
        let wider = MmaPlan {
            warps_per_tile: plan.warps_per_tile * 2,
            ..plan
        };
        if blocks_of(&wider) > resident_blocks {
            break;
        }
        plan = wider;
    }
    plan
}

/// The partition a `gemm_*_bf16_mma_m*` launch of `rows` rows of `w` runs where its variant
/// loads X from global memory (not [`mma_x_shared`]; the launches of [`MmaKernel::Registers`]
/// there): [`mma_plan`], then [`wave_plan`] where `gemm.mma_wave_warps_per_tile` is on and the
/// backend says how many blocks the device holds at once (the plan as it is elsewhere).
///
/// # Errors
/// [`Error::Invalid`] for a weight that is not an mma.sync layout or rows past
/// [`MMA_MAX_ROWS`]; the backend's errors from its occupancy query.
pub fn register_plan(backend: &Backend, w: &Linear, rows: usize) -> Result<MmaPlan> {
    let kernel = match &w.storage {
        LinearStorage::MmaNvfp4 { .. } => mma_variant(&MMA_NVFP4_KERNELS, rows)?,
        LinearStorage::MmaBf16 { .. } => mma_variant(&MMA_BF16_KERNELS, rows)?,
        _ => {
            return Err(Error::invalid(
                "linear weight",
                "not laid out for the mma.sync kernels",
            ));
        }
    };
    global_x_plan(backend, kernel, w, rows)
}

/// [`register_plan`] for the launch of `kernel`.
fn global_x_plan(
    backend: &Backend,
    kernel: &'static str,
    w: &Linear,
    rows: usize,
) -> Result<MmaPlan> {
    let (target, multiprocessors) = device_facts(backend)?;
    let tiles = &target.gemm;
    let plan = mma_plan(
        w.grid.n_tiles,
        w.grid.k_groups,
        tiles.mma_warps_per_block,
        multiprocessors,
        tiles.mma_min_warps_per_sm,
        tiles.mma_min_groups_per_split,
    );
    if !tiles.mma_wave_warps_per_tile {
        return Ok(plan);
    }
    let n_tiles = check_u32("linear tiles", w.grid.n_tiles)?;
    let block_warps = mma_block_warps(target, rows);
    // these variants' blocks take no dynamic shared memory outside clusters, whatever the plan
    let dims_of = |p: &MmaPlan| p.dims(n_tiles, block_warps, target.warp_size, 0);
    Ok(
        match backend.max_active_blocks(FAMILY, kernel, &dims_of(&plan))? {
            Some(resident) => wave_plan(plan, tiles.mma_warps_per_block, resident, |p| {
                let grid = dims_of(p).grid;
                grid.0 * grid.1
            }),
            None => plan,
        },
    )
}

/// The partition of `gemm_nvfp4_bf16_stream_m*` for `rows` rows: [`mma_plan`] on
/// `stream_warps_per_block`-warp blocks, then K split further until a block's X
/// (`rows * (groups_per_split * 64 + 8)` bf16) fits in `stream_max_x_bytes`.
pub fn stream_plan(
    n_tiles: usize,
    k_groups: usize,
    rows: usize,
    tiles: &GemmTiles,
    multiprocessors: u32,
) -> MmaPlan {
    let plan = mma_plan(
        n_tiles,
        k_groups,
        tiles.stream_warps_per_block,
        multiprocessors,
        tiles.mma_min_warps_per_sm,
        tiles.mma_min_groups_per_split,
    );
    let row_bytes = tiles.stream_max_x_bytes as usize / rows.max(1);
    let most = (row_bytes.saturating_sub(16) / 128).max(1);
    if plan.groups_per_split as usize <= most {
        return plan;
    }
    let groups_per_split = k_groups.div_ceil(k_groups.div_ceil(most));
    MmaPlan {
        warps_per_tile: plan.warps_per_tile,
        splits: k_groups.div_ceil(groups_per_split) as u32,
        groups_per_split: groups_per_split as u32,
    }
}

/// The 8-row tiles of X in the `gemm_*_mma_m*` / `_stream_m*` variant that takes `rows` rows
/// (the kernels' MT: 1, 2, 4, 6 or 8; [`MMA_VARIANT_ROWS`]).
pub fn row_tiles(rows: usize) -> usize {
    let index = mma_variant_index(rows).unwrap_or(MMA_VARIANT_ROWS.len() - 1);
    MMA_VARIANT_ROWS[index] / 8
}

/// The index in [`MMA_VARIANT_ROWS`] of the smallest variant that holds `rows` rows; `None` past
/// [`MMA_MAX_ROWS`].
fn mma_variant_index(rows: usize) -> Option<usize> {
    MMA_VARIANT_ROWS.iter().position(|&v| v >= rows)
}

/// Whether a launch of `rows` rows (at most [`MMA_MAX_ROWS`]) runs a `gemm_*_mma_m*` variant
/// that streams X through shared memory (`X_SHARED` in gemm.cu): on `cp.async` targets, the
/// variants of at least `gemm.mma_x_shared_min_rows` rows.
pub fn mma_x_shared(target: &TargetFacts, rows: usize) -> bool {
    let variant_rows = row_tiles(rows) * 8;
    target.instructions.cp_async && variant_rows >= target.gemm.mma_x_shared_min_rows as usize
}

/// Warps per block of the `gemm_*_mma_m*` variant that takes `rows` rows:
/// `gemm.mma_x_shared_warps_per_block` where it streams X ([`mma_x_shared`]), else
/// `gemm.mma_warps_per_block`.
pub fn mma_block_warps(target: &TargetFacts, rows: usize) -> u32 {
    if mma_x_shared(target, rows) {
        target.gemm.mma_x_shared_warps_per_block
    } else {
        target.gemm.mma_warps_per_block
    }
}

/// The partition of the `gemm_*_mma_m*` variants that stream X through shared memory
/// ([`mma_x_shared`]): [`mma_plan`] with at most `mma_x_shared_max_warps_per_tile` warps per
/// tile (a round of the X ring holds one K group for each warp of a tile), K split across
/// blocks for the rest, down to `mma_x_shared_min_groups_per_split` groups per split.
///
/// Where the tiles alone leave warps without work (that plan splits K), the number of splits is
/// then the one whose blocks fill their waves best: these blocks are large
/// (`mma_x_shared_warps_per_block` warps, `mma_x_shared_blocks_per_sm` resident per SM), so a
/// split count chosen for the warps alone can leave a last wave nearly empty (the (8192, 2048)
/// attention q projection at M = 64 in 12-warp blocks: 2 splits are 172 blocks on 132 SMs, two
/// waves of 16 groups; 3 splits two waves of 11). The cost of a split count is its waves times
/// (groups per split + a split's overhead, 2 groups), the fewest splits on a tie. Where the
/// tiles alone give every warp work, K stays whole even when the blocks leave part of a wave
/// empty: the attention q/k/v at M = 64 (576 tiles, 96 blocks, 0.73 waves) split 4 ways for
/// waves made the H100's B = 64 decode step 1.2% slower (BENCHMARKS.md, thirty-sixth session).
pub fn x_shared_plan(
    n_tiles: usize,
    k_groups: usize,
    tiles: &GemmTiles,
    multiprocessors: u32,
) -> MmaPlan {
    let plan = mma_plan(
        n_tiles,
        k_groups,
        tiles.mma_x_shared_max_warps_per_tile,
        multiprocessors,
        tiles.mma_min_warps_per_sm,
        tiles.mma_x_shared_min_groups_per_split,
    );
    if plan.splits == 1 {
        return plan;
    }
    let tiles_per_block = (tiles.mma_x_shared_warps_per_block / plan.warps_per_tile).max(1);
    let groups_per_split = wave_filling_groups_per_split(
        k_groups,
        n_tiles.max(1).div_ceil(tiles_per_block as usize),
        multiprocessors * tiles.mma_x_shared_blocks_per_sm,
        tiles.mma_x_shared_min_groups_per_split,
    );
    MmaPlan {
        warps_per_tile: plan.warps_per_tile,
        splits: k_groups.div_ceil(groups_per_split).max(1) as u32,
        groups_per_split: groups_per_split as u32,
    }
}

/// The K groups per split, of every split count that keeps at least `min_groups_per_split`
/// groups per split, whose `blocks_per_split` blocks per split fill `slots` resident blocks in
/// the fewest waves of the least work: waves x (groups per split + [`SPLIT_OVERHEAD_GROUPS`]),
/// the fewest splits on a tie ([`x_shared_plan`], [`wgmma_plan`]).
fn wave_filling_groups_per_split(
    k_groups: usize,
    blocks_per_split: usize,
    slots: u32,
    min_groups_per_split: u32,
) -> usize {
    let slots = slots.max(1) as usize;
    let most = (k_groups / min_groups_per_split.max(1) as usize).max(1);
    let cost = |groups_per_split: usize| {
        let splits = k_groups.div_ceil(groups_per_split);
        (blocks_per_split * splits).div_ceil(slots) * (groups_per_split + SPLIT_OVERHEAD_GROUPS)
    };
    // each split count's groups per split, fewest splits first (min_by_key keeps the first;
    // the range is never empty)
    (1..=most)
        .map(|splits| k_groups.div_ceil(splits).max(1))
        .min_by_key(|&groups| cost(groups))
        .unwrap_or(k_groups.max(1))
}

/// What a K split adds to a block's work in [`wave_filling_groups_per_split`], in K groups: its
/// partial sums stored, counted and added by the tile's last block (an estimate, not a
/// measurement).
const SPLIT_OVERHEAD_GROUPS: usize = 2;

/// Whether a launch of `rows` rows (at most [`MMA_MAX_ROWS`]) over `n_tiles` 16-row tiles runs
/// `gemm_*_wgmma_m64` in place of the mma.sync variant: on targets with `wgmma` and `cp.async`,
/// from `gemm.wgmma_min_rows` rows, and above 32 rows (the m48 / m64 variants' launches) where
/// the weights have at least `gemm.wgmma_min_tiles` tiles (0: never), whose many blocks of many
/// rounds stream at the copy bandwidth.
pub fn mma_wgmma(target: &TargetFacts, rows: usize, n_tiles: usize) -> bool {
    let tiles = &target.gemm;
    wgmma_rendered(target)
        && (rows >= tiles.wgmma_min_rows as usize
            || (rows > 32
                && tiles.wgmma_min_tiles > 0
                && n_tiles >= tiles.wgmma_min_tiles as usize))
}

/// Whether `target`'s gemm source has the `gemm_*_wgmma_m64` kernels (`wgmma` and `cp.async`).
pub fn wgmma_rendered(target: &TargetFacts) -> bool {
    target.instructions.wgmma && target.instructions.cp_async
}

/// The partition of `gemm_*_wgmma_m64`: a warpgroup per quad of four 16-row tiles,
/// `gemm.wgmma_warpgroups_per_block` quads per block (`warps_per_tile` is 1: unused), K whole
/// where those blocks fill the `multiprocessors * gemm.wgmma_blocks_per_sm` resident slots,
/// else split across blocks into the split count that fills the slots in the fewest waves of the
/// least work, with at least `gemm.wgmma_min_groups_per_split` groups per split.
pub fn wgmma_plan(
    n_tiles: usize,
    k_groups: usize,
    tiles: &GemmTiles,
    multiprocessors: u32,
) -> MmaPlan {
    let quads = n_tiles.max(1).div_ceil(4);
    let k_groups = k_groups.max(1);
    let blocks = quads.div_ceil(tiles.wgmma_warpgroups_per_block.max(1) as usize);
    let slots = multiprocessors * tiles.wgmma_blocks_per_sm;
    // K splits only fill the device's slots: where the tiles alone fill them, splitting K adds
    // the partial sums' traffic to every tile (the lm_head at M = 64 took 2 splits by a hair of
    // the estimate, 521.07 us against 183.71 for (65536, 4096) unsplit; forty-first session)
    let groups_per_split = if blocks >= slots as usize {
        k_groups
    } else {
        wave_filling_groups_per_split(k_groups, blocks, slots, tiles.wgmma_min_groups_per_split)
    };
    MmaPlan {
        warps_per_tile: 1,
        splits: k_groups.div_ceil(groups_per_split) as u32,
        groups_per_split: groups_per_split as u32,
    }
}

/// The launch of `gemm_*_wgmma_m64` on `plan` over `n_tiles` 16-row tiles: a block per
/// `gemm.wgmma_warpgroups_per_block` quads and K split, its operand and staging slots and
/// weight rings (NVFP4 weights where `nvfp4`) of dynamic shared memory ([`wgmma_shared_bytes`]).
fn wgmma_dims(target: &TargetFacts, plan: &MmaPlan, n_tiles: u32, nvfp4: bool) -> LaunchDims {
    let tiles = &target.gemm;
    let warpgroups = tiles.wgmma_warpgroups_per_block.max(1);
    LaunchDims {
        grid: (n_tiles.div_ceil(4).div_ceil(warpgroups), plan.splits, 1),
        block: (warpgroups * 4 * target.warp_size, 1, 1),
        shared_bytes: wgmma_shared_bytes(tiles, nvfp4),
        cluster: (1, 1, 1),
    }
}

/// bf16 per row of the X ring of the `gemm_*_mma_m*` variants that stream X (`X_ROW` in gemm.cu):
/// a 64-wide K group and 8 of padding, so that rows are 144 bytes apart and each phase of a
/// warp's 16-byte reads hits each shared-memory bank once.
const X_RING_ROW_ELEMS: usize = 72;

/// The partitions, in order of preference, that would finish a `gemm_*_mma_m*` launch of `rows`
/// rows (planned as `plan` over `k_groups` groups) in clusters (`finish_in_cluster` in gemm.cu),
/// on targets with `clusters`; the launch takes the first whose clusters the device holds all at
/// once, else `plan` finishing through the L2. The variants that load X from global memory keep
/// `plan` when it has 2 to `gemm.mma_cluster_max_splits` splits. The X-ring variants, where
/// `plan` splits K, try every split count from `plan`'s (at most
/// `gemm.mma_x_shared_cluster_max_splits`) down to 2, the groups spread evenly again: a cluster
/// is placed whole within a GPC, so the wave-filling split count's clusters may not all fit at
/// once (H100: 132 blocks in clusters of 6 took two waves, 25.92 us against 20.95 through the L2,
/// while 88 in clusters of 4 took 15.81; BENCHMARKS.md, thirty-eighth session).
pub fn cluster_candidates(
    target: &TargetFacts,
    rows: usize,
    plan: &MmaPlan,
    k_groups: usize,
) -> Vec<MmaPlan> {
    if !target.instructions.clusters || plan.splits < 2 {
        return Vec::new();
    }
    if !mma_x_shared(target, rows) {
        let fits = plan.splits <= target.gemm.mma_cluster_max_splits;
        return if fits { vec![*plan] } else { Vec::new() };
    }
    let most = plan.splits.min(target.gemm.mma_x_shared_cluster_max_splits) as usize;
    let mut candidates: Vec<MmaPlan> = Vec::new();
    for splits in (2..=most).rev() {
        let groups_per_split = k_groups.div_ceil(splits);
        let candidate = MmaPlan {
            warps_per_tile: plan.warps_per_tile,
            splits: k_groups.div_ceil(groups_per_split) as u32,
            groups_per_split: groups_per_split as u32,
        };
        // two split counts can spread the groups alike (the last split short)
        if candidate.splits >= 2 && candidates.last() != Some(&candidate) {
            candidates.push(candidate);
        }
    }
    candidates
}

/// Dynamic shared memory of one block of the `gemm_*_mma_m*` variants that load X from global
/// memory: none, or the warps' sums when the launch finishes `in_cluster` ([`cluster_candidates`]:
/// `mma_warps_per_block` x `m_tiles` x 32 lanes x 16 bytes).
pub fn mma_shared_bytes(tiles: &GemmTiles, rows: usize, in_cluster: bool) -> usize {
    if in_cluster {
        tiles.mma_warps_per_block as usize * row_tiles(rows) * 32 * 16
    } else {
        0
    }
}

/// Dynamic shared memory of one `gemm_*_mma_m*` block that streams X ([`mma_x_shared`]): the ring
/// (`mma_x_shared_slots` rounds of `warps_per_tile` x the variant's rows, those past `rows` zero,
/// of 72 bf16), which the warps reuse for their sums when they share a tile or finish `in_cluster`
/// ([`cluster_candidates`]): `mma_x_shared_warps_per_block` x `m_tiles` x 32 lanes x 16 bytes,
/// as `gemm_mma` in gemm.cu lays it out.
pub fn x_shared_bytes(tiles: &GemmTiles, rows: usize, plan: &MmaPlan, in_cluster: bool) -> usize {
    let m_tiles = row_tiles(rows);
    let ring = tiles.mma_x_shared_slots as usize
        * plan.warps_per_tile as usize
        * m_tiles
        * 8
        * X_RING_ROW_ELEMS
        * 2;
    let sums = if plan.warps_per_tile > 1 || in_cluster {
        tiles.mma_x_shared_warps_per_block as usize * m_tiles * 32 * 16
    } else {
        0
    };
    ring.max(sums)
}

/// Dynamic shared memory of one `gemm_nvfp4_bf16_stream_m*` block: the warps' rings, then X
/// (`rows` rows of `groups_per_split * 64 + 8` bf16), as `gemm_stream` in gemm.cu lays it out.
pub fn stream_shared_bytes(tiles: &GemmTiles, rows: usize, groups_per_split: u32) -> usize {
    let rings = tiles.stream_warps_per_block
        * tiles.stream_stages
        * tiles.stream_chunk_groups
        * STREAM_GROUP_BYTES;
    rings as usize + rows * (groups_per_split as usize * 64 + 8) * 2
}

/// `gemm_nvfp4_bf16_mma_m{8,16,32,48,64}`: one per [`MMA_VARIANT_ROWS`] ([`mma_variant`]).
const MMA_NVFP4_KERNELS: [&str; 5] = [
    "gemm_nvfp4_bf16_mma_m8",
    "gemm_nvfp4_bf16_mma_m16",
    "gemm_nvfp4_bf16_mma_m32",
    "gemm_nvfp4_bf16_mma_m48",
    "gemm_nvfp4_bf16_mma_m64",
];
/// `gemm_bf16_bf16_mma_m{8,16,32,48,64}`: one per [`MMA_VARIANT_ROWS`] ([`mma_variant`]).
const MMA_BF16_KERNELS: [&str; 5] = [
    "gemm_bf16_bf16_mma_m8",
    "gemm_bf16_bf16_mma_m16",
    "gemm_bf16_bf16_mma_m32",
    "gemm_bf16_bf16_mma_m48",
    "gemm_bf16_bf16_mma_m64",
];
/// `gemm_nvfp4_bf16_wgmma_m64` (targets with `wgmma`; [`mma_wgmma`]).
const WGMMA_NVFP4_KERNEL: &str = "gemm_nvfp4_bf16_wgmma_m64";
/// `gemm_bf16_bf16_wgmma_m64` (targets with `wgmma`; [`mma_wgmma`]).
const WGMMA_BF16_KERNEL: &str = "gemm_bf16_bf16_wgmma_m64";
/// `gemm_nvfp4_bf16_stream_m{8,16}`: index `log2(ceil(rows / 8))`.
const STREAM_NVFP4_KERNELS: [&str; 2] = ["gemm_nvfp4_bf16_stream_m8", "gemm_nvfp4_bf16_stream_m16"];
/// `gemm_nvfp4_nvfp4_mma_m{8,16,32}` (W4A4): index `log2(ceil(rows / 8))`.
const W4A4_KERNELS: [&str; 3] = [
    "gemm_nvfp4_nvfp4_mma_m8",
    "gemm_nvfp4_nvfp4_mma_m16",
    "gemm_nvfp4_nvfp4_mma_m32",
];
/// `gemm_nvfp4_bf16_wmma_m{16,32,64}`: index `log2(ceil(rows / 16))`.
const WMMA_NVFP4_KERNELS: [&str; 3] = [
    "gemm_nvfp4_bf16_wmma_m16",
    "gemm_nvfp4_bf16_wmma_m32",
    "gemm_nvfp4_bf16_wmma_m64",
];
/// `gemm_bf16_bf16_wmma_m{16,32,64}`: index `log2(ceil(rows / 16))`.
const WMMA_BF16_KERNELS: [&str; 3] = [
    "gemm_bf16_bf16_wmma_m16",
    "gemm_bf16_bf16_wmma_m32",
    "gemm_bf16_bf16_wmma_m64",
];
/// The W4A4 activation quantiser: one thread per 16-element block of X.
pub const KERNEL_QUANTIZE_NVFP4_ROWS: &str = "quantize_nvfp4_rows";
/// Threads per block of [`KERNEL_QUANTIZE_NVFP4_ROWS`] (QUANTIZE_THREADS in gemm.cu).
const QUANTIZE_THREADS: u32 = 256;

/// The smallest kernel of `variants` (for `step`, `2 * step`, `4 * step`, ... rows) that holds
/// `rows` rows.
///
/// # Errors
/// [`Error::Invalid`] when none does (the callers chunk M so that one always does).
fn variant(variants: &[&'static str], step: usize, rows: usize) -> Result<&'static str> {
    let index = rows.div_ceil(step).next_power_of_two().trailing_zeros() as usize;
    let largest = step << (variants.len() - 1);
    variants
        .get(index)
        .copied()
        .ok_or_else(|| too_many_rows(rows, largest))
}

/// The `gemm_*_bf16_mma_m*` kernel of `kernels` (one per [`MMA_VARIANT_ROWS`]) that takes `rows`
/// rows: the smallest that holds them.
///
/// # Errors
/// More than [`MMA_MAX_ROWS`] rows.
fn mma_variant(kernels: &[&'static str; 5], rows: usize) -> Result<&'static str> {
    let index = mma_variant_index(rows);
    index
        .map(|i| kernels[i])
        .ok_or_else(|| too_many_rows(rows, MMA_MAX_ROWS))
}

/// The error of a launch of `rows` rows where the largest kernel takes `largest`.
fn too_many_rows(rows: usize, largest: usize) -> Error {
    Error::invalid(
        "gemm rows per launch",
        format!("{rows} rows; the largest kernel takes {largest}"),
    )
}

/// The target and multiprocessor count of a device backend.
fn device_facts(backend: &Backend) -> Result<(&'static TargetFacts, u32)> {
    let target = device_target(backend)?;
    let multiprocessors = backend.multiprocessors().unwrap_or(target.multiprocessors);
    Ok((target, multiprocessors))
}

/// A device weight for `gemm_*_bf16_mma_m*`.
#[derive(Clone, Copy)]
enum MmaWeights<'w> {
    Nvfp4 {
        words: &'w DeviceVec<u32>,
        scales: &'w DeviceVec<u16>,
        global_scale: f32,
    },
    Bf16 {
        words: &'w DeviceVec<u32>,
    },
}

/// A device weight for `gemm_nvfp4_bf16_stream_m*` (the mma layout).
#[derive(Clone, Copy)]
struct StreamWeights<'w> {
    words: &'w DeviceVec<u32>,
    scales: &'w DeviceVec<u16>,
    global_scale: f32,
}

/// A device weight for `gemm_*_bf16_wmma_m*`.
#[derive(Clone, Copy)]
enum WmmaWeights<'w> {
    Nvfp4 {
        words: &'w DeviceVec<u32>,
        scales: &'w DeviceVec<u32>,
        global_scale: f32,
    },
    Bf16 {
        values: &'w DeviceVec<u16>,
    },
}

/// A device weight for `gemm_nvfp4_nvfp4_mma_m*`.
#[derive(Clone, Copy)]
struct W4a4Weights<'w> {
    words: &'w DeviceVec<u32>,
    scales: &'w DeviceVec<u32>,
    global_scale: f32,
    input_scale: f32,
}

/// The device path of [`linear`] (shapes checked by the caller): the kernels of the weight's
/// layout, which [`Linear`]'s constructors chose from the target's [`TensorCore`].
fn linear_device(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    epilogue: &Epilogue<'_>,
    y: &mut DeviceVec<bf16>,
    kernel: MmaKernel,
) -> Result<()> {
    let found = w.storage.backend_name();
    let mismatch = || Error::BackendMismatch {
        what: "linear weight".into(),
        expected: backend.name(),
        found,
    };
    if found != backend.name() {
        return Err(mismatch());
    }
    let residual = match epilogue {
        Epilogue::Residual(r) => Some(*r),
        Epilogue::None | Epilogue::SiluMul => None,
    };
    if kernel == MmaKernel::Staged {
        let target = device_target(backend)?;
        let LinearStorage::MmaNvfp4 {
            words,
            scales,
            global_scale,
        } = &w.storage
        else {
            return Err(Error::invalid(
                "NVFP4 kernel",
                "the staged stream kernel takes NVFP4 W4A16 weights on mma.sync targets only",
            ));
        };
        if !target.instructions.cp_async {
            return Err(Error::invalid(
                "NVFP4 kernel",
                format!(
                    "target {} has no cp.async for the staged stream kernel",
                    target.name
                ),
            ));
        }
        if m <= STREAM_MAX_ROWS {
            let weights = StreamWeights {
                words,
                scales,
                global_scale: *global_scale,
            };
            return linear_stream(backend, x, m, w, weights, epilogue, residual, y);
        }
    }
    let force_wgmma = kernel == MmaKernel::Wgmma;
    if force_wgmma {
        let target = device_target(backend)?;
        if !wgmma_rendered(target)
            || !matches!(
                w.storage,
                LinearStorage::MmaNvfp4 { .. } | LinearStorage::MmaBf16 { .. }
            )
        {
            return Err(Error::invalid(
                "gemm kernel",
                format!(
                    "the wgmma kernels take NVFP4 W4A16 or bf16 weights on targets with wgmma \
                     and cp.async; target {} has {}",
                    target.name,
                    if wgmma_rendered(target) {
                        "them, the weight is laid out for another kernel"
                    } else {
                        "none"
                    }
                ),
            ));
        }
    }
    let mut mma = |weights| {
        linear_mma(
            backend,
            x,
            m,
            w,
            weights,
            epilogue,
            residual,
            y,
            force_wgmma,
        )
    };
    match &w.storage {
        LinearStorage::MmaNvfp4 {
            words,
            scales,
            global_scale,
        } => mma(MmaWeights::Nvfp4 {
            words,
            scales,
            global_scale: *global_scale,
        }),
        LinearStorage::MmaBf16 { words } => mma(MmaWeights::Bf16 { words }),
        LinearStorage::WmmaNvfp4 {
            words,
            scales,
            global_scale,
        } => {
            let weights = WmmaWeights::Nvfp4 {
                words,
                scales,
                global_scale: *global_scale,
            };
            linear_wmma(backend, x, m, w, weights, epilogue, residual, y)
        }
        LinearStorage::WmmaBf16 { values } => {
            let weights = WmmaWeights::Bf16 { values };
            linear_wmma(backend, x, m, w, weights, epilogue, residual, y)
        }
        LinearStorage::W4a4 {
            words,
            scales,
            global_scale,
            input_scale,
        } => {
            let weights = W4a4Weights {
                words,
                scales,
                global_scale: *global_scale,
                input_scale: *input_scale,
            };
            linear_w4a4(backend, x, m, w, weights, epilogue, residual, y)
        }
        LinearStorage::HostNvfp4(_)
        | LinearStorage::HostW4a4 { .. }
        | LinearStorage::HostBf16(_) => Err(mismatch()),
    }
}

/// The rows `start .. start + rows` of one tensor-core launch: X (`[m, k]`), Y and the residual
/// (`[m, n]`, or the null pointer), and their count.
#[derive(Clone, Copy)]
struct ChunkArgs<'a> {
    x: KernelArg<'a>,
    y: KernelArg<'a>,
    residual: KernelArg<'a>,
    rows: u32,
}

impl<'a> ChunkArgs<'a> {
    /// # Errors
    /// [`Error::Invalid`] when the rows are not within the buffers.
    #[allow(clippy::too_many_arguments)]
    fn new(
        x: &'a DeviceVec<bf16>,
        y: &'a mut DeviceVec<bf16>,
        residual: Option<&'a DeviceVec<bf16>>,
        start: usize,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<Self> {
        let out = start * n..(start + rows) * n;
        Ok(Self {
            x: KernelArg::input_range(x, start * k..(start + rows) * k)?,
            residual: match residual {
                Some(r) => KernelArg::input_range(r, out.clone())?,
                None => KernelArg::optional_input::<bf16>(None),
            },
            y: KernelArg::output_range(y, out)?,
            rows: check_u32("gemm rows per launch", rows)?,
        })
    }
}

/// The sizes the tensor-core kernels take after M: N (output columns), K, the weight's tiles and
/// K groups, and the epilogue code.
#[derive(Clone, Copy)]
struct TileShape {
    n: u32,
    k: u32,
    n_tiles: u32,
    k_groups: u32,
    epilogue: u32,
}

impl TileShape {
    /// # Errors
    /// [`Error::Invalid`] for a dimension past the kernels' 32-bit range.
    fn new(w: &Linear, epilogue: &Epilogue<'_>) -> Result<Self> {
        Ok(Self {
            n: check_u32("linear N", w.out_features())?,
            k: check_u32("linear K", w.grid.cols)?,
            n_tiles: check_u32("linear tiles", w.grid.n_tiles)?,
            k_groups: check_u32("linear K groups", w.grid.k_groups)?,
            epilogue: epilogue.kernel_code(),
        })
    }
}

/// How an mma.sync launch shares K: the split-K scratch (null pointers when K is not split) and
/// the plan's groups per split and warps per tile.
#[derive(Clone, Copy)]
struct SplitArgs<'a> {
    partials: KernelArg<'a>,
    counters: KernelArg<'a>,
    groups_per_split: u32,
    warps_per_tile: u32,
}

impl<'a> SplitArgs<'a> {
    /// The split-K arguments of `plan` over `scratch` (null pointers without splits).
    fn new(scratch: Option<&'a mut SplitKScratch>, plan: &MmaPlan) -> Self {
        let (partials, counters) = match scratch {
            Some(s) => (s.partials.as_mut(), s.counters.as_mut()),
            None => (None, None),
        };
        Self {
            partials: KernelArg::optional_output(partials),
            counters: KernelArg::optional_output(counters),
            groups_per_split: plan.groups_per_split,
            warps_per_tile: plan.warps_per_tile,
        }
    }
}

/// The backend's split-K scratch for a launch of `plan` over `n_tiles` tiles of `m_tiles` n8
/// tiles of rows (partials: 32 lanes x 4 floats per n8 tile, per tile and split; a counter per
/// tile), held for the launch; none without splits.
fn split_k_scratch<'b>(
    backend: &'b Backend,
    plan: &MmaPlan,
    n_tiles: usize,
    m_tiles: usize,
) -> Result<Option<MutexGuard<'b, SplitKScratch>>> {
    if plan.splits <= 1 {
        return Ok(None);
    }
    let partials = n_tiles * plan.splits as usize * 32 * m_tiles * 4;
    backend.split_k_scratch(partials, n_tiles).map(Some)
}

/// `gemm_nvfp4_bf16_mma_m*`'s arguments in its parameter order (x, words, scales, alpha, y,
/// residual, partials, counters, m, n, k, n_tiles, k_groups, groups_per_split, warps_per_tile,
/// epilogue).
fn mma_nvfp4_arguments<'a>(
    c: ChunkArgs<'a>,
    words: &'a DeviceVec<u32>,
    scales: &'a DeviceVec<u16>,
    global_scale: f32,
    split: SplitArgs<'a>,
    s: TileShape,
) -> [KernelArg<'a>; 16] {
    [
        c.x,
        KernelArg::input(words),
        KernelArg::input(scales),
        // the fragments hold e2m1 * scale * 2^-7 (layout.rs)
        KernelArg::f32(global_scale * 128.0),
        c.y,
        c.residual,
        split.partials,
        split.counters,
        KernelArg::u32(c.rows),
        KernelArg::u32(s.n),
        KernelArg::u32(s.k),
        KernelArg::u32(s.n_tiles),
        KernelArg::u32(s.k_groups),
        KernelArg::u32(split.groups_per_split),
        KernelArg::u32(split.warps_per_tile),
        KernelArg::u32(s.epilogue),
    ]
}

/// `gemm_bf16_bf16_mma_m*`'s arguments in its parameter order (x, words, alpha, y, residual,
/// partials, counters, m, n, k, n_tiles, k_groups, groups_per_split, warps_per_tile, epilogue).
fn mma_bf16_arguments<'a>(
    c: ChunkArgs<'a>,
    words: &'a DeviceVec<u32>,
    split: SplitArgs<'a>,
    s: TileShape,
) -> [KernelArg<'a>; 15] {
    [
        c.x,
        KernelArg::input(words),
        KernelArg::f32(1.0),
        c.y,
        c.residual,
        split.partials,
        split.counters,
        KernelArg::u32(c.rows),
        KernelArg::u32(s.n),
        KernelArg::u32(s.k),
        KernelArg::u32(s.n_tiles),
        KernelArg::u32(s.k_groups),
        KernelArg::u32(split.groups_per_split),
        KernelArg::u32(split.warps_per_tile),
        KernelArg::u32(s.epilogue),
    ]
}

/// `gemm_nvfp4_bf16_wmma_m*`'s arguments in its parameter order (x, words, scales, alpha, y,
/// residual, m, n, k, n_tiles, k_groups, epilogue).
fn wmma_nvfp4_arguments<'a>(
    c: ChunkArgs<'a>,
    words: &'a DeviceVec<u32>,
    scales: &'a DeviceVec<u32>,
    global_scale: f32,
    s: TileShape,
) -> [KernelArg<'a>; 12] {
    [
        c.x,
        KernelArg::input(words),
        KernelArg::input(scales),
        // the kernel decodes e2m1 * e4m3 exactly; the per-tensor scale is alpha
        KernelArg::f32(global_scale),
        c.y,
        c.residual,
        KernelArg::u32(c.rows),
        KernelArg::u32(s.n),
        KernelArg::u32(s.k),
        KernelArg::u32(s.n_tiles),
        KernelArg::u32(s.k_groups),
        KernelArg::u32(s.epilogue),
    ]
}

/// `gemm_bf16_bf16_wmma_m*`'s arguments in its parameter order (x, words, alpha, y, residual, m,
/// n, k, n_tiles, k_groups, epilogue).
fn wmma_bf16_arguments<'a>(
    c: ChunkArgs<'a>,
    values: &'a DeviceVec<u16>,
    s: TileShape,
) -> [KernelArg<'a>; 11] {
    [
        c.x,
        KernelArg::input(values),
        KernelArg::f32(1.0),
        c.y,
        c.residual,
        KernelArg::u32(c.rows),
        KernelArg::u32(s.n),
        KernelArg::u32(s.k),
        KernelArg::u32(s.n_tiles),
        KernelArg::u32(s.k_groups),
        KernelArg::u32(s.epilogue),
    ]
}

/// `quantize_nvfp4_rows`'s arguments in its parameter order (x, input_scale, packed, scales,
/// blocks).
fn quantize_arguments<'a>(
    x: &'a DeviceVec<bf16>,
    input_scale: f32,
    packed: &'a mut DeviceVec<u8>,
    scales: &'a mut DeviceVec<u8>,
    blocks: u64,
) -> [KernelArg<'a>; 5] {
    [
        KernelArg::input(x),
        KernelArg::f32(input_scale),
        KernelArg::output(packed),
        KernelArg::output(scales),
        KernelArg::u64(blocks),
    ]
}

/// `gemm_nvfp4_nvfp4_mma_m*`'s arguments in its parameter order (xq, xs, words, w_scales,
/// alpha, y, residual, m, n, k, n_tiles, k_groups, epilogue): `c.x` is unused, the activations
/// are the quantised `codes` and `code_scales` of the chunk's rows.
fn w4a4_arguments<'a>(
    codes: KernelArg<'a>,
    code_scales: KernelArg<'a>,
    c: ChunkArgs<'a>,
    weights: W4a4Weights<'a>,
    s: TileShape,
) -> [KernelArg<'a>; 13] {
    [
        codes,
        code_scales,
        KernelArg::input(weights.words),
        KernelArg::input(weights.scales),
        KernelArg::f32(weights.input_scale * weights.global_scale),
        c.y,
        c.residual,
        KernelArg::u32(c.rows),
        KernelArg::u32(s.n),
        KernelArg::u32(s.k),
        KernelArg::u32(s.n_tiles),
        KernelArg::u32(s.k_groups),
        KernelArg::u32(s.epilogue),
    ]
}

/// The mma.sync path: `gemm_*_bf16_mma_m*` in chunks of [`MMA_MAX_ROWS`] rows, partitioned by
/// [`mma_plan`]; split-K launches hold the backend's scratch ([`Backend::split_k_scratch`]).
#[allow(clippy::too_many_arguments)]
fn linear_mma(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    weights: MmaWeights<'_>,
    epilogue: &Epilogue<'_>,
    residual: Option<&DeviceVec<bf16>>,
    y: &mut DeviceVec<bf16>,
    force_wgmma: bool,
) -> Result<()> {
    let (target, multiprocessors) = device_facts(backend)?;
    let tiles = &target.gemm;
    let shape = TileShape::new(w, epilogue)?;
    let (k, n_out) = (w.grid.cols, w.out_features());
    for start in (0..m).step_by(MMA_MAX_ROWS) {
        let rows = (m - start).min(MMA_MAX_ROWS);
        let wgmma = force_wgmma || mma_wgmma(target, rows, w.grid.n_tiles);
        let nvfp4 = matches!(weights, MmaWeights::Nvfp4 { .. });
        let kernel = match (nvfp4, wgmma) {
            (true, true) => WGMMA_NVFP4_KERNEL,
            (true, false) => mma_variant(&MMA_NVFP4_KERNELS, rows)?,
            (false, true) => WGMMA_BF16_KERNEL,
            (false, false) => mma_variant(&MMA_BF16_KERNELS, rows)?,
        };
        let (plan, dims, in_cluster) = if wgmma {
            let plan = wgmma_plan(w.grid.n_tiles, w.grid.k_groups, tiles, multiprocessors);
            (plan, wgmma_dims(target, &plan, shape.n_tiles, nvfp4), false)
        } else {
            let plan = if mma_x_shared(target, rows) {
                x_shared_plan(w.grid.n_tiles, w.grid.k_groups, tiles, multiprocessors)
            } else {
                global_x_plan(backend, kernel, w, rows)?
            };
            let launch = |plan: &MmaPlan, in_cluster: bool| -> Result<LaunchDims> {
                let bytes = if mma_x_shared(target, rows) {
                    x_shared_bytes(tiles, rows, plan, in_cluster)
                } else {
                    mma_shared_bytes(tiles, rows, in_cluster)
                };
                let mut dims = plan.dims(
                    shape.n_tiles,
                    mma_block_warps(target, rows),
                    target.warp_size,
                    check_u32("gemm mma shared memory", bytes)?,
                );
                if in_cluster {
                    dims.cluster = (1, plan.splits, 1);
                }
                Ok(dims)
            };
            // the first candidate whose clusters the device holds at once, else the L2 finish
            // (pairs always fit: a cluster of 2 needs two blocks of one GPC, which holds pairs
            // of SMs)
            let mut chosen = None;
            for candidate in cluster_candidates(target, rows, &plan, w.grid.k_groups) {
                let dims = launch(&candidate, true)?;
                let fits = candidate.splits <= 2
                    || backend
                        .max_active_clusters(FAMILY, kernel, &dims)?
                        .is_some_and(|clusters| clusters >= dims.grid.0);
                if fits {
                    chosen = Some((candidate, dims));
                    break;
                }
            }
            match chosen {
                Some((plan, dims)) => (plan, dims, true),
                None => (plan, launch(&plan, false)?, false),
            }
        };
        // the n8 tiles of rows each lane's partial holds: the variant's, or the wgmma kernels'
        // 8 whatever the rows (they finish as m64; MmaKernel::Wgmma runs them at any M); a
        // launch that finishes in its clusters needs no partials or counters
        let m_tiles = if wgmma { 8 } else { row_tiles(rows) };
        let mut scratch = if in_cluster {
            None
        } else {
            split_k_scratch(backend, &plan, w.grid.n_tiles, m_tiles)?
        };
        let split = SplitArgs::new(scratch.as_deref_mut(), &plan);
        let chunk = ChunkArgs::new(x, y, residual, start, rows, k, n_out)?;
        // The kernels index only what is checked here: X, Y and the residual were checked
        // against (m, n, k) and the chunk's rows lie within them; the weights were laid out
        // for (n_tiles, k_groups); the X rings and the warps' sums fit the dynamic shared
        // memory (x_shared_bytes, wgmma_shared_bytes); with splits > 1 (and not in_cluster,
        // whose kernels keep their partials in shared memory) the scratch holds
        // n_tiles * splits * 32 * 4 * m_tiles floats (m_tiles as the launched kernel finishes)
        // and n_tiles zeroed counters, and its guard is held until the launch is queued.
        match weights {
            MmaWeights::Nvfp4 {
                words,
                scales,
                global_scale,
            } => {
                let args = mma_nvfp4_arguments(chunk, words, scales, global_scale, split, shape);
                // SAFETY: gemm_nvfp4_bf16_mma_m*'s parameters in order (mma_nvfp4_arguments);
                // bounds as above.
                unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
            }
            MmaWeights::Bf16 { words } => {
                let args = mma_bf16_arguments(chunk, words, split, shape);
                // SAFETY: gemm_bf16_bf16_mma_m*'s parameters in order (mma_bf16_arguments);
                // bounds as above.
                unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
            }
        }
        drop(scratch);
    }
    Ok(())
}

/// The staged stream path: one `gemm_nvfp4_bf16_stream_m*` launch for `m <=` [`STREAM_MAX_ROWS`]
/// rows, partitioned by [`stream_plan`]; a split-K launch holds the backend's scratch.
#[allow(clippy::too_many_arguments)]
fn linear_stream(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    weights: StreamWeights<'_>,
    epilogue: &Epilogue<'_>,
    residual: Option<&DeviceVec<bf16>>,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let (target, multiprocessors) = device_facts(backend)?;
    let tiles = &target.gemm;
    let plan = stream_plan(w.grid.n_tiles, w.grid.k_groups, m, tiles, multiprocessors);
    let shape = TileShape::new(w, epilogue)?;
    let shared_bytes = stream_shared_bytes(tiles, m, plan.groups_per_split);
    let dims = plan.dims(
        shape.n_tiles,
        tiles.stream_warps_per_block,
        target.warp_size,
        check_u32("gemm stream shared memory", shared_bytes)?,
    );
    let m_tiles = row_tiles(m);
    let mut scratch = split_k_scratch(backend, &plan, w.grid.n_tiles, m_tiles)?;
    let split = SplitArgs::new(scratch.as_deref_mut(), &plan);
    let (k, n_out) = (w.grid.cols, w.out_features());
    let chunk = ChunkArgs::new(x, y, residual, 0, m, k, n_out)?;
    let kernel = variant(&STREAM_NVFP4_KERNELS, 8, m)?;
    let args = mma_nvfp4_arguments(
        chunk,
        weights.words,
        weights.scales,
        weights.global_scale,
        split,
        shape,
    );
    // SAFETY: gemm_nvfp4_bf16_stream_m*'s parameters are gemm_nvfp4_bf16_mma_m*'s, in order
    // (mma_nvfp4_arguments). X, Y and the residual were checked against (m, n, k); the weights
    // were laid out for (n_tiles, k_groups); the shared memory holds the rings and m rows of
    // groups_per_split groups of X (stream_shared_bytes); with splits > 1 the scratch holds
    // n_tiles * splits * 32 * 4 * m_tiles floats and n_tiles zeroed counters, and its guard is
    // held until the launch is queued.
    unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
    drop(scratch);
    Ok(())
}

/// The WMMA path (gfx1151): `gemm_*_bf16_wmma_m*` in chunks of [`MMA_MAX_ROWS`] rows, one wave
/// per 16-row weight tile over all of K (the kernels have no K split).
#[allow(clippy::too_many_arguments)]
fn linear_wmma(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    weights: WmmaWeights<'_>,
    epilogue: &Epilogue<'_>,
    residual: Option<&DeviceVec<bf16>>,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let target = device_target(backend)?;
    let tiles = &target.gemm;
    let shape = TileShape::new(w, epilogue)?;
    let (k, n_out) = (w.grid.cols, w.out_features());
    let dims = LaunchDims::linear(
        shape.n_tiles.div_ceil(tiles.mma_warps_per_block),
        tiles.mma_warps_per_block * target.warp_size,
    );
    for start in (0..m).step_by(MMA_MAX_ROWS) {
        let rows = (m - start).min(MMA_MAX_ROWS);
        let chunk = ChunkArgs::new(x, y, residual, start, rows, k, n_out)?;
        // Both kernels index only what is checked here: X, Y and the residual were checked
        // against (m, n, k) and the chunk's rows lie within them; the weights were laid out for
        // (n_tiles, k_groups) (layout.rs, Wmma*).
        match weights {
            WmmaWeights::Nvfp4 {
                words,
                scales,
                global_scale,
            } => {
                let kernel = variant(&WMMA_NVFP4_KERNELS, 16, rows)?;
                let args = wmma_nvfp4_arguments(chunk, words, scales, global_scale, shape);
                // SAFETY: gemm_nvfp4_bf16_wmma_m*'s parameters in order
                // (wmma_nvfp4_arguments); bounds as above.
                unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
            }
            WmmaWeights::Bf16 { values } => {
                let kernel = variant(&WMMA_BF16_KERNELS, 16, rows)?;
                let args = wmma_bf16_arguments(chunk, values, shape);
                // SAFETY: gemm_bf16_bf16_wmma_m*'s parameters in order (wmma_bf16_arguments);
                // bounds as above.
                unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
            }
        }
    }
    Ok(())
}

/// The W4A4 path: quantise X (`quantize_nvfp4_rows`), then `gemm_nvfp4_nvfp4_mma_m*` in chunks
/// of [`W4A4_MAX_ROWS`] rows, alpha = input_scale * weight_scale_2.
#[allow(clippy::too_many_arguments)]
fn linear_w4a4(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    weights: W4a4Weights<'_>,
    epilogue: &Epilogue<'_>,
    residual: Option<&DeviceVec<bf16>>,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let target = device_target(backend)?;
    let (k, n_out) = (w.grid.cols, w.out_features());
    let blocks = (m * k / 16) as u64;
    let mut packed = backend.zeros::<u8>(m * k / 2)?;
    let mut code_scales = backend.zeros::<u8>(m * k / 16)?;
    let grid = u32::try_from(blocks.div_ceil(u64::from(QUANTIZE_THREADS))).map_err(|_| {
        Error::invalid(
            "W4A4 activations",
            format!("[{m}, {k}] is too large for one launch"),
        )
    })?;
    let args = quantize_arguments(
        x,
        weights.input_scale,
        &mut packed,
        &mut code_scales,
        blocks,
    );
    // SAFETY: quantize_nvfp4_rows's parameters in order (quantize_arguments); X holds
    // blocks * 16 bf16, the outputs blocks * 8 and blocks bytes.
    unsafe {
        backend.launch(
            FAMILY,
            KERNEL_QUANTIZE_NVFP4_ROWS,
            &LaunchDims::linear(grid, QUANTIZE_THREADS),
            &args,
        )
    }?;

    let tiles = &target.gemm;
    let shape = TileShape::new(w, epilogue)?;
    let dims = LaunchDims::linear(
        shape.n_tiles.div_ceil(tiles.mma_warps_per_block),
        tiles.mma_warps_per_block * target.warp_size,
    );
    for start in (0..m).step_by(W4A4_MAX_ROWS) {
        let rows = (m - start).min(W4A4_MAX_ROWS);
        let kernel = variant(&W4A4_KERNELS, 8, rows)?;
        let codes = KernelArg::input_range(&packed, start * k / 2..(start + rows) * k / 2)?;
        let row_scales =
            KernelArg::input_range(&code_scales, start * k / 16..(start + rows) * k / 16)?;
        let chunk = ChunkArgs::new(x, y, residual, start, rows, k, n_out)?;
        let args = w4a4_arguments(codes, row_scales, chunk, weights, shape);
        // SAFETY: gemm_nvfp4_nvfp4_mma_m*'s parameters in order (w4a4_arguments); the codes and
        // scales hold `rows` quantised rows of K, the weights were laid out for (n_tiles,
        // k_groups), Y and the residual were checked against (m, n).
        unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{launch_check, table};
    use crate::target;

    #[test]
    fn the_quantiser_block_is_the_templates() {
        crate::kernels::table::assert_defines(
            super::FAMILY,
            |t| t.instructions.mma_block_scaled_fp4,
            &[("QUANTIZE_THREADS", super::QUANTIZE_THREADS.to_string())],
        );
    }

    /// Every launch's argument list (the functions the launches build them with) meets the
    /// compiled kernel's parameters on every target whose instructions select it: count, kinds
    /// and scalar widths (sm_90a / sm_121a: the PTX parameter types; gfx1151: the code object's
    /// metadata through the HIP launch check).
    #[test]
    fn every_argument_list_meets_the_compiled_kernels_parameters() {
        let x = DeviceVec::Host(vec![bf16::ZERO; 64]);
        let mut y = DeviceVec::Host(vec![bf16::ZERO; 64]);
        let residual = DeviceVec::Host(vec![bf16::ZERO; 64]);
        let words = DeviceVec::Host(vec![0u32; 8]);
        let scales_u16 = DeviceVec::Host(vec![0u16; 8]);
        let scales_u32 = DeviceVec::Host(vec![0u32; 8]);
        let values = DeviceVec::Host(vec![0u16; 8]);
        let mut partials = DeviceVec::Host(vec![0f32; 8]);
        let mut counters = DeviceVec::Host(vec![0u32; 8]);
        let (mut codes, mut code_scales) =
            (DeviceVec::Host(vec![0u8; 8]), DeviceVec::Host(vec![0u8; 1]));
        let plain = Nvfp4Weights {
            rows: 1,
            cols: 16,
            packed: DeviceVec::Host(vec![0u8; 8]),
            scales: DeviceVec::Host(vec![0u8; 1]),
            global_scale: 1.0,
        };
        let w4a4 = W4a4Weights {
            words: &words,
            scales: &scales_u32,
            global_scale: 1.0,
            input_scale: 1.0,
        };
        let shape = TileShape {
            n: 1,
            k: 16,
            n_tiles: 1,
            k_groups: 1,
            epilogue: 0,
        };
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            let name = t.name.as_str();
            let args = gemv_arguments(&x, &plain, &mut y, [1, 1, 16]);
            checks.check(name, KERNEL_GEMM_NVFP4_BF16_GEMV, &args);
            let kernels: &[&str] = match TensorCore::for_target(t).expect("tensor cores") {
                TensorCore::MmaSync if wgmma_rendered(t) => &[
                    &MMA_NVFP4_KERNELS[..],
                    &MMA_BF16_KERNELS[..],
                    &STREAM_NVFP4_KERNELS[..],
                    &[WGMMA_NVFP4_KERNEL, WGMMA_BF16_KERNEL][..],
                ]
                .concat(),
                TensorCore::MmaSync if t.instructions.cp_async => &[
                    &MMA_NVFP4_KERNELS[..],
                    &MMA_BF16_KERNELS[..],
                    &STREAM_NVFP4_KERNELS[..],
                ]
                .concat(),
                TensorCore::MmaSync => &[&MMA_NVFP4_KERNELS[..], &MMA_BF16_KERNELS[..]].concat(),
                TensorCore::Wmma => &[&WMMA_NVFP4_KERNELS[..], &WMMA_BF16_KERNELS[..]].concat(),
            };
            for &kernel in kernels {
                let chunk = ChunkArgs::new(&x, &mut y, Some(&residual), 0, 1, 16, 1).expect("rows");
                let split = SplitArgs {
                    partials: KernelArg::optional_output(Some(&mut partials)),
                    counters: KernelArg::optional_output(Some(&mut counters)),
                    groups_per_split: 1,
                    warps_per_tile: 1,
                };
                // the stream and wgmma kernels take the mma kernels' arguments
                if MMA_NVFP4_KERNELS.contains(&kernel)
                    || STREAM_NVFP4_KERNELS.contains(&kernel)
                    || kernel == WGMMA_NVFP4_KERNEL
                {
                    checks.check(
                        name,
                        kernel,
                        &mma_nvfp4_arguments(chunk, &words, &scales_u16, 1.0, split, shape),
                    );
                } else if MMA_BF16_KERNELS.contains(&kernel) || kernel == WGMMA_BF16_KERNEL {
                    checks.check(
                        name,
                        kernel,
                        &mma_bf16_arguments(chunk, &words, split, shape),
                    );
                } else if WMMA_NVFP4_KERNELS.contains(&kernel) {
                    checks.check(
                        name,
                        kernel,
                        &wmma_nvfp4_arguments(chunk, &words, &scales_u32, 1.0, shape),
                    );
                } else {
                    checks.check(name, kernel, &wmma_bf16_arguments(chunk, &values, shape));
                }
            }
            if t.instructions.mma_block_scaled_fp4 {
                let args = quantize_arguments(&x, 1.0, &mut codes, &mut code_scales, 1);
                checks.check(name, KERNEL_QUANTIZE_NVFP4_ROWS, &args);
                for kernel in W4A4_KERNELS {
                    let chunk = ChunkArgs::new(&x, &mut y, None, 0, 1, 16, 1).expect("rows");
                    let args = w4a4_arguments(
                        KernelArg::input(&codes),
                        KernelArg::input(&code_scales),
                        chunk,
                        w4a4,
                        shape,
                    );
                    checks.check(name, kernel, &args);
                }
            }
        }
        checks.assert_all_match();
    }

    /// Every kernel a launch names is defined by the gemm source of each target whose
    /// instructions select it (a misspelt name would only show on that device).
    #[test]
    fn the_launched_kernels_exist_for_every_target_that_selects_them() {
        for t in target::all() {
            let source = table::rendered(&t.name, FAMILY).expect("gemm is rendered");
            let mut used = vec![KERNEL_GEMM_NVFP4_BF16_GEMV];
            match TensorCore::for_target(t).expect("every target has tensor cores") {
                TensorCore::MmaSync => {
                    used.extend(MMA_NVFP4_KERNELS.iter().chain(&MMA_BF16_KERNELS));
                    if t.instructions.cp_async {
                        used.extend(STREAM_NVFP4_KERNELS);
                    }
                    if wgmma_rendered(t) {
                        used.extend([WGMMA_NVFP4_KERNEL, WGMMA_BF16_KERNEL]);
                    }
                }
                TensorCore::Wmma => {
                    used.extend(WMMA_NVFP4_KERNELS.iter().chain(&WMMA_BF16_KERNELS))
                }
            }
            if t.instructions.mma_block_scaled_fp4 {
                used.extend(W4A4_KERNELS);
                used.push(KERNEL_QUANTIZE_NVFP4_ROWS);
            }
            for kernel in used {
                assert!(
                    source.kernels.contains(&kernel),
                    "{}: `{kernel}` is not among the rendered gemm kernels {:?}",
                    t.name,
                    source.kernels
                );
            }
        }
    }

    /// The stream plan keeps a block's X within `stream_max_x_bytes` by splitting K, covers every
    /// K group, and is the mma plan (on its warps per block) where X fits.
    #[test]
    fn the_stream_plan_keeps_x_within_its_budget() {
        for t in target::all().iter().filter(|t| t.instructions.cp_async) {
            let tiles = &t.gemm;
            for (n, k) in MODEL_SHAPES
                .into_iter()
                .chain([(248320, 2048), (65536, 4096)])
            {
                let (n_tiles, k_groups) = (n.div_ceil(16), k.div_ceil(64));
                for rows in [1, 3, 8, 16] {
                    let plan = stream_plan(n_tiles, k_groups, rows, tiles, t.multiprocessors);
                    let x = rows * (plan.groups_per_split as usize * 64 + 8) * 2;
                    assert!(
                        x <= tiles.stream_max_x_bytes as usize,
                        "{}: ({n}, {k}) x {rows}: {plan:?}",
                        t.name
                    );
                    assert!(
                        stream_shared_bytes(tiles, rows, plan.groups_per_split)
                            <= t.max_shared_bytes_per_block as usize
                    );
                    assert!(plan.splits as usize * plan.groups_per_split as usize >= k_groups);
                    assert!(
                        (plan.splits as usize - 1) * (plan.groups_per_split as usize) < k_groups
                    );
                    let mma = mma_plan(
                        n_tiles,
                        k_groups,
                        tiles.stream_warps_per_block,
                        t.multiprocessors,
                        tiles.mma_min_warps_per_sm,
                        tiles.mma_min_groups_per_split,
                    );
                    if rows * (mma.groups_per_split as usize * 64 + 8) * 2
                        <= tiles.stream_max_x_bytes as usize
                    {
                        assert_eq!(plan, mma, "{}: ({n}, {k}) x {rows}", t.name);
                    }
                }
            }
        }
    }

    /// Where X streams through shared memory the plan keeps the tile's warps within
    /// `mma_x_shared_max_warps_per_tile`, covers every K group, and the ring (with the warps'
    /// sums) fits a block's shared memory and the resident blocks the launch bounds ask for.
    #[test]
    fn the_x_shared_plan_fits_the_ring() {
        for t in target::all().iter().filter(|t| t.instructions.cp_async) {
            let tiles = &t.gemm;
            let most =
                t.max_shared_bytes_per_block as usize / tiles.mma_x_shared_blocks_per_sm as usize;
            assert!(!mma_x_shared(t, tiles.mma_x_shared_min_rows as usize - 9));
            for (n, k) in MODEL_SHAPES
                .into_iter()
                .chain([(248320, 2048), (65536, 4096), (37, 528)])
            {
                let (n_tiles, k_groups) = (n.div_ceil(16), k.div_ceil(64));
                for rows in [33, 50, 64] {
                    if !mma_x_shared(t, rows) {
                        continue;
                    }
                    let plan = x_shared_plan(n_tiles, k_groups, tiles, t.multiprocessors);
                    assert!(plan.warps_per_tile <= tiles.mma_x_shared_max_warps_per_tile);
                    assert!(plan.splits as usize * plan.groups_per_split as usize >= k_groups);
                    // in a cluster or not: the sums take the ring's place whenever asked for
                    for in_cluster in [false, true] {
                        let bytes = x_shared_bytes(tiles, rows, &plan, in_cluster);
                        assert!(
                            bytes <= most,
                            "{}: ({n}, {k}) x {rows}: {bytes} bytes for {plan:?}",
                            t.name
                        );
                    }
                }
            }
        }
    }

    /// wave_plan: the attention q/k/v at M = 1..16 (576 tiles, 32 K groups, 8-warp blocks; mma_plan
    /// gives 2 warps per tile, 144 blocks) doubles to 4 warps per tile where 288 blocks are resident
    /// at once, not where only 264 are, to 8 where 576 are; a split plan, or one already at the
    /// block's warps, stays as it is.
    #[test]
    fn wave_plan_widens_tiles_within_one_wave() {
        let tiles = 576usize;
        let blocks = |p: &MmaPlan| (tiles as u32).div_ceil(8 / p.warps_per_tile) * p.splits;
        let plan = mma_plan(tiles, 32, 8, 132, 8, 8);
        assert_eq!(
            plan,
            MmaPlan {
                warps_per_tile: 2,
                splits: 1,
                groups_per_split: 32
            }
        );
        assert_eq!(wave_plan(plan, 8, 396, blocks).warps_per_tile, 4);
        assert_eq!(wave_plan(plan, 8, 264, blocks), plan);
        assert_eq!(wave_plan(plan, 8, 576, blocks).warps_per_tile, 8);
        assert_eq!(wave_plan(plan, 4, 10_000, blocks).warps_per_tile, 4);
        let split = MmaPlan {
            warps_per_tile: 2,
            splits: 2,
            groups_per_split: 16,
        };
        assert_eq!(wave_plan(split, 8, 10_000, blocks), split);
        for resident in [0, 100, 300, 600] {
            let p = wave_plan(plan, 8, resident, blocks);
            assert_eq!((p.splits, p.groups_per_split), (1, 32));
            assert!(p == plan || blocks(&p) <= resident);
        }
    }

    /// The cluster partitions: none without clusters, a knob of 0 or a plan without splits; the
    /// plan itself for the variants that load X from global memory when its splits are within
    /// their bound; for the X-ring variants every split count from the plan's (within the bound)
    /// down to 2, each covering K with no split empty, distinct.
    #[test]
    fn cluster_candidates_follow_the_knobs_and_cover_k() {
        let mut t = target::by_name("sm_90a").expect("sm_90a").clone();
        let gfx = target::by_name("gfx1151").expect("gfx1151");
        let l2_plan = MmaPlan {
            warps_per_tile: 2,
            splits: 6,
            groups_per_split: 11,
        };
        assert!(cluster_candidates(gfx, 64, &l2_plan, 64).is_empty());
        t.gemm.mma_x_shared_cluster_max_splits = 0;
        t.gemm.mma_cluster_max_splits = 2;
        assert!(cluster_candidates(&t, 64, &l2_plan, 64).is_empty());
        let pair = MmaPlan {
            warps_per_tile: 8,
            splits: 2,
            groups_per_split: 32,
        };
        assert_eq!(cluster_candidates(&t, 1, &pair, 64), vec![pair]);
        let three = MmaPlan { splits: 3, ..pair };
        assert!(cluster_candidates(&t, 1, &three, 64).is_empty());
        let whole = MmaPlan { splits: 1, ..pair };
        assert!(cluster_candidates(&t, 1, &whole, 64).is_empty());
        t.gemm.mma_x_shared_cluster_max_splits = 8;
        let candidates = cluster_candidates(&t, 64, &l2_plan, 64);
        let shapes: Vec<(u32, u32)> = candidates
            .iter()
            .map(|p| (p.splits, p.groups_per_split))
            .collect();
        assert_eq!(shapes, [(6, 11), (5, 13), (4, 16), (3, 22), (2, 32)]);
        for p in &candidates {
            assert_eq!(p.warps_per_tile, 2);
            assert!(p.splits as usize * p.groups_per_split as usize >= 64);
            assert!((p.splits as usize - 1) * (p.groups_per_split as usize) < 64);
        }
        // 9 groups: 4 and 3 splits spread them alike (3 groups each), offered once
        let small = MmaPlan {
            warps_per_tile: 2,
            splits: 4,
            groups_per_split: 3,
        };
        let shapes: Vec<(u32, u32)> = cluster_candidates(&t, 64, &small, 9)
            .iter()
            .map(|p| (p.splits, p.groups_per_split))
            .collect();
        assert_eq!(shapes, [(3, 3), (2, 5)]);
    }

    /// On sm_90a the warpgroup kernel takes the launches of more than 32 rows over the lm_head
    /// (at least `gemm.wgmma_min_tiles` tiles) and runs them unsplit, their blocks filling the
    /// device on their own; the model's other projections stay on mma.sync, and where their blocks
    /// leave slots empty the plan still splits K.
    #[test]
    fn the_wgmma_kernel_takes_the_lm_head_unsplit() {
        let t = target::by_name("sm_90a").expect("sm_90a");
        let lm_head_tiles = 248320 / 16;
        assert!(mma_wgmma(t, 64, lm_head_tiles) && mma_wgmma(t, 33, lm_head_tiles));
        assert!(!mma_wgmma(t, 32, lm_head_tiles));
        for (n, _) in MODEL_SHAPES {
            assert!(!mma_wgmma(t, 64, n / 16), "({n}) is not the lm_head");
        }
        let lm_head = wgmma_plan(lm_head_tiles, 32, &t.gemm, 132);
        assert_eq!((lm_head.splits, lm_head.groups_per_split), (1, 32));
        let in_proj = wgmma_plan(12352 / 16, 32, &t.gemm, 132);
        assert!(in_proj.splits > 1, "{in_proj:?}");
    }

    /// The wgmma plan covers every K group with no split empty, keeps at least
    /// `wgmma_min_groups_per_split` groups per split where it splits at all, and its launch holds
    /// every quad of 16-row tiles within the target's shared memory.
    #[test]
    fn the_wgmma_plan_covers_k_in_whole_splits() {
        for t in target::all().iter().filter(|t| wgmma_rendered(t)) {
            let tiles = &t.gemm;
            for (n, k) in MODEL_SHAPES.into_iter().chain([
                (248320, 2048),
                (65536, 4096),
                (16, 16),
                (100, 528),
            ]) {
                let (n_tiles, k_groups) = (n.div_ceil(16), k.div_ceil(64));
                let plan = wgmma_plan(n_tiles, k_groups, tiles, t.multiprocessors);
                let (splits, groups) = (plan.splits as usize, plan.groups_per_split as usize);
                assert!(splits * groups >= k_groups, "{n}x{k}: {plan:?}");
                assert!(
                    (splits - 1) * groups < k_groups,
                    "{n}x{k}: empty split {plan:?}"
                );
                assert!(
                    splits == 1 || groups >= tiles.wgmma_min_groups_per_split as usize,
                    "{n}x{k}: {plan:?}"
                );
                for nvfp4 in [true, false] {
                    let dims = wgmma_dims(t, &plan, n_tiles as u32, nvfp4);
                    let quads = dims.grid.0 as usize * tiles.wgmma_warpgroups_per_block as usize;
                    assert!(quads * 4 >= n_tiles, "{n}x{k}: {dims:?}");
                    assert!(dims.shared_bytes <= t.max_shared_bytes_per_block, "{n}x{k}");
                }
            }
        }
    }

    /// The X-ring plan splits K only where the tiles alone leave warps idle, and then into the
    /// split count that fills its waves of 12-warp blocks (one per SM on 132 SMs) best: the
    /// attention q projection (8192, 2048) 3 splits (258 blocks, two waves of 11 groups; 2 were
    /// 172 blocks, two waves of 16), the GDN out_proj (2048, 4096) 6 (132 blocks, one wave; the
    /// warps alone asked for 5), the GDN in_proj (12352, 2048) and the lm_head none.
    #[test]
    fn the_x_shared_plan_fills_its_waves() {
        let mut tiles = target::by_name("sm_90a").expect("sm_90a").gemm.clone();
        tiles.mma_x_shared_warps_per_block = 12;
        tiles.mma_x_shared_blocks_per_sm = 1;
        tiles.mma_x_shared_max_warps_per_tile = 2;
        tiles.mma_min_warps_per_sm = 8;
        tiles.mma_x_shared_min_groups_per_split = 4;
        for ((n, k), splits, groups) in [
            ((8192, 2048), 3, 11),
            ((2048, 4096), 6, 11),
            ((12352, 2048), 1, 32),
            ((248320, 2048), 1, 32),
        ] {
            let plan = x_shared_plan(n / 16, k / 64, &tiles, 132);
            assert_eq!(
                (plan.splits, plan.groups_per_split),
                (splits, groups),
                "({n}, {k}): {plan:?}"
            );
        }
    }

    /// The instruction comes from the target's table, not its name.
    #[test]
    fn the_tensor_core_is_chosen_by_instructions() {
        let mut t = target::by_name("gfx1151").expect("gfx1151").clone();
        assert_eq!(TensorCore::for_target(&t).ok(), Some(TensorCore::Wmma));
        t.instructions.mma_sync_bf16 = true;
        assert_eq!(TensorCore::for_target(&t).ok(), Some(TensorCore::MmaSync));
        t.instructions.mma_sync_bf16 = false;
        t.instructions.wmma_bf16 = false;
        let e = TensorCore::for_target(&t).unwrap_err().to_string();
        assert!(e.contains("gfx1151") && e.contains("neither"), "{e}");
    }

    /// Each chunk of rows runs on the smallest variant that holds it.
    #[test]
    fn each_row_count_gets_the_smallest_variant_that_holds_it() {
        for (rows, mma, wmma) in [
            (1, "m8", "m16"),
            (8, "m8", "m16"),
            (9, "m16", "m16"),
            (16, "m16", "m16"),
            (17, "m32", "m32"),
            (32, "m32", "m32"),
            (33, "m48", "m64"),
            (48, "m48", "m64"),
            (49, "m64", "m64"),
            (64, "m64", "m64"),
        ] {
            let got = mma_variant(&MMA_NVFP4_KERNELS, rows).expect("fits");
            assert!(got.ends_with(&format!("_{mma}")), "{rows} rows: {got}");
            let got = variant(&WMMA_BF16_KERNELS, 16, rows).expect("fits");
            assert!(got.ends_with(&format!("_{wmma}")), "{rows} rows: {got}");
        }
        assert_eq!(
            variant(&W4A4_KERNELS, 8, W4A4_MAX_ROWS).ok(),
            Some("gemm_nvfp4_nvfp4_mma_m32")
        );
        let e = mma_variant(&MMA_BF16_KERNELS, MMA_MAX_ROWS + 1).unwrap_err();
        assert!(e.to_string().contains("65 rows"), "{e}");
    }
}
