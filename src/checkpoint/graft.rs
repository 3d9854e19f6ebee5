//! `fp4spec graft-mtp --base BASE --into FINETUNE --out OUT`: a fine-tune that lost its MTP head
//! (fine-tuning frameworks drop `mtp.*`) gets the head of the model it was tuned from.
//!
//! OUT holds FINETUNE's shards (hard links, or copies across file systems or with `copy`),
//! one new shard with BASE's `mtp.*` tensors copied byte for byte, an index covering both, and
//! FINETUNE's config with its MTP depth set to BASE's (and `mtp.*` added to the quantisation
//! exclusions when FINETUNE's list does not cover it). BASE and FINETUNE are only read.
//!
//! Refused (nothing written): OUT exists; BASE has no `mtp.*` tensors or an incomplete or
//! quantised head; FINETUNE already has `mtp.*` tensors; the parts the head shares with the
//! backbone disagree (family, hidden size, vocabulary, attention and expert shapes, the shapes of
//! embed_tokens, lm_head and the final norm); or the grafted head would fail the tensor check
//! under FINETUNE's config.
//!
//! The drift report compares BASE and FINETUNE on what the head reads from the backbone:
//! embed_tokens, lm_head and the final norm (the head's input hidden state is the backbone's
//! output after that norm). Relative L2 difference `||F - B|| / ||B||`, computed in f64 over
//! the whole tensor a piece at a time. The verdict thresholds (0.001, 0.05, 0.2) are a rule of
//! thumb, not a measurement: the acceptance rate of the grafted head (`fp4spec spec-metrics`)
//! is the real test.

use super::atomic::{self, Placed, StagedDir, check_cancelled};
use crate::error::{Error, Result};
use crate::formats::quant_config::{self, Convention, QuantConfig};
use crate::formats::safetensors::{
    Checkpoint, HeaderCatalog, PlannedTensor, ShardWriter, TensorHeaders, TensorRef,
};
use crate::model::config::{Family, ModelConfig};
use crate::model::weights::{self, Problem, ProblemKind};
use indicatif::ProgressBar;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Elements per piece when tensors are compared.
const DRIFT_CHUNK: usize = 1 << 20;
/// Bytes per piece when tensors are copied.
const COPY_CHUNK: usize = 8 << 20;

/// What to graft where.
#[derive(Debug, Clone)]
pub struct GraftOptions {
    /// The checkpoint whose `mtp.*` head is taken.
    pub base: PathBuf,
    /// The fine-tune that receives it.
    pub into: PathBuf,
    /// The new checkpoint folder (must not exist).
    pub out: PathBuf,
    /// Copy FINETUNE's shards instead of hard-linking them.
    pub copy: bool,
}

/// How far FINETUNE moved from BASE on one tensor the head depends on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// `embed_tokens`, `lm_head` or `norm`.
    pub part: &'static str,
    /// The tensor in BASE.
    pub base_tensor: String,
    /// The tensor in FINETUNE.
    pub finetune_tensor: String,
    /// `||F - B|| / ||B||`.
    pub relative_l2: f64,
    /// The rule-of-thumb reading of it.
    pub verdict: &'static str,
}

/// What the graft did.
#[derive(Debug, Clone, Serialize)]
pub struct GraftReport {
    /// The new checkpoint.
    pub out: PathBuf,
    /// MTP layers grafted.
    pub mtp_layers: usize,
    /// `mtp.*` tensors copied.
    pub mtp_tensors: usize,
    /// Bytes of their data.
    pub mtp_bytes: u64,
    /// The new shard holding them.
    pub mtp_shard: String,
    /// FINETUNE's shards and how each reached OUT.
    pub shards: Vec<(String, Placed)>,
    /// Other files of FINETUNE copied (tokenizer, templates, processor configs).
    pub side_files: Vec<String>,
    /// The exclusion entry added to the quantisation config, if one was needed.
    pub exclusion_added: Option<String>,
    /// Drift between BASE and FINETUNE on the tensors the head depends on.
    pub drift: Vec<Drift>,
    /// Differences that do not block the graft but may matter (rope, norm epsilon).
    pub notes: Vec<String>,
}

fn refuse(reason: impl Into<String>) -> Error {
    Error::invalid("graft-mtp refused", reason)
}

/// The rule-of-thumb reading of a relative L2 drift.
pub fn drift_verdict(relative_l2: f64) -> &'static str {
    if relative_l2 < 0.001 {
        "unchanged"
    } else if relative_l2 < 0.05 {
        "light fine-tune: the graft is plausible"
    } else if relative_l2 < 0.2 {
        "substantial drift: measure acceptance before relying on the head"
    } else {
        "heavy drift: the head will likely draft poorly"
    }
}

