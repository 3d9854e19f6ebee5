//! Bench of the `moe` family on the device (CUDA, or HIP on a gfx1151): the whole MoE block
//! (router to combined output, shared expert included) in both launch forms (one persistent
//! launch; three split launches: route, gate_up, down) on the Qwen3.6-35B-A3B shape
//! (E = 256, k = 8, H = 2048, I = Is = 512) at T = 1, 4, 16, 64 tokens, NVFP4 and bf16 experts,
//! beside the ceiling measured in the same run (device-to-device copy bandwidth) and a
//! straightforward baseline.
//!
//! Every case is `LAUNCHES` back-to-back calls captured in one CUDA graph and replayed between
//! events (on HIP: launched back to back between HIP events; median per call). Each call gets its
//! own random input, so its own experts, and the weights rotate over enough copies that the experts
//! a call touches come from DRAM.
//!
//! Columns: "experts" = distinct experts the calls chose (mean over the calls; the reference
//! routing of each input); "MB" = bytes one call must read at least: those experts' weights
//! once, the shared expert, the router and X / Y ([`MoeWeights::block_bytes`]); "read-once" =
//! MB at the copy bandwidth; "persist" / "split us" / "stream us" / "bulk us" = the forms (the
//! last two where the target has them, [`MoeLaunch`]); "goal" = the bound
//! (T = 1: read-once + 6 us; T = 16, 64: 1.3 x read-once + 6 us; none at T = 4), "met", "GB/s"
//! and "x" for the form the library picks at that T (`moe.split_max_tokens`); "baseline" = the per-expert loop of the GEMM family's
//! `linear` on the same weights (router, then each chosen expert's gate_up with silu * up and
//! down on its gathered rows, then the shared expert), given the routing and the gathered rows
//! for free and without the weighted combine: a lower bound of what a straightforward version
//! costs; "x" = baseline / the picked form.
//!
//! Run: `cargo bench --bench moe` on a CUDA or ROCm host (prints one skip line elsewhere).

mod common;

use common::{LAUNCHES, bench_graph};
use criterion::Criterion;
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::gemm::{self, Epilogue, Linear, RowOrder};
use fp4spec::kernels::moe::reference::{self, MoeShape, Routing};
use fp4spec::kernels::moe::{
    self, ExpertFormat, ExpertWeights, MoeHostWeights, MoeLaunch, MoeWeights, MoeWorkspace,
};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::collections::{BTreeSet, HashMap};

const QWEN: MoeShape = MoeShape {
    experts: 256,
    top_k: 8,
    hidden: 2048,
    intermediate: 512,
    shared_intermediate: 512,
};
const TOKENS: [usize; 4] = [1, 4, 16, 64];
/// Bytes the weight copies must cover per rotation: several times the H200's 60 MB L2.
const ROTATION_BYTES: f64 = 512e6;

struct Row {
    format: ExpertFormat,
    t: usize,
    experts: f64,
    bytes: f64,
    persistent: f64,
    split: f64,
    /// The streaming launches (NaN where the target has none).
    stream: f64,
    /// The bulk launches (NaN where the target has none; bf16 experts run the streaming ones).
    bulk: f64,
    /// The form the library picks for this T (moe.split_max_tokens, moe.stream_min_tokens).
    chosen: f64,
    baseline: f64,
}

/// The baseline's weights: one `Linear` pair per expert that some call chose (and the shared
/// expert, and the router with the shared gate as a bf16 linear).
struct Baseline {
    router: Linear,
    shared: (Linear, Linear),
    experts: HashMap<u32, (Linear, Linear)>,
}

