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
//!
//! With a quantisation config (`hf_quant_config.json` or `config.json` `quantization_config`,
//! [`QuantConfig`]) its exclusion list decides: a linear it excludes must be float, every other
//! linear must be NVFP4 in the config's convention, with its activation scale when the
//! algorithm is `NVFP4` (W4A4); fused 3-D experts may then be NVFP4 as ModelOpt writes them
//! (`gate_up_proj` U8 `[E, 2I, H/2]`, `gate_up_proj_weight_scale` F8_E4M3 `[E, 2I, H/16]`,
//! `gate_up_proj_weight_scale_2` F32 `[E]`, `gate_up_proj_input_scale` F32 `[E]` or scalar; the
//! same for `down_proj`). MTP tensors must stay float whatever the list says, and the list must
//! exclude them. Without a quantisation config each linear is taken as stored.

use crate::error::{Error, Result};
use crate::formats::quant_config::{Convention, QuantConfig};
use crate::formats::safetensors::{Checkpoint, TensorHeader, TensorHeaders};
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
    /// Fused 3-D expert tensors (`gate_up_proj`, `down_proj`) stored as NVFP4.
    pub nvfp4_fused_experts: usize,
}

/// What kind of problem the check found; [`ProblemKind::code`] is the stable code
/// `fp4spec doctor` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// A tensor the config implies is absent.
    Missing,
    /// A tensor has the wrong dtype.
    Dtype,
    /// A tensor has the wrong shape.
    Shape,
    /// An NVFP4 linear lacks `weight_scale`, its global scale or its activation scale.
    ScaleMissing,
    /// An NVFP4 scale has the wrong dtype or shape.
    ScaleShape,
    /// Fused 3-D NVFP4 experts lack a per-expert scale.
    FusedExpertScaleMissing,
    /// The exclusion list excludes a linear that is stored as NVFP4.
    ExcludedButQuantized,
    /// A linear the exclusion list does not exclude is stored float, or in the other NVFP4
    /// convention.
    NotQuantized,
    /// `mtp.layers.*` exist but `mtp.fc.weight` does not.
    MtpFcMissing,
    /// Another MTP tensor the config implies is absent.
    MtpTensorMissing,
    /// `mtp.*` tensors but no MTP layers in the config.
    MtpWithoutConfig,
    /// MTP layers in the config but no `mtp.*` tensors.
    ConfigWithoutMtp,
    /// An MTP linear is stored quantised (MTP must stay BF16).
    MtpQuantized,
    /// The quantisation config's exclusion list does not cover the MTP head.
    MtpNotExcluded,
}

impl ProblemKind {
    /// The stable code.
    pub fn code(self) -> &'static str {
        match self {
            Self::Missing => "tensor-missing",
            Self::Dtype => "tensor-dtype",
            Self::Shape => "tensor-shape",
            Self::ScaleMissing => "nvfp4-scale-missing",
            Self::ScaleShape => "nvfp4-scale-shape",
            Self::FusedExpertScaleMissing => "fused-expert-scales-missing",
            Self::ExcludedButQuantized => "excluded-but-quantized",
            Self::NotQuantized => "not-quantized",
            Self::MtpFcMissing => "mtp-fc-missing",
            Self::MtpTensorMissing => "mtp-tensor-missing",
            Self::MtpWithoutConfig => "mtp-tensors-without-config",
            Self::ConfigWithoutMtp => "mtp-config-without-tensors",
            Self::MtpQuantized => "mtp-quantized",
            Self::MtpNotExcluded => "mtp-not-excluded",
        }
    }
}

/// One problem: its kind, the tensor (or pattern) it concerns, and the error naming it.
#[derive(Debug)]
pub struct Problem {
    /// What kind.
    pub kind: ProblemKind,
    /// The tensor, or `mtp.*` for the head as a whole.
    pub tensor: String,
    /// The error, naming tensor, file and what was expected.
    pub error: Error,
}

