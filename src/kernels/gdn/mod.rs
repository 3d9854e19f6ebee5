//! Family `gdn`: Gated DeltaNet linear attention (`kernels/templates/gdn.cu`), from the raw
//! projection rows (`in_proj_qkv`, `in_proj_a`, `in_proj_b`, `in_proj_z`) to the rows
//! `out_proj` consumes: conv1d + SiLU, the split into q, k, v, L2 norms and q scale, the gates,
//! the gated delta rule, and the gated RMSNorm, fused into the kernels that consume them. The
//! CPU backend runs [`reference`](mod@reference); a device (CUDA or HIP,
//! through [`Backend::launch`]) runs the kernels below.
//!
//! # Kernels
//! - [`step`] (`gdn_step_dk{128,256}`, and `gdn_step_dk128_dv128` for exactly the real heads):
//!   decode or speculative verify of `m` tokens per sequence for a batch, one launch. One block per
//!   (value head, `step_dv_per_block` value columns, sequence; the last slice of a head masked past
//!   dv); the block's state slice lives in registers (16-byte loads and stores, read once and
//!   written once per step); each token costs one reduction of `(S^T k, S^T q)` (warp shuffles;
//!   then one barrier only where several warps hold rows of the same columns,
//!   `gdn.step_column_lanes`), since `o = e^g S^T q + u (k . q)` needs no second pass. The gated
//!   RMSNorm needs the whole head: where one block holds it (sm_90a: 256 threads over dv = 128)
//!   that block applies it; otherwise the last of the head's blocks to finish does (an arrival
//!   counter per (sequence, head), reset by that block), so a decode step stays one launch. A
//!   block's life is a latency chain (at B = 1 one block per head, at B = 64 eight waves of
//!   them), so its front end is one round of loads over all its threads: the conv taps of the
//!   (q, k) pairs and of its v columns in one index space, z and the norm weights staged beside
//!   them; one 64-bit state address per thread, 32-bit ring arithmetic (H200: 18.4 -> 13.6 us
//!   per launch at B = 1, 153 -> 122 us at B = 64, BENCHMARKS.md).
//! - [`prefill`]: chunk 64 in the WY / UT form on tensor cores (`mma.sync` bf16, fp32
//!   accumulation; a lane-by-lane fallback of the same fragment layout on gfx1151), for a
//!   variable-length batch given by `cu_seqlens`, continuing each sequence from its slot (state,
//!   conv window, pending tokens). `gdn_chunk_prepare_*` runs every (chunk, head) in parallel:
//!   conv, norms, gates, `K K^T`, `Q K^T`, the 64x64 triangular inverse (fp32), `W`, `U`, `M`
//!   to a [`ChunkWorkspace`]. `gdn_chunk_state_*` walks each sequence's chunks in order, one
//!   block per (head, `chunk_dv_per_block` value columns): the columns of the state are
//!   independent, so the sequential part runs on 32 x 4..8 blocks; the state slice stays in the
//!   accumulator registers (fp32) of four warps and is rounded to bf16 only as an MMA operand,
//!   while four more warps compute the outputs beside them. The gated
//!   RMSNorm is then `gdn_gated_norm` over the rows (a separate pass: a head's columns are
//!   spread over blocks). Where the time goes (H200, thirteenth session, ncu at T = 4096): the
//!   prepare pass 262 us, instruction-bound (117 M warp instructions, IPC 1.95 at 4 blocks per
//!   SM; a thread convolves 8 rows of 8 channels so each tap's loads fly together: under
//!   `ncu --set full` a T = 512 prepare went from 109.9 to 77.7 us with that change alone); the
//!   state pass 150 us, 64 chunks of about 2.3 us, one
//!   block per SM (stalls spread over the products, the stage loads and the barriers). Prefill
//!   at T = 512 / 4096 / 16384: 165.6 / 744.9 / 2893.9 us before that session, 83.7 / 385.0 /
//!   1475.2 after (BENCHMARKS.md). What would go further: the sequential pass computing only
//!   the states (W, K, U per chunk, 40% fewer bytes staged) with the outputs in a parallel pass
//!   over chunks from stored chunk states, as fla does; the prepare pass once per key head
//!   (its q and k are computed by both value heads today).
//! - [`Sequences::commit`] (`gdn_commit`): the bookkeeping after a step.
//!
//! # The cache and the speculative step
//! A [`GdnCache`] holds, per sequence slot: the state `[Hv][dk][dv]` fp32; and a ring of
//! [`GdnCache::ring_len`] token positions (indexed by absolute position modulo the ring) with
//! the raw qkv row (bf16; the conv window is the last `kernel - 1` of them) and, for verified
//! tokens, the replay data: the normalised k `[Hk][dk]`, `u = beta (v - (e^g S)^T k)`
//! `[Hv][dv]` and g `[Hv]` (fp32). [`Sequences`] says, per sequence of a batch, its slot, its
//! position (tokens committed) and how many of them are *pending*: accepted but not yet folded
//! into the state, which holds the state after `position - pending` tokens (a slot whose
//! folded position is 0 is read as the zero state).
//!
//! A verify step of `n + 1` tokens replays the pending tokens (`S = e^g S + k u^T`: a rank-1
//! update per token, no reduction), stores that state (the pre-verify state), runs the new
//! tokens producing every output, and records each one's replay data at its position. The
//! runner then commits any accepted count `a` in `0..=n+1`: `position += a`, `pending = a`.
//! Nothing is undone and no prefix is recomputed: the next step (verify, decode or prefill)
//! replays the `a` accepted tokens at its start, and the rejected positions are overwritten. The
//! conv window follows the same rule for free: it is the ring's last `kernel - 1` rows before
//! `position`. A decode step folds its tokens (commit with [`StepMode::Decode`]: pending 0).
//!
//! Why this design (the cost goal: verify with `n + 1 = 3` at most 1.3x a decode step, whose
//! floor is reading and writing the 2 MiB state once): vLLM writes the state after every
//! verified token (`n + 1` writes: 2x a decode step's traffic at `n + 1 = 3`, 3x at 5);
//! keeping two states and selecting by acceptance doubles the slot memory and still writes a
//! full state. Here a step reads the state once and writes it once whatever `n` is; the extra
//! traffic is the replay data, `(Hk dk + Hv dv + Hv) * 4` = 24.1 KiB per token per layer
//! written and read back (1.2% of the state per token), and the extra work is the replay's
//! `pending` fused multiply-adds per state element, overlapped with the state's load.
//!
//! # Layouts
//! Projection rows are bf16 [`Bf16Rows`] (any row stride, so fused projections work): qkv `[rows]
//! [conv_dim]` (q `Hk dk`, k `Hk dk`, v `Hv dv`), a and b `[rows][Hv]`, z `[rows][Hv dv]`; the
//! step's row of token `t` of sequence `b` is `b * m + t`, prefill's rows are the sequences'
//! tokens one after another (`cu_seqlens`). Outputs are bf16 `[rows][Hv dv]`. Parameters are
//! f32 ([`GdnParams`]).
//!
//! # Limits and checks
//! dk and dv are multiples of 16, dk at most 256 ([`step`]) and one of [`CHUNK_DK`] ([`prefill`],
//! the instantiated chunk kernels); the step takes at most `gdn.step_max_tokens` tokens per sequence
//! (targets.toml). The kernels are checked against the CPU backend on a GPU
//! (`tests/gpu/gdn.rs`) and, without one, by running the rendered sources of sm_90a, sm_121a
//! and gfx1151 on the CPU with the MMA fragments emulated (`tests/gdn_emulated.rs`).

pub mod reference;

pub use reference::{GdnShape, StepMode};