/// Grafts BASE's MTP head into FINETUNE as OUT; `progress` counts the bytes read and written.
///
/// # Errors
/// [`Error::Invalid`] (`graft-mtp refused: ...`) for every refusal listed in the module docs,
/// [`Error::Checkpoint`] when OUT exists, and the errors of opening either checkpoint or
/// writing OUT. Nothing is left at OUT on error.
pub fn graft_mtp(opts: &GraftOptions, progress: &ProgressBar) -> Result<GraftReport> {
    if opts.out.symlink_metadata().is_ok() {
        return Err(Error::Checkpoint {
            path: opts.out.clone(),
            reason: "already exists; refusing to overwrite it (choose a new output folder)".into(),
        });
    }
    let base_config = ModelConfig::load(&opts.base)?;
    let ft_config = ModelConfig::load(&opts.into)?;
    let base = Checkpoint::open(&opts.base)?;
    let ft = Checkpoint::open(&opts.into)?;
    let mtp_names: Vec<&str> = base
        .tensor_names()
        .into_iter()
        .filter(|n| n.starts_with("mtp."))
        .collect();
    if mtp_names.is_empty() {
        return Err(refuse(format!(
            "BASE {} has no mtp.* tensors: there is no head to graft",
            opts.base.display()
        )));
    }
    let base_quant = QuantConfig::load(&opts.base)?;
    let (_, base_problems) = weights::problems(&base, &base_config, base_quant.as_ref());
    let head_problems: Vec<&Problem> = base_problems.iter().filter(|p| is_mtp(p)).collect();
    if !head_problems.is_empty() {
        return Err(refuse(format!(
            "BASE's MTP head is not usable as it is: {}",
            describe(&head_problems)
        )));
    }
    let depth = base_config.mtp_num_hidden_layers;
    let ft_mtp: Vec<&str> = ft
        .tensor_names()
        .into_iter()
        .filter(|n| n.starts_with("mtp."))
        .collect();
    if !ft_mtp.is_empty() {
        return Err(refuse(format!(
            "FINETUNE {} already has {} mtp.* tensor(s) ({}...): graft into a checkpoint without a head",
            opts.into.display(),
            ft_mtp.len(),
            ft_mtp[0]
        )));
    }
    let roles = shared_parts(&base, &base_config, &ft, &ft_config)?;
    let notes = soft_differences(&base_config, &ft_config);

    // the head under FINETUNE's config, checked before anything is written
    let ft_quant = QuantConfig::load(&opts.into)?;
    let exclusion = match &ft_quant {
        Some(q) if !q.excludes("mtp.fc") => Some(match q.convention {
            Convention::ModelOpt => "mtp.*".to_string(),
            Convention::CompressedTensors => r"re:mtp\..*".to_string(),
        }),
        _ => None,
    };
    let out_quant = match (&ft_quant, &exclusion) {
        (Some(q), Some(entry)) => Some(q.with_exclusion(entry)?),
        (q, _) => q.clone(),
    };
    let mut out_config = ft_config.clone();
    out_config.mtp_num_hidden_layers = depth;
    let mut combined = HeaderCatalog::from_headers(&ft);
    for name in &mtp_names {
        let h = base.expect_header(name)?;
        combined.insert(name, h.file, h.dtype, h.shape.to_vec());
    }
    let (_, problems) = weights::problems(&combined, &out_config, out_quant.as_ref());
    let problems: Vec<&Problem> = problems.iter().filter(|p| is_mtp(p)).collect();
    if !problems.is_empty() {
        return Err(refuse(format!(
            "BASE's head does not fit FINETUNE's config: {}",
            describe(&problems)
        )));
    }

    let mtp_bytes: u64 = mtp_names
        .iter()
        .filter_map(|n| base.header(n))
        .map(|h| h.bytes())
        .sum();
    let shard_bytes: u64 = ft
        .shards()
        .iter()
        .map(|(path, _)| path.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let drift_bytes: u64 = roles
        .iter()
        .map(|(_, b, f)| {
            base.header(b).map_or(0, |h| h.bytes()) + ft.header(f).map_or(0, |h| h.bytes())
        })
        .sum();
    progress.set_length(drift_bytes + shard_bytes + mtp_bytes);

    progress.set_message("drift");
    let mut drift = Vec::new();
    for (part, base_name, ft_name) in &roles {
        let relative_l2 = relative_l2(&base.tensor(base_name)?, &ft.tensor(ft_name)?, progress)?;
        drift.push(Drift {
            part,
            base_tensor: base_name.clone(),
            finetune_tensor: ft_name.clone(),
            relative_l2,
            verdict: drift_verdict(relative_l2),
        });
    }

    let out = StagedDir::create(&opts.out)?;
    progress.set_message("shards");
    let mut weight_map = BTreeMap::new();
    let mut shards = Vec::new();
    for (path, names) in ft.shards() {
        let file_name = file_name(path)?;
        let placed = atomic::link_or_copy(path, &out.path().join(&file_name), opts.copy, progress)?;
        for name in names {
            weight_map.insert(name.to_string(), file_name.clone());
        }
        shards.push((file_name, placed));
    }
    let mut mtp_shard = "model-mtp.safetensors".to_string();
    let mut suffix = 1;
    while shards.iter().any(|(name, _)| *name == mtp_shard) {
        mtp_shard = format!("model-mtp-{suffix}.safetensors");
        suffix += 1;
    }
    progress.set_message("mtp head");
    let planned: Vec<PlannedTensor> = mtp_names
        .iter()
        .map(|n| {
            let h = base.expect_header(n)?;
            Ok(PlannedTensor::new(*n, h.dtype, h.shape.to_vec()))
        })
        .collect::<Result<_>>()?;
    let mut writer = ShardWriter::create(out.path().join(&mtp_shard), &planned, None)?;
    for name in &mtp_names {
        let tensor = base.tensor(name)?;
        for piece in tensor.data.chunks(COPY_CHUNK) {
            check_cancelled()?;
            writer.write(name, piece)?;
            progress.inc(piece.len() as u64);
        }
        weight_map.insert(name.to_string(), mtp_shard.clone());
    }
    writer.finish()?;
    let total_size: u64 = combined
        .names()
        .iter()
        .filter_map(|n| combined.header(n))
        .map(|h| h.bytes())
        .sum();
    super::write_index(&out, &weight_map, total_size)?;

    let mut config_json = super::read_config_json(&opts.into)?;
    set_mtp_depth(&mut config_json, &ft_config, depth);
    if let (Some(entry), Some(q)) = (&exclusion, &ft_quant)
        && let Some(qc) = config_json.get_mut("quantization_config")
    {
        quant_config::add_exclusion_json(qc, q.convention, entry);
    }
    out.write_json("config.json", &config_json)?;
    let hf_path = opts.into.join(quant_config::HF_QUANT_CONFIG);
    if hf_path.is_file() {
        let text = std::fs::read_to_string(&hf_path).map_err(|e| Error::io(&hf_path, e))?;
        let mut hf: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Error::invalid(
                hf_path.display().to_string(),
                format!("not valid JSON: {e}"),
            )
        })?;
        if let Some(entry) = &exclusion {
            quant_config::add_exclusion_json(&mut hf, Convention::ModelOpt, entry);
        }
        out.write_json(quant_config::HF_QUANT_CONFIG, &hf)?;
    }
    let side_files = super::copy_side_files(&opts.into, &out)?;

    // the output as written, read back: its head must pass the check the runner makes
    let written = Checkpoint::open(out.path())?;
    let written_config = ModelConfig::load(out.path())?;
    let written_quant = QuantConfig::load(out.path())?;
    let (_, problems) = weights::problems(&written, &written_config, written_quant.as_ref());
    let problems: Vec<&Problem> = problems.iter().filter(|p| is_mtp(p)).collect();
    if !problems.is_empty() {
        return Err(Error::invalid(
            "graft-mtp",
            format!(
                "the written checkpoint fails the MTP check (a defect of this tool): {}",
                describe(&problems)
            ),
        ));
    }
    drop(written);
    progress.finish_and_clear();
    let out_path = out.commit()?;
    Ok(GraftReport {
        out: out_path,
        mtp_layers: depth,
        mtp_tensors: mtp_names.len(),
        mtp_bytes,
        mtp_shard,
        shards,
        side_files,
        exclusion_added: exclusion,
        drift,
        notes,
    })
}

