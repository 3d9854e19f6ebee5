//! A MoE block's weights on the host, as a checkpoint or a caller provides them, checked against
//! the block's shape; and the kernel layout they are re-laid-out into once at load.
//!
//! Sources: float row-major slices in the fused 3-D layout of Qwen3.5/3.6 (`gate_up` `[E, 2I, H]`,
//! `down` `[E, H, I]`), per-expert bf16 or NVFP4 matrices (each NVFP4 tensor with its own
//! `weight_scale` / `weight_scale_2` / `input_scale`), or a safetensors checkpoint under a tensor
//! name prefix ([`MoeHostWeights::load`]).
//!
//! Kernel layout ([`KernelLayout`], for the target's [`TensorCore`]): the router rows and the
//! shared expert's gate as one bf16 `[E + 1, H]` matrix in the GEMM family's fragment order
//! (mma.sync or WMMA); every routed expert's `[gate; up]` in [`RowOrder::GateUp`] and its down in
//! [`RowOrder::Plain`] fragments, concatenated, followed by the shared expert cut into
//! `S = ceil(Is / I)` sub-experts of `I` columns (zero-padded: a zero gate and up row gives
//! `silu(0) * 0 = 0`, a zero down column adds nothing), so the kernel treats it as S more experts.
//! Per expert, `alpha` multipliers carry the per-tensor scales (NVFP4 on mma.sync:
//! `weight_scale_2 * 2^7`, the fragments' exponent offset; NVFP4 on WMMA: `weight_scale_2`, the
//! kernel decodes `e2m1 * e4m3` exactly; bf16: 1).

use super::reference::MoeShape;
use crate::error::{Error, Result};
use crate::formats::nvfp4::{BLOCK, E4M3_ONE, Nvfp4Matrix, e2m1_decode, e4m3_decode};
use crate::formats::safetensors::{Checkpoint, TensorRef};
use crate::kernels::gemm::layout::{
    Bf16Fragments, GROUP_COLS, Nvfp4Fragments, TILE_ROWS, TileGrid, WmmaBf16Fragments,
    WmmaNvfp4Fragments,
};
use crate::kernels::gemm::{RowOrder, TensorCore};
use crate::rng::SplitMix64;
use half::{bf16, f16};
use safetensors::Dtype;

/// The weight format of the experts (routed and shared alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFormat {
    /// NVFP4 weights, bf16 activations (W4A16: decoded in registers, bf16 tensor-core math).
    Nvfp4,
    /// bf16 weights.
    Bf16,
}

/// One expert's weights (a routed expert, or the shared expert with `Is` for `I`).
#[derive(Debug, Clone, PartialEq)]
pub enum ExpertWeights {
    /// bf16: `gate_up` `[2I][H]` (rows `[gate; up]`), `down` `[H][I]`, row-major.
    Bf16 {
        /// `[2I][H]`.
        gate_up: Vec<bf16>,
        /// `[H][I]`.
        down: Vec<bf16>,
    },
    /// NVFP4, each matrix with its own block scales and per-tensor scale.
    Nvfp4 {
        /// `gate_proj` `[I, H]`.
        gate: Nvfp4Matrix,
        /// `up_proj` `[I, H]`.
        up: Nvfp4Matrix,
        /// `down_proj` `[H, I]`.
        down: Nvfp4Matrix,
    },
}

impl ExpertWeights {
    /// The format.
    pub fn format(&self) -> ExpertFormat {
        match self {
            ExpertWeights::Bf16 { .. } => ExpertFormat::Bf16,
            ExpertWeights::Nvfp4 { .. } => ExpertFormat::Nvfp4,
        }
    }

    /// The weights as the CPU reference reads them: `([2I][H], [H][I])` in f32 (NVFP4
    /// dequantised: `e2m1 * e4m3 * weight_scale_2`).
    pub fn dense(&self) -> (Vec<f32>, Vec<f32>) {
        match self {
            ExpertWeights::Bf16 { gate_up, down } => (
                gate_up.iter().map(|v| v.to_f32()).collect(),
                down.iter().map(|v| v.to_f32()).collect(),
            ),
            ExpertWeights::Nvfp4 { gate, up, down } => {
                let mut gate_up = gate.dequantize();
                gate_up.extend(up.dequantize());
                (gate_up, down.dequantize())
            }
        }
    }

    /// Bytes a kernel streams to read the expert once (NVFP4: nibbles + block scales; bf16: 2
    /// per element).
    pub fn bytes(&self) -> u64 {
        match self {
            ExpertWeights::Bf16 { gate_up, down } => 2 * (gate_up.len() + down.len()) as u64,
            ExpertWeights::Nvfp4 { gate, up, down } => [gate, up, down]
                .iter()
                .map(|m| (m.packed.len() + m.scales.len()) as u64)
                .sum(),
        }
    }

    /// Checks the buffers against `[2 * inter, hidden]` / `[hidden, inter]`.
    fn check(&self, what: &str, hidden: usize, inter: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid(what, reason));
        match self {
            ExpertWeights::Bf16 { gate_up, down } => {
                if gate_up.len() != 2 * inter * hidden || down.len() != hidden * inter {
                    return bad(format!(
                        "bf16 gate_up has {} values and down {}; [{}, {hidden}] and [{hidden}, {inter}] need {} and {}",
                        gate_up.len(),
                        down.len(),
                        2 * inter,
                        2 * inter * hidden,
                        hidden * inter
                    ));
                }
            }
            ExpertWeights::Nvfp4 { gate, up, down } => {
                for (name, m, rows, cols) in [
                    ("gate", gate, inter, hidden),
                    ("up", up, inter, hidden),
                    ("down", down, hidden, inter),
                ] {
                    if (m.rows, m.cols) != (rows, cols)
                        || m.packed.len() != rows * cols / 2
                        || m.scales.len() != rows * cols / BLOCK
                    {
                        return bad(format!(
                            "NVFP4 {name} is [{}, {}] with {} packed bytes and {} scales; expected [{rows}, {cols}]",
                            m.rows,
                            m.cols,
                            m.packed.len(),
                            m.scales.len()
                        ));
                    }
                    if !m.global_scale.is_finite() {
                        return bad(format!("NVFP4 {name} has global scale {}", m.global_scale));
                    }
                }
            }
        }
        Ok(())
    }
}

