//! Family `moe`: the sparse mixture-of-experts block of Qwen3.5-MoE (router softmax over all
//! experts, top-k, renormalisation; per expert `down(silu(gate x) * up x)`; a shared expert scaled
//! by `sigmoid(shared_expert_gate x)`), `kernels/templates/moe.cu`.
//!
//! - [`reference`]: the CPU reference, the definition.
//! - [`weights`]: the block's weights on the host (from float slices, per-expert NVFP4 matrices or
//!   a checkpoint) and their kernel layout.
//! - [`MoeWeights`] on a backend, a caller-held [`MoeWorkspace`], and [`moe_block`]: the whole
//!   block for `T` tokens. The CPU backend runs the reference (NVFP4 dequantised: W4A16). CUDA runs
//!   `moe_{nvfp4,bf16}_m{rows}`, ONE persistent launch per block (router, fp32 softmax / top-k /
//!   renormalisation / shared gate, alignment by expert on the device, grouped gate_up with
//!   `silu(gate) * up` fused, grouped down, weighted combine plus the shared expert and an
//!   optional residual), capturable in a CUDA graph: no allocation, no host synchronisation.
//!   Experts nobody chose cost nothing (they get no work items); every chosen expert's weights
//!   are read once from DRAM per launch (an expert with more tokens than a pass, 8, re-reads its
//!   tiles from L2). Work items are claimed in order from a counter, so the kernel cannot
//!   deadlock whatever number of its blocks is resident; a wait longer than 4 s traps (a launch
//!   error naming the wait on stdout) instead of hanging.
//! - gfx1151 has the same kernels on WMMA (compiled, and run emulated on the CPU with the sm_90a
//!   source in tests/moe_emulated.rs); their HIP launch is not written yet: on the HIP backend
//!   the constructors and [`moe_block`] answer [`Error::Invalid`] ("no hip launch yet"), as the
//!   other families still launching through cudarc do.
//!
//! Numerics: bf16 operands, fp32 accumulation; `silu(gate) * up` is rounded to bf16 before the
//! down GEMM (as the GEMM family's epilogue), the down outputs stay fp32 until the combine rounds
//! the block's output once.

pub mod reference;
pub mod weights;

pub use weights::{
    ExpertFormat, ExpertWeights, FloatElement, FusedBlock, KernelLayout, MoeHostWeights,
};

use super::{check_len, check_u32};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, DeviceVec};
use crate::error::{Error, Result};
use crate::formats::safetensors::Checkpoint;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;
use reference::{ExpertRef, MoeShape, Routing};
use std::collections::HashMap;

/// The family name (template and module).
pub const FAMILY: &str = "moe";

/// The most tokens times experts per token one launch may route: the kernel packs per-expert slot
/// counts into 16 bits.
pub const MAX_SLOTS_PER_LAUNCH: usize = 65535;

/// A MoE block's weights on a backend: the host weights on the CPU, the kernel layout
/// ([`KernelLayout`]) on CUDA.
pub struct MoeWeights {
    shape: MoeShape,
    format: ExpertFormat,
    shared_experts: usize,
    shared_gate: bool,
    expert_bytes: u64,
    shared_bytes: u64,
    router_bytes: u64,
    storage: MoeStorage,
}

enum MoeStorage {
    Host(Box<MoeHostWeights>),
    Cuda(Box<CudaMoe>),
}

struct CudaMoe {
    router: CudaSlice<u32>,
    has_shared_gate: bool,
    gate_up: CudaSlice<u32>,
    gate_up_scales: Option<CudaSlice<u16>>,
    down: CudaSlice<u32>,
    down_scales: Option<CudaSlice<u16>>,
    gate_up_alpha: CudaSlice<f32>,
    down_alpha: CudaSlice<f32>,
}

fn upload<T: DeviceRepr>(cuda: &CudaBackend, data: &[T], what: &str) -> Result<CudaSlice<T>> {
    cuda.stream()
        .clone_htod(data)
        .map_err(|e| Error::cuda(format!("upload {what} ({} elements)", data.len()), e))
}