use super::{Bf16Rows, check_grid_y, check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::target::TargetFacts;
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "gdn";
/// Tokens per chunk of the prefill kernels.
pub const CHUNK: usize = 64;
/// Largest dk of the step kernel (its shared-memory tiles).
pub const STEP_MAX_DK: usize = 256;
/// The dk values the prefill kernels are instantiated for.
pub const CHUNK_DK: [usize; 3] = [32, 64, 128];

/// Bytes of one sequence's recurrent state (fp32): what a decode step must read and write.
pub fn state_bytes(shape: GdnShape) -> u64 {
    4 * shape.state_len() as u64
}

/// Floating-point operations of the chunked prefill of `tokens` tokens (the tensor-core
/// products of both passes: `K K^T`, `Q K^T`, `W`, `U` per chunk and head; `W S`, `Q S`,
/// `M V'`, `K^T V'` per chunk, head and value column), counting a multiply-add as 2.
pub fn chunk_flops(shape: GdnShape, tokens: usize) -> f64 {
    let (c, dk, dv) = (CHUNK as f64, shape.dk as f64, shape.dv as f64);
    let per_token_head = 2.0 * (2.0 * c * dk + c * dk + c * dv + 2.0 * dk * dv + c * dv + dk * dv);
    per_token_head * shape.value_heads as f64 * tokens as f64
}

/// Checks that a shape is one the kernels take.
fn check_shape(shape: GdnShape) -> Result<()> {
    let GdnShape {
        key_heads,
        value_heads,
        dk,
        dv,
    } = shape;
    if key_heads == 0 || value_heads % key_heads != 0 {
        return Err(Error::invalid(
            "gdn shape",
            format!("{value_heads} value heads are not a multiple of {key_heads} key heads"),
        ));
    }
    if dk == 0 || dk % 16 != 0 || dk > STEP_MAX_DK || dv == 0 || dv % 16 != 0 {
        return Err(Error::invalid(
            "gdn shape",
            format!(
                "dk = {dk}, dv = {dv}: both must be positive multiples of 16, dk at most {STEP_MAX_DK}"
            ),
        ));
    }
    Ok(())
}

/// One layer's parameters on a backend, as f32.
pub struct GdnParams {
    shape: GdnShape,
    kernel: usize,
    eps: f32,
    conv_weight: DeviceVec<f32>,
    a_log: DeviceVec<f32>,
    dt_bias: DeviceVec<f32>,
    norm_weight: DeviceVec<f32>,
}

impl GdnParams {
    /// Uploads a layer's parameters: `conv_weight` `[conv_dim][kernel]` (`conv1d.weight` without
    /// its middle axis), `a_log` and `dt_bias` `[Hv]`, `norm_weight` `[dv]`, the gated RMSNorm's
    /// `eps`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a shape the kernels do not take, a kernel width outside 1..=8, or
    /// a buffer whose length disagrees with the shape; [`Error::Cuda`] / [`Error::Hip`] when an upload fails.
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        backend: &Backend,
        shape: GdnShape,
        kernel: usize,
        conv_weight: &[f32],
        a_log: &[f32],
        dt_bias: &[f32],
        norm_weight: &[f32],
        eps: f32,
    ) -> Result<Self> {
        check_shape(shape)?;
        if !(1..=8).contains(&kernel) {
            return Err(Error::invalid(
                "gdn conv kernel width",
                format!("{kernel} is outside 1..=8"),
            ));
        }
        for (what, len, want) in [
            (
                "gdn conv1d.weight",
                conv_weight.len(),
                shape.conv_dim() * kernel,
            ),
            ("gdn A_log", a_log.len(), shape.value_heads),
            ("gdn dt_bias", dt_bias.len(), shape.value_heads),
            ("gdn norm.weight", norm_weight.len(), shape.dv),
        ] {
            if len != want {
                return Err(Error::invalid(
                    what,
                    format!("{len} values, expected {want} for {shape:?} and kernel {kernel}"),
                ));
            }
        }
        Ok(Self {
            shape,
            kernel,
            eps,
            conv_weight: backend.upload(conv_weight)?,
            a_log: backend.upload(a_log)?,
            dt_bias: backend.upload(dt_bias)?,
            norm_weight: backend.upload(norm_weight)?,
        })
    }

    /// A second copy on the same backend (device to device on a device).
    ///
    /// # Errors
    /// [`Error::BackendMismatch`] for parameters of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when a copy fails.
    pub fn try_clone(&self, backend: &Backend) -> Result<Self> {
        Ok(Self {
            shape: self.shape,
            kernel: self.kernel,
            eps: self.eps,
            conv_weight: backend.duplicate(&self.conv_weight)?,
            a_log: backend.duplicate(&self.a_log)?,
            dt_bias: backend.duplicate(&self.dt_bias)?,
            norm_weight: backend.duplicate(&self.norm_weight)?,
        })
    }

    /// The layer's head shape.
    pub fn shape(&self) -> GdnShape {
        self.shape
    }

    /// The conv kernel width.
    pub fn kernel(&self) -> usize {
        self.kernel
    }
}

/// One layer's per-sequence state on a backend: see the module docs for the layout.
pub struct GdnCache {
    shape: GdnShape,
    kernel: usize,
    slots: usize,
    max_step_tokens: usize,
    ring_len: usize,
    state: DeviceVec<f32>,
    conv: DeviceVec<bf16>,
    ring_k: DeviceVec<f32>,
    ring_u: DeviceVec<f32>,
    ring_g: DeviceVec<f32>,
    o_scratch: DeviceVec<f32>,
    counters: DeviceVec<u32>,
}

/// Most tokens per sequence one decode / verify step takes on `backend`: the target's
/// `gdn.step_max_tokens`, and on the CPU the largest any target may declare
/// ([`crate::target::GDN_STEP_MAX_TOKENS`]).
pub fn step_max_tokens(backend: &Backend) -> usize {
    backend
        .target()
        .map_or(crate::target::GDN_STEP_MAX_TOKENS, |t| {
            t.gdn.step_max_tokens
        }) as usize
}

impl GdnCache {
    /// Zeroed slots for `slots` sequences of a layer with conv width `kernel`, for steps of at
    /// most `max_step_tokens` tokens per sequence.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a shape the kernels do not take, no slots, or more step tokens
    /// than the target's `gdn.step_max_tokens`; [`Error::Cuda`] / [`Error::Hip`] when an allocation fails.
    pub fn new(
        backend: &Backend,
        shape: GdnShape,
        kernel: usize,
        slots: usize,
        max_step_tokens: usize,
    ) -> Result<Self> {
        check_shape(shape)?;
        let most = step_max_tokens(backend);
        if slots == 0 || max_step_tokens == 0 || max_step_tokens > most || kernel == 0 {
            return Err(Error::invalid(
                "gdn cache",
                format!(
                    "{slots} slots, {max_step_tokens} tokens per step, kernel {kernel}: needs at \
                     least one slot and 1..={most} tokens per step"
                ),
            ));
        }
        // written positions [pos, pos + m) never alias read ones [pos - max(kernel - 1, pending), pos)
        let ring_len = (kernel - 1).max(max_step_tokens) + max_step_tokens;
        let (hk, hv, dk, dv) = (shape.key_heads, shape.value_heads, shape.dk, shape.dv);
        Ok(Self {
            shape,
            kernel,
            slots,
            max_step_tokens,
            ring_len,
            state: backend.zeros(slots * shape.state_len())?,
            conv: backend.zeros(slots * ring_len * shape.conv_dim())?,
            ring_k: backend.zeros(slots * ring_len * hk * dk)?,
            ring_u: backend.zeros(slots * ring_len * hv * dv)?,
            ring_g: backend.zeros(slots * ring_len * hv)?,
            o_scratch: backend.zeros(slots * max_step_tokens * hv * dv)?,
            counters: backend.zeros(slots * hv)?,
        })
    }

    /// Positions kept per slot (`max(kernel - 1, m) + m` for `m` tokens per step).
    pub fn ring_len(&self) -> usize {
        self.ring_len
    }

    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Most tokens per sequence and step.
    pub fn max_step_tokens(&self) -> usize {
        self.max_step_tokens
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.slots {
            return Err(Error::invalid(
                "gdn slot",
                format!("{slot} is not below the cache's {} slots", self.slots),
            ));
        }
        Ok(())
    }

