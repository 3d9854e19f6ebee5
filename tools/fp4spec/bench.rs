//! `fp4spec bench decode`: the device decode path ([`fp4spec::model::device`]) on synthetic
//! weights of a model's real shapes, per (batch, context): ms per step replayed from the captured
//! graph and launched call by call, tokens/s, the roofline's bytes per step, the fraction of the
//! copy bandwidth measured in the same run, and projections for GB10 and Strix Halo at the same
//! fraction of their measured bandwidth (labelled as projections). n = 0 only: the device path
//! does not draft with the MTP head yet. criterion's statistics are in `cargo bench --bench
//! decode`; this command is the tool a user runs on their own box, with JSON for scripts.

use crate::Failure;
use fp4spec::backend::{Backend, BackendKind};
use fp4spec::model::config::ModelConfig;
use fp4spec::model::device::{Decoder, DeviceModel, SyntheticWeights};
use fp4spec::roofline::{self, Step};
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
    /// Sequences decoded together, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
    batch: Vec<usize>,
    /// Tokens already behind every sequence, comma-separated (the caches hold synthetic
    /// values; the bytes read are a real sequence's).
    #[arg(long, value_delimiter = ',', default_value = "0,20000")]
    context: Vec<usize>,
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
    /// Also draw PREFIX-tokens.svg (tok/s against batch) and PREFIX-step-ms.svg (ms per step
    /// against rows per step), one line per context.
    #[arg(long, value_name = "PREFIX")]
    chart: Option<PathBuf>,
}

/// One measured case.
#[derive(serde::Serialize)]
struct Case {
    batch: usize,
    context: usize,
    /// Median ms per step, graph replays (launch by launch on backends without graphs).
    ms_per_step: f64,
    /// Median ms per step launched call by call.
    eager_ms_per_step: f64,
    tokens_per_second: f64,
    /// The roofline's bytes per step.
    bytes_per_step: f64,
    /// bytes_per_step / ms_per_step over the measured copy bandwidth.
    fraction_of_copy: f64,
    /// Distinct experts the last layer chose in the last step, and the roofline's expectation.
    distinct_experts: usize,
    expected_experts: f64,
    /// Projected tokens/s at the same fraction of GB10's and Strix Halo's measured bandwidth.
    projected_gb10_tokens_per_second: f64,
    projected_strix_halo_tokens_per_second: f64,
}

