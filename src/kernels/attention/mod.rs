//! Family `attention`: the gated full attention of Qwen3.5-MoE over a per-sequence KV cache
//! (`kernels/templates/attention.cu`), for any mix of decode, verify and prefill rows.
//!
//! Per layer and step, after the q/k/v projections (one GEMM writing each row's
//! `[q_gate | k | v]` where the model's three weights stack, else three; both read through
//! [`Projections`]):
//! 1. [`prepare`]: per head, the zero-centred q/k RMSNorm, partial NeoX RoPE from a [`RopeTable`]
//!    (cos/sin computed on the host from the f32 angle, as transformers does), k and v appended
//!    to the cache at each row's position, q to an f32 buffer;
//! 2. [`attend`]: each row attends over positions `0 ..= position` of its slot (causal and
//!    variable-length by construction), split over the sequence in chunks of
//!    `attention.split_positions` (targets.toml) so long contexts fill the device, one block per
//!    (split, KV head, row) so K/V rows are fetched once per GQA group; then the splits are
//!    merged and multiplied by `sigmoid(gate)`, bf16 out for o_proj. The split kernel
//!    ([`DecodeKernel`]) stages the split's K and V in shared memory with cp.async and runs both
//!    products on mma.sync where the target has them (sm_90a, sm_121a); elsewhere (gfx1151) one
//!    warp per query head reads the rows directly (the reference GPU version, also run by the
//!    attention bench and GPU tests on NVIDIA for comparison).
//!
//! The cache ([`KvCache`]) holds bf16, or float8_e4m3fn codes of `value * (1 / scale)` with one key
//! and one value scale per layer ([`KvFormat`]): half the bytes, which is most of a long-context
//! step's reads at larger batches. Every split kernel has an `_fp8` twin that reads the codes and
//! decodes them exactly (an e4m3 value is a bf16); the scales multiply q and the split's output.
//!
//! Bytes a decode row must read at least: its K and V over the context,
//! `2 * positions * kv_heads * head_dim * element bytes` ([`kv_bytes`]).

pub mod reference;

use super::{Bf16Rows, check_grid_y, check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::formats::nvfp4::{e4m3_decode, e4m3_encode};
use crate::target::TargetFacts;
use half::bf16;
use reference::AttentionShape;

/// The family name (template and module).
pub const FAMILY: &str = "attention";
/// q/k norm + RoPE, KV append.
pub const KERNEL_PREPARE: &str = "attention_prepare";
/// Split-K attention over the cache, one warp per query head (every target; the reference GPU
/// version of the mma kernels, [`decode_mma_kernel`]).
pub const KERNEL_DECODE: &str = "attention_decode";
/// [`KERNEL_DECODE`] over an e4m3 cache ([`KvFormat::Fp8E4m3`]).
pub const KERNEL_DECODE_FP8: &str = "attention_decode_fp8";
/// The same splits and partials as [`KERNEL_DECODE`], the split's K and V rows staged in shared
/// memory by cp.async and both products on mma.sync (targets with both; [`attend`] picks it
/// there): the kernel for GQA groups of 1 to 8 query heads (one n8 tile of heads).
pub const KERNEL_DECODE_MMA_G8: &str = "attention_decode_mma_g8";
/// [`KERNEL_DECODE_MMA_G8`] for groups of 9 to 16 query heads (two n8 tiles).
pub const KERNEL_DECODE_MMA_G16: &str = "attention_decode_mma_g16";
/// [`KERNEL_DECODE_MMA_G8`] over an e4m3 cache.
pub const KERNEL_DECODE_MMA_G8_FP8: &str = "attention_decode_mma_g8_fp8";
/// [`KERNEL_DECODE_MMA_G16`] over an e4m3 cache.
pub const KERNEL_DECODE_MMA_G16_FP8: &str = "attention_decode_mma_g16_fp8";
/// Warps per block of the mma decode kernels (`ATTN_MMA_WARPS` in the template).
const DECODE_MMA_WARPS: u32 = 8;
/// Merge of the splits and the output gate.
pub const KERNEL_COMBINE_GATE: &str = "attention_combine_gate";
/// Largest head dimension the kernels hold in registers.
pub const MAX_HEAD_DIM: usize = 256;
/// Largest GQA group (query heads per KV head): one warp each in a block.
pub const MAX_GROUP: usize = 16;

/// Bytes of K and V one row reads over `positions` positions of a cache in `format`.
pub fn kv_bytes(shape: AttentionShape, positions: usize, format: KvFormat) -> u64 {
    (2 * positions * shape.kv_heads * shape.head_dim * format.element_bytes()) as u64
}

/// How a [`KvCache`] stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvFormat {
    /// bf16 values, 2 bytes each.
    Bf16,
    /// float8_e4m3fn codes of `value * (1 / scale)` (the scale's f32 inverse, computed once), 1
    /// byte each: round to nearest even, saturating at +-448, NaN kept (as [`e4m3_encode`]). One
    /// scale for a layer's keys, one for its values (vLLM's fp8 KV cache; without calibrated
    /// scales, 1.0 as vLLM's default).
    Fp8E4m3 {
        /// Keys are stored as `key * (1 / key_scale)`.
        key_scale: f32,
        /// Values are stored as `value * (1 / value_scale)`.
        value_scale: f32,
    },
}

impl KvFormat {
    /// [`KvFormat::Fp8E4m3`] with unit scales.
    pub const FP8_UNIT_SCALES: Self = Self::Fp8E4m3 {
        key_scale: 1.0,
        value_scale: 1.0,
    };