fn copy<T: DeviceRepr>(
    cuda: &CudaBackend,
    data: &CudaSlice<T>,
    what: &str,
) -> Result<CudaSlice<T>> {
    cuda.stream()
        .clone_dtod(data)
        .map_err(|e| Error::cuda(format!("copy {what} ({} elements)", data.len()), e))
}

impl MoeWeights {
    /// Puts `host` on `backend`: a copy on the CPU; on CUDA, re-laid-out into the kernels' order
    /// once and uploaded.
    ///
    /// # Errors
    /// [`Error::Invalid`] for weights that disagree with their shape, experts in mixed formats, a
    /// NaN NVFP4 block scale, or a shape the device's kernels cannot run (more experts than
    /// `moe.max_experts` of its target, k above the warp size); [`Error::Cuda`] when an upload
    /// fails.
    pub fn new(backend: &Backend, host: &MoeHostWeights) -> Result<Self> {
        host.check()?;
        let shape = host.shape;
        let shared_experts = host.shared_experts();
        let expert_bytes = host.expert_bytes();
        let shared_bytes = host.shared.as_ref().map_or(0, ExpertWeights::bytes);
        let router_rows = shape.experts + usize::from(host.shared_gate.is_some());
        let router_bytes = 2 * (router_rows * shape.hidden) as u64;
        let storage = match backend {
            Backend::Cpu => MoeStorage::Host(Box::new(host.clone())),
            Backend::Hip(_) => return Err(backend.no_launch_yet(FAMILY)),
            Backend::Cuda(cuda) => {
                check_kernel_shape(cuda, shape)?;
                let layout = host.kernel_layout()?;
                // the kernels index fragment lanes with 32 bits
                for (what, words) in [
                    ("MoE router fragments", layout.router.len()),
                    ("MoE gate_up fragments", layout.gate_up.len()),
                    ("MoE down fragments", layout.down.len()),
                ] {
                    check_u32(what, words)?;
                }
                let scales = |data: &[u16], what: &str| -> Result<Option<CudaSlice<u16>>> {
                    if data.is_empty() {
                        Ok(None)
                    } else {
                        upload(cuda, data, what).map(Some)
                    }
                };
                MoeStorage::Cuda(Box::new(CudaMoe {
                    router: upload(cuda, &layout.router, "MoE router fragments")?,
                    has_shared_gate: layout.has_shared_gate,
                    gate_up: upload(cuda, &layout.gate_up, "MoE gate_up fragments")?,
                    gate_up_scales: scales(&layout.gate_up_scales, "MoE gate_up scales")?,
                    down: upload(cuda, &layout.down, "MoE down fragments")?,
                    down_scales: scales(&layout.down_scales, "MoE down scales")?,
                    gate_up_alpha: upload(cuda, &layout.gate_up_alpha, "MoE gate_up alphas")?,
                    down_alpha: upload(cuda, &layout.down_alpha, "MoE down alphas")?,
                }))
            }
        };
        Ok(Self {
            shape,
            format: host.format(),
            shared_experts,
            shared_gate: host.shared_gate.is_some(),
            expert_bytes,
            shared_bytes,
            router_bytes,
            storage,
        })
    }

    /// Loads the block under `prefix` of `checkpoint` ([`MoeHostWeights::load`]) onto `backend`.
    ///
    /// # Errors
    /// As [`MoeHostWeights::load`] and [`MoeWeights::new`].
    pub fn load(
        backend: &Backend,
        checkpoint: &Checkpoint,
        prefix: &str,
        shape: MoeShape,
    ) -> Result<Self> {
        Self::new(backend, &MoeHostWeights::load(checkpoint, prefix, shape)?)
    }

