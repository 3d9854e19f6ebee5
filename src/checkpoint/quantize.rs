//! `fp4spec quantize --model DIR --out OUT`: a BF16 (or F16/F32) checkpoint to NVFP4, the way
//! NVIDIA ModelOpt quantises weights ([`Nvfp4Matrix::quantize_with_global_scale`] with
//! [`modelopt_global_scale`]), written as ModelOpt or compressed-tensors checkpoints read.
//!
//! Streaming: tensors are read from the memory-mapped input a piece at a time (a block of rows
//! of a 2-D linear, one expert of a fused 3-D tensor), pieces are quantised in parallel (one per
//! thread) and written at once; what is held is a few pieces plus the block scales of the tensor
//! being written (1/32 of its BF16 size), never the model. Output shards mirror the input's.
//!
//! What is quantised: every 2-D `X.weight` and every fused expert tensor
//! (`...experts.gate_up_proj` `[E, 2I, H]`, `...experts.down_proj` `[E, H, I]`) whose module the
//! exclusion list does not exclude; [`DEFAULT_EXCLUDE`] keeps `lm_head`, the embeddings, the
//! Gated DeltaNet projections, the routers, the shared-expert gates, the MTP head and the vision
//! tower in their float dtype, as ModelOpt's NVFP4 exports of this family do. A linear whose
//! input width is not a multiple of 16 is added to the exclusion list by name. Everything else
//! (norms, conv weights, `A_log`, `dt_bias`) is copied byte for byte. The exclusion list is
//! written (`hf_quant_config.json` and `config.json` `quantization_config` for ModelOpt,
//! `quantization_config.ignore` for compressed-tensors).
//!
//! Global scales: `weight_scale_2 = amax / (6 * 448)` per linear, per expert for fused experts
//! (gate and up share one, as the fused tensor is one slice per expert). Linears that engines
//! fuse at load share one: q/k/v of an attention layer, gate/up of the shared expert and of each
//! per-expert expert, in_proj_qkv/in_proj_z and in_proj_b/in_proj_a of a GDN layer (when not
//! excluded) — engines keep a single global scale per fused linear, so different ones would be
//! misread.
//!
//! Activation scales (`input_scale`, W4A4 only): `amax / (6 * 448)` with amax from the
//! calibration file when it names the module, else [`DEFAULT_INPUT_AMAX`] = 6 * 448, i.e.
//! `input_scale = 1.0`: every block's E4M3 scale holds its amax / 6 directly, which keeps blocks
//! with amax from 0.094 to 2688 in E4M3's normal range with no clipping. Calibrate for better
//! small-activation precision. Linears fused at load take the largest amax of their group (they
//! read the same input).
//!
//! Layouts: ModelOpt keeps fused experts fused, with per-expert scales (`P`, `P_weight_scale`
//! `[E, R, C/16]`, `P_weight_scale_2` `[E]`, `P_input_scale` `[E]`), unless `split_experts`
//! asks for per-expert 2-D linears (`experts.{e}.gate_proj`, ...; what older loaders read).
//! compressed-tensors has no fused-expert form, so it always splits.
//!
//! The written checkpoint is read back and checked with [`weights::check`] (the runner's check)
//! before it is renamed into place.

use super::atomic::{StagedDir, check_cancelled};
use crate::error::{Error, Result};
use crate::formats::nvfp4::{BLOCK, Nvfp4Matrix, modelopt_global_scale};
use crate::formats::quant_config::{self, Convention, QuantConfig, fnmatch};
use crate::formats::safetensors::{
    Checkpoint, PlannedTensor, SINGLE_FILE, ShardWriter, TensorHeaders, TensorRef,
};
use crate::model::config::ModelConfig;
use crate::model::weights;
use indicatif::ProgressBar;
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Exclusion entries every quantisation starts from (fnmatch wildcards, module names).
pub const DEFAULT_EXCLUDE: [&str; 7] = [
    "lm_head",
    "*embed_tokens",
    "*linear_attn*",
    "*mlp.gate",
    "*shared_expert_gate",
    "mtp.*",
    "*visual*",
];

/// Activation amax used where the calibration file says nothing: 6 * 448, so
/// `input_scale = 1.0`.
pub const DEFAULT_INPUT_AMAX: f32 = 2688.0;

/// Elements quantised per piece of a 2-D linear (rounded to whole rows).
const PIECE_ELEMENTS: usize = 1 << 20;