    /// Bytes per cached element.
    pub fn element_bytes(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::Fp8E4m3 { .. } => 1,
        }
    }

    /// (key scale, value scale): what a stored key and value are multiplied by when read (1 for
    /// bf16).
    pub fn scales(self) -> (f32, f32) {
        match self {
            Self::Bf16 => (1.0, 1.0),
            Self::Fp8E4m3 {
                key_scale,
                value_scale,
            } => (key_scale, value_scale),
        }
    }

    /// The format named `name`: `bf16`, or `fp8` (e4m3 with unit scales).
    ///
    /// # Errors
    /// [`Error::Invalid`] for any other name.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "bf16" => Ok(Self::Bf16),
            "fp8" | "fp8_e4m3" => Ok(Self::FP8_UNIT_SCALES),
            other => Err(Error::invalid(
                "KV cache format",
                format!("{other:?}: bf16 or fp8 (float8_e4m3fn, unit scales)"),
            )),
        }
    }

    /// A short name for tables (`bf16`, `fp8`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8E4m3 { .. } => "fp8",
        }
    }
}

/// One side (keys or values) of a [`KvCache`]: `[slot][position][kv_head][head_dim]` elements.
pub enum KvStore {
    /// bf16 values ([`KvFormat::Bf16`]).
    Bf16(DeviceVec<bf16>),
    /// e4m3 codes ([`KvFormat::Fp8E4m3`]).
    Fp8(DeviceVec<u8>),
}

impl KvStore {
    fn zeros(backend: &Backend, format: KvFormat, len: usize) -> Result<Self> {
        Ok(match format {
            KvFormat::Bf16 => Self::Bf16(backend.zeros(len)?),
            KvFormat::Fp8E4m3 { .. } => Self::Fp8(backend.zeros(len)?),
        })
    }

    fn input(&self) -> KernelArg<'_> {
        match self {
            Self::Bf16(v) => KernelArg::input(v),
            Self::Fp8(v) => KernelArg::input(v),
        }
    }

    fn output(&mut self) -> KernelArg<'_> {
        match self {
            Self::Bf16(v) => KernelArg::output(v),
            Self::Fp8(v) => KernelArg::output(v),
        }
    }

    /// The values on the host (CPU backend), decoded and multiplied by `scale` (e4m3).
    fn host_values(&self, backend: &Backend, what: &str, scale: f32) -> Result<Vec<f32>> {
        Ok(match self {
            Self::Bf16(v) => host(backend, what, v)?.iter().map(|x| x.to_f32()).collect(),
            Self::Fp8(v) => host(backend, what, v)?
                .iter()
                .map(|&c| e4m3_decode(c) * scale)
                .collect(),
        })
    }

    /// Stores `values` at elements `at..` on the host (CPU backend): bf16, or the e4m3 codes of
    /// `value * (1 / scale)`.
    fn host_store(
        &mut self,
        backend: &Backend,
        what: &str,
        at: usize,
        values: &[f32],
        scale: f32,
    ) -> Result<()> {
        match self {
            Self::Bf16(v) => {
                let v = host_mut(backend, what, v)?;
                for (dst, src) in v[at..at + values.len()].iter_mut().zip(values) {
                    *dst = bf16::from_f32(*src);
                }
            }
            Self::Fp8(v) => {
                let v = host_mut(backend, what, v)?;
                let inverse = 1.0 / scale;
                for (dst, src) in v[at..at + values.len()].iter_mut().zip(values) {
                    *dst = e4m3_encode(*src * inverse);
                }
            }
        }
        Ok(())
    }
}

/// cos and sin of every (position, rotary pair): `[positions][rotary_dim / 2][2]` f32.
pub struct RopeTable {
    /// Rotated dimensions per head (even).
    pub rotary_dim: usize,
    /// Positions covered.
    pub positions: usize,
    /// The table on the backend.
    pub cos_sin: DeviceVec<f32>,
}

impl RopeTable {
    /// The table for `positions` positions with base `theta`: the angle `position * inv_freq`
    /// rounded to f32 (as transformers computes it), its cos and sin in f64, stored f32.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an odd or zero rotary dimension or one above [`MAX_HEAD_DIM`];
    /// [`Error::Cuda`] / [`Error::Hip`] when the upload fails.
    pub fn new(backend: &Backend, rotary_dim: usize, theta: f64, positions: usize) -> Result<Self> {
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > MAX_HEAD_DIM {
            return Err(Error::invalid(
                "rotary dimension",
                format!("{rotary_dim}: RoPE needs an even count in 2..={MAX_HEAD_DIM}"),
            ));
        }
        let inv_freq = reference::rope_inv_freq(rotary_dim, theta);
        let mut table = Vec::with_capacity(positions * rotary_dim);
        for p in 0..positions {
            for &f in &inv_freq {
                let (sin, cos) = f64::from(p as f32 * f).sin_cos();
                table.push(cos as f32);
                table.push(sin as f32);
            }
        }
        Ok(Self {
            rotary_dim,
            positions,
            cos_sin: backend.upload(&table)?,
        })
    }
}

/// The KV cache of one attention layer for `slots` sequences of up to `capacity` positions:
/// `[slot][position][kv_head][head_dim]` elements in `format`, keys and values apart.
pub struct KvCache {
    /// The layer shape it was sized for: its rows hold `kv_heads * head_dim` elements.
    pub shape: AttentionShape,
    /// Sequences it holds.
    pub slots: usize,
    /// Positions per sequence.
    pub capacity: usize,
    /// How keys and values are stored.
    pub format: KvFormat,
    /// Keys.
    pub keys: KvStore,
    /// Values.
    pub values: KvStore,
}

impl KvCache {
    /// A zeroed cache.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an e4m3 scale that is not finite and positive; [`Error::Cuda`] /
    /// [`Error::Hip`] when the allocation fails.
    pub fn new(
        backend: &Backend,
        shape: AttentionShape,
        slots: usize,
        capacity: usize,
        format: KvFormat,
    ) -> Result<Self> {
        let (key_scale, value_scale) = format.scales();
        for (what, scale) in [("key", key_scale), ("value", value_scale)] {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(Error::invalid(
                    format!("KV cache {what} scale"),
                    format!("{scale}: a finite scale above 0"),
                ));
            }
        }
        let len = slots * capacity * shape.kv_heads * shape.head_dim;
        Ok(Self {
            shape,
            slots,
            capacity,
            format,
            keys: KvStore::zeros(backend, format, len)?,
            values: KvStore::zeros(backend, format, len)?,
        })
    }
}

