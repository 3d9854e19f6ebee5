//! `fp4spec`: the command-line program.
//!
//! Exit status: 0 ok, 1 a check failed (or a compiler is missing), 2 bad input or usage.

use clap::{Parser, Subcommand};
use fp4spec::backend::{Backend, BackendKind};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::check::{self, CheckStatus};
use fp4spec::kernels::gemm::{Epilogue, Linear, RowOrder};
use fp4spec::kernels::{Nvfp4Weights, compare, gemm, table};
use fp4spec::rng::SplitMix64;
use fp4spec::target;
use half::bf16;
use std::path::PathBuf;
use std::process::ExitCode;

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
    },
    /// The main job for now: `kernels --check` for every target, then `gemm-check` on the best
    /// available backend at the default shape.
    Selftest {
        /// auto (CUDA when present, else CPU), cpu or cuda.
        #[arg(long, default_value = "auto")]
        backend: String,
    },
    /// Run the NVFP4 x bf16 GEMM on a backend with random inputs and compare it with the CPU
    /// reference (default shape: one Qwen3.6-35B-A3B shared-expert gate_up at 16 rows).
    GemmCheck {
        /// auto (CUDA when present, else CPU), cpu or cuda.
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
        /// mma (the tensor-core kernels, on re-laid-out weights) or gemv (the straightforward
        /// reference GPU kernel).
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Kernels {
            targets,
            out,
            check,
            verbose,
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

fn kernels(
    names: &[String],
    out: Option<PathBuf>,
    run_check: bool,
    verbose: bool,
) -> Result<(), Failure> {
    let selected: Vec<target::TargetFacts> = if names.is_empty() {
        target::all().to_vec()
    } else {
        names
            .iter()
            .map(|n| target::by_name(n).cloned())
            .collect::<Result<_, _>>()?
    };
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
        "{:<9} {:<9} {:<26} {:<8} {:>5} {:>5} {:>6} {:>6}  detail",
        "target", "family", "kernel", "status", "regs", "sregs", "spill", "stack"
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
            "{:<9} {:<9} {:<26} {:<8} {:>5} {:>5} {:>6} {:>6}  {detail}",
            row.target,
            row.family,
            row.kernel,
            status,
            num(r.registers),
            num(r.scalar_registers),
            num(r.spill_bytes),
            num(r.stack_bytes)
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
    let use_mma = match kernel {
        "mma" => true,
        "gemv" => false,
        other => {
            return Err(Failure::Input(format!(
                "--kernel `{other}` is not one of mma, gemv"
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
    let mut run: Box<GemmRun<'_>> = if use_mma {
        let linear = Linear::nvfp4(&backend, &w, RowOrder::Plain)?;
        let (backend, x_dev) = (&backend, &x_dev);
        Box::new(move |y| gemm::linear(backend, x_dev, m, &linear, Epilogue::None, y))
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