/// Measured activation amax per module: a JSON object mapping a module name or an fnmatch
/// pattern to a number, or (fused experts) to a list of one number per expert:
/// `{"model.layers.3.self_attn.q_proj": 11.5, "*mlp.experts.gate_up_proj": [3.1, ...]}`.
/// An exact name wins over patterns; among patterns the first in the file wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    entries: Vec<(String, Vec<f32>)>,
}

impl Calibration {
    /// Parses the JSON text; `source` names it in errors.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the entry: not an object, a value that is not a positive
    /// finite number or a non-empty list of them.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(source, format!("not valid JSON: {e}")))?;
        let object = value.as_object().ok_or_else(|| {
            Error::invalid(source, "must be an object of module -> activation amax")
        })?;
        let mut entries = Vec::new();
        for (key, v) in object {
            let numbers: Option<Vec<f64>> = match v {
                serde_json::Value::Array(items) if !items.is_empty() => {
                    items.iter().map(serde_json::Value::as_f64).collect()
                }
                other => other.as_f64().map(|x| vec![x]),
            };
            // checked as the f32 the scales are written in: 1e39 would become infinite and 1e-50
            // zero (then replaced by the default) after the narrowing
            let numbers = numbers
                .map(|n| n.into_iter().map(|x| x as f32).collect::<Vec<f32>>())
                .filter(|n| n.iter().all(|x| x.is_finite() && *x > 0.0))
                .ok_or_else(|| {
                    Error::invalid(
                        format!("{source}: `{key}`"),
                        format!(
                            "{v} is not a positive number or a list of them within f32's range"
                        ),
                    )
                })?;
            entries.push((key.clone(), numbers));
        }
        Ok(Self { entries })
    }

    /// Reads and parses `path`.
    ///
    /// # Errors
    /// [`Error::Io`], or as [`Calibration::parse`].
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The amax values for `module`, if the file names it.
    pub fn lookup(&self, module: &str) -> Option<&[f32]> {
        self.entries
            .iter()
            .find(|(key, _)| key == module)
            .or_else(|| self.entries.iter().find(|(key, _)| fnmatch(key, module)))
            .map(|(_, values)| values.as_slice())
    }
}

/// What to quantise and how.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// The float checkpoint folder.
    pub model: PathBuf,
    /// The new checkpoint folder (must not exist).
    pub out: PathBuf,
    /// Tensor naming of the output.
    pub convention: Convention,
    /// Weights only (`W4A16_NVFP4`): no activation scales.
    pub weights_only: bool,
    /// Exclusion entries beyond [`DEFAULT_EXCLUDE`].
    pub exclude: Vec<String>,
    /// Measured activation amax, if any.
    pub calibration: Option<Calibration>,
    /// Activation amax where the calibration says nothing.
    pub default_input_amax: f32,
    /// ModelOpt only: write fused experts as per-expert 2-D linears.
    pub split_experts: bool,
}

impl QuantizeOptions {
    /// ModelOpt NVFP4 (W4A4) of `model` into `out` with the defaults.
    pub fn new(model: impl Into<PathBuf>, out: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            out: out.into(),
            convention: Convention::ModelOpt,
            weights_only: false,
            exclude: Vec::new(),
            calibration: None,
            default_input_amax: DEFAULT_INPUT_AMAX,
            split_experts: false,
        }
    }
}

/// The quantisation error of one input tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorError {
    /// The linear (`...q_proj`) or fused expert tensor.
    pub tensor: String,
    /// Its input shape.
    pub shape: Vec<usize>,
    /// `||W - deq(Q(W))|| / ||W||` over the whole tensor (0 for an all-zero tensor).
    pub relative_rms: f64,
    /// Largest `|W - deq(Q(W))|`.
    pub max_abs_error: f32,
    /// Largest `|W|`.
    pub amax: f32,
    /// Fused experts: the expert with the largest relative error, and that error.
    pub worst_expert: Option<(usize, f64)>,
    /// The activation scale written (first expert's for fused experts); None for W4A16.
    pub input_scale: Option<f32>,
    /// Whether the activation scale came from the calibration file.
    pub calibrated: bool,
}

/// What the quantisation did.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizeReport {
    /// The new checkpoint.
    pub out: PathBuf,
    /// Tensor naming written.
    pub convention: Convention,
    /// `NVFP4` or `W4A16_NVFP4`.
    pub quant_algo: String,
    /// The exclusion list written.
    pub exclude_modules: Vec<String>,
    /// Modules added to it because their input width is not a multiple of 16.
    pub auto_excluded: Vec<String>,
    /// Every quantised tensor and its error.
    pub quantized: Vec<TensorError>,
    /// Tensors copied unchanged.
    pub copied: usize,
    /// Bytes of tensor data read.
    pub input_bytes: u64,
    /// Bytes of the output shards.
    pub output_bytes: u64,
}