fn is_mtp(problem: &Problem) -> bool {
    problem.tensor.starts_with("mtp.")
        || matches!(
            problem.kind,
            ProblemKind::MtpFcMissing
                | ProblemKind::MtpTensorMissing
                | ProblemKind::MtpWithoutConfig
                | ProblemKind::ConfigWithoutMtp
                | ProblemKind::MtpQuantized
                | ProblemKind::MtpNotExcluded
        )
}

fn describe(problems: &[&Problem]) -> String {
    let mut text: Vec<String> = problems
        .iter()
        .take(5)
        .map(|p| format!("[{}] {}", p.kind.code(), p.error))
        .collect();
    if problems.len() > 5 {
        text.push(format!("and {} more", problems.len() - 5));
    }
    text.join("; ")
}

fn file_name(path: &Path) -> Result<String> {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::Checkpoint {
            path: path.to_path_buf(),
            reason: "has no file name".into(),
        })
}

/// The tensors the head shares with the backbone, as (part, name in BASE, name in FINETUNE),
/// after checking BASE and FINETUNE agree on everything the head's shapes depend on.
fn shared_parts(
    base: &Checkpoint,
    base_config: &ModelConfig,
    ft: &Checkpoint,
    ft_config: &ModelConfig,
) -> Result<Vec<(&'static str, String, String)>> {
    let mut disagree = Vec::new();
    macro_rules! same {
        ($($field:ident),*) => {$(
            if base_config.$field != ft_config.$field {
                disagree.push(format!(
                    "{}: BASE {:?}, FINETUNE {:?}",
                    stringify!($field), base_config.$field, ft_config.$field
                ));
            }
        )*};
    }
    same!(
        family,
        hidden_size,
        vocab_size,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        num_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        shared_expert_intermediate_size,
        attn_output_gate,
        partial_rotary_factor,
        tie_word_embeddings
    );
    let prefix = |c: &Checkpoint| {
        if c.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        }
    };
    let (bp, fp) = (prefix(base), prefix(ft));
    let mut roles = vec![
        (
            "embed_tokens",
            format!("{bp}embed_tokens.weight"),
            format!("{fp}embed_tokens.weight"),
        ),
        (
            "lm_head",
            "lm_head.weight".to_string(),
            "lm_head.weight".to_string(),
        ),
        (
            "norm",
            format!("{bp}norm.weight"),
            format!("{fp}norm.weight"),
        ),
    ];
    if base_config.tie_word_embeddings && ft_config.tie_word_embeddings {
        roles.retain(|(part, _, _)| *part != "lm_head");
    }
    for (part, b, f) in &roles {
        match (base.header(b), ft.header(f)) {
            (Some(bh), Some(fh)) if bh.shape == fh.shape => {
                for h in [bh, fh] {
                    if let Err(e) = h.expect_dtype(&[
                        safetensors::Dtype::BF16,
                        safetensors::Dtype::F16,
                        safetensors::Dtype::F32,
                    ]) {
                        disagree.push(format!("{part}: {e}"));
                    }
                }
            }
            (Some(bh), Some(fh)) => disagree.push(format!(
                "{part}: BASE `{b}` {:?}, FINETUNE `{f}` {:?}",
                bh.shape, fh.shape
            )),
            (None, _) => disagree.push(format!("{part}: BASE has no `{b}`")),
            (_, None) => disagree.push(format!("{part}: FINETUNE has no `{f}`")),
        }
    }
    if !disagree.is_empty() {
        return Err(refuse(format!(
            "BASE and FINETUNE disagree on what the head shares with the backbone: {}",
            disagree.join("; ")
        )));
    }
    Ok(roles)
}