/// Which cache slot and position each row of a step has (on the backend, so a captured graph
/// replays with new positions copied in).
pub struct Rows {
    /// Rows.
    pub count: usize,
    /// `[count]` cache slot of each row.
    pub slot: DeviceVec<u32>,
    /// `[count]` position of each row.
    pub position: DeviceVec<u32>,
}

/// One step's projections of an attention layer as its GEMMs wrote them, per row: `q_gate`
/// each head's query then its output gate (`heads * 2 * head_dim`), `k` and `v` each KV head's
/// key and value (`kv_heads * head_dim`). Three matrices of their own
/// ([`Projections::separate`]) or the column ranges of one `[q_gate | k | v]` GEMM output
/// ([`Projections::fused`]).
#[derive(Clone, Copy)]
pub struct Projections<'a> {
    /// `[rows][heads][2 * head_dim]`.
    pub q_gate: Bf16Rows<'a>,
    /// `[rows][kv_heads][head_dim]`.
    pub k: Bf16Rows<'a>,
    /// `[rows][kv_heads][head_dim]`.
    pub v: Bf16Rows<'a>,
}

impl<'a> Projections<'a> {
    /// Three packed matrices.
    pub fn separate(
        shape: AttentionShape,
        q_gate: &'a DeviceVec<bf16>,
        k: &'a DeviceVec<bf16>,
        v: &'a DeviceVec<bf16>,
    ) -> Self {
        Self {
            q_gate: Bf16Rows::packed(q_gate, shape.q_gate_width()),
            k: Bf16Rows::packed(k, shape.kv_width()),
            v: Bf16Rows::packed(v, shape.kv_width()),
        }
    }

    /// The rows of one `[q_gate | k | v]` output, [`AttentionShape::projection_width`]
    /// elements each.
    pub fn fused(shape: AttentionShape, qkv: &'a DeviceVec<bf16>) -> Self {
        let at = |offset| Bf16Rows {
            data: qkv,
            offset,
            stride: shape.projection_width(),
        };
        Self {
            q_gate: at(0),
            k: at(shape.q_gate_width()),
            v: at(shape.q_gate_width() + shape.kv_width()),
        }
    }

    /// Checks that `rows` rows of each lie inside their buffers.
    fn check(&self, shape: AttentionShape, rows: usize) -> Result<()> {
        self.q_gate
            .check("attention q_gate", rows, shape.q_gate_width(), false)?;
        self.k.check("attention k", rows, shape.kv_width(), false)?;
        self.v.check("attention v", rows, shape.kv_width(), false)
    }
}

/// Per-head weights and constants of one gated attention layer.
pub struct GatedAttention<'a> {
    /// Heads and sizes.
    pub shape: AttentionShape,
    /// `[head_dim]` zero-centred q norm weight (f32).
    pub q_norm: &'a DeviceVec<f32>,
    /// `[head_dim]` zero-centred k norm weight (f32).
    pub k_norm: &'a DeviceVec<f32>,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// The RoPE table.
    pub rope: &'a RopeTable,
}

/// Scratch of [`attend`]: the split partials, sized for up to `rows` rows of `capacity`
/// positions. Allocate once per model; launches never allocate (capturable in a CUDA graph).
pub struct Workspace {
    shape: AttentionShape,
    rows: usize,
    splits: usize,
    partial_ml: DeviceVec<f32>,
    partial_acc: DeviceVec<f32>,
}

/// The chunks of `attention.split_positions` a cache of `capacity` positions holds on `target`:
/// the most splits a call can have (one chunk each).
fn cache_chunks(target: &TargetFacts, capacity: usize) -> usize {
    capacity
        .div_ceil(target.attention.split_positions as usize)
        .max(1)
}

/// [`cache_chunks`] on `backend`'s target (1 on the CPU, which has no splits).
fn splits_for(backend: &Backend, capacity: usize) -> usize {
    backend.target().map_or(1, |t| cache_chunks(t, capacity))
}

/// The splits of one [`attend`] call on `target` with `multiprocessors` of them (the device's
/// count): one per chunk of `attention.split_positions` while the rows' KV heads times the
/// cache's chunks stay within `attention.decode_blocks_per_sm` blocks per multiprocessor; past
/// that, that many blocks'
/// worth, each split taking every `splits`-th chunk of its row (the kernels' online softmax runs
/// over them), so a long context at a large batch writes and merges fewer partials.
fn call_splits(
    target: &TargetFacts,
    multiprocessors: u32,
    rows: usize,
    kv_heads: usize,
    capacity: usize,
) -> usize {
    let wanted = (target.attention.decode_blocks_per_sm * multiprocessors) as usize;
    cache_chunks(target, capacity).min(wanted.div_ceil((rows * kv_heads).max(1)).max(1))
}

/// The warp-per-head decode kernel for a cache in `format` ([`KERNEL_DECODE`] or
/// [`KERNEL_DECODE_FP8`]).
pub fn decode_warp_kernel(format: KvFormat) -> &'static str {
    match format {
        KvFormat::Bf16 => KERNEL_DECODE,
        KvFormat::Fp8E4m3 { .. } => KERNEL_DECODE_FP8,
    }
}

/// The mma decode kernel for `shape`'s GQA group and a cache in `format`
/// ([`KERNEL_DECODE_MMA_G8`] up to 8 query heads per KV head, else [`KERNEL_DECODE_MMA_G16`],
/// or their `_fp8` twins; groups above [`MAX_GROUP`] are refused before).
///
/// # Panics
/// When `shape.kv_heads` is 0 ([`attend`] refuses such a shape first).
pub fn decode_mma_kernel(shape: AttentionShape, format: KvFormat) -> &'static str {
    let fp8 = matches!(format, KvFormat::Fp8E4m3 { .. });
    match (shape.heads / shape.kv_heads <= 8, fp8) {
        (true, false) => KERNEL_DECODE_MMA_G8,
        (false, false) => KERNEL_DECODE_MMA_G16,
        (true, true) => KERNEL_DECODE_MMA_G8_FP8,
        (false, true) => KERNEL_DECODE_MMA_G16_FP8,
    }
}