    /// Puts a sequence into `slot` at `position`: its state `[Hv][dk][dv]` (the state after
    /// `position` tokens, nothing pending) and conv window `[kernel - 1][conv_dim]` (the raw qkv
    /// rows of the positions before `position`, oldest first). Used to restore a sequence and by
    /// tests; the [`Sequences`] entry must say `position` with 0 pending.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a slot past the cache or buffers that disagree with the shape;
    /// [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn set_sequence(
        &mut self,
        backend: &Backend,
        slot: usize,
        position: usize,
        state: &[f32],
        window: &[bf16],
    ) -> Result<()> {
        self.check_slot(slot)?;
        let (size, channels, rows) = (
            self.shape.state_len(),
            self.shape.conv_dim(),
            self.kernel - 1,
        );
        if state.len() != size || window.len() != rows * channels {
            return Err(Error::invalid(
                "gdn sequence",
                format!(
                    "state of {} and window of {} values; expected {size} and {}",
                    state.len(),
                    window.len(),
                    rows * channels
                ),
            ));
        }
        backend.write(&mut self.state, slot * size, state)?;
        for r in 0..rows {
            let Some(p) = (position + r).checked_sub(rows) else {
                continue; // before the sequence's start: read as zeros, never stored
            };
            let at = (slot * self.ring_len + p % self.ring_len) * channels;
            backend.write(
                &mut self.conv,
                at,
                &window[r * channels..(r + 1) * channels],
            )?;
        }
        Ok(())
    }

    /// The state stored in `slot` (after `position - pending` tokens of its sequence).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a slot past the cache, [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn state(&self, backend: &Backend, slot: usize) -> Result<Vec<f32>> {
        self.check_slot(slot)?;
        let size = self.shape.state_len();
        backend.read(&self.state, slot * size..(slot + 1) * size)
    }

    /// The conv window of `slot` at `position`: the raw qkv rows of the `kernel - 1` positions
    /// before it, `[kernel - 1][conv_dim]`, zeros before the sequence's start.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a slot past the cache, [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn conv_window(
        &self,
        backend: &Backend,
        slot: usize,
        position: usize,
    ) -> Result<Vec<bf16>> {
        self.check_slot(slot)?;
        let (rows, channels) = (self.kernel - 1, self.shape.conv_dim());
        let mut window = Vec::with_capacity(rows * channels);
        for r in 0..rows {
            match (position + r).checked_sub(rows) {
                Some(p) => {
                    let at = (slot * self.ring_len + p % self.ring_len) * channels;
                    window.extend(backend.read(&self.conv, at..at + channels)?);
                }
                None => window.extend(std::iter::repeat_n(bf16::ZERO, channels)),
            }
        }
        Ok(window)
    }
}

/// The ring rows of the `kernel - 1` positions before `position` (None before position 0).
fn window_rows<'a>(
    conv: &'a [bf16],
    cache: &GdnCache,
    slot: usize,
    position: usize,
) -> Vec<Option<&'a [bf16]>> {
    let (rows, channels) = (cache.kernel - 1, cache.shape.conv_dim());
    (0..rows)
        .map(|r| {
            (position + r).checked_sub(rows).map(|p| {
                let at = (slot * cache.ring_len + p % cache.ring_len) * channels;
                &conv[at..at + channels]
            })
        })
        .collect()
}

/// How many tokens each sequence of a step accepted.
#[derive(Clone, Copy)]
pub enum Accepted<'a> {
    /// The same count for every sequence (a decode step: its `m`; a flush: 0).
    All(u32),
    /// One count per sequence, e.g. written by the verification kernel.
    PerSequence(&'a DeviceVec<u32>),
}

/// A batch of sequences: per sequence its cache slot, its position (tokens committed) and its
/// pending count (accepted tokens not yet folded into the state).
pub struct Sequences {
    slots: DeviceVec<u32>,
    positions: DeviceVec<u32>,
    pending: DeviceVec<u32>,
}

impl Sequences {
    /// Sequences in `slots` at `positions`, nothing pending.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the lists differ in length or are empty, [`Error::Cuda`] / [`Error::Hip`] when an
    /// upload fails.
    pub fn new(backend: &Backend, slots: &[u32], positions: &[u32]) -> Result<Self> {
        if slots.len() != positions.len() || slots.is_empty() {
            return Err(Error::invalid(
                "gdn sequences",
                format!(
                    "{} slots and {} positions: one each per sequence, at least one",
                    slots.len(),
                    positions.len()
                ),
            ));
        }
        Ok(Self {
            slots: backend.upload(slots)?,
            positions: backend.upload(positions)?,
            pending: backend.zeros(slots.len())?,
        })
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the batch is empty (never: [`Sequences::new`] refuses it).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Puts every sequence back at `positions` with nothing pending, in the same buffers (a
    /// graph captured with them stays valid).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `positions` has a length other than the batch's,
    /// [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn restart(&mut self, backend: &Backend, positions: &[u32]) -> Result<()> {
        if positions.len() != self.len() {
            return Err(Error::invalid(
                "gdn sequences",
                format!("{} positions for {} sequences", positions.len(), self.len()),
            ));
        }
        backend.write(&mut self.positions, 0, positions)?;
        backend.fill_zeros(&mut self.pending)
    }

    /// The positions, downloaded.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn positions(&self, backend: &Backend) -> Result<Vec<u32>> {
        backend.download(&self.positions)
    }

    /// The pending counts, downloaded.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn pending(&self, backend: &Backend) -> Result<Vec<u32>> {
        backend.download(&self.pending)
    }

    /// After a step: `position += accepted`; `pending = accepted` after a verify step (they wait
    /// for the next step's replay), 0 after a decode step, a prefill or a flush (`mode` is
    /// [`StepMode::Decode`] for those). One launch for every layer of the model (the layers
    /// share positions).
    ///
    /// # Errors
    /// [`Error::Invalid`] when a per-sequence count list has the wrong length,
    /// [`Error::BackendMismatch`] / [`Error::Cuda`] / [`Error::Hip`] from the device path.
    pub fn commit(
        &mut self,
        backend: &Backend,
        accepted: Accepted<'_>,
        mode: StepMode,
    ) -> Result<()> {
        let count = self.len();
        if let Accepted::PerSequence(a) = accepted {
            check_len("gdn accepted counts", a, count, &format!("[{count}]"))?;
        }
        let fold = mode == StepMode::Decode;
        match backend {
            Backend::Cpu => {
                let (DeviceVec::Host(positions), DeviceVec::Host(pending)) =
                    (&mut self.positions, &mut self.pending)
                else {
                    return Err(backend.mismatch("gdn sequences", &self.slots));
                };
                for i in 0..count {
                    let a = match accepted {
                        Accepted::All(a) => a,
                        Accepted::PerSequence(DeviceVec::Host(v)) => v[i],
                        Accepted::PerSequence(other) => {
                            return Err(backend.mismatch("gdn accepted counts", other));
                        }
                    };
                    positions[i] = positions[i].wrapping_add(a);
                    pending[i] = if fold { 0 } else { a };
                }
                Ok(())
            }
            Backend::Cuda(_) | Backend::Hip(_) => {
                let (uniform, accepted_arg) = match accepted {
                    Accepted::All(a) => (a, KernelArg::optional_input::<u32>(None)),
                    Accepted::PerSequence(v) => (0, KernelArg::input(v)),
                };
                let (count32, fold32) = (check_u32("gdn sequences", count)?, u32::from(fold));
                let args = commit_arguments(self, accepted_arg, [uniform, count32, fold32]);
                // SAFETY: gdn_commit's parameters in order (commit_arguments); every array holds
                // `count` elements (accepted checked above).
                unsafe {
                    backend.launch(
                        FAMILY,
                        KERNEL_COMMIT,
                        &LaunchDims::linear(count32.div_ceil(COMMIT_THREADS), COMMIT_THREADS),
                        &args,
                    )
                }
            }
        }
    }
}

/// The projection rows of a call.
#[derive(Clone, Copy)]
pub struct Projections<'a> {
    /// `in_proj_qkv` rows, `[rows][conv_dim]`.
    pub qkv: Bf16Rows<'a>,
    /// `in_proj_a` rows, `[rows][Hv]`.
    pub a: Bf16Rows<'a>,
    /// `in_proj_b` rows, `[rows][Hv]`.
    pub b: Bf16Rows<'a>,
    /// `in_proj_z` rows, `[rows][Hv dv]`: with them the outputs go through the gated RMSNorm,
    /// without them they are the raw recurrence outputs.
    pub z: Option<Bf16Rows<'a>>,
}