/// An element type a float weight can come in.
pub trait FloatElement: Copy {
    /// The value rounded to bf16 (round to nearest even).
    fn to_bf16(self) -> bf16;
}

impl FloatElement for f32 {
    fn to_bf16(self) -> bf16 {
        bf16::from_f32(self)
    }
}

impl FloatElement for bf16 {
    fn to_bf16(self) -> bf16 {
        self
    }
}

impl FloatElement for f16 {
    fn to_bf16(self) -> bf16 {
        bf16::from_f32(self.to_f32())
    }
}

/// A whole block as float row-major slices, experts in the fused 3-D layout.
#[derive(Debug, Clone, Copy)]
pub struct FusedBlock<'a, T> {
    /// Router `[E][H]`.
    pub router: &'a [T],
    /// The shared expert's gate `[H]`.
    pub shared_gate: Option<&'a [T]>,
    /// `[E][2I][H]`, each expert's rows `[gate; up]`.
    pub gate_up: &'a [T],
    /// `[E][H][I]`.
    pub down: &'a [T],
    /// The shared expert: `[2Is][H]` (rows `[gate; up]`) and `[H][Is]`.
    pub shared: Option<(&'a [T], &'a [T])>,
}

/// A MoE block's weights in host memory, before the load-time re-layout. The router (and the
/// shared gate) are bf16, as the kernels read them.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeHostWeights {
    /// The block's sizes.
    pub shape: MoeShape,
    /// Router `[E][H]`.
    pub router: Vec<bf16>,
    /// The shared expert's gate `[H]` (`shared_expert_gate.weight`), if any.
    pub shared_gate: Option<Vec<bf16>>,
    /// The `E` routed experts, all in one format.
    pub experts: Vec<ExpertWeights>,
    /// The shared expert (`Is` = `shape.shared_intermediate` columns), present exactly when
    /// `Is > 0`.
    pub shared: Option<ExpertWeights>,
}

impl MoeHostWeights {
    /// A block from float slices (f32, bf16 or f16; rounded to bf16), checked against `shape`.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the slice whose length disagrees with `shape`, or as
    /// [`MoeHostWeights::check`].
    pub fn from_fused<T: FloatElement>(shape: MoeShape, block: &FusedBlock<'_, T>) -> Result<Self> {
        let MoeShape {
            experts,
            hidden: h,
            intermediate: i,
            shared_intermediate: s,
            ..
        } = shape;
        let length = |what: &str, got: usize, want: usize| -> Result<()> {
            if got == want {
                Ok(())
            } else {
                Err(Error::invalid(
                    what,
                    format!("{got} values, expected {want} for {shape:?}"),
                ))
            }
        };
        length("MoE router", block.router.len(), experts * h)?;
        length(
            "MoE experts gate_up",
            block.gate_up.len(),
            experts * 2 * i * h,
        )?;
        length("MoE experts down", block.down.len(), experts * h * i)?;
        if let Some(gate) = block.shared_gate {
            length("MoE shared expert gate", gate.len(), h)?;
        }
        let round = |v: &[T]| -> Vec<bf16> { v.iter().map(|x| x.to_bf16()).collect() };
        let shared = match block.shared {
            Some((gate_up, down)) => {
                length("MoE shared expert gate_up", gate_up.len(), 2 * s * h)?;
                length("MoE shared expert down", down.len(), h * s)?;
                Some(ExpertWeights::Bf16 {
                    gate_up: round(gate_up),
                    down: round(down),
                })
            }
            None => None,
        };
        let weights = Self {
            shape,
            router: round(block.router),
            shared_gate: block.shared_gate.map(round),
            experts: (0..experts)
                .map(|e| ExpertWeights::Bf16 {
                    gate_up: round(&block.gate_up[e * 2 * i * h..(e + 1) * 2 * i * h]),
                    down: round(&block.down[e * h * i..(e + 1) * h * i]),
                })
                .collect(),
            shared,
        };
        weights.check()?;
        Ok(weights)
    }

    /// Synthetic weights of `shape` for benches and tests (exact for bandwidth and compute, not
    /// for a model's accuracy), reproducible from `seed`: router rows uniform with RMS
    /// `2 / sqrt(H)` (logits of standard deviation ~2 for unit inputs), the shared gate (when
    /// `Is > 0`) `1 / sqrt(H)`; every expert (and the shared expert) in `format`, gate and up of
    /// RMS `1 / sqrt(H)`, down `1 / sqrt(I)`. NVFP4: uniform random codes, block scales 0.5 ..
    /// 1.875, one per-tensor scale per matrix (gate's and up's equal). Experts are generated in
    /// parallel.
    pub fn synthetic(shape: MoeShape, format: ExpertFormat, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let h = shape.hidden;
        let router = uniform_bf16(&mut rng, shape.experts * h, 2.0 / (h as f32).sqrt());
        let shared_gate = (shape.shared_intermediate > 0)
            .then(|| uniform_bf16(&mut rng, h, 1.0 / (h as f32).sqrt()));
        let seeds: Vec<u64> = (0..shape.experts).map(|_| rng.next_u64()).collect();
        let experts = parallel_map(&seeds, |&seed| {
            synthetic_expert(&mut SplitMix64::new(seed), format, h, shape.intermediate)
        });
        let shared = (shape.shared_intermediate > 0)
            .then(|| synthetic_expert(&mut rng, format, h, shape.shared_intermediate));
        Self {
            shape,
            router,
            shared_gate,
            experts,
            shared,
        }
    }

    /// The routed experts' format.
    pub fn format(&self) -> ExpertFormat {
        self.experts
            .first()
            .map_or(ExpertFormat::Bf16, ExpertWeights::format)
    }

