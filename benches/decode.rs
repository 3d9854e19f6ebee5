//! End-to-end decode on the device: a full-size Qwen3.6-35B-A3B with synthetic weights
//! ([`DeviceModel::synthetic`], NVFP4 by the ModelOpt recipe and all-bf16), `B` sequences decoding
//! one token each per step (n = 0), the step replayed from its captured CUDA graph, beside the
//! device copy bandwidth measured in the same run; then speculative steps ([`SpecDecoder`], n MTP
//! drafts) at B = 1 and 16, with their projected speed-up over n = 0.
//!
//! Each case times steps back to back between events (criterion's samples; median per step).
//! Context: "short" starts every sequence empty and lets it grow while timing (a few thousand
//! tokens at most: the KV bytes stay small); "20000" restarts the sequences at position 20000
//! ([`Decoder::skip_to`]), so attention reads 20000 positions of (zero) cache per row.
//!
//! Columns: "ms/step"; "tok/s" = B / step time; "MB/step" = the roofline's bytes per step
//! ([`roofline::step_bytes`]: dense weights once, the expected distinct experts of B tokens, the
//! KV and GDN state of every sequence); "GB/s" = MB/step over the step time; "% copy" = that over
//! the measured copy bandwidth (the goal: >= 80% at B = 1, >= 75% at every B); "eager ms" = the
//! same step launched call by call without the graph, and "launch %" = the share of the eager step
//! the graph saves (the goal: the graph's launch overhead < 5% of the step); "experts" = distinct
//! experts the last layer chose in the last step, "expected" = the roofline's count for uniform
//! routing (every sequence starts from its own token, so the rows differ).
//!
//! Run: `cargo bench --bench decode` on a CUDA host with about 80 GB of device memory (prints
//! one skip line elsewhere; a device without room for the bf16 model skips those rows).

mod common;

use common::{Samples, announce, copy_bandwidth_gbs, criterion};
use criterion::{Criterion, Throughput};
use fp4spec::backend::Backend;
use fp4spec::kernels::gemm::Nvfp4Mode;
use fp4spec::model::config::ModelConfig;
use fp4spec::model::device::{Decoder, DeviceModel, SpecDecoder, SyntheticWeights};
use fp4spec::roofline::{self, Step};
use std::time::{Duration, Instant};

const NVFP4_BATCHES: [usize; 6] = [1, 4, 8, 16, 32, 64];
/// Speculative cases: batches and drafts per step (NVFP4, short context).
const SPEC_BATCHES: [usize; 2] = [1, 16];
const SPEC_DRAFTS: [usize; 4] = [1, 2, 3, 4];
/// The acceptance rate the speculative table projects tokens/s at (per draft, i.i.d.).
const SPEC_ACCEPTANCE: f64 = 0.70;
const BF16_BATCHES: [usize; 2] = [1, 16];
const LONG_CONTEXT: usize = 20000;
/// Positions per sequence: room for the long-context start plus every timed step.
const CAPACITY: usize = LONG_CONTEXT + 4096;
/// Steps timed per eager measurement.
const EAGER_STEPS: usize = 20;

/// One speculative case: B sequences, n drafts per step (short context, NVFP4).
struct SpecRow {
    batch: usize,
    drafts: usize,
    step_s: f64,
}

struct Row {
    weights: &'static str,
    batch: usize,
    context: &'static str,
    step_s: f64,
    eager_s: f64,
    bytes: f64,
    /// Distinct experts of the last layer's last step.
    experts: usize,
}

/// What the timing loop asks of a decoder.
enum Phase {
    /// Make room for this many steps (restart the sequences when they would run out).
    Room(usize),
    /// Queue one step.
    Step,
}

