//! End-to-end decode on the device: a full-size Qwen3.6-35B-A3B with synthetic weights
//! ([`DeviceModel::synthetic`], NVFP4 by the ModelOpt recipe and all-bf16), `B` sequences decoding
//! one token each per step (n = 0, no speculation), the step replayed from its captured CUDA
//! graph, beside the device copy bandwidth measured in the same run.
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
use fp4spec::model::config::ModelConfig;
use fp4spec::model::device::{Decoder, DeviceModel, SyntheticWeights};
use fp4spec::roofline::{self, Step};
use std::time::{Duration, Instant};

const NVFP4_BATCHES: [usize; 6] = [1, 4, 8, 16, 32, 64];
const BF16_BATCHES: [usize; 2] = [1, 16];
const LONG_CONTEXT: usize = 20000;
/// Positions per sequence: room for the long-context start plus every timed step.
const CAPACITY: usize = LONG_CONTEXT + 4096;
/// Steps timed per eager measurement.
const EAGER_STEPS: usize = 20;

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

/// Median seconds per step of `decoder.step()` (graph replays), timed by criterion.
fn time_steps(
    c: &mut Criterion,
    backend: &Backend,
    decoder: &mut Decoder<'_>,
    name: &str,
    bytes: f64,
    start: usize,
) -> f64 {
    let samples = Samples::default();
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            if decoder.position() + iters as usize > CAPACITY {
                decoder.skip_to(start).expect("restart the sequences");
            }
            let begin = backend.record_event().expect("event");
            for _ in 0..iters {
                decoder.step().expect("decode step");
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
) {
    let config = ModelConfig::qwen36_35b_a3b();
    let label = match weights {
        SyntheticWeights::Nvfp4 => "nvfp4",
        SyntheticWeights::Bf16 => "bf16",
    };
    let precision = weights.precision();
    let built = Instant::now();
    let model = match DeviceModel::synthetic(backend, &config, weights, 0x5eed) {
        Ok(model) => model,
        Err(e) => {
            println!("skipped the {label} model: {e}");
            return;
        }
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
                },
            )
            .total();
            let name = format!("{label}/B{batch}/ctx_{context}");
            let step_s = time_steps(c, backend, &mut decoder, &name, bytes, start);
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
    let mut rows = Vec::new();
    run(
        &mut c,
        &backend,
        SyntheticWeights::Nvfp4,
        &NVFP4_BATCHES,
        &mut rows,
    );
    run(
        &mut c,
        &backend,
        SyntheticWeights::Bf16,
        &BF16_BATCHES,
        &mut rows,
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
}
