//! `fp4spec doctor DIR`: everything wrong with a checkpoint folder, from `config.json`,
//! the quantisation config, the shard index and every shard header (never the tensor data),
//! one [`Finding`] per problem with a stable code and the tensor, file or field it concerns.
//!
//! Codes: the structural ones of [`HeaderProblemKind::code`] (`shard-header-past-end`,
//! `shard-offsets-overlap`, ...), the tensor ones of [`ProblemKind::code`] (`mtp-fc-missing`,
//! `fused-expert-scales-missing`, ...), and those of this module: `weights-missing`,
//! `index-invalid`, `index-shard-missing`, `index-shard-escapes`, `index-tensor-absent`,
//! `shard-tensor-unindexed`, `shard-unreadable`, `config-missing`, `config-invalid`,
//! `quant-config-invalid`, `quant-config-disagree`, `quant-config-missing`,
//! `vl-processor-file-missing`, `family-mismatch`.

use crate::error::{Error, Result};
use crate::formats::quant_config::QuantConfig;
use crate::formats::safetensors::{
    self as st, HeaderCatalog, HeaderProblemKind, INDEX_FILE, SINGLE_FILE, ShardHeader,
    TensorHeaders,
};
use crate::model::config::{Family, ModelConfig};
use crate::model::weights::{self, ExpertLayout, ProblemKind};
use ::safetensors::Dtype;
use ::safetensors::tensor::TensorInfo;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

/// Files a vision-language checkpoint needs beside its weights: engines fail at init without
/// them.
pub const VL_PROCESSOR_FILES: [&str; 3] = [
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
];

/// One problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Stable code (`mtp-fc-missing`).
    pub code: &'static str,
    /// The tensor, file or field it concerns.
    pub subject: String,
    /// What is wrong and what it causes.
    pub message: String,
}

/// What the checkpoint is.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// `model_type` of config.json, when it parsed.
    pub model_type: Option<String>,
    /// Layout family from the config: `qwen3_5_moe` or `qwen3_next`.
    pub family: Option<&'static str>,
    /// Layout family the tensors show (`qwen3_5_moe`: `in_proj_qkv`; `qwen3_next`:
    /// `in_proj_qkvz`), if any GDN projection is present.
    pub tensor_layout: Option<&'static str>,
    /// The MTP class a server must use for this layout.
    pub mtp_class: Option<&'static str>,
    /// Whether config.json is the vision-language wrapper.
    pub vision_language: bool,
    /// Decoder layers.
    pub layers: usize,
    /// Gated DeltaNet layers.
    pub gdn_layers: usize,
    /// Full-attention layers.
    pub full_attention_layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub experts_per_token: usize,
    /// `fused` or `per-expert`.
    pub expert_layout: Option<&'static str>,
    /// `bf16` (no quantisation config) or e.g. `NVFP4 (modelopt)`.
    pub quantization: String,
    /// Exclusion entries of the quantisation config.
    pub exclusions: usize,
    /// 2-D linears stored as NVFP4.
    pub nvfp4_linears: usize,
    /// 2-D linears stored float.
    pub float_linears: usize,
    /// Fused 3-D expert tensors stored as NVFP4.
    pub nvfp4_fused_experts: usize,
    /// MTP tensors present.
    pub mtp_present: bool,
    /// MTP layers the config declares.
    pub mtp_layers: usize,
    /// Shard files.
    pub shards: usize,
    /// Tensors.
    pub tensors: usize,
    /// Bytes of tensor data (from the headers).
    pub tensor_bytes: u64,
    /// Bytes of the shard files.
    pub file_bytes: u64,
}

/// The findings and the summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Every problem found; empty for a healthy checkpoint.
    pub findings: Vec<Finding>,
    /// What the checkpoint is.
    pub summary: Summary,
}

impl Report {
    /// Whether nothing was found.
    pub fn healthy(&self) -> bool {
        self.findings.is_empty()
    }

    fn add(&mut self, code: &'static str, subject: impl Into<String>, message: impl Into<String>) {
        self.findings.push(Finding {
            code,
            subject: subject.into(),
            message: message.into(),
        });
    }
}