fn expert_linears(
    backend: &Backend,
    expert: &ExpertWeights,
    h: usize,
    i: usize,
) -> (Linear, Linear) {
    match expert {
        ExpertWeights::Bf16 { gate_up, down } => (
            Linear::bf16(backend, gate_up, 2 * i, h, RowOrder::GateUp).expect("gate_up"),
            Linear::bf16(backend, down, h, i, RowOrder::Plain).expect("down"),
        ),
        ExpertWeights::Nvfp4 { gate, up, down } => {
            // synthetic gate and up share one per-tensor scale, so [gate; up] is one matrix
            assert_eq!(
                gate.global_scale, up.global_scale,
                "synthetic gate/up scales"
            );
            let mut packed = gate.packed.clone();
            packed.extend_from_slice(&up.packed);
            let mut scales = gate.scales.clone();
            scales.extend_from_slice(&up.scales);
            let gate_up = Nvfp4Matrix {
                rows: 2 * i,
                cols: h,
                packed,
                scales,
                global_scale: gate.global_scale,
                input_scale: None,
            };
            (
                Linear::nvfp4(backend, &gate_up, RowOrder::GateUp).expect("gate_up"),
                Linear::nvfp4(backend, down, RowOrder::Plain).expect("down"),
            )
        }
    }
}

impl Baseline {
    fn new(backend: &Backend, host: &MoeHostWeights, chosen: &BTreeSet<u32>) -> Self {
        let s = host.shape;
        let mut router = host.router.clone();
        router.extend_from_slice(host.shared_gate.as_ref().expect("shared gate"));
        Self {
            router: Linear::bf16(backend, &router, s.experts + 1, s.hidden, RowOrder::Plain)
                .expect("router"),
            shared: expert_linears(
                backend,
                host.shared.as_ref().expect("shared expert"),
                s.hidden,
                s.shared_intermediate,
            ),
            experts: chosen
                .iter()
                .map(|&e| {
                    (
                        e,
                        expert_linears(
                            backend,
                            &host.experts[e as usize],
                            s.hidden,
                            s.intermediate,
                        ),
                    )
                })
                .collect(),
        }
    }
}

/// One chosen expert's part of a baseline call: its gathered rows and outputs.
struct ExpertCall {
    expert: u32,
    rows: usize,
    x: DeviceVec<bf16>,
    act: DeviceVec<bf16>,
    out: DeviceVec<bf16>,
}

/// One call's buffers for the baseline: the input, each chosen expert's part, the shared
/// expert's and the router's outputs.
struct BaselineCall {
    x: DeviceVec<bf16>,
    logits: DeviceVec<bf16>,
    shared_act: DeviceVec<bf16>,
    shared_out: DeviceVec<bf16>,
    experts: Vec<ExpertCall>,
}

fn baseline_call(
    backend: &Backend,
    s: MoeShape,
    x: &[bf16],
    t: usize,
    routing: &Routing,
) -> BaselineCall {
    let (h, k, i) = (s.hidden, s.top_k, s.intermediate);
    let mut rows: HashMap<u32, Vec<usize>> = HashMap::new();
    for (slot, &e) in routing.experts.iter().enumerate() {
        rows.entry(e).or_default().push(slot / k);
    }
    let mut experts: Vec<ExpertCall> = rows
        .into_iter()
        .map(|(expert, tokens)| {
            let gathered: Vec<bf16> = tokens
                .iter()
                .flat_map(|&token| x[token * h..(token + 1) * h].iter().copied())
                .collect();
            let n = tokens.len();
            ExpertCall {
                expert,
                rows: n,
                x: backend.upload(&gathered).expect("gathered X"),
                act: backend.zeros(n * i).expect("act"),
                out: backend.zeros(n * h).expect("out"),
            }
        })
        .collect();
    experts.sort_by_key(|call| call.expert);
    BaselineCall {
        x: backend.upload(x).expect("X"),
        logits: backend.zeros(t * (s.experts + 1)).expect("logits"),
        shared_act: backend.zeros(t * s.shared_intermediate).expect("act"),
        shared_out: backend.zeros(t * h).expect("out"),
        experts,
    }
}