impl QuantizeReport {
    /// Relative RMS error over all quantised tensors, weighted by their size.
    pub fn overall_relative_rms(&self) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for t in &self.quantized {
            let n = t.shape.iter().product::<usize>() as f64;
            num += t.relative_rms * t.relative_rms * n;
            den += n;
        }
        if den > 0.0 { (num / den).sqrt() } else { 0.0 }
    }
}

/// What happens to one input tensor.
#[derive(Debug, Clone)]
enum Action {
    Copy,
    /// A 2-D linear `[rows, cols]`; `module` is its name without `.weight`.
    Linear {
        module: String,
        rows: usize,
        cols: usize,
    },
    /// A fused expert tensor `[experts, rows, cols]`; `gate_up` when rows are [gate; up].
    Fused {
        experts: usize,
        rows: usize,
        cols: usize,
        gate_up: bool,
    },
}

/// Squared-error sums of quantised values.
#[derive(Debug, Clone, Copy, Default)]
struct ErrorSums {
    error: f64,
    norm: f64,
    max_abs_error: f32,
    amax: f32,
}

impl ErrorSums {
    fn of(values: &[f32], quantised: &[f32]) -> Self {
        let mut sums = Self::default();
        for (v, q) in values.iter().zip(quantised) {
            let e = (v - q).abs();
            sums.error += (e as f64) * (e as f64);
            sums.norm += (*v as f64) * (*v as f64);
            sums.max_abs_error = sums.max_abs_error.max(e);
            sums.amax = sums.amax.max(v.abs());
        }
        sums
    }

    fn add(&mut self, other: &Self) {
        self.error += other.error;
        self.norm += other.norm;
        self.max_abs_error = self.max_abs_error.max(other.max_abs_error);
        self.amax = self.amax.max(other.amax);
    }

    fn relative(&self) -> f64 {
        if self.norm > 0.0 {
            (self.error / self.norm).sqrt()
        } else {
            0.0
        }
    }
}

/// One quantised piece: packed nibbles, block scales, and its error.
struct Piece {
    packed: Vec<u8>,
    scales: Vec<u8>,
    sums: ErrorSums,
}

/// The scales one NVFP4 matrix is written with.
#[derive(Debug, Clone, Copy)]
struct Scales {
    /// The multiplier quantisation used (what a loader reconstructs).
    global: f32,
    /// What is stored: `weight_scale_2` (ModelOpt) or `weight_global_scale` = 1 / global.
    stored_global: f32,
    /// `input_scale` (ModelOpt) / 1 / `input_global_scale`, when activations are quantised.
    input: Option<f32>,
    calibrated: bool,
}

struct Plan<'a> {
    opts: &'a QuantizeOptions,
    quant: QuantConfig,
    actions: HashMap<String, Action>,
    group_amax: HashMap<String, f32>,
    /// The quantised linears of each fusion group (they read one input).
    group_members: HashMap<String, Vec<String>>,
}

/// The fusion group engines load `module` into, if any (`...self_attn.qkv`).
fn fusion_group(module: &str) -> Option<String> {
    let (parent, leaf) = module.rsplit_once('.')?;
    let group = match leaf {
        "q_proj" | "k_proj" | "v_proj" if parent.ends_with("self_attn") => "qkv",
        "gate_proj" | "up_proj" => "gate_up",
        "in_proj_qkv" | "in_proj_z" => "in_proj_qkvz",
        "in_proj_b" | "in_proj_a" => "in_proj_ba",
        _ => return None,
    };
    Some(format!("{parent}.{group}"))
}

const FLOAT: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

