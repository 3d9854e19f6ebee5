//! `fp4spec`: the command-line program.
//!
//! Exit status: 0 ok, 1 a check failed (or a compiler is missing), 2 bad input or usage; output
//! piped into a reader that stops early (`| head`) ends the program by SIGPIPE, as other tools.

mod bench;
mod run;

use clap::{Parser, Subcommand};
use fp4spec::backend::cuda::nvrtc;
use fp4spec::backend::{Backend, BackendKind};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::check::{self, CheckStatus};
use fp4spec::kernels::gemm::{Epilogue, Linear, MmaKernel, RowOrder};
use fp4spec::kernels::{Nvfp4Weights, compare, gemm, table};
use fp4spec::rng::SplitMix64;
use fp4spec::target;
use half::bf16;
use std::path::PathBuf;
use std::process::ExitCode;

mod doctor;
mod graft_mtp;
mod quantize;

/// The embedded default GEMM shape: a Qwen3.6-35B-A3B shared-expert gate_up ([1024, 2048]) at
/// 16 rows (batch x verify rows of a small speculative batch).
const DEFAULT_M: usize = 16;
const DEFAULT_N: usize = 1024;
const DEFAULT_K: usize = 2048;

#[derive(Parser)]
#[command(
    name = "fp4spec",
    version,
    about = "Per-target NVFP4 / MoE / GDN kernels for Qwen3.5-MoE decode"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: greedy generation on the embedded demo model (code-like and prose-like
    /// prompts), without speculation and with 1-3 MTP drafts; prints acceptance by draft
    /// position and tokens per forward, and fails if speculation changes the output.
    Demo(run::DemoArgs),
    /// Logits of every input position (and with --mtp the MTP head's), as JSON.
    Logits(run::LogitsArgs),
    /// Generate from a prompt, optionally with MTP speculative decoding.
    Generate(run::GenerateArgs),
    /// List, write out or compile-check the rendered kernels.
    Kernels {
        /// Only these targets (repeatable); default: every target of kernels/targets.toml.
        #[arg(long = "target", value_name = "TARGET")]
        targets: Vec<String>,
        /// Write the rendered sources to DIR/<target>/<family>.{cu,hip}.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Compile every kernel for every selected target (NVRTC for sm_*, clang for gfx*) and
        /// print one row per kernel with registers and spills.
        #[arg(long)]
        check: bool,
        /// With --check: print each family's compiler log.
        #[arg(long, requires = "check")]
        verbose: bool,
        /// Compile every family of the selected NVIDIA targets into the CUBIN cache the CUDA
        /// backend loads from ($FP4SPEC_CACHE_DIR, else $XDG_CACHE_HOME/fp4spec, else
        /// ~/.cache/fp4spec), skipping those already there: a machine without a GPU prepares
        /// what a GPU host with the same NVRTC version then loads without compiling. (AMD code
        /// objects are built into the executable: nothing to cache.)
        #[arg(long, conflicts_with_all = ["check", "out"])]
        fill_cache: bool,
    },
    /// The main job for now: `kernels --check` for every target, then `gemm-check` on the best
    /// available backend at the default shape.
    Selftest {
        /// auto (CUDA when present, else HIP, else CPU), cpu, cuda or hip.
        #[arg(long, default_value = "auto")]
        backend: String,
    },
    /// Bytes read per decoded token by part, the bandwidth ceiling, and the speculation model.
    Roofline(RooflineArgs),
    /// Measure on the device: `bench decode` runs decode steps of a synthetic full-size model
    /// against the roofline (table, and JSON with --json).
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Acceptance of speculative decoding from a vLLM Prometheus metrics page.
    SpecMetrics {
        /// A metrics page saved to a file, or `-` for standard input.
        #[arg(required_unless_present = "url")]
        source: Option<String>,
        /// Fetch the page from a running server (plain http://HOST:PORT/metrics).
        #[arg(long, conflicts_with = "source")]
        url: Option<String>,
        /// An earlier snapshot of the same page: report the interval between the two.
        #[arg(long, value_name = "OLD")]
        since: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Everything wrong with a checkpoint folder (config, quantisation config, index, shard
    /// headers; never the data), one line per finding with a stable code; exit 1 on findings.
    Doctor(doctor::Args),
    /// Graft BASE's MTP head into FINETUNE as the new checkpoint OUT, with the drift report.
    GraftMtp(graft_mtp::Args),
    /// BF16 -> NVFP4 (ModelOpt or compressed-tensors), streaming, with the error per tensor.
    Quantize(quantize::Args),
    /// Run the NVFP4 x bf16 GEMM on a backend with random inputs and compare it with the CPU
    /// reference (default shape: one Qwen3.6-35B-A3B shared-expert gate_up at 16 rows).
    GemmCheck {
        /// auto (CUDA when present, else HIP, else CPU), cpu, cuda or hip.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Rows of X.
        #[arg(long, default_value_t = DEFAULT_M)]
        m: usize,
        /// Output features (rows of W).
        #[arg(long, default_value_t = DEFAULT_N)]
        n: usize,
        /// Input features; a multiple of 16.
        #[arg(long, default_value_t = DEFAULT_K)]
        k: usize,
        /// Random seed (default: fresh).
        #[arg(long)]
        seed: Option<u64>,
        /// mma (the tensor-core kernels, on re-laid-out weights), stream (the staged NVFP4
        /// stream kernel at M <= 16, cp.async targets), wgmma (the warpgroup kernels at any M,
        /// wgmma targets) or gemv (the straightforward reference GPU kernel).
        #[arg(long, default_value = "mma")]
        kernel: String,
        /// Launches after the checked one (for profilers; all on the same inputs).
        #[arg(long, default_value_t = 0)]
        repeat: usize,
    },
}

/// A failure and the exit status it maps to.
enum Failure {
    /// A check ran and did not pass (exit 1).
    Check(String),
    /// Bad input, or something the check could not even start (exit 2).
    Input(String),
}

impl From<fp4spec::Error> for Failure {
    fn from(e: fp4spec::Error) -> Self {
        Failure::Input(e.to_string())
    }
}

/// Rust ignores SIGPIPE, so a write to a closed pipe (`fp4spec kernels | head`) is an error that
/// println! turns into a panic; the default action ends the program quietly, as other command-line
/// tools do.
#[cfg(unix)]
fn end_quietly_on_closed_pipe() {
    // SAFETY: called first in main, before any thread starts; SIG_DFL is a valid action for
    // SIGPIPE and the previous handler is not needed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn end_quietly_on_closed_pipe() {}

fn main() -> ExitCode {
    end_quietly_on_closed_pipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => run::demo(args),
        Command::Logits(args) => run::logits(args),
        Command::Generate(args) => run::generate(args),
        Command::Kernels {
            targets,
            fill_cache: true,
            ..
        } => fill_kernel_cache(&targets),
        Command::Kernels {
            targets,
            out,
            check,
            verbose,
            fill_cache: false,
        } => kernels(&targets, out, check, verbose),
        Command::GemmCheck {
            backend,
            m,
            n,
            k,
            seed,
            kernel,
            repeat,
        } => gemm_check(&backend, m, n, k, seed, &kernel, repeat),
        Command::Roofline(args) => roofline_command(args),
        Command::Bench(what) => bench::run(what),
        Command::Doctor(args) => doctor::run(args),
        Command::GraftMtp(args) => graft_mtp::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::SpecMetrics {
            source,
            url,
            since,
            json,
        } => spec_metrics_command(source, url, since, json),
        Command::Selftest { backend } => {
            let compiled = kernels(&[], None, true, false);
            let computed = gemm_check(&backend, DEFAULT_M, DEFAULT_N, DEFAULT_K, None, "mma", 0);
            compiled.and(computed)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Check(message)) => {
            eprintln!("fp4spec: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Input(message)) => {
            eprintln!("fp4spec: error: {message}");
            ExitCode::from(2)
        }
    }
}

/// The targets named on the command line, or every target when none is.
fn selected_targets(names: &[String]) -> Result<Vec<target::TargetFacts>, Failure> {
    if names.is_empty() {
        return Ok(target::all().to_vec());
    }
    Ok(names
        .iter()
        .map(|n| target::by_name(n).cloned())
        .collect::<Result<_, _>>()?)
}

/// `kernels --fill-cache`: one line per (target, family), compiled now or already present.
fn fill_kernel_cache(names: &[String]) -> Result<(), Failure> {
    for t in selected_targets(names)? {
        if t.vendor != target::Vendor::Nvidia {
            println!(
                "{:<9} code objects are built into the executable: nothing to cache",
                t.name
            );
            continue;
        }
        let include = nvrtc::cuda_include_dir()?;
        for source in table::rendered_for_target(&t.name) {
            let (path, fill) = nvrtc::fill_cache(source, &t, &include)?;
            let what = match fill {
                nvrtc::CacheFill::Present => "present",
                nvrtc::CacheFill::Compiled => "compiled",
            };
            println!(
                "{:<9} {:<9} {what:<9} {}",
                t.name,
                source.family,
                path.display()
            );
        }
    }
    Ok(())
}

fn kernels(
    names: &[String],
    out: Option<PathBuf>,
    run_check: bool,
    verbose: bool,
) -> Result<(), Failure> {
    let selected = selected_targets(names)?;
    if let Some(dir) = &out {
        for t in &selected {
            let target_dir = dir.join(&t.name);
            std::fs::create_dir_all(&target_dir)
                .map_err(|e| Failure::Input(format!("{}: {e}", target_dir.display())))?;
            for source in table::rendered_for_target(&t.name) {
                let path = target_dir.join(source.file_name);
                std::fs::write(&path, source.source)
                    .map_err(|e| Failure::Input(format!("{}: {e}", path.display())))?;
                println!("wrote {}", path.display());
            }
        }
    }
    if !run_check {
        if out.is_none() {
            println!("{:<9} {:<9} kernels", "target", "family");
            for t in &selected {
                for source in table::rendered_for_target(&t.name) {
                    println!(
                        "{:<9} {:<9} {}",
                        t.name,
                        source.family,
                        source.kernels.join(", ")
                    );
                }
            }
        }
        return Ok(());
    }
    let rows = check::check(&selected);
    println!(
        "{:<9} {:<9} {:<26} {:<8} {:>5} {:>5} {:>6} {:>6} {:>6}  detail",
        "target", "family", "kernel", "status", "regs", "sregs", "spill", "stack", "lds"
    );
    let (mut failed, mut missing) = (0, 0);
    for (index, row) in rows.iter().enumerate() {
        let r = row.resources.clone().unwrap_or_default();
        let num = |v: Option<u32>| v.map_or("-".to_string(), |v| v.to_string());
        let (status, detail) = match &row.status {
            CheckStatus::Ok => ("ok", String::new()),
            CheckStatus::Failed(log) => {
                failed += 1;
                ("FAILED", format!("\n{log}"))
            }
            CheckStatus::CompilerMissing(why) => {
                missing += 1;
                ("MISSING", why.clone())
            }
        };
        println!(
            "{:<9} {:<9} {:<26} {:<8} {:>5} {:>5} {:>6} {:>6} {:>6}  {detail}",
            row.target,
            row.family,
            row.kernel,
            status,
            num(r.registers),
            num(r.scalar_registers),
            num(r.spill_bytes),
            num(r.stack_bytes),
            num(r.shared_bytes)
        );
        let last_of_family = rows
            .get(index + 1)
            .is_none_or(|next| (&next.target, &next.family) != (&row.target, &row.family));
        if verbose && last_of_family && !row.log.trim().is_empty() {
            println!("{}", row.log.trim_end());
        }
    }
    println!(
        "{} kernels: {} ok, {failed} failed, {missing} without a compiler",
        rows.len(),
        rows.len() - failed - missing
    );
    if failed + missing > 0 {
        return Err(Failure::Check(format!(
            "kernel check: {failed} failed, {missing} without a compiler"
        )));
    }
    Ok(())
}

/// One launch of the checked GEMM into the given output.
type GemmRun<'a> = dyn FnMut(&mut fp4spec::backend::DeviceVec<bf16>) -> fp4spec::Result<()> + 'a;

fn gemm_check(
    backend: &str,
    m: usize,
    n: usize,
    k: usize,
    seed: Option<u64>,
    kernel: &str,
    repeat: usize,
) -> Result<(), Failure> {
    let mma_kernel = match kernel {
        "mma" => Some(MmaKernel::Registers),
        "stream" => Some(MmaKernel::Staged),
        "wgmma" => Some(MmaKernel::Wgmma),
        "gemv" => None,
        other => {
            return Err(Failure::Input(format!(
                "--kernel `{other}` is not one of mma, stream, wgmma, gemv"
            )));
        }
    };
    let kind: BackendKind = backend.parse()?;
    let backend = match kind {
        BackendKind::Auto => {
            let (backend, why_not_cuda) = Backend::auto();
            if let Some(why) = why_not_cuda {
                println!("backend auto: using the CPU ({why})");
            }
            backend
        }
        other => Backend::new(other)?,
    };
    let seed = seed.unwrap_or_else(SplitMix64::fresh_seed);
    println!(
        "gemm-check ({kernel}) on {}: M={m} N={n} K={k} seed={seed}",
        backend.describe()
    );
    let mut rng = SplitMix64::new(seed);
    let w = Nvfp4Matrix::quantize("random W", &rng.normal_vec(n * k, 0.02), n, k)?;
    let x: Vec<bf16> = rng
        .normal_vec(m * k, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let x_dev = backend.upload(&x)?;
    let mut y_dev = backend.zeros::<bf16>(m * n)?;
    let mut run: Box<GemmRun<'_>> = if let Some(mma_kernel) = mma_kernel {
        let linear = Linear::nvfp4(&backend, &w, RowOrder::Plain)?;
        let (backend, x_dev) = (&backend, &x_dev);
        Box::new(move |y| {
            gemm::linear_with(backend, x_dev, m, &linear, Epilogue::None, y, mma_kernel)
        })
    } else {
        let weights = Nvfp4Weights::upload(&backend, &w)?;
        let (backend, x_dev) = (&backend, &x_dev);
        Box::new(move |y| gemm::nvfp4_gemm(backend, x_dev, m, &weights, y))
    };
    let start = std::time::Instant::now();
    run(&mut y_dev)?;
    backend.synchronize()?;
    let elapsed = start.elapsed();
    let mut again = backend.zeros::<bf16>(m * n)?;
    for _ in 0..repeat {
        run(&mut again)?;
    }
    backend.synchronize()?;
    let y = backend.download(&y_dev)?;
    let want = fp4spec::kernels::gemm::reference::nvfp4_gemm_f32(&x, m, w.view());
    let agreement = compare::compare_bf16(&y, &want);
    println!(
        "  first call (includes compilation or cache load): {:.3} ms",
        elapsed.as_secs_f64() * 1e3
    );
    println!("  vs CPU reference: {agreement}");
    if backend.name() == "cpu" {
        println!(
            "  note: the CPU backend runs the reference itself; this checks only the bf16 rounding path"
        );
    }
    if !agreement.passed() {
        return Err(Failure::Check(
            "gemm-check: the GEMM disagrees with the CPU reference".into(),
        ));
    }
    println!("  ok");
    Ok(())
}

/// The options of `fp4spec roofline`.
#[derive(clap::Args)]
struct RooflineArgs {
    /// Checkpoint folder whose config.json describes the model (default: Qwen3.6-35B-A3B).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// bf16 or nvfp4 (ModelOpt: experts, shared experts and attention in NVFP4). Default: what
    /// --model's quantisation config says (nvfp4 when it has one, else bf16), or nvfp4 for the
    /// built-in Qwen3.6-35B-A3B.
    #[arg(long)]
    precision: Option<String>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens already in each sequence's KV cache.
    #[arg(long, default_value_t = 0)]
    context: usize,
    /// How the KV cache stores keys and values: bf16, or fp8 (float8_e4m3fn, half the bytes).
    #[arg(long, default_value = "bf16")]
    kv_cache: String,
    /// gb10, strix-halo or h200 (peak and measured bandwidth), unless --bandwidth is given.
    #[arg(long, default_value = "gb10")]
    device: String,
    /// Memory bandwidth, e.g. 224.2GiB/s or 273GB/s.
    #[arg(long)]
    bandwidth: Option<String>,
    /// Bytes read per token (e.g. 5.488GiB) instead of the model's.
    #[arg(long)]
    bytes_per_token: Option<String>,
    /// Draft tokens per step (speculative decoding with the MTP head).
    #[arg(long)]
    spec_tokens: Option<usize>,
    /// Per-draft acceptance probability, with --spec-tokens.
    #[arg(long)]
    acceptance: Option<f64>,
    /// Cost of one draft step in ms (default: the MTP head's bytes at the bandwidth; 0 when
    /// the --fit points already include drafting).
    #[arg(long)]
    draft_ms: Option<f64>,
    /// CSV of measured forward costs, header `rows,ms`: fit ms = fixed + per_row * rows.
    #[arg(long, value_name = "FILE")]
    fit: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn roofline_command(args: RooflineArgs) -> Result<(), Failure> {
    use fp4spec::model::config::ModelConfig;
    use fp4spec::roofline::{self, Precision, RowFit, Step};
    let from_folder = match (&args.precision, &args.model) {
        (None, Some(dir)) => Some(
            match fp4spec::formats::quant_config::QuantConfig::load(dir)? {
                Some(_) => "nvfp4",
                None => "bf16",
            },
        ),
        _ => None,
    };
    let precision = match from_folder.or(args.precision.as_deref()).unwrap_or("nvfp4") {
        "bf16" => Precision::Bf16,
        "nvfp4" => Precision::Nvfp4,
        other => {
            return Err(Failure::Input(format!(
                "--precision `{other}` is not one of bf16, nvfp4"
            )));
        }
    };
    // far past any batch or draft count in use, and small enough for the model's products
    const MOST_SEQUENCES: usize = 1 << 20;
    const MOST_DRAFTS: usize = 64;
    if !(1..=MOST_SEQUENCES).contains(&args.batch) {
        return Err(Failure::Input(format!(
            "--batch must be in 1..={MOST_SEQUENCES}"
        )));
    }
    if args.spec_tokens.is_some_and(|n| n > MOST_DRAFTS) {
        return Err(Failure::Input(format!(
            "--spec-tokens must be at most {MOST_DRAFTS}"
        )));
    }
    let (bandwidths, device): (Vec<(&str, f64)>, String) = match &args.bandwidth {
        Some(text) => (
            vec![("given", roofline::parse_bytes("--bandwidth", text)?)],
            "given".into(),
        ),
        None => {
            let preset = roofline::DEVICES
                .iter()
                .find(|d| d.name == args.device)
                .ok_or_else(|| {
                    let known: Vec<&str> = roofline::DEVICES.iter().map(|d| d.name).collect();
                    Failure::Input(format!(
                        "--device `{}` is not one of {}",
                        args.device,
                        known.join(", ")
                    ))
                })?;
            (
                vec![("measured", preset.measured), ("peak", preset.peak)],
                preset.name.into(),
            )
        }
    };
    let config = match &args.model {
        Some(dir) => Some(ModelConfig::load(dir)?),
        None if args.bytes_per_token.is_none() => Some(ModelConfig::qwen36_35b_a3b()),
        None => None,
    };
    let kv = fp4spec::kernels::attention::KvFormat::parse(&args.kv_cache)?;
    let step = |rows| Step {
        batch: args.batch,
        rows,
        context: args.context,
        kv_element_bytes: kv.element_bytes(),
    };
    let (bytes_per_token, breakdown) = match (&args.bytes_per_token, &config) {
        (Some(text), _) => (roofline::parse_bytes("--bytes-per-token", text)?, None),
        (None, Some(config)) => {
            let bytes = roofline::step_bytes(config, precision, step(1));
            (bytes.total() / args.batch as f64, Some(bytes))
        }
        (None, None) => unreachable!("a config is loaded whenever --bytes-per-token is absent"),
    };
    let fit = match &args.fit {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Failure::Input(format!("{}: {e}", path.display())))?;
            Some(RowFit::from_csv(&text, &path.display().to_string())?)
        }
        None => None,
    };
    let bandwidth = bandwidths[0].1;
    let ceiling = bandwidth / bytes_per_token;
    let mut report = serde_json::json!({
        "device": device,
        "bandwidth_bytes_per_s": bandwidth,
        "batch": args.batch,
        "context": args.context,
        "bytes_per_token": bytes_per_token,
        "ceiling_tokens_per_s": ceiling,
    });
    if let Some(bytes) = &breakdown {
        report["bytes_per_step_by_part"] =
            serde_json::to_value(bytes).map_err(|e| Failure::Input(e.to_string()))?;
    }
    if let Some(fit) = &fit {
        report["fixed_ms"] = fit.fixed_ms.into();
        report["per_row_ms"] = fit.per_row_ms.into();
    }
    let speculation = match (args.spec_tokens, args.acceptance) {
        (Some(n), Some(a)) if (0.0..=1.0).contains(&a) => Some((n, a)),
        (Some(_), Some(a)) => {
            return Err(Failure::Input(format!(
                "--acceptance {a} is not a probability in 0..=1"
            )));
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(Failure::Input(
                "--spec-tokens and --acceptance go together".into(),
            ));
        }
        (None, None) => None,
    };
    if let Some((n, a)) = speculation {
        let tokens = roofline::tokens_per_forward(n, a);
        let forward_ms = match (&fit, &config, &args.bytes_per_token) {
            (Some(fit), _, _) => fit.ms(n + 1),
            (None, Some(config), None) => {
                roofline::step_bytes(config, precision, step(n + 1)).total() / bandwidth * 1e3
            }
            _ => bytes_per_token * args.batch as f64 / bandwidth * 1e3,
        };
        let draft_ms = match (args.draft_ms, &config) {
            (Some(ms), _) => ms,
            (None, Some(config)) => roofline::draft_bytes(config, step(1)) / bandwidth * 1e3,
            (None, None) => 0.0,
        };
        let step_ms = forward_ms + n as f64 * draft_ms;
        report["spec_tokens"] = n.into();
        report["acceptance"] = a.into();
        report["tokens_per_forward"] = tokens.into();
        report["forward_ms"] = forward_ms.into();
        report["draft_ms"] = draft_ms.into();
        report["projected_tokens_per_s"] = (args.batch as f64 * tokens / step_ms * 1e3).into();
    }
    if args.json {
        println!("{report:#}");
        return Ok(());
    }
    const GIB: f64 = 1073741824.0;
    if let Some(bytes) = &breakdown {
        println!(
            "bytes read per step ({} sequences, context {}, {} KV cache):",
            args.batch,
            args.context,
            kv.name()
        );
        let parts = [
            ("routed experts", bytes.experts),
            ("shared experts + router", bytes.shared_and_router),
            ("attention projections", bytes.attention),
            ("GDN projections", bytes.gdn_projections),
            ("norms", bytes.norms),
            ("lm_head + embeddings", bytes.lm_head_and_embeddings),
            ("KV cache", bytes.kv_cache),
            ("GDN state (read + write)", bytes.gdn_state),
        ];
        for (name, value) in parts {
            println!(
                "  {name:<26} {:>9.3} GiB  {:>5.1}%",
                value / GIB,
                100.0 * value / bytes.total()
            );
        }
        println!("  {:<26} {:>9.3} GiB", "total", bytes.total() / GIB);
    }
    println!(
        "bytes per token: {:.3} GiB ({:.0} bytes)",
        bytes_per_token / GIB,
        bytes_per_token
    );
    let per = if args.batch > 1 {
        format!(" (all {} sequences together)", args.batch)
    } else {
        String::new()
    };
    for (label, bw) in &bandwidths {
        println!(
            "ceiling on {device} ({label} {:.1} GB/s): {:.1} tok/s{per}",
            bw / 1e9,
            bw / bytes_per_token
        );
    }
    if let Some(fit) = &fit {
        println!(
            "fit: {:.2} ms fixed + {:.2} ms per row",
            fit.fixed_ms, fit.per_row_ms
        );
    }
    if speculation.is_some() {
        println!(
            "speculation: {:.3} tokens per forward, forward {:.3} ms + {} drafts x {:.3} ms -> {:.1} tok/s",
            report["tokens_per_forward"].as_f64().unwrap_or(f64::NAN),
            report["forward_ms"].as_f64().unwrap_or(f64::NAN),
            report["spec_tokens"],
            report["draft_ms"].as_f64().unwrap_or(f64::NAN),
            report["projected_tokens_per_s"]
                .as_f64()
                .unwrap_or(f64::NAN)
        );
    }
    Ok(())
}

fn spec_metrics_command(
    source: Option<String>,
    url: Option<String>,
    since: Option<PathBuf>,
    json: bool,
) -> Result<(), Failure> {
    use fp4spec::spec_metrics::{self, SpecCounters};
    use std::io::Read;
    let (text, name) = match (&source, &url) {
        (_, Some(url)) => (spec_metrics::fetch(url)?, url.clone()),
        (Some(dash), None) if dash == "-" => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| Failure::Input(format!("standard input: {e}")))?;
            (text, "<stdin>".to_string())
        }
        (Some(file), None) => (
            std::fs::read_to_string(file).map_err(|e| Failure::Input(format!("{file}: {e}")))?,
            file.clone(),
        ),
        (None, None) => return Err(Failure::Input("give a metrics file, `-` or --url".into())),
    };
    let mut counters = SpecCounters::parse(&text, &name)?;
    if let Some(old) = &since {
        let old_text = std::fs::read_to_string(old)
            .map_err(|e| Failure::Input(format!("{}: {e}", old.display())))?;
        counters = counters.since(&SpecCounters::parse(&old_text, &old.display().to_string())?)?;
    }
    let summary = counters.summary()?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).map_err(|e| Failure::Input(e.to_string()))?
        );
        return Ok(());
    }
    let interval = if since.is_some() {
        " over the interval"
    } else {
        ""
    };
    println!(
        "{name}{interval}: {} drafts, {} draft tokens, {} accepted",
        counters.drafts, counters.draft_tokens, counters.accepted_tokens
    );
    println!("acceptance rate: {:.3}", summary.acceptance_rate);
    println!(
        "mean accepted length: {:.3} tokens per target forward",
        summary.mean_accepted_length
    );
    for (position, rate) in summary.per_position.iter().enumerate() {
        println!("  position {position}: {rate:.3}");
    }
    let advice = if summary.regime == "edit-like" {
        "a block drafter pays here"
    } else {
        "a block drafter does not pay here"
    };
    println!(
        "regime: {} (the seeds measured {} prose-like, {} edit-like): {advice}",
        summary.regime,
        spec_metrics::PROSE_LIKE_ACCEPTANCE,
        spec_metrics::EDIT_LIKE_ACCEPTANCE
    );
    Ok(())
}