    /// A second copy on the same backend (device-to-device on CUDA), e.g. to stream weights
    /// from DRAM rather than cache in a bench.
    ///
    /// # Errors
    /// [`Error::Cuda`] when a copy fails.
    pub fn try_clone(&self, backend: &Backend) -> Result<Self> {
        let storage = match (&self.storage, backend) {
            (MoeStorage::Host(host), _) => MoeStorage::Host(host.clone()),
            (MoeStorage::Cuda(c), Backend::Cuda(cuda)) => {
                let scales =
                    |s: &Option<CudaSlice<u16>>, what: &str| -> Result<Option<CudaSlice<u16>>> {
                        s.as_ref().map(|s| copy(cuda, s, what)).transpose()
                    };
                MoeStorage::Cuda(Box::new(CudaMoe {
                    router: copy(cuda, &c.router, "MoE router fragments")?,
                    has_shared_gate: c.has_shared_gate,
                    gate_up: copy(cuda, &c.gate_up, "MoE gate_up fragments")?,
                    gate_up_scales: scales(&c.gate_up_scales, "MoE gate_up scales")?,
                    down: copy(cuda, &c.down, "MoE down fragments")?,
                    down_scales: scales(&c.down_scales, "MoE down scales")?,
                    gate_up_alpha: copy(cuda, &c.gate_up_alpha, "MoE gate_up alphas")?,
                    down_alpha: copy(cuda, &c.down_alpha, "MoE down alphas")?,
                }))
            }
            (MoeStorage::Cuda(_), other) => {
                return Err(Error::BackendMismatch {
                    what: "MoE weights".into(),
                    expected: other.name(),
                    found: "cuda",
                });
            }
        };
        Ok(Self { storage, ..*self })
    }

    /// The block's sizes.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }

    /// The experts' format.
    pub fn format(&self) -> ExpertFormat {
        self.format
    }

    /// Bytes of one routed expert's weights.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    /// The fewest bytes one launch must read when `distinct_experts` different experts were
    /// chosen: those experts' weights once, the shared expert, the router (and shared gate), bf16
    /// X and Y for `t` tokens. The read-once time is this over the copy bandwidth.
    pub fn block_bytes(&self, distinct_experts: usize, t: usize) -> u64 {
        distinct_experts as u64 * self.expert_bytes
            + self.shared_bytes
            + self.router_bytes
            + 4 * (t * self.shape.hidden) as u64
    }
}

/// Checks that the device's kernels can run `shape`.
fn check_kernel_shape(cuda: &CudaBackend, shape: MoeShape) -> Result<()> {
    let target = cuda.target();
    if shape.experts > target.moe.max_experts as usize {
        return Err(Error::invalid(
            "MoE shape",
            format!(
                "{} experts; the {} kernels take at most moe.max_experts = {} (kernels/targets.toml)",
                shape.experts, target.name, target.moe.max_experts
            ),
        ));
    }
    if shape.top_k > target.warp_size as usize {
        return Err(Error::invalid(
            "MoE shape",
            format!(
                "top-k {} exceeds the warp size {}: the router keeps one choice per lane",
                shape.top_k, target.warp_size
            ),
        ));
    }
    for (what, value) in [
        ("MoE hidden size", shape.hidden),
        ("MoE intermediate size", shape.intermediate),
    ] {
        check_u32(what, value)?;
    }
    Ok(())
}

/// Device scratch of [`moe_block`], held by the caller and reused by every call (no allocation
/// per call): routing tables, expert activations and outputs for up to `capacity` tokens per
/// launch, and the kernel's counters (zero between launches).
pub struct MoeWorkspace {
    capacity: usize,
    shape: MoeShape,
    shared_experts: usize,
    shared_gate: bool,
    storage: WorkspaceStorage,
}

enum WorkspaceStorage {
    /// The CPU backend keeps the last routing.
    Host(Option<Routing>),
    Cuda(Box<CudaWorkspace>),
}

struct CudaWorkspace {
    control: CudaSlice<u32>,
    topk_ids: CudaSlice<u32>,
    slot_pos: CudaSlice<u32>,
    sorted_token: CudaSlice<u32>,
    active_expert: CudaSlice<u32>,
    active_offset: CudaSlice<u32>,
    active_count: CudaSlice<u32>,
    n_active: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    route_weight: CudaSlice<f32>,
    shared_scale: CudaSlice<f32>,
    partial: CudaSlice<f32>,
    act: CudaSlice<u16>,
    /// Tokens of the last launch (what [`MoeWorkspace::routing`] reads back).
    last_tokens: usize,
}