/// How a linear is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Absent,
    Float,
    Nvfp4(Convention),
}

/// What the quantisation config (and the MTP rule) demand of a linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// No quantisation config: as stored.
    Any,
    /// Float; a quantised tensor is a problem of this kind.
    Float(ProblemKind),
    /// NVFP4 in this convention.
    Nvfp4(Convention),
}

struct Checker<'a> {
    headers: &'a dyn TensorHeaders,
    quant: Option<&'a QuantConfig>,
    report: WeightsReport,
    problems: Vec<Problem>,
    mtp_not_excluded: Option<String>,
}

impl<'a> Checker<'a> {
    fn fail(&mut self, kind: ProblemKind, tensor: &str, error: Error) {
        self.problems.push(Problem {
            kind,
            tensor: tensor.to_string(),
            error,
        });
    }

    fn missing_kind(name: &str) -> ProblemKind {
        if name == "mtp.fc.weight" {
            ProblemKind::MtpFcMissing
        } else if name.starts_with("mtp.") {
            ProblemKind::MtpTensorMissing
        } else {
            ProblemKind::Missing
        }
    }

    /// The header of `name`, or a problem of kind `missing`.
    fn lookup(&mut self, name: &str, missing: ProblemKind) -> Option<TensorHeader<'a>> {
        let headers = self.headers;
        match headers.expect_header(name) {
            Ok(h) => Some(h),
            Err(e) => {
                self.fail(missing, name, e);
                None
            }
        }
    }

    fn dense(&mut self, name: &str, dtypes: &[Dtype], shape: &[usize]) -> bool {
        let Some(h) = self.lookup(name, Self::missing_kind(name)) else {
            return false;
        };
        if let Err(e) = h.expect_dtype(dtypes) {
            self.fail(ProblemKind::Dtype, name, e);
            return false;
        }
        if let Err(e) = h.expect_shape(shape) {
            self.fail(ProblemKind::Shape, name, e);
            return false;
        }
        self.report.tensors += 1;
        true
    }

    /// A scale tensor: absent is `missing`, a wrong dtype or shape is
    /// [`ProblemKind::ScaleShape`].
    fn scale(
        &mut self,
        name: &str,
        missing: ProblemKind,
        check: impl Fn(&TensorHeader<'_>) -> Result<()>,
    ) -> bool {
        let Some(h) = self.lookup(name, missing) else {
            return false;
        };
        if let Err(e) = check(&h) {
            self.fail(ProblemKind::ScaleShape, name, e);
            return false;
        }
        self.report.tensors += 1;
        true
    }

    fn stored_linear(&self, prefix: &str) -> Stored {
        let c = self.headers;
        if c.contains(&format!("{prefix}.weight_packed")) {
            return Stored::Nvfp4(Convention::CompressedTensors);
        }
        let weight = c.header(&format!("{prefix}.weight"));
        if c.contains(&format!("{prefix}.weight_scale"))
            || c.contains(&format!("{prefix}.weight_scale_2"))
            || weight.is_some_and(|w| w.dtype == Dtype::U8)
        {
            Stored::Nvfp4(Convention::ModelOpt)
        } else if weight.is_some() {
            Stored::Float
        } else {
            Stored::Absent
        }
    }

    fn stored_fused(&self, name: &str) -> Stored {
        let c = self.headers;
        let tensor = c.header(name);
        if c.contains(&format!("{name}_weight_scale"))
            || c.contains(&format!("{name}_weight_scale_2"))
            || tensor.is_some_and(|t| t.dtype == Dtype::U8)
        {
            Stored::Nvfp4(Convention::ModelOpt)
        } else if tensor.is_some() {
            Stored::Float
        } else {
            Stored::Absent
        }
    }

    fn expected(&mut self, module: &str) -> Expect {
        if module.starts_with("mtp.") {
            if let Some(q) = self.quant
                && !q.excludes(module)
                && self.mtp_not_excluded.is_none()
            {
                self.mtp_not_excluded = Some(module.to_string());
            }
            return Expect::Float(ProblemKind::MtpQuantized);
        }
        match self.quant {
            None => Expect::Any,
            Some(q) if q.excludes(module) => Expect::Float(ProblemKind::ExcludedButQuantized),
            Some(q) => Expect::Nvfp4(q.convention),
        }
    }

    /// Whether `stored` is what `expect` allows; reports the problem (on `tensor`) if not.
    fn agrees(&mut self, module: &str, tensor: &str, expect: Expect, stored: Stored) -> bool {
        let source = self.quant.map_or(String::new(), |q| q.source.clone());
        match (expect, stored) {
            (Expect::Float(kind), Stored::Nvfp4(convention)) => {
                let why = match kind {
                    ProblemKind::MtpQuantized => {
                        "the MTP head must stay BF16 (mtp.fc unquantised); engines load it as float"
                            .to_string()
                    }
                    _ => format!(
                        "the exclusion list of {source} excludes `{module}` (entry `{}`), so loaders build it as float",
                        self.quant
                            .and_then(|q| q.excluding_entry(module))
                            .unwrap_or("?")
                    ),
                };
                let error = Error::invalid(
                    format!("tensor `{tensor}`"),
                    format!("stored as NVFP4 ({}), but {why}", convention.name()),
                );
                self.fail(kind, tensor, error);
                false
            }
            (Expect::Nvfp4(convention), Stored::Float) => {
                let dtype = self
                    .headers
                    .header(tensor)
                    .map_or("float".to_string(), |h| h.dtype.to_string());
                let error = Error::invalid(
                    format!("tensor `{tensor}`"),
                    format!(
                        "stored as {dtype}, but the exclusion list of {source} does not exclude `{module}`, so loaders expect NVFP4 ({})",
                        convention.name()
                    ),
                );
                self.fail(ProblemKind::NotQuantized, tensor, error);
                false
            }
            (Expect::Nvfp4(want), Stored::Nvfp4(found)) if want != found => {
                let error = Error::invalid(
                    format!("tensor `{tensor}`"),
                    format!(
                        "stored in the {} convention, but {source} says {}",
                        found.name(),
                        want.name()
                    ),
                );
                self.fail(ProblemKind::NotQuantized, tensor, error);
                false
            }
            _ => true,
        }
    }

    fn activation_scales(&self) -> bool {
        self.quant.is_some_and(|q| q.activation_scales)
    }

    /// A 2-D linear `[out, in]` under `prefix` (`....q_proj`): float `prefix.weight`, or NVFP4.
    fn linear(&mut self, prefix: &str, out: usize, input: usize) {
        let weight = format!("{prefix}.weight");
        let stored = self.stored_linear(prefix);
        let expect = self.expected(prefix);
        if stored == Stored::Absent {
            let error = Error::MissingTensor {
                tensor: weight.clone(),
                checkpoint: self.headers.location().to_path_buf(),
            };
            self.fail(Self::missing_kind(&weight), &weight, error);
            return;
        }
        if !self.agrees(prefix, &weight, expect, stored) {
            return;
        }
        let convention = match stored {
            Stored::Nvfp4(convention) => convention,
            _ => {
                if self.dense(&weight, &FLOAT, &[out, input]) {
                    self.report.float_linears += 1;
                }
                return;
            }
        };
        let (codes, global, activation) = match convention {
            Convention::ModelOpt => ("weight", "weight_scale_2", "input_scale"),
            Convention::CompressedTensors => {
                ("weight_packed", "weight_global_scale", "input_global_scale")
            }
        };
        let codes = format!("{prefix}.{codes}");
        if input % 16 != 0 {
            let error = Error::invalid(
                &codes,
                format!("an NVFP4 linear needs K % 16 == 0, K = {input}"),
            );
            self.fail(ProblemKind::Shape, &codes, error);
            return;
        }
        let mut ok = self.dense(&codes, &[Dtype::U8], &[out, input / 2]);
        ok &= self.scale(
            &format!("{prefix}.weight_scale"),
            ProblemKind::ScaleMissing,
            |h| {
                h.expect_dtype(&[Dtype::F8_E4M3])?;
                h.expect_shape(&[out, input / 16])
            },
        );
        ok &= self.scale(
            &format!("{prefix}.{global}"),
            ProblemKind::ScaleMissing,
            |h| h.expect_f32_scalar(),
        );
        let activation = format!("{prefix}.{activation}");
        if self.activation_scales() || self.headers.contains(&activation) {
            ok &= self.scale(&activation, ProblemKind::ScaleMissing, |h| {
                h.expect_f32_scalar()
            });
        }
        if ok {
            self.report.nvfp4_linears += 1;
        }
    }

    /// A fused 3-D expert tensor `name` `[experts, rows, cols]`: float, or NVFP4 with
    /// per-expert scales (ModelOpt).
    fn fused(&mut self, name: &str, experts: usize, rows: usize, cols: usize) {
        let stored = self.stored_fused(name);
        let expect = self.expected(name);
        if stored == Stored::Absent {
            let error = Error::MissingTensor {
                tensor: name.to_string(),
                checkpoint: self.headers.location().to_path_buf(),
            };
            self.fail(Self::missing_kind(name), name, error);
            return;
        }
        if expect == Expect::Nvfp4(Convention::CompressedTensors) && stored == Stored::Float {
            let error = Error::invalid(
                format!("tensor `{name}`"),
                "fused 3-D experts in a compressed-tensors checkpoint: that convention has no fused-expert form, store the experts per expert",
            );
            self.fail(ProblemKind::NotQuantized, name, error);
            return;
        }
        if !self.agrees(name, name, expect, stored) {
            return;
        }
        if stored == Stored::Float {
            self.dense(name, &FLOAT, &[experts, rows, cols]);
            return;
        }
        if cols % 16 != 0 {
            let error = Error::invalid(name, format!("NVFP4 experts need K % 16 == 0, K = {cols}"));
            self.fail(ProblemKind::Shape, name, error);
            return;
        }
        let missing = ProblemKind::FusedExpertScaleMissing;
        let mut ok = self.dense(name, &[Dtype::U8], &[experts, rows, cols / 2]);
        ok &= self.scale(&format!("{name}_weight_scale"), missing, |h| {
            h.expect_dtype(&[Dtype::F8_E4M3])?;
            h.expect_shape(&[experts, rows, cols / 16])
        });
        ok &= self.scale(&format!("{name}_weight_scale_2"), missing, |h| {
            h.expect_dtype(&[Dtype::F32])?;
            h.expect_shape(&[experts])
                .map_err(|_| h.shape_error(&format!("[{experts}]: one global scale per expert")))
        });
        let activation = format!("{name}_input_scale");
        if self.activation_scales() || self.headers.contains(&activation) {
            ok &= self.scale(&activation, missing, |h| {
                h.expect_dtype(&[Dtype::F32])?;
                if h.shape == [experts] {
                    return Ok(());
                }
                h.expect_f32_scalar().map_err(|_| {
                    h.shape_error(&format!("[{experts}] (per expert) or a scalar (shared)"))
                })
            });
        }
        if ok {
            self.report.nvfp4_fused_experts += 1;
        }
    }

    /// A decoder layer's norms, mixer and MoE block under `p` (`model.layers.3.`).
    fn layer(&mut self, config: &ModelConfig, p: &str, kind: LayerKind, experts: ExpertLayout) {
        let h = config.hidden_size;
        self.dense(&format!("{p}input_layernorm.weight"), &FLOAT, &[h]);
        self.dense(&format!("{p}post_attention_layernorm.weight"), &FLOAT, &[h]);
        match kind {
            LayerKind::FullAttention => {
                let (heads, kv, hd) = (
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                );
                let q_rows = heads * hd * if config.attn_output_gate { 2 } else { 1 };
                self.linear(&format!("{p}self_attn.q_proj"), q_rows, h);
                self.linear(&format!("{p}self_attn.k_proj"), kv * hd, h);
                self.linear(&format!("{p}self_attn.v_proj"), kv * hd, h);
                self.linear(&format!("{p}self_attn.o_proj"), h, heads * hd);
                self.dense(&format!("{p}self_attn.q_norm.weight"), &FLOAT, &[hd]);
                self.dense(&format!("{p}self_attn.k_norm.weight"), &FLOAT, &[hd]);
            }
            LayerKind::LinearAttention => {
                let a = format!("{p}linear_attn.");
                let value_dim = config.linear_num_value_heads * config.linear_value_head_dim;
                let key_dim = config.linear_num_key_heads * config.linear_key_head_dim;
                let heads = config.linear_num_value_heads;
                match config.family {
                    Family::Qwen35Moe => {
                        self.linear(&format!("{a}in_proj_qkv"), config.linear_conv_dim(), h);
                        self.linear(&format!("{a}in_proj_z"), value_dim, h);
                        self.linear(&format!("{a}in_proj_b"), heads, h);
                        self.linear(&format!("{a}in_proj_a"), heads, h);
                    }
                    Family::Qwen3Next => {
                        self.linear(&format!("{a}in_proj_qkvz"), 2 * key_dim + 2 * value_dim, h);
                        self.linear(&format!("{a}in_proj_ba"), 2 * heads, h);
                    }
                }
                self.dense(
                    &format!("{a}conv1d.weight"),
                    &FLOAT,
                    &[config.linear_conv_dim(), 1, config.linear_conv_kernel_dim],
                );
                self.dense(&format!("{a}dt_bias"), &FLOAT, &[heads]);
                self.dense(&format!("{a}A_log"), &FLOAT, &[heads]);
                self.dense(
                    &format!("{a}norm.weight"),
                    &FLOAT,
                    &[config.linear_value_head_dim],
                );
                self.linear(&format!("{a}out_proj"), h, value_dim);
            }
        }
        self.moe(config, &format!("{p}mlp."), experts);
    }

    fn moe(&mut self, config: &ModelConfig, m: &str, experts: ExpertLayout) {
        let (h, e, i, s) = (
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        );
        self.dense(&format!("{m}gate.weight"), &FLOAT, &[e, h]);
        match experts {
            ExpertLayout::Fused => {
                self.fused(&format!("{m}experts.gate_up_proj"), e, 2 * i, h);
                self.fused(&format!("{m}experts.down_proj"), e, h, i);
            }
            ExpertLayout::PerExpert => {
                for expert in 0..e {
                    self.linear(&format!("{m}experts.{expert}.gate_proj"), i, h);
                    self.linear(&format!("{m}experts.{expert}.up_proj"), i, h);
                    self.linear(&format!("{m}experts.{expert}.down_proj"), h, i);
                }
            }
        }
        self.linear(&format!("{m}shared_expert.gate_proj"), s, h);
        self.linear(&format!("{m}shared_expert.up_proj"), s, h);
        self.linear(&format!("{m}shared_expert.down_proj"), h, s);
        self.dense(&format!("{m}shared_expert_gate.weight"), &FLOAT, &[1, h]);
    }
}