/// Examines the checkpoint folder `dir`.
///
/// # Errors
/// [`Error::Checkpoint`] only when `dir` is not a readable folder; everything wrong inside it
/// is a [`Finding`].
pub fn diagnose(dir: &Path) -> Result<Report> {
    if !dir.is_dir() {
        return Err(Error::Checkpoint {
            path: dir.to_path_buf(),
            reason: "is not a folder".into(),
        });
    }
    let mut report = Report::default();
    let catalog = scan_structure(dir, &mut report)?;
    let config = match ModelConfig::load(dir) {
        Ok(config) => Some(config),
        Err(Error::Io { path, source }) if source.kind() == std::io::ErrorKind::NotFound => {
            report.add(
                "config-missing",
                path.display().to_string(),
                "no config.json: no engine can load this folder",
            );
            None
        }
        Err(e) => {
            let subject = match &e {
                Error::Invalid { what, .. } => what.clone(),
                _ => dir.join("config.json").display().to_string(),
            };
            report.add("config-invalid", subject, e.to_string());
            None
        }
    };
    let quant = quant_config(dir, &mut report);
    let s = &mut report.summary;
    s.quantization = match &quant {
        Some(q) => format!("{} ({})", q.quant_algo, q.convention.name()),
        None => "bf16".into(),
    };
    s.exclusions = quant.as_ref().map_or(0, |q| q.exclude.len());
    s.tensors = catalog.len();
    s.mtp_present = catalog.names().iter().any(|n| n.starts_with("mtp."));
    s.tensor_layout = tensor_layout(&catalog);
    if let Some(config) = &config {
        summarise_config(config, s);
        if !catalog.is_empty() {
            tensor_findings(&catalog, config, quant.as_ref(), &mut report);
        }
        if config.vision_language || has_vision_config(dir) {
            for file in VL_PROCESSOR_FILES {
                if !dir.join(file).is_file() {
                    report.add(
                        "vl-processor-file-missing",
                        file,
                        "vision-language checkpoint without it: engines fail at init (the processor is built even for text-only requests)",
                    );
                }
            }
        }
        family_findings(config, &mut report);
    }
    sweep_quantised(&catalog, quant.as_ref(), &mut report);
    dedupe(&mut report.findings);
    Ok(report)
}

/// The index and every shard header: structural findings, and the tensors that could be read.
fn scan_structure(dir: &Path, report: &mut Report) -> Result<HeaderCatalog> {
    let mut catalog = HeaderCatalog::new(dir);
    let index = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    if index.is_file() {
        scan_index(dir, &index, &mut catalog, report)?;
    } else if single.is_file() {
        if let Some(header) = read_header(&single, report) {
            for (name, info) in &header.tensors {
                catalog.insert(name, &single, info.dtype, info.shape.clone());
            }
        }
    } else {
        report.add(
            "weights-missing",
            dir.display().to_string(),
            format!("neither {INDEX_FILE} nor {SINGLE_FILE} is in this folder"),
        );
    }
    for name in catalog.names() {
        if let Some(h) = catalog.header(name) {
            report.summary.tensor_bytes = report.summary.tensor_bytes.saturating_add(h.bytes());
        }
    }
    Ok(catalog)
}

fn read_header(path: &Path, report: &mut Report) -> Option<ShardHeader> {
    let file = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    match st::read_shard_header(path) {
        Ok(header) => {
            report.summary.shards += 1;
            report.summary.file_bytes += header.file_len;
            for problem in &header.problems {
                let subject = match &problem.tensor {
                    Some(tensor) => format!("{file}: {tensor}"),
                    None => file.clone(),
                };
                report.add(problem.kind.code(), subject, problem.message.clone());
            }
            let unusable = header
                .problems
                .iter()
                .any(|p| p.kind == HeaderProblemKind::HeaderPastEnd);
            (!unusable).then_some(header)
        }
        Err(e) => {
            report.add("shard-unreadable", file, e.to_string());
            None
        }
    }
}

