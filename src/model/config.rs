//! `config.json` of a Qwen3.5-MoE / Qwen3.6 checkpoint (text-only, or the vision-language
//! wrapper with the language fields under `text_config`) or of Qwen3-Next (flat, MTP depth in
//! `num_nextn_predict_layers`). Every field the runner uses is read and checked here; a missing,
//! mistyped or inconsistent field is an error naming it (`text_config.num_key_value_heads`).

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Which model family (and so which tensor layout and MTP class) a checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Qwen3.5-MoE / Qwen3.6 (`qwen3_5_moe`, `qwen3_5_moe_text`): fused 3-D experts in the main
    /// layers, separate GDN projections, MTP class `qwen3_5_mtp`.
    Qwen35Moe,
    /// Qwen3-Next (`qwen3_next`): per-expert tensors, fused `in_proj_qkvz` / `in_proj_ba`, MTP
    /// class `qwen3_next_mtp`.
    Qwen3Next,
}

impl Family {
    /// The MTP implementation a server must use for this family (the other gives ~0% acceptance).
    pub fn mtp_class(self) -> &'static str {
        match self {
            Family::Qwen35Moe => "qwen3_5_mtp",
            Family::Qwen3Next => "qwen3_next_mtp",
        }
    }
}

/// What a decoder layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet linear attention (`linear_attention`).
    LinearAttention,
    /// Gated full attention (`full_attention`).
    FullAttention,
}

/// The language model's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub family: Family,
    /// Whether the checkpoint is the vision-language wrapper (fields under `text_config`).
    pub vision_language: bool,
    /// Hidden size (2048 in Qwen3.6-35B-A3B).
    pub hidden_size: usize,
    /// One entry per decoder layer.
    pub layer_types: Vec<LayerKind>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Routed experts per MoE block.
    pub num_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Intermediate size of one routed expert.
    pub moe_intermediate_size: usize,
    /// Intermediate size of the shared expert.
    pub shared_expert_intermediate_size: usize,
    /// Query heads of full attention.
    pub num_attention_heads: usize,
    /// Key/value heads of full attention.
    pub num_key_value_heads: usize,
    /// Head dimension of full attention.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Fraction of `head_dim` that is rotated.
    pub partial_rotary_factor: f64,
    /// Gated DeltaNet key heads.
    pub linear_num_key_heads: usize,
    /// Gated DeltaNet value heads.
    pub linear_num_value_heads: usize,
    /// Gated DeltaNet key head dimension.
    pub linear_key_head_dim: usize,
    /// Gated DeltaNet value head dimension.
    pub linear_value_head_dim: usize,
    /// Depthwise causal conv kernel size.
    pub linear_conv_kernel_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether full attention has the sigmoid output gate (q_proj twice as wide).
    pub attn_output_gate: bool,
    /// MTP decoder layers (0: no MTP head).
    pub mtp_num_hidden_layers: usize,
    /// Whether lm_head shares the embedding.
    pub tie_word_embeddings: bool,
    /// End-of-sequence token ids (`eos_token_id`, a number or a list; empty when absent).
    pub eos_token_ids: Vec<u32>,
}

/// The largest value accepted for each size in a config.json: far past any model of the family
/// (Qwen3.6-35B-A3B: 40 layers, 256 experts, hidden 2048, vocabulary 248320, head_dim 256, GDN
/// heads of 128), and small enough that every product of them the runner forms (a weight's
/// elements, a sequence's caches, a launch's grid) fits in 64 bits, so a corrupt file is refused
/// here, naming the field, before anything is sized from it.
pub mod limits {
    /// `num_hidden_layers`, and `full_attention_interval`.
    pub const LAYERS: usize = 1024;
    /// `mtp_num_hidden_layers` / `num_nextn_predict_layers`.
    pub const MTP_LAYERS: usize = 16;
    /// `hidden_size`, `moe_intermediate_size`, `shared_expert_intermediate_size`.
    pub const WIDTH: usize = 1 << 16;
    /// `vocab_size`.
    pub const VOCABULARY: usize = 1 << 22;
    /// `num_experts` (and so `num_experts_per_tok`).
    pub const EXPERTS: usize = 4096;
    /// Attention and Gated DeltaNet head counts.
    pub const HEADS: usize = 256;
    /// Attention and Gated DeltaNet head dimensions.
    pub const HEAD_DIM: usize = 1024;
    /// `linear_conv_kernel_dim`.
    pub const CONV_KERNEL: usize = 64;
}