impl Projections<'_> {
    fn check(&self, shape: GdnShape, rows: usize) -> Result<()> {
        self.qkv
            .check("gdn qkv rows", rows, shape.conv_dim(), true)?;
        self.a.check("gdn a rows", rows, shape.value_heads, false)?;
        self.b.check("gdn b rows", rows, shape.value_heads, false)?;
        if let Some(z) = &self.z {
            z.check("gdn z rows", rows, shape.value_heads * shape.dv, false)?;
        }
        Ok(())
    }
}

/// The host-side view of a cache slot as the reference's [`reference::SequenceCache`].
fn host_sequence(
    cache: &GdnCache,
    host: &HostCache<'_>,
    slot: usize,
    position: usize,
    pending: usize,
) -> reference::SequenceCache {
    let shape = cache.shape;
    let size = shape.state_len();
    let state = if position > pending {
        host.state[slot * size..(slot + 1) * size].to_vec()
    } else {
        vec![0.0; size]
    };
    let window = window_rows(host.conv, cache, slot, position)
        .into_iter()
        .flat_map(|row| match row {
            Some(r) => r.iter().map(|x| x.to_f32()).collect(),
            None => vec![0.0; shape.conv_dim()],
        })
        .collect();
    let mut seq = reference::SequenceCache::new(state, window, position);
    let (kw, uw, gw) = (
        shape.key_heads * shape.dk,
        shape.value_heads * shape.dv,
        shape.value_heads,
    );
    for c in 0..pending {
        let at = slot * cache.ring_len + (position - pending + c) % cache.ring_len;
        seq.pending.push(reference::PendingToken {
            k: host.ring_k[at * kw..(at + 1) * kw].to_vec(),
            u: host.ring_u[at * uw..(at + 1) * uw].to_vec(),
            g: host.ring_g[at * gw..(at + 1) * gw].to_vec(),
        });
    }
    seq
}

struct HostCache<'a> {
    state: &'a [f32],
    conv: &'a [bf16],
    ring_k: &'a [f32],
    ring_u: &'a [f32],
    ring_g: &'a [f32],
}

/// The CPU backend of [`step`] and [`prefill`]: each sequence through the reference, the
/// results written back in the kernels' layout. `rows[b]` are sequence b's input rows;
/// `prefill` stores only the last `kernel - 1` raw rows (as the prefill kernels do).
#[allow(clippy::too_many_arguments)]
fn cpu_run(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    seqs: &Sequences,
    inputs: &Projections<'_>,
    rows: &[std::ops::Range<usize>],
    mode: StepMode,
    prefill: bool,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let host = |v: &DeviceVec<u32>| match v {
        DeviceVec::Host(h) => Ok(h.clone()),
        other => Err(backend.mismatch("gdn sequences", other)),
    };
    let (slots, positions, pending) = (
        host(&seqs.slots)?,
        host(&seqs.positions)?,
        host(&seqs.pending)?,
    );
    let param_host = |v: &DeviceVec<f32>| match v {
        DeviceVec::Host(h) => Ok(h.clone()),
        other => Err(backend.mismatch("gdn parameters", other)),
    };
    let (conv_weight, a_log, dt_bias, norm_weight) = (
        param_host(&params.conv_weight)?,
        param_host(&params.a_log)?,
        param_host(&params.dt_bias)?,
        param_host(&params.norm_weight)?,
    );
    let layer = reference::LayerParams {
        conv_weight: &conv_weight,
        kernel: params.kernel,
        a_log: &a_log,
        dt_bias: &dt_bias,
        norm_weight: &norm_weight,
        eps: f64::from(params.eps),
    };
    let shape = cache.shape;
    let (channels, width) = (shape.conv_dim(), shape.value_heads * shape.dv);
    let (kw, uw, gw) = (
        shape.key_heads * shape.dk,
        shape.value_heads * shape.dv,
        shape.value_heads,
    );
    let mut results = Vec::new();
    {
        let buffers = (
            &cache.state,
            &cache.conv,
            &cache.ring_k,
            &cache.ring_u,
            &cache.ring_g,
        );
        let (
            DeviceVec::Host(state),
            DeviceVec::Host(conv),
            DeviceVec::Host(ring_k),
            DeviceVec::Host(ring_u),
            DeviceVec::Host(ring_g),
        ) = buffers
        else {
            return Err(backend.mismatch("gdn cache", &cache.state));
        };
        let view = HostCache {
            state,
            conv,
            ring_k,
            ring_u,
            ring_g,
        };
        for (b, range) in rows.iter().enumerate() {
            let slot = slots[b] as usize;
            if slot >= cache.slots {
                return Err(Error::invalid(
                    "gdn slot",
                    format!(
                        "sequence {b} names slot {slot}; the cache has {}",
                        cache.slots
                    ),
                ));
            }
            let (pos, pend) = (positions[b] as usize, pending[b] as usize);
            if pend > pos || pend > cache.max_step_tokens {
                return Err(Error::invalid(
                    "gdn pending",
                    format!("sequence {b}: {pend} pending tokens at position {pos}"),
                ));
            }
            let mut seq = host_sequence(cache, &view, slot, pos, pend);
            let qkv = inputs
                .qkv
                .host_rows("gdn qkv rows", range.clone(), channels)?;
            let a = inputs
                .a
                .host_rows("gdn a rows", range.clone(), shape.value_heads)?;
            let bv = inputs
                .b
                .host_rows("gdn b rows", range.clone(), shape.value_heads)?;
            let z = match &inputs.z {
                Some(z) => Some(z.host_rows("gdn z rows", range.clone(), width)?),
                None => None,
            };
            let raw = reference::RawInputs {
                t: range.len(),
                qkv: &qkv,
                a: &a,
                b: &bv,
                z: z.as_deref(),
            };
            let outputs = seq.step(shape, layer, raw, mode);
            results.push((slot, pos, range.clone(), seq, outputs));
        }
    }
    let (
        DeviceVec::Host(state),
        DeviceVec::Host(conv),
        DeviceVec::Host(ring_k),
        DeviceVec::Host(ring_u),
        DeviceVec::Host(ring_g),
        DeviceVec::Host(out),
    ) = (
        &mut cache.state,
        &mut cache.conv,
        &mut cache.ring_k,
        &mut cache.ring_u,
        &mut cache.ring_g,
        out,
    )
    else {
        return Err(backend.mismatch("gdn output", &cache.state));
    };
    let (size, ring_len) = (shape.state_len(), cache.ring_len);
    for (slot, pos, range, seq, outputs) in results {
        state[slot * size..(slot + 1) * size].copy_from_slice(&seq.state);
        let t = range.len();
        let first_kept = if prefill {
            t.saturating_sub(params.kernel - 1)
        } else {
            0
        };
        for i in first_kept..t {
            let at = slot * ring_len + (pos + i) % ring_len;
            let row = inputs.qkv.host_rows(
                "gdn qkv rows",
                range.start + i..range.start + i + 1,
                channels,
            )?;
            for (dst, v) in conv[at * channels..(at + 1) * channels].iter_mut().zip(row) {
                *dst = bf16::from_f32(v);
            }
        }
        if mode == StepMode::Verify {
            for (i, (_, token)) in seq.verified().iter().enumerate() {
                let at = slot * ring_len + (pos + i) % ring_len;
                ring_k[at * kw..(at + 1) * kw].copy_from_slice(&token.k);
                ring_u[at * uw..(at + 1) * uw].copy_from_slice(&token.u);
                ring_g[at * gw..(at + 1) * gw].copy_from_slice(&token.g);
            }
        }
        for (i, v) in outputs.iter().enumerate() {
            out[range.start * width + i] = bf16::from_f32(*v);
        }
    }
    Ok(())
}