/// Checks every tensor `config` implies, under the quantisation config of the checkpoint's
/// folder (see [`QuantConfig::load`]).
///
/// # Errors
/// The first problem [`problems`] finds: [`Error::MissingTensor`], [`Error::Dtype`] or
/// [`Error::Shape`] naming tensor and file (a missing per-expert scale of fused NVFP4 experts
/// names the scale tensor); [`Error::Invalid`] for an MTP head that the config and the tensors
/// disagree on, `mtp.layers.*` without `mtp.fc.weight`, or a linear stored otherwise than the
/// exclusion list says; and the errors of [`QuantConfig::load`].
pub fn check(checkpoint: &Checkpoint, config: &ModelConfig) -> Result<WeightsReport> {
    let location = checkpoint.location();
    let dir = if location.is_dir() {
        location
    } else {
        location.parent().unwrap_or(location)
    };
    let quant = QuantConfig::load(dir)?;
    check_with(checkpoint, config, quant.as_ref())
}

/// [`check`] on any tensor headers, with the quantisation config given (None: a float
/// checkpoint, each linear taken as stored).
///
/// # Errors
/// As [`check`].
pub fn check_with(
    headers: &dyn TensorHeaders,
    config: &ModelConfig,
    quant: Option<&QuantConfig>,
) -> Result<WeightsReport> {
    let (report, problems) = problems(headers, config, quant);
    match problems.into_iter().next() {
        Some(problem) => Err(problem.error),
        None => Ok(report),
    }
}

