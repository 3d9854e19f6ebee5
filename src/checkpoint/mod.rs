//! Checkpoint tools: [`doctor`] (every structural, tensor, quantisation and MTP problem of a
//! checkpoint folder, each with a stable code), [`graft`] (the MTP head of one checkpoint into a
//! fine-tune of it), [`quantize`] (BF16 to NVFP4, streaming, ModelOpt or compressed-tensors) and
//! [`atomic`] (output folders that are complete or absent, never partial).
//!
//! They read headers through [`crate::formats::safetensors`], the quantisation config through
//! [`crate::formats::quant_config`], and judge tensors with the same check the runner uses,
//! [`crate::model::weights`], so a checkpoint `doctor` passes is one the runner loads.

pub mod atomic;
pub mod doctor;
pub mod graft;
pub mod quantize;

use crate::error::{Error, Result};
use crate::formats::safetensors::{INDEX_FILE, SINGLE_FILE};
use atomic::StagedDir;
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::path::Path;

/// The files of a checkpoint folder that are neither weights nor the files a command rewrites
/// (`config.json`, the index, `hf_quant_config.json`): tokenizer, chat template, generation and
/// processor configs. Sorted; subfolders are not included.
///
/// # Errors
/// [`Error::Io`] when the folder cannot be listed.
pub fn side_files(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().map_err(|e| Error::io(dir, e))?.is_file();
        let rewritten = [
            "config.json",
            INDEX_FILE,
            SINGLE_FILE,
            crate::formats::quant_config::HF_QUANT_CONFIG,
        ]
        .contains(&name.as_str());
        if is_file && !rewritten && !name.ends_with(".safetensors") && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Copies the [`side_files`] of `from` into the staged output.
///
/// # Errors
/// As [`atomic::copy_synced`].
pub fn copy_side_files(from: &Path, out: &StagedDir) -> Result<Vec<String>> {
    let names = side_files(from)?;
    for name in &names {
        atomic::copy_synced(
            &from.join(name),
            &out.path().join(name),
            &ProgressBar::hidden(),
        )?;
    }
    Ok(names)
}

/// Writes `model.safetensors.index.json` for `weight_map` (tensor -> shard file name) with
/// `metadata.total_size` = `total_size` (bytes of tensor data).
///
/// # Errors
/// As [`StagedDir::write_file`].
pub fn write_index(
    out: &StagedDir,
    weight_map: &BTreeMap<String, String>,
    total_size: u64,
) -> Result<()> {
    out.write_json(
        INDEX_FILE,
        &serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        }),
    )
}

/// `config.json` of `dir` as JSON (key order kept).
///
/// # Errors
/// [`Error::Io`], or [`Error::Invalid`] when it is not a JSON object.
pub fn read_config_json(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(path.display().to_string(), format!("not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(Error::invalid(
            path.display().to_string(),
            "is not a JSON object",
        ));
    }
    Ok(value)
}

/// A progress bar over `total` bytes, drawn on standard error when it is a terminal (hidden
/// otherwise), with `message` as its label.
pub fn bytes_progress(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message.to_string());
    bar
}