/// One step of `m` tokens for every sequence of `seqs` (row `b * m + t` of the projections and
/// of `out`, bf16 `[B m][Hv dv]`): decode ([`StepMode::Decode`]: the state after the tokens is
/// stored) or speculative verify ([`StepMode::Verify`]: the pre-verify state is kept and each
/// token's replay data recorded). Every sequence's pending tokens are replayed first. Follow it
/// with [`Sequences::commit`]. `m = 0` with `Decode` is a flush (see [`flush`]).
///
/// # Errors
/// [`Error::Invalid`] when the params, cache and shapes disagree, `m` exceeds the cache's
/// `max_step_tokens`, the batch exceeds the cache's slots, or a buffer is too short;
/// [`Error::BackendMismatch`] / [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the backends. On a device
/// a slot past the cache makes its sequence's blocks do nothing (device data is not read back).
#[allow(clippy::too_many_arguments)]
pub fn step(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    seqs: &Sequences,
    m: usize,
    inputs: &Projections<'_>,
    mode: StepMode,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let shape = params.shape;
    check_call(params, cache)?;
    let count = seqs.len();
    if m > cache.max_step_tokens || count > cache.slots {
        return Err(Error::invalid(
            "gdn step",
            format!(
                "{count} sequences of {m} tokens; the cache takes at most {} of {}",
                cache.slots, cache.max_step_tokens
            ),
        ));
    }
    let rows = count * m;
    inputs.check(shape, rows)?;
    let width = shape.value_heads * shape.dv;
    if rows > 0 {
        check_len(
            "gdn output",
            out,
            rows * width,
            &format!("[{rows}, {width}]"),
        )?;
    }
    match backend {
        Backend::Cpu => {
            let ranges: Vec<_> = (0..count).map(|b| b * m..(b + 1) * m).collect();
            cpu_run(
                backend, params, cache, seqs, inputs, &ranges, mode, false, out,
            )
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            step_device(backend, params, cache, seqs, m, inputs, mode, out)
        }
    }
}

/// Folds every sequence's pending tokens into its state (a decode step of 0 tokens, then the
/// commit): needed only to read a state back after a verify step.
///
/// # Errors
/// As [`step`] and [`Sequences::commit`].
pub fn flush(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    seqs: &mut Sequences,
) -> Result<()> {
    // no rows are read; a one-element buffer because a device allocation of 0 bytes fails
    let empty = backend.zeros::<bf16>(1)?;
    let rows = Bf16Rows::packed(&empty, 1);
    let inputs = Projections {
        qkv: rows,
        a: rows,
        b: rows,
        z: None,
    };
    let mut out = backend.zeros::<bf16>(1)?;
    step(
        backend,
        params,
        cache,
        seqs,
        0,
        &inputs,
        StepMode::Decode,
        &mut out,
    )?;
    seqs.commit(backend, Accepted::All(0), StepMode::Decode)
}

fn check_call(params: &GdnParams, cache: &GdnCache) -> Result<()> {
    if params.shape != cache.shape || params.kernel != cache.kernel {
        return Err(Error::invalid(
            "gdn cache",
            format!(
                "built for {:?} kernel {}, the parameters are {:?} kernel {}",
                cache.shape, cache.kernel, params.shape, params.kernel
            ),
        ));
    }
    Ok(())
}

/// `gdn_step_dk{128,256}`: the step kernel for dk up to 128, else up to 256; then
/// `gdn_step_dk128_dv128`, for exactly dk = dv = 128 (the real shape: its state rows sit at
/// constant offsets, see gdn.cu).
const STEP_KERNELS: [&str; 3] = ["gdn_step_dk128", "gdn_step_dk256", "gdn_step_dk128_dv128"];
/// `gdn_chunk_prepare_dk{32,64,128}`, in the order of [`CHUNK_DK`].
const PREPARE_KERNELS: [&str; 3] = [
    "gdn_chunk_prepare_dk32",
    "gdn_chunk_prepare_dk64",
    "gdn_chunk_prepare_dk128",
];
/// `gdn_chunk_state_dk{32,64,128}_dv{16,32}`: `[dk in the order of CHUNK_DK][value columns per
/// block in the order of CHUNK_DV_PER_BLOCK]`.
const STATE_KERNELS: [[&str; 2]; 3] = [
    ["gdn_chunk_state_dk32_dv16", "gdn_chunk_state_dk32_dv32"],
    ["gdn_chunk_state_dk64_dv16", "gdn_chunk_state_dk64_dv32"],
    ["gdn_chunk_state_dk128_dv16", "gdn_chunk_state_dk128_dv32"],
];
/// The value columns per block the chunk-state kernels are instantiated for.
const CHUNK_DV_PER_BLOCK: [usize; 2] = [16, 32];
/// The prefill's gated RMSNorm pass.
const KERNEL_GATED_NORM: &str = "gdn_gated_norm";
/// The sequence bookkeeping after a step.
const KERNEL_COMMIT: &str = "gdn_commit";
/// Threads per block of `gdn_chunk_prepare_*` (CHUNK_THREADS in gdn.cu).
const CHUNK_THREADS: u32 = 128;
/// Threads per block of `gdn_chunk_state_*` on `target` (STATE_THREADS in gdn.cu): state warps
/// and output warps, 4 of each per column slice.
pub fn chunk_state_threads(target: &TargetFacts) -> u32 {
    256 * target.gdn.chunk_state_column_splits
}
/// Threads per block of `gdn_gated_norm`, one warp per (row, head) (NORM_THREADS in gdn.cu).
const NORM_THREADS: u32 = 128;
/// Threads per block of `gdn_commit` (COMMIT_THREADS in gdn.cu).
const COMMIT_THREADS: u32 = 128;

/// `gdn_commit`'s arguments in their parameter order: positions, pending (both written),
/// accepted (null: `uniform` for every sequence), then uniform, count, fold.
fn commit_arguments<'a>(
    seqs: &'a mut Sequences,
    accepted: KernelArg<'a>,
    [uniform, count, fold]: [u32; 3],
) -> [KernelArg<'a>; 6] {
    [
        KernelArg::output(&mut seqs.positions),
        KernelArg::output(&mut seqs.pending),
        accepted,
        KernelArg::u32(uniform),
        KernelArg::u32(count),
        KernelArg::u32(fold),
    ]
}

/// `gdn_step_dk*`'s arguments in their parameter order: the projection rows qkv, a, b, z (z
/// null without the gated norm) each followed by its row stride, the layer's parameters
/// (conv1d.weight, A_log, dt_bias, norm.weight, eps), the cache (state, conv ring, ring k, u,
/// g), the sequences (slots, positions, pending), `out`, the cache's output scratch and
/// counters, then `sizes` (hk, hv, dk, dv, kernel, ring_len, n_slots, m, verify).
fn step_arguments<'a>(
    rows: [KernelArg<'a>; 4],
    strides: [u32; 4],
    params: &'a GdnParams,
    cache: &'a mut GdnCache,
    seqs: &'a Sequences,
    out: KernelArg<'a>,
    sizes: [u32; 9],
) -> [KernelArg<'a>; 33] {
    let [qkv, a, b, z] = rows;
    [
        qkv,
        KernelArg::u32(strides[0]),
        a,
        KernelArg::u32(strides[1]),
        b,
        KernelArg::u32(strides[2]),
        z,
        KernelArg::u32(strides[3]),
        KernelArg::input(&params.conv_weight),
        KernelArg::input(&params.a_log),
        KernelArg::input(&params.dt_bias),
        KernelArg::input(&params.norm_weight),
        KernelArg::f32(params.eps),
        KernelArg::output(&mut cache.state),
        KernelArg::output(&mut cache.conv),
        KernelArg::output(&mut cache.ring_k),
        KernelArg::output(&mut cache.ring_u),
        KernelArg::output(&mut cache.ring_g),
        KernelArg::input(&seqs.slots),
        KernelArg::input(&seqs.positions),
        KernelArg::input(&seqs.pending),
        out,
        KernelArg::output(&mut cache.o_scratch),
        KernelArg::output(&mut cache.counters),
        KernelArg::u32(sizes[0]),
        KernelArg::u32(sizes[1]),
        KernelArg::u32(sizes[2]),
        KernelArg::u32(sizes[3]),
        KernelArg::u32(sizes[4]),
        KernelArg::u32(sizes[5]),
        KernelArg::u32(sizes[6]),
        KernelArg::u32(sizes[7]),
        KernelArg::u32(sizes[8]),
    ]
}

