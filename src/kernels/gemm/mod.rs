//! Family `gemm`: `Y[M, N] = X[M, K] (bf16) * W[N, K]^T` for NVFP4 and bf16 weights, fp32
//! accumulation, bf16 out (`kernels/templates/gemm.cu`).
//!
//! Kernels, by target:
//! - `gemm_nvfp4_bf16_gemv` (all): the straightforward one (one warp per output column, plain
//!   layout, no tensor cores), kept as the reference GPU version: [`nvfp4_gemm`].
//! - `gemm_{nvfp4,bf16}_bf16_mma_m{8,16,32,64}` (sm_90a, sm_121a): the weight-streaming
//!   tensor-core kernels on `mma.sync.m16n8k16`, on weights re-laid out once at load
//!   ([`layout`]) into a [`Linear`]: [`linear`]. W is the A operand, so M = 1..64 rows cost
//!   1..8 MMAs per weight fragment and the weights are read once whatever M is. Each tile gets
//!   1..8 warps ([`mma_plan`]: the fewest that fill the device), K is split across blocks only
//!   when even that does not, and the last block of a tile adds the splits in order
//!   (deterministic). Epilogues: residual add, `silu(gate) * up` ([`RowOrder::GateUp`]).
//! - `quantize_nvfp4_rows` + `gemm_nvfp4_nvfp4_mma_m{8,16,32}` (sm_121a): W4A4 on the
//!   block-scaled FP4 MMA, chosen per model with [`Nvfp4Mode`]; compiled and emulated here
//!   ([`reference::nvfp4_w4a4_f32`]), not run (no GB10).
//! - `gemm_{nvfp4,bf16}_bf16_wmma_m{16,32,64}` (gfx1151): the same product on
//!   `v_wmma_f32_16x16x16_bf16`, layouts in [`layout`]; compiled, launched by the HIP backend.
//!
//! Why registers and not a shared-memory pipeline: every weight byte is used by exactly one warp,
//! so a `cp.async` stage through shared memory would only add a copy; each lane's global load is
//! its MMA fragment and `mma_stages_*` (targets.toml) groups stay in flight per warp. Measured on
//! the H200 (BENCHMARKS.md): bf16 weights stream at 92% of the copy bandwidth at M = 1; NVFP4 at
//! 65%, latency-bound by its decode and register use (ncu) rather than by this choice; M = 64 is
//! slow because X fragments are re-read per tile, which is where a shared X tile will pay.
//!
//! The bytes a GEMM must move at least are [`nvfp4_gemm_bytes`] / [`Linear::bytes`]; benches
//! report achieved bandwidth against them.

pub mod layout;
pub mod reference;

pub use layout::RowOrder;

use super::{Nvfp4Weights, check_len, check_u32};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, DeviceVec};
use crate::error::{Error, Result};
use crate::formats::nvfp4::Nvfp4Matrix;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use layout::{Bf16Fragments, Nvfp4Fragments};

/// The family name (template and module).
pub const FAMILY: &str = "gemm";
/// The straightforward NVFP4 x bf16 kernel: one warp per output column.
pub const KERNEL_GEMM_NVFP4_BF16_GEMV: &str = "gemm_nvfp4_bf16_gemv";

/// The fewest bytes `Y = X * dequant(W)^T` can move: W's packed nibbles and scales, X and Y
/// each once.
pub fn nvfp4_gemm_bytes(m: usize, w: &Nvfp4Weights) -> u64 {
    w.bytes() + 2 * (m * w.cols) as u64 + 2 * (m * w.rows) as u64
}

/// Computes `y = x * dequant(w)^T` for `m` rows: `x` is bf16 `[m, w.grid.cols]`, `y` bf16
/// `[m, w.grid.rows]`, both row-major. `m == 0` does nothing.
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
        // Transitional: this family still launches through cudarc; it runs on HIP once it
        // moves onto Backend::launch.
        Backend::Hip(_) => Err(backend.no_launch_yet(FAMILY)),
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

enum LinearStorage {
    HostNvfp4(Nvfp4Matrix),
    HostW4a4 {
        matrix: Nvfp4Matrix,
        input_scale: f32,
    },
    CudaW4a4 {
        words: CudaSlice<u32>,
        scales: CudaSlice<u32>,
        global_scale: f32,
        input_scale: f32,
    },
    HostBf16(Vec<bf16>),
    CudaNvfp4 {
        words: CudaSlice<u32>,
        scales: CudaSlice<u16>,
        global_scale: f32,
    },
    CudaBf16 {
        words: CudaSlice<u32>,
    },
}

