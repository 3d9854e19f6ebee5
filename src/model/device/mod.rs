//! The target forward on a backend's kernels: every layer through the families' launch APIs
//! (`tokens`, `norm`, `gemm`, `gdn`, `attention`, `moe`), weights and caches resident on the
//! backend, a batch of sequences decoding one token each per step, the greedy token written on
//! the device. On CUDA the whole step is captured once as a graph and replayed; nothing in a
//! step reads back to the host. The CPU backend runs the same sequence of calls on the families'
//! references (no graph), which is how CI checks the wiring against [`Model::forward`].
//!
//! Per layer and step (B rows): `norm` (residual += previous delta, input norm) -> mixer -> `norm`
//! (residual += mixer output, post-attention norm) -> `moe` (its output is the next delta). The
//! Gated DeltaNet mixer runs ONE projection GEMM (the rows `[qkv; z; b; a]` of one weight) and
//! [`gdn::step`] reads its pieces in place; attention runs q (with gate), k and v as ONE GEMM
//! where their weights stack (else three), then [`attention::prepare`] and
//! [`attention::attend`]. The residual stream stays f32; what the GEMMs read and write is bf16.
//!
//! Weights come from a loaded [`Model`] (linears and experts the checkpoint stores as NVFP4 run
//! on their codes and scales in the W4A16 kernels, the rest as bf16; the fused Gated DeltaNet
//! projection is bf16, dequantised where its parts were NVFP4) or
//! are synthetic at the real shapes ([`DeviceModel::synthetic`]): one layer of each kind is
//! generated and laid out on the host, then copied on the device into every layer of that kind,
//! so each layer streams its own buffers (no layer's weights stay in L2 for the next) and a
//! 35B-A3B-sized model is built in seconds without a host copy per layer.
//!
//! [`Decoder::prefill`] runs every prompt but its last token in one forward over all prompt rows
//! (the chunked Gated DeltaNet prefill, attention over each row's causal prefix); the last
//! tokens then go through the captured step. [`SpecDecoder`] decodes greedily with the MTP head
//! drafting `n` tokens per step (see its module). Not yet on this path: sampling.

mod generate;
mod speculative;

pub use generate::generate_greedy;
pub use speculative::{SpecDecoder, StepEvents, max_drafts};

/// Most positions a sequence of a [`Decoder`] or [`SpecDecoder`] may hold (its `capacity`): the
/// kernels index positions in 32 bits, and 4 Mi positions are far past any context the family
/// supports (Qwen3.6: 262144), so a request's arithmetic gone wrong is refused before the caches
/// are sized from it.
pub const MAX_POSITIONS: usize = 1 << 22;

/// The positions (`capacity`) a [`Decoder`] or [`SpecDecoder`] needs for a prompt of `prompt`
/// tokens followed by `steps` steps of up to `drafts + 1` tokens each, plus the `2 * drafts + 2`
/// that a speculative step's chained drafts look past its last token; `None` where that is more
/// than [`MAX_POSITIONS`] (or overflows).
pub fn decoder_capacity(prompt: usize, steps: usize, drafts: usize) -> Option<usize> {
    drafts
        .checked_add(1)
        .and_then(|width| width.checked_mul(steps))
        .and_then(|tokens| tokens.checked_add(drafts.checked_mul(2)?.checked_add(2)?))
        .and_then(|tokens| tokens.checked_add(prompt))
        .filter(|&capacity| capacity <= MAX_POSITIONS)
}

use crate::backend::{Backend, DeviceVec, Graph};
use crate::error::{Error, Result};
use crate::formats::nvfp4::Nvfp4Matrix;
use crate::kernels::Bf16Rows;
use crate::kernels::attention::reference::AttentionShape;
use crate::kernels::attention::{self, GatedAttention, KvCache, KvFormat, RopeTable};
use crate::kernels::gdn::reference::GdnShape;
use crate::kernels::gdn::{self, GdnCache, GdnParams, Projections, Sequences, StepMode};
use crate::kernels::gemm::{Epilogue, Linear, Nvfp4Mode, RowOrder, linear};
use crate::kernels::moe::reference::MoeShape;
use crate::kernels::moe::weights::{synthetic_nvfp4, uniform_bf16};
use crate::kernels::moe::{
    ExpertFormat, ExpertWeights, FusedBlock, MAX_SLOTS_PER_LAUNCH, MoeHostWeights, MoeWeights,
    MoeWorkspace, moe_block_prefetching,
};
use crate::kernels::norm::{ResidualWriter, rms_norm_residual};
use crate::kernels::tokens::{self, ArgmaxWorkspace, TokenColumn};
use crate::model::config::{LayerKind, ModelConfig};
use crate::model::forward::Model;
use crate::model::params::{
    ExpertWeights as ModelExpertWeights, HostLinear, MixerWeights, MoeWeights as ModelMoeWeights,
};
use crate::rng::SplitMix64;
use half::bf16;

/// How a synthetic model stores its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticWeights {
    /// Every weight bf16.
    Bf16,
    /// The ModelOpt NVFP4 recipe: experts, shared expert and attention projections NVFP4 (W4A16
    /// kernels); Gated DeltaNet projections, router, shared-expert gate, embeddings and lm_head
    /// bf16.
    Nvfp4,
}

impl SyntheticWeights {
    /// The roofline's storage of the same recipe (what a step of this model must read).
    pub fn precision(self) -> crate::roofline::Precision {
        match self {
            Self::Bf16 => crate::roofline::Precision::Bf16,
            Self::Nvfp4 => crate::roofline::Precision::Nvfp4,
        }
    }
}

/// A model's weights on a backend, in the layouts the kernels consume.
pub struct DeviceModel {
    backend: Backend,
    config: ModelConfig,
    /// `[V][H]` bf16.
    embed: DeviceVec<bf16>,
    layers: Vec<DeviceLayer>,
    final_norm: DeviceVec<f32>,
    lm_head: Linear,
    mtp: Option<DeviceMtp>,
    /// How the decoders' KV caches store keys and values (the target's and the MTP head's).
    kv_format: KvFormat,
}

/// The MTP head: `x = fc([norm_e(embed(t)); norm_h(hidden)])` as two GEMMs over the halves of
/// `fc`'s columns (the second adds the first's output in its epilogue, so the concatenation
/// is never materialised), then its decoder layers (full attention and MoE, caches of their
/// own), then `norm`; the logits come from the target's lm_head.
struct DeviceMtp {
    pre_fc_norm_embedding: DeviceVec<f32>,
    pre_fc_norm_hidden: DeviceVec<f32>,
    /// `fc[:, :H]`, `[H][H]`.
    fc_embedding: Linear,
    /// `fc[:, H:]`, `[H][H]`.
    fc_hidden: Linear,
    layers: Vec<DeviceLayer>,
    norm: DeviceVec<f32>,
}

struct DeviceLayer {
    input_norm: DeviceVec<f32>,
    post_attention_norm: DeviceVec<f32>,
    mixer: DeviceMixer,
    moe: MoeWeights,
}

