//! Family `moe`: the sparse mixture-of-experts block of Qwen3.5-MoE (router softmax over all
//! experts, top-k, renormalisation; per expert `down(silu(gate x) * up x)`; a shared expert scaled
//! by `sigmoid(shared_expert_gate x)`), `kernels/templates/moe.cu`.
//!
//! - [`reference`](mod@reference): the CPU reference, the definition.
//! - [`weights`]: the block's weights on the host (from float slices, per-expert NVFP4 matrices or
//!   a checkpoint) and their kernel layout.
//! - [`MoeWeights`] on a backend, a caller-held [`MoeWorkspace`], and [`moe_block`]: the whole
//!   block for `T` tokens. The CPU backend runs the reference (NVFP4 dequantised: W4A16). A device
//!   (CUDA or HIP, through [`Backend::launch`]) runs `moe_{nvfp4,bf16}_m{rows}`, ONE persistent
//!   launch per block (router, fp32 softmax / top-k / renormalisation / shared gate, alignment by
//!   expert on the device, grouped gate_up with `silu(gate) * up` fused, grouped down, weighted
//!   combine plus the shared expert and an optional residual), capturable in a graph: no
//!   allocation, no host synchronisation. Up to `moe.split_max_tokens` tokens (targets.toml) the
//!   same items run as three launches instead ([`MoeLaunch::Split`]: route, gate_up, down), which
//!   was faster at every T benched: the persistent launch's blocks idle until the routing is
//!   known, while a kernel boundary orders the phases in about a microsecond. The router runs as
//!   `moe.router_planes` planes of partial logits (one block per router tile and plane in the
//!   route launch, so each warp's chain of loads is short; the persistent launch computes the
//!   same planes in turn and rounds alike); the route launch loads the router, and the down
//!   launch the routing and its weights, before waiting for the kernel before them (programmatic
//!   dependent launch); the gate_up launch runs the shared expert's items whole before its wait
//!   (they need only X), so at decode the shared expert overlaps the routing. The warps that
//!   share one expert tile's K groups are a launch argument ([`tile_warps`]): more of them, each
//!   a shorter chain, up to `moe.wide_max_tokens` tokens (the split gate_up and down kernels are
//!   compiled for `moe.split_blocks_per_sm` resident blocks, so a decode step's items fit one
//!   wave). From `moe.stream_min_tokens` tokens ([`MoeLaunch::Stream`], targets with mma.sync
//!   and cp.async) the down launch is a grid of resident blocks whose warps each stream whole
//!   tiles of several experts, X through a cp.async ring, and the combine is a launch of its
//!   own (same sums in the same order: the split form's bits). [`MoeLaunch::Bulk`] (targets
//!   with bulk copies too; Auto from `moe.bulk_min_tokens`: 4 on sm_90a, where on the H100 it
//!   took decode steps 2-7% below the split form's at B = 4 and 8 and 12% below the streaming
//!   form's at B = 16 and 64; not measured on GB10) streams both expert launches so, each
//!   warp's NVFP4 weights arriving by bulk copies into a ring of slots in shared memory,
//!   several KB in flight per warp where the register rings hold a few hundred bytes per
//!   group, and its X fragments `moe.bulk_x_groups_ahead` K groups ahead in registers. Experts
//!   nobody chose cost nothing (they get no work items); every chosen expert's weights are
//!   read once from DRAM per launch (an expert with more tokens than a pass, 8, re-reads its
//!   tiles from L2). Work items are claimed in order from a counter, so the kernel cannot
//!   deadlock whatever number of its blocks is resident; a wait longer than 4 s traps (a
//!   launch error naming the wait on stdout) instead of hanging.
//! - The weights are laid out for the target's [`TensorCore`] (chosen by its instructions):
//!   mma.sync fragments on the NVIDIA targets, WMMA fragments on gfx1151, whose kernels are
//!   compiled and run emulated on the CPU (tests/moe_emulated.rs) but not yet on a gfx1151.
//!
//! Numerics: bf16 operands, fp32 accumulation; `silu(gate) * up` is rounded to bf16 before the
//! down GEMM (as the GEMM family's epilogue), the down outputs stay fp32 until the combine rounds
//! the block's output once.

pub mod reference;
pub mod weights;

pub use weights::{
    ExpertFormat, ExpertWeights, FloatElement, FusedBlock, KernelLayout, MoeHostWeights,
};

use super::gemm::TensorCore;
use super::table;
use super::{check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::formats::safetensors::Checkpoint;
use crate::target::TargetFacts;
use half::bf16;
use reference::{ExpertRef, MoeShape, Routing};
use std::collections::HashMap;

/// The family name (template and module).
pub const FAMILY: &str = "moe";

/// The most tokens times experts per token one launch may route: the kernel packs per-expert slot
/// counts into 16 bits.
pub const MAX_SLOTS_PER_LAUNCH: usize = 65535;

/// A MoE block's weights on a backend: the host weights on the CPU, the kernel layout
/// ([`KernelLayout`]) of the target's [`TensorCore`] on a device.
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
    Device(Box<DeviceMoe>),
}

/// The kernel layout on a device (NVFP4 scales are `None` for bf16 experts).
struct DeviceMoe {
    router: DeviceVec<u32>,
    has_shared_gate: bool,
    gate_up: DeviceVec<u32>,
    gate_up_scales: Option<DeviceVec<u8>>,
    down: DeviceVec<u32>,
    down_scales: Option<DeviceVec<u8>>,
    gate_up_alpha: DeviceVec<f32>,
    down_alpha: DeviceVec<f32>,
}