impl MoeWorkspace {
    /// Scratch for blocks of `weights`' shape, up to `capacity` tokens per launch ([`moe_block`]
    /// runs more in several launches).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `capacity` is zero or `capacity * k` exceeds
    /// [`MAX_SLOTS_PER_LAUNCH`]; [`Error::Cuda`] when an allocation fails.
    pub fn new(backend: &Backend, weights: &MoeWeights, capacity: usize) -> Result<Self> {
        let shape = weights.shape;
        if capacity == 0 || capacity * shape.top_k > MAX_SLOTS_PER_LAUNCH {
            return Err(Error::invalid(
                "MoE workspace capacity",
                format!(
                    "{capacity} tokens x top-k {}: need 1 ..= {MAX_SLOTS_PER_LAUNCH} slots per launch",
                    shape.top_k
                ),
            ));
        }
        let storage = match backend {
            Backend::Cpu => WorkspaceStorage::Host(None),
            Backend::Hip(_) => return Err(backend.no_launch_yet(FAMILY)),
            Backend::Cuda(cuda) => {
                let (e, k, h, i) = (shape.experts, shape.top_k, shape.hidden, shape.intermediate);
                let positions = capacity * (k + weights.shared_experts);
                let stream = cuda.stream();
                let u32s = |len: usize, what: &str| -> Result<CudaSlice<u32>> {
                    stream
                        .alloc_zeros(len.max(1))
                        .map_err(|e| Error::cuda(format!("allocate MoE {what} ({len} u32)"), e))
                };
                let f32s = |len: usize, what: &str| -> Result<CudaSlice<f32>> {
                    stream
                        .alloc_zeros(len.max(1))
                        .map_err(|e| Error::cuda(format!("allocate MoE {what} ({len} f32)"), e))
                };
                WorkspaceStorage::Cuda(Box::new(CudaWorkspace {
                    // 4 counters, one per expert rank, one per 16 hidden rows (enough for any
                    // grouping of the down tiles), one per 8 tokens (the smallest token chunk)
                    control: u32s(
                        4 + e + weights.shared_experts + h.div_ceil(16) + capacity.div_ceil(8),
                        "counters",
                    )?,
                    topk_ids: u32s(capacity * k, "top-k ids")?,
                    slot_pos: u32s(capacity * k, "slot positions")?,
                    sorted_token: u32s(positions, "sorted tokens")?,
                    active_expert: u32s(e, "active experts")?,
                    active_offset: u32s(e, "active offsets")?,
                    active_count: u32s(e, "active counts")?,
                    n_active: u32s(1, "active expert count")?,
                    logits: f32s(capacity * (e + 1), "router logits")?,
                    route_weight: f32s(capacity * k, "routing weights")?,
                    shared_scale: f32s(capacity, "shared expert scales")?,
                    partial: f32s(positions * h, "expert outputs")?,
                    act: stream.alloc_zeros(positions * i).map_err(|e| {
                        Error::cuda(
                            format!("allocate MoE activations ({} bf16)", positions * i),
                            e,
                        )
                    })?,
                    last_tokens: 0,
                }))
            }
        };
        Ok(Self {
            capacity,
            shape,
            shared_experts: weights.shared_experts,
            shared_gate: weights.shared_gate,
            storage,
        })
    }

