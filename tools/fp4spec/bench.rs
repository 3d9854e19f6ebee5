//! `fp4spec bench decode`: the device decode path ([`fp4spec::model::device`]) on synthetic
//! weights of a model's real shapes, per (batch, drafts n, context): ms per step replayed from
//! the captured graphs and launched call by call, for n > 0 split into the verification (target
//! forward over the n + 1 rows per sequence, MTP catch-up, acceptance) and the drafting (n
//! lm_head rows, n - 1 chained MTP rows), tokens/s, the roofline's bytes per step, the fraction of
//! the copy bandwidth measured in the same run, and projections for GB10 and Strix Halo at the
//! same fraction of their measured bandwidth. Then per (batch, context) the verify-cost fit
//! (fixed + per-row ms over the verification's rows per sequence) and the speed-up speculation
//! would give at the acceptance rates the seeds measured: random weights accept nothing, so
//! these are projections from measured step times, labelled so. criterion's statistics are in
//! `cargo bench --bench decode`; this command is the tool a user runs on their own box, with
//! JSON and SVG charts.

use crate::Failure;
use fp4spec::backend::{Backend, BackendKind};
use fp4spec::kernels::attention::KvFormat;
use fp4spec::kernels::chain;
use fp4spec::kernels::gemm::Nvfp4Mode;
use fp4spec::model::config::ModelConfig;
use fp4spec::model::device::{
    Decoder, DeviceModel, MAX_POSITIONS, SpecDecoder, SyntheticWeights, decoder_capacity,
    max_drafts,
};
use fp4spec::roofline::{self, RowFit, Step};
use std::path::PathBuf;

/// What `fp4spec bench` measures.
#[derive(clap::Subcommand)]
pub enum Bench {
    /// Decode steps of a synthetic full-size model on the device, against the roofline.
    Decode(DecodeArgs),
}