fn scan_index(
    dir: &Path,
    index: &Path,
    catalog: &mut HeaderCatalog,
    report: &mut Report,
) -> Result<()> {
    let subject = index.display().to_string();
    let text = match std::fs::read_to_string(index) {
        Ok(text) => text,
        Err(e) => {
            report.add("index-invalid", subject, format!("cannot be read: {e}"));
            return Ok(());
        }
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(json) => json,
        Err(e) => {
            report.add("index-invalid", subject, format!("not valid JSON: {e}"));
            return Ok(());
        }
    };
    let Some(weight_map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        report.add("index-invalid", subject, "has no `weight_map` object");
        return Ok(());
    };
    let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, shard) in weight_map {
        match shard.as_str() {
            Some(shard) => by_shard.entry(shard).or_default().push(tensor),
            None => report.add(
                "index-invalid",
                tensor.clone(),
                format!("weight_map entry is {shard}, not a shard file name"),
            ),
        }
    }
    let root = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    for (shard, tensors) in by_shard {
        let listed = || {
            let mut names: Vec<&str> = tensors.iter().take(3).copied().collect();
            if tensors.len() > 3 {
                names.push("...");
            }
            format!("{} tensor(s): {}", tensors.len(), names.join(", "))
        };
        let relative = Path::new(shard);
        let plain = !shard.is_empty()
            && relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !plain {
            report.add(
                "index-shard-escapes",
                shard,
                format!(
                    "is not a plain file name inside the folder (it would read outside it); listed for {}",
                    listed()
                ),
            );
            continue;
        }
        if !root.join(relative).exists() {
            report.add(
                "index-shard-missing",
                shard,
                format!("no such file; the index lists it for {}", listed()),
            );
            continue;
        }
        let path = match st::contained_shard_path(&root, shard) {
            Ok(path) => path,
            Err(reason) => {
                report.add("index-shard-escapes", shard, reason);
                continue;
            }
        };
        let Some(header) = read_header(&path, report) else {
            continue;
        };
        let in_shard: BTreeMap<&str, &TensorInfo> = header
            .tensors
            .iter()
            .map(|(name, info)| (name.as_str(), info))
            .collect();
        let indexed: BTreeSet<&str> = tensors.iter().copied().collect();
        for tensor in &tensors {
            match in_shard.get(tensor) {
                Some(info) => catalog.insert(tensor, &path, info.dtype, info.shape.clone()),
                None => report.add(
                    "index-tensor-absent",
                    *tensor,
                    format!("the index puts it in {shard}, whose header does not have it"),
                ),
            }
        }
        for name in in_shard.keys().filter(|n| !indexed.contains(*n)) {
            report.add(
                "shard-tensor-unindexed",
                *name,
                format!(
                    "is in {shard} but not in the index: engines that follow the index never load it"
                ),
            );
        }
    }
    Ok(())
}

fn quant_config(dir: &Path, report: &mut Report) -> Option<QuantConfig> {
    match QuantConfig::load_both(dir) {
        Ok((Some(a), Some(b))) => {
            if let Err(e) = a.agrees_with(&b) {
                report.add(
                    "quant-config-disagree",
                    format!("{} / {}", a.source, b.source),
                    e.to_string(),
                );
            }
            Some(a)
        }
        Ok((a, b)) => a.or(b),
        Err(e) => {
            let subject = match &e {
                Error::Invalid { what, .. } => what.clone(),
                Error::Io { path, .. } => path.display().to_string(),
                _ => dir.display().to_string(),
            };
            report.add("quant-config-invalid", subject, e.to_string());
            None
        }
    }
}

fn summarise_config(config: &ModelConfig, s: &mut Summary) {
    s.model_type = Some(
        match (config.family, config.vision_language) {
            (Family::Qwen3Next, _) => "qwen3_next",
            (Family::Qwen35Moe, true) => "qwen3_5_moe",
            (Family::Qwen35Moe, false) => "qwen3_5_moe(_text)",
        }
        .to_string(),
    );
    s.family = Some(family_name(config.family));
    s.mtp_class = Some(config.family.mtp_class());
    s.vision_language = config.vision_language;
    let (gdn, full) = config.layer_counts();
    s.layers = config.num_hidden_layers();
    s.gdn_layers = gdn;
    s.full_attention_layers = full;
    s.experts = config.num_experts;
    s.experts_per_token = config.num_experts_per_tok;
    s.mtp_layers = config.mtp_num_hidden_layers;
}

fn family_name(family: Family) -> &'static str {
    match family {
        Family::Qwen35Moe => "qwen3_5_moe",
        Family::Qwen3Next => "qwen3_next",
    }
}

/// Which layout the GDN projections show.
fn tensor_layout(catalog: &HeaderCatalog) -> Option<&'static str> {
    let names = catalog.names();
    let next = names.iter().any(|n| n.contains(".in_proj_qkvz."));
    let qwen35 = names.iter().any(|n| n.contains(".in_proj_qkv."));
    match (qwen35, next) {
        (true, false) => Some("qwen3_5_moe"),
        (false, true) => Some("qwen3_next"),
        _ => None,
    }
}

fn has_vision_config(dir: &Path) -> bool {
    super::read_config_json(dir).is_ok_and(|c| c.get("vision_config").is_some())
}

fn tensor_findings(
    catalog: &HeaderCatalog,
    config: &ModelConfig,
    quant: Option<&QuantConfig>,
    report: &mut Report,
) {
    let (weights_report, problems) = weights::problems(catalog, config, quant);
    let s = &mut report.summary;
    s.expert_layout = Some(match weights_report.experts {
        ExpertLayout::Fused => "fused",
        ExpertLayout::PerExpert => "per-expert",
    });
    s.nvfp4_linears = weights_report.nvfp4_linears;
    s.float_linears = weights_report.float_linears;
    s.nvfp4_fused_experts = weights_report.nvfp4_fused_experts;
    for problem in problems {
        report.add(
            problem.kind.code(),
            problem.tensor,
            problem.error.to_string(),
        );
    }
}