/// Dynamic shared memory of one mma decode block ([`decode_mma_kernel`]), bytes: the split's K
/// and V rows (`head_dim + 8` bf16 each, the padding that keeps ldmatrix free of bank
/// conflicts), the scores of its k parts (f32) and p as bf16 hi and lo halves, for the kernel's
/// tiles of 8 heads. The layout the template's comment above the kernels gives, in the same
/// order. `split_positions` is the target's `attention.split_positions` (32, 64 or 128).
///
/// # Panics
/// When `shape.kv_heads` is 0 ([`attend`] refuses such a shape first).
pub fn decode_mma_shared_bytes(shape: AttentionShape, split_positions: usize) -> usize {
    let n_tiles = (shape.heads / shape.kv_heads).div_ceil(8);
    let pos_tiles = split_positions / 16;
    let k_parts = DECODE_MMA_WARPS as usize / pos_tiles.max(1);
    let rows = 2 * split_positions * (shape.head_dim + 8) * 2;
    let scores = k_parts * 8 * n_tiles * split_positions * 4;
    let p = 2 * 8 * n_tiles * (split_positions + 8) * 2;
    rows + scores + p
}

/// Dimensions of a head one `attention_combine_gate` block merges: a multiple of 32, the whole
/// head once `rows * heads` blocks give every SM `attention.combine_blocks_per_sm`, else fewer
/// so the (row, head)s' split partials are read by about that many blocks (at B = 1 and 20000
/// positions each head has 313 splits); `multiprocessors`: the device's.
fn combine_dims_per_block(
    shape: AttentionShape,
    rows: usize,
    target: &TargetFacts,
    multiprocessors: u32,
) -> u32 {
    let items = (rows * shape.heads).max(1);
    let wanted_blocks = (target.attention.combine_blocks_per_sm * multiprocessors) as usize;
    let lanes = shape.head_dim / 32;
    let parts = wanted_blocks.div_ceil(items).clamp(1, lanes);
    (32 * lanes.div_ceil(parts)) as u32
}

impl Workspace {
    /// Scratch for `rows` rows over a cache of `capacity` positions.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the allocation fails.
    pub fn new(
        backend: &Backend,
        shape: AttentionShape,
        rows: usize,
        capacity: usize,
    ) -> Result<Self> {
        let splits = splits_for(backend, capacity);
        let parts = rows * shape.heads * splits;
        Ok(Self {
            shape,
            rows,
            splits,
            partial_ml: backend.zeros(2 * parts)?,
            partial_acc: backend.zeros(parts * shape.head_dim)?,
        })
    }
}

/// Whether `cache` (and `workspace`, where given) were sized for `shape`: a larger shape than
/// theirs would have the kernels read and write past their buffers.
fn check_sized_for(
    shape: AttentionShape,
    cache: &KvCache,
    workspace: Option<&Workspace>,
) -> Result<()> {
    if cache.shape != shape {
        return Err(Error::invalid(
            "attention KV cache",
            format!("made for {:?}; this call is {shape:?}", cache.shape),
        ));
    }
    if let Some(w) = workspace.filter(|w| w.shape != shape) {
        return Err(Error::invalid(
            "attention workspace",
            format!("made for {:?}; this call is {shape:?}", w.shape),
        ));
    }
    Ok(())
}

fn check_shape(shape: AttentionShape) -> Result<()> {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    if kv_heads == 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP {
        return Err(Error::invalid(
            "attention heads",
            format!(
                "{heads} query heads over {kv_heads} KV heads: groups of 1..={MAX_GROUP} needed"
            ),
        ));
    }
    if head_dim == 0 || head_dim > MAX_HEAD_DIM || head_dim % 32 != 0 {
        return Err(Error::invalid(
            "attention head_dim",
            format!("{head_dim}: a multiple of 32 (one warp's lanes) up to {MAX_HEAD_DIM}"),
        ));
    }
    Ok(())
}

fn host<'a, T>(backend: &Backend, what: &str, v: &'a DeviceVec<T>) -> Result<&'a [T]> {
    match v {
        DeviceVec::Host(v) => Ok(v),
        other => Err(backend.mismatch(what, other)),
    }
}

fn host_mut<'a, T>(
    backend: &Backend,
    what: &str,
    v: &'a mut DeviceVec<T>,
) -> Result<&'a mut Vec<T>> {
    match v {
        DeviceVec::Host(v) => Ok(v),
        other => Err(backend.mismatch(what, other)),
    }
}