/// Arguments of `fp4spec bench decode`.
#[derive(clap::Args)]
pub struct DecodeArgs {
    /// auto (CUDA when present, else HIP, else CPU), cpu, cuda or hip.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Checkpoint folder whose config.json gives the shapes (default: Qwen3.6-35B-A3B).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// nvfp4 (the ModelOpt recipe: experts and attention projections NVFP4) or bf16.
    #[arg(long, default_value = "nvfp4")]
    weights: String,
    /// How the NVFP4 attention projections multiply: w4a16 or w4a4 (GB10's block-scaled FP4
    /// MMA; experts stay w4a16).
    #[arg(long, default_value = "w4a16")]
    nvfp4: String,
    /// Sequences decoded together, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
    batch: Vec<usize>,
    /// MTP drafts per step, comma-separated (0 = plain decoding; the model needs an MTP head
    /// for more).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3,4")]
    drafts: Vec<usize>,
    /// Tokens already behind every sequence, comma-separated (the caches hold synthetic
    /// values; the bytes read are a real sequence's).
    #[arg(long, value_delimiter = ',', default_value = "0,20000")]
    context: Vec<usize>,
    /// How the KV caches store keys and values: bf16, or fp8 (float8_e4m3fn with unit scales,
    /// half the bytes).
    #[arg(long, default_value = "bf16")]
    kv_cache: String,
    /// Steps per timed run.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Timed runs per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Bytes of each side of the copy-bandwidth measurement.
    #[arg(long, default_value_t = 512 << 20)]
    copy_bytes: usize,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also draw, for each context C, PREFIX-tokens-ctxC.svg (tok/s against batch, n > 0 at
    /// acceptance 0.70) and PREFIX-verify-ms-ctxC.svg (verification ms against verify rows per
    /// step), one line per n.
    #[arg(long, value_name = "PREFIX")]
    chart: Option<PathBuf>,
    /// Also, for every plain (n = 0) case: what each kind of launch (a kernel at one grid size)
    /// costs the step, from the step captured and timed without it (a device backend; one more
    /// timed case per kind of launch). Reliable for kernels whose outputs steer nothing: leaving
    /// out one upstream of a MoE router changes which experts a batch reads.
    #[arg(long)]
    kernel_costs: bool,
}

/// Acceptance rates the seeds measured (per draft, across their runs), at which the speed-up of
/// speculation is projected.
const SEED_ACCEPTANCE: [f64; 5] = [0.47, 0.60, 0.70, 0.76, 0.94];

/// One measured case.
#[derive(serde::Serialize)]
struct Case {
    batch: usize,
    /// MTP drafts per step (0: plain decoding).
    drafts: usize,
    context: usize,
    /// Median ms per step, graph replays (launch by launch on backends without graphs).
    ms_per_step: f64,
    /// Of which the verification (the whole step at n = 0), median.
    verify_ms: f64,
    /// Of which the drafting, median (0 at n = 0).
    draft_ms: f64,
    /// Median ms per step launched call by call.
    eager_ms_per_step: f64,
    /// Tokens per second at one token per sequence and step (n = 0: the real rate; n > 0: the
    /// rate were no draft accepted; see `projected`).
    tokens_per_second: f64,
    /// The roofline's bytes per step.
    bytes_per_step: f64,
    /// bytes_per_step per sequence: the bytes of each token at n = 0; with n drafts a step
    /// emits 1 to n + 1 tokens a sequence (divide by the tokens per forward of an acceptance
    /// rate, `speculation`).
    bytes_per_token: f64,
    /// Of which the target forward over the n + 1 verify rows (bytes_per_step at n = 0).
    verify_bytes: f64,
    /// bytes_per_step / ms_per_step over the measured copy bandwidth.
    fraction_of_copy: f64,
    /// Distinct experts the last layer chose in the last step, and the roofline's expectation.
    distinct_experts: usize,
    expected_experts: f64,
    /// Projected tokens/s at the same fraction of GB10's and Strix Halo's measured bandwidth.
    projected_gb10_tokens_per_second: f64,
    projected_strix_halo_tokens_per_second: f64,
    /// Kernel launches per step (0 where the backend runs no kernels).
    launches: usize,
    /// launches x the dependent launch time of a full grid, over ms_per_step: the share of the
    /// step that chained launches doing nothing would take (None without a device).
    launch_floor_fraction: Option<f64>,
}

/// Per (batch, context): the verification's cost against its rows per sequence, and the
/// projected speed-up of each n over n = 0 at the seeds' acceptance rates.
#[derive(serde::Serialize)]
struct Speculation {
    batch: usize,
    context: usize,
    /// `verify_ms = fixed + per_row * (n + 1)` over the measured n.
    fit: Option<RowFit>,
    /// The verification at 3 rows per sequence (n = 2) over 1 row (n = 0), where both ran.
    three_rows_over_one: Option<f64>,
    /// The same ratio of the roofline's bytes (the verify forwards' `verify_bytes`): the least
    /// `three_rows_over_one` can be with both forwards at the same fraction of the bandwidth (the
    /// 3 rows' tokens select more distinct experts).
    three_rows_over_one_roofline: Option<f64>,
    /// `(n, [speed-up at each of SEED_ACCEPTANCE])`.
    speedups: Vec<(usize, Vec<f64>)>,
}

/// What one kind of launch costs a plain step (`--kernel-costs`).
#[derive(serde::Serialize)]
struct KernelCost {
    batch: usize,
    context: usize,
    /// The kernel and its grid's blocks, `kernel@blocks`.
    launch: String,
    /// Launches of that kind in one step.
    launches: usize,
    /// Median ms per step with every launch of this kind left out (graph replays).
    ms_per_step_without: f64,
    /// The full step's ms minus that: what the launches add to the step's critical path.
    cost_ms: f64,
    /// Distinct experts the last layer chose in the last step without them: where it differs
    /// from the full step's, leaving them out changed the routing, and `cost_ms` includes the
    /// expert bytes that saved or added (not what the launches cost).
    distinct_experts: usize,
    /// The full step's.
    full_experts: usize,
}

/// The dependent launch time measured in the run ([`chain::dependent_launch_seconds`]), us: by
/// the grid dependency (what the kernels use) for one block and a full grid, and by arrival
/// counters for a full grid.
#[derive(serde::Serialize, Clone, Copy)]
struct DependentLaunch {
    one_block: f64,
    full_grid: f64,
    full_grid_counter: f64,
    /// Blocks of the full grid (one per SM).
    full_grid_blocks: u32,
}

#[derive(serde::Serialize)]
struct Report<'a> {
    device: String,
    weights: &'a str,
    /// How NVFP4 attention projections multiply: w4a16 or w4a4.
    nvfp4: &'a str,
    /// KV cache format: bf16 or fp8 (e4m3).
    kv_cache: &'static str,
    copy_bandwidth_gbs: f64,
    /// What one dependent launch adds to a chain of them, us: one block, and one block per SM.
    dependent_launch_us: Option<DependentLaunch>,
    graph: bool,
    cases: Vec<Case>,
    acceptance_rates: [f64; 5],
    speculation: Vec<Speculation>,
    kernel_costs: Vec<KernelCost>,
}