fn family_findings(config: &ModelConfig, report: &mut Report) {
    let declared = family_name(config.family);
    if let Some(layout) = report.summary.tensor_layout
        && layout != declared
    {
        let (right, wrong) = if layout == "qwen3_5_moe" {
            ("qwen3_5_mtp", "qwen3_next_mtp")
        } else {
            ("qwen3_next_mtp", "qwen3_5_mtp")
        };
        report.add(
            "family-mismatch",
            "config.json: model_type",
            format!(
                "config.json says {declared} but the tensors have the {layout} layout: a server must use the MTP class {right}; {wrong} gives ~0% acceptance"
            ),
        );
    }
}

/// Quantised tensors outside what the config implies: NVFP4 linears (vision tower, or any
/// when config.json did not parse), quantised MTP tensors, and NVFP4 without a config.
fn sweep_quantised(catalog: &HeaderCatalog, quant: Option<&QuantConfig>, report: &mut Report) {
    let linears = weights::nvfp4_linears(catalog);
    for prefix in &linears {
        for problem in weights::linear_problems(catalog, prefix, quant) {
            report.add(
                problem.kind.code(),
                problem.tensor,
                problem.error.to_string(),
            );
        }
    }
    for name in catalog.names() {
        let quantised = catalog
            .header(name)
            .is_some_and(|h| matches!(h.dtype, Dtype::U8 | Dtype::F8_E4M3));
        if name.starts_with("mtp.") && quantised {
            report.add(
                ProblemKind::MtpQuantized.code(),
                name,
                "MTP tensor stored quantised: the MTP head must stay BF16 (engines load it as float)",
            );
        }
    }
    let fused = catalog
        .names()
        .into_iter()
        .find(|n| n.ends_with("_weight_scale") && n.contains("experts."));
    if quant.is_none()
        && let Some(example) = linears.first().map(String::as_str).or(fused)
    {
        report.add(
            "quant-config-missing",
            example,
            format!(
                "{} NVFP4 tensor group(s) but neither config.json quantization_config nor hf_quant_config.json: engines load them as float garbage",
                linears.len() + usize::from(fused.is_some())
            ),
        );
    }
}

/// Drops repeated (code, subject) pairs, and "missing" findings about tensors the index
/// already reported absent from their shard.
fn dedupe(findings: &mut Vec<Finding>) {
    let absent: BTreeSet<String> = findings
        .iter()
        .filter(|f| f.code == "index-tensor-absent")
        .map(|f| f.subject.clone())
        .collect();
    let mut seen = BTreeSet::new();
    findings.retain(|f| {
        let missing = matches!(
            f.code,
            "tensor-missing"
                | "mtp-tensor-missing"
                | "nvfp4-scale-missing"
                | "fused-expert-scales-missing"
        );
        if missing && absent.contains(&f.subject) {
            return false;
        }
        seen.insert((f.code, f.subject.clone()))
    });
}

/// `bytes` in the largest binary unit that keeps it at least 1 (`3.2 GiB`, `512 B`).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.3} {}", UNITS[unit])
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let (Some(family), Some(class)) = (self.family, self.mtp_class) {
            writeln!(
                f,
                "model: {} ({family} layout{}), MTP class {class}",
                self.model_type.as_deref().unwrap_or("?"),
                if self.vision_language {
                    ", vision-language wrapper"
                } else {
                    ""
                }
            )?;
            writeln!(
                f,
                "layers: {} ({} Gated DeltaNet, {} full attention); experts: {} per layer, {} per token, stored {}",
                self.layers,
                self.gdn_layers,
                self.full_attention_layers,
                self.experts,
                self.experts_per_token,
                self.expert_layout.unwrap_or("?")
            )?;
        }
        writeln!(
            f,
            "quantisation: {}{}; linears: {} NVFP4, {} float; fused NVFP4 expert tensors: {}",
            self.quantization,
            if self.exclusions > 0 {
                format!(", {} exclusion entries", self.exclusions)
            } else {
                String::new()
            },
            self.nvfp4_linears,
            self.float_linears,
            self.nvfp4_fused_experts
        )?;
        writeln!(
            f,
            "MTP: {} (config declares {} layer(s))",
            if self.mtp_present {
                "present"
            } else {
                "absent"
            },
            self.mtp_layers
        )?;
        write!(
            f,
            "weights: {} tensors in {} shard(s), {} of tensor data, {} on disk",
            self.tensors,
            self.shards,
            human_bytes(self.tensor_bytes),
            human_bytes(self.file_bytes)
        )
    }
}