/// The name of the step kernel [`step`] launches for key dimension `dk` and value dimension `dv`.
pub fn step_kernel(dk: usize, dv: usize) -> &'static str {
    if dk == 128 && dv == 128 {
        STEP_KERNELS[2]
    } else {
        STEP_KERNELS[usize::from(dk > 128)]
    }
}

/// The device path of [`step`] (shapes checked by the caller): one launch of `gdn_step_dk*`.
#[allow(clippy::too_many_arguments)]
fn step_device(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    seqs: &Sequences,
    m: usize,
    inputs: &Projections<'_>,
    mode: StepMode,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let shape = params.shape;
    let target = device_target(backend)?;
    let tiles = &target.gdn;
    // a head's dv columns in slices of step_dv_per_block, the last one masked where dv is not a
    // multiple (dv is a multiple of 16, so every thread's 4 columns are all in or all out)
    let slices_per_head = shape.dv.div_ceil(tiles.step_dv_per_block as usize);
    let count = seqs.len();
    let z_stride = inputs.z.map_or(0, |z| z.stride);
    let strides = [
        check_u32("gdn qkv stride", inputs.qkv.stride)?,
        check_u32("gdn a stride", inputs.a.stride)?,
        check_u32("gdn b stride", inputs.b.stride)?,
        check_u32("gdn z stride", z_stride)?,
    ];
    let rows = [
        inputs.qkv.arg()?,
        inputs.a.arg()?,
        inputs.b.arg()?,
        match &inputs.z {
            Some(z) => z.arg()?,
            None => KernelArg::optional_input::<bf16>(None),
        },
    ];
    let sizes = [
        shape.key_heads,
        shape.value_heads,
        shape.dk,
        shape.dv,
        params.kernel,
        cache.ring_len,
        cache.slots,
        m,
        usize::from(mode == StepMode::Verify),
    ]
    .map(|d| d as u32);
    let grid_x = check_u32("gdn step blocks", shape.value_heads * slices_per_head)?;
    let grid_y = check_u32("gdn step sequences", count)?;
    check_grid_y("gdn step", grid_y, "sequences")?;
    let dims = LaunchDims {
        grid: (grid_x, grid_y, 1),
        block: (tiles.step_threads, 1, 1),
        shared_bytes: 0,
        cluster: (1, 1, 1),
    };
    let kernel = step_kernel(shape.dk, shape.dv);
    let args = step_arguments(
        rows,
        strides,
        params,
        cache,
        seqs,
        KernelArg::output(out),
        sizes,
    );
    // SAFETY: gdn_step_dk*'s parameters in order (step_arguments), dk within its tiles. The
    // projection rows and the output were checked against (B m) rows; the cache holds `slots`
    // slots of ring_len positions and a scratch / counters for slots * max_step_tokens rows
    // (B <= slots, m <= max_step_tokens checked); slots past the cache are skipped by the
    // kernel, positions index the ring modulo its length, pending counts are clamped to the
    // shared-memory tiles.
    unsafe { backend.launch(FAMILY, kernel, &dims, &args) }
}

/// The target of a device backend.
///
/// # Errors
/// [`Error::BackendMismatch`] on the CPU backend (its callers run the reference there).
fn device_target(backend: &Backend) -> Result<&'static TargetFacts> {
    backend.target().ok_or_else(|| Error::BackendMismatch {
        what: "gdn device launch".into(),
        expected: "cuda or hip",
        found: backend.name(),
    })
}

/// The prefill's intermediate tensors, sized for up to `max_tokens` tokens in up to
/// `max_sequences` sequences per call (empty on the CPU backend).
pub struct ChunkWorkspace {
    shape: GdnShape,
    max_chunks: usize,
    max_sequences: usize,
    q: DeviceVec<bf16>,
    k: DeviceVec<bf16>,
    w: DeviceVec<bf16>,
    u: DeviceVec<bf16>,
    m: DeviceVec<bf16>,
    gamma: DeviceVec<f32>,
    cu_seqlens: DeviceVec<u32>,
    /// What `cu_seqlens` holds: a call with the same batch copies nothing (so repeated calls
    /// can be captured in a graph after the first).
    uploaded: Vec<u32>,
}

impl ChunkWorkspace {
    /// A workspace for calls of up to `max_tokens` tokens in up to `max_sequences` sequences:
    /// about `28 KiB` per token at the real shape (`(2 Hk dk + Hv (dk + dv + 64)) * 2 + Hv * 4`
    /// bytes per chunk row).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a shape the kernels do not take, [`Error::Cuda`] / [`Error::Hip`] when an
    /// allocation fails.
    pub fn new(
        backend: &Backend,
        shape: GdnShape,
        max_tokens: usize,
        max_sequences: usize,
    ) -> Result<Self> {
        check_shape(shape)?;
        let max_chunks = max_tokens.div_ceil(CHUNK) + max_sequences;
        let rows = if backend.target().is_some() {
            max_chunks * CHUNK
        } else {
            0
        };
        let (hk, hv, dk, dv) = (shape.key_heads, shape.value_heads, shape.dk, shape.dv);
        Ok(Self {
            shape,
            max_chunks,
            max_sequences,
            q: backend.zeros(rows * hk * dk)?,
            k: backend.zeros(rows * hk * dk)?,
            w: backend.zeros(rows * hv * dk)?,
            u: backend.zeros(rows * hv * dv)?,
            m: backend.zeros(rows * hv * CHUNK)?,
            gamma: backend.zeros(rows * hv)?,
            cu_seqlens: backend.zeros(max_sequences + 1)?,
            uploaded: Vec::new(),
        })
    }
}

/// Dynamic shared-memory bytes of `gdn_chunk_prepare_dk{dk}` for value heads of `dv` (the
/// carve-up at the kernel's start).
pub fn chunk_prepare_smem(dk: usize, dv: usize) -> usize {
    let ldx = dk.max(dv) + 8;
    CHUNK * ldx * 2 + CHUNK * (dk + 8) * 2 + CHUNK * (CHUNK + 8) * 4 + (2 * CHUNK + 3 * 256) * 4
}

/// Dynamic shared-memory bytes of `gdn_chunk_state_dk{dk}_dv{dvs}` with `stages` chunks of
/// operands staged ahead.
pub fn chunk_state_smem(dk: usize, dvs: usize, stages: usize) -> usize {
    let ldv = dvs + 8;
    let stage = (3 * CHUNK * (dk + 8) + CHUNK * (CHUNK + 8) + CHUNK * ldv) * 2 + CHUNK * 4;
    dk * ldv * 2 + 2 * CHUNK * ldv * 2 + stages * stage
}

/// Prefill of a batch of sequences: sequence `b` has tokens `cu_seqlens[b]..cu_seqlens[b + 1]`
/// of the projection rows and of `out` (bf16 `[T][Hv dv]`, T = `cu_seqlens[B]`), and continues
/// from its slot at its position (state, conv window and pending tokens; position 0 is a fresh
/// sequence). Stores each sequence's final state and conv window; follow it with
/// [`Sequences::commit`] with the sequences' lengths and [`StepMode::Decode`].
///
/// # Errors
/// [`Error::Invalid`] when `cu_seqlens` is not a non-decreasing list of B + 1 offsets from 0,
/// the call exceeds the workspace, dk is not one the kernels are instantiated for
/// ([`CHUNK_DK`]), a buffer is too short, or the kernels' shared memory exceeds the target's;
/// [`Error::BackendMismatch`] / [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the backends.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    workspace: &mut ChunkWorkspace,
    seqs: &Sequences,
    cu_seqlens: &[u32],
    inputs: &Projections<'_>,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let shape = params.shape;
    check_call(params, cache)?;
    let count = seqs.len();
    if cu_seqlens.len() != count + 1
        || cu_seqlens[0] != 0
        || cu_seqlens.windows(2).any(|w| w[1] < w[0])
    {
        return Err(Error::invalid(
            "gdn cu_seqlens",
            format!(
                "{cu_seqlens:?}: needs {} non-decreasing offsets starting at 0",
                count + 1
            ),
        ));
    }
    let tokens = cu_seqlens[count] as usize;
    let chunks: usize = cu_seqlens
        .windows(2)
        .map(|w| ((w[1] - w[0]) as usize).div_ceil(CHUNK))
        .sum();
    if workspace.shape != shape || chunks > workspace.max_chunks || count > workspace.max_sequences
    {
        return Err(Error::invalid(
            "gdn chunk workspace",
            format!(
                "{count} sequences in {chunks} chunks of {shape:?}; the workspace holds {} sequences, {} chunks of {:?}",
                workspace.max_sequences, workspace.max_chunks, workspace.shape
            ),
        ));
    }
    inputs.check(shape, tokens)?;
    let width = shape.value_heads * shape.dv;
    check_len(
        "gdn output",
        out,
        tokens * width,
        &format!("[{tokens}, {width}]"),
    )?;
    match backend {
        Backend::Cpu => {
            let ranges: Vec<_> = cu_seqlens
                .windows(2)
                .map(|w| w[0] as usize..w[1] as usize)
                .collect();
            cpu_run(
                backend,
                params,
                cache,
                seqs,
                inputs,
                &ranges,
                StepMode::Decode,
                true,
                out,
            )
        }
        Backend::Cuda(_) | Backend::Hip(_) => prefill_device(
            backend, params, cache, workspace, seqs, cu_seqlens, chunks, inputs, out,
        ),
    }
}