/// Median seconds per step of `queue(Phase::Step)` (graph replays), timed by criterion between
/// events after `queue(Phase::Room(iters))`.
fn time_steps(
    c: &mut Criterion,
    backend: &Backend,
    name: &str,
    bytes: f64,
    mut queue: impl FnMut(Phase),
) -> f64 {
    let samples = Samples::default();
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::BytesDecimal(bytes as u64));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            queue(Phase::Room(iters as usize));
            let begin = backend.record_event().expect("event");
            for _ in 0..iters {
                queue(Phase::Step);
            }
            let end = backend.record_event().expect("event");
            let seconds = f64::from(begin.elapsed_ms(&end).expect("event timing")) / 1e3;
            samples.0.borrow_mut().push(seconds / iters as f64);
            Duration::from_secs_f64(seconds)
        })
    });
    g.finish();
    samples.median()
}

/// Seconds per step launched call by call (no graph), over `EAGER_STEPS` steps.
fn time_eager(backend: &Backend, decoder: &mut Decoder<'_>, start: usize) -> f64 {
    decoder.skip_to(start).expect("restart the sequences");
    let begin = backend.record_event().expect("event");
    for _ in 0..EAGER_STEPS {
        decoder.step_without_graph().expect("eager step");
    }
    let end = backend.record_event().expect("event");
    f64::from(begin.elapsed_ms(&end).expect("event timing")) / 1e3 / EAGER_STEPS as f64
}

fn run(
    c: &mut Criterion,
    backend: &Backend,
    weights: SyntheticWeights,
    batches: &[usize],
    rows: &mut Vec<Row>,
    spec_rows: &mut Vec<SpecRow>,
) {
    let config = ModelConfig::qwen36_35b_a3b();
    let label = match weights {
        SyntheticWeights::Nvfp4 => "nvfp4",
        SyntheticWeights::Bf16 => "bf16",
    };
    let precision = weights.precision();
    let built = Instant::now();
    let model = match DeviceModel::synthetic(backend, &config, weights, Nvfp4Mode::W4a16, 0x5eed) {
        Ok(model) => model,
        // only the bf16 model (70 GB) may not fit; anything else is a failure
        Err(e @ fp4spec::Error::Cuda { .. }) if weights == SyntheticWeights::Bf16 => {
            println!("skipped the {label} model: {e}");
            return;
        }
        Err(e) => panic!("the {label} model: {e}"),
    };
    println!(
        "{label} model built in {:.1} s",
        built.elapsed().as_secs_f64()
    );
    for &batch in batches {
        let mut decoder = Decoder::new(&model, batch, CAPACITY).expect("decoder");
        decoder.start_distinct().expect("first tokens");
        for (context, start) in [("short", 0), ("20000", LONG_CONTEXT)] {
            decoder.skip_to(start).expect("start");
            let bytes = roofline::step_bytes(
                &config,
                precision,
                Step {
                    batch,
                    rows: 1,
                    context: start,
                    kv_element_bytes: model.kv_format().element_bytes(),
                },
            )
            .total();
            let name = format!("{label}/B{batch}/ctx_{context}");
            let step_s = time_steps(c, backend, &name, bytes, |phase| match phase {
                Phase::Room(steps) => {
                    if decoder.position() + steps > CAPACITY {
                        decoder.skip_to(start).expect("restart the sequences");
                    }
                }
                Phase::Step => decoder.step().expect("decode step"),
            });
            let eager_s = time_eager(backend, &mut decoder, start);
            let experts = decoder.last_layer_distinct_experts().expect("routing");
            rows.push(Row {
                weights: label,
                batch,
                context,
                step_s,
                eager_s,
                bytes,
                experts,
            });
        }
    }
    // speculation: the same model with n MTP drafts per step (bf16 MTP head, ModelOpt's
    // exclusion), short context; the synthetic drafts are never accepted, so a step emits one
    // token and the speed-up at an acceptance rate is projected from the step times
    if weights != SyntheticWeights::Nvfp4 {
        return;
    }
    for &batch in &SPEC_BATCHES {
        for drafts in SPEC_DRAFTS {
            let mut decoder =
                SpecDecoder::new(&model, batch, CAPACITY, drafts).expect("speculative decoder");
            decoder.start_distinct().expect("first tokens");
            let bytes = roofline::speculative_step_bytes(
                &config,
                precision,
                Step {
                    batch,
                    rows: drafts + 1,
                    context: 0,
                    kv_element_bytes: model.kv_format().element_bytes(),
                },
            );
            let name = format!("{label}/B{batch}/n{drafts}/ctx_short");
            let step_s = time_steps(c, backend, &name, bytes, |phase| match phase {
                Phase::Room(steps) => {
                    // a step advances a sequence by n + 1 tokens at most and looks 2 n ahead
                    if decoder.position_bound() + (steps + 2) * (drafts + 1) >= CAPACITY {
                        decoder.skip_to(0).expect("restart the sequences");
                    }
                }
                Phase::Step => decoder.step().expect("speculative step"),
            });
            spec_rows.push(SpecRow {
                batch,
                drafts,
                step_s,
            });
        }
    }
}

