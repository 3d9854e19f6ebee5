//! Which tensors a Qwen3.5-MoE / Qwen3-Next checkpoint must hold for its config, checked for
//! presence, dtype and shape before the first forward (headers only, no data read).
//!
//! Accepted: both name prefixes (`model.layers.*`, and `model.language_model.layers.*` of the
//! vision-language wrapper, whose `model.visual.*` is ignored); experts fused 3-D
//! (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`) or per expert
//! 2-D; separate GDN projections (Qwen3.5/3.6) or fused `in_proj_qkvz` / `in_proj_ba`
//! (Qwen3-Next); dense tensors in BF16, F16 or F32; any 2-D linear in NVFP4 (ModelOpt `weight` +
//! `weight_scale` + `weight_scale_2`, or compressed-tensors `weight_packed` + `weight_scale` +
//! `weight_global_scale`). `mtp.layers.*` without `mtp.fc.weight` is an error that says what other
//! engines do with it.

use crate::error::{Error, Result};
use crate::formats::safetensors::Checkpoint;
use crate::model::config::{Family, LayerKind, ModelConfig};
use safetensors::Dtype;

const FLOAT: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// How the routed experts of the main layers are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` and `mlp.experts.down_proj` `[E, H, I]`.
    Fused,
    /// `mlp.experts.{e}.{gate,up,down}_proj.weight`.
    PerExpert,
}

/// What the check found.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightsReport {
    /// Prefix of the language-model tensors (`model.` or `model.language_model.`).
    pub prefix: String,
    /// Expert storage of the main layers.
    pub experts: ExpertLayout,
    /// Tensors checked.
    pub tensors: usize,
    /// 2-D linears stored as NVFP4.
    pub nvfp4_linears: usize,
    /// 2-D linears stored in a float dtype.
    pub float_linears: usize,
    /// Whether the MTP head is present (and complete).
    pub mtp: bool,
}

struct Checker<'a> {
    checkpoint: &'a Checkpoint,
    report: WeightsReport,
}

impl Checker<'_> {
    fn dense(&mut self, name: &str, dtypes: &[Dtype], shape: &[usize]) -> Result<()> {
        self.checkpoint.expect(name, dtypes, shape)?;
        self.report.tensors += 1;
        Ok(())
    }

    /// A 2-D linear `[out, in]` under `prefix` (`....q_proj`): float `prefix.weight`, or NVFP4.
    fn linear(&mut self, prefix: &str, out: usize, input: usize) -> Result<()> {
        let c = self.checkpoint;
        let weight = format!("{prefix}.weight");
        let packed = format!("{prefix}.weight_packed");
        let (codes, global) = if c.contains(&packed) {
            (packed, format!("{prefix}.weight_global_scale"))
        } else if c.contains(&format!("{prefix}.weight_scale")) {
            (weight, format!("{prefix}.weight_scale_2"))
        } else {
            self.dense(&weight, &FLOAT, &[out, input])?;
            self.report.float_linears += 1;
            return Ok(());
        };
        if input % 16 != 0 {
            return Err(Error::invalid(
                codes,
                format!("an NVFP4 linear needs K % 16 == 0, K = {input}"),
            ));
        }
        self.dense(&codes, &[Dtype::U8], &[out, input / 2])?;
        self.dense(
            &format!("{prefix}.weight_scale"),
            &[Dtype::F8_E4M3],
            &[out, input / 16],
        )?;
        c.scalar_f32(&global)?;
        self.report.tensors += 1;
        self.report.nvfp4_linears += 1;
        Ok(())
    }

    /// A decoder layer's norms, mixer and MoE block under `p` (`model.layers.3.`).
    fn layer(
        &mut self,
        config: &ModelConfig,
        p: &str,
        kind: LayerKind,
        experts: ExpertLayout,
    ) -> Result<()> {
        let h = config.hidden_size;
        self.dense(&format!("{p}input_layernorm.weight"), &FLOAT, &[h])?;
        self.dense(&format!("{p}post_attention_layernorm.weight"), &FLOAT, &[h])?;
        match kind {
            LayerKind::FullAttention => {
                let (heads, kv, hd) = (
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                );
                let q_rows = heads * hd * if config.attn_output_gate { 2 } else { 1 };
                self.linear(&format!("{p}self_attn.q_proj"), q_rows, h)?;
                self.linear(&format!("{p}self_attn.k_proj"), kv * hd, h)?;
                self.linear(&format!("{p}self_attn.v_proj"), kv * hd, h)?;
                self.linear(&format!("{p}self_attn.o_proj"), h, heads * hd)?;
                self.dense(&format!("{p}self_attn.q_norm.weight"), &FLOAT, &[hd])?;
                self.dense(&format!("{p}self_attn.k_norm.weight"), &FLOAT, &[hd])?;
            }
            LayerKind::LinearAttention => {
                let a = format!("{p}linear_attn.");
                let value_dim = config.linear_num_value_heads * config.linear_value_head_dim;
                let key_dim = config.linear_num_key_heads * config.linear_key_head_dim;
                let heads = config.linear_num_value_heads;
                match config.family {
                    Family::Qwen35Moe => {
                        self.linear(&format!("{a}in_proj_qkv"), config.linear_conv_dim(), h)?;
                        self.linear(&format!("{a}in_proj_z"), value_dim, h)?;
                        self.linear(&format!("{a}in_proj_b"), heads, h)?;
                        self.linear(&format!("{a}in_proj_a"), heads, h)?;
                    }
                    Family::Qwen3Next => {
                        self.linear(&format!("{a}in_proj_qkvz"), 2 * key_dim + 2 * value_dim, h)?;
                        self.linear(&format!("{a}in_proj_ba"), 2 * heads, h)?;
                    }
                }
                self.dense(
                    &format!("{a}conv1d.weight"),
                    &FLOAT,
                    &[config.linear_conv_dim(), 1, config.linear_conv_kernel_dim],
                )?;
                self.dense(&format!("{a}dt_bias"), &FLOAT, &[heads])?;
                self.dense(&format!("{a}A_log"), &FLOAT, &[heads])?;
                self.dense(
                    &format!("{a}norm.weight"),
                    &FLOAT,
                    &[config.linear_value_head_dim],
                )?;
                self.linear(&format!("{a}out_proj"), h, value_dim)?;
            }
        }
        self.moe(config, &format!("{p}mlp."), experts)
    }

    fn moe(&mut self, config: &ModelConfig, m: &str, experts: ExpertLayout) -> Result<()> {
        let (h, e, i, s) = (
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        );
        self.dense(&format!("{m}gate.weight"), &FLOAT, &[e, h])?;
        match experts {
            ExpertLayout::Fused => {
                self.dense(&format!("{m}experts.gate_up_proj"), &FLOAT, &[e, 2 * i, h])?;
                self.dense(&format!("{m}experts.down_proj"), &FLOAT, &[e, h, i])?;
            }
            ExpertLayout::PerExpert => {
                for expert in 0..e {
                    self.linear(&format!("{m}experts.{expert}.gate_proj"), i, h)?;
                    self.linear(&format!("{m}experts.{expert}.up_proj"), i, h)?;
                    self.linear(&format!("{m}experts.{expert}.down_proj"), h, i)?;
                }
            }
        }
        self.linear(&format!("{m}shared_expert.gate_proj"), s, h)?;
        self.linear(&format!("{m}shared_expert.up_proj"), s, h)?;
        self.linear(&format!("{m}shared_expert.down_proj"), h, s)?;
        self.dense(&format!("{m}shared_expert_gate.weight"), &FLOAT, &[1, h])
    }
}