/// `gdn_chunk_prepare_dk*`'s arguments in their parameter order: the projection rows qkv, a,
/// b each followed by its row stride, the layer's conv1d.weight, A_log and dt_bias, the cache's
/// conv ring (read), the workspace's cu_seqlens, the sequences' slots and positions, the
/// workspace's q, k, w, u, m and gamma (written), then `sizes` (hk, hv, dv, kernel, ring_len,
/// sequences).
fn prepare_arguments<'a>(
    rows: [KernelArg<'a>; 3],
    strides: [u32; 3],
    params: &'a GdnParams,
    cache: &'a GdnCache,
    workspace: &'a mut ChunkWorkspace,
    seqs: &'a Sequences,
    sizes: [u32; 6],
) -> [KernelArg<'a>; 25] {
    let [qkv, a, b] = rows;
    let ChunkWorkspace {
        q,
        k,
        w,
        u,
        m,
        gamma,
        cu_seqlens,
        ..
    } = workspace;
    [
        qkv,
        KernelArg::u32(strides[0]),
        a,
        KernelArg::u32(strides[1]),
        b,
        KernelArg::u32(strides[2]),
        KernelArg::input(&params.conv_weight),
        KernelArg::input(&params.a_log),
        KernelArg::input(&params.dt_bias),
        KernelArg::input(&cache.conv),
        KernelArg::input(cu_seqlens),
        KernelArg::input(&seqs.slots),
        KernelArg::input(&seqs.positions),
        KernelArg::output(q),
        KernelArg::output(k),
        KernelArg::output(w),
        KernelArg::output(u),
        KernelArg::output(m),
        KernelArg::output(gamma),
        KernelArg::u32(sizes[0]),
        KernelArg::u32(sizes[1]),
        KernelArg::u32(sizes[2]),
        KernelArg::u32(sizes[3]),
        KernelArg::u32(sizes[4]),
        KernelArg::u32(sizes[5]),
    ]
}

/// `gdn_chunk_state_dk*_dv*`'s arguments in their parameter order: the workspace's q, k, w, u,
/// m and gamma, the qkv rows and their stride, the cache's state and conv ring (written) and
/// ring k, u, g, the workspace's cu_seqlens, the sequences' slots, positions and pending,
/// `out`, then `sizes` (hk, hv, dv, kernel, ring_len, n_slots).
fn state_arguments<'a>(
    workspace: &'a ChunkWorkspace,
    [qkv, qkv_stride]: [KernelArg<'a>; 2],
    cache: &'a mut GdnCache,
    seqs: &'a Sequences,
    out: KernelArg<'a>,
    sizes: [u32; 6],
) -> [KernelArg<'a>; 24] {
    [
        KernelArg::input(&workspace.q),
        KernelArg::input(&workspace.k),
        KernelArg::input(&workspace.w),
        KernelArg::input(&workspace.u),
        KernelArg::input(&workspace.m),
        KernelArg::input(&workspace.gamma),
        qkv,
        qkv_stride,
        KernelArg::output(&mut cache.state),
        KernelArg::output(&mut cache.conv),
        KernelArg::input(&cache.ring_k),
        KernelArg::input(&cache.ring_u),
        KernelArg::input(&cache.ring_g),
        KernelArg::input(&workspace.cu_seqlens),
        KernelArg::input(&seqs.slots),
        KernelArg::input(&seqs.positions),
        KernelArg::input(&seqs.pending),
        out,
        KernelArg::u32(sizes[0]),
        KernelArg::u32(sizes[1]),
        KernelArg::u32(sizes[2]),
        KernelArg::u32(sizes[3]),
        KernelArg::u32(sizes[4]),
        KernelArg::u32(sizes[5]),
    ]
}

/// `gdn_gated_norm`'s arguments in their parameter order: `out` (normalised in place), the z
/// rows and their stride, the layer's norm.weight and eps, then `sizes` (rows, hv, dv).
fn gated_norm_arguments<'a>(
    out: KernelArg<'a>,
    [z, z_stride]: [KernelArg<'a>; 2],
    params: &'a GdnParams,
    sizes: [u32; 3],
) -> [KernelArg<'a>; 8] {
    [
        out,
        z,
        z_stride,
        KernelArg::input(&params.norm_weight),
        KernelArg::f32(params.eps),
        KernelArg::u32(sizes[0]),
        KernelArg::u32(sizes[1]),
        KernelArg::u32(sizes[2]),
    ]
}