    /// Tokens one launch takes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The routing of the last launch's tokens (the last `capacity`-token chunk of the last
    /// [`moe_block`] call): chosen experts, most probable first, their renormalised weights and
    /// the shared expert's scales (empty without a shared-expert gate, as in
    /// [`reference::route`]). Waits for the device.
    ///
    /// # Errors
    /// [`Error::Invalid`] before any call; [`Error::Cuda`] when the copy fails (also where an
    /// earlier kernel fault shows).
    pub fn routing(&self, backend: &Backend) -> Result<Routing> {
        let none = || Error::invalid("MoE workspace", "no block has run on it yet");
        match (&self.storage, backend) {
            (WorkspaceStorage::Host(routing), _) => routing.clone().ok_or_else(none),
            (WorkspaceStorage::Cuda(w), Backend::Cuda(cuda)) => {
                let t = w.last_tokens;
                if t == 0 {
                    return Err(none());
                }
                let k = self.shape.top_k;
                let stream = cuda.stream();
                let read_u32 = |s: &CudaSlice<u32>, len: usize| -> Result<Vec<u32>> {
                    stream
                        .clone_dtoh(&s.slice(..len))
                        .map_err(|e| Error::cuda("download the MoE routing", e))
                };
                let read_f32 = |s: &CudaSlice<f32>, len: usize| -> Result<Vec<f32>> {
                    stream
                        .clone_dtoh(&s.slice(..len))
                        .map_err(|e| Error::cuda("download the MoE routing", e))
                };
                Ok(Routing {
                    top_k: k,
                    experts: read_u32(&w.topk_ids, t * k)?,
                    weights: read_f32(&w.route_weight, t * k)?,
                    // as the reference: the scales exist where a gate does
                    shared_scale: if self.shared_gate {
                        read_f32(&w.shared_scale, t)?
                    } else {
                        Vec::new()
                    },
                })
            }
            (WorkspaceStorage::Cuda(_), other) => Err(Error::BackendMismatch {
                what: "MoE workspace".into(),
                expected: other.name(),
                found: "cuda",
            }),
        }
    }
}

/// The kernels' argument block; mirrors `struct MoeArgs` in kernels/templates/moe.cu field by
/// field (device pointers as u64, null = 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeArgs {
    x: u64,
    residual: u64,
    y: u64,
    router: u64,
    gate_up: u64,
    gate_up_scales: u64,
    down: u64,
    down_scales: u64,
    gate_up_alpha: u64,
    down_alpha: u64,
    control: u64,
    topk_ids: u64,
    slot_pos: u64,
    sorted_token: u64,
    active_expert: u64,
    active_offset: u64,
    active_count: u64,
    n_active: u64,
    logits: u64,
    route_weight: u64,
    shared_scale: u64,
    partial: u64,
    act: u64,
    tokens: u32,
    experts: u32,
    top_k: u32,
    hidden: u32,
    inter: u32,
    shared_experts: u32,
    has_shared_gate: u32,
    unused: u32,
}

// the template's static_assert holds the other side
const _: () = assert!(std::mem::size_of::<MoeArgs>() == 216);

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for MoeArgs {}