    /// Shared sub-experts of `I` columns the kernels run the shared expert as: `ceil(Is / I)`.
    pub fn shared_experts(&self) -> usize {
        self.shape
            .shared_intermediate
            .div_ceil(self.shape.intermediate.max(1))
    }

    /// Checks every buffer against the shape, that the experts share one format, and that the
    /// shape fits the kernels (K multiples of 16, `1 <= k <= E`).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the first expert, tensor or size that is wrong.
    pub fn check(&self) -> Result<()> {
        let MoeShape {
            experts,
            top_k,
            hidden: h,
            intermediate: i,
            shared_intermediate: s,
        } = self.shape;
        let bad = |what: &str, reason: String| Err(Error::invalid(what, reason));
        if experts == 0 || top_k == 0 || top_k > experts {
            return bad(
                "MoE shape",
                format!("{experts} experts, top-k {top_k}: need 1 <= k <= E"),
            );
        }
        for (name, value) in [
            ("hidden size", h),
            ("expert intermediate size", i),
            ("shared expert intermediate size", s),
        ] {
            if value % BLOCK != 0 || (value == 0 && name != "shared expert intermediate size") {
                return bad(
                    "MoE shape",
                    format!(
                        "{name} {value} is not a positive multiple of 16 (one NVFP4 block, one MMA K step)"
                    ),
                );
            }
        }
        if self.router.len() != experts * h {
            return bad(
                "MoE router",
                format!("{} values, expected [{experts}, {h}]", self.router.len()),
            );
        }
        if self.experts.len() != experts {
            return bad(
                "MoE experts",
                format!("{} experts for E = {experts}", self.experts.len()),
            );
        }
        let format = self.format();
        for (e, expert) in self.experts.iter().enumerate() {
            let what = format!("MoE expert {e}");
            if expert.format() != format {
                return bad(
                    &what,
                    format!(
                        "is {:?} but expert 0 is {format:?}: the routed experts must share one format",
                        expert.format()
                    ),
                );
            }
            expert.check(&what, h, i)?;
        }
        match (&self.shared, s) {
            (None, 0) => {}
            (Some(shared), s) if s > 0 => {
                shared.check("MoE shared expert", h, s)?;
                if format == ExpertFormat::Nvfp4 && shared.format() == ExpertFormat::Bf16 {
                    return bad(
                        "MoE shared expert",
                        "is bf16 while the routed experts are NVFP4: the kernels run one format (quantise the shared expert, or load the routed experts in bf16)".into(),
                    );
                }
            }
            (None, s) => {
                return bad(
                    "MoE shared expert",
                    format!("the shape has shared_intermediate {s} but no shared expert is given"),
                );
            }
            (Some(_), _) => {
                return bad(
                    "MoE shared expert",
                    "given, but the shape has shared_intermediate 0".into(),
                );
            }
        }
        if let Some(gate) = &self.shared_gate {
            if self.shared.is_none() {
                return bad(
                    "MoE shared expert gate",
                    "given without a shared expert".into(),
                );
            }
            if gate.len() != h {
                return bad(
                    "MoE shared expert gate",
                    format!("{} values, expected {h}", gate.len()),
                );
            }
        }
        Ok(())
    }

    /// Bytes of one routed expert's weights (what a kernel reads once per active expert).
    pub fn expert_bytes(&self) -> u64 {
        self.experts.first().map_or(0, ExpertWeights::bytes)
    }