/// The device path of [`prefill`] (shapes checked by the caller): `gdn_chunk_prepare_dk*` over
/// every chunk, `gdn_chunk_state_dk*_dv*` over every (head, value columns, sequence), then
/// `gdn_gated_norm` over the rows when z is given.
#[allow(clippy::too_many_arguments)]
fn prefill_device(
    backend: &Backend,
    params: &GdnParams,
    cache: &mut GdnCache,
    workspace: &mut ChunkWorkspace,
    seqs: &Sequences,
    cu_seqlens: &[u32],
    chunks: usize,
    inputs: &Projections<'_>,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let shape = params.shape;
    let (dk, dv) = (shape.dk, shape.dv);
    let Some(dk_index) = CHUNK_DK.iter().position(|&d| d == dk) else {
        return Err(Error::invalid(
            "gdn prefill",
            format!("dk = {dk}: the chunked kernels are instantiated for dk in {CHUNK_DK:?}"),
        ));
    };
    let target = device_target(backend)?;
    let preferred = target.gdn.chunk_dv_per_block as usize;
    let dvs = if dv % preferred == 0 { preferred } else { 16 };
    let Some(dvs_index) = CHUNK_DV_PER_BLOCK.iter().position(|&d| d == dvs) else {
        return Err(Error::invalid(
            "gdn prefill",
            format!(
                "{} has gdn.chunk_dv_per_block = {dvs}; the chunk kernels are instantiated for \
                 {CHUNK_DV_PER_BLOCK:?}",
                target.name
            ),
        ));
    };
    let stages = target.gdn.chunk_stages as usize;
    let smem = [
        chunk_prepare_smem(dk, dv),
        chunk_state_smem(dk, dvs, stages),
    ];
    if let Some(too_big) = smem
        .iter()
        .find(|b| **b > target.max_shared_bytes_per_block as usize)
    {
        return Err(Error::invalid(
            "gdn prefill",
            format!(
                "{shape:?} needs {too_big} bytes of shared memory per block; {} has {}",
                target.name, target.max_shared_bytes_per_block
            ),
        ));
    }
    let count = seqs.len();
    let tokens = cu_seqlens[count] as usize;
    if workspace.uploaded != cu_seqlens {
        backend.write(&mut workspace.cu_seqlens, 0, cu_seqlens)?;
        workspace.uploaded = cu_seqlens.to_vec();
    }
    let strides = [
        check_u32("gdn qkv stride", inputs.qkv.stride)?,
        check_u32("gdn a stride", inputs.a.stride)?,
        check_u32("gdn b stride", inputs.b.stride)?,
    ];
    let [hk, hv, dv32, kernel, ring_len, n_slots, count32] = [
        shape.key_heads,
        shape.value_heads,
        dv,
        params.kernel,
        cache.ring_len,
        cache.slots,
        count,
    ]
    .map(|d| d as u32);
    check_grid_y("gdn prefill", count32, "sequences")?;

    if chunks > 0 {
        let dims = LaunchDims {
            grid: (check_u32("gdn chunks", chunks)?, hv, 1),
            block: (CHUNK_THREADS, 1, 1),
            shared_bytes: smem[0] as u32,
            cluster: (1, 1, 1),
        };
        let rows = [inputs.qkv.arg()?, inputs.a.arg()?, inputs.b.arg()?];
        let args = prepare_arguments(
            rows,
            strides,
            params,
            cache,
            workspace,
            seqs,
            [hk, hv, dv32, kernel, ring_len, count32],
        );
        // SAFETY: gdn_chunk_prepare_dk*'s parameters in order (prepare_arguments). cu_seqlens
        // (validated on the host, copied above) partitions the checked projection rows; the
        // workspace holds at least `chunks` chunks; the grid covers exactly `chunks` chunks;
        // shared memory as computed by chunk_prepare_smem, within the target's (checked above).
        unsafe { backend.launch(FAMILY, PREPARE_KERNELS[dk_index], &dims, &args) }?;
    }

    let dims = LaunchDims {
        grid: (
            check_u32("gdn state blocks", shape.value_heads * dv / dvs)?,
            count32,
            1,
        ),
        block: (chunk_state_threads(target), 1, 1),
        shared_bytes: smem[1] as u32,
        cluster: (1, 1, 1),
    };
    let qkv = [inputs.qkv.arg()?, KernelArg::u32(strides[0])];
    let args = state_arguments(
        workspace,
        qkv,
        cache,
        seqs,
        KernelArg::output(out),
        [hk, hv, dv32, kernel, ring_len, n_slots],
    );
    // SAFETY: gdn_chunk_state_dk*_dv*'s parameters in order (state_arguments); the workspace was
    // filled by the prepare pass for the same cu_seqlens; `out` holds T rows; slots past the
    // cache are skipped by the kernel; shared memory as computed by chunk_state_smem, within
    // the target's (checked above).
    unsafe { backend.launch(FAMILY, STATE_KERNELS[dk_index][dvs_index], &dims, &args) }?;

    if let Some(z) = &inputs.z {
        if tokens > 0 {
            let z_rows = [
                z.arg()?,
                KernelArg::u32(check_u32("gdn z stride", z.stride)?),
            ];
            let rows = check_u32("gdn rows", tokens)?;
            let tasks = tokens as u64 * shape.value_heads as u64;
            // one warp per (row, head): the warps per block follow the target's warp size
            let tasks_per_block = u64::from(NORM_THREADS / target.warp_size);
            let grid = u32::try_from(tasks.div_ceil(tasks_per_block)).map_err(|_| {
                Error::invalid(
                    "gdn prefill",
                    format!("{tokens} rows are too many for one norm launch"),
                )
            })?;
            let args =
                gated_norm_arguments(KernelArg::output(out), z_rows, params, [rows, hv, dv32]);
            // SAFETY: gdn_gated_norm's parameters in order (gated_norm_arguments); out and z
            // were checked for T rows.
            unsafe {
                backend.launch(
                    FAMILY,
                    KERNEL_GATED_NORM,
                    &LaunchDims::linear(grid, NORM_THREADS),
                    &args,
                )
            }?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::launch_check;
    use crate::target;

    #[test]
    fn launch_sizes_are_the_templates() {
        crate::kernels::table::assert_defines(
            super::FAMILY,
            |_| true,
            &[
                ("CHUNK_THREADS", super::CHUNK_THREADS.to_string()),
                ("NORM_THREADS", super::NORM_THREADS.to_string()),
                ("COMMIT_THREADS", super::COMMIT_THREADS.to_string()),
            ],
        );
    }

    /// Every launch's argument list (built by [`commit_arguments`], [`step_arguments`],
    /// [`prepare_arguments`], [`state_arguments`] and [`gated_norm_arguments`]) meets every
    /// target's compiled kernels: count, kinds and scalar widths (PTX types on the NVIDIA
    /// targets, the code object's metadata through the HIP launch check on gfx1151), with and
    /// without z.
    #[test]
    fn the_argument_lists_meet_the_compiled_kernels_parameters() {
        let cpu = Backend::Cpu;
        let shape = GdnShape {
            key_heads: 1,
            value_heads: 2,
            dk: 64,
            dv: 32,
        };
        let params = GdnParams::upload(
            &cpu,
            shape,
            4,
            &vec![0.0; shape.conv_dim() * 4],
            &[0.0; 2],
            &[0.0; 2],
            &[0.0; 32],
            1e-6,
        )
        .expect("parameters");
        let mut cache = GdnCache::new(&cpu, shape, 4, 2, 2).expect("cache");
        let mut seqs = Sequences::new(&cpu, &[0], &[0]).expect("sequences");
        let mut workspace = ChunkWorkspace::new(&cpu, shape, 64, 1).expect("workspace");
        let rows = DeviceVec::Host(vec![bf16::ZERO; 8]);
        let mut out = DeviceVec::Host(vec![bf16::ZERO; 8]);
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            let name = t.name.as_str();
            let per_sequence = DeviceVec::Host(vec![0u32; 1]);
            for accepted in [
                KernelArg::optional_input::<u32>(None),
                KernelArg::input(&per_sequence),
            ] {
                checks.check(
                    name,
                    KERNEL_COMMIT,
                    &commit_arguments(&mut seqs, accepted, [1, 1, 0]),
                );
            }
            for kernel in STEP_KERNELS {
                for z in [None, Some(&rows)] {
                    let io = [
                        KernelArg::input(&rows),
                        KernelArg::input(&rows),
                        KernelArg::input(&rows),
                        KernelArg::optional_input(z),
                    ];
                    let args = step_arguments(
                        io,
                        [8, 2, 2, 64],
                        &params,
                        &mut cache,
                        &seqs,
                        KernelArg::output(&mut out),
                        [1, 2, 64, 32, 4, 4, 2, 1, 0],
                    );
                    checks.check(name, kernel, &args);
                }
            }
            for kernel in PREPARE_KERNELS {
                let io = [
                    KernelArg::input(&rows),
                    KernelArg::input(&rows),
                    KernelArg::input(&rows),
                ];
                let args = prepare_arguments(
                    io,
                    [8, 2, 2],
                    &params,
                    &cache,
                    &mut workspace,
                    &seqs,
                    [1, 2, 32, 4, 4, 1],
                );
                checks.check(name, kernel, &args);
            }
            for kernel in STATE_KERNELS.iter().flatten() {
                let args = state_arguments(
                    &workspace,
                    [KernelArg::input(&rows), KernelArg::u32(8)],
                    &mut cache,
                    &seqs,
                    KernelArg::output(&mut out),
                    [1, 2, 32, 4, 4, 2],
                );
                checks.check(name, kernel, &args);
            }
            let args = gated_norm_arguments(
                KernelArg::output(&mut out),
                [KernelArg::input(&rows), KernelArg::u32(64)],
                &params,
                [1, 2, 32],
            );
            checks.check(name, KERNEL_GATED_NORM, &args);
        }
        checks.assert_all_match();
    }

    /// The step kernel follows dk, with its own kernel for exactly dk = dv = 128; dk outside the
    /// chunk kernels' instantiations is refused.
    #[test]
    fn kernels_are_chosen_by_dk() {
        assert_eq!(step_kernel(64, 128), "gdn_step_dk128");
        assert_eq!(step_kernel(128, 64), "gdn_step_dk128");
        assert_eq!(step_kernel(128, 128), "gdn_step_dk128_dv128");
        assert_eq!(step_kernel(144, 128), "gdn_step_dk256");
        assert_eq!(PREPARE_KERNELS.len(), CHUNK_DK.len());
        assert_eq!(STATE_KERNELS[0].len(), CHUNK_DV_PER_BLOCK.len());
    }
}