impl Plan<'_> {
    fn action(&self, name: &str) -> &Action {
        self.actions.get(name).unwrap_or(&Action::Copy)
    }

    /// The output tensors of input tensor `name`.
    fn outputs(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Vec<PlannedTensor> {
        let activation = !self.opts.weights_only;
        let linear = |module: &str, rows: usize, cols: usize| -> Vec<PlannedTensor> {
            let (codes, global, input) = match self.opts.convention {
                Convention::ModelOpt => ("weight", "weight_scale_2", "input_scale"),
                Convention::CompressedTensors => {
                    ("weight_packed", "weight_global_scale", "input_global_scale")
                }
            };
            let scalar = match self.opts.convention {
                Convention::ModelOpt => vec![],
                Convention::CompressedTensors => vec![1],
            };
            let mut v = vec![
                PlannedTensor::new(format!("{module}.{codes}"), Dtype::U8, vec![rows, cols / 2]),
                PlannedTensor::new(
                    format!("{module}.weight_scale"),
                    Dtype::F8_E4M3,
                    vec![rows, cols / BLOCK],
                ),
                PlannedTensor::new(format!("{module}.{global}"), Dtype::F32, scalar.clone()),
            ];
            if activation {
                v.push(PlannedTensor::new(
                    format!("{module}.{input}"),
                    Dtype::F32,
                    scalar,
                ));
            }
            v
        };
        match self.action(name) {
            Action::Copy => vec![PlannedTensor::new(name, dtype, shape.to_vec())],
            Action::Linear { module, rows, cols } => linear(module, *rows, *cols),
            Action::Fused {
                experts,
                rows,
                cols,
                gate_up,
            } => {
                if self.splits() {
                    let base = expert_base(name);
                    let mut v = Vec::new();
                    for e in 0..*experts {
                        if *gate_up {
                            v.extend(linear(&format!("{base}{e}.gate_proj"), rows / 2, *cols));
                            v.extend(linear(&format!("{base}{e}.up_proj"), rows / 2, *cols));
                        } else {
                            v.extend(linear(&format!("{base}{e}.down_proj"), *rows, *cols));
                        }
                    }
                    v
                } else {
                    let mut v = vec![
                        PlannedTensor::new(name, Dtype::U8, vec![*experts, *rows, cols / 2]),
                        PlannedTensor::new(
                            format!("{name}_weight_scale"),
                            Dtype::F8_E4M3,
                            vec![*experts, *rows, cols / BLOCK],
                        ),
                        PlannedTensor::new(
                            format!("{name}_weight_scale_2"),
                            Dtype::F32,
                            vec![*experts],
                        ),
                    ];
                    if activation {
                        v.push(PlannedTensor::new(
                            format!("{name}_input_scale"),
                            Dtype::F32,
                            vec![*experts],
                        ));
                    }
                    v
                }
            }
        }
    }

    fn splits(&self) -> bool {
        self.opts.split_experts || self.opts.convention == Convention::CompressedTensors
    }

    /// The scales of a matrix whose weights have largest magnitude `amax`, reading the
    /// activation amax of `module` (expert `expert` of a fused tensor).
    fn scales(&self, module: &str, amax: f32, expert: Option<usize>) -> Result<Scales> {
        let global = modelopt_global_scale(amax);
        let (global, stored_global) = match self.opts.convention {
            Convention::ModelOpt => (global, global),
            Convention::CompressedTensors => {
                let inverted = 1.0 / global;
                (1.0 / inverted, inverted)
            }
        };
        let mut calibrated = false;
        let input = if self.opts.weights_only {
            None
        } else {
            let single = [module.to_string()];
            let members: &[String] = match fusion_group(module) {
                Some(group) => self
                    .group_members
                    .get(&group)
                    .map_or(&single, Vec::as_slice),
                None => &single,
            };
            let mut amax_in: Option<f32> = None;
            for member in members
                .iter()
                .map(String::as_str)
                .chain([module])
                .filter(|_| self.opts.calibration.is_some())
            {
                if let Some(values) = self
                    .opts
                    .calibration
                    .as_ref()
                    .and_then(|c| c.lookup(member))
                {
                    let value = match (values.len(), expert) {
                        (1, _) => values[0],
                        (_, Some(e)) if e < values.len() => values[e],
                        (n, _) => {
                            return Err(Error::invalid(
                                format!("calibration entry for `{member}`"),
                                format!(
                                    "{n} values: give one, or one per expert of a fused tensor"
                                ),
                            ));
                        }
                    };
                    amax_in = Some(amax_in.map_or(value, |a: f32| a.max(value)));
                }
            }
            calibrated = amax_in.is_some();
            Some(modelopt_global_scale(
                amax_in.unwrap_or(self.opts.default_input_amax),
            ))
        };
        Ok(Scales {
            global,
            stored_global,
            input,
            calibrated,
        })
    }
}

/// `...mlp.experts.` of `...mlp.experts.gate_up_proj`: where per-expert names start.
fn expert_base(name: &str) -> String {
    match name.rsplit_once('.') {
        Some((base, _)) => format!("{base}."),
        None => String::new(),
    }
}