    /// Loads the block under `prefix` (e.g. `model.layers.3.mlp.`): `gate.weight` `[E, H]`,
    /// optional `shared_expert_gate.weight` `[1, H]`, the routed experts fused
    /// (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`: float, or NVFP4
    /// codes `[E, N, K/2]` with per-expert `{name}_weight_scale` / `_weight_scale_2` /
    /// `_input_scale` as [`Nvfp4Matrix::load_fused_expert`] reads them) or per expert
    /// (`experts.{e}.{gate,up,down}_proj`, float `.weight` or NVFP4 in the ModelOpt or
    /// compressed-tensors convention, every expert with its own scales), and the shared expert
    /// (`shared_expert.{gate,up,down}_proj`) when `shape.shared_intermediate > 0`. Float tensors
    /// may be BF16, F16 or F32 (rounded to bf16).
    ///
    /// # Errors
    /// [`Error::MissingTensor`] naming the first absent tensor (a missing NVFP4 scale included),
    /// [`Error::Dtype`] / [`Error::Shape`] naming a tensor that disagrees with `shape`,
    /// [`Error::Invalid`] for experts in mixed formats or as [`MoeHostWeights::check`].
    pub fn load(checkpoint: &Checkpoint, prefix: &str, shape: MoeShape) -> Result<Self> {
        let MoeShape {
            experts,
            hidden: h,
            intermediate: i,
            shared_intermediate: s,
            ..
        } = shape;
        let router = checkpoint.expect(&format!("{prefix}gate.weight"), &FLOAT, &[experts, h])?;
        let shared_gate_name = format!("{prefix}shared_expert_gate.weight");
        let shared_gate = if checkpoint.contains(&shared_gate_name) {
            let gate = checkpoint.expect(&shared_gate_name, &FLOAT, &[1, h])?;
            Some(bf16_elements(&gate, 0, h))
        } else {
            None
        };
        let fused = format!("{prefix}experts.gate_up_proj");
        let routed = if checkpoint.contains(&fused) && checkpoint.tensor(&fused)?.dtype == Dtype::U8
        {
            // fused NVFP4: `[E, 2I, H/2]` codes with per-expert scales (`{name}_weight_scale`,
            // `{name}_weight_scale_2`, ...); gate and up share each expert's per-tensor scale
            let down_name = format!("{prefix}experts.down_proj");
            (0..experts)
                .map(|e| {
                    let gate_up = fused_nvfp4_expert(checkpoint, &fused, e, 2 * i, h)?;
                    Ok(ExpertWeights::Nvfp4 {
                        gate: nvfp4_rows(&gate_up, 0, i),
                        up: nvfp4_rows(&gate_up, i, i),
                        down: fused_nvfp4_expert(checkpoint, &down_name, e, h, i)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else if checkpoint.contains(&fused) {
            let gate_up = checkpoint.expect(&fused, &FLOAT, &[experts, 2 * i, h])?;
            let down = checkpoint.expect(
                &format!("{prefix}experts.down_proj"),
                &FLOAT,
                &[experts, h, i],
            )?;
            (0..experts)
                .map(|e| ExpertWeights::Bf16 {
                    gate_up: bf16_elements(&gate_up, e * 2 * i * h, 2 * i * h),
                    down: bf16_elements(&down, e * h * i, h * i),
                })
                .collect()
        } else {
            let mut list: Vec<ExpertWeights> = Vec::with_capacity(experts);
            for e in 0..experts {
                let expert = load_expert(checkpoint, &format!("{prefix}experts.{e}."), h, i)?;
                if let Some(first) = list.first() {
                    if first.format() != expert.format() {
                        return Err(Error::invalid(
                            format!("tensor `{prefix}experts.{e}.gate_proj`"),
                            format!(
                                "expert {e} is {:?} but expert 0 is {:?}: the routed experts must share one format",
                                expert.format(),
                                first.format()
                            ),
                        ));
                    }
                }
                list.push(expert);
            }
            list
        };
        let shared = if s > 0 {
            Some(load_expert(
                checkpoint,
                &format!("{prefix}shared_expert."),
                h,
                s,
            )?)
        } else {
            None
        };
        let weights = Self {
            shape,
            router: bf16_elements(&router, 0, experts * h),
            shared_gate,
            experts: routed,
            shared,
        };
        weights.check()?;
        Ok(weights)
    }

    /// The kernel layout for the kernels on `tensor_core` (see the module docs). Experts are
    /// re-laid-out in parallel.
    ///
    /// # Errors
    /// As [`MoeHostWeights::check`], and [`Error::Invalid`] for a NaN NVFP4 block scale.
    pub fn kernel_layout(&self, tensor_core: TensorCore) -> Result<KernelLayout> {
        self.check()?;
        let MoeShape {
            experts,
            hidden: h,
            intermediate: i,
            ..
        } = self.shape;
        let format = self.format();
        let mut router = self.router.clone();
        if let Some(gate) = &self.shared_gate {
            router.extend_from_slice(gate);
        }
        let router_rows = router.len() / h;
        let router = match tensor_core {
            TensorCore::MmaSync => {
                Bf16Fragments::new(&router, router_rows, h, RowOrder::Plain)?.words
            }
            TensorCore::Wmma => bf16_pairs(
                &WmmaBf16Fragments::new(&router, router_rows, h, RowOrder::Plain)?.values,
            ),
        };
        // every expert the kernels see: the routed ones, then the shared sub-experts
        let mut units: Vec<ExpertWeights> = Vec::new();
        if let Some(shared) = &self.shared {
            units = split_shared(shared, self.shape, format);
        }
        let all: Vec<&ExpertWeights> = self.experts.iter().chain(units.iter()).collect();
        let pieces = parallel_map(&all, |expert| expert_fragments(expert, h, i, tensor_core));
        let mut layout = KernelLayout {
            tensor_core,
            format,
            hidden: h,
            inter: i,
            router,
            has_shared_gate: self.shared_gate.is_some(),
            shared_experts: units.len(),
            gate_up: Vec::new(),
            gate_up_scales: Vec::new(),
            down: Vec::new(),
            down_scales: Vec::new(),
            gate_up_alpha: Vec::with_capacity(2 * all.len()),
            down_alpha: Vec::with_capacity(all.len()),
        };
        let shared_alphas = self
            .shared
            .as_ref()
            .and_then(|shared| split_shared_alphas(shared, format));
        for (index, piece) in pieces.into_iter().enumerate() {
            let mut piece = piece?;
            if let (true, Some([gate, up, down])) = (index >= experts, shared_alphas) {
                piece.gate_up_alpha = [gate, up];
                piece.down_alpha = down;
            }
            layout.gate_up.extend_from_slice(&piece.gate_up);
            layout
                .gate_up_scales
                .extend_from_slice(&piece.gate_up_scales);
            layout.down.extend_from_slice(&piece.down);
            layout.down_scales.extend_from_slice(&piece.down_scales);
            layout.gate_up_alpha.extend_from_slice(&piece.gate_up_alpha);
            layout.down_alpha.push(piece.down_alpha);
        }
        debug_assert_eq!(layout.down_alpha.len(), experts + layout.shared_experts);
        Ok(layout)
    }
}

/// `len` bf16 values uniform in `[-a, a]` with RMS `rms`.
pub(crate) fn uniform_bf16(rng: &mut SplitMix64, len: usize, rms: f32) -> Vec<bf16> {
    let a = rms * 3f32.sqrt();
    (0..len)
        .map(|_| bf16::from_f32((2.0 * rng.uniform() - 1.0) * a))
        .collect()
}

/// RMS of an E2M1 code drawn uniformly from all 16.
const E2M1_UNIFORM_RMS: f32 = 2.93;
/// RMS of a block scale drawn uniformly from the E4M3 codes 0x30 ..= 0x3f (0.5 .. 1.875).
const SYNTHETIC_SCALE_RMS: f32 = 1.15;

/// An NVFP4 `[rows, cols]` of RMS about `rms` (uniform codes and block scales, see
/// [`MoeHostWeights::synthetic`]).
pub(crate) fn synthetic_nvfp4(
    rng: &mut SplitMix64,
    rows: usize,
    cols: usize,
    rms: f32,
) -> Nvfp4Matrix {
    let mut packed = vec![0u8; rows * cols / 2];
    for chunk in packed.chunks_mut(8) {
        let bits = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&bits[..chunk.len()]);
    }
    let scales = (0..rows * cols / BLOCK)
        .map(|_| 0x30 + (rng.next_u64() % 16) as u8)
        .collect();
    Nvfp4Matrix {
        rows,
        cols,
        packed,
        scales,
        global_scale: rms / (E2M1_UNIFORM_RMS * SYNTHETIC_SCALE_RMS),
        input_scale: None,
    }
}

fn synthetic_expert(
    rng: &mut SplitMix64,
    format: ExpertFormat,
    h: usize,
    i: usize,
) -> ExpertWeights {
    let (w_in, w_out) = (1.0 / (h as f32).sqrt(), 1.0 / (i as f32).sqrt());
    match format {
        ExpertFormat::Nvfp4 => ExpertWeights::Nvfp4 {
            gate: synthetic_nvfp4(rng, i, h, w_in),
            up: synthetic_nvfp4(rng, i, h, w_in),
            down: synthetic_nvfp4(rng, h, i, w_out),
        },
        ExpertFormat::Bf16 => ExpertWeights::Bf16 {
            gate_up: uniform_bf16(rng, 2 * i * h, w_in),
            down: uniform_bf16(rng, h * i, w_out),
        },
    }
}

/// The float dtypes accepted for dense tensors.
const FLOAT: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// `len` elements of a float tensor from element `start`, rounded to bf16 (no f32 copy of the
/// whole tensor: a fused expert tensor is gigabytes).
fn bf16_elements(tensor: &TensorRef<'_>, start: usize, len: usize) -> Vec<bf16> {
    let data = tensor.data;
    match tensor.dtype {
        Dtype::F32 => data[4 * start..4 * (start + len)]
            .chunks_exact(4)
            .map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        Dtype::F16 => data[2 * start..2 * (start + len)]
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_bf16())
            .collect(),
        // BF16 (the callers checked the dtype is one of FLOAT)
        _ => data[2 * start..2 * (start + len)]
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]))
            .collect(),
    }
}

