//! The weights of a checkpoint in host memory, as the CPU reference runner computes with them:
//! every tensor f32, NVFP4 linears dequantised (so the reference computes W4A16: dequantised
//! weight times unquantised activation), Qwen3-Next's fused GDN projections split into the
//! Qwen3.5 order, experts from fused 3-D or per-expert tensors. The checkpoint is checked in full
//! ([`super::weights::check`]) before anything is read.

use crate::error::{Error, Result};
use crate::formats::nvfp4::Nvfp4Matrix;
use crate::formats::safetensors::Checkpoint;
use crate::kernels::gemm::reference::f32_gemm;
use crate::model::config::{Family, LayerKind, ModelConfig};
use crate::model::weights;
use safetensors::Dtype;

const FLOAT: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// A linear layer `y = x W^T` with `W` `[rows][cols]` in f32.
#[derive(Debug, Clone)]
pub struct HostLinear {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `[rows][cols]`, row-major.
    pub weight: Vec<f32>,
    /// The NVFP4 matrix `weight` was dequantised from, when the checkpoint stores the linear so:
    /// what the device path runs (W4A16 on the codes and scales themselves).
    pub nvfp4: Option<Nvfp4Matrix>,
}

impl HostLinear {
    /// `x` (`[m][cols]`) times the weight transposed: `[m][rows]`.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.cols;
        f32_gemm(x, m, &self.weight, self.rows, self.cols)
    }
}

/// Gated full attention weights.
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `[heads * head_dim * 2][H]`, per head `[query; gate]`.
    pub q: HostLinear,
    /// `[kv_heads * head_dim][H]`.
    pub k: HostLinear,
    /// `[kv_heads * head_dim][H]`.
    pub v: HostLinear,
    /// `[H][heads * head_dim]`.
    pub o: HostLinear,
    /// `[head_dim]`, zero-centred.
    pub q_norm: Vec<f32>,
    /// `[head_dim]`, zero-centred.
    pub k_norm: Vec<f32>,
}

/// Gated DeltaNet weights, in the Qwen3.5 order (Qwen3-Next's fused projections are split at
/// load).
#[derive(Debug, Clone)]
pub struct GdnWeights {
    /// `[2 * key_dim + value_dim][H]`, rows `[q | k | v]`.
    pub qkv: HostLinear,
    /// `[value_dim][H]`.
    pub z: HostLinear,
    /// `[Hv][H]`.
    pub b: HostLinear,
    /// `[Hv][H]`.
    pub a: HostLinear,
    /// `[conv_dim][kernel]`.
    pub conv: Vec<f32>,
    /// `[Hv]`.
    pub dt_bias: Vec<f32>,
    /// `[Hv]`.
    pub a_log: Vec<f32>,
    /// `[dv]`, a plain (not zero-centred) weight.
    pub norm: Vec<f32>,
    /// `[H][value_dim]`.
    pub out: HostLinear,
}

/// A layer's token mixer.
#[derive(Debug, Clone)]
pub enum MixerWeights {
    /// Gated DeltaNet.
    Gdn(GdnWeights),
    /// Gated full attention.
    Attention(AttentionWeights),
}

/// One expert's MLP: `gate_up` `[2I][H]` (gate rows first), `down` `[H][I]`.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// `[2I][H]`.
    pub gate_up: Vec<f32>,
    /// `[H][I]`.
    pub down: Vec<f32>,
    /// `[gate, up, down]` as stored, when the checkpoint stores the expert's three projections
    /// as separate NVFP4 tensors (fused NVFP4 experts are kept dequantised only).
    pub nvfp4: Option<[Nvfp4Matrix; 3]>,
}