fn run_baseline(backend: &Backend, w: &Baseline, t: usize, call: &mut BaselineCall) {
    gemm::linear(
        backend,
        &call.x,
        t,
        &w.router,
        Epilogue::None,
        &mut call.logits,
    )
    .expect("router");
    for part in &mut call.experts {
        let (gate_up, down) = &w.experts[&part.expert];
        gemm::linear(
            backend,
            &part.x,
            part.rows,
            gate_up,
            Epilogue::SiluMul,
            &mut part.act,
        )
        .expect("gate_up");
        gemm::linear(
            backend,
            &part.act,
            part.rows,
            down,
            Epilogue::None,
            &mut part.out,
        )
        .expect("down");
    }
    let (gate_up, down) = &w.shared;
    gemm::linear(
        backend,
        &call.x,
        t,
        gate_up,
        Epilogue::SiluMul,
        &mut call.shared_act,
    )
    .expect("shared gate_up");
    gemm::linear(
        backend,
        &call.shared_act,
        t,
        down,
        Epilogue::None,
        &mut call.shared_out,
    )
    .expect("shared down");
}

/// The reference routing of `x` (what the kernel chooses, up to near-ties).
fn routing_of(host: &MoeHostWeights, x: &[bf16], t: usize) -> Routing {
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let router: Vec<f32> = host.router.iter().map(|v| v.to_f32()).collect();
    let gate: Option<Vec<f32>> = host
        .shared_gate
        .as_ref()
        .map(|g| g.iter().map(|v| v.to_f32()).collect());
    reference::route(host.shape, &xf, t, &router, gate.as_deref())
}

fn random_x(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    (0..len)
        .map(|_| bf16::from_f32((2.0 * rng.uniform() - 1.0) * 3f32.sqrt()))
        .collect()
}

fn bench_format(
    criterion: &mut Criterion,
    backend: &Backend,
    rng: &mut SplitMix64,
    format: ExpertFormat,
    rows: &mut Vec<Row>,
) {
    let host = MoeHostWeights::synthetic(QWEN, format, rng.next_u64());
    let weights = MoeWeights::new(backend, &host).expect("MoE weights");
    let h = QWEN.hidden;
    // inputs and their routings first: the baseline is built for the experts they choose
    let inputs: Vec<Vec<(Vec<bf16>, Routing)>> = TOKENS
        .iter()
        .map(|&t| {
            (0..LAUNCHES)
                .map(|_| {
                    let x = random_x(rng, t * h);
                    let routing = routing_of(&host, &x, t);
                    (x, routing)
                })
                .collect()
        })
        .collect();
    let chosen: BTreeSet<u32> = inputs
        .iter()
        .flatten()
        .flat_map(|(_, r)| r.experts.iter().copied())
        .collect();
    let baseline = Baseline::new(backend, &host, &chosen);
    let mut workspace = MoeWorkspace::new(backend, &weights, *TOKENS.iter().max().expect("tokens"))
        .expect("workspace");
    for (&t, calls) in TOKENS.iter().zip(&inputs) {
        let distinct: Vec<usize> = calls
            .iter()
            .map(|(_, r)| r.experts.iter().collect::<BTreeSet<_>>().len())
            .collect();
        let bytes: Vec<u64> = distinct
            .iter()
            .map(|&d| weights.block_bytes(d, t))
            .collect();
        let mean_bytes = bytes.iter().sum::<u64>() as f64 / bytes.len() as f64;
        let copies = ((ROTATION_BYTES / mean_bytes).ceil() as usize).clamp(1, LAUNCHES);
        let mut rotation = vec![weights.try_clone(backend).expect("weight copy")];
        while rotation.len() < copies {
            rotation.push(weights.try_clone(backend).expect("weight copy"));
        }
        let xs: Vec<DeviceVec<bf16>> = calls
            .iter()
            .map(|(x, _)| backend.upload(x).expect("X"))
            .collect();
        let mut y: DeviceVec<bf16> = backend.zeros(t * h).expect("Y");
        let name = format!("T{t}");
        let target = backend.target().expect("a device backend");
        let launches = MoeLaunch::forms(target);
        let mut timed = Vec::new();
        for &launch in launches {
            timed.push(bench_graph(
                criterion,
                backend,
                &format!("moe_{format:?}/{launch:?}"),
                &name,
                mean_bytes as u64,
                |i| {
                    moe::moe_block_with(
                        backend,
                        &rotation[i % copies],
                        &xs[i],
                        t,
                        None,
                        &mut workspace,
                        &mut y,
                        launch,
                    )
                    .expect("moe_block")
                },
            ));
        }
        let (persistent, split) = (timed[0], timed[1]);
        let form = |wanted: MoeLaunch| {
            launches
                .iter()
                .position(|&f| f == wanted)
                .map_or(f64::NAN, |i| timed[i])
        };
        let (stream, bulk) = (form(MoeLaunch::Stream), form(MoeLaunch::Bulk));
        let auto = MoeLaunch::Auto.resolve(target, t);
        let chosen = form(auto);
        let last_launch = *launches.last().expect("a launch form");
        // the graph's last call (the last form) left its output in y: a direct launch must give
        // the same bits
        let replayed = backend.download(&y).expect("Y");
        let last = LAUNCHES - 1;
        let mut direct: DeviceVec<bf16> = backend.zeros(t * h).expect("Y");
        moe::moe_block_with(
            backend,
            &rotation[last % copies],
            &xs[last],
            t,
            None,
            &mut workspace,
            &mut direct,
            last_launch,
        )
        .expect("moe_block");
        let direct = backend.download(&direct).expect("Y");
        assert!(
            replayed
                .iter()
                .zip(&direct)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "moe {format:?} T={t}: the graph replay differs from a direct launch"
        );
        let mut baseline_calls: Vec<BaselineCall> = calls
            .iter()
            .map(|(x, routing)| baseline_call(backend, QWEN, x, t, routing))
            .collect();
        let baseline_time = bench_graph(
            criterion,
            backend,
            &format!("moe_{format:?}/baseline"),
            &name,
            mean_bytes as u64,
            |i| run_baseline(backend, &baseline, t, &mut baseline_calls[i]),
        );
        rows.push(Row {
            format,
            t,
            experts: distinct.iter().sum::<usize>() as f64 / distinct.len() as f64,
            bytes: mean_bytes,
            persistent,
            split,
            stream,
            bulk,
            chosen,
            baseline: baseline_time,
        });
    }
}