/// A 2-D linear `{prefix}{name}` of `[rows, cols]`: float `.weight`, or NVFP4 (detected by its
/// codes being U8 or by its scale tensors).
enum LoadedLinear {
    Float(Vec<bf16>),
    Nvfp4(Nvfp4Matrix),
}

fn load_linear(
    checkpoint: &Checkpoint,
    prefix: &str,
    rows: usize,
    cols: usize,
) -> Result<LoadedLinear> {
    let weight = format!("{prefix}.weight");
    let nvfp4 = checkpoint.contains(&format!("{prefix}.weight_packed"))
        || checkpoint.contains(&format!("{prefix}.weight_scale"))
        || checkpoint.contains(&format!("{prefix}.weight_scale_2"))
        || (checkpoint.contains(&weight) && checkpoint.tensor(&weight)?.dtype == Dtype::U8);
    if nvfp4 {
        let matrix = Nvfp4Matrix::load(checkpoint, prefix)?;
        if (matrix.rows, matrix.cols) != (rows, cols) {
            let codes = if checkpoint.contains(&format!("{prefix}.weight_packed")) {
                format!("{prefix}.weight_packed")
            } else {
                weight
            };
            let tensor = checkpoint.tensor(&codes)?;
            return Err(Error::Shape {
                tensor: codes,
                file: tensor.file.to_path_buf(),
                expected: format!("[{rows}, {}] (NVFP4 codes of [{rows}, {cols}])", cols / 2),
                found: tensor.shape.to_vec(),
            });
        }
        return Ok(LoadedLinear::Nvfp4(matrix));
    }
    let tensor = checkpoint.expect(&weight, &FLOAT, &[rows, cols])?;
    Ok(LoadedLinear::Float(bf16_elements(&tensor, 0, rows * cols)))
}

/// Expert `expert` of the fused NVFP4 tensor `name`, checked to be `[rows, cols]`.
fn fused_nvfp4_expert(
    checkpoint: &Checkpoint,
    name: &str,
    expert: usize,
    rows: usize,
    cols: usize,
) -> Result<Nvfp4Matrix> {
    let matrix = Nvfp4Matrix::load_fused_expert(checkpoint, name, expert)?;
    if (matrix.rows, matrix.cols) != (rows, cols) {
        let tensor = checkpoint.tensor(name)?;
        return Err(Error::Shape {
            tensor: name.to_string(),
            file: tensor.file.to_path_buf(),
            expected: format!(
                "[E, {rows}, {}] (NVFP4 codes of [{rows}, {cols}] per expert)",
                cols / 2
            ),
            found: tensor.shape.to_vec(),
        });
    }
    Ok(matrix)
}

/// One expert's `gate_proj`, `up_proj`, `down_proj` under `prefix` (`...experts.7.`), all float
/// or all NVFP4.
fn load_expert(
    checkpoint: &Checkpoint,
    prefix: &str,
    hidden: usize,
    inter: usize,
) -> Result<ExpertWeights> {
    let gate = load_linear(checkpoint, &format!("{prefix}gate_proj"), inter, hidden)?;
    let up = load_linear(checkpoint, &format!("{prefix}up_proj"), inter, hidden)?;
    let down = load_linear(checkpoint, &format!("{prefix}down_proj"), hidden, inter)?;
    match (gate, up, down) {
        (LoadedLinear::Float(mut gate_up), LoadedLinear::Float(up), LoadedLinear::Float(down)) => {
            gate_up.extend_from_slice(&up);
            Ok(ExpertWeights::Bf16 { gate_up, down })
        }
        (LoadedLinear::Nvfp4(gate), LoadedLinear::Nvfp4(up), LoadedLinear::Nvfp4(down)) => {
            Ok(ExpertWeights::Nvfp4 { gate, up, down })
        }
        _ => Err(Error::invalid(
            format!("tensors `{prefix}{{gate,up,down}}_proj`"),
            "mix NVFP4 and float: one expert's three projections must share a format",
        )),
    }
}