/// Runs `fp4spec bench ...`.
pub fn run(bench: Bench) -> Result<(), Failure> {
    match bench {
        Bench::Decode(args) => decode(args),
    }
}

fn decode(args: DecodeArgs) -> Result<(), Failure> {
    let weights = match args.weights.as_str() {
        "nvfp4" => SyntheticWeights::Nvfp4,
        "bf16" => SyntheticWeights::Bf16,
        other => {
            return Err(Failure::Input(format!(
                "--weights `{other}` is not one of nvfp4, bf16"
            )));
        }
    };
    let precision = weights.precision();
    let nvfp4: Nvfp4Mode = args.nvfp4.parse()?;
    if weights == SyntheticWeights::Bf16 && nvfp4 == Nvfp4Mode::W4a4 {
        return Err(Failure::Input(
            "--nvfp4 w4a4 multiplies NVFP4 linears: it needs --weights nvfp4".into(),
        ));
    }
    let kv_format = KvFormat::parse(&args.kv_cache)?;
    if args.batch.is_empty() || args.batch.contains(&0) || args.context.is_empty() {
        return Err(Failure::Input(
            "--batch needs positive sizes and --context at least one length".into(),
        ));
    }
    if args.drafts.is_empty() {
        return Err(Failure::Input("--drafts needs at least one count".into()));
    }
    if args.steps == 0 || args.repeats == 0 {
        return Err(Failure::Input(
            "--steps and --repeats must be positive".into(),
        ));
    }
    let kind: BackendKind = args.backend.parse()?;
    let backend = Backend::new(kind)?;
    let draft_limit = max_drafts(&backend);
    if let Some(&n) = args.drafts.iter().find(|&&n| n > draft_limit) {
        return Err(Failure::Input(format!(
            "--drafts {n}: at most {draft_limit} drafts per step on {}",
            backend.describe()
        )));
    }
    if args.kernel_costs && matches!(backend, Backend::Cpu) {
        return Err(Failure::Input(
            "--kernel-costs needs a device backend (the CPU runs no kernels)".into(),
        ));
    }
    let config = match &args.model {
        Some(dir) => ModelConfig::load(dir)?,
        None => ModelConfig::qwen36_35b_a3b(),
    };
    let copy = backend.copy_bandwidth(args.copy_bytes, args.repeats)?;
    println!("device: {}", backend.describe());
    println!(
        "copy bandwidth: {:.0} GB/s (measured now, {} MiB each way)",
        copy / 1e9,
        args.copy_bytes >> 20
    );
    let dependent_launch = dependent_launch(&backend, args.repeats)?;
    if let Some(d) = dependent_launch {
        println!(
            "dependent launch: {:.2} us (1 block), {:.2} us ({} blocks of 256 threads): a chain of \
             {CHAIN_LINKS} kernels that only wait for the one before, as a step's kernels do; \
             {:.2} us with arrival counters instead of the grid dependency (measured now)",
            d.one_block, d.full_grid, d.full_grid_blocks, d.full_grid_counter
        );
    }
    let started = std::time::Instant::now();
    let mut model = DeviceModel::synthetic(&backend, &config, weights, nvfp4, args.seed)?;
    model.set_kv_format(kv_format);
    println!(
        "synthetic {} weights built in {:.1} s; KV cache {}",
        args.weights,
        started.elapsed().as_secs_f64(),
        kv_format.name()
    );
    if args.drafts.iter().any(|&n| n > 0) && !model.has_mtp() {
        return Err(Failure::Input(
            "--drafts above 0 needs an MTP head; the config has mtp_num_hidden_layers = 0".into(),
        ));
    }
    let longest = args.context.iter().copied().max().unwrap_or(0);
    let most_drafts = args.drafts.iter().copied().max().unwrap_or(0);
    // every timed run starts again at its context: room for the warm-up and one run of steps
    // of up to n + 1 tokens, and the chained drafts past the last
    let capacity = args
        .steps
        .checked_add(1)
        .and_then(|steps| decoder_capacity(longest, steps, most_drafts))
        .ok_or_else(|| {
            Failure::Input(format!(
                "--context {longest} and --steps {} need more than the {MAX_POSITIONS} positions \
                 a decoder holds",
                args.steps
            ))
        })?;
    let preset = |name: &str| {
        roofline::DEVICES
            .iter()
            .find(|d| d.name == name)
            .map(|d| d.measured)
            .unwrap_or_else(|| panic!("roofline::DEVICES has no `{name}` preset"))
    };
    let (gb10, strix) = (preset("gb10"), preset("strix-halo"));
    let mut cases = Vec::new();
    let mut kernel_costs = Vec::new();
    let mut graph = false;
    for &batch in &args.batch {
        for &drafts in &args.drafts {
            let mut stepper = if drafts == 0 {
                let mut decoder = Decoder::new(&model, batch, capacity)?;
                decoder.start_distinct()?;
                Stepper::Plain(Box::new(decoder))
            } else {
                let mut decoder = SpecDecoder::new(&model, batch, capacity, drafts)?;
                decoder.start_distinct()?;
                Stepper::Speculative(Box::new(decoder))
            };
            graph = stepper.replays_graph();
            for &context in &args.context {
                let step = Step {
                    batch,
                    rows: drafts + 1,
                    context,
                    kv_element_bytes: kv_format.element_bytes(),
                };
                let bytes = roofline::speculative_step_bytes(&config, precision, step);
                let timed = time_steps(&backend, &mut stepper, context, &args)?;
                let fraction = bytes / (timed.step_ms / 1e3) / copy;
                let projected = |bandwidth: f64| batch as f64 * fraction * bandwidth / bytes;
                cases.push(Case {
                    batch,
                    drafts,
                    context,
                    ms_per_step: timed.step_ms,
                    verify_ms: timed.verify_ms,
                    draft_ms: timed.draft_ms,
                    eager_ms_per_step: timed.eager_ms,
                    tokens_per_second: batch as f64 / (timed.step_ms / 1e3),
                    bytes_per_step: bytes,
                    bytes_per_token: bytes / batch as f64,
                    verify_bytes: roofline::step_bytes(&config, precision, step).total(),
                    fraction_of_copy: fraction,
                    distinct_experts: stepper.distinct_experts()?,
                    expected_experts: roofline::expected_distinct_experts(
                        config.num_experts,
                        config.num_experts_per_tok,
                        batch * (drafts + 1),
                    ),
                    projected_gb10_tokens_per_second: projected(gb10),
                    projected_strix_halo_tokens_per_second: projected(strix),
                    launches: timed.launches,
                    launch_floor_fraction: dependent_launch
                        .map(|d| timed.launches as f64 * d.full_grid / 1e3 / timed.step_ms),
                });
                if args.kernel_costs && drafts == 0 {
                    let full_experts = stepper.distinct_experts()?;
                    kernel_costs.extend(costs_of_launches(
                        &backend,
                        &model,
                        (batch, context, capacity),
                        (timed.step_ms, full_experts),
                        &args,
                    )?);
                }
            }
        }
    }
    println!(
        "{:>3} {:>2} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7} {:>8} {:>7} {:>8} {:>8} {:>10} {:>10}",
        "B",
        "n",
        "context",
        "ms/step",
        "verify ms",
        "draft ms",
        "eager ms",
        "tok/s",
        "MB/step",
        "MB/tok",
        "% copy",
        "launches",
        "% chain",
        "experts",
        "expected",
        "GB10 tok/s",
        "Strix tok/s"
    );
    for c in &cases {
        let chain = c
            .launch_floor_fraction
            .map_or_else(|| "-".to_string(), |f| format!("{:.1}%", 100.0 * f));
        println!(
            "{:>3} {:>2} {:>7} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.1} {:>9.1} {:>8.1} {:>6.1}% {:>8} {chain:>7} {:>8} {:>8.1} {:>10.1} {:>10.1}",
            c.batch,
            c.drafts,
            c.context,
            c.ms_per_step,
            c.verify_ms,
            c.draft_ms,
            c.eager_ms_per_step,
            c.tokens_per_second,
            c.bytes_per_step / 1e6,
            c.bytes_per_token / 1e6,
            100.0 * c.fraction_of_copy,
            c.launches,
            c.distinct_experts,
            c.expected_experts,
            c.projected_gb10_tokens_per_second,
            c.projected_strix_halo_tokens_per_second
        );
    }
    println!(
        "(tok/s: one token per sequence and step, what n > 0 gives with no draft accepted; \
         MB/tok: MB/step per sequence, each token's bytes at n = 0; \
         launches: kernels per step; % chain: launches x the full grid's dependent launch time \
         over the step, what the chain alone would take; \
         experts: the last layer's distinct experts in the last step, n = 0 only. GB10 / Strix \
         tok/s: projections at this run's fraction of copy bandwidth and the boxes' measured \
         bandwidths, not measurements; {})",
        if graph {
            "steps replayed from the captured CUDA graphs"
        } else {
            "this backend captures no graphs: steps launched call by call"
        }
    );
    if !kernel_costs.is_empty() {
        println!(
            "kernel costs (each kind of launch left out of the captured step: the full step's ms \
             minus the step's without it; a kernel whose results steer later work changes that \
             work when left out: positions or the next tokens steer later steps, and every kernel \
             upstream of a MoE router steers which experts the batch reads, so at B > 1 their \
             figures include the expert bytes a changed routing saves):"
        );
        println!(
            "{:>3} {:>7} {:<36} {:>8} {:>12} {:>9} {:>12} {:>8}",
            "B",
            "context",
            "kernel@blocks",
            "launches",
            "ms without",
            "cost ms",
            "us / launch",
            "experts"
        );
        for k in &kernel_costs {
            // a changed routing reads other experts: that row's difference is not a cost
            let routing = if k.distinct_experts == k.full_experts {
                String::new()
            } else {
                format!("  routing changed (full step: {})", k.full_experts)
            };
            println!(
                "{:>3} {:>7} {:<36} {:>8} {:>12.3} {:>9.3} {:>12.2} {:>8}{routing}",
                k.batch,
                k.context,
                k.launch,
                k.launches,
                k.ms_per_step_without,
                k.cost_ms,
                1e3 * k.cost_ms / k.launches.max(1) as f64,
                k.distinct_experts
            );
        }
    }
    let speculation = speculation(&args, &cases);
    if speculation.iter().any(|s| !s.speedups.is_empty()) {
        println!(
            "speculation (projected from the measured step times: tokens per step at i.i.d. \
             acceptance a, (1 - a^(n + 1)) / (1 - a), over the n = 0 step; the synthetic \
             weights' own drafts are never accepted; 3 rows/1: the verify forward at n = 2 over \
             n = 0, measured and in the roofline's bytes, the least it can be where both run at \
             one fraction of the bandwidth):"
        );
        println!(
            "{:>3} {:>7} {:>22} {:>10} {:>10}   speed-up over n = 0 at acceptance {:?}",
            "B", "context", "verify ms fit", "3 rows/1", "roofline", SEED_ACCEPTANCE
        );
        for sp in &speculation {
            let fit = sp.fit.map_or_else(
                || "-".to_string(),
                |f| format!("{:.3} + {:.3}/row", f.fixed_ms, f.per_row_ms),
            );
            let ratio = |r: Option<f64>| r.map_or_else(|| "-".to_string(), |r| format!("{r:.3}x"));
            println!(
                "{:>3} {:>7} {fit:>22} {:>10} {:>10}",
                sp.batch,
                sp.context,
                ratio(sp.three_rows_over_one),
                ratio(sp.three_rows_over_one_roofline)
            );
            for (n, speedups) in &sp.speedups {
                let cells: Vec<String> = speedups.iter().map(|v| format!("{v:.2}x")).collect();
                println!("{:>14} n = {n}: {}", "", cells.join("  "));
            }
        }
    }
    if let Some(prefix) = &args.chart {
        for &context in &args.context {
            let title = format!(
                "{} ({} weights, context {context})",
                config_name(&args),
                args.weights
            );
            let charts: [(&str, &str, &str, Value); 2] = [
                (
                    "tokens",
                    "sequences",
                    "tokens/s (n > 0: projected at acceptance 0.70)",
                    |c: &Case| {
                        (
                            c.batch as f64,
                            c.tokens_per_second * roofline::tokens_per_forward(c.drafts, 0.70),
                        )
                    },
                ),
                (
                    "verify-ms",
                    "verify rows per step (sequences x (n + 1))",
                    "verification ms per step",
                    |c: &Case| ((c.batch * (c.drafts + 1)) as f64, c.verify_ms),
                ),
            ];
            for (suffix, x_label, y_label, value) in charts {
                let mut path = prefix.clone().into_os_string();
                path.push(format!("-{suffix}-ctx{context}.svg"));
                let path = PathBuf::from(path);
                let points: Vec<&Case> = cases.iter().filter(|c| c.context == context).collect();
                chart(
                    &path,
                    &title,
                    x_label,
                    y_label,
                    &args.drafts,
                    &points,
                    value,
                )
                .map_err(|e| Failure::Input(format!("{}: {e}", path.display())))?;
                println!("chart: {}", path.display());
            }
        }
    }
    if let Some(path) = &args.json {
        let report = Report {
            device: backend.describe(),
            weights: &args.weights,
            nvfp4: &args.nvfp4,
            kv_cache: kv_format.name(),
            copy_bandwidth_gbs: copy / 1e9,
            dependent_launch_us: dependent_launch,
            graph,
            cases,
            acceptance_rates: SEED_ACCEPTANCE,
            speculation,
            kernel_costs,
        };
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::Input(format!("JSON of the report: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| Failure::Input(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

/// The model a run measures, for chart titles.
fn config_name(args: &DecodeArgs) -> String {
    args.model.as_ref().map_or_else(
        || "Qwen3.6-35B-A3B".to_string(),
        |dir| dir.display().to_string(),
    )
}

/// A chart's (x, y) of a case.
type Value = fn(&Case) -> (f64, f64);

/// One SVG line chart of `value` over `cases`, one line per number of drafts.
fn chart(
    path: &std::path::Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    drafts: &[usize],
    cases: &[&Case],
    value: Value,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let x_max = cases.iter().map(|c| value(c).0).fold(1.0, f64::max);
    let y_max = cases
        .iter()
        .map(|c| value(c).1)
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.1;
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..x_max * 1.05, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()?;
    for (i, &n) in drafts.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = cases
            .iter()
            .filter(|c| c.drafts == n)
            .map(|c| value(c))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(format!("n = {n}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}

/// A decoder of either kind, stepped the same way by the timing loop.
enum Stepper<'m> {
    Plain(Box<Decoder<'m>>),
    Speculative(Box<SpecDecoder<'m>>),
}

impl Stepper<'_> {
    fn replays_graph(&self) -> bool {
        match self {
            Self::Plain(d) => d.replays_graph(),
            Self::Speculative(d) => d.replays_graph(),
        }
    }

    fn skip_to(&mut self, position: usize) -> Result<(), Failure> {
        match self {
            Self::Plain(d) => d.skip_to(position)?,
            Self::Speculative(d) => d.skip_to(position)?,
        }
        Ok(())
    }

    /// Distinct experts the last layer chose in the last step (plain decoders; 0 for
    /// speculative ones, whose rows are not one token per sequence).
    fn distinct_experts(&self) -> Result<usize, Failure> {
        Ok(match self {
            Self::Plain(d) => d.last_layer_distinct_experts()?,
            Self::Speculative(_) => 0,
        })
    }

    fn step(&mut self, eager: bool) -> Result<(), Failure> {
        match (self, eager) {
            (Self::Plain(d), false) => d.step()?,
            (Self::Plain(d), true) => d.step_without_graph()?,
            (Self::Speculative(d), false) => d.step()?,
            (Self::Speculative(d), true) => d.step_without_graph()?,
        }
        Ok(())
    }
}

/// `--kernel-costs` for one plain case (`batch` sequences at `context`, caches of `capacity`
/// positions, `full_ms` per step with every launch and `full_experts` distinct experts in its
/// last layer): the kinds of launch a step makes (noted while a decoder captures its step), then
/// per kind a decoder captured without it, timed as the case was.
fn costs_of_launches(
    backend: &Backend,
    model: &DeviceModel,
    (batch, context, capacity): (usize, usize, usize),
    (full_ms, full_experts): (f64, usize),
    args: &DecodeArgs,
) -> Result<Vec<KernelCost>, Failure> {
    // one step launched call by call, recorded: its kinds of launch and how many of each
    let mut decoder = Decoder::new(model, batch, capacity)?;
    decoder.start_distinct()?;
    backend.record_launches(true);
    let stepped = decoder.step_without_graph();
    backend.record_launches(false);
    stepped?;
    drop(decoder);
    let mut costs = Vec::new();
    for tally in backend.recorded_launches() {
        let class = tally.class;
        backend.leave_out(Some(class.clone()));
        let timed = Decoder::new(model, batch, capacity)
            .map_err(Failure::from)
            .and_then(|mut decoder| {
                decoder.start_distinct()?;
                let mut stepper = Stepper::Plain(Box::new(decoder));
                let timed = time_steps(backend, &mut stepper, context, args)?;
                Ok((timed, stepper.distinct_experts()?))
            });
        backend.leave_out(None);
        let (timed, distinct_experts) = timed?;
        costs.push(KernelCost {
            batch,
            context,
            launch: class.to_string(),
            launches: tally.launches,
            ms_per_step_without: timed.step_ms,
            cost_ms: full_ms - timed.step_ms,
            distinct_experts,
            full_experts,
        });
    }
    Ok(costs)
}

/// Medians over the timed runs of one case, ms, and the launches of one step.
struct Timed {
    step_ms: f64,
    verify_ms: f64,
    draft_ms: f64,
    eager_ms: f64,
    launches: usize,
}

/// Kernels in the chain that times a dependent launch.
const CHAIN_LINKS: usize = 512;

/// The dependent launch time of one block and of one block per SM (None on the CPU backend).
fn dependent_launch(backend: &Backend, repeats: usize) -> Result<Option<DependentLaunch>, Failure> {
    let Some(sms) = backend.multiprocessors() else {
        return Ok(None);
    };
    let us = |handover: chain::Handover, blocks: u32, threads: u32| {
        chain::dependent_launch_seconds(backend, handover, CHAIN_LINKS, blocks, threads, repeats)
            .map(|s| s * 1e6)
    };
    Ok(Some(DependentLaunch {
        one_block: us(chain::Handover::GridDependency, 1, 32)?,
        full_grid: us(chain::Handover::GridDependency, sms, 256)?,
        full_grid_counter: us(chain::Handover::Counter, sms, 256)?,
        full_grid_blocks: sms,
    }))
}

fn median(mut runs: Vec<f64>) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Times `args.repeats` runs of `args.steps` steps from `context` (each after one warm step):
/// graph replays with the verification and the drafting apart (events around each half of
/// every speculative step), then launch by launch.
fn time_steps(
    backend: &Backend,
    stepper: &mut Stepper<'_>,
    context: usize,
    args: &DecodeArgs,
) -> Result<Timed, Failure> {
    let steps = args.steps as f64;
    let (mut step_runs, mut verify_runs, mut draft_runs, mut eager_runs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut launches = 0;
    for _ in 0..args.repeats {
        stepper.skip_to(context)?;
        stepper.step(false)?; // warm: the first replay after a restart
        match stepper {
            Stepper::Plain(decoder) => {
                let start = backend.record_event()?;
                for _ in 0..args.steps {
                    decoder.step()?;
                }
                let end = backend.record_event()?;
                backend.synchronize()?;
                let ms = f64::from(start.elapsed_ms(&end)?) / steps;
                step_runs.push(ms);
                verify_runs.push(ms);
                draft_runs.push(0.0);
            }
            Stepper::Speculative(decoder) => {
                let mut events = Vec::with_capacity(args.steps);
                for _ in 0..args.steps {
                    events.push(decoder.step_with_events()?);
                }
                backend.synchronize()?;
                let (mut verify, mut draft) = (0.0, 0.0);
                for e in &events {
                    verify += f64::from(e.start.elapsed_ms(&e.verified)?);
                    draft += f64::from(e.verified.elapsed_ms(&e.drafted)?);
                }
                let (first, last) = (&events[0], &events[events.len() - 1]);
                step_runs.push(f64::from(first.start.elapsed_ms(&last.drafted)?) / steps);
                verify_runs.push(verify / steps);
                draft_runs.push(draft / steps);
            }
        }
        stepper.skip_to(context)?;
        backend.record_launches(true); // the warm eager step: one step's launches
        let warm = stepper.step(true);
        backend.record_launches(false);
        warm?;
        launches = backend.recorded_launch_count();
        let start = backend.record_event()?;
        for _ in 0..args.steps {
            stepper.step(true)?;
        }
        let end = backend.record_event()?;
        backend.synchronize()?;
        eager_runs.push(f64::from(start.elapsed_ms(&end)?) / steps);
    }
    Ok(Timed {
        step_ms: median(step_runs),
        verify_ms: median(verify_runs),
        draft_ms: median(draft_runs),
        eager_ms: median(eager_runs),
        launches,
    })
}

/// The verify-cost fit and the projected speed-ups of every (batch, context) measured.
fn speculation(args: &DecodeArgs, cases: &[Case]) -> Vec<Speculation> {
    let mut out = Vec::new();
    for &batch in &args.batch {
        for &context in &args.context {
            let of = |n: usize| {
                cases
                    .iter()
                    .find(|c| c.batch == batch && c.context == context && c.drafts == n)
            };
            let points: Vec<(f64, f64)> = args
                .drafts
                .iter()
                .filter_map(|&n| of(n).map(|c| ((n + 1) as f64, c.verify_ms)))
                .collect();
            let base = of(0);
            let speedups = match base {
                Some(base) => args
                    .drafts
                    .iter()
                    .filter(|&&n| n > 0)
                    .filter_map(|&n| of(n))
                    .map(|c| {
                        let rates = SEED_ACCEPTANCE
                            .iter()
                            .map(|&a| {
                                roofline::tokens_per_forward(c.drafts, a) * base.ms_per_step
                                    / c.ms_per_step
                            })
                            .collect();
                        (c.drafts, rates)
                    })
                    .collect(),
                None => Vec::new(),
            };
            out.push(Speculation {
                batch,
                context,
                fit: RowFit::fit(&points).ok(),
                three_rows_over_one: of(2)
                    .zip(base)
                    .map(|(three, one)| three.verify_ms / one.verify_ms),
                three_rows_over_one_roofline: of(2)
                    .zip(base)
                    .map(|(three, one)| three.verify_bytes / one.verify_bytes),
                speedups,
            });
        }
    }
    out
}
