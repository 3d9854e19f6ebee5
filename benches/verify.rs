//! Bench of the `verify` family on the device (CUDA, or HIP on a gfx1151): batched speculative
//! verification of B sequences with n drafts each at V = 248320 fp32 logits, every sampling control
//! on (temperature 0.7, top-k 50, top-p 0.9, min-p 0.05, eight logit-bias entries), point-mass
//! drafts (a greedy drafter such as the MTP head) and sampled drafts (with their logit rows),
//! beside the device copy bandwidth measured in the same run; with top-k on `verify_topk` serves
//! the batch, so the same controls with top-k off ("no-top-k") measure the histogram passes.
//! Greedy cases (the same controls at
//! temperature 0: pass 1 finds the argmax, pass 2 and the row finish do nothing) measure the floor
//! of the launches and their fixed latency chains; the sampled cases' excess over them is the cost
//! of the sampling machinery (histogram, plan, pass 2, exact finish).
//!
//! Each case is timed as decode runs it: back-to-back calls of `verify::verify` captured in one
//! CUDA graph, each on its own copy of the logits (`common::rotation_copies`: 256 MiB of copies,
//! and as many calls, at least `LAUNCHES`, so every call reads DRAM), replayed between CUDA events (on
//! HIP: launched back to back between HIP events); the figure is the median time per call. "bytes"
//! is the logits read once (target rows, and draft rows for sampled drafts); "1 pass" is those
//! bytes at the copy bandwidth; the goal is at most 2 passes + 5 us.
//!
//! Run: `cargo bench --bench verify` on a CUDA or ROCm host (prints one skip line elsewhere).

mod common;

use common::{COPY_BYTES, LAUNCHES, bench_graph_calls, rotation_copies};
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::kernels::verify::{
    self, Capacity, DraftKind, SamplingParams, Sequence, VerifyWorkspace,
};
use fp4spec::rng::SplitMix64;

const VOCAB: usize = 248_320;
const BATCHES: [usize; 3] = [1, 8, 64];
const DRAFTS: [usize; 3] = [1, 2, 4];
/// Distinct logit rows the cases are tiled from (generating 300 MB of normals would dominate).
const POOL_ROWS: usize = 24;

/// Every control on, at values a chat deployment uses.
fn all_controls(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.05,
        logit_bias: vec![
            (3, 2.0),
            (17, -1.5),
            (99, f32::NEG_INFINITY),
            (1234, 0.5),
            (1234, 0.25),
            (20_000, 1.0),
            (5, -0.5),
            (77, 3.0),
        ],
        seed,
    }
}

/// Rows shaped like a language model's: a broad bulk and eight strong candidates.
fn pool(rng: &mut SplitMix64) -> Vec<Vec<f32>> {
    (0..POOL_ROWS)
        .map(|_| {
            let mut row = rng.normal_vec(VOCAB, 2.0);
            for k in 0..8 {
                row[(rng.next_u64() % VOCAB as u64) as usize] = 12.0 - k as f32;
            }
            row
        })
        .collect()
}

/// [`all_controls`] at temperature 0 (the bias still applies).
fn greedy(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..all_controls(seed)
    }
}

/// [`all_controls`] with top-k off: the histogram passes (with top-k on, `verify_topk`).
fn top_k_off(seed: u64) -> SamplingParams {
    SamplingParams {
        top_k: 0,
        ..all_controls(seed)
    }
}

/// Which controls a case runs: a name for the table and the controls of sequence s.
#[derive(Clone, Copy)]
struct Controls {
    name: &'static str,
    params: fn(u64) -> SamplingParams,
}

const ALL_CONTROLS: Controls = Controls {
    name: "all",
    params: all_controls,
};
const GREEDY: Controls = Controls {
    name: "greedy",
    params: greedy,
};
const TOP_K_OFF: Controls = Controls {
    name: "no-top-k",
    params: top_k_off,
};

struct Row {
    controls: &'static str,
    kind: DraftKind,
    batch: usize,
    drafts: usize,
    bytes: u64,
    seconds: f64,
    accepted: f64,
}