impl DeviceMoe {
    /// The backend the buffers live on.
    fn backend_name(&self) -> &'static str {
        self.router.backend_name()
    }
}

/// The empty buffer is `None` (bf16 experts have no scales).
fn upload_scales(backend: &Backend, scales: &[u8]) -> Result<Option<DeviceVec<u8>>> {
    if scales.is_empty() {
        Ok(None)
    } else {
        backend.upload(scales).map(Some)
    }
}

impl MoeWeights {
    /// Puts `host` on `backend`: a copy on the CPU; on a device, re-laid-out once into the
    /// kernels' order for its target's [`TensorCore`] and uploaded.
    ///
    /// # Errors
    /// [`Error::Invalid`] for weights that disagree with their shape, experts in mixed formats, a
    /// NaN NVFP4 block scale, or a shape the device's kernels cannot run (more experts than
    /// `moe.max_experts` of its target, k above the warp size, a target without tensor-core
    /// kernels); [`Error::Cuda`] / [`Error::Hip`] when an upload fails.
    pub fn new(backend: &Backend, host: &MoeHostWeights) -> Result<Self> {
        host.check()?;
        let shape = host.shape;
        let shared_experts = host.shared_experts();
        let expert_bytes = host.expert_bytes();
        let shared_bytes = host.shared.as_ref().map_or(0, ExpertWeights::bytes);
        let router_rows = shape.experts + usize::from(host.shared_gate.is_some());
        let router_bytes = 2 * (router_rows * shape.hidden) as u64;
        let storage = match backend.target() {
            None => MoeStorage::Host(Box::new(host.clone())),
            Some(target) => {
                check_kernel_shape(target, shape)?;
                let layout = host.kernel_layout(TensorCore::for_target(target)?)?;
                // the kernels index fragment lanes with 32 bits
                for (what, words) in [
                    ("MoE router fragments", layout.router.len()),
                    ("MoE gate_up fragments", layout.gate_up.len()),
                    ("MoE down fragments", layout.down.len()),
                ] {
                    check_u32(what, words)?;
                }
                MoeStorage::Device(Box::new(DeviceMoe {
                    router: backend.upload(&layout.router)?,
                    has_shared_gate: layout.has_shared_gate,
                    gate_up: backend.upload(&layout.gate_up)?,
                    gate_up_scales: upload_scales(backend, &layout.gate_up_scales)?,
                    down: backend.upload(&layout.down)?,
                    down_scales: upload_scales(backend, &layout.down_scales)?,
                    gate_up_alpha: backend.upload(&layout.gate_up_alpha)?,
                    down_alpha: backend.upload(&layout.down_alpha)?,
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

    /// A second copy on the same backend (device-to-device on a device), e.g. to stream
    /// weights from DRAM rather than cache in a bench.
    ///
    /// # Errors
    /// [`Error::BackendMismatch`] for weights of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when a copy fails.
    pub fn try_clone(&self, backend: &Backend) -> Result<Self> {
        let storage = match &self.storage {
            MoeStorage::Host(host) => MoeStorage::Host(host.clone()),
            MoeStorage::Device(d) if d.backend_name() == backend.name() => {
                let scales = |s: &Option<DeviceVec<u8>>| -> Result<Option<DeviceVec<u8>>> {
                    s.as_ref().map(|s| backend.duplicate(s)).transpose()
                };
                MoeStorage::Device(Box::new(DeviceMoe {
                    router: backend.duplicate(&d.router)?,
                    has_shared_gate: d.has_shared_gate,
                    gate_up: backend.duplicate(&d.gate_up)?,
                    gate_up_scales: scales(&d.gate_up_scales)?,
                    down: backend.duplicate(&d.down)?,
                    down_scales: scales(&d.down_scales)?,
                    gate_up_alpha: backend.duplicate(&d.gate_up_alpha)?,
                    down_alpha: backend.duplicate(&d.down_alpha)?,
                }))
            }
            MoeStorage::Device(d) => {
                return Err(Error::BackendMismatch {
                    what: "MoE weights".into(),
                    expected: backend.name(),
                    found: d.backend_name(),
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

/// Checks that `target`'s kernels can run `shape`.
fn check_kernel_shape(target: &TargetFacts, shape: MoeShape) -> Result<()> {
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
    Device(Box<DeviceWorkspace>),
}

/// The kernels' scratch on a device (lengths as [`MoeWorkspace::new`] allocates them).
struct DeviceWorkspace {
    control: DeviceVec<u32>,
    topk_ids: DeviceVec<u32>,
    slot_pos: DeviceVec<u32>,
    sorted_token: DeviceVec<u32>,
    active_expert: DeviceVec<u32>,
    active_offset: DeviceVec<u32>,
    active_count: DeviceVec<u32>,
    n_active: DeviceVec<u32>,
    logits: DeviceVec<f32>,
    route_weight: DeviceVec<f32>,
    shared_scale: DeviceVec<f32>,
    partial: DeviceVec<f32>,
    act: DeviceVec<bf16>,
    /// Tokens of the last launch (what [`MoeWorkspace::routing`] reads back).
    last_tokens: usize,
}

impl MoeWorkspace {
    /// Scratch for blocks of `weights`' shape, up to `capacity` tokens per launch ([`moe_block`]
    /// runs more in several launches).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `capacity` is zero or `capacity * k` exceeds
    /// [`MAX_SLOTS_PER_LAUNCH`]; [`Error::Cuda`] / [`Error::Hip`] when an allocation fails.
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
        let storage = match backend.target() {
            None => WorkspaceStorage::Host(None),
            Some(target) => {
                let (e, k, h, i) = (shape.experts, shape.top_k, shape.hidden, shape.intermediate);
                let planes = target.moe.router_planes as usize;
                let positions = capacity * (k + weights.shared_experts);
                let u32s = |len: usize| backend.zeros::<u32>(len.max(1));
                let f32s = |len: usize| backend.zeros::<f32>(len.max(1));
                WorkspaceStorage::Device(Box::new(DeviceWorkspace {
                    // 4 counters, one per expert rank, one per 16 hidden rows (enough for any
                    // grouping of the down tiles), one per 8 tokens (the smallest token chunk)
                    control: u32s(
                        4 + e + weights.shared_experts + h.div_ceil(16) + capacity.div_ceil(8),
                    )?,
                    topk_ids: u32s(capacity * k)?,
                    slot_pos: u32s(capacity * k)?,
                    sorted_token: u32s(positions)?,
                    active_expert: u32s(e)?,
                    active_offset: u32s(e)?,
                    active_count: u32s(e)?,
                    n_active: u32s(1)?,
                    logits: f32s(planes * capacity * (e + 1))?,
                    route_weight: f32s(capacity * k)?,
                    shared_scale: f32s(capacity)?,
                    partial: f32s(positions * h)?,
                    act: backend.zeros::<bf16>(positions * i)?,
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
    /// [`Error::Invalid`] before any call; [`Error::BackendMismatch`] for a workspace of another
    /// backend; [`Error::Cuda`] / [`Error::Hip`] when the copy fails (also where an earlier
    /// kernel fault shows).
    pub fn routing(&self, backend: &Backend) -> Result<Routing> {
        let none = || Error::invalid("MoE workspace", "no block has run on it yet");
        match &self.storage {
            WorkspaceStorage::Host(routing) => routing.clone().ok_or_else(none),
            WorkspaceStorage::Device(w) => {
                let t = w.last_tokens;
                if t == 0 {
                    return Err(none());
                }
                let k = self.shape.top_k;
                let first = |buffer: &DeviceVec<f32>, len: usize| -> Result<Vec<f32>> {
                    let mut values = backend.download(buffer)?;
                    values.truncate(len);
                    Ok(values)
                };
                let mut experts = backend.download(&w.topk_ids)?;
                experts.truncate(t * k);
                Ok(Routing {
                    top_k: k,
                    experts,
                    weights: first(&w.route_weight, t * k)?,
                    // as the reference: the scales exist where a gate does
                    shared_scale: if self.shared_gate {
                        first(&w.shared_scale, t)?
                    } else {
                        Vec::new()
                    },
                })
            }
        }
    }
}

/// The whole MoE block for `t` tokens: `y = moe(x) [+ residual]`, `x`, `y` (and `residual`)
/// bf16 `[t, H]` row-major. Runs in launches of at most `workspace.capacity()` tokens; `t == 0`
/// does nothing.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with the shape or the workspace belongs
/// to another shape; [`Error::BackendMismatch`] when buffers, weights or workspace live
/// elsewhere; [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the device path.
pub fn moe_block(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
) -> Result<()> {
    moe_block_with(
        backend,
        weights,
        x,
        t,
        residual,
        workspace,
        y,
        MoeLaunch::Auto,
    )
}

/// How a device runs [`moe_block_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeLaunch {
    /// The target's choice (kernels/targets.toml): [`MoeLaunch::Bulk`] from
    /// `moe.bulk_min_tokens`, else [`MoeLaunch::Stream`] from `moe.stream_min_tokens`, to
    /// `moe.split_max_tokens` tokens, [`MoeLaunch::Split`] below and [`MoeLaunch::Persistent`]
    /// above.
    #[default]
    Auto,
    /// One persistent launch (`moe_{format}_m{rows}`).
    Persistent,
    /// Three launches: route, gate_up, down (`moe_route_m{rows}`,
    /// `moe_{format}_{gate_up,down}_m{rows}`).
    Split,
    /// Four launches: the split form's route and gate_up, then the streaming down launch (a grid
    /// of resident blocks whose warps each stream whole tiles of several experts,
    /// `moe_{format}_down_stream`) and `moe_stream_combine`. On targets that render them
    /// (mma.sync and cp.async); [`Error::Invalid`] elsewhere.
    Stream,
    /// Four launches: the split form's route, then `moe_nvfp4_gate_up_bulk` and
    /// `moe_nvfp4_down_bulk` (grids of resident blocks whose warps stream whole tiles of several
    /// experts, their weights through bulk copies into a shared-memory ring per warp), then
    /// `moe_stream_combine`; the same bits as the streaming form. NVFP4 experts only: bf16
    /// experts take the streaming form's launches. On targets with bulk copies besides mma.sync
    /// and cp.async; [`Error::Invalid`] elsewhere.
    Bulk,
}

impl MoeLaunch {
    /// The form a launch of `tokens` tokens takes on `target`: [`MoeLaunch::Auto`] resolved by
    /// kernels/targets.toml (`moe.split_max_tokens`, `moe.stream_min_tokens`,
    /// `moe.bulk_min_tokens`), any other choice itself.
    pub fn resolve(self, target: &TargetFacts, tokens: usize) -> MoeLaunch {
        let m = &target.moe;
        match self {
            MoeLaunch::Auto if tokens > m.split_max_tokens as usize => MoeLaunch::Persistent,
            MoeLaunch::Auto if m.bulk_min_tokens > 0 && tokens >= m.bulk_min_tokens as usize => {
                MoeLaunch::Bulk
            }
            MoeLaunch::Auto
                if m.stream_min_tokens > 0 && tokens >= m.stream_min_tokens as usize =>
            {
                MoeLaunch::Stream
            }
            MoeLaunch::Auto => MoeLaunch::Split,
            chosen => chosen,
        }
    }

    /// The forms `target` renders kernels for: persistent and split, streaming where
    /// `moe.stream_min_tokens` turns it on, and bulk beside it where the target has bulk copies.
    pub fn forms(target: &TargetFacts) -> &'static [MoeLaunch] {
        use MoeLaunch::{Bulk, Persistent, Split, Stream};
        match (
            target.moe.stream_min_tokens > 0,
            target.instructions.bulk_streaming(),
        ) {
            (true, true) => &[Persistent, Split, Stream, Bulk],
            (true, false) => &[Persistent, Split, Stream],
            _ => &[Persistent, Split],
        }
    }
}

/// [`moe_block`] with the device launch chosen by the caller (the bench and the tests compare
/// them; the CPU backend runs the reference whatever the choice).
///
/// # Errors
/// As [`moe_block`].
#[allow(clippy::too_many_arguments)]
pub fn moe_block_with(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
    launch: MoeLaunch,
) -> Result<()> {
    moe_block_checked(backend, weights, x, t, residual, workspace, y, launch, None)
}

/// [`moe_block`] whose route launch asks the L2 for the first `moe.prefetch_next_layer_bytes` of
/// `next` (the next layer's first dense weight, as
/// [`crate::kernels::gemm::Linear::weight_words`] gives it) in blocks of at most
/// `moe.prefetch_next_layer_max_tokens` tokens: at B = 1 the MoE block's launches are latency
/// chains that leave DRAM mostly idle.
///
/// # Errors
/// As [`moe_block`].
#[allow(clippy::too_many_arguments)]
pub fn moe_block_prefetching(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
    next: Option<&DeviceVec<u32>>,
) -> Result<()> {
    moe_block_checked(
        backend,
        weights,
        x,
        t,
        residual,
        workspace,
        y,
        MoeLaunch::Auto,
        next,
    )
}

#[allow(clippy::too_many_arguments)]
fn moe_block_checked(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
    launch: MoeLaunch,
    prefetch: Option<&DeviceVec<u32>>,
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
    match backend {
        Backend::Cpu => {
            let host = match &weights.storage {
                MoeStorage::Host(host) => host,
                MoeStorage::Device(d) => {
                    return Err(Error::BackendMismatch {
                        what: "MoE weights".into(),
                        expected: "cpu",
                        found: d.backend_name(),
                    });
                }
            };
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
        Backend::Cuda(_) | Backend::Hip(_) => moe_block_device(
            backend, weights, x, t, residual, workspace, y, launch, prefetch,
        ),
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

/// Bytes of the next layer's weight (`available` bytes) that the route launch of a block of
/// `tokens` tokens asks the L2 for: `moe.prefetch_next_layer_bytes` in split and streaming
/// launches of at most `moe.prefetch_next_layer_max_tokens` tokens (the persistent launch has no
/// route launch), at most `available`, rounded down to 16 (the bulk prefetch's unit).
pub fn prefetch_bytes(
    target: &TargetFacts,
    launch: MoeLaunch,
    tokens: usize,
    available: usize,
) -> usize {
    let m = &target.moe;
    let split = matches!(
        launch,
        MoeLaunch::Split | MoeLaunch::Stream | MoeLaunch::Bulk
    );
    if !split || tokens > m.prefetch_next_layer_max_tokens as usize {
        return 0;
    }
    (m.prefetch_next_layer_bytes as usize).min(available) & !15
}

/// Warps per gate_up tile and per down tile of a launch of `tokens` tokens: `moe.wide_*` up to
/// `moe.wide_max_tokens` tokens, else the target's. The persistent and the split launches of the
/// same tokens use the same, so they sum every tile's K groups alike (bit-equal outputs).
pub fn tile_warps(target: &TargetFacts, tokens: usize) -> TileWarps {
    let m = &target.moe;
    if tokens <= m.wide_max_tokens as usize {
        TileWarps {
            gate_up: m.wide_gate_up_warps_per_tile,
            down: m.wide_down_warps_per_tile,
        }
    } else {
        TileWarps {
            gate_up: m.gate_up_warps_per_tile,
            down: m.down_warps_per_tile,
        }
    }
}

/// Warps splitting the K groups of one 16-row expert tile (powers of two dividing
/// `moe.warps_per_block`; an item holds the rest of its block's warps as tiles). Kernel arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileWarps {
    /// Per gate_up tile.
    pub gate_up: u32,
    /// Per down tile.
    pub down: u32,
}

/// Blocks of the three split launches: one per router item and plane, per gate_up item and per
/// down item (shared sub-experts' items for every chunk of `rows` tokens, then every rank that
/// could be active, `min(E, tokens * k)`; blocks past the actual active ranks leave at once). The
/// kernels'
/// `make_plan` counts items the same way. Public for the kernels' host emulation
/// (tests/moe_emulated.rs), which launches them as the runner does.
pub struct SplitGrids {
    /// Blocks of `moe_route_m{rows}`.
    pub route: u32,
    /// Blocks of `moe_{format}_gate_up_m{rows}`.
    pub gate_up: u32,
    /// Blocks of `moe_{format}_down_m{rows}`.
    pub down: u32,
}

impl SplitGrids {
    /// The grids for `tokens` tokens of a block of `shape` with `shared` shared sub-experts (and a
    /// shared gate row in the router when `has_shared_gate`), `rows` tokens per pass, on `target`.
    pub fn new(
        target: &TargetFacts,
        shape: MoeShape,
        shared: usize,
        has_shared_gate: bool,
        tokens: usize,
        rows: u32,
    ) -> Self {
        let m = &target.moe;
        let warps = tile_warps(target, tokens);
        let per_item = |warps_per_tile: u32| (m.warps_per_block / warps_per_tile) as usize;
        let chunks = tokens.div_ceil(rows as usize);
        let router_tiles = (shape.experts + usize::from(has_shared_gate)).div_ceil(16);
        let router_groups = router_tiles.div_ceil(per_item(m.router_warps_per_tile));
        let gate_up_groups = shape
            .intermediate
            .div_ceil(8)
            .div_ceil(per_item(warps.gate_up));
        let down_groups = shape.hidden.div_ceil(16).div_ceil(per_item(warps.down));
        let ranks = shape.experts.min(tokens * shape.top_k);
        let blocks = |n: usize| n.clamp(1, u32::MAX as usize) as u32;
        Self {
            route: blocks(router_groups * chunks * m.router_planes as usize),
            gate_up: blocks((shared * chunks + ranks) * gate_up_groups),
            down: blocks((shared * chunks + ranks) * down_groups),
        }
    }
}

/// The streaming form's own kernels for one format: the down launch, then the combine.
fn stream_kernel_names(format: ExpertFormat) -> [&'static str; 2] {
    match format {
        ExpertFormat::Nvfp4 => ["moe_nvfp4_down_stream", "moe_stream_combine"],
        ExpertFormat::Bf16 => ["moe_bf16_down_stream", "moe_stream_combine"],
    }
}

/// The bulk form's expert launches (gate_up, down) for NVFP4 weights.
const BULK_KERNELS: [&str; 2] = ["moe_nvfp4_gate_up_bulk", "moe_nvfp4_down_bulk"];

/// Blocks of `moe_stream_combine` for `tokens` tokens of `hidden` rows: each thread sums 4 rows
/// of one token (the kernel's `per_token` blocks per token). Public for the kernels' host
/// emulation (tests/moe_emulated.rs).
pub fn stream_combine_blocks(target: &TargetFacts, hidden: usize, tokens: usize) -> u32 {
    let rows_per_block = 4 * (target.moe.warps_per_block * target.warp_size) as usize;
    (tokens * hidden.div_ceil(rows_per_block)).clamp(1, u32::MAX as usize) as u32
}

/// The rendered kernel `name` of `target` (as the kernel table holds it).
fn named_kernel(target: &TargetFacts, name: &str) -> Result<&'static str> {
    table::rendered(&target.name, FAMILY)
        .and_then(|source| source.kernels.iter().copied().find(|k| *k == name))
        .ok_or_else(|| {
            Error::invalid(
                format!("kernel `{name}`"),
                format!(
                    "not among the {} moe kernels (the streaming launches need mma.sync and cp.async)",
                    target.name
                ),
            )
        })
}

/// The kernel name prefixes of one expert format (`{prefix}{rows}` names a kernel): the
/// persistent launch, then the split launches' route, gate_up and down.
fn kernel_prefixes(format: ExpertFormat) -> [&'static str; 4] {
    match format {
        ExpertFormat::Nvfp4 => [
            "moe_nvfp4_m",
            "moe_route_m",
            "moe_nvfp4_gate_up_m",
            "moe_nvfp4_down_m",
        ],
        ExpertFormat::Bf16 => [
            "moe_bf16_m",
            "moe_route_m",
            "moe_bf16_gate_up_m",
            "moe_bf16_down_m",
        ],
    }
}

/// The rendered kernel `{prefix}{rows}` of `target` (e.g. `moe_nvfp4_m8`, `moe_route_m8`; its
/// name as the kernel table holds it, found without allocating).
fn moe_kernel(target: &TargetFacts, prefix: &str, rows: u32) -> Result<&'static str> {
    table::rendered(&target.name, FAMILY)
        .and_then(|source| {
            source.kernels.iter().copied().find(|kernel| {
                kernel
                    .strip_prefix(prefix)
                    .and_then(|r| r.parse::<u32>().ok())
                    == Some(rows)
            })
        })
        .ok_or_else(|| {
            Error::invalid(
                format!("kernel `{prefix}{rows}`"),
                format!(
                    "not among the {} moe kernels (moe.token_rows in kernels/targets.toml)",
                    target.name
                ),
            )
        })
}

/// `moe_{nvfp4,bf16}_m*`'s arguments in their parameter order (MOE_PARAMETERS in moe.cu): the
/// chunk's `[x, residual, y]`, the weights (router, gate_up, gate_up_scales, down, down_scales,
/// gate_up_alpha, down_alpha), the workspace (control, topk_ids, slot_pos, sorted_token,
/// active_expert, active_offset, active_count, n_active, logits, route_weight, shared_scale,
/// partial, act), then tokens, `sizes` (experts, top_k, hidden, inter, shared_experts,
/// has_shared_gate) and the warps per gate_up and per down tile.
fn moe_arguments<'a>(
    [x, residual, y]: [KernelArg<'a>; 3],
    weights: &'a DeviceMoe,
    w: &'a mut DeviceWorkspace,
    tokens: u32,
    sizes: [u32; 6],
    warps: TileWarps,
    prefetch: [KernelArg<'a>; 2],
) -> [KernelArg<'a>; 34] {
    let [prefetch_words, prefetch_bytes] = prefetch;
    [
        x,
        residual,
        y,
        KernelArg::input(&weights.router),
        KernelArg::input(&weights.gate_up),
        KernelArg::optional_input(weights.gate_up_scales.as_ref()),
        KernelArg::input(&weights.down),
        KernelArg::optional_input(weights.down_scales.as_ref()),
        KernelArg::input(&weights.gate_up_alpha),
        KernelArg::input(&weights.down_alpha),
        KernelArg::output(&mut w.control),
        KernelArg::output(&mut w.topk_ids),
        KernelArg::output(&mut w.slot_pos),
        KernelArg::output(&mut w.sorted_token),
        KernelArg::output(&mut w.active_expert),
        KernelArg::output(&mut w.active_offset),
        KernelArg::output(&mut w.active_count),
        KernelArg::output(&mut w.n_active),
        KernelArg::output(&mut w.logits),
        KernelArg::output(&mut w.route_weight),
        KernelArg::output(&mut w.shared_scale),
        KernelArg::output(&mut w.partial),
        KernelArg::output(&mut w.act),
        KernelArg::u32(tokens),
        KernelArg::u32(sizes[0]),
        KernelArg::u32(sizes[1]),
        KernelArg::u32(sizes[2]),
        KernelArg::u32(sizes[3]),
        KernelArg::u32(sizes[4]),
        KernelArg::u32(sizes[5]),
        KernelArg::u32(warps.gate_up),
        KernelArg::u32(warps.down),
        prefetch_words,
        prefetch_bytes,
    ]
}

/// The device path of [`moe_block`] (shapes checked by the caller): one launch of
/// `moe_{format}_m{rows}` per `capacity` tokens.
#[allow(clippy::too_many_arguments)]
fn moe_block_device(
    backend: &Backend,
    weights: &MoeWeights,
    x: &DeviceVec<bf16>,
    t: usize,
    residual: Option<&DeviceVec<bf16>>,
    workspace: &mut MoeWorkspace,
    y: &mut DeviceVec<bf16>,
    launch: MoeLaunch,
    prefetch: Option<&DeviceVec<u32>>,
) -> Result<()> {
    let mismatch = |what: &str, found: &'static str| Error::BackendMismatch {
        what: what.into(),
        expected: backend.name(),
        found,
    };
    let device = match &weights.storage {
        MoeStorage::Device(d) if d.backend_name() == backend.name() => d,
        MoeStorage::Device(d) => return Err(mismatch("MoE weights", d.backend_name())),
        MoeStorage::Host(_) => return Err(mismatch("MoE weights", "cpu")),
    };
    let capacity = workspace.capacity;
    let w: &mut DeviceWorkspace = match &mut workspace.storage {
        WorkspaceStorage::Device(w) => w,
        WorkspaceStorage::Host(_) => return Err(mismatch("MoE workspace", "cpu")),
    };
    let (Some(target), Some(multiprocessors)) = (backend.target(), backend.multiprocessors())
    else {
        return Err(mismatch("MoE launch", "cpu"));
    };
    let shape = weights.shape;
    let tiles = &target.moe;
    let threads = tiles.warps_per_block * target.warp_size;
    let sizes = [
        check_u32("MoE experts", shape.experts)?,
        check_u32("MoE top-k", shape.top_k)?,
        check_u32("MoE hidden size", shape.hidden)?,
        check_u32("MoE intermediate size", shape.intermediate)?,
        check_u32("MoE shared experts", weights.shared_experts)?,
        u32::from(device.has_shared_gate),
    ];
    let h = shape.hidden;
    for start in (0..t).step_by(capacity) {
        let tokens = (t - start).min(capacity);
        let rows = tiles
            .token_rows
            .iter()
            .copied()
            .find(|&r| r as usize >= tokens)
            .or_else(|| tiles.token_rows.last().copied())
            .unwrap_or(8);
        let [persistent, route, gate_up, down] = kernel_prefixes(weights.format);
        let launch = launch.resolve(target, tokens);
        let split_grids = || {
            SplitGrids::new(
                target,
                shape,
                weights.shared_experts,
                device.has_shared_gate,
                tokens,
                rows,
            )
        };
        // (kernel, blocks) of each launch, without a heap allocation per block
        let (split_launches, stream_launches, bulk_launches, persistent_launch);
        let launches: &[(&str, u32)] = match launch {
            MoeLaunch::Split => {
                let plan = split_grids();
                split_launches = [
                    (moe_kernel(target, route, rows)?, plan.route),
                    (moe_kernel(target, gate_up, rows)?, plan.gate_up),
                    (moe_kernel(target, down, rows)?, plan.down),
                ];
                &split_launches
            }
            // bf16 experts have no bulk kernels: the streaming form's launches serve them
            MoeLaunch::Bulk if weights.format == ExpertFormat::Nvfp4 => {
                let [bulk_gate_up, bulk_down] = BULK_KERNELS;
                let bulk_blocks = multiprocessors * tiles.bulk_blocks_per_sm;
                bulk_launches = [
                    (moe_kernel(target, route, rows)?, split_grids().route),
                    (named_kernel(target, bulk_gate_up)?, bulk_blocks),
                    (named_kernel(target, bulk_down)?, bulk_blocks),
                    (
                        named_kernel(target, "moe_stream_combine")?,
                        stream_combine_blocks(target, h, tokens),
                    ),
                ];
                &bulk_launches
            }
            MoeLaunch::Stream | MoeLaunch::Bulk => {
                let [stream_down, combine] = stream_kernel_names(weights.format);
                let plan = split_grids();
                stream_launches = [
                    (moe_kernel(target, route, rows)?, plan.route),
                    (moe_kernel(target, gate_up, rows)?, plan.gate_up),
                    (
                        named_kernel(target, stream_down)?,
                        multiprocessors * tiles.split_blocks_per_sm,
                    ),
                    (
                        named_kernel(target, combine)?,
                        stream_combine_blocks(target, h, tokens),
                    ),
                ];
                &stream_launches
            }
            MoeLaunch::Persistent | MoeLaunch::Auto => {
                let blocks = multiprocessors * tiles.blocks_per_sm;
                persistent_launch = [(moe_kernel(target, persistent, rows)?, blocks)];
                &persistent_launch
            }
        };
        let chunk = start * h..(start + tokens) * h;
        let residual_rows = match residual {
            Some(r) => KernelArg::input_range(r, chunk.clone())?,
            None => KernelArg::optional_input::<bf16>(None),
        };
        let io = [
            KernelArg::input_range(x, chunk.clone())?,
            residual_rows,
            KernelArg::output_range(y, chunk)?,
        ];
        // tokens <= capacity, checked against 16-bit slot counts
        let warps = tile_warps(target, tokens);
        let prefetch_bytes = prefetch.map_or(0, |words| {
            prefetch_bytes(target, launch, tokens, words.len() * 4)
        });
        let prefetch_args = [
            KernelArg::optional_input(prefetch.filter(|_| prefetch_bytes > 0)),
            KernelArg::u32(prefetch_bytes as u32),
        ];
        let args = moe_arguments(io, device, w, tokens as u32, sizes, warps, prefetch_args);
        for &(kernel, blocks) in launches {
            let dims = LaunchDims::linear(blocks, threads);
            // SAFETY: every moe kernel takes MOE_PARAMETERS in order (moe_arguments); X, Y and
            // the residual hold t * H bf16 (checked by the caller) and the chunk lies within
            // them; the weights were laid out for this shape and the target's tensor core, and
            // the workspace sized for `capacity` tokens of it (shape checked by the caller); its
            // counters are zero between launches (arrival counters rearm themselves, the
            // persistent launch's last block resets the rest); the split launches' grids are the
            // item counts of SplitGrids, which the kernels derive the same way.
            unsafe { backend.launch(FAMILY, kernel, &dims, &args) }?;
        }
        w.last_tokens = tokens;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::launch_check;
    use crate::target;

    /// The launch's argument list (built by [`moe_arguments`]) meets every target's compiled
    /// kernels: count, kinds and scalar widths (PTX types on the NVIDIA targets, the code
    /// object's metadata through the HIP launch check on gfx1151), with and without NVFP4
    /// scales and a residual.
    fn no_prefetch<'a>() -> [KernelArg<'a>; 2] {
        [KernelArg::optional_input::<u32>(None), KernelArg::u32(0)]
    }

    #[test]
    fn the_argument_list_meets_the_compiled_kernels_parameters() {
        let u32s = || DeviceVec::Host(vec![0u32; 4]);
        let f32s = || DeviceVec::Host(vec![0f32; 4]);
        let weights = DeviceMoe {
            router: u32s(),
            has_shared_gate: true,
            gate_up: u32s(),
            gate_up_scales: Some(DeviceVec::Host(vec![0u8; 4])),
            down: u32s(),
            down_scales: Some(DeviceVec::Host(vec![0u8; 4])),
            gate_up_alpha: f32s(),
            down_alpha: f32s(),
        };
        let mut workspace = DeviceWorkspace {
            control: u32s(),
            topk_ids: u32s(),
            slot_pos: u32s(),
            sorted_token: u32s(),
            active_expert: u32s(),
            active_offset: u32s(),
            active_count: u32s(),
            n_active: u32s(),
            logits: f32s(),
            route_weight: f32s(),
            shared_scale: f32s(),
            partial: f32s(),
            act: DeviceVec::Host(vec![bf16::ZERO; 4]),
            last_tokens: 0,
        };
        let x = DeviceVec::Host(vec![bf16::ZERO; 4]);
        let mut y = DeviceVec::Host(vec![bf16::ZERO; 4]);
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            for &rows in &t.moe.token_rows {
                for (format, residual) in
                    [(ExpertFormat::Nvfp4, Some(&x)), (ExpertFormat::Bf16, None)]
                {
                    for prefix in kernel_prefixes(format) {
                        let kernel = moe_kernel(t, prefix, rows).expect("rendered");
                        let io = [
                            KernelArg::input(&x),
                            KernelArg::optional_input(residual),
                            KernelArg::output(&mut y),
                        ];
                        let sizes = [8, 2, 64, 32, 0, 1];
                        let warps = tile_warps(t, 1);
                        let args = moe_arguments(
                            io,
                            &weights,
                            &mut workspace,
                            1,
                            sizes,
                            warps,
                            no_prefetch(),
                        );
                        checks.check(&t.name, kernel, &args);
                    }
                }
            }
            if MoeLaunch::forms(t).contains(&MoeLaunch::Stream) {
                for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
                    let bulk = (format == ExpertFormat::Nvfp4
                        && MoeLaunch::forms(t).contains(&MoeLaunch::Bulk))
                    .then_some(BULK_KERNELS);
                    let names = stream_kernel_names(format);
                    for name in names.into_iter().chain(bulk.into_iter().flatten()) {
                        let kernel = named_kernel(t, name).expect("rendered");
                        let io = [
                            KernelArg::input(&x),
                            KernelArg::optional_input(Some(&x)),
                            KernelArg::output(&mut y),
                        ];
                        let sizes = [8, 2, 64, 32, 1, 1];
                        let args = moe_arguments(
                            io,
                            &weights,
                            &mut workspace,
                            9,
                            sizes,
                            tile_warps(t, 9),
                            no_prefetch(),
                        );
                        checks.check(&t.name, kernel, &args);
                    }
                }
            }
        }
        checks.assert_all_match();
    }

    /// `Auto` follows each target's thresholds: split up to `moe.stream_min_tokens` (or to
    /// `moe.split_max_tokens` without the streaming form), streaming from there (bulk from
    /// `moe.bulk_min_tokens` where that is set), persistent above; an explicit choice stays
    /// itself.
    #[test]
    fn auto_resolves_by_the_targets_thresholds() {
        for t in target::all() {
            let (split_max, stream_min, bulk_min) = (
                t.moe.split_max_tokens as usize,
                t.moe.stream_min_tokens as usize,
                t.moe.bulk_min_tokens as usize,
            );
            for tokens in 1..=split_max + 1 {
                let want = if tokens > split_max {
                    MoeLaunch::Persistent
                } else if bulk_min > 0 && tokens >= bulk_min {
                    MoeLaunch::Bulk
                } else if stream_min > 0 && tokens >= stream_min {
                    MoeLaunch::Stream
                } else {
                    MoeLaunch::Split
                };
                let got = MoeLaunch::Auto.resolve(t, tokens);
                assert_eq!(got, want, "{} T={tokens}", t.name);
                assert!(MoeLaunch::forms(t).contains(&got), "{} T={tokens}", t.name);
                assert_eq!(MoeLaunch::Split.resolve(t, tokens), MoeLaunch::Split);
            }
        }
    }

    /// The next-layer prefetch: the target's bytes in route launches of at most its token limit,
    /// none in larger blocks or the persistent launch (it has no route launch), never past the
    /// weight, always whole 16-byte units.
    #[test]
    fn the_route_launch_prefetches_within_its_token_limit_and_the_weight() {
        for t in target::all() {
            let (bytes, max) = (
                t.moe.prefetch_next_layer_bytes as usize,
                t.moe.prefetch_next_layer_max_tokens as usize,
            );
            for tokens in 1..=max + 1 {
                let want = if tokens <= max { bytes & !15 } else { 0 };
                for launch in [MoeLaunch::Split, MoeLaunch::Stream] {
                    assert_eq!(
                        prefetch_bytes(t, launch, tokens, usize::MAX),
                        want,
                        "{}",
                        t.name
                    );
                }
                assert_eq!(
                    prefetch_bytes(t, MoeLaunch::Persistent, tokens, usize::MAX),
                    0
                );
            }
            if max > 0 && bytes > 0 {
                let short = bytes / 2 + 9;
                let got = prefetch_bytes(t, MoeLaunch::Split, 1, short);
                assert_eq!(got, short & !15, "{}: clamped to the weight", t.name);
            }
        }
        assert!(
            target::all()
                .iter()
                .any(|t| t.moe.prefetch_next_layer_bytes > 0)
        );
    }

    /// Every variant a launch can pick (each target's `moe.token_rows`, both formats, persistent
    /// and split, and the streaming kernels where `moe.stream_min_tokens` turns them on) is a
    /// kernel of the target's rendered source; other row counts are refused by name.
    #[test]
    fn every_token_rows_variant_resolves_to_a_rendered_kernel() {
        for t in target::all() {
            for &rows in &t.moe.token_rows {
                for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
                    for prefix in kernel_prefixes(format) {
                        let kernel = moe_kernel(t, prefix, rows).expect("rendered");
                        assert_eq!(kernel, format!("{prefix}{rows}"), "{}", t.name);
                    }
                }
            }
            let e = moe_kernel(t, "moe_bf16_m", 3).unwrap_err().to_string();
            assert!(e.contains("moe_bf16_m3") && e.contains(&t.name), "{e}");
            // the streaming launches exactly where targets.toml turns them on
            for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
                for name in stream_kernel_names(format) {
                    match named_kernel(t, name) {
                        Ok(kernel) => {
                            assert!(t.moe.stream_min_tokens > 0, "{} {kernel}", t.name);
                            assert_eq!(kernel, name);
                        }
                        Err(e) => {
                            assert_eq!(t.moe.stream_min_tokens, 0, "{} {name}: {e}", t.name);
                            assert!(e.to_string().contains(name), "{e}");
                        }
                    }
                }
            }
            // the bulk launches exactly where the form is
            let bulk_form = MoeLaunch::forms(t).contains(&MoeLaunch::Bulk);
            for name in BULK_KERNELS {
                assert_eq!(
                    named_kernel(t, name).is_ok(),
                    bulk_form,
                    "{} {name}",
                    t.name
                );
            }
        }
    }
}