/// Checks every tensor `config` implies.
///
/// # Errors
/// [`Error::MissingTensor`], [`Error::Dtype`] or [`Error::Shape`] for the first tensor that is
/// absent or wrong (naming tensor and file); [`Error::Invalid`] for an MTP head that the config
/// and the tensors disagree on, or `mtp.layers.*` without `mtp.fc.weight`.
pub fn check(checkpoint: &Checkpoint, config: &ModelConfig) -> Result<WeightsReport> {
    let prefix = if checkpoint.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let h = config.hidden_size;
    let fused = checkpoint.contains(&format!("{prefix}layers.0.mlp.experts.gate_up_proj"));
    let experts = if fused {
        ExpertLayout::Fused
    } else {
        ExpertLayout::PerExpert
    };
    let mut checker = Checker {
        checkpoint,
        report: WeightsReport {
            prefix: prefix.to_string(),
            experts,
            tensors: 0,
            nvfp4_linears: 0,
            float_linears: 0,
            mtp: false,
        },
    };
    checker.dense(
        &format!("{prefix}embed_tokens.weight"),
        &FLOAT,
        &[config.vocab_size, h],
    )?;
    checker.dense(&format!("{prefix}norm.weight"), &FLOAT, &[h])?;
    if !config.tie_word_embeddings {
        checker.linear("lm_head", config.vocab_size, h)?;
    }
    for (i, kind) in config.layer_types.iter().enumerate() {
        checker.layer(config, &format!("{prefix}layers.{i}."), *kind, experts)?;
    }
    let names = checkpoint.tensor_names();
    let has_mtp_layers = names.iter().any(|n| n.starts_with("mtp.layers."));
    let has_mtp = names.iter().any(|n| n.starts_with("mtp."));
    let location = checkpoint.location().display().to_string();
    if has_mtp_layers && !checkpoint.contains("mtp.fc.weight") {
        return Err(Error::invalid(
            format!("{location}: mtp.fc.weight"),
            "missing while mtp.layers.* exist: the MTP head cannot run (other engines leave it uninitialised and reject every draft)",
        ));
    }
    match (config.mtp_num_hidden_layers, has_mtp) {
        (0, false) => {}
        (0, true) => {
            return Err(Error::invalid(
                format!("{location}: mtp.*"),
                "MTP tensors are present but the config declares no MTP layers (mtp_num_hidden_layers / num_nextn_predict_layers)",
            ));
        }
        (n, false) => {
            return Err(Error::invalid(
                format!("{location}: mtp.*"),
                format!(
                    "the config declares {n} MTP layer(s) but the checkpoint has no mtp.* tensors"
                ),
            ));
        }
        (n, true) => {
            checker.dense("mtp.fc.weight", &FLOAT, &[h, 2 * h])?;
            for norm in [
                "mtp.pre_fc_norm_embedding.weight",
                "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight",
            ] {
                checker.dense(norm, &FLOAT, &[h])?;
            }
            for layer in 0..n {
                let mtp_experts = if checkpoint
                    .contains(&format!("mtp.layers.{layer}.mlp.experts.gate_up_proj"))
                {
                    ExpertLayout::Fused
                } else {
                    ExpertLayout::PerExpert
                };
                checker.layer(
                    config,
                    &format!("mtp.layers.{layer}."),
                    LayerKind::FullAttention,
                    mtp_experts,
                )?;
            }
            checker.report.mtp = true;
        }
    }
    Ok(checker.report)
}