/// A linear layer's weight `W[rows, cols]` on a backend, in the layout its kernels consume:
/// the plain matrix on the CPU, [`layout`] fragments on CUDA.
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
    /// An NVFP4 weight. `row_order` is [`RowOrder::GateUp`] for a `[gate; up]` weight that will
    /// run with [`Epilogue::SiluMul`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for a malformed matrix (buffer lengths, NaN scales, odd gate/up rows),
    /// [`Error::Cuda`] when the upload fails.
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
        let fragments = Nvfp4Fragments::new(matrix, row_order)?;
        let storage = match backend {
            // Transitional: the gemm family has no HIP launch yet (weights are laid out for
            // its cudarc launches).
            Backend::Hip(_) => return Err(backend.no_launch_yet(FAMILY)),
            Backend::Cpu => LinearStorage::HostNvfp4(matrix.clone()),
            Backend::Cuda(cuda) => LinearStorage::CudaNvfp4 {
                words: upload(cuda, &fragments.words, "NVFP4 weight words")?,
                scales: upload(cuda, &fragments.scales, "NVFP4 weight scales")?,
                global_scale: matrix.global_scale,
            },
        };
        Ok(Self {
            format: WeightFormat::Nvfp4,
            grid: fragments.grid,
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
    /// block scale is NaN, or the CUDA device's target has no block-scaled FP4 MMA (use
    /// [`Nvfp4Mode::W4a16`] there); [`Error::Cuda`] when the upload fails.
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
        let storage = match backend {
            // Transitional: the gemm family has no HIP launch yet (weights are laid out for
            // its cudarc launches).
            Backend::Hip(_) => return Err(backend.no_launch_yet(FAMILY)),
            Backend::Cpu => LinearStorage::HostW4a4 {
                matrix: matrix.clone(),
                input_scale,
            },
            Backend::Cuda(cuda) => {
                if !cuda.target().instructions.mma_block_scaled_fp4 {
                    return Err(Error::invalid(
                        "W4A4 weight",
                        format!(
                            "target {} has no block-scaled FP4 MMA; run this model with W4A16",
                            cuda.target().name
                        ),
                    ));
                }
                LinearStorage::CudaW4a4 {
                    words: upload(cuda, &fragments.words, "W4A4 weight words")?,
                    scales: upload(cuda, &fragments.scales, "W4A4 weight scales")?,
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
    /// [`Error::Invalid`] when `values` does not match the shape or K is not a positive
    /// multiple of 16, [`Error::Cuda`] when the upload fails.
    pub fn bf16(
        backend: &Backend,
        values: &[bf16],
        rows: usize,
        cols: usize,
        row_order: RowOrder,
    ) -> Result<Self> {
        let fragments = Bf16Fragments::new(values, rows, cols, row_order)?;
        let storage = match backend {
            // Transitional: the gemm family has no HIP launch yet (weights are laid out for
            // its cudarc launches).
            Backend::Hip(_) => return Err(backend.no_launch_yet(FAMILY)),
            Backend::Cpu => LinearStorage::HostBf16(values.to_vec()),
            Backend::Cuda(cuda) => LinearStorage::CudaBf16 {
                words: upload(cuda, &fragments.words, "bf16 weight words")?,
            },
        };
        Ok(Self {
            format: WeightFormat::Bf16,
            grid: fragments.grid,
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

fn upload<T: cudarc::driver::DeviceRepr>(
    cuda: &CudaBackend,
    data: &[T],
    what: &str,
) -> Result<CudaSlice<T>> {
    cuda.stream()
        .clone_htod(data)
        .map_err(|e| Error::cuda(format!("upload {what} ({} elements)", data.len()), e))
}

/// `y = epilogue(x * w^T)` for `m` rows: `x` bf16 `[m, w.in_features()]`, `y` bf16
/// `[m, w.out_features()]`, row-major. `m == 0` does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shapes, the epilogue does not
/// fit the weight's row order, or a dimension exceeds the kernels' range;
/// [`Error::BackendMismatch`] when buffers live elsewhere; [`Error::Compile`] / [`Error::Cuda`]
/// from the CUDA path.
pub fn linear(
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    epilogue: Epilogue<'_>,
    y: &mut DeviceVec<bf16>,
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
                _ => {
                    return Err(Error::BackendMismatch {
                        what: "linear weight".into(),
                        expected: "cpu",
                        found: "cuda",
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
        // Transitional: this family still launches through cudarc; it runs on HIP once it
        // moves onto Backend::launch.
        Backend::Hip(_) => Err(backend.no_launch_yet(FAMILY)),
        Backend::Cuda(cuda) => linear_cuda(cuda, backend, x, m, w, &epilogue, y),
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
    let most = (k_groups / min_groups_per_split as usize).max(1);
    let splits = splits_wanted.clamp(1, most);
    let groups_per_split = k_groups.div_ceil(splits).max(1);
    MmaPlan {
        warps_per_tile,
        splits: k_groups.div_ceil(groups_per_split).max(1) as u32,
        groups_per_split: groups_per_split as u32,
    }
}

fn linear_cuda(
    cuda: &CudaBackend,
    backend: &Backend,
    x: &DeviceVec<bf16>,
    m: usize,
    w: &Linear,
    epilogue: &Epilogue<'_>,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let DeviceVec::Cuda(x) = x else {
        return Err(backend.mismatch("linear input X", x));
    };
    let DeviceVec::Cuda(y) = y else {
        return Err(backend.mismatch("linear output Y", y));
    };
    let residual = match epilogue {
        Epilogue::Residual(DeviceVec::Cuda(r)) => Some(r),
        Epilogue::Residual(r) => return Err(backend.mismatch("linear residual", r)),
        _ => None,
    };
    let (k, n_out) = (w.grid.cols, w.out_features());
    if let LinearStorage::CudaW4a4 {
        words,
        scales,
        global_scale,
        input_scale,
    } = &w.storage
    {
        return linear_w4a4(
            cuda,
            x,
            m,
            w,
            (words, scales, *global_scale, *input_scale),
            epilogue,
            residual,
            y,
        );
    }
    let tiles = &cuda.target().gemm;
    let plan = mma_plan(
        w.grid.n_tiles,
        w.grid.k_groups,
        tiles.mma_warps_per_block,
        cuda.multiprocessors(),
        tiles.mma_min_warps_per_sm,
        tiles.mma_min_groups_per_split,
    );
    let (n32, k32) = (check_u32("linear N", n_out)?, check_u32("linear K", k)?);
    let (n_tiles, k_groups) = (
        check_u32("linear tiles", w.grid.n_tiles)?,
        check_u32("linear K groups", w.grid.k_groups)?,
    );
    let epilogue_code = epilogue.kernel_code();
    let format = match w.format {
        // W4A4 weights took the branch above
        WeightFormat::Nvfp4 | WeightFormat::Nvfp4W4a4 => "nvfp4",
        WeightFormat::Bf16 => "bf16",
    };
    for start in (0..m).step_by(MMA_MAX_ROWS) {
        let rows = (m - start).min(MMA_MAX_ROWS);
        let kernel = format!(
            "gemm_{format}_bf16_mma_m{}",
            rows.div_ceil(8).next_power_of_two() * 8
        );
        let m_tiles = rows.div_ceil(8).next_power_of_two();
        let scratch = if plan.splits > 1 {
            Some(cuda.split_k_scratch(
                w.grid.n_tiles * plan.splits as usize * 32 * m_tiles * 4,
                w.grid.n_tiles,
            )?)
        } else {
            None
        };
        let function = cuda.function(FAMILY, &kernel)?;
        let x_rows = x.slice(start * k..(start + rows) * k);
        let mut y_rows = y.slice_mut(start * n_out..(start + rows) * n_out);
        let residual_rows = residual.map(|r| r.slice(start * n_out..(start + rows) * n_out));
        let (partials_ptr, counters_ptr) = match &scratch {
            Some(s) => match (&s.partials, &s.counters) {
                (Some(p), Some(c)) => {
                    (p.device_ptr(cuda.stream()).0, c.device_ptr(cuda.stream()).0)
                }
                _ => (0, 0),
            },
            None => (0, 0),
        };
        let residual_ptr = residual_rows
            .as_ref()
            .map_or(0, |r| r.device_ptr(cuda.stream()).0);
        let m32 = rows as u32;
        let config = LaunchConfig {
            grid_dim: (
                n_tiles.div_ceil(tiles.mma_warps_per_block / plan.warps_per_tile),
                plan.splits,
                1,
            ),
            block_dim: (tiles.mma_warps_per_block * cuda.target().warp_size, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = cuda.stream().launch_builder(&function);
        launch.arg(&x_rows);
        let alpha = match &w.storage {
            LinearStorage::CudaNvfp4 {
                words,
                scales,
                global_scale,
            } => {
                launch.arg(words).arg(scales);
                global_scale * 128.0
            }
            LinearStorage::CudaBf16 { words } => {
                launch.arg(words);
                1.0
            }
            _ => {
                return Err(Error::BackendMismatch {
                    what: "linear weight".into(),
                    expected: "cuda",
                    found: "cpu",
                });
            }
        };
        launch
            .arg(&alpha)
            .arg(&mut y_rows)
            .arg(&residual_ptr)
            .arg(&partials_ptr)
            .arg(&counters_ptr)
            .arg(&m32)
            .arg(&n32)
            .arg(&k32)
            .arg(&n_tiles)
            .arg(&k_groups)
            .arg(&plan.groups_per_split)
            .arg(&plan.warps_per_tile)
            .arg(&epilogue_code);
        // SAFETY: argument types and order match gemm.cu's gemm_*_mma_m* signatures; X, Y and the
        // residual were checked against (m, n, k); the weights were laid out for (n_tiles,
        // k_groups); the split-K scratch holds n_tiles * splits * 32 * 4 * m_tiles floats and
        // n_tiles zeroed counters, and its guard is held until the launch is queued.
        unsafe { launch.launch(config) }.map_err(|e| {
            Error::cuda(
                format!(
                    "launch {kernel} M={rows} N={n_out} K={k} splits={}",
                    plan.splits
                ),
                e,
            )
        })?;
        drop(scratch);
    }
    Ok(())
}

/// The W4A4 path: quantise X (`quantize_nvfp4_rows`), then `gemm_nvfp4_nvfp4_mma_m*` in chunks
/// of [`W4A4_MAX_ROWS`] rows, alpha = input_scale * weight_scale_2.
#[allow(clippy::too_many_arguments)]
fn linear_w4a4(
    cuda: &CudaBackend,
    x: &CudaSlice<bf16>,
    m: usize,
    w: &Linear,
    (words, scales, global_scale, input_scale): (&CudaSlice<u32>, &CudaSlice<u32>, f32, f32),
    epilogue: &Epilogue<'_>,
    residual: Option<&CudaSlice<bf16>>,
    y: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (k, n_out) = (w.grid.cols, w.out_features());
    let blocks = (m * k / 16) as u64;
    let stream = cuda.stream();
    let mut packed = stream
        .alloc_zeros::<u8>(m * k / 2)
        .map_err(|e| Error::cuda("allocate W4A4 activation codes", e))?;
    let mut x_scales = stream
        .alloc_zeros::<u8>(m * k / 16)
        .map_err(|e| Error::cuda("allocate W4A4 activation scales", e))?;
    let threads = 256u32; // QUANTIZE_THREADS in gemm.cu
    let grid = u32::try_from(blocks.div_ceil(u64::from(threads))).map_err(|_| {
        Error::invalid(
            "W4A4 activations",
            format!("[{m}, {k}] is too large for one launch"),
        )
    })?;
    let quantize = cuda.function(FAMILY, "quantize_nvfp4_rows")?;
    let mut launch = stream.launch_builder(&quantize);
    launch
        .arg(x)
        .arg(&input_scale)
        .arg(&mut packed)
        .arg(&mut x_scales)
        .arg(&blocks);
    // SAFETY: matches quantize_nvfp4_rows(x, input_scale, packed, scales, blocks); X holds
    // blocks * 16 bf16, the outputs blocks * 8 and blocks bytes.
    unsafe {
        launch.launch(LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(|e| Error::cuda(format!("launch quantize_nvfp4_rows M={m} K={k}"), e))?;

    let tiles = &cuda.target().gemm;
    let alpha = input_scale * global_scale;
    let epilogue_code = epilogue.kernel_code();
    let (n32, k32) = (check_u32("linear N", n_out)?, check_u32("linear K", k)?);
    let (n_tiles, k_groups) = (
        check_u32("linear tiles", w.grid.n_tiles)?,
        check_u32("linear K groups", w.grid.k_groups)?,
    );
    for start in (0..m).step_by(W4A4_MAX_ROWS) {
        let rows = (m - start).min(W4A4_MAX_ROWS);
        let kernel = format!(
            "gemm_nvfp4_nvfp4_mma_m{}",
            rows.div_ceil(8).next_power_of_two() * 8
        );
        let function = cuda.function(FAMILY, &kernel)?;
        let codes = packed.slice(start * k / 2..(start + rows) * k / 2);
        let row_scales = x_scales.slice(start * k / 16..(start + rows) * k / 16);
        let mut y_rows = y.slice_mut(start * n_out..(start + rows) * n_out);
        let residual_ptr = residual.map_or(0, |r| {
            r.slice(start * n_out..(start + rows) * n_out)
                .device_ptr(stream)
                .0
        });
        let m32 = rows as u32;
        let mut launch = stream.launch_builder(&function);
        launch
            .arg(&codes)
            .arg(&row_scales)
            .arg(words)
            .arg(scales)
            .arg(&alpha)
            .arg(&mut y_rows)
            .arg(&residual_ptr)
            .arg(&m32)
            .arg(&n32)
            .arg(&k32)
            .arg(&n_tiles)
            .arg(&k_groups)
            .arg(&epilogue_code);
        let config = LaunchConfig {
            grid_dim: (n_tiles.div_ceil(tiles.mma_warps_per_block), 1, 1),
            block_dim: (tiles.mma_warps_per_block * cuda.target().warp_size, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gemm_nvfp4_nvfp4_mma_m*'s signature; the codes and scales hold `rows`
        // quantised rows of K, the weights were laid out for (n_tiles, k_groups), Y and the
        // residual were checked against (m, n).
        unsafe { launch.launch(config) }
            .map_err(|e| Error::cuda(format!("launch {kernel} M={rows} N={n_out} K={k}"), e))?;
    }
    Ok(())
}