/// The whole MoE block for `t` tokens: `y = moe(x) [+ residual]`, `x`, `y` (and `residual`)
/// bf16 `[t, H]` row-major. Runs in launches of at most `workspace.capacity()` tokens; `t == 0`
/// does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shape or the workspace belongs
/// to another shape; [`Error::BackendMismatch`] when buffers live elsewhere; [`Error::Compile`] /
/// [`Error::Cuda`] from the CUDA path.
pub fn moe_block(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let h = weights.shape.hidden;
    check_len("MoE input X", x, t * h, &format!("[{t}, {h}]"))?;
    check_len("MoE output Y", y, t * h, &format!("[{t}, {h}]"))?;
    if let Some(r) = residual {
        check_len("MoE residual", r, t * h, &format!("[{t}, {h}]"))?;
    }
    if workspace.shape != weights.shape
        || workspace.shared_experts != weights.shared_experts
        || workspace.shared_gate != weights.shared_gate
    {
        return Err(Error::invalid(
            "MoE workspace",
            format!(
                "made for {:?}, the weights are {:?}",
                workspace.shape, weights.shape
            ),
        ));
    }
    if t == 0 {
        return Ok(());
    }
    match (backend, &weights.storage) {
        (Backend::Cpu, MoeStorage::Host(host)) => {
            let DeviceVec::Host(x) = x else {
                return Err(backend.mismatch("MoE input X", x));
            };
            let residual = match residual {
                None => None,
                Some(DeviceVec::Host(r)) => Some(r),
                Some(r) => return Err(backend.mismatch("MoE residual", r)),
            };
            let DeviceVec::Host(y) = y else {
                return Err(backend.mismatch("MoE output Y", y));
            };
            let (out, routing) = reference_block(host, x, t);
            *y = out
                .iter()
                .enumerate()
                .map(|(index, v)| bf16::from_f32(v + residual.map_or(0.0, |r| r[index].to_f32())))
                .collect();
            // keep what a device would: the routing of the last `capacity`-token launch
            let (first, k) = (
                (t - 1) / workspace.capacity * workspace.capacity,
                routing.top_k,
            );
            workspace.storage = WorkspaceStorage::Host(Some(Routing {
                top_k: k,
                experts: routing.experts[first * k..].to_vec(),
                weights: routing.weights[first * k..].to_vec(),
                shared_scale: routing
                    .shared_scale
                    .get(first..)
                    .unwrap_or_default()
                    .to_vec(),
            }));
            Ok(())
        }
        (Backend::Cuda(cuda), MoeStorage::Cuda(device)) => {
            moe_block_cuda(cuda, backend, weights, device, x, t, residual, workspace, y)
        }
        (Backend::Hip(_), _) => Err(backend.no_launch_yet(FAMILY)),
        (Backend::Cpu, MoeStorage::Cuda(_)) => Err(Error::BackendMismatch {
            what: "MoE weights".into(),
            expected: "cpu",
            found: "cuda",
        }),
        (Backend::Cuda(_), MoeStorage::Host(_)) => Err(Error::BackendMismatch {
            what: "MoE weights".into(),
            expected: "cuda",
            found: "cpu",
        }),
    }
}

/// The CPU path: the reference on the weights as stored (NVFP4 dequantised), with only the
/// chosen experts expanded to f32. Returns the unrounded output and the routing.
fn reference_block(host: &MoeHostWeights, x: &[bf16], t: usize) -> (Vec<f32>, Routing) {
    let shape = host.shape;
    let x: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let router: Vec<f32> = host.router.iter().map(|v| v.to_f32()).collect();
    let gate: Option<Vec<f32>> = host
        .shared_gate
        .as_ref()
        .map(|g| g.iter().map(|v| v.to_f32()).collect());
    let routing = reference::route(shape, &x, t, &router, gate.as_deref());
    let mut dense: HashMap<u32, (Vec<f32>, Vec<f32>)> = HashMap::new();
    for &e in &routing.experts {
        dense
            .entry(e)
            .or_insert_with(|| host.experts[e as usize].dense());
    }
    let shared = host.shared.as_ref().map(ExpertWeights::dense);
    let expert = |e: usize| {
        let (gate_up, down) = &dense[&(e as u32)];
        ExpertRef { gate_up, down }
    };
    let out = reference::moe_block(
        shape,
        &x,
        t,
        &routing,
        expert,
        shared
            .as_ref()
            .map(|(gate_up, down)| ExpertRef { gate_up, down }),
    );
    (out, routing)
}

/// Device address of a buffer (kernel arguments are raw addresses).
fn address<T>(cuda: &CudaBackend, slice: &CudaSlice<T>) -> u64 {
    slice.device_ptr(cuda.stream()).0
}