/// The experts in the kernels' order and form, re-laid-out once at load.
///
/// Fragments are u32 words of the GEMM family's layouts for `tensor_core`
/// ([`Nvfp4Fragments`] / [`Bf16Fragments`] on mma.sync, [`WmmaNvfp4Fragments`] /
/// [`WmmaBf16Fragments`] on WMMA, whose bf16 values go two per word, the even column in the low
/// half); NVFP4 block scales are the layout's scale bytes in memory order (mma.sync: two e5m3
/// bytes per lane; WMMA: four e4m3 bytes per tile row).
#[derive(Debug, Clone)]
pub struct KernelLayout {
    /// The instruction the fragments are laid out for.
    pub tensor_core: TensorCore,
    /// The experts' format.
    pub format: ExpertFormat,
    /// H.
    pub hidden: usize,
    /// I (also the sub-experts' width).
    pub inter: usize,
    /// Router rows, then the shared gate row when present: bf16 fragments.
    pub router: Vec<u32>,
    /// Whether router row E is the shared expert's gate.
    pub has_shared_gate: bool,
    /// S: shared sub-experts after the E routed experts.
    pub shared_experts: usize,
    /// `[E + S]` experts' `[gate; up]` fragments ([`RowOrder::GateUp`]).
    pub gate_up: Vec<u32>,
    /// Their NVFP4 scale bytes (empty for bf16).
    pub gate_up_scales: Vec<u8>,
    /// `[E + S]` experts' down fragments ([`RowOrder::Plain`]).
    pub down: Vec<u32>,
    /// Their NVFP4 scale bytes (empty for bf16).
    pub down_scales: Vec<u8>,
    /// `[E + S][2]`: the multipliers of the gate rows and of the up rows.
    pub gate_up_alpha: Vec<f32>,
    /// `[E + S]`: the multiplier of the down rows.
    pub down_alpha: Vec<f32>,
}

impl KernelLayout {
    /// Experts the kernels see: the routed ones, then the shared sub-experts.
    pub fn units(&self) -> usize {
        self.down_alpha.len()
    }

    /// What the kernels multiply with for unit `unit` (a routed expert, or `E + c` for shared
    /// sub-expert c), decoded back from the fragments and scaled by the alphas: `([2I][H]` rows
    /// `[gate; up]`, `[H][I])` in f32. For checks of the layout against the weights it came from.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a unit past [`KernelLayout::units`].
    pub fn unit_dense(&self, unit: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        if unit >= self.units() {
            return Err(Error::invalid(
                "MoE kernel layout",
                format!("unit {unit} of {}", self.units()),
            ));
        }
        let (h, i) = (self.hidden, self.inter);
        let gate_up = TileGrid::new("MoE gate_up", 2 * i, h, RowOrder::GateUp)?;
        let down = TileGrid::new("MoE down", h, i, RowOrder::Plain)?;
        let [gate_alpha, up_alpha] = [
            self.gate_up_alpha[2 * unit],
            self.gate_up_alpha[2 * unit + 1],
        ];
        let down_alpha = self.down_alpha[unit];
        let decode =
            |grid: TileGrid, words: &[u32], scales: &[u8], alpha: &dyn Fn(usize) -> f32| {
                let (unit_words, unit_scale_bytes) = self.unit_sizes(&grid);
                let words = &words[unit * unit_words..(unit + 1) * unit_words];
                let scales = if scales.is_empty() {
                    &[][..]
                } else {
                    &scales[unit * unit_scale_bytes..(unit + 1) * unit_scale_bytes]
                };
                let value: Box<dyn Fn(usize, usize) -> f32> = match (self.tensor_core, self.format)
                {
                    (TensorCore::MmaSync, ExpertFormat::Nvfp4) => {
                        let fragments = Nvfp4Fragments {
                            grid,
                            words: words.to_vec(),
                            scales: scales
                                .chunks_exact(2)
                                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                                .collect(),
                            global_scale: 1.0 / NVFP4_FRAGMENT_SCALE,
                        };
                        Box::new(move |row, col| fragments.value(row, col))
                    }
                    (TensorCore::Wmma, ExpertFormat::Nvfp4) => {
                        let fragments = WmmaNvfp4Fragments {
                            grid,
                            words: words.to_vec(),
                            scales: scales
                                .chunks_exact(4)
                                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                                .collect(),
                            global_scale: 1.0,
                        };
                        Box::new(move |row, col| fragments.value(row, col))
                    }
                    (TensorCore::MmaSync, ExpertFormat::Bf16) => Box::new(move |row, col| {
                        bf16_fragment_value(&grid, words, row, col).to_f32()
                    }),
                    (TensorCore::Wmma, ExpertFormat::Bf16) => Box::new(move |row, col| {
                        wmma_bf16_fragment_value(&grid, words, row, col).to_f32()
                    }),
                };
                let mut out = vec![0.0f32; grid.rows * grid.cols];
                for (index, slot) in out.iter_mut().enumerate() {
                    let (row, col) = (index / grid.cols, index % grid.cols);
                    *slot = value(row, col) * alpha(row);
                }
                out
            };
        let gate_up = decode(gate_up, &self.gate_up, &self.gate_up_scales, &|row| {
            if row < i { gate_alpha } else { up_alpha }
        });
        let down = decode(down, &self.down, &self.down_scales, &|_| down_alpha);
        Ok((gate_up, down))
    }

    /// u32 words and NVFP4 scale bytes of one unit's matrix on `grid`: per (tile, group) 32
    /// lanes of 4 (NVFP4) or 16 (bf16) words and 2 scale bytes on mma.sync; 16 rows of 8
    /// (NVFP4) or 32 (bf16) words and 4 scale bytes on WMMA.
    fn unit_sizes(&self, grid: &TileGrid) -> (usize, usize) {
        let groups = grid.n_tiles * grid.k_groups;
        let (lanes, words, scale_bytes) = match (self.tensor_core, self.format) {
            (TensorCore::MmaSync, ExpertFormat::Nvfp4) => (32, 4, 2),
            (TensorCore::MmaSync, ExpertFormat::Bf16) => (32, 16, 2),
            (TensorCore::Wmma, ExpertFormat::Nvfp4) => (TILE_ROWS, 8, 4),
            (TensorCore::Wmma, ExpertFormat::Bf16) => (TILE_ROWS, GROUP_COLS / 2, 4),
        };
        (groups * lanes * words, groups * lanes * scale_bytes)
    }
}