/// Quantises `opts.model` into `opts.out`; `progress` counts the input bytes processed.
///
/// # Errors
/// [`Error::Checkpoint`] when OUT exists; [`Error::Invalid`] for an input that is already
/// quantised, a NaN or infinite weight (naming tensor and element), a malformed calibration
/// entry; the errors of opening the input and writing the output. Nothing is left at OUT on
/// error.
pub fn quantize(opts: &QuantizeOptions, progress: &ProgressBar) -> Result<QuantizeReport> {
    if opts.out.symlink_metadata().is_ok() {
        return Err(Error::Checkpoint {
            path: opts.out.clone(),
            reason: "already exists; refusing to overwrite it (choose a new output folder)".into(),
        });
    }
    if !(opts.default_input_amax.is_finite() && opts.default_input_amax > 0.0) {
        return Err(Error::invalid(
            "default input amax",
            format!("{} is not a positive number", opts.default_input_amax),
        ));
    }
    if let Some(existing) = QuantConfig::load(&opts.model)? {
        return Err(Error::invalid(
            opts.model.display().to_string(),
            format!(
                "is already quantised ({}, {}): quantise a float checkpoint",
                existing.quant_algo, existing.source
            ),
        ));
    }
    let config = ModelConfig::load(&opts.model)?;
    let checkpoint = Checkpoint::open(&opts.model)?;
    let algo = if opts.weights_only {
        "W4A16_NVFP4"
    } else {
        "NVFP4"
    };
    let mut exclude: Vec<String> = DEFAULT_EXCLUDE.iter().map(|s| s.to_string()).collect();
    exclude.extend(opts.exclude.iter().cloned());
    let draft = QuantConfig::new(opts.convention, algo, exclude.clone(), "fp4spec quantize")?;

    let mut actions = HashMap::new();
    let mut auto_excluded = Vec::new();
    for name in checkpoint.tensor_names() {
        let h = checkpoint.expect_header(name)?;
        if !FLOAT.contains(&h.dtype) {
            return Err(Error::invalid(
                format!("tensor `{name}` in {}", h.file.display()),
                format!(
                    "is {}: the input must be a float checkpoint (BF16, F16 or F32)",
                    h.dtype
                ),
            ));
        }
        let action = if let (Some(module), [rows, cols]) = (name.strip_suffix(".weight"), h.shape) {
            Action::Linear {
                module: module.to_string(),
                rows: *rows,
                cols: *cols,
            }
        } else if let (true, [experts, rows, cols]) = (
            name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj"),
            h.shape,
        ) {
            Action::Fused {
                experts: *experts,
                rows: *rows,
                cols: *cols,
                gate_up: name.ends_with("gate_up_proj"),
            }
        } else {
            continue;
        };
        let (module, cols) = match &action {
            Action::Linear { module, cols, .. } => (module.as_str(), *cols),
            Action::Fused { cols, .. } => (name, *cols),
            Action::Copy => continue,
        };
        if draft.excludes(module) {
            continue;
        }
        if cols % BLOCK != 0 {
            auto_excluded.push(module.to_string());
            continue;
        }
        if let Action::Fused {
            rows,
            gate_up: true,
            ..
        } = action
            && rows % 2 != 0
        {
            return Err(
                h.shape_error("[E, 2I, H] with an even row count (gate rows, then up rows)")
            );
        }
        actions.insert(name.to_string(), action);
    }
    exclude.extend(auto_excluded.iter().cloned());
    let quant = QuantConfig::new(opts.convention, algo, exclude, "fp4spec quantize")?;
    let mut group_members: HashMap<String, Vec<String>> = HashMap::new();
    for action in actions.values() {
        if let Action::Linear { module, .. } = action
            && let Some(group) = fusion_group(module)
        {
            group_members.entry(group).or_default().push(module.clone());
        }
    }
    let mut plan = Plan {
        opts,
        quant,
        actions,
        group_amax: HashMap::new(),
        group_members,
    };

    let input_bytes: u64 = checkpoint
        .tensor_names()
        .iter()
        .filter_map(|n| checkpoint.header(n))
        .map(|h| h.bytes())
        .sum();
    let grouped: Vec<(String, String)> = plan
        .actions
        .iter()
        .filter_map(|(name, a)| match a {
            Action::Linear { module, .. } => fusion_group(module).map(|g| (name.clone(), g)),
            _ => None,
        })
        .collect();
    let grouped_bytes: u64 = grouped
        .iter()
        .filter_map(|(n, _)| checkpoint.header(n))
        .map(|h| h.bytes())
        .sum();
    progress.set_length(input_bytes + grouped_bytes);
    progress.set_message("scales");
    for (name, group) in &grouped {
        let amax = tensor_amax(&checkpoint.tensor(name)?, progress)?;
        let entry = plan.group_amax.entry(group.clone()).or_insert(0.0);
        *entry = entry.max(amax);
    }

    let out = StagedDir::create(&opts.out)?;
    progress.set_message("quantize");
    let mut weight_map = BTreeMap::new();
    let mut quantized = Vec::new();
    let mut copied = 0;
    let mut output_bytes = 0;
    let mut total_size = 0u64;
    for (path, names) in checkpoint.shards() {
        let file_name = if checkpoint.is_sharded() {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| SINGLE_FILE.to_string())
        } else {
            SINGLE_FILE.to_string()
        };
        let mut planned = Vec::new();
        for name in &names {
            let h = checkpoint.expect_header(name)?;
            planned.extend(plan.outputs(name, h.dtype, h.shape));
        }
        for t in &planned {
            total_size += t.bytes()? as u64;
            weight_map.insert(t.name.clone(), file_name.clone());
        }
        let mut writer = ShardWriter::create(out.path().join(&file_name), &planned, None)?;
        for name in &names {
            let tensor = checkpoint.tensor(name)?;
            match plan.action(name).clone() {
                Action::Copy => {
                    for piece in tensor.data.chunks(8 << 20) {
                        check_cancelled()?;
                        writer.write(name, piece)?;
                        progress.inc(piece.len() as u64);
                    }
                    copied += 1;
                }
                Action::Linear { module, rows, cols } => {
                    quantized.push(plan.write_linear(
                        &mut writer,
                        &tensor,
                        &module,
                        rows,
                        cols,
                        progress,
                    )?);
                }
                Action::Fused {
                    experts,
                    rows,
                    cols,
                    gate_up,
                } => {
                    quantized.push(plan.write_fused(
                        &mut writer,
                        &tensor,
                        [experts, rows, cols],
                        gate_up,
                        progress,
                    )?);
                }
            }
        }
        output_bytes += writer.finish()?;
    }
    if checkpoint.is_sharded() {
        super::write_index(&out, &weight_map, total_size)?;
    }
    let mut config_json = super::read_config_json(&opts.model)?;
    if let Some(object) = config_json.as_object_mut() {
        object.insert(
            "quantization_config".into(),
            plan.quant.quantization_config_json(),
        );
    }
    out.write_json("config.json", &config_json)?;
    if opts.convention == Convention::ModelOpt {
        out.write_json(
            quant_config::HF_QUANT_CONFIG,
            &plan.quant.hf_quant_config_json(),
        )?;
    }
    super::copy_side_files(&opts.model, &out)?;

    // the output as written, read back: it must pass the runner's check under its own config
    let written = Checkpoint::open(out.path())?;
    weights::check(&written, &config).map_err(|e| {
        Error::invalid(
            "fp4spec quantize",
            format!("the written checkpoint fails the tensor check (a defect of this tool): {e}"),
        )
    })?;
    drop(written);
    progress.finish_and_clear();
    let out_path = out.commit()?;
    Ok(QuantizeReport {
        out: out_path,
        convention: opts.convention,
        quant_algo: algo.to_string(),
        exclude_modules: plan.quant.exclude.clone(),
        auto_excluded,
        quantized,
        copied,
        input_bytes,
        output_bytes,
    })
}