fn main() {
    let Some(backend) = common::device_or_skip("moe") else {
        return;
    };
    common::announce(&backend);
    let mut criterion = common::criterion();
    let copy_gbs = common::copy_bandwidth_gbs(&mut criterion, &backend);
    let mut rng = SplitMix64::new(0x0e5e);
    let mut rows = Vec::new();
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
        bench_format(&mut criterion, &backend, &mut rng, format, &mut rows);
    }
    criterion.final_summary();

    println!(
        "\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written, {} MiB each way)",
        common::COPY_BYTES >> 20
    );
    println!(
        "MoE block {QWEN:?}: read-once = MB / copy bandwidth; goal: T=1 read-once + 6 us, T=16/64 1.3 x read-once + 6 us"
    );
    println!(
        "{:<6} {:>3} {:>7} {:>8} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8} {:>4} {:>6} {:>7} {:>9} {:>6}",
        "format",
        "T",
        "experts",
        "MB",
        "read-once",
        "persist",
        "split us",
        "stream us",
        "bulk us",
        "goal us",
        "met",
        "GB/s",
        "of copy",
        "baseline",
        "x"
    );
    for row in &rows {
        let read_once = row.bytes / (copy_gbs * 1e9);
        let goal = match row.t {
            1 => Some(read_once + 6e-6),
            16 | 64 => Some(1.3 * read_once + 6e-6),
            _ => None,
        };
        let gbs = row.bytes / row.chosen / 1e9;
        println!(
            "{:<6} {:>3} {:>7.1} {:>8.2} {:>9.2} {:>8.2} {:>8.2} {:>9.2} {:>8.2} {:>8} {:>4} {:>6.0} {:>6.1}% {:>9.2} {:>6.2}",
            format!("{:?}", row.format).to_lowercase(),
            row.t,
            row.experts,
            row.bytes / 1e6,
            read_once * 1e6,
            row.persistent * 1e6,
            row.split * 1e6,
            row.stream * 1e6,
            row.bulk * 1e6,
            goal.map_or("-".into(), |g| format!("{:.2}", g * 1e6)),
            goal.map_or("-", |g| common::met(row.chosen, g)),
            gbs,
            100.0 * gbs / copy_gbs,
            row.baseline * 1e6,
            row.baseline / row.chosen
        );
    }
}