#[derive(serde::Serialize)]
struct Report<'a> {
    device: String,
    weights: &'a str,
    copy_bandwidth_gbs: f64,
    graph: bool,
    cases: Vec<Case>,
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
    if args.batch.is_empty() || args.batch.contains(&0) || args.context.is_empty() {
        return Err(Failure::Input(
            "--batch needs positive sizes and --context at least one length".into(),
        ));
    }
    if args.steps == 0 || args.repeats == 0 {
        return Err(Failure::Input(
            "--steps and --repeats must be positive".into(),
        ));
    }
    let kind: BackendKind = args.backend.parse()?;
    let backend = Backend::new(kind)?;
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
    let started = std::time::Instant::now();
    let model = DeviceModel::synthetic(&backend, &config, weights, args.seed)?;
    println!(
        "synthetic {} weights built in {:.1} s; n = 0 (no MTP drafting on the device path yet)",
        args.weights,
        started.elapsed().as_secs_f64()
    );
    let longest = args.context.iter().copied().max().unwrap_or(0);
    // every timed run starts again at its context: room for the warm-up and one run
    let capacity = longest + args.steps + 2;
    let preset = |name: &str| {
        roofline::DEVICES
            .iter()
            .find(|d| d.name == name)
            .map_or(0.0, |d| d.measured)
    };
    let (gb10, strix) = (preset("gb10"), preset("strix-halo"));
    let mut cases = Vec::new();
    let mut graph = false;
    for &batch in &args.batch {
        let mut decoder = Decoder::new(&model, batch, capacity)?;
        graph = decoder.replays_graph();
        decoder.start_distinct()?;
        for &context in &args.context {
            let bytes = roofline::step_bytes(
                &config,
                precision,
                Step {
                    batch,
                    rows: 1,
                    context,
                },
            )
            .total();
            let time = |decoder: &mut Decoder<'_>, eager: bool| -> Result<f64, Failure> {
                let mut runs = Vec::with_capacity(args.repeats);
                for _ in 0..args.repeats {
                    decoder.skip_to(context)?;
                    decoder.step()?; // warm: the first replay after a restart
                    let start = backend.record_event()?;
                    for _ in 0..args.steps {
                        if eager {
                            decoder.step_without_graph()?;
                        } else {
                            decoder.step()?;
                        }
                    }
                    let end = backend.record_event()?;
                    backend.synchronize()?;
                    runs.push(f64::from(start.elapsed_ms(&end)?) / args.steps as f64);
                }
                runs.sort_by(f64::total_cmp);
                Ok(runs[runs.len() / 2])
            };
            let ms = time(&mut decoder, false)?;
            let eager_ms = time(&mut decoder, true)?;
            let fraction = bytes / (ms / 1e3) / copy;
            let projected = |bandwidth: f64| batch as f64 * fraction * bandwidth / bytes;
            cases.push(Case {
                batch,
                context,
                ms_per_step: ms,
                eager_ms_per_step: eager_ms,
                tokens_per_second: batch as f64 / (ms / 1e3),
                bytes_per_step: bytes,
                fraction_of_copy: fraction,
                distinct_experts: decoder.last_layer_distinct_experts()?,
                expected_experts: roofline::expected_distinct_experts(
                    config.num_experts,
                    config.num_experts_per_tok,
                    batch,
                ),
                projected_gb10_tokens_per_second: projected(gb10),
                projected_strix_halo_tokens_per_second: projected(strix),
            });
        }
    }
    println!(
        "{:>3} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8} {:>10} {:>10}",
        "B",
        "context",
        "ms/step",
        "eager ms",
        "tok/s",
        "MB/step",
        "% copy",
        "experts",
        "expected",
        "GB10 tok/s",
        "Strix tok/s"
    );
    for c in &cases {
        println!(
            "{:>3} {:>7} {:>9.3} {:>9.3} {:>9.1} {:>9.1} {:>6.1}% {:>8} {:>8.1} {:>10.1} {:>10.1}",
            c.batch,
            c.context,
            c.ms_per_step,
            c.eager_ms_per_step,
            c.tokens_per_second,
            c.bytes_per_step / 1e6,
            100.0 * c.fraction_of_copy,
            c.distinct_experts,
            c.expected_experts,
            c.projected_gb10_tokens_per_second,
            c.projected_strix_halo_tokens_per_second
        );
    }
    println!(
        "(GB10 / Strix tok/s: projections at this run's fraction of copy bandwidth and the boxes' \
         measured bandwidths, not measurements; {})",
        if graph {
            "steps replayed from the captured CUDA graph"
        } else {
            "this backend captures no graphs: steps launched call by call"
        }
    );
    if let Some(prefix) = &args.chart {
        let title = format!("{} ({} weights, n = 0)", config_name(&args), args.weights);
        for (suffix, y_label, value) in [
            (
                "tokens",
                "tokens/s",
                (|c: &Case| c.tokens_per_second) as fn(&Case) -> f64,
            ),
            ("step-ms", "ms per step", |c: &Case| c.ms_per_step),
        ] {
            let mut path = prefix.clone().into_os_string();
            path.push(format!("-{suffix}.svg"));
            let path = PathBuf::from(path);
            chart(&path, &title, y_label, &args.context, &cases, value)
                .map_err(|e| Failure::Input(format!("{}: {e}", path.display())))?;
            println!("chart: {}", path.display());
        }
    }
    if let Some(path) = &args.json {
        let report = Report {
            device: backend.describe(),
            weights: &args.weights,
            copy_bandwidth_gbs: copy / 1e9,
            graph,
            cases,
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

/// One SVG line chart: `value` of every case against its batch (rows per step at n = 0), one
/// line per context.
fn chart(
    path: &std::path::Path,
    title: &str,
    y_label: &str,
    contexts: &[usize],
    cases: &[Case],
    value: fn(&Case) -> f64,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let x_max = cases.iter().map(|c| c.batch).max().unwrap_or(1) as f64;
    let y_max = cases
        .iter()
        .map(value)
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
        .x_desc("sequences (rows per step)")
        .y_desc(y_label)
        .draw()?;
    for (i, &context) in contexts.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = cases
            .iter()
            .filter(|c| c.context == context)
            .map(|c| (c.batch as f64, value(c)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(format!("context {context}"))
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