fn main() {
    let Some(backend) = common::device_or_skip("decode") else {
        return;
    };
    if !matches!(backend, Backend::Cuda(_)) {
        println!(
            "skipped bench decode: the decode step is captured as a CUDA graph; {} has none",
            backend.name()
        );
        return;
    }
    announce(&backend);
    let mut c = criterion();
    let copy = copy_bandwidth_gbs(&mut c, &backend);
    let config = ModelConfig::qwen36_35b_a3b();
    let (mut rows, mut spec_rows) = (Vec::new(), Vec::new());
    run(
        &mut c,
        &backend,
        SyntheticWeights::Nvfp4,
        &NVFP4_BATCHES,
        &mut rows,
        &mut spec_rows,
    );
    run(
        &mut c,
        &backend,
        SyntheticWeights::Bf16,
        &BF16_BATCHES,
        &mut rows,
        &mut spec_rows,
    );
    println!();
    println!("device copy bandwidth: {copy:.0} GB/s (measured in this run)");
    println!(
        "{:<6} {:>3} {:>7} {:>9} {:>9} {:>9} {:>8} {:>7} {:>9} {:>9} {:>8} {:>8}",
        "format",
        "B",
        "context",
        "ms/step",
        "tok/s",
        "MB/step",
        "GB/s",
        "% copy",
        "eager ms",
        "launch %",
        "experts",
        "expected"
    );
    for r in &rows {
        let gbs = r.bytes / r.step_s / 1e9;
        println!(
            "{:<6} {:>3} {:>7} {:>9.3} {:>9.1} {:>9.1} {:>8.0} {:>6.1}% {:>9.3} {:>8.1}% {:>8} {:>8.1}",
            r.weights,
            r.batch,
            r.context,
            r.step_s * 1e3,
            r.batch as f64 / r.step_s,
            r.bytes / 1e6,
            gbs,
            100.0 * gbs / copy,
            r.eager_s * 1e3,
            100.0 * (r.eager_s - r.step_s) / r.eager_s,
            r.experts,
            roofline::expected_distinct_experts(
                config.num_experts,
                config.num_experts_per_tok,
                r.batch
            ),
        );
    }
    if !spec_rows.is_empty() {
        println!();
        println!(
            "speculative (nvfp4, short context; tok/s projected at acceptance {SPEC_ACCEPTANCE} \
             per draft from the measured step: the synthetic drafts are never accepted)"
        );
        println!(
            "{:>3} {:>2} {:>9} {:>10} {:>14}",
            "B", "n", "ms/step", "x n = 0", "proj. speed-up"
        );
        for r in &spec_rows {
            let plain = rows
                .iter()
                .find(|p| p.weights == "nvfp4" && p.batch == r.batch && p.context == "short")
                .map_or(f64::NAN, |p| p.step_s);
            println!(
                "{:>3} {:>2} {:>9.3} {:>9.3}x {:>13.2}x",
                r.batch,
                r.drafts,
                r.step_s * 1e3,
                r.step_s / plain,
                roofline::tokens_per_forward(r.drafts, SPEC_ACCEPTANCE) * plain / r.step_s
            );
        }
    }
}