// one per layer (40 in the model): the variants' size difference costs nothing worth a box
#[allow(clippy::large_enum_variant)]
enum DeviceMixer {
    Gdn {
        /// Rows `[qkv; z; b; a]` (zero rows pad the total to a multiple of 8: gdn reads the
        /// qkv rows with 16-byte loads).
        in_proj: Linear,
        params: GdnParams,
        out: Linear,
    },
    Attention {
        qkv: QkvProjection,
        o: Linear,
        q_norm: DeviceVec<f32>,
        k_norm: DeviceVec<f32>,
    },
}

/// An attention layer's q, k and v projections.
// one per attention layer (10 in the model): the variants' size difference costs nothing worth a box
#[allow(clippy::large_enum_variant)]
enum QkvProjection {
    /// One `[q; k; v]` weight: one GEMM writes each row's `[q_gate | k | v]`
    /// ([`attention::Projections::fused`]). Where the three share a format and, NVFP4, one
    /// per-tensor scale ([`Nvfp4Matrix::stack_rows`]), as ModelOpt and `fp4spec quantize`
    /// export them. The k and v launches cost about 2.8 us each at B = 1, 20 a step; one
    /// launch took the step 0.9% shorter at B = 1 and 2.5% at B = 64 (H100, BENCHMARKS.md,
    /// thirty-third session).
    Fused(Linear),
    /// Three weights, three GEMMs: NVFP4 linears whose per-tensor (or input) scales differ,
    /// which one launch could only multiply exactly with an alpha per tile, or a mix of NVFP4
    /// and bf16 linears.
    Separate { q: Linear, k: Linear, v: Linear },
}

impl QkvProjection {
    /// The projections of `a` on `backend`, fused where they can be, NVFP4 ones in `mode`.
    fn new(
        backend: &Backend,
        a: &crate::model::params::AttentionWeights,
        mode: Nvfp4Mode,
    ) -> Result<Self> {
        let parts = [&a.q, &a.k, &a.v];
        let nvfp4: Option<Vec<&Nvfp4Matrix>> = parts.iter().map(|l| l.nvfp4.as_ref()).collect();
        if let Some(matrices) = nvfp4 {
            if let Some(stacked) = Nvfp4Matrix::stack_rows(&matrices) {
                return Ok(Self::Fused(Linear::nvfp4_in(
                    backend,
                    &stacked,
                    RowOrder::Plain,
                    mode,
                )?));
            }
        } else if parts.iter().all(|l| l.nvfp4.is_none()) {
            let rows = parts.iter().map(|l| l.rows).sum();
            let values: Vec<bf16> = parts.iter().flat_map(|l| to_bf16(&l.weight)).collect();
            return Ok(Self::Fused(Linear::bf16(
                backend,
                &values,
                rows,
                a.q.cols,
                RowOrder::Plain,
            )?));
        }
        Ok(Self::Separate {
            q: device_linear(backend, &a.q, mode)?,
            k: device_linear(backend, &a.k, mode)?,
            v: device_linear(backend, &a.v, mode)?,
        })
    }

    fn try_clone(&self, backend: &Backend) -> Result<Self> {
        Ok(match self {
            Self::Fused(qkv) => Self::Fused(qkv.try_clone(backend)?),
            Self::Separate { q, k, v } => Self::Separate {
                q: q.try_clone(backend)?,
                k: k.try_clone(backend)?,
                v: v.try_clone(backend)?,
            },
        })
    }

    /// The weight the layer's first launch streams (the next-layer prefetch asks the L2 for it).
    fn first(&self) -> &Linear {
        match self {
            Self::Fused(qkv) => qkv,
            Self::Separate { q, .. } => q,
        }
    }

    /// Weight bytes one call streams.
    fn weight_bytes(&self) -> u64 {
        match self {
            Self::Fused(qkv) => qkv.weight_bytes(),
            Self::Separate { q, k, v } => q.weight_bytes() + k.weight_bytes() + v.weight_bytes(),
        }
    }
}

impl DeviceMixer {
    fn try_clone(&self, backend: &Backend) -> Result<Self> {
        Ok(match self {
            Self::Gdn {
                in_proj,
                params,
                out,
            } => Self::Gdn {
                in_proj: in_proj.try_clone(backend)?,
                params: params.try_clone(backend)?,
                out: out.try_clone(backend)?,
            },
            Self::Attention {
                qkv,
                o,
                q_norm,
                k_norm,
            } => Self::Attention {
                qkv: qkv.try_clone(backend)?,
                o: o.try_clone(backend)?,
                q_norm: backend.duplicate(q_norm)?,
                k_norm: backend.duplicate(k_norm)?,
            },
        })
    }
}

/// The Gated DeltaNet head shape of `config`.
fn gdn_shape(config: &ModelConfig) -> GdnShape {
    GdnShape {
        key_heads: config.linear_num_key_heads,
        value_heads: config.linear_num_value_heads,
        dk: config.linear_key_head_dim,
        dv: config.linear_value_head_dim,
    }
}

/// The full-attention head shape of `config`.
fn attention_shape(config: &ModelConfig) -> AttentionShape {
    AttentionShape {
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
    }
}

/// The MoE block shape of `config`.
fn moe_shape(config: &ModelConfig) -> MoeShape {
    MoeShape {
        experts: config.num_experts,
        top_k: config.num_experts_per_tok,
        hidden: config.hidden_size,
        intermediate: config.moe_intermediate_size,
        shared_intermediate: config.shared_expert_intermediate_size,
    }
}

/// Rows of the fused Gated DeltaNet input projection before padding: `[qkv; z; b; a]`.
fn gdn_projection_rows(config: &ModelConfig) -> usize {
    let s = gdn_shape(config);
    config.linear_conv_dim() + s.value_heads * s.dv + 2 * s.value_heads
}