/// Step 1: normalises and rotates each row's query (`projections.q_gate`, per head the query
/// then its gate) into `q` (`[rows][heads][head_dim]` f32) and its key (`projections.k`), and
/// appends the key and value (`projections.v`) to `cache` at each row's slot and position.
/// Positions must be below the cache's and the RoPE table's capacity (the CPU path checks; on
/// the GPU they are device data the caller keeps in range).
///
/// # Errors
/// [`Error::Invalid`] for projection rows that do not fit their buffers or buffer lengths that
/// disagree with the shapes, a group or head size the kernels do not take, a cache made for
/// another shape, or (CPU) a slot or position out of range; [`Error::BackendMismatch`],
/// [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`].
pub fn prepare(
    backend: &Backend,
    layer: &GatedAttention<'_>,
    projections: &Projections<'_>,
    rows: &Rows,
    cache: &mut KvCache,
    q: &mut DeviceVec<f32>,
) -> Result<()> {
    let s = layer.shape;
    check_shape(s)?;
    check_sized_for(s, cache, None)?;
    let (n, hd) = (rows.count, s.head_dim);
    let half = layer.rope.rotary_dim / 2;
    if layer.rope.rotary_dim > hd {
        return Err(Error::invalid(
            "rotary dimension",
            format!("{} exceeds head_dim {hd}", layer.rope.rotary_dim),
        ));
    }
    projections.check(s, n)?;
    check_len(
        "attention q out",
        q,
        n * s.heads * hd,
        "[rows, heads, head_dim]",
    )?;
    check_len("q_norm", layer.q_norm, hd, "[head_dim]")?;
    check_len("k_norm", layer.k_norm, hd, "[head_dim]")?;
    check_len("row slots", &rows.slot, n, "[rows]")?;
    check_len("row positions", &rows.position, n, "[rows]")?;
    if n == 0 {
        return Ok(());
    }
    let (key_scale, value_scale) = cache.format.scales();
    match backend {
        Backend::Cpu => {
            let (qg, kk, vv) = (
                projections
                    .q_gate
                    .host_rows("attention q_gate", 0..n, s.q_gate_width())?,
                projections.k.host_rows("attention k", 0..n, s.kv_width())?,
                projections.v.host_rows("attention v", 0..n, s.kv_width())?,
            );
            let (qn, kn) = (
                host(backend, "q_norm", layer.q_norm)?,
                host(backend, "k_norm", layer.k_norm)?,
            );
            let (slots, positions) = (
                host(backend, "slots", &rows.slot)?,
                host(backend, "positions", &rows.position)?,
            );
            let table = host(backend, "RoPE table", &layer.rope.cos_sin)?;
            let (capacity, cache_slots) = (cache.capacity, cache.slots);
            let out = host_mut(backend, "q out", q)?;
            let kv_row = s.kv_heads * hd;
            let rotate = |x: &mut [f32], p: usize| {
                let cs = &table[p * half * 2..(p + 1) * half * 2];
                for head in x.chunks_exact_mut(hd) {
                    for j in 0..half {
                        let (c, sn) = (f64::from(cs[2 * j]), f64::from(cs[2 * j + 1]));
                        let (a, b) = (f64::from(head[j]), f64::from(head[j + half]));
                        head[j] = (a * c - b * sn) as f32;
                        head[j + half] = (b * c + a * sn) as f32;
                    }
                }
            };
            for r in 0..n {
                let (slot, pos) = (slots[r] as usize, positions[r] as usize);
                if slot >= cache_slots || pos >= capacity || pos >= layer.rope.positions {
                    return Err(Error::invalid(
                        format!("attention row {r}"),
                        format!(
                            "slot {slot} position {pos}: cache holds {cache_slots} slots of {capacity}, RoPE {} positions",
                            layer.rope.positions
                        ),
                    ));
                }
                let query: Vec<f32> = qg[r * s.heads * 2 * hd..(r + 1) * s.heads * 2 * hd]
                    .chunks_exact(2 * hd)
                    .flat_map(|head| head[..hd].iter().copied())
                    .collect();
                let mut query = super::norm::reference::rms_norm(&query, qn, f64::from(layer.eps));
                rotate(&mut query, pos);
                out[r * s.heads * hd..(r + 1) * s.heads * hd].copy_from_slice(&query);
                let mut key = super::norm::reference::rms_norm(
                    &kk[r * kv_row..(r + 1) * kv_row],
                    kn,
                    f64::from(layer.eps),
                );
                rotate(&mut key, pos);
                let at = (slot * capacity + pos) * kv_row;
                cache
                    .keys
                    .host_store(backend, "KV cache keys", at, &key, key_scale)?;
                cache.values.host_store(
                    backend,
                    "KV cache values",
                    at,
                    &vv[r * kv_row..(r + 1) * kv_row],
                    value_scale,
                )?;
            }
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("attention q_gate", projections.q_gate.data))?;
            let tiles = &target.attention;
            let items = check_u32("attention rows x heads", n * (s.heads + s.kv_heads))?;
            let dims = LaunchDims::linear(
                items.div_ceil(tiles.prepare_warps_per_block),
                tiles.prepare_warps_per_block * target.warp_size,
            );
            let args = prepare_arguments(layer, projections, rows, cache, q)?;
            // SAFETY: the arguments are attention_prepare's parameters in order; the rows of
            // q_gate, k and v (at their strides), q and the norms were checked against (rows,
            // heads, kv_heads, head_dim); slots and positions index the cache and the RoPE
            // table, which the caller keeps in range (documented).
            unsafe { backend.launch(FAMILY, KERNEL_PREPARE, &dims, &args) }
        }
    }
}

/// The split kernel of [`attend`] on a device (both write the same partials, merged by
/// `attention_combine_gate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// [`KERNEL_DECODE`]: one warp per query head, every target.
    Warp,
    /// [`decode_mma_kernel`]: shared-memory staging and mma.sync (targets with mma.sync and
    /// cp.async).
    Mma,
}

impl DecodeKernel {
    /// The kernel [`attend`] uses on `target`: [`DecodeKernel::Mma`] where it exists.
    pub fn preferred(target: &TargetFacts) -> Self {
        if Self::Mma.runs_on(target) {
            Self::Mma
        } else {
            Self::Warp
        }
    }

    /// Whether `target` renders this kernel.
    pub fn runs_on(self, target: &TargetFacts) -> bool {
        match self {
            Self::Warp => true,
            Self::Mma => target.instructions.staged_mma(),
        }
    }

    /// The kernel's name (for the mma kernels, the prefix of their names).
    pub fn name(self) -> &'static str {
        match self {
            Self::Warp => KERNEL_DECODE,
            Self::Mma => "attention_decode_mma",
        }
    }
}