#[allow(clippy::too_many_arguments)]
fn bench_case(
    criterion: &mut criterion::Criterion,
    backend: &Backend,
    rows_pool: &[Vec<f32>],
    rng: &mut SplitMix64,
    controls: Controls,
    kind: DraftKind,
    batch: usize,
    drafts: usize,
    out: &mut Vec<Row>,
) {
    let params: Vec<SamplingParams> = (0..batch).map(|s| (controls.params)(s as u64)).collect();
    let sequences: Vec<Sequence> = params
        .iter()
        .enumerate()
        .map(|(s, p)| Sequence {
            params: p,
            position: 1000 + 7 * s as u64,
            drafts,
        })
        .collect();
    let target_rows = batch * (drafts + 1);
    let mut target = Vec::with_capacity(target_rows * VOCAB);
    let mut tokens = Vec::with_capacity(batch * drafts);
    let mut draft_logits = Vec::new();
    for s in 0..batch {
        for j in 0..=drafts {
            let row = &rows_pool[(s * 5 + j) % rows_pool.len()];
            target.extend_from_slice(row);
            if j < drafts {
                // mostly the target's favourite, as a good drafter proposes
                let best = verify::reference::greedy_token(row, &params[s], j).expect("row");
                tokens.push(if rng.next_u64() % 4 == 0 {
                    (rng.next_u64() % VOCAB as u64) as u32
                } else {
                    best
                });
                if kind == DraftKind::Sampled {
                    let mut d = row.clone();
                    d.iter_mut().step_by(5).for_each(|v| *v += 1.0);
                    draft_logits.extend_from_slice(&d);
                }
            }
        }
    }
    let capacity = Capacity {
        vocab: VOCAB,
        max_sequences: batch,
        max_drafts: drafts,
        max_bias_entries: params.iter().map(|p| p.logit_bias.len()).sum(),
    };
    let mut ws = VerifyWorkspace::new(backend, capacity).expect("workspace");
    ws.set_batch(&sequences, kind).expect("set_batch");
    let bytes = verify::logits_bytes(&ws);
    let copies = rotation_copies(bytes);
    let targets: Vec<DeviceVec<f32>> = (0..copies)
        .map(|_| backend.upload(&target).expect("upload target logits"))
        .collect();
    let drafts_dev: Vec<DeviceVec<f32>> = if kind == DraftKind::Sampled {
        (0..copies)
            .map(|_| backend.upload(&draft_logits).expect("upload draft logits"))
            .collect()
    } else {
        Vec::new()
    };
    let tokens_dev = backend.upload(&tokens).expect("upload draft tokens");
    let name = match controls.name {
        "all" => format!("{kind:?}_B{batch}_n{drafts}"),
        other => format!("{kind:?}_{other}_B{batch}_n{drafts}"),
    };
    let calls = copies.max(LAUNCHES);
    let seconds = bench_graph_calls(criterion, backend, "verify", &name, bytes, calls, |i| {
        let draft = drafts_dev.get(i % copies);
        verify::verify(backend, &mut ws, &targets[i % copies], &tokens_dev, draft).expect("verify")
    });
    let outcomes = ws.outcomes().expect("outcomes");
    let accepted = outcomes
        .iter()
        .map(|o| o.as_ref().expect("a verified sequence").accepted as f64)
        .sum::<f64>()
        / batch as f64;
    out.push(Row {
        controls: controls.name,
        kind,
        batch,
        drafts,
        bytes,
        seconds,
        accepted,
    });
}

fn main() {
    let Some(backend) = common::device_or_skip("verify") else {
        return;
    };
    let mut criterion = common::criterion();
    common::announce(&backend);
    let copy_gbs = common::copy_bandwidth_gbs(&mut criterion, &backend);
    let mut rng = SplitMix64::new(0x5eed);
    let rows_pool = pool(&mut rng);
    let mut rows = Vec::new();
    for kind in [DraftKind::PointMass, DraftKind::Sampled] {
        for batch in BATCHES {
            for drafts in DRAFTS {
                bench_case(
                    &mut criterion,
                    &backend,
                    &rows_pool,
                    &mut rng,
                    ALL_CONTROLS,
                    kind,
                    batch,
                    drafts,
                    &mut rows,
                );
            }
        }
    }
    // the histogram passes: every control but top-k
    for kind in [DraftKind::PointMass, DraftKind::Sampled] {
        for batch in BATCHES {
            for drafts in [1, 4] {
                bench_case(
                    &mut criterion,
                    &backend,
                    &rows_pool,
                    &mut rng,
                    TOP_K_OFF,
                    kind,
                    batch,
                    drafts,
                    &mut rows,
                );
            }
        }
    }
    // the floor: greedy rows (draft rows are not read, so point-mass drafts only)
    for batch in BATCHES {
        bench_case(
            &mut criterion,
            &backend,
            &rows_pool,
            &mut rng,
            GREEDY,
            DraftKind::PointMass,
            batch,
            1,
            &mut rows,
        );
    }
    criterion.final_summary();

    println!(
        "\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written, {} MiB each way)",
        COPY_BYTES >> 20
    );
    println!(
        "V = {VOCAB}; controls: all = every control on (verify_topk), no-top-k = all but top-k (the histogram passes), greedy = all at temperature 0; bytes = logits read once; 1 pass = bytes / copy bandwidth; goal = 2 passes + 5 us"
    );
    println!(
        "{:<8} {:<9} {:>3} {:>2} {:>10} {:>8} {:>8} {:>6} {:>7} {:>8} {:>5} {:>9}",
        "controls",
        "drafts",
        "B",
        "n",
        "bytes",
        "us",
        "1 pass",
        "GB/s",
        "of copy",
        "goal us",
        "met",
        "accepted"
    );
    for row in &rows {
        let gbs = row.bytes as f64 / row.seconds / 1e9;
        let pass = row.bytes as f64 / (copy_gbs * 1e9);
        let goal = 2.0 * pass + 5e-6;
        println!(
            "{:<8} {:<9} {:>3} {:>2} {:>10} {:>8.2} {:>8.2} {:>6.0} {:>6.1}% {:>8.2} {:>5} {:>9.2}",
            row.controls,
            match row.kind {
                DraftKind::PointMass => "point",
                DraftKind::Sampled => "sampled",
            },
            row.batch,
            row.drafts,
            row.bytes,
            row.seconds * 1e6,
            pass * 1e6,
            gbs,
            100.0 * gbs / copy_gbs,
            goal * 1e6,
            common::met(row.seconds, goal),
            row.accepted
        );
    }
}