/// The bf16 at (`row`, `col`) of a [`Bf16Fragments`] word array (the inverse of its layout:
/// lane (g, t) holds tile rows g and g + 8 at K columns 16t .. 16t + 15 of each 64-wide group;
/// MMA j takes columns 4j .. 4j + 3 of them as registers (g, c), (g + 8, c), (g, c + 2),
/// (g + 8, c + 2), two columns per register, the even one low).
fn bf16_fragment_value(grid: &TileGrid, words: &[u32], row: usize, col: usize) -> bf16 {
    let (tile, tile_row) = grid.row_order.locate(grid.rows, row);
    let (upper, g) = (tile_row >= 8, tile_row % 8);
    let (group, within) = (col / GROUP_COLS, col % GROUP_COLS);
    let (t, j) = (within / 16, (within % 16) / 4);
    let register = 2 * ((within % 4) / 2) + usize::from(upper);
    let index = grid.lane_index(tile, group, g * 4 + t);
    let word = words[Bf16Fragments::word_index(index, j, register)];
    bf16::from_bits((word >> (16 * (within % 2))) as u16)
}

/// The bf16 at (`row`, `col`) of a [`WmmaBf16Fragments`] array packed two per word by
/// [`bf16_pairs`] (per (tile, group, tile row) the row's 64 values in order).
fn wmma_bf16_fragment_value(grid: &TileGrid, words: &[u32], row: usize, col: usize) -> bf16 {
    let (tile, tile_row) = grid.row_order.locate(grid.rows, row);
    let (group, within) = (col / GROUP_COLS, col % GROUP_COLS);
    let index = ((tile * grid.k_groups + group) * TILE_ROWS + tile_row) * GROUP_COLS + within;
    bf16::from_bits((words[index / 2] >> (16 * (index % 2))) as u16)
}

/// bf16 bits two per word, the even index in the low half (the memory order of `values` on a
/// little-endian device). `values` has an even length (whole 64-wide groups).
fn bf16_pairs(values: &[u16]) -> Vec<u32> {
    values
        .chunks(2)
        .map(|pair| u32::from(pair[0]) | u32::from(pair.get(1).copied().unwrap_or(0)) << 16)
        .collect()
}

/// Scale words as their bytes in memory order (little-endian).
fn scale_bytes<T: Copy, const N: usize>(scales: &[T], to_le: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    scales.iter().flat_map(|s| to_le(*s)).collect()
}

struct ExpertPiece {
    gate_up: Vec<u32>,
    gate_up_scales: Vec<u8>,
    down: Vec<u32>,
    down_scales: Vec<u8>,
    gate_up_alpha: [f32; 2],
    down_alpha: f32,
}

/// The mma.sync NVFP4 fragments' exponent offset: a fragment value is `e2m1 * scale * 2^-7`.
const NVFP4_FRAGMENT_SCALE: f32 = 128.0;

fn expert_fragments(
    expert: &ExpertWeights,
    hidden: usize,
    inter: usize,
    tensor_core: TensorCore,
) -> Result<ExpertPiece> {
    match (expert, tensor_core) {
        (ExpertWeights::Bf16 { gate_up, down }, TensorCore::MmaSync) => Ok(ExpertPiece {
            gate_up: Bf16Fragments::new(gate_up, 2 * inter, hidden, RowOrder::GateUp)?.words,
            gate_up_scales: Vec::new(),
            down: Bf16Fragments::new(down, hidden, inter, RowOrder::Plain)?.words,
            down_scales: Vec::new(),
            gate_up_alpha: [1.0, 1.0],
            down_alpha: 1.0,
        }),
        (ExpertWeights::Bf16 { gate_up, down }, TensorCore::Wmma) => Ok(ExpertPiece {
            gate_up: bf16_pairs(
                &WmmaBf16Fragments::new(gate_up, 2 * inter, hidden, RowOrder::GateUp)?.values,
            ),
            gate_up_scales: Vec::new(),
            down: bf16_pairs(&WmmaBf16Fragments::new(down, hidden, inter, RowOrder::Plain)?.values),
            down_scales: Vec::new(),
            gate_up_alpha: [1.0, 1.0],
            down_alpha: 1.0,
        }),
        (ExpertWeights::Nvfp4 { gate, up, down }, tensor_core) => {
            // [gate; up] as one matrix: the per-tensor scales stay apart, in the alphas
            let mut packed = gate.packed.clone();
            packed.extend_from_slice(&up.packed);
            let mut scales = gate.scales.clone();
            scales.extend_from_slice(&up.scales);
            let gate_up = Nvfp4Matrix {
                rows: 2 * inter,
                cols: hidden,
                packed,
                scales,
                global_scale: 1.0,
                input_scale: None,
            };
            let (gate_up, gate_up_scales, down_words, down_scales, fragment_scale) =
                match tensor_core {
                    TensorCore::MmaSync => {
                        let gate_up = Nvfp4Fragments::new(&gate_up, RowOrder::GateUp)?;
                        let down = Nvfp4Fragments::new(down, RowOrder::Plain)?;
                        (
                            gate_up.words,
                            scale_bytes(&gate_up.scales, u16::to_le_bytes),
                            down.words,
                            scale_bytes(&down.scales, u16::to_le_bytes),
                            NVFP4_FRAGMENT_SCALE,
                        )
                    }
                    TensorCore::Wmma => {
                        let gate_up = WmmaNvfp4Fragments::new(&gate_up, RowOrder::GateUp)?;
                        let down = WmmaNvfp4Fragments::new(down, RowOrder::Plain)?;
                        (
                            gate_up.words,
                            scale_bytes(&gate_up.scales, u32::to_le_bytes),
                            down.words,
                            scale_bytes(&down.scales, u32::to_le_bytes),
                            1.0,
                        )
                    }
                };
            Ok(ExpertPiece {
                gate_up,
                gate_up_scales,
                down: down_words,
                down_scales,
                gate_up_alpha: [
                    gate.global_scale * fragment_scale,
                    up.global_scale * fragment_scale,
                ],
                down_alpha: down.global_scale * fragment_scale,
            })
        }
    }
}