/// Where a field is read from, for error messages (`config.json: text_config.hidden_size`).
#[derive(Clone, Copy)]
struct Fields<'a> {
    file: &'a Path,
    prefix: &'static str,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn name(&self, field: &str) -> String {
        format!("{}: {}{field}", self.file.display(), self.prefix)
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    /// A positive integer of at most `most` (one of [`limits`]).
    fn positive(&self, field: &str, most: usize) -> Result<usize> {
        let value = self
            .get(field)
            .ok_or_else(|| Error::invalid(self.name(field), "missing"))?;
        match value.as_u64() {
            Some(v) if v > 0 => self.at_most(field, v, most),
            _ => Err(Error::invalid(
                self.name(field),
                format!("must be a positive integer, found {value}"),
            )),
        }
    }

    /// A non-negative integer of at most `most`; `default` when absent.
    fn count_or(&self, field: &str, default: usize, most: usize) -> Result<usize> {
        match self.get(field) {
            None => Ok(default),
            Some(value) => match value.as_u64() {
                Some(v) => self.at_most(field, v, most),
                None => Err(Error::invalid(
                    self.name(field),
                    format!("must be a non-negative integer, found {value}"),
                )),
            },
        }
    }

    fn at_most(&self, field: &str, v: u64, most: usize) -> Result<usize> {
        usize::try_from(v)
            .ok()
            .filter(|&v| v <= most)
            .ok_or_else(|| {
                Error::invalid(
                    self.name(field),
                    format!("{v} is more than this crate accepts ({most})"),
                )
            })
    }

    fn number(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                _ => Err(Error::invalid(
                    self.name(field),
                    format!("must be a positive number, found {value}"),
                )),
            },
        }
    }

    /// A token id or a list of them; empty when absent.
    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let bad = |value: &Value| {
            Error::invalid(
                self.name(field),
                format!("must be a token id or a list of them, found {value}"),
            )
        };
        let id = |value: &Value| {
            value
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| bad(value))
        };
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(list)) => list.iter().map(id).collect(),
            Some(value) => Ok(vec![id(value)?]),
        }
    }

    fn flag_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(value) => value.as_bool().ok_or_else(|| {
                Error::invalid(
                    self.name(field),
                    format!("must be true or false, found {value}"),
                )
            }),
        }
    }
}

/// The language fields of Qwen3.6-35B-A3B as its config.json has them (the vision-language
/// wrapper; ../shared/reference/qwen3_5_moe.md): the default model of the roofline and of
/// synthetic full-size weights.
pub const QWEN36_35B_A3B_CONFIG: &str = r#"{
  "model_type": "qwen3_5_moe",
  "architectures": ["Qwen3_5MoeForConditionalGeneration"],
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": true},
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "vocab_size": 248320, "rms_norm_eps": 1e-6, "attn_output_gate": true,
    "mtp_num_hidden_layers": 1, "mamba_ssm_dtype": "float32"
  }
}"#;

/// Model types this crate runs, as `config.json` spells them.
pub const KNOWN_MODEL_TYPES: [&str; 3] = ["qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"];