/// A sparse MoE block.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router `[E][H]`.
    pub router: Vec<f32>,
    /// The routed experts.
    pub experts: Vec<ExpertWeights>,
    /// The shared expert.
    pub shared: ExpertWeights,
    /// `shared_expert_gate` `[H]`.
    pub shared_gate: Vec<f32>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[H]`, zero-centred.
    pub input_norm: Vec<f32>,
    /// `[H]`, zero-centred.
    pub post_attention_norm: Vec<f32>,
    /// The token mixer.
    pub mixer: MixerWeights,
    /// The MoE block.
    pub moe: MoeWeights,
}

/// The MTP head.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// `[H][2H]`, input `[embedding; hidden]`.
    pub fc: HostLinear,
    /// `[H]`.
    pub pre_fc_norm_embedding: Vec<f32>,
    /// `[H]`.
    pub pre_fc_norm_hidden: Vec<f32>,
    /// `[H]`, after the MTP layers.
    pub norm: Vec<f32>,
    /// Full-attention decoder layers.
    pub layers: Vec<LayerWeights>,
}

/// Every weight the runner uses.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[V][H]`.
    pub embed: Vec<f32>,
    /// `[H]`, zero-centred.
    pub final_norm: Vec<f32>,
    /// `[V][H]` (a copy of the embedding when tied).
    pub lm_head: HostLinear,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// The MTP head, when the checkpoint has one.
    pub mtp: Option<MtpWeights>,
}

struct Loader<'a> {
    checkpoint: &'a Checkpoint,
    config: &'a ModelConfig,
}