/// The shared expert (`Is` columns) as `ceil(Is / I)` experts of `I` columns in the routed
/// experts' `format` (zero-padded past `Is`). An NVFP4 shared expert with bf16 routed experts is
/// decoded exactly (`e2m1 * e4m3` has at most 6 significant bits) and its per-tensor scales move
/// into the alphas, which [`split_shared_alphas`] reports.
fn split_shared(
    shared: &ExpertWeights,
    shape: MoeShape,
    format: ExpertFormat,
) -> Vec<ExpertWeights> {
    let (h, i, s) = (shape.hidden, shape.intermediate, shape.shared_intermediate);
    let count = s.div_ceil(i);
    match (shared, format) {
        (ExpertWeights::Nvfp4 { gate, up, down }, ExpertFormat::Nvfp4) => (0..count)
            .map(|c| ExpertWeights::Nvfp4 {
                gate: nvfp4_rows(gate, c * i, i),
                up: nvfp4_rows(up, c * i, i),
                down: nvfp4_columns(down, c * i, i),
            })
            .collect(),
        _ => {
            let (gate_up, down) = bf16_shared(shared);
            (0..count)
                .map(|c| {
                    let mut part = vec![bf16::ZERO; 2 * i * h];
                    for j in 0..i.min(s.saturating_sub(c * i)) {
                        let (gate_row, up_row) = (c * i + j, s + c * i + j);
                        part[j * h..(j + 1) * h]
                            .copy_from_slice(&gate_up[gate_row * h..(gate_row + 1) * h]);
                        part[(i + j) * h..(i + j + 1) * h]
                            .copy_from_slice(&gate_up[up_row * h..(up_row + 1) * h]);
                    }
                    let mut part_down = vec![bf16::ZERO; h * i];
                    for row in 0..h {
                        for j in 0..i.min(s.saturating_sub(c * i)) {
                            part_down[row * i + j] = down[row * s + c * i + j];
                        }
                    }
                    ExpertWeights::Bf16 {
                        gate_up: part,
                        down: part_down,
                    }
                })
                .collect()
        }
    }
}

/// The shared expert in bf16 `([2Is][H], [H][Is])`: as given, or NVFP4 decoded without its
/// per-tensor scales (exact in bf16; [`split_shared_alphas`] gives those scales).
fn bf16_shared(shared: &ExpertWeights) -> (Vec<bf16>, Vec<bf16>) {
    match shared {
        ExpertWeights::Bf16 { gate_up, down } => (gate_up.clone(), down.clone()),
        ExpertWeights::Nvfp4 { gate, up, down } => {
            let unscaled = |m: &Nvfp4Matrix| -> Vec<bf16> {
                let k_blocks = m.cols / BLOCK;
                (0..m.rows * m.cols)
                    .map(|index| {
                        let (row, col) = (index / m.cols, index % m.cols);
                        let byte = m.packed[index / 2];
                        let nibble = if index % 2 == 0 {
                            byte & 0xf
                        } else {
                            byte >> 4
                        };
                        let scale = e4m3_decode(m.scales[row * k_blocks + col / BLOCK]);
                        bf16::from_f32(e2m1_decode(nibble) * scale)
                    })
                    .collect()
            };
            let mut gate_up = unscaled(gate);
            gate_up.extend(unscaled(up));
            (gate_up, unscaled(down))
        }
    }
}

/// The alphas `(gate, up, down)` of every shared sub-expert of [`split_shared`]: the routed
/// format's own for a shared expert in that format; the per-tensor scales for an NVFP4 shared
/// expert decoded into bf16.
fn split_shared_alphas(shared: &ExpertWeights, format: ExpertFormat) -> Option<[f32; 3]> {
    match (shared, format) {
        (ExpertWeights::Nvfp4 { gate, up, down }, ExpertFormat::Bf16) => {
            Some([gate.global_scale, up.global_scale, down.global_scale])
        }
        _ => None,
    }
}

/// Rows `first .. first + count` of `m` (zero rows past its end).
fn nvfp4_rows(m: &Nvfp4Matrix, first: usize, count: usize) -> Nvfp4Matrix {
    let (row_bytes, row_scales) = (m.cols / 2, m.cols / BLOCK);
    let mut packed = vec![0u8; count * row_bytes];
    let mut scales = vec![E4M3_ONE; count * row_scales];
    let present = count.min(m.rows.saturating_sub(first));
    packed[..present * row_bytes]
        .copy_from_slice(&m.packed[first * row_bytes..(first + present) * row_bytes]);
    scales[..present * row_scales]
        .copy_from_slice(&m.scales[first * row_scales..(first + present) * row_scales]);
    Nvfp4Matrix {
        rows: count,
        cols: m.cols,
        packed,
        scales,
        global_scale: m.global_scale,
        input_scale: m.input_scale,
    }
}

/// Columns `first .. first + count` of `m` (multiples of 16; zero columns past its end).
fn nvfp4_columns(m: &Nvfp4Matrix, first: usize, count: usize) -> Nvfp4Matrix {
    let present = count.min(m.cols.saturating_sub(first));
    let mut packed = vec![0u8; m.rows * count / 2];
    let mut scales = vec![E4M3_ONE; m.rows * count / BLOCK];
    for row in 0..m.rows {
        let source = row * m.cols + first;
        packed[row * count / 2..(row * count + present) / 2]
            .copy_from_slice(&m.packed[source / 2..(source + present) / 2]);
        let source_block = row * (m.cols / BLOCK) + first / BLOCK;
        scales[row * count / BLOCK..(row * count + present) / BLOCK]
            .copy_from_slice(&m.scales[source_block..source_block + present / BLOCK]);
    }
    Nvfp4Matrix {
        rows: m.rows,
        cols: count,
        packed,
        scales,
        global_scale: m.global_scale,
        input_scale: m.input_scale,
    }
}

/// `f` over `items` on all cores, results in order.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = items.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| scope.spawn(|| part.iter().map(&f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}