impl ModelConfig {
    /// Qwen3.6-35B-A3B ([`QWEN36_35B_A3B_CONFIG`]).
    pub fn qwen36_35b_a3b() -> Self {
        // a constant of this crate, parsed by the tests: failing here is a build defect
        Self::parse(QWEN36_35B_A3B_CONFIG, Path::new("QWEN36_35B_A3B_CONFIG"))
            .expect("the embedded Qwen3.6-35B-A3B config parses")
    }

    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, else as [`ModelConfig::parse`].
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let path: PathBuf = dir.as_ref().join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::parse(&text, &path)
    }

    /// Parses the text of a `config.json`; `file` names it in errors.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the file and field: not JSON, an unknown `model_type`, a
    /// missing or mistyped field, or fields that disagree (`layer_types` against
    /// `num_hidden_layers`, heads that do not divide, more experts per token than experts, a
    /// rotary dimension that is not an even number of dimensions).
    pub fn parse(text: &str, file: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| {
            Error::invalid(file.display().to_string(), format!("not valid JSON: {e}"))
        })?;
        let root = root
            .as_object()
            .ok_or_else(|| Error::invalid(file.display().to_string(), "is not a JSON object"))?;
        let top = Fields {
            file,
            prefix: "",
            map: root,
        };
        let model_type = top
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Error::invalid(
                    top.name("model_type"),
                    format!(
                        "missing or not a string (known: {})",
                        KNOWN_MODEL_TYPES.join(", ")
                    ),
                )
            })?;
        let (family, fields, vision_language) = match model_type {
            "qwen3_next" => (Family::Qwen3Next, top, false),
            "qwen3_5_moe_text" => (Family::Qwen35Moe, top, false),
            "qwen3_5_moe" => match root.get("text_config") {
                Some(Value::Object(text_config)) => (
                    Family::Qwen35Moe,
                    Fields {
                        file,
                        prefix: "text_config.",
                        map: text_config,
                    },
                    true,
                ),
                Some(other) => {
                    return Err(Error::invalid(
                        top.name("text_config"),
                        format!("must be an object, found {other}"),
                    ));
                }
                None => (Family::Qwen35Moe, top, false),
            },
            other => {
                return Err(Error::invalid(
                    top.name("model_type"),
                    format!(
                        "`{other}` is not a model this crate runs (known: {})",
                        KNOWN_MODEL_TYPES.join(", ")
                    ),
                ));
            }
        };
        let f = &fields;
        let num_hidden_layers = f.positive("num_hidden_layers", limits::LAYERS)?;
        let layer_types = layer_types(f, num_hidden_layers)?;
        let rope = f.get("rope_parameters").and_then(Value::as_object);
        let rope_fields = rope.map(|map| Fields {
            file,
            prefix: if vision_language {
                "text_config.rope_parameters."
            } else {
                "rope_parameters."
            },
            map,
        });
        let from_rope = |field: &str| -> Result<Option<f64>> {
            match &rope_fields {
                Some(r) => match r.number(field)? {
                    Some(v) => Ok(Some(v)),
                    None => f.number(field),
                },
                None => f.number(field),
            }
        };
        let mtp_field = match family {
            Family::Qwen35Moe => "mtp_num_hidden_layers",
            Family::Qwen3Next => "num_nextn_predict_layers",
        };
        let config = Self {
            family,
            vision_language,
            hidden_size: f.positive("hidden_size", limits::WIDTH)?,
            layer_types,
            vocab_size: f.positive("vocab_size", limits::VOCABULARY)?,
            num_experts: f.positive("num_experts", limits::EXPERTS)?,
            num_experts_per_tok: f.positive("num_experts_per_tok", limits::EXPERTS)?,
            moe_intermediate_size: f.positive("moe_intermediate_size", limits::WIDTH)?,
            shared_expert_intermediate_size: f
                .positive("shared_expert_intermediate_size", limits::WIDTH)?,
            num_attention_heads: f.positive("num_attention_heads", limits::HEADS)?,
            num_key_value_heads: f.positive("num_key_value_heads", limits::HEADS)?,
            head_dim: f.positive("head_dim", limits::HEAD_DIM)?,
            rope_theta: from_rope("rope_theta")?.ok_or_else(|| {
                Error::invalid(
                    f.name("rope_parameters.rope_theta"),
                    "missing (nor rope_theta)",
                )
            })?,
            partial_rotary_factor: from_rope("partial_rotary_factor")?.unwrap_or(1.0),
            linear_num_key_heads: f.positive("linear_num_key_heads", limits::HEADS)?,
            linear_num_value_heads: f.positive("linear_num_value_heads", limits::HEADS)?,
            linear_key_head_dim: f.positive("linear_key_head_dim", limits::HEAD_DIM)?,
            linear_value_head_dim: f.positive("linear_value_head_dim", limits::HEAD_DIM)?,
            linear_conv_kernel_dim: f.positive("linear_conv_kernel_dim", limits::CONV_KERNEL)?,
            rms_norm_eps: f
                .number("rms_norm_eps")?
                .ok_or_else(|| Error::invalid(f.name("rms_norm_eps"), "missing"))?,
            attn_output_gate: f.flag_or("attn_output_gate", true)?,
            mtp_num_hidden_layers: f.count_or(mtp_field, 0, limits::MTP_LAYERS)?,
            tie_word_embeddings: top.flag_or("tie_word_embeddings", false)?
                || f.flag_or("tie_word_embeddings", false)?,
            eos_token_ids: match f.token_ids("eos_token_id")? {
                ids if ids.is_empty() => top.token_ids("eos_token_id")?,
                ids => ids,
            },
        };
        config.check(f)?;
        Ok(config)
    }

    fn check(&self, f: &Fields<'_>) -> Result<()> {
        if !self.attn_output_gate {
            return Err(Error::invalid(
                f.name("attn_output_gate"),
                "false: the runner and the attention kernels implement the gated attention of \
                 Qwen3.5 / 3.6 and Qwen3-Next only",
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(Error::invalid(
                f.name("num_key_value_heads"),
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(Error::invalid(
                f.name("linear_num_key_heads"),
                format!(
                    "{} does not divide linear_num_value_heads {}",
                    self.linear_num_key_heads, self.linear_num_value_heads
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(Error::invalid(
                f.name("num_experts_per_tok"),
                format!(
                    "{} is more than num_experts {}",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        let rotary = self.partial_rotary_factor * self.head_dim as f64;
        if self.partial_rotary_factor > 1.0
            || rotary.fract() != 0.0
            || rotary as usize % 2 != 0
            || rotary == 0.0
        {
            return Err(Error::invalid(
                f.name("partial_rotary_factor"),
                format!(
                    "{} of head_dim {} is {rotary} dimensions; RoPE needs an even, positive count",
                    self.partial_rotary_factor, self.head_dim
                ),
            ));
        }
        Ok(())
    }

    /// Decoder layers.
    pub fn num_hidden_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Dimensions RoPE rotates in each attention head (64 of 256 in Qwen3.6-35B-A3B).
    pub fn rotary_dim(&self) -> usize {
        (self.partial_rotary_factor * self.head_dim as f64) as usize
    }

    /// Width of the GDN conv / qkv projection: `2 * key heads * dk + value heads * dv`.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Layers of each kind: (Gated DeltaNet, full attention).
    pub fn layer_counts(&self) -> (usize, usize) {
        let full = self
            .layer_types
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count();
        (self.layer_types.len() - full, full)
    }
}

/// `layer_types` as given (checked against `num_hidden_layers`), else derived from
/// `full_attention_interval`: layer i is full attention when (i + 1) % interval == 0.
fn layer_types(f: &Fields<'_>, layers: usize) -> Result<Vec<LayerKind>> {
    if let Some(value) = f.get("layer_types") {
        let list = value.as_array().ok_or_else(|| {
            Error::invalid(
                f.name("layer_types"),
                format!("must be a list, found {value}"),
            )
        })?;
        if list.len() != layers {
            return Err(Error::invalid(
                f.name("layer_types"),
                format!("{} entries, but num_hidden_layers is {layers}", list.len()),
            ));
        }
        return list
            .iter()
            .enumerate()
            .map(|(i, kind)| match kind.as_str() {
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                Some("full_attention") => Ok(LayerKind::FullAttention),
                _ => Err(Error::invalid(
                    format!("{}[{i}]", f.name("layer_types")),
                    format!("{kind} is neither `linear_attention` nor `full_attention`"),
                )),
            })
            .collect();
    }
    let interval = f.positive("full_attention_interval", limits::LAYERS).map_err(|_| {
        Error::invalid(f.name("layer_types"), "missing, and full_attention_interval (to derive it from) is missing or not a positive integer")
    })?;
    Ok((0..layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect())
}