impl Loader<'_> {
    fn dense(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.checkpoint.expect(name, &FLOAT, shape)?.to_f32()
    }

    /// The linear under `prefix` (`....q_proj`): float `prefix.weight`, or NVFP4 (ModelOpt or
    /// compressed-tensors) dequantised.
    fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<HostLinear> {
        let c = self.checkpoint;
        let weight = if c.contains(&format!("{prefix}.weight_packed"))
            || c.contains(&format!("{prefix}.weight_scale"))
        {
            let matrix = Nvfp4Matrix::load(c, prefix)?;
            if (matrix.rows, matrix.cols) != (rows, cols) {
                return Err(Error::invalid(
                    format!("{prefix} (NVFP4)"),
                    format!(
                        "holds [{}, {}], the config implies [{rows}, {cols}]",
                        matrix.rows, matrix.cols
                    ),
                ));
            }
            let weight = matrix.dequantize();
            return Ok(HostLinear {
                rows,
                cols,
                weight,
                nvfp4: Some(matrix),
            });
        } else {
            self.dense(&format!("{prefix}.weight"), &[rows, cols])?
        };
        Ok(HostLinear {
            rows,
            cols,
            weight,
            nvfp4: None,
        })
    }

    fn attention(&self, p: &str) -> Result<AttentionWeights> {
        let c = self.config;
        let (h, heads, kv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        if !c.attn_output_gate {
            return Err(Error::invalid(
                "attn_output_gate",
                "false: the runner implements the gated attention of Qwen3.5 / Qwen3-Next only",
            ));
        }
        Ok(AttentionWeights {
            q: self.linear(&format!("{p}q_proj"), heads * hd * 2, h)?,
            k: self.linear(&format!("{p}k_proj"), kv * hd, h)?,
            v: self.linear(&format!("{p}v_proj"), kv * hd, h)?,
            o: self.linear(&format!("{p}o_proj"), h, heads * hd)?,
            q_norm: self.dense(&format!("{p}q_norm.weight"), &[hd])?,
            k_norm: self.dense(&format!("{p}k_norm.weight"), &[hd])?,
        })
    }

    fn gdn(&self, p: &str) -> Result<GdnWeights> {
        let c = self.config;
        let h = c.hidden_size;
        let (hk, hv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let (key_dim, value_dim, conv_dim) = (hk * dk, hv * dv, c.linear_conv_dim());
        let (qkv, z, b, a) = match c.family {
            Family::Qwen35Moe => (
                self.linear(&format!("{p}in_proj_qkv"), conv_dim, h)?,
                self.linear(&format!("{p}in_proj_z"), value_dim, h)?,
                self.linear(&format!("{p}in_proj_b"), hv, h)?,
                self.linear(&format!("{p}in_proj_a"), hv, h)?,
            ),
            Family::Qwen3Next => {
                // per key head: [q dk | k dk | v r*dv | z r*dv] and [b r | a r], r = Hv / Hk
                let qkvz =
                    self.linear(&format!("{p}in_proj_qkvz"), 2 * key_dim + 2 * value_dim, h)?;
                let ba = self.linear(&format!("{p}in_proj_ba"), 2 * hv, h)?;
                let r = hv / hk;
                let group = 2 * dk + 2 * r * dv;
                let rows_of = |m: &HostLinear, picks: &mut dyn Iterator<Item = usize>| {
                    let weight: Vec<f32> = picks
                        .flat_map(|row| m.weight[row * h..(row + 1) * h].iter().copied())
                        .collect();
                    HostLinear {
                        rows: weight.len() / h,
                        cols: h,
                        weight,
                        nvfp4: None,
                    }
                };
                let q_rows = (0..hk).flat_map(|g| (0..dk).map(move |i| g * group + i));
                let k_rows = (0..hk).flat_map(|g| (0..dk).map(move |i| g * group + dk + i));
                let v_rows = (0..hk).flat_map(|g| (0..r * dv).map(move |i| g * group + 2 * dk + i));
                let z_rows =
                    (0..hk).flat_map(|g| (0..r * dv).map(move |i| g * group + 2 * dk + r * dv + i));
                let mut qkv_rows = q_rows.chain(k_rows).chain(v_rows);
                let b_rows = (0..hk).flat_map(|g| (0..r).map(move |i| g * 2 * r + i));
                let a_rows = (0..hk).flat_map(|g| (0..r).map(move |i| g * 2 * r + r + i));
                (
                    rows_of(&qkvz, &mut qkv_rows),
                    rows_of(&qkvz, &mut z_rows.into_iter()),
                    rows_of(&ba, &mut b_rows.into_iter()),
                    rows_of(&ba, &mut a_rows.into_iter()),
                )
            }
        };
        Ok(GdnWeights {
            qkv,
            z,
            b,
            a,
            conv: self.dense(
                &format!("{p}conv1d.weight"),
                &[conv_dim, 1, c.linear_conv_kernel_dim],
            )?,
            dt_bias: self.dense(&format!("{p}dt_bias"), &[hv])?,
            a_log: self.dense(&format!("{p}A_log"), &[hv])?,
            norm: self.dense(&format!("{p}norm.weight"), &[dv])?,
            out: self.linear(&format!("{p}out_proj"), h, value_dim)?,
        })
    }

    fn mlp(&self, p: &str, intermediate: usize) -> Result<ExpertWeights> {
        let h = self.config.hidden_size;
        let gate = self.linear(&format!("{p}gate_proj"), intermediate, h)?;
        let up = self.linear(&format!("{p}up_proj"), intermediate, h)?;
        let down = self.linear(&format!("{p}down_proj"), h, intermediate)?;
        let nvfp4 = match (gate.nvfp4, up.nvfp4, down.nvfp4) {
            (Some(gate), Some(up), Some(down)) => Some([gate, up, down]),
            _ => None,
        };
        let mut gate_up = gate.weight;
        gate_up.extend_from_slice(&up.weight);
        Ok(ExpertWeights {
            gate_up,
            down: down.weight,
            nvfp4,
        })
    }

    fn moe(&self, m: &str) -> Result<MoeWeights> {
        let c = self.config;
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        let fused_name = format!("{m}experts.gate_up_proj");
        let fused_nvfp4 = self
            .checkpoint
            .tensor(&fused_name)
            .is_ok_and(|t| t.dtype == Dtype::U8);
        let experts = if fused_nvfp4 {
            (0..e)
                .map(|expert| {
                    let dequant = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>> {
                        let matrix = Nvfp4Matrix::load_fused_expert(self.checkpoint, name, expert)?;
                        if (matrix.rows, matrix.cols) != (rows, cols) {
                            return Err(Error::invalid(
                                format!("{name} (NVFP4, expert {expert})"),
                                format!(
                                    "holds [{}, {}], the config implies [{rows}, {cols}]",
                                    matrix.rows, matrix.cols
                                ),
                            ));
                        }
                        Ok(matrix.dequantize())
                    };
                    Ok(ExpertWeights {
                        gate_up: dequant(&fused_name, 2 * i, h)?,
                        down: dequant(&format!("{m}experts.down_proj"), h, i)?,
                        nvfp4: None,
                    })
                })
                .collect::<Result<_>>()?
        } else if self.checkpoint.contains(&fused_name) {
            let gate_up = self.dense(&fused_name, &[e, 2 * i, h])?;
            let down = self.dense(&format!("{m}experts.down_proj"), &[e, h, i])?;
            gate_up
                .chunks_exact(2 * i * h)
                .zip(down.chunks_exact(h * i))
                .map(|(gate_up, down)| ExpertWeights {
                    gate_up: gate_up.to_vec(),
                    down: down.to_vec(),
                    nvfp4: None,
                })
                .collect()
        } else {
            (0..e)
                .map(|expert| self.mlp(&format!("{m}experts.{expert}."), i))
                .collect::<Result<_>>()?
        };
        Ok(MoeWeights {
            router: self.dense(&format!("{m}gate.weight"), &[e, h])?,
            experts,
            shared: self.mlp(
                &format!("{m}shared_expert."),
                c.shared_expert_intermediate_size,
            )?,
            shared_gate: self.dense(&format!("{m}shared_expert_gate.weight"), &[1, h])?,
        })
    }

    fn layer(&self, p: &str, kind: LayerKind) -> Result<LayerWeights> {
        let h = self.config.hidden_size;
        Ok(LayerWeights {
            input_norm: self.dense(&format!("{p}input_layernorm.weight"), &[h])?,
            post_attention_norm: self
                .dense(&format!("{p}post_attention_layernorm.weight"), &[h])?,
            mixer: match kind {
                LayerKind::FullAttention => {
                    MixerWeights::Attention(self.attention(&format!("{p}self_attn."))?)
                }
                LayerKind::LinearAttention => {
                    MixerWeights::Gdn(self.gdn(&format!("{p}linear_attn."))?)
                }
            },
            moe: self.moe(&format!("{p}mlp."))?,
        })
    }
}

impl ModelWeights {
    /// Checks every tensor `config` implies ([`weights::check`]), then reads them all as f32.
    ///
    /// # Errors
    /// As [`weights::check`]; [`Error::Invalid`] for an NVFP4 tensor whose block scales are NaN
    /// or whose shape disagrees with the config, or a config the runner does not implement
    /// (attention without the output gate).
    pub fn load(checkpoint: &Checkpoint, config: &ModelConfig) -> Result<Self> {
        let report = weights::check(checkpoint, config)?;
        let loader = Loader { checkpoint, config };
        let prefix = &report.prefix;
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed = loader.dense(&format!("{prefix}embed_tokens.weight"), &[v, h])?;
        let lm_head = if config.tie_word_embeddings {
            HostLinear {
                rows: v,
                cols: h,
                weight: embed.clone(),
                nvfp4: None,
            }
        } else {
            loader.linear("lm_head", v, h)?
        };
        let layers = config
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, kind)| loader.layer(&format!("{prefix}layers.{i}."), *kind))
            .collect::<Result<Vec<_>>>()?;
        let mtp = if report.mtp {
            Some(MtpWeights {
                fc: loader.linear("mtp.fc", h, 2 * h)?,
                pre_fc_norm_embedding: loader.dense("mtp.pre_fc_norm_embedding.weight", &[h])?,
                pre_fc_norm_hidden: loader.dense("mtp.pre_fc_norm_hidden.weight", &[h])?,
                norm: loader.dense("mtp.norm.weight", &[h])?,
                layers: (0..config.mtp_num_hidden_layers)
                    .map(|l| loader.layer(&format!("mtp.layers.{l}."), LayerKind::FullAttention))
                    .collect::<Result<_>>()?,
            })
        } else {
            None
        };
        Ok(Self {
            embed,
            final_norm: loader.dense(&format!("{prefix}norm.weight"), &[h])?,
            lm_head,
            layers,
            mtp,
        })
    }
}