#[allow(clippy::too_many_arguments)]
fn moe_block_cuda(
    cuda: &CudaBackend,
    backend: &Backend,
    weights: &MoeWeights,
    device: &CudaMoe,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    let DeviceVec::Cuda(x) = x else {
        return Err(backend.mismatch("MoE input X", x));
    };
    let residual = match residual {
        None => None,
        Some(DeviceVec::Cuda(r)) => Some(r),
        Some(r) => return Err(backend.mismatch("MoE residual", r)),
    };
    let DeviceVec::Cuda(y) = y else {
        return Err(backend.mismatch("MoE output Y", y));
    };
    let WorkspaceStorage::Cuda(w) = &mut workspace.storage else {
        return Err(Error::BackendMismatch {
            what: "MoE workspace".into(),
            expected: "cuda",
            found: "cpu",
        });
    };
    let shape = weights.shape;
    let target = cuda.target();
    let tiles = &target.moe;
    let format = match weights.format {
        ExpertFormat::Nvfp4 => "nvfp4",
        ExpertFormat::Bf16 => "bf16",
    };
    let grid = cuda.multiprocessors() * tiles.blocks_per_sm;
    let config = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (tiles.warps_per_block * target.warp_size, 1, 1),
        shared_mem_bytes: 0,
    };
    let h = shape.hidden;
    let mut args = MoeArgs {
        x: 0,
        residual: 0,
        y: 0,
        router: address(cuda, &device.router),
        gate_up: address(cuda, &device.gate_up),
        gate_up_scales: device
            .gate_up_scales
            .as_ref()
            .map_or(0, |s| address(cuda, s)),
        down: address(cuda, &device.down),
        down_scales: device.down_scales.as_ref().map_or(0, |s| address(cuda, s)),
        gate_up_alpha: address(cuda, &device.gate_up_alpha),
        down_alpha: address(cuda, &device.down_alpha),
        control: address(cuda, &w.control),
        topk_ids: address(cuda, &w.topk_ids),
        slot_pos: address(cuda, &w.slot_pos),
        sorted_token: address(cuda, &w.sorted_token),
        active_expert: address(cuda, &w.active_expert),
        active_offset: address(cuda, &w.active_offset),
        active_count: address(cuda, &w.active_count),
        n_active: address(cuda, &w.n_active),
        logits: address(cuda, &w.logits),
        route_weight: address(cuda, &w.route_weight),
        shared_scale: address(cuda, &w.shared_scale),
        partial: address(cuda, &w.partial),
        act: address(cuda, &w.act),
        tokens: 0,
        experts: check_u32("MoE experts", shape.experts)?,
        top_k: check_u32("MoE top-k", shape.top_k)?,
        hidden: check_u32("MoE hidden size", h)?,
        inter: check_u32("MoE intermediate size", shape.intermediate)?,
        shared_experts: check_u32("MoE shared experts", weights.shared_experts)?,
        has_shared_gate: u32::from(device.has_shared_gate),
        unused: 0,
    };
    let x_base = address(cuda, x);
    let y_base = address(cuda, y);
    let residual_base = residual.map_or(0, |r| address(cuda, r));
    for start in (0..t).step_by(workspace.capacity) {
        let tokens = (t - start).min(workspace.capacity);
        let rows = tiles
            .token_rows
            .iter()
            .copied()
            .find(|&r| r as usize >= tokens)
            .or_else(|| tiles.token_rows.last().copied())
            .unwrap_or(8);
        let kernel = format!("moe_{format}_m{rows}");
        let function = cuda.function(FAMILY, &kernel)?;
        let offset = 2 * (start * h) as u64; // bytes of bf16
        args.x = x_base + offset;
        args.y = y_base + offset;
        args.residual = if residual_base == 0 {
            0
        } else {
            residual_base + offset
        };
        args.tokens = tokens as u32; // <= capacity, checked against 16-bit slot counts
        let mut launch = cuda.stream().launch_builder(&function);
        launch.arg(&args);
        // SAFETY: MoeArgs matches the kernel's by-value parameter (size checked on both sides);
        // X, Y and the residual hold t * H bf16 (checked above) and the chunk stays inside them;
        // the weights were laid out for this shape and the workspace sized for `capacity` tokens
        // of it (shape checked above); its counters are zero between launches.
        unsafe { launch.launch(config) }.map_err(|e| {
            Error::cuda(
                format!(
                    "launch {kernel} T={tokens} E={} k={} H={h} I={}",
                    shape.experts, shape.top_k, shape.intermediate
                ),
                e,
            )
        })?;
        w.last_tokens = tokens;
    }
    Ok(())
}