/// Largest magnitude of a tensor, read a piece at a time.
fn tensor_amax(tensor: &TensorRef<'_>, progress: &ProgressBar) -> Result<f32> {
    let n = tensor.elements();
    let width = tensor.dtype.bitsize() as u64 / 8;
    let mut amax = 0.0f32;
    let mut start = 0;
    while start < n {
        check_cancelled()?;
        let end = (start + PIECE_ELEMENTS).min(n);
        let values = tensor.to_f32_range(start..end)?;
        if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                format!("tensor `{}` in {}", tensor.name, tensor.file.display()),
                format!(
                    "element {} is {}; NVFP4 cannot hold it",
                    start + bad,
                    values[bad]
                ),
            ));
        }
        amax = values.iter().fold(amax, |m, v| m.max(v.abs()));
        progress.inc((end - start) as u64 * width);
        start = end;
    }
    Ok(amax)
}

/// Quantises rows `[first_row, first_row + rows)` of the matrix starting at element `offset` of
/// `tensor` (`cols` wide) with `global`.
fn quantize_piece(
    tensor: &TensorRef<'_>,
    offset: usize,
    first_row: usize,
    rows: usize,
    cols: usize,
    global: f32,
) -> Result<Piece> {
    let start = offset + first_row * cols;
    let values = tensor.to_f32_range(start..start + rows * cols)?;
    let what = format!(
        "tensor `{}` (rows {first_row}..{} of the matrix at element {offset})",
        tensor.name,
        first_row + rows
    );
    let matrix = Nvfp4Matrix::quantize_with_global_scale(&what, &values, rows, cols, global)?;
    let sums = ErrorSums::of(&values, &matrix.dequantize());
    Ok(Piece {
        packed: matrix.packed,
        scales: matrix.scales,
        sums,
    })
}