fn to_bf16(values: &[f32]) -> Vec<bf16> {
    values.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// The linear as the checkpoint stores it: its NVFP4 codes and scales (multiplied in `nvfp4`)
/// where it is NVFP4, else bf16.
fn device_linear(backend: &Backend, w: &HostLinear, nvfp4: Nvfp4Mode) -> Result<Linear> {
    match &w.nvfp4 {
        Some(matrix) => Linear::nvfp4_in(backend, matrix, RowOrder::Plain, nvfp4),
        None => Linear::bf16(
            backend,
            &to_bf16(&w.weight),
            w.rows,
            w.cols,
            RowOrder::Plain,
        ),
    }
}

/// A MoE block's weights as the checkpoint stores them: NVFP4 experts when every routed expert
/// and the shared expert were loaded from NVFP4 tensors, else every expert bf16.
fn moe_host_weights(config: &ModelConfig, m: &ModelMoeWeights) -> Result<MoeHostWeights> {
    let shape = moe_shape(config);
    let has_shared = shape.shared_intermediate > 0;
    let nvfp4 = |e: &ModelExpertWeights| {
        e.nvfp4
            .as_ref()
            .map(|[gate, up, down]| ExpertWeights::Nvfp4 {
                gate: gate.clone(),
                up: up.clone(),
                down: down.clone(),
            })
    };
    let experts: Option<Vec<ExpertWeights>> = m.experts.iter().map(nvfp4).collect();
    let shared = if has_shared {
        nvfp4(&m.shared).map(Some)
    } else {
        Some(None)
    };
    if let (Some(experts), Some(shared)) = (experts, shared) {
        let host = MoeHostWeights {
            shape,
            router: to_bf16(&m.router),
            shared_gate: has_shared.then(|| to_bf16(&m.shared_gate)),
            experts,
            shared,
        };
        host.check()?;
        return Ok(host);
    }
    let gate_up: Vec<f32> = m.experts.iter().flat_map(|e| e.gate_up.clone()).collect();
    let down: Vec<f32> = m.experts.iter().flat_map(|e| e.down.clone()).collect();
    MoeHostWeights::from_fused(
        shape,
        &FusedBlock {
            router: &m.router,
            shared_gate: has_shared.then_some(m.shared_gate.as_slice()),
            gate_up: &gate_up,
            down: &down,
            shared: has_shared.then_some((m.shared.gate_up.as_slice(), m.shared.down.as_slice())),
        },
    )
}

/// One decoder layer of a loaded model on `backend` (target or MTP): linears the checkpoint
/// stores as NVFP4 as NVFP4, the Gated DeltaNet projections fused into one bf16 weight.
fn device_layer(
    backend: &Backend,
    config: &ModelConfig,
    layer: &crate::model::params::LayerWeights,
    nvfp4: Nvfp4Mode,
) -> Result<DeviceLayer> {
    let (h, eps) = (config.hidden_size, config.rms_norm_eps as f32);
    let mixer = match &layer.mixer {
        MixerWeights::Gdn(g) => {
            let mut rows = Vec::new();
            for part in [&g.qkv, &g.z, &g.b, &g.a] {
                rows.extend_from_slice(&part.weight);
            }
            let count = gdn_projection_rows(config);
            let padded = count.next_multiple_of(8);
            rows.resize(padded * h, 0.0);
            DeviceMixer::Gdn {
                in_proj: Linear::bf16(backend, &to_bf16(&rows), padded, h, RowOrder::Plain)?,
                params: GdnParams::upload(
                    backend,
                    gdn_shape(config),
                    config.linear_conv_kernel_dim,
                    &g.conv,
                    &g.a_log,
                    &g.dt_bias,
                    &g.norm,
                    eps,
                )?,
                out: device_linear(backend, &g.out, nvfp4)?,
            }
        }
        MixerWeights::Attention(a) => DeviceMixer::Attention {
            qkv: QkvProjection::new(backend, a, nvfp4)?,
            o: device_linear(backend, &a.o, nvfp4)?,
            q_norm: backend.upload(&a.q_norm)?,
            k_norm: backend.upload(&a.k_norm)?,
        },
    };
    let host = moe_host_weights(config, &layer.moe)?;
    Ok(DeviceLayer {
        input_norm: backend.upload(&layer.input_norm)?,
        post_attention_norm: backend.upload(&layer.post_attention_norm)?,
        mixer,
        moe: MoeWeights::new(backend, &host)?,
    })
}

/// The MTP `fc` (`[H][2H]`, input `[embedding; hidden]`) as its two `[H][H]` halves, bf16.
fn split_fc(backend: &Backend, fc: &HostLinear, h: usize) -> Result<(Linear, Linear)> {
    if fc.rows != h || fc.cols != 2 * h {
        return Err(Error::invalid(
            "mtp.fc",
            format!(
                "[{}, {}] where [{h}, {}] was expected",
                fc.rows,
                fc.cols,
                2 * h
            ),
        ));
    }
    let half = |first: usize| -> Vec<bf16> {
        fc.weight
            .chunks_exact(2 * h)
            .flat_map(|row| row[first..first + h].iter().map(|&v| bf16::from_f32(v)))
            .collect()
    };
    Ok((
        Linear::bf16(backend, &half(0), h, h, RowOrder::Plain)?,
        Linear::bf16(backend, &half(h), h, h, RowOrder::Plain)?,
    ))
}

/// Checks what the device path assumes of a config.
fn check_config(config: &ModelConfig) -> Result<()> {
    if !config.attn_output_gate {
        return Err(Error::invalid(
            "model config attn_output_gate",
            "false: the attention kernels apply the output gate of Qwen3.5/3.6 (true)",
        ));
    }
    if config.layer_types.is_empty() {
        return Err(Error::invalid("model config layer_types", "no layers"));
    }
    Ok(())
}

impl DeviceModel {
    /// Puts `model`'s weights (the target's and its MTP head's) on `backend`: linears and
    /// experts stored as NVFP4 (separate per-expert tensors for experts) as NVFP4, multiplied
    /// as W4A16, the rest as bf16.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a config the kernels do not take (no output gate, head or expert
    /// shapes outside the families' ranges); [`Error::Cuda`] / [`Error::Hip`] when an upload
    /// fails.
    pub fn from_model(backend: &Backend, model: &Model) -> Result<Self> {
        Self::from_model_with(backend, model, Nvfp4Mode::W4a16)
    }

    /// [`DeviceModel::from_model`] with the model's NVFP4 linears (the attention projections,
    /// and any other dense linear stored as NVFP4) multiplied in `nvfp4`: the per-model choice
    /// between W4A16 and W4A4 (activations quantised to NVFP4 with each linear's checkpoint
    /// `input_scale`, the block-scaled FP4 MMA of GB10; the CPU backend emulates it exactly).
    /// The experts stay W4A16: the MoE kernels have no W4A4 form.
    ///
    /// # Errors
    /// As [`DeviceModel::from_model`], and [`Error::Invalid`] for W4A4 where an NVFP4 linear has
    /// no `input_scale` or the device's target has no block-scaled FP4 MMA (sm_90a, gfx1151).
    pub fn from_model_with(backend: &Backend, model: &Model, nvfp4: Nvfp4Mode) -> Result<Self> {
        let config = &model.config;
        check_config(config)?;
        let w = &model.weights;
        let h = config.hidden_size;
        let layers = w
            .layers
            .iter()
            .map(|layer| device_layer(backend, config, layer, nvfp4))
            .collect::<Result<Vec<_>>>()?;
        let mtp = w
            .mtp
            .as_ref()
            .map(|m| -> Result<DeviceMtp> {
                let (fc_embedding, fc_hidden) = split_fc(backend, &m.fc, h)?;
                Ok(DeviceMtp {
                    pre_fc_norm_embedding: backend.upload(&m.pre_fc_norm_embedding)?,
                    pre_fc_norm_hidden: backend.upload(&m.pre_fc_norm_hidden)?,
                    fc_embedding,
                    fc_hidden,
                    layers: m
                        .layers
                        .iter()
                        .map(|layer| device_layer(backend, config, layer, nvfp4))
                        .collect::<Result<Vec<_>>>()?,
                    norm: backend.upload(&m.norm)?,
                })
            })
            .transpose()?;
        Ok(Self {
            backend: backend.clone(),
            config: config.clone(),
            embed: backend.upload(&to_bf16(&w.embed))?,
            layers,
            final_norm: backend.upload(&w.final_norm)?,
            lm_head: device_linear(backend, &w.lm_head, nvfp4)?,
            mtp,
            kv_format: KvFormat::Bf16,
        })
    }

    /// Random weights with `config`'s shapes and `weights`' storage, reproducible from `seed`
    /// (exact for bandwidth and compute, meaningless as a language model): linears of RMS
    /// `1 / sqrt(K)`, norm weights near 0 (zero-centred), GDN gates in their usual ranges. One
    /// layer of each kind is generated on the host and copied on the device into every other
    /// layer of that kind; the embedding table repeats a block of 4096 random rows. NVFP4
    /// attention projections multiply in `nvfp4` (W4A4 with the quantiser's default
    /// `input_scale` of 1.0, as [`DeviceModel::from_model_with`]).
    ///
    /// # Errors
    /// As [`DeviceModel::from_model_with`], and [`Error::Invalid`] for W4A4 with bf16 weights
    /// (nothing NVFP4 to multiply); [`Error::Cuda`] also when the device runs out of memory
    /// (Qwen3.6-35B-A3B needs about 22 GB as NVFP4 and 70 GB as bf16).
    pub fn synthetic(
        backend: &Backend,
        config: &ModelConfig,
        weights: SyntheticWeights,
        nvfp4: Nvfp4Mode,
        seed: u64,
    ) -> Result<Self> {
        check_config(config)?;
        if weights == SyntheticWeights::Bf16 && nvfp4 == Nvfp4Mode::W4a4 {
            return Err(Error::invalid(
                "synthetic weights",
                "W4A4 multiplies NVFP4 linears, and bf16 weights have none",
            ));
        }
        let mut rng = SplitMix64::new(seed);
        let (h, eps) = (config.hidden_size, config.rms_norm_eps as f32);
        let small = |rng: &mut SplitMix64, len: usize, scale: f32| -> Vec<f32> {
            (0..len)
                .map(|_| (2.0 * rng.uniform() - 1.0) * scale)
                .collect()
        };
        let dense = |rng: &mut SplitMix64, rows: usize, cols: usize| -> Result<Linear> {
            let values = uniform_bf16(rng, rows * cols, 1.0 / (cols as f32).sqrt());
            Linear::bf16(backend, &values, rows, cols, RowOrder::Plain)
        };
        let projection = |rng: &mut SplitMix64, rows: usize, cols: usize| -> Result<Linear> {
            match weights {
                SyntheticWeights::Bf16 => dense(rng, rows, cols),
                SyntheticWeights::Nvfp4 => {
                    let mut matrix: Nvfp4Matrix =
                        synthetic_nvfp4(rng, rows, cols, 1.0 / (cols as f32).sqrt());
                    // the quantiser's default (checkpoint::quantize): amax 6 * 448
                    matrix.input_scale = Some(1.0);
                    Linear::nvfp4_in(backend, &matrix, RowOrder::Plain, nvfp4)
                }
            }
        };
        let norm = |rng: &mut SplitMix64, len: usize| -> Result<DeviceVec<f32>> {
            backend.upload(&small(rng, len, 0.1))
        };

        let gdn = gdn_shape(config);
        let gdn_template = if config.layer_types.contains(&LayerKind::LinearAttention) {
            let rows = gdn_projection_rows(config).next_multiple_of(8);
            let conv = small(
                &mut rng,
                config.linear_conv_dim() * config.linear_conv_kernel_dim,
                0.5,
            );
            // A = exp(A_log) in 1 .. 16 and dt_bias near 0: decays of a real checkpoint's range
            let a_log: Vec<f32> = (0..gdn.value_heads)
                .map(|_| rng.uniform() * 16f32.ln())
                .collect();
            let dt_bias = small(&mut rng, gdn.value_heads, 1.0);
            let norm_weight: Vec<f32> = (0..gdn.dv).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
            Some(DeviceMixer::Gdn {
                in_proj: dense(&mut rng, rows, h)?,
                params: GdnParams::upload(
                    backend,
                    gdn,
                    config.linear_conv_kernel_dim,
                    &conv,
                    &a_log,
                    &dt_bias,
                    &norm_weight,
                    eps,
                )?,
                out: dense(&mut rng, h, gdn.value_heads * gdn.dv)?,
            })
        } else {
            None
        };
        let att = attention_shape(config);
        let attention_template = if config.layer_types.contains(&LayerKind::FullAttention) {
            // one [q; k; v] weight, as a ModelOpt checkpoint's q, k and v fuse
            Some(DeviceMixer::Attention {
                qkv: QkvProjection::Fused(projection(&mut rng, att.projection_width(), h)?),
                o: projection(&mut rng, h, att.heads * att.head_dim)?,
                q_norm: norm(&mut rng, att.head_dim)?,
                k_norm: norm(&mut rng, att.head_dim)?,
            })
        } else {
            None
        };
        let format = match weights {
            SyntheticWeights::Bf16 => ExpertFormat::Bf16,
            SyntheticWeights::Nvfp4 => ExpertFormat::Nvfp4,
        };
        let moe_template = MoeWeights::new(
            backend,
            &MoeHostWeights::synthetic(moe_shape(config), format, rng.next_u64()),
        )?;

        let mut layers = Vec::with_capacity(config.layer_types.len());
        for kind in &config.layer_types {
            let template = match kind {
                LayerKind::LinearAttention => gdn_template.as_ref(),
                LayerKind::FullAttention => attention_template.as_ref(),
            };
            let mixer = template
                .ok_or_else(|| {
                    Error::invalid("synthetic model", "a layer kind without a template")
                })?
                .try_clone(backend)?;
            layers.push(DeviceLayer {
                input_norm: norm(&mut rng, h)?,
                post_attention_norm: norm(&mut rng, h)?,
                mixer,
                moe: moe_template.try_clone(backend)?,
            });
        }

        // the MTP head in bf16 (ModelOpt leaves it unquantised): full-attention layers with
        // bf16 experts
        let mtp = if config.mtp_num_hidden_layers > 0 {
            let moe = match weights {
                SyntheticWeights::Bf16 => moe_template.try_clone(backend)?,
                SyntheticWeights::Nvfp4 => MoeWeights::new(
                    backend,
                    &MoeHostWeights::synthetic(
                        moe_shape(config),
                        ExpertFormat::Bf16,
                        rng.next_u64(),
                    ),
                )?,
            };
            let mut layers = Vec::with_capacity(config.mtp_num_hidden_layers);
            for _ in 0..config.mtp_num_hidden_layers {
                layers.push(DeviceLayer {
                    input_norm: norm(&mut rng, h)?,
                    post_attention_norm: norm(&mut rng, h)?,
                    mixer: DeviceMixer::Attention {
                        qkv: QkvProjection::Fused(dense(&mut rng, att.projection_width(), h)?),
                        o: dense(&mut rng, h, att.heads * att.head_dim)?,
                        q_norm: norm(&mut rng, att.head_dim)?,
                        k_norm: norm(&mut rng, att.head_dim)?,
                    },
                    moe: moe.try_clone(backend)?,
                });
            }
            Some(DeviceMtp {
                pre_fc_norm_embedding: norm(&mut rng, h)?,
                pre_fc_norm_hidden: norm(&mut rng, h)?,
                fc_embedding: dense(&mut rng, h, h)?,
                fc_hidden: dense(&mut rng, h, h)?,
                layers,
                norm: norm(&mut rng, h)?,
            })
        } else {
            None
        };

        let vocab = config.vocab_size;
        let block_rows = vocab.min(4096);
        let block = uniform_bf16(&mut rng, block_rows * h, 1.0);
        let embed: Vec<bf16> = block.iter().copied().cycle().take(vocab * h).collect();
        Ok(Self {
            backend: backend.clone(),
            config: config.clone(),
            embed: backend.upload(&embed)?,
            layers,
            final_norm: norm(&mut rng, h)?,
            lm_head: dense(&mut rng, vocab, h)?,
            mtp,
            kv_format: KvFormat::Bf16,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Whether the model has an MTP head (speculative decoding needs one).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// How the KV caches of decoders made from now on store keys and values (bf16 unless set).
    pub fn kv_format(&self) -> KvFormat {
        self.kv_format
    }

    /// Sets the KV cache format of decoders made from now on ([`KvFormat::Fp8E4m3`]: half the
    /// cache bytes; the same scales for every layer).
    pub fn set_kv_format(&mut self, format: KvFormat) {
        self.kv_format = format;
    }

    /// The attention layers (the target's and the MTP head's) whose q, k and v run as one
    /// GEMM, and all attention layers: `(stacked, total)`.
    pub fn stacked_qkv_layers(&self) -> (usize, usize) {
        let mtp_layers = self.mtp.iter().flat_map(|m| &m.layers);
        self.layers
            .iter()
            .chain(mtp_layers)
            .fold((0, 0), |(stacked, total), l| match &l.mixer {
                DeviceMixer::Attention { qkv, .. } => (
                    stacked + usize::from(matches!(qkv, QkvProjection::Fused(_))),
                    total + 1,
                ),
                DeviceMixer::Gdn { .. } => (stacked, total),
            })
    }

    /// Weight bytes one decode step of `tokens` rows streams at least, with `distinct_experts`
    /// routed experts per layer: every dense weight once (the embedding table only for the
    /// `tokens` rows read), the chosen experts, the shared expert and the router.
    pub fn weight_bytes(&self, tokens: usize, distinct_experts: usize) -> u64 {
        let h = self.config.hidden_size as u64;
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                let mixer = match &l.mixer {
                    DeviceMixer::Gdn { in_proj, out, .. } => {
                        in_proj.weight_bytes() + out.weight_bytes()
                    }
                    DeviceMixer::Attention { qkv, o, .. } => qkv.weight_bytes() + o.weight_bytes(),
                };
                mixer + l.moe.block_bytes(distinct_experts, 0)
            })
            .sum();
        layers + self.lm_head.weight_bytes() + 2 * h * tokens as u64
    }
}

/// The activations of one forward over `rows` rows (a decode step's B rows, or a prefill's
/// prompt rows) and the attention rows and scratch sized for them: allocated once per decoder for
/// the step (its captured graph holds these buffers), once per call for a prefill.
struct Activations {
    rows: usize,
    residual: DeviceVec<f32>,
    normed: DeviceVec<bf16>,
    delta: DeviceVec<bf16>,
    gdn_projections: DeviceVec<bf16>,
    gdn_out: DeviceVec<bf16>,
    /// `[rows][q_gate | k | v]` ([`QkvProjection::Fused`]).
    qkv: DeviceVec<bf16>,
    /// The outputs of [`QkvProjection::Separate`]'s three GEMMs, q_gate, k and v, where a
    /// layer has it.
    separate_qkv: Option<[DeviceVec<bf16>; 3]>,
    q: DeviceVec<f32>,
    attention_out: DeviceVec<bf16>,
    /// Each row's sequence slot and position.
    attention_rows: attention::Rows,
    attention_workspace: attention::Workspace,
}

impl Activations {
    /// Buffers for the rows of `slots` (each row's sequence) at `positions` of `model` (its
    /// layers and its MTP head's), over caches of `capacity` positions.
    fn new(model: &DeviceModel, capacity: usize, slots: &[u32], positions: &[u32]) -> Result<Self> {
        let (backend, config) = (&model.backend, &model.config);
        let rows = slots.len();
        let h = config.hidden_size;
        let (gdn, att) = (gdn_shape(config), attention_shape(config));
        let (stacked, attention_layers) = model.stacked_qkv_layers();
        let separate_qkv = if stacked < attention_layers {
            Some([
                backend.zeros(rows * att.q_gate_width())?,
                backend.zeros(rows * att.kv_width())?,
                backend.zeros(rows * att.kv_width())?,
            ])
        } else {
            None
        };
        Ok(Self {
            rows,
            residual: backend.zeros(rows * h)?,
            normed: backend.zeros(rows * h)?,
            delta: backend.zeros(rows * h)?,
            gdn_projections: backend
                .zeros(rows * gdn_projection_rows(config).next_multiple_of(8))?,
            gdn_out: backend.zeros(rows * gdn.value_heads * gdn.dv)?,
            qkv: backend.zeros(rows * att.projection_width())?,
            separate_qkv,
            q: backend.zeros(rows * att.heads * att.head_dim)?,
            attention_out: backend.zeros(rows * att.heads * att.head_dim)?,
            attention_rows: attention::Rows {
                count: rows,
                slot: backend.upload(slots)?,
                position: backend.upload(positions)?,
            },
            attention_workspace: attention::Workspace::new(backend, att, rows, capacity)?,
        })
    }
}

/// How the Gated DeltaNet layers of a forward run.
enum GdnForward<'a> {
    /// `tokens` tokens per sequence ([`gdn::step`]): a decode step (1, [`StepMode::Decode`]) or
    /// a speculative verify step (the pending token and the drafts, [`StepMode::Verify`]).
    Step { tokens: usize, mode: StepMode },
    /// Each sequence's rows `cu_seqlens[b]..cu_seqlens[b + 1]` ([`gdn::prefill`]).
    Prefill {
        workspace: &'a mut gdn::ChunkWorkspace,
        cu_seqlens: &'a [u32],
    },
}

/// The caches every forward of a decoder shares.
struct Caches {
    gdn: Vec<GdnCache>,
    kv: Vec<KvCache>,
    sequences: Sequences,
    rope: RopeTable,
}

impl Caches {
    /// Empty caches of `model`'s layers for `batch` sequences of up to `capacity` tokens, each
    /// step taking up to `step_tokens` tokens per sequence (1 to decode, n + 1 to verify).
    fn new(model: &DeviceModel, batch: usize, capacity: usize, step_tokens: usize) -> Result<Self> {
        let (backend, config) = (&model.backend, &model.config);
        let (gdn, att) = (gdn_shape(config), attention_shape(config));
        let (mut gdn_caches, mut kv_caches) = (Vec::new(), Vec::new());
        for layer in &model.layers {
            match &layer.mixer {
                DeviceMixer::Gdn { params, .. } => gdn_caches.push(GdnCache::new(
                    backend,
                    gdn,
                    params.kernel(),
                    batch,
                    step_tokens,
                )?),
                DeviceMixer::Attention { .. } => kv_caches.push(KvCache::new(
                    backend,
                    att,
                    batch,
                    capacity,
                    model.kv_format,
                )?),
            }
        }
        let slots: Vec<u32> = (0..batch as u32).collect();
        Ok(Self {
            gdn: gdn_caches,
            kv: kv_caches,
            sequences: Sequences::new(backend, &slots, &vec![0; batch])?,
            rope: RopeTable::new(backend, config.rotary_dim(), config.rope_theta, capacity)?,
        })
    }
}

/// Every layer over `act`'s rows, from its residual (the embeddings) to the last MoE block's
/// output in `act.delta` (not yet added to the residual).
fn run_layers(
    model: &DeviceModel,
    act: &mut Activations,
    caches: &mut Caches,
    moe_workspace: &mut MoeWorkspace,
    mut gdn_forward: GdnForward<'_>,
) -> Result<()> {
    let (mut gdn_index, mut kv_index) = (0, 0);
    for (i, layer) in model.layers.iter().enumerate() {
        let cache = match &layer.mixer {
            DeviceMixer::Gdn { .. } => {
                gdn_index += 1;
                LayerCache::Gdn(&mut caches.gdn[gdn_index - 1])
            }
            DeviceMixer::Attention { .. } => {
                kv_index += 1;
                LayerCache::Kv(&mut caches.kv[kv_index - 1])
            }
        };
        let shared = SharedCaches {
            sequences: &caches.sequences,
            rope: &caches.rope,
        };
        // the next layer's first dense weight (the lm_head after the last), which the MoE
        // block's route launch asks the L2 for
        let next = match model.layers.get(i + 1).map(|l| &l.mixer) {
            Some(DeviceMixer::Gdn { in_proj, .. }) => in_proj,
            Some(DeviceMixer::Attention { qkv, .. }) => qkv.first(),
            None => &model.lm_head,
        };
        run_layer(
            model,
            layer,
            act,
            cache,
            shared,
            moe_workspace,
            &mut gdn_forward,
            i > 0,
            next.weight_words(),
        )?;
    }
    Ok(())
}

/// The target model from tokens to logits over `act`'s rows: the embeddings of the tokens
/// `column` names in `tokens`, every layer, the final norm into `hidden` (bf16 `[rows][H]`, what
/// the lm_head and the MTP head read) and the lm_head into `logits` (bf16 `[rows][V]`).
#[allow(clippy::too_many_arguments)]
fn target_logits(
    model: &DeviceModel,
    tokens: &DeviceVec<u32>,
    column: TokenColumn,
    act: &mut Activations,
    caches: &mut Caches,
    moe_workspace: &mut MoeWorkspace,
    gdn_forward: GdnForward<'_>,
    hidden: &mut DeviceVec<bf16>,
    logits: &mut DeviceVec<bf16>,
) -> Result<()> {
    let (backend, config) = (&model.backend, &model.config);
    let rows = act.rows;
    tokens::embed(
        backend,
        tokens,
        column,
        &model.embed,
        config.hidden_size,
        &mut act.residual,
    )?;
    run_layers(model, act, caches, moe_workspace, gdn_forward)?;
    rms_norm_residual(
        backend,
        &mut act.residual,
        ResidualWriter::Earlier,
        Some(&act.delta),
        &model.final_norm,
        config.rms_norm_eps as f32,
        hidden,
        rows,
    )?;
    linear(
        backend,
        hidden,
        rows,
        &model.lm_head,
        Epilogue::None,
        logits,
    )
}

/// The cache of one layer's token mixer.
enum LayerCache<'a> {
    Gdn(&'a mut GdnCache),
    Kv(&'a mut KvCache),
}

/// What every layer of a forward reads besides its own cache.
#[derive(Clone, Copy)]
struct SharedCaches<'a> {
    sequences: &'a Sequences,
    rope: &'a RopeTable,
}

/// One decoder layer over `act`'s rows: the residual takes the previous layer's delta (when
/// `add_delta`), then `residual += mixer(norm(residual))`, and the MoE block of the
/// post-attention norm goes to `act.delta`.
#[allow(clippy::too_many_arguments)]
fn run_layer(
    model: &DeviceModel,
    layer: &DeviceLayer,
    act: &mut Activations,
    cache: LayerCache<'_>,
    shared: SharedCaches<'_>,
    moe_workspace: &mut MoeWorkspace,
    gdn_forward: &mut GdnForward<'_>,
    add_delta: bool,
    next_weights: Option<&DeviceVec<u32>>,
) -> Result<()> {
    let (backend, config) = (&model.backend, &model.config);
    let (b, eps) = (act.rows, config.rms_norm_eps as f32);
    let gdn = gdn_shape(config);
    let att = attention_shape(config);
    let delta = add_delta.then_some(&act.delta);
    // the first layer's residual is the embedding gather's, just before; a later layer's was
    // last written by the norm before the previous MoE block
    let written_by = if add_delta {
        ResidualWriter::Earlier
    } else {
        ResidualWriter::PreviousKernel
    };
    rms_norm_residual(
        backend,
        &mut act.residual,
        written_by,
        delta,
        &layer.input_norm,
        eps,
        &mut act.normed,
        b,
    )?;
    match (&layer.mixer, cache) {
        (
            DeviceMixer::Gdn {
                in_proj,
                params,
                out,
            },
            LayerCache::Gdn(cache),
        ) => {
            linear(
                backend,
                &act.normed,
                b,
                in_proj,
                Epilogue::None,
                &mut act.gdn_projections,
            )?;
            let width = in_proj.out_features();
            let (conv_dim, value_dim) = (config.linear_conv_dim(), gdn.value_heads * gdn.dv);
            let at = |offset: usize| Bf16Rows {
                data: &act.gdn_projections,
                offset,
                stride: width,
            };
            let inputs = Projections {
                qkv: at(0),
                z: Some(at(conv_dim)),
                b: at(conv_dim + value_dim),
                a: at(conv_dim + value_dim + gdn.value_heads),
            };
            match gdn_forward {
                GdnForward::Step { tokens, mode } => gdn::step(
                    backend,
                    params,
                    cache,
                    shared.sequences,
                    *tokens,
                    &inputs,
                    *mode,
                    &mut act.gdn_out,
                )?,
                GdnForward::Prefill {
                    workspace,
                    cu_seqlens,
                } => gdn::prefill(
                    backend,
                    params,
                    cache,
                    workspace,
                    shared.sequences,
                    cu_seqlens,
                    &inputs,
                    &mut act.gdn_out,
                )?,
            }
            linear(
                backend,
                &act.gdn_out,
                b,
                out,
                Epilogue::None,
                &mut act.delta,
            )?;
        }
        (
            DeviceMixer::Attention {
                qkv,
                o,
                q_norm,
                k_norm,
            },
            LayerCache::Kv(cache),
        ) => {
            let projections = match qkv {
                QkvProjection::Fused(qkv) => {
                    linear(backend, &act.normed, b, qkv, Epilogue::None, &mut act.qkv)?;
                    attention::Projections::fused(att, &act.qkv)
                }
                QkvProjection::Separate { q, k, v } => {
                    let Some([q_gate, k_out, v_out]) = &mut act.separate_qkv else {
                        return Err(Error::invalid(
                            "decoder activations",
                            "made for a model without separate q, k and v projections",
                        ));
                    };
                    linear(backend, &act.normed, b, q, Epilogue::None, q_gate)?;
                    linear(backend, &act.normed, b, k, Epilogue::None, k_out)?;
                    linear(backend, &act.normed, b, v, Epilogue::None, v_out)?;
                    attention::Projections::separate(att, q_gate, k_out, v_out)
                }
            };
            attention::prepare(
                backend,
                &GatedAttention {
                    shape: att,
                    q_norm,
                    k_norm,
                    eps,
                    rope: shared.rope,
                },
                &projections,
                &act.attention_rows,
                cache,
                &mut act.q,
            )?;
            attention::attend(
                backend,
                att,
                &act.q,
                projections.q_gate,
                cache,
                &act.attention_rows,
                &mut act.attention_workspace,
                &mut act.attention_out,
            )?;
            linear(
                backend,
                &act.attention_out,
                b,
                o,
                Epilogue::None,
                &mut act.delta,
            )?;
        }
        _ => {
            return Err(Error::invalid(
                "decoder layer",
                "a layer's cache is not of its mixer's kind",
            ));
        }
    }
    rms_norm_residual(
        backend,
        &mut act.residual,
        ResidualWriter::Earlier,
        Some(&act.delta),
        &layer.post_attention_norm,
        eps,
        &mut act.normed,
        b,
    )?;
    moe_block_prefetching(
        backend,
        &layer.moe,
        &act.normed,
        b,
        None,
        moe_workspace,
        &mut act.delta,
        next_weights,
    )
}

/// For benchmarks: one first token per sequence, spread over the vocabulary (a prime stride), so
/// that the rows of a batch differ and route to different experts as a real batch's do.
fn distinct_first_tokens(batch: usize, vocab: usize) -> Vec<u32> {
    (0..batch as u64)
        .map(|b| ((b * 7919 + 13) % vocab as u64) as u32)
        .collect()
}

/// Checks a batch's prompts: one non-empty prompt per sequence, none longer than `capacity`.
fn check_prompts(prompts: &[&[u32]], batch: usize, capacity: usize) -> Result<()> {
    if prompts.len() != batch || prompts.iter().any(|p| p.is_empty()) {
        return Err(Error::invalid(
            "decoder prompts",
            format!(
                "{} prompts for {batch} sequences: one non-empty prompt each",
                prompts.len()
            ),
        ));
    }
    if let Some(p) = prompts.iter().find(|p| p.len() > capacity) {
        return Err(Error::invalid(
            "decoder prompts",
            format!(
                "a prompt of {} tokens exceeds the capacity of {capacity}",
                p.len()
            ),
        ));
    }
    Ok(())
}

/// What [`prefill_rows`] leaves: the forward's activations (the residual before the final norm:
/// the last layer's MoE output still in `delta`) and each sequence's rows.
struct PrefillRows {
    act: Activations,
    /// Rows of each sequence: its prompt but the last token.
    lengths: Vec<usize>,
}

/// The target forward over every prompt but its last token, all sequences in one forward (GEMMs
/// over every row, the chunked Gated DeltaNet prefill from position 0, attention over each
/// row's causal prefix, the MoE block over every row); `None` when every prompt is one token.
/// The caches hold the prompts afterwards; the caller commits the positions. Allocates the
/// rows' buffers for the call.
fn prefill_rows(
    model: &DeviceModel,
    caches: &mut Caches,
    capacity: usize,
    prompts: &[&[u32]],
) -> Result<Option<PrefillRows>> {
    let lengths: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
    let rows: usize = lengths.iter().sum();
    if rows == 0 {
        return Ok(None);
    }
    let (backend, config) = (&model.backend, &model.config);
    let mut cu_seqlens = vec![0u32];
    let (mut tokens, mut slots, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for (b, (prompt, &len)) in prompts.iter().zip(&lengths).enumerate() {
        tokens.extend_from_slice(&prompt[..len]);
        slots.extend(std::iter::repeat_n(b as u32, len));
        positions.extend(0..len as u32);
        cu_seqlens.push(tokens.len() as u32);
    }
    let vocab = config.vocab_size;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::invalid(
            "token id",
            format!("{bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let mut act = Activations::new(model, capacity, &slots, &positions)?;
    let mut workspace = gdn::ChunkWorkspace::new(backend, gdn_shape(config), rows, prompts.len())?;
    tokens::embed(
        backend,
        &backend.upload(&tokens)?,
        TokenColumn::packed(rows),
        &model.embed,
        config.hidden_size,
        &mut act.residual,
    )?;
    let mut moe_workspace = prefill_moe_workspace(model, &model.layers[0].moe, rows)?;
    run_layers(
        model,
        &mut act,
        caches,
        &mut moe_workspace,
        GdnForward::Prefill {
            workspace: &mut workspace,
            cu_seqlens: &cu_seqlens,
        },
    )?;
    Ok(Some(PrefillRows { act, lengths }))
}

/// A MoE workspace for a prefill of `rows` rows through `moe`'s blocks: every row in one
/// launch where the kernels' slot counts allow.
fn prefill_moe_workspace(
    model: &DeviceModel,
    moe: &MoeWeights,
    rows: usize,
) -> Result<MoeWorkspace> {
    let top_k = model.config.num_experts_per_tok.max(1);
    MoeWorkspace::new(
        &model.backend,
        moe,
        rows.min(MAX_SLOTS_PER_LAUNCH / top_k).max(1),
    )
}

/// A batch of sequences decoding on a [`DeviceModel`]: their caches, the step's buffers, and on
/// CUDA the captured step. Every sequence advances one token per step; the greedy token of each
/// is written on the device as the next step's input.
pub struct Decoder<'m> {
    model: &'m DeviceModel,
    batch: usize,
    capacity: usize,
    /// Tokens behind each sequence (the host's mirror of the device positions).
    positions: Vec<usize>,
    tokens: DeviceVec<u32>,
    step: Activations,
    /// `[B][H]`: the last step's hidden after the final norm.
    hidden: DeviceVec<bf16>,
    logits: DeviceVec<bf16>,
    caches: Caches,
    moe_workspace: MoeWorkspace,
    argmax_workspace: ArgmaxWorkspace,
    graph: Option<Graph>,
}

impl<'m> Decoder<'m> {
    /// `batch` sequences of up to `capacity` tokens each on `model`'s backend. Runs one step to
    /// load every kernel and grow every scratch buffer, then (on CUDA) captures the step as a
    /// graph; the sequences start empty ([`Decoder::start`], [`Decoder::prefill`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty batch or capacity, or shapes the kernels do not take;
    /// [`Error::Cuda`] / [`Error::Hip`] when an allocation, the warm-up step or the capture
    /// fails.
    pub fn new(model: &'m DeviceModel, batch: usize, capacity: usize) -> Result<Self> {
        if batch == 0 || !(1..=MAX_POSITIONS).contains(&capacity) {
            return Err(Error::invalid(
                "decoder",
                format!(
                    "{batch} sequences of {capacity} tokens: both must be positive, the tokens at \
                     most {MAX_POSITIONS}"
                ),
            ));
        }
        let (backend, config) = (&model.backend, &model.config);
        let slots: Vec<u32> = (0..batch as u32).collect();
        let zeros = vec![0u32; batch];
        let mut decoder = Self {
            model,
            batch,
            capacity,
            positions: vec![0; batch],
            tokens: backend.zeros(batch)?,
            step: Activations::new(model, capacity, &slots, &zeros)?,
            hidden: backend.zeros(batch * config.hidden_size)?,
            logits: backend.zeros(batch * config.vocab_size)?,
            caches: Caches::new(model, batch, capacity, 1)?,
            moe_workspace: MoeWorkspace::new(backend, &model.layers[0].moe, batch)?,
            argmax_workspace: ArgmaxWorkspace::new(backend, batch, config.vocab_size)?,
            graph: None,
        };
        decoder.queue_step()?;
        decoder.restart()?;
        if matches!(backend, Backend::Cuda(_)) {
            let graph = {
                let this = &mut decoder;
                backend.capture(|| this.queue_step())?
            };
            decoder.graph = Some(graph);
        }
        Ok(decoder)
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens behind the sequence furthest along.
    pub fn position(&self) -> usize {
        self.positions.iter().copied().max().unwrap_or(0)
    }

    /// Whether steps replay a captured graph (CUDA) or are launched one call at a time.
    pub fn replays_graph(&self) -> bool {
        self.graph.is_some()
    }

    /// For benchmarks: empties every sequence and starts each from its own token (spread over
    /// the vocabulary), so that the rows of a batch differ and route to different experts as a
    /// real batch's do; identical rows would all choose the same experts.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn start_distinct(&mut self) -> Result<()> {
        let first = distinct_first_tokens(self.batch, self.model.config.vocab_size);
        self.start(&first)
    }

    /// Empties every sequence (position 0) and sets the tokens of the first step, one per
    /// sequence.
    ///
    /// # Errors
    /// As [`Decoder::set_tokens`]; [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn start(&mut self, tokens: &[u32]) -> Result<()> {
        self.restart()?;
        self.set_tokens(tokens)
    }

    /// Positions back to 0: the GDN kernels read no state and no conv rows before position 0 and
    /// attention reads only positions up to each row's own, so nothing else needs clearing.
    fn restart(&mut self) -> Result<()> {
        self.set_positions(&vec![0; self.batch])
    }

    fn set_positions(&mut self, positions: &[usize]) -> Result<()> {
        let backend = &self.model.backend;
        let device: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        self.caches.sequences.restart(backend, &device)?;
        backend.write(&mut self.step.attention_rows.position, 0, &device)?;
        self.positions = positions.to_vec();
        Ok(())
    }

    /// For benchmarks: every sequence continues as if `position` tokens were behind it, with
    /// whatever its caches hold (zeros, or an earlier run's values). The bytes a step reads are
    /// those of a real sequence at that position; the values are not.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `position` is not below the capacity; [`Error::Cuda`] /
    /// [`Error::Hip`] when a copy fails.
    pub fn skip_to(&mut self, position: usize) -> Result<()> {
        if position >= self.capacity {
            return Err(Error::invalid(
                "decoder position",
                format!("{position} is not below the capacity of {}", self.capacity),
            ));
        }
        self.set_positions(&vec![position; self.batch])
    }

    /// Empties every sequence and runs its prompt through the model in one forward, all but the
    /// last token (GEMMs over every prompt row, the chunked Gated DeltaNet prefill, attention
    /// over each row's causal prefix, the MoE block over every row); the last tokens become the
    /// next step's inputs, so the following [`Decoder::step`] gives each sequence's first greedy
    /// token. Allocates the prompt rows' buffers for the call (not captured in the graph).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a prompt count other than the batch, an empty prompt, a token
    /// outside the vocabulary or a prompt longer than the capacity allows; errors of the
    /// launches.
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<()> {
        check_prompts(prompts, self.batch, self.capacity)?;
        let last: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
        self.restart()?;
        self.set_tokens(&last)?;
        if let Some(rows) = prefill_rows(self.model, &mut self.caches, self.capacity, prompts)? {
            // from position 0, the commit the prefill asks for (positions += lengths, nothing
            // pending) is what set_positions writes, for the attention rows too
            self.set_positions(&rows.lengths)?;
        }
        Ok(())
    }

    /// Replaces the next step's input tokens (e.g. to feed a prompt one token per step),
    /// one per sequence.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a count other than the batch or a token outside the vocabulary;
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn set_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if tokens.len() != self.batch {
            return Err(Error::invalid(
                "decoder tokens",
                format!("{} tokens for {} sequences", tokens.len(), self.batch),
            ));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(
                "token id",
                format!("{bad} is outside the vocabulary of {vocab}"),
            ));
        }
        self.model.backend.write(&mut self.tokens, 0, tokens)
    }

    /// Queues one step: every sequence's input token through the model, its logits, and its
    /// greedy token as the next input; positions advance by one. Replays the captured graph
    /// on CUDA.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a sequence is full (position = capacity); errors of the launches.
    pub fn step(&mut self) -> Result<()> {
        self.check_room()?;
        match &self.graph {
            Some(graph) => graph.launch()?,
            None => self.queue_step()?,
        }
        self.positions.iter_mut().for_each(|p| *p += 1);
        Ok(())
    }

    /// Queues one step launch by launch, without the graph (what the graph holds; the bench
    /// times both to show the launch overhead the graph removes).
    ///
    /// # Errors
    /// As [`Decoder::step`].
    pub fn step_without_graph(&mut self) -> Result<()> {
        self.check_room()?;
        self.queue_step()?;
        self.positions.iter_mut().for_each(|p| *p += 1);
        Ok(())
    }

    /// The tokens of the next step (after a step: each sequence's greedy token), downloaded.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails (where an earlier fault shows).
    pub fn tokens(&self) -> Result<Vec<u32>> {
        self.model.backend.download(&self.tokens)
    }

    /// The last step's logits, `[batch][vocab]` as f32 (bf16 values), downloaded.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn logits(&self) -> Result<Vec<f32>> {
        Ok(self
            .model
            .backend
            .download(&self.logits)?
            .into_iter()
            .map(|v| v.to_f32())
            .collect())
    }

    /// Distinct routed experts the last layer's MoE block chose in the last step (waits for the
    /// device): what its expert bytes were, against the roofline's expectation for uniform
    /// routing.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn last_layer_distinct_experts(&self) -> Result<usize> {
        let routing = self.moe_workspace.routing(&self.model.backend)?;
        let mut experts = routing.experts;
        experts.sort_unstable();
        experts.dedup();
        Ok(experts.len())
    }

    /// An error when a sequence is full (position = capacity).
    fn check_room(&self) -> Result<()> {
        if self.position() >= self.capacity {
            return Err(Error::invalid(
                "decoder",
                format!("a sequence is full ({} tokens)", self.capacity),
            ));
        }
        Ok(())
    }

    fn queue_step(&mut self) -> Result<()> {
        let model = self.model;
        let backend = &model.backend;
        target_logits(
            model,
            &self.tokens,
            TokenColumn::packed(self.batch),
            &mut self.step,
            &mut self.caches,
            &mut self.moe_workspace,
            GdnForward::Step {
                tokens: 1,
                mode: StepMode::Decode,
            },
            &mut self.hidden,
            &mut self.logits,
        )?;
        tokens::argmax(
            backend,
            &self.logits,
            &mut self.argmax_workspace,
            &mut self.tokens,
            TokenColumn::packed(self.batch),
            Some(&mut self.step.attention_rows.position),
        )?;
        self.caches
            .sequences
            .commit(backend, gdn::Accepted::All(1), StepMode::Decode)
    }
}
