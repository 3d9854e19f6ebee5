//! `fp4spec quantize --model DIR --out OUT [--format modelopt|compressed-tensors]`.

use crate::Failure;
use fp4spec::checkpoint::quantize::{self, Calibration, QuantizeOptions};
use fp4spec::checkpoint::{atomic, bytes_progress};
use fp4spec::formats::quant_config::Convention;
use std::path::PathBuf;

/// Tensors listed in the text report (worst first); `--json` lists all.
const LISTED: usize = 20;

/// The options of `fp4spec quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// The BF16 (or F16/F32) checkpoint folder.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The new checkpoint folder (must not exist).
    #[arg(long, value_name = "OUT")]
    out: PathBuf,
    /// modelopt (hf_quant_config.json; fused experts stay fused) or compressed-tensors
    /// (nvfp4-pack-quantized; experts per expert).
    #[arg(long, default_value = "modelopt")]
    format: String,
    /// Weights only (W4A16_NVFP4): no activation scales.
    #[arg(long)]
    weights_only: bool,
    /// An exclusion entry beyond the defaults (fnmatch wildcard over module names; repeatable).
    #[arg(long, value_name = "PATTERN")]
    exclude: Vec<String>,
    /// JSON of measured activation amax: {"module or pattern": amax, "...experts.gate_up_proj": [per expert]}.
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Activation amax where the calibration says nothing (default 2688 = 6 * 448: input_scale 1.0).
    #[arg(long, default_value_t = quantize::DEFAULT_INPUT_AMAX)]
    input_amax: f32,
    /// modelopt: write fused experts as per-expert 2-D linears.
    #[arg(long)]
    split_experts: bool,
    /// Machine-readable output (every tensor's error).
    #[arg(long)]
    json: bool,
}

/// Quantises and prints the error report.
pub fn run(args: Args) -> Result<(), Failure> {
    let convention = match args.format.as_str() {
        "modelopt" => Convention::ModelOpt,
        "compressed-tensors" => Convention::CompressedTensors,
        other => {
            return Err(Failure::Input(format!(
                "--format `{other}` is not one of modelopt, compressed-tensors"
            )));
        }
    };
    let calibration = match &args.calibration {
        Some(path) => Some(Calibration::load(path)?),
        None => None,
    };
    let _ = ctrlc::set_handler(atomic::request_cancel);
    let options = QuantizeOptions {
        convention,
        weights_only: args.weights_only,
        exclude: args.exclude,
        calibration,
        default_input_amax: args.input_amax,
        split_experts: args.split_experts,
        ..QuantizeOptions::new(args.model, args.out)
    };
    let progress = bytes_progress(0, "quantize");
    let report = quantize::quantize(&options, &progress)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Failure::Input(e.to_string()))?
        );
        return Ok(());
    }
    const GIB: f64 = 1073741824.0;
    println!(
        "wrote {} ({} {}): {} tensors quantised, {} copied; {:.3} GiB -> {:.3} GiB",
        report.out.display(),
        report.quant_algo,
        report.convention.name(),
        report.quantized.len(),
        report.copied,
        report.input_bytes as f64 / GIB,
        report.output_bytes as f64 / GIB
    );
    println!("exclusions: {}", report.exclude_modules.join(", "));
    if !report.auto_excluded.is_empty() {
        println!(
            "kept float (input width not a multiple of 16): {}",
            report.auto_excluded.join(", ")
        );
    }
    let calibrated = report.quantized.iter().filter(|t| t.calibrated).count();
    if !args.weights_only {
        println!(
            "input_scale: {calibrated} tensor(s) from the calibration, {} from amax {} (input_scale {})",
            report.quantized.len() - calibrated,
            options.default_input_amax,
            fp4spec::formats::nvfp4::modelopt_global_scale(options.default_input_amax)
        );
    }
    println!(
        "quantisation error (relative RMS) over all quantised weights: {:.5}",
        report.overall_relative_rms()
    );
    let mut worst: Vec<&quantize::TensorError> = report.quantized.iter().collect();
    worst.sort_by(|a, b| b.relative_rms.total_cmp(&a.relative_rms));
    println!(
        "{:<64} {:>10} {:>11} {:>10}  worst expert",
        "tensor (worst first)", "rel. RMS", "max |err|", "amax"
    );
    for t in worst.iter().take(LISTED) {
        let expert = t
            .worst_expert
            .map_or(String::new(), |(e, r)| format!("{e}: {r:.5}"));
        println!(
            "{:<64} {:>10.5} {:>11.4e} {:>10.4e}  {expert}",
            t.tensor, t.relative_rms, t.max_abs_error, t.amax
        );
    }
    if worst.len() > LISTED {
        println!(
            "... {} more (--json lists every tensor)",
            worst.len() - LISTED
        );
    }
    Ok(())
}