/// Every problem of the tensors `config` implies (not only the first), and what was found.
pub fn problems(
    headers: &dyn TensorHeaders,
    config: &ModelConfig,
    quant: Option<&QuantConfig>,
) -> (WeightsReport, Vec<Problem>) {
    let prefix = if headers.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let h = config.hidden_size;
    let fused = headers.contains(&format!("{prefix}layers.0.mlp.experts.gate_up_proj"));
    let experts = if fused {
        ExpertLayout::Fused
    } else {
        ExpertLayout::PerExpert
    };
    let mut checker = Checker {
        headers,
        quant,
        report: WeightsReport {
            prefix: prefix.to_string(),
            experts,
            tensors: 0,
            nvfp4_linears: 0,
            float_linears: 0,
            mtp: false,
            nvfp4_fused_experts: 0,
        },
        problems: Vec::new(),
        mtp_not_excluded: None,
    };
    checker.dense(
        &format!("{prefix}embed_tokens.weight"),
        &FLOAT,
        &[config.vocab_size, h],
    );
    checker.dense(&format!("{prefix}norm.weight"), &FLOAT, &[h]);
    if !config.tie_word_embeddings {
        checker.linear("lm_head", config.vocab_size, h);
    }
    for (i, kind) in config.layer_types.iter().enumerate() {
        checker.layer(config, &format!("{prefix}layers.{i}."), *kind, experts);
    }
    let names = headers.names();
    let has_mtp_layers = names.iter().any(|n| n.starts_with("mtp.layers."));
    let has_mtp = names.iter().any(|n| n.starts_with("mtp."));
    let location = headers.location().display().to_string();
    let fc_missing = has_mtp_layers && !headers.contains("mtp.fc.weight");
    if fc_missing {
        checker.fail(
            ProblemKind::MtpFcMissing,
            "mtp.fc.weight",
            Error::invalid(
                format!("{location}: mtp.fc.weight"),
                "missing while mtp.layers.* exist: the MTP head cannot run (other engines leave it uninitialised and reject every draft)",
            ),
        );
    }
    match (config.mtp_num_hidden_layers, has_mtp) {
        (0, false) => {}
        (0, true) => checker.fail(
            ProblemKind::MtpWithoutConfig,
            "mtp.*",
            Error::invalid(
                format!("{location}: mtp.*"),
                "MTP tensors are present but the config declares no MTP layers (mtp_num_hidden_layers / num_nextn_predict_layers)",
            ),
        ),
        (n, false) => checker.fail(
            ProblemKind::ConfigWithoutMtp,
            "mtp.*",
            Error::invalid(
                format!("{location}: mtp.*"),
                format!(
                    "the config declares {n} MTP layer(s) but the checkpoint has no mtp.* tensors"
                ),
            ),
        ),
        (n, true) => {
            let before = checker.problems.len();
            if !fc_missing {
                checker.expected("mtp.fc");
                if headers
                    .header("mtp.fc.weight")
                    .is_some_and(|w| !FLOAT.contains(&w.dtype))
                {
                    checker.fail(
                        ProblemKind::MtpQuantized,
                        "mtp.fc.weight",
                        Error::invalid(
                            "tensor `mtp.fc.weight`",
                            "is quantised; it must stay BF16 (every NVFP4 export keeps it unquantised)",
                        ),
                    );
                } else {
                    checker.dense("mtp.fc.weight", &FLOAT, &[h, 2 * h]);
                }
            }
            for norm in [
                "mtp.pre_fc_norm_embedding.weight",
                "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight",
            ] {
                checker.dense(norm, &FLOAT, &[h]);
            }
            for layer in 0..n {
                let mtp_experts = if headers
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
                );
            }
            checker.report.mtp = checker.problems.len() == before && !fc_missing;
        }
    }
    if let (Some(module), Some(q)) = (checker.mtp_not_excluded.take(), quant) {
        checker.fail(
            ProblemKind::MtpNotExcluded,
            "mtp.*",
            Error::invalid(
                format!("{}: exclusion list", q.source),
                format!(
                    "does not exclude `{module}`: engines build the MTP head's linears as NVFP4 and misread its BF16 weights; add `mtp.*`"
                ),
            ),
        );
    }
    (checker.report, checker.problems)
}