/// Step 2: every row's attention over positions `0 ..= position` of its slot, merged over the
/// splits and multiplied by `sigmoid(gate)` (the second half of each head in `q_gate`'s rows,
/// [`Projections::q_gate`]), into
/// `out` (`[rows][heads * head_dim]` bf16). On a device the split kernel is
/// [`DecodeKernel::preferred`] for its target.
///
/// # Errors
/// [`Error::Invalid`] for buffer lengths that disagree with the shapes, a cache or workspace
/// made for another shape, a workspace made for fewer rows or a smaller cache, or (CPU) a slot
/// or position out of the cache's range; [`Error::BackendMismatch`], [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    backend: &Backend,
    shape: AttentionShape,
    q: &DeviceVec<f32>,
    q_gate: Bf16Rows<'_>,
    cache: &KvCache,
    rows: &Rows,
    workspace: &mut Workspace,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    let decode = backend
        .target()
        .map_or(DecodeKernel::Warp, DecodeKernel::preferred);
    attend_with(
        backend, decode, shape, q, q_gate, cache, rows, workspace, out,
    )
}

/// [`attend`] with the split kernel `decode` (ignored on the CPU), so benches and tests can run
/// both on one device.
///
/// # Errors
/// As [`attend`]; [`Error::Invalid`] when the target does not render `decode`, or when its
/// shared memory cannot hold one split of the mma kernel (lower
/// `attention.split_positions`).
#[allow(clippy::too_many_arguments)]
pub fn attend_with(
    backend: &Backend,
    decode: DecodeKernel,
    shape: AttentionShape,
    q: &DeviceVec<f32>,
    q_gate: Bf16Rows<'_>,
    cache: &KvCache,
    rows: &Rows,
    workspace: &mut Workspace,
    out: &mut DeviceVec<bf16>,
) -> Result<()> {
    check_shape(shape)?;
    check_sized_for(shape, cache, Some(workspace))?;
    let (n, hd) = (rows.count, shape.head_dim);
    check_len(
        "attention q",
        q,
        n * shape.heads * hd,
        "[rows, heads, head_dim]",
    )?;
    q_gate.check("attention q_gate", n, shape.q_gate_width(), false)?;
    check_len(
        "attention out",
        out,
        n * shape.heads * hd,
        "[rows, heads * head_dim]",
    )?;
    // the device's multiprocessors, not the table's: a part with fewer SMs than its target's
    // table names (an H100 PCIe against sm_90a's 132) fills its own (the CPU has no splits)
    let device = backend.target().zip(backend.multiprocessors());
    let splits = device.map_or(1, |(t, multiprocessors)| {
        call_splits(t, multiprocessors, n, shape.kv_heads, cache.capacity)
    });
    if workspace.rows < n || workspace.splits < splits {
        return Err(Error::invalid(
            "attention workspace",
            format!(
                "made for {} rows and {} splits; this call needs {n} rows and {splits} splits",
                workspace.rows, workspace.splits
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (key_scale, value_scale) = cache.format.scales();
    match backend {
        Backend::Cpu => {
            let qv = host(backend, "q", q)?;
            let qg = q_gate.host_rows("attention q_gate", 0..n, shape.q_gate_width())?;
            let (slots, positions) = (
                host(backend, "slots", &rows.slot)?,
                host(backend, "positions", &rows.position)?,
            );
            let (keys, values) = (
                cache.keys.host_values(backend, "keys", key_scale)?,
                cache.values.host_values(backend, "values", value_scale)?,
            );
            let o = host_mut(backend, "attention out", out)?;
            let kv_row = shape.kv_heads * hd;
            for r in 0..n {
                let (slot, len) = (slots[r] as usize, positions[r] as usize + 1);
                if slot >= cache.slots || len > cache.capacity {
                    return Err(Error::invalid(
                        format!("attention row {r}"),
                        format!(
                            "slot {slot} position {}: cache holds {} slots of {}",
                            len - 1,
                            cache.slots,
                            cache.capacity
                        ),
                    ));
                }
                let base = slot * cache.capacity * kv_row;
                let attended = reference::attend(
                    shape,
                    &qv[r * shape.heads * hd..(r + 1) * shape.heads * hd],
                    &keys[base..base + len * kv_row],
                    &values[base..base + len * kv_row],
                    len,
                );
                for h in 0..shape.heads {
                    for d in 0..hd {
                        let g = f64::from(qg[(r * shape.heads + h) * 2 * hd + hd + d]);
                        let a = f64::from(attended[h * hd + d]);
                        o[(r * shape.heads + h) * hd + d] =
                            crate::formats::bf16::round_f64(a / (1.0 + (-g).exp()));
                    }
                }
            }
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("attention q", q))?;
            let (n32, heads, kv, hd32, splits32) = (
                check_u32("rows", n)?,
                check_u32("heads", shape.heads)?,
                check_u32("kv heads", shape.kv_heads)?,
                check_u32("head_dim", hd)?,
                check_u32("splits", splits)?,
            );
            check_grid_y("attention rows", n32, "rows")?;
            let warp = target.warp_size;
            if !decode.runs_on(target) {
                return Err(Error::invalid(
                    "attention decode kernel",
                    format!("{} is not rendered for {}", decode.name(), target.name),
                ));
            }
            let (kernel, decode) = if decode == DecodeKernel::Mma {
                let bytes =
                    decode_mma_shared_bytes(shape, target.attention.split_positions as usize);
                if bytes > target.max_shared_bytes_per_block as usize {
                    return Err(Error::invalid(
                        "attention split",
                        format!(
                            "{} on {} needs {bytes} bytes of shared memory for \
                             {} positions of head_dim {hd} (at most {}): lower \
                             attention.split_positions in kernels/targets.toml",
                            decode_mma_kernel(shape, cache.format),
                            target.name,
                            target.attention.split_positions,
                            target.max_shared_bytes_per_block
                        ),
                    ));
                }
                let dims = LaunchDims {
                    grid: (kv, splits32, n32),
                    block: (DECODE_MMA_WARPS * warp, 1, 1),
                    shared_bytes: check_u32("attention shared memory", bytes)?,
                    cluster: (1, 1, 1),
                };
                (decode_mma_kernel(shape, cache.format), dims)
            } else {
                let dims = LaunchDims {
                    grid: (splits32, kv, n32),
                    block: ((heads / kv) * warp, 1, 1),
                    shared_bytes: 0,
                    cluster: (1, 1, 1),
                };
                (decode_warp_kernel(cache.format), dims)
            };
            let args = decode_arguments(q, cache, rows, workspace, shape, splits32)?;
            // SAFETY: the arguments are the decode kernels' parameters in order; q holds rows x
            // heads x head_dim, the workspace rows x heads x splits partials (checked above);
            // the cache is indexed by the rows' slots and positions, which the caller keeps in
            // range.
            unsafe { backend.launch(FAMILY, kernel, &decode, &args) }?;
            let combine_warps = target.attention.combine_warps_per_block;
            let multiprocessors = device.map_or(target.multiprocessors, |(_, m)| m);
            let dims_per_block = combine_dims_per_block(shape, n, target, multiprocessors);
            let combine = LaunchDims {
                grid: (n32 * heads, hd32.div_ceil(dims_per_block), 1),
                block: (combine_warps * warp, 1, 1),
                shared_bytes: 0,
                cluster: (1, 1, 1),
            };
            let args = combine_arguments(
                workspace,
                q_gate,
                rows,
                out,
                shape,
                splits32,
                dims_per_block,
            )?;
            // SAFETY: as above; out holds rows x heads x head_dim, q_gate's rows (at its
            // stride) heads x 2 x head_dim.
            unsafe { backend.launch(FAMILY, KERNEL_COMBINE_GATE, &combine, &args) }
        }
    }
}

/// `attention_prepare`'s arguments in its parameter order; the scalars from the layer, the rows,
/// the projections' strides and the cache.
///
/// # Errors
/// [`Error::Invalid`] when a size exceeds the kernels' 32-bit range or a projection's offset lies
/// past its buffer.
fn prepare_arguments<'a>(
    layer: &GatedAttention<'a>,
    projections: &Projections<'a>,
    rows: &'a Rows,
    cache: &'a mut KvCache,
    q: &'a mut DeviceVec<f32>,
) -> Result<[KernelArg<'a>; 24]> {
    let s = layer.shape;
    let (key_scale, value_scale) = cache.format.scales();
    let fp8 = u32::from(cache.format != KvFormat::Bf16);
    let capacity = check_u32("cache capacity", cache.capacity)?;
    Ok([
        projections.q_gate.arg()?,
        projections.k.arg()?,
        projections.v.arg()?,
        KernelArg::input(layer.q_norm),
        KernelArg::input(layer.k_norm),
        KernelArg::input(&layer.rope.cos_sin),
        KernelArg::input(&rows.slot),
        KernelArg::input(&rows.position),
        KernelArg::output(q),
        cache.keys.output(),
        cache.values.output(),
        KernelArg::u32(check_u32("rows", rows.count)?),
        KernelArg::u32(check_u32("q_gate row stride", projections.q_gate.stride)?),
        KernelArg::u32(check_u32("k row stride", projections.k.stride)?),
        KernelArg::u32(check_u32("v row stride", projections.v.stride)?),
        KernelArg::u32(check_u32("heads", s.heads)?),
        KernelArg::u32(check_u32("kv heads", s.kv_heads)?),
        KernelArg::u32(check_u32("head_dim", s.head_dim)?),
        KernelArg::u32(check_u32("rotary half", layer.rope.rotary_dim / 2)?),
        KernelArg::u32(capacity),
        KernelArg::f32(layer.eps),
        KernelArg::u32(fp8),
        KernelArg::f32(1.0 / key_scale),
        KernelArg::f32(1.0 / value_scale),
    ])
}

/// The split kernels' arguments in their parameter order (every decode kernel takes the same).
///
/// # Errors
/// [`Error::Invalid`] when a size exceeds the kernels' 32-bit range.
fn decode_arguments<'a>(
    q: &'a DeviceVec<f32>,
    cache: &'a KvCache,
    rows: &'a Rows,
    workspace: &'a mut Workspace,
    shape: AttentionShape,
    splits: u32,
) -> Result<[KernelArg<'a>; 14]> {
    let (key_scale, value_scale) = cache.format.scales();
    Ok([
        KernelArg::input(q),
        cache.keys.input(),
        cache.values.input(),
        KernelArg::input(&rows.slot),
        KernelArg::input(&rows.position),
        KernelArg::output(&mut workspace.partial_ml),
        KernelArg::output(&mut workspace.partial_acc),
        KernelArg::u32(check_u32("heads", shape.heads)?),
        KernelArg::u32(check_u32("kv heads", shape.kv_heads)?),
        KernelArg::u32(check_u32("head_dim", shape.head_dim)?),
        KernelArg::u32(check_u32("cache capacity", cache.capacity)?),
        KernelArg::u32(splits),
        KernelArg::f32(key_scale),
        KernelArg::f32(value_scale),
    ])
}

/// `attention_combine_gate`'s arguments in its parameter order.
///
/// # Errors
/// [`Error::Invalid`] when a size exceeds the kernels' 32-bit range or q_gate's offset lies
/// past its buffer.
fn combine_arguments<'a>(
    workspace: &'a Workspace,
    q_gate: Bf16Rows<'a>,
    rows: &'a Rows,
    out: &'a mut DeviceVec<bf16>,
    shape: AttentionShape,
    splits: u32,
    dims_per_block: u32,
) -> Result<[KernelArg<'a>; 11]> {
    Ok([
        KernelArg::input(&workspace.partial_ml),
        KernelArg::input(&workspace.partial_acc),
        q_gate.arg()?,
        KernelArg::input(&rows.position),
        KernelArg::output(out),
        KernelArg::u32(check_u32("rows", rows.count)?),
        KernelArg::u32(check_u32("q_gate row stride", q_gate.stride)?),
        KernelArg::u32(check_u32("heads", shape.heads)?),
        KernelArg::u32(check_u32("head_dim", shape.head_dim)?),
        KernelArg::u32(splits),
        KernelArg::u32(dims_per_block),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::launch_check;
    use crate::target;

    #[test]
    fn launch_sizes_and_limits_are_the_templates() {
        crate::kernels::table::assert_defines(
            super::FAMILY,
            |_| true,
            &[("ATTN_MAX_HEAD_DIM", super::MAX_HEAD_DIM.to_string())],
        );
        crate::kernels::table::assert_defines(
            super::FAMILY,
            |t| t.instructions.mma_sync_bf16,
            &[("ATTN_MMA_WARPS", super::DECODE_MMA_WARPS.to_string())],
        );
    }

    const QWEN: AttentionShape = AttentionShape {
        heads: 16,
        kv_heads: 2,
        head_dim: 256,
    };

    #[test]
    fn combine_blocks_cut_heads_only_at_small_batches() {
        let h200 = crate::target::by_name("sm_90a").expect("sm_90a");
        // B = 1: 16 (row, head)s, 8 blocks of 32 dimensions each (128 blocks for 132 SMs x 2)
        assert_eq!(
            combine_dims_per_block(QWEN, 1, h200, h200.multiprocessors),
            32
        );
        // B = 8: 128 items, 3 parts wanted: 96-dimension blocks (3 per head)
        assert_eq!(
            combine_dims_per_block(QWEN, 8, h200, h200.multiprocessors),
            96
        );
        // B = 64: 1024 items already give every SM more than two blocks
        assert_eq!(
            combine_dims_per_block(QWEN, 64, h200, h200.multiprocessors),
            256
        );
        // head_dim 160: 5 lanes of 32, never a block past the head
        let odd = AttentionShape {
            heads: 12,
            kv_heads: 1,
            head_dim: 160,
        };
        let dims = combine_dims_per_block(odd, 1, h200, h200.multiprocessors);
        assert!(dims % 32 == 0 && dims <= 160, "{dims}");
    }

    #[test]
    fn large_batches_take_several_chunks_per_split() {
        let h200 = crate::target::by_name("sm_90a").expect("sm_90a");
        // 20001 positions are 313 chunks of 64: B = 1 keeps one split per chunk (626 blocks
        // within 6 x 132), B = 8 and 64 share 792 blocks' worth over their rows and KV heads
        assert_eq!(call_splits(h200, h200.multiprocessors, 1, 2, 20001), 313);
        assert_eq!(call_splits(h200, h200.multiprocessors, 8, 2, 20001), 50);
        assert_eq!(call_splits(h200, h200.multiprocessors, 64, 2, 20001), 7);
        // a short cache: never more splits than chunks, never fewer than one
        assert_eq!(call_splits(h200, h200.multiprocessors, 1, 2, 100), 2);
        assert_eq!(call_splits(h200, h200.multiprocessors, 4096, 16, 20001), 1);
    }

    #[test]
    fn the_mma_split_fits_three_blocks_per_h200_sm() {
        let bytes = decode_mma_shared_bytes(QWEN, 64);
        // K and V rows (2 x 64 x 264 bf16), scores (2 k parts x 8 heads x 64 f32), p hi / lo
        assert_eq!(bytes, 2 * 64 * 264 * 2 + 2 * 8 * 64 * 4 + 2 * 8 * 72 * 2);
        assert!(3 * (bytes + 1024) <= 228 * 1024, "{bytes}");
        assert_eq!(
            decode_mma_kernel(QWEN, KvFormat::Bf16),
            KERNEL_DECODE_MMA_G8
        );
        assert_eq!(
            decode_mma_kernel(QWEN, KvFormat::FP8_UNIT_SCALES),
            KERNEL_DECODE_MMA_G8_FP8
        );
    }

    /// Every attention kernel's launch arguments against its compiled parameters on every target
    /// (the mma split kernels where they are rendered), both KV formats and strided projections.
    #[test]
    fn the_launch_arguments_match_every_targets_kernels() {
        let cpu = Backend::Cpu;
        let shape = QWEN;
        let (hd, q_rows) = (shape.head_dim, shape.heads * shape.head_dim);
        let rope = RopeTable::new(&cpu, 64, 1e7, 8).expect("rope");
        let norm = DeviceVec::Host(vec![0.0f32; hd]);
        let layer = GatedAttention {
            shape,
            q_norm: &norm,
            k_norm: &norm,
            eps: 1e-6,
            rope: &rope,
        };
        let qkv = DeviceVec::Host(vec![bf16::ZERO; shape.projection_width()]);
        let projections = Projections::fused(shape, &qkv);
        let rows = Rows {
            count: 1,
            slot: DeviceVec::Host(vec![0]),
            position: DeviceVec::Host(vec![0]),
        };
        let mut q = DeviceVec::Host(vec![0.0f32; q_rows]);
        let mut out = DeviceVec::Host(vec![bf16::ZERO; q_rows]);
        let mut workspace = Workspace::new(&cpu, shape, 1, 8).expect("workspace");
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            let name = t.name.as_str();
            for format in [KvFormat::Bf16, KvFormat::FP8_UNIT_SCALES] {
                let mut cache = KvCache::new(&cpu, shape, 1, 8, format).expect("cache");
                let args = prepare_arguments(&layer, &projections, &rows, &mut cache, &mut q)
                    .expect("prepare arguments");
                checks.check(name, KERNEL_PREPARE, &args);
                let mut kernels = vec![decode_warp_kernel(format)];
                if DecodeKernel::Mma.runs_on(t) {
                    kernels.push(decode_mma_kernel(shape, format));
                }
                for kernel in kernels {
                    let args = decode_arguments(&q, &cache, &rows, &mut workspace, shape, 1)
                        .expect("decode arguments");
                    checks.check(name, kernel, &args);
                }
            }
            let args = combine_arguments(
                &workspace,
                projections.q_gate,
                &rows,
                &mut out,
                shape,
                1,
                32,
            )
            .expect("combine arguments");
            checks.check(name, KERNEL_COMBINE_GATE, &args);
        }
        checks.assert_all_match();
    }
}