/// Pieces of `rows` rows of a `cols`-wide matrix: at most [`PIECE_ELEMENTS`] each, and at
/// least `threads` of them when there are rows enough, so one matrix fills every thread.
fn row_pieces(rows: usize, cols: usize, threads: usize) -> Vec<(usize, usize)> {
    let step = (PIECE_ELEMENTS / cols.max(1))
        .min(rows.div_ceil(threads.max(1)))
        .max(1);
    (0..rows)
        .step_by(step)
        .map(|r| (r, step.min(rows - r)))
        .collect()
}

impl Plan<'_> {
    /// Writes a 2-D linear `module` (`[rows, cols]`, or a matrix of a fused tensor starting at
    /// element `offset`) quantised with `scales` under its linear names; returns its error sums.
    #[allow(clippy::too_many_arguments)]
    fn write_matrix(
        &self,
        writer: &mut ShardWriter,
        tensor: &TensorRef<'_>,
        module: &str,
        offset: usize,
        rows: usize,
        cols: usize,
        scales: Scales,
        progress: &ProgressBar,
    ) -> Result<ErrorSums> {
        let codes = match self.opts.convention {
            Convention::ModelOpt => format!("{module}.weight"),
            Convention::CompressedTensors => format!("{module}.weight_packed"),
        };
        let width = tensor.dtype.bitsize() as u64 / 8;
        let mut block_scales = Vec::with_capacity(rows * cols / BLOCK);
        let mut sums = ErrorSums::default();
        let threads = rayon::current_num_threads().max(1);
        for batch in row_pieces(rows, cols, threads).chunks(threads) {
            check_cancelled()?;
            let pieces: Vec<Piece> = batch
                .par_iter()
                .map(|&(first, n)| quantize_piece(tensor, offset, first, n, cols, scales.global))
                .collect::<Result<_>>()?;
            for (piece, (_, n)) in pieces.iter().zip(batch) {
                writer.write(&codes, &piece.packed)?;
                block_scales.extend_from_slice(&piece.scales);
                sums.add(&piece.sums);
                progress.inc((n * cols) as u64 * width);
            }
        }
        writer.write(&format!("{module}.weight_scale"), &block_scales)?;
        let (global, input) = match self.opts.convention {
            Convention::ModelOpt => ("weight_scale_2", "input_scale"),
            Convention::CompressedTensors => ("weight_global_scale", "input_global_scale"),
        };
        writer.write(
            &format!("{module}.{global}"),
            &scales.stored_global.to_le_bytes(),
        )?;
        if let Some(input_scale) = scales.input {
            let stored = match self.opts.convention {
                Convention::ModelOpt => input_scale,
                Convention::CompressedTensors => 1.0 / input_scale,
            };
            writer.write(&format!("{module}.{input}"), &stored.to_le_bytes())?;
        }
        Ok(sums)
    }

    fn write_linear(
        &self,
        writer: &mut ShardWriter,
        tensor: &TensorRef<'_>,
        module: &str,
        rows: usize,
        cols: usize,
        progress: &ProgressBar,
    ) -> Result<TensorError> {
        let amax = match fusion_group(module).and_then(|g| self.group_amax.get(&g)) {
            Some(&amax) => amax,
            None => tensor_amax(tensor, &ProgressBar::hidden())?,
        };
        let scales = self.scales(module, amax, None)?;
        let sums = self.write_matrix(writer, tensor, module, 0, rows, cols, scales, progress)?;
        Ok(TensorError {
            tensor: module.to_string(),
            shape: vec![rows, cols],
            relative_rms: sums.relative(),
            max_abs_error: sums.max_abs_error,
            amax: sums.amax,
            worst_expert: None,
            input_scale: scales.input,
            calibrated: scales.calibrated,
        })
    }

    fn write_fused(
        &self,
        writer: &mut ShardWriter,
        tensor: &TensorRef<'_>,
        [experts, rows, cols]: [usize; 3],
        gate_up: bool,
        progress: &ProgressBar,
    ) -> Result<TensorError> {
        let name = tensor.name;
        let per_expert = rows * cols;
        let mut total = ErrorSums::default();
        let mut worst: Option<(usize, f64)> = None;
        let mut first_scales = None;
        let mut record = |e: usize, sums: &ErrorSums| {
            total.add(sums);
            if worst.is_none_or(|(_, r)| sums.relative() > r) {
                worst = Some((e, sums.relative()));
            }
        };
        if self.splits() {
            let base = expert_base(name);
            for e in 0..experts {
                let amax = slice_amax(tensor, e * per_expert, per_expert)?;
                let parts: Vec<(String, usize, usize)> = if gate_up {
                    vec![
                        (format!("{base}{e}.gate_proj"), 0, rows / 2),
                        (format!("{base}{e}.up_proj"), rows / 2, rows / 2),
                    ]
                } else {
                    vec![(format!("{base}{e}.down_proj"), 0, rows)]
                };
                let mut expert_sums = ErrorSums::default();
                for (module, first_row, n) in parts {
                    let scales = self.scales(name, amax, Some(e))?;
                    first_scales.get_or_insert(scales);
                    let sums = self.write_matrix(
                        writer,
                        tensor,
                        &module,
                        e * per_expert + first_row * cols,
                        n,
                        cols,
                        scales,
                        progress,
                    )?;
                    expert_sums.add(&sums);
                }
                record(e, &expert_sums);
            }
        } else {
            let width = tensor.dtype.bitsize() as u64 / 8;
            let threads = rayon::current_num_threads().max(1);
            let mut block_scales = Vec::with_capacity(experts * per_expert / BLOCK);
            let mut globals = Vec::with_capacity(experts * 4);
            let mut inputs = Vec::with_capacity(experts * 4);
            let indices: Vec<usize> = (0..experts).collect();
            for batch in indices.chunks(threads) {
                check_cancelled()?;
                let pieces: Vec<(Piece, Scales)> = batch
                    .par_iter()
                    .map(|&e| {
                        let amax = slice_amax(tensor, e * per_expert, per_expert)?;
                        let scales = self.scales(name, amax, Some(e))?;
                        let piece =
                            quantize_piece(tensor, e * per_expert, 0, rows, cols, scales.global)?;
                        Ok((piece, scales))
                    })
                    .collect::<Result<_>>()?;
                for ((piece, scales), &e) in pieces.iter().zip(batch) {
                    writer.write(name, &piece.packed)?;
                    block_scales.extend_from_slice(&piece.scales);
                    globals.extend_from_slice(&scales.stored_global.to_le_bytes());
                    if let Some(input) = scales.input {
                        inputs.extend_from_slice(&input.to_le_bytes());
                    }
                    first_scales.get_or_insert(*scales);
                    record(e, &piece.sums);
                    progress.inc(per_expert as u64 * width);
                }
            }
            writer.write(&format!("{name}_weight_scale"), &block_scales)?;
            writer.write(&format!("{name}_weight_scale_2"), &globals)?;
            if !self.opts.weights_only {
                writer.write(&format!("{name}_input_scale"), &inputs)?;
            }
        }
        Ok(TensorError {
            tensor: name.to_string(),
            shape: vec![experts, rows, cols],
            relative_rms: total.relative(),
            max_abs_error: total.max_abs_error,
            amax: total.amax,
            worst_expert: worst,
            input_scale: first_scales.and_then(|s| s.input),
            calibrated: first_scales.is_some_and(|s| s.calibrated),
        })
    }
}

/// Largest magnitude of elements `[offset, offset + len)`.
fn slice_amax(tensor: &TensorRef<'_>, offset: usize, len: usize) -> Result<f32> {
    let values = tensor.to_f32_range(offset..offset + len)?;
    if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::invalid(
            format!("tensor `{}` in {}", tensor.name, tensor.file.display()),
            format!(
                "element {} is {}; NVFP4 cannot hold it",
                offset + bad,
                values[bad]
            ),
        ));
    }
    Ok(values.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}