/// The name of every linear stored as NVFP4 (2-D, either convention), found by its scale or
/// packed tensors: `model.visual.blocks.0.attn.qkv` for `...qkv.weight_scale`. Fused expert
/// tensors are not included.
pub fn nvfp4_linears(headers: &dyn TensorHeaders) -> Vec<String> {
    const SUFFIXES: [&str; 6] = [
        ".weight_scale",
        ".weight_scale_2",
        ".input_scale",
        ".weight_packed",
        ".weight_global_scale",
        ".input_global_scale",
    ];
    let mut prefixes: Vec<String> = headers
        .names()
        .into_iter()
        .filter_map(|name| {
            SUFFIXES
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .map(str::to_string)
        })
        .collect();
    prefixes.sort();
    prefixes.dedup();
    prefixes
}

/// The problems of the NVFP4 linear `prefix` alone, its shape taken from its own tensors (what
/// `fp4spec doctor` runs on quantised linears the config does not imply, such as a vision
/// tower's): missing or mis-shaped scales, and disagreement with the exclusion list.
pub fn linear_problems(
    headers: &dyn TensorHeaders,
    prefix: &str,
    quant: Option<&QuantConfig>,
) -> Vec<Problem> {
    let mut checker = Checker {
        headers,
        quant,
        report: WeightsReport {
            prefix: String::new(),
            experts: ExpertLayout::PerExpert,
            tensors: 0,
            nvfp4_linears: 0,
            float_linears: 0,
            mtp: false,
            nvfp4_fused_experts: 0,
        },
        problems: Vec::new(),
        mtp_not_excluded: None,
    };
    let codes = [
        format!("{prefix}.weight_packed"),
        format!("{prefix}.weight"),
    ];
    let from_codes = codes
        .iter()
        .filter_map(|n| headers.header(n))
        .find(|h| h.dtype == Dtype::U8)
        .and_then(|h| h.expect_rank::<2>().ok())
        .and_then(|[rows, half]| Some((rows, half.checked_mul(2)?)));
    let from_scales = headers
        .header(&format!("{prefix}.weight_scale"))
        .and_then(|h| h.expect_rank::<2>().ok())
        .and_then(|[rows, blocks]| Some((rows, blocks.checked_mul(16)?)));
    match from_codes.or(from_scales) {
        Some((out, input)) => checker.linear(prefix, out, input),
        None => {
            let weight = format!("{prefix}.weight");
            let error = Error::invalid(
                format!("NVFP4 linear `{prefix}`"),
                "has scale tensors but no 2-D packed weight (`weight` U8 or `weight_packed`) and no 2-D weight_scale to size it by",
            );
            checker.fail(Checker::missing_kind(&weight), &weight, error);
        }
    }
    checker.problems
}