fn soft_differences(base: &ModelConfig, ft: &ModelConfig) -> Vec<String> {
    let mut notes = Vec::new();
    if base.rope_theta != ft.rope_theta {
        notes.push(format!(
            "rope_theta differs (BASE {}, FINETUNE {}): the head runs with FINETUNE's",
            base.rope_theta, ft.rope_theta
        ));
    }
    if base.rms_norm_eps != ft.rms_norm_eps {
        notes.push(format!(
            "rms_norm_eps differs (BASE {}, FINETUNE {}): the head runs with FINETUNE's",
            base.rms_norm_eps, ft.rms_norm_eps
        ));
    }
    notes
}

/// `||f - b|| / ||b||` over every element, in f64, read a piece at a time.
fn relative_l2(base: &TensorRef<'_>, ft: &TensorRef<'_>, progress: &ProgressBar) -> Result<f64> {
    let n = base.elements();
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    let width = (base.dtype.bitsize() + ft.dtype.bitsize()) as u64 / 8;
    let mut start = 0;
    while start < n {
        check_cancelled()?;
        let end = (start + DRIFT_CHUNK).min(n);
        let b = base.to_f32_range(start..end)?;
        let f = ft.to_f32_range(start..end)?;
        for (x, y) in b.iter().zip(&f) {
            let (x, y) = (*x as f64, *y as f64);
            diff += (y - x) * (y - x);
            norm += x * x;
        }
        progress.inc((end - start) as u64 * width);
        start = end;
    }
    Ok(if norm > 0.0 {
        (diff / norm).sqrt()
    } else if diff == 0.0 {
        0.0
    } else {
        f64::INFINITY
    })
}

/// Sets the MTP depth field of a config.json (under `text_config` for the vision-language
/// wrapper, `num_nextn_predict_layers` for Qwen3-Next), leaving the rest as it is.
fn set_mtp_depth(config: &mut serde_json::Value, parsed: &ModelConfig, depth: usize) {
    let field = match parsed.family {
        Family::Qwen35Moe => "mtp_num_hidden_layers",
        Family::Qwen3Next => "num_nextn_predict_layers",
    };
    let target = if parsed.vision_language {
        config.get_mut("text_config")
    } else {
        Some(config)
    };
    if let Some(object) = target.and_then(|t| t.as_object_mut()) {
        object.insert(field.to_string(), depth.into());
    }
}
