//! Bench of the `gdn` family on the device (CUDA, or HIP on a gfx1151) at the Qwen3.6-35B-A3B
//! head shape (Hk 16, Hv 32, dk = dv = 128), with the ceilings measured in the same run:
//! device-to-device copy bandwidth (for the decode and verify steps, which must read and write
//! each sequence's 2 MiB state once) and, on CUDA only, cuBLAS bf16 GEMM at 8192^3 (for the
//! prefill's tensor-core work; a HIP run says it is absent). Calls are timed as
//! benches/common/mod.rs says: CUDA graph replays, or back-to-back launches on HIP.
//!
//! - decode, B in {1, 8, 64}: one `gdn_step` per layer and step (conv, gates, norms, the
//!   recurrence and the gated RMSNorm fused), goal `<= state bytes / copy bandwidth + 3 us`.
//!   Each timed call runs `ceil(16 / B)` steps on different sequence slots and every call of the
//!   captured graph its own slots (512 MiB of states or more per replay), so the states come
//!   from memory, not from the 60 MB L2, as they do for a 30-layer model.
//! - verify, n + 1 in {3, 5}, the same batches, with n + 1 tokens pending from the previous
//!   verify (the most a step replays): cost relative to decode at the same B, goal <= 1.3x at 3.
//! - prefill, T in {512, 4096, 16384, 65536}, one sequence, without the gated norm (fla's
//!   chunk_gated_delta_rule computes the same) and with it: FLOP/s against cuBLAS.
//!
//! fla's figures (measured independently on the H200 with fla 0.6.0, issue 8) are printed as
//! "x fla"; tools/reference/gdn_peers.py measures fla and us in one run.
//!
//! Run: `cargo bench --bench gdn` on a CUDA or ROCm host (prints one skip line elsewhere).

mod common;

use common::{LAUNCHES, bench_graph};
use criterion::Criterion;
use cudarc::cublas::CudaBlas;
use fp4spec::backend::Backend;
use fp4spec::backend::cuda::{CudaBackend, cublas};
use fp4spec::kernels::Bf16Rows;
use fp4spec::kernels::gdn::{
    self, Accepted, ChunkWorkspace, GdnCache, GdnParams, GdnShape, Projections, Sequences, StepMode,
};
use fp4spec::rng::SplitMix64;
use half::bf16;

const SHAPE: GdnShape = GdnShape {
    key_heads: 16,
    value_heads: 32,
    dk: 128,
    dv: 128,
};
const KERNEL: usize = 4;
const BATCHES: [usize; 3] = [1, 8, 64];
const VERIFY_TOKENS: [usize; 2] = [3, 5];
const PREFILL_T: [usize; 4] = [512, 4096, 16384, 65536];
/// fla 0.6.0 on the H200 (issue 8): fused_recurrent at B = 1, 8, 64 and chunk at T = 512,
/// 4096, 16384, microseconds.
const FLA_DECODE_US: [(usize, f64); 3] = [(1, 203.0), (8, 176.0), (64, 146.0)];
const FLA_CHUNK_US: [(usize, f64); 3] = [(512, 990.0), (4096, 980.0), (16384, 1110.0)];
const GEMM_SIDE: usize = 8192;

fn random_bf16(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

fn params(backend: &Backend, rng: &mut SplitMix64) -> GdnParams {
    let shape = SHAPE;
    GdnParams::upload(
        backend,
        shape,
        KERNEL,
        &rng.normal_vec(shape.conv_dim() * KERNEL, 0.5),
        &(0..shape.value_heads)
            .map(|h| (h as f32 * 0.3).ln_1p() - 1.0)
            .collect::<Vec<_>>(),
        &rng.normal_vec(shape.value_heads, 0.5),
        &vec![1.0; shape.dv],
        1e-6,
    )
    .expect("params")
}

/// Projection rows on the device.
struct Inputs {
    qkv: fp4spec::backend::DeviceVec<bf16>,
    a: fp4spec::backend::DeviceVec<bf16>,
    b: fp4spec::backend::DeviceVec<bf16>,
    z: fp4spec::backend::DeviceVec<bf16>,
}

impl Inputs {
    fn new(backend: &Backend, rng: &mut SplitMix64, rows: usize) -> Self {
        let s = SHAPE;
        let up = |v: Vec<bf16>| backend.upload(&v).expect("upload");
        Self {
            qkv: up(random_bf16(rng, rows * s.conv_dim())),
            a: up(random_bf16(rng, rows * s.value_heads)),
            b: up(random_bf16(rng, rows * s.value_heads)),
            z: up(random_bf16(rng, rows * s.value_heads * s.dv)),
        }
    }

    fn projections(&self, gated: bool) -> Projections<'_> {
        let s = SHAPE;
        Projections {
            qkv: Bf16Rows::packed(&self.qkv, s.conv_dim()),
            a: Bf16Rows::packed(&self.a, s.value_heads),
            b: Bf16Rows::packed(&self.b, s.value_heads),
            z: gated.then(|| Bf16Rows::packed(&self.z, s.value_heads * s.dv)),
        }
    }
}

struct StepRow {
    kind: String,
    batch: usize,
    tokens: usize,
    seconds: f64,
}

/// Decode (gated and not) and verify steps at batch `batch`.
fn bench_steps(
    criterion: &mut Criterion,
    backend: &Backend,
    rng: &mut SplitMix64,
    batch: usize,
    out: &mut Vec<StepRow>,
) {
    let per_call = 16usize.div_ceil(batch);
    let groups = LAUNCHES * per_call;
    let max_m = *VERIFY_TOKENS.iter().max().unwrap_or(&1);
    let params = params(backend, rng);
    let mut cache =
        GdnCache::new(backend, SHAPE, KERNEL, groups * batch, max_m).expect("cache (memory)");
    let mut seqs: Vec<Sequences> = (0..groups)
        .map(|g| {
            let slots: Vec<u32> = (0..batch).map(|b| (g * batch + b) as u32).collect();
            Sequences::new(backend, &slots, &vec![100; batch]).expect("sequences")
        })
        .collect();
    let state_bytes = 2 * batch as u64 * gdn::state_bytes(SHAPE);
    for (kind, gated) in [("decode", true), ("decode raw o", false)] {
        let inputs = Inputs::new(backend, rng, batch);
        let projections = inputs.projections(gated);
        let mut y = backend
            .zeros::<bf16>(batch * SHAPE.value_heads * SHAPE.dv)
            .expect("output");
        let seconds = bench_graph(
            criterion,
            backend,
            &format!("gdn/{kind}"),
            &format!("B{batch}"),
            state_bytes * per_call as u64,
            |i| {
                for r in 0..per_call {
                    let s = &seqs[i * per_call + r];
                    gdn::step(
                        backend,
                        &params,
                        &mut cache,
                        s,
                        1,
                        &projections,
                        StepMode::Decode,
                        &mut y,
                    )
                    .expect("decode step");
                }
            },
        ) / per_call as f64;
        out.push(StepRow {
            kind: kind.into(),
            batch,
            tokens: 1,
            seconds,
        });
    }
    for tokens in VERIFY_TOKENS {
        let inputs = Inputs::new(backend, rng, batch * tokens);
        let projections = inputs.projections(true);
        let mut y = backend
            .zeros::<bf16>(batch * tokens * SHAPE.value_heads * SHAPE.dv)
            .expect("output");
        // every sequence accepts all n + 1 tokens once: each timed step replays n + 1
        for s in &mut seqs {
            gdn::step(
                backend,
                &params,
                &mut cache,
                s,
                tokens,
                &projections,
                StepMode::Verify,
                &mut y,
            )
            .expect("verify step");
            s.commit(backend, Accepted::All(tokens as u32), StepMode::Verify)
                .expect("commit");
        }
        let seconds = bench_graph(
            criterion,
            backend,
            "gdn/verify",
            &format!("B{batch}_n+1={tokens}"),
            state_bytes * per_call as u64,
            |i| {
                for r in 0..per_call {
                    let s = &seqs[i * per_call + r];
                    gdn::step(
                        backend,
                        &params,
                        &mut cache,
                        s,
                        tokens,
                        &projections,
                        StepMode::Verify,
                        &mut y,
                    )
                    .expect("verify step");
                }
            },
        ) / per_call as f64;
        out.push(StepRow {
            kind: "verify".into(),
            batch,
            tokens,
            seconds,
        });
        for s in &mut seqs {
            gdn::flush(backend, &params, &mut cache, s).expect("flush");
        }
    }
}

struct PrefillRow {
    tokens: usize,
    gated: bool,
    seconds: f64,
}

fn bench_prefill(
    criterion: &mut Criterion,
    backend: &Backend,
    rng: &mut SplitMix64,
    tokens: usize,
    out: &mut Vec<PrefillRow>,
) {
    let params = params(backend, rng);
    let mut cache = GdnCache::new(backend, SHAPE, KERNEL, 1, 1).expect("cache");
    let mut workspace = ChunkWorkspace::new(backend, SHAPE, tokens, 1).expect("workspace (memory)");
    let seqs = Sequences::new(backend, &[0], &[0]).expect("sequences");
    let inputs = Inputs::new(backend, rng, tokens);
    let mut y = backend
        .zeros::<bf16>(tokens * SHAPE.value_heads * SHAPE.dv)
        .expect("output");
    let cu = [0, tokens as u32];
    for gated in [false, true] {
        let projections = inputs.projections(gated);
        // bf16 in: q, k, v (the conv's channels), a and b, and z where gated; bf16 out: y
        let y_width = SHAPE.value_heads * SHAPE.dv;
        let z_width = if gated { y_width } else { 0 };
        let bytes =
            (tokens * (SHAPE.conv_dim() + 2 * SHAPE.value_heads + z_width + y_width) * 2) as u64;
        let seconds = bench_graph(
            criterion,
            backend,
            &format!("gdn/prefill{}", if gated { "_gated" } else { "" }),
            &format!("T{tokens}"),
            bytes,
            |_| {
                gdn::prefill(
                    backend,
                    &params,
                    &mut cache,
                    &mut workspace,
                    &seqs,
                    &cu,
                    &projections,
                    &mut y,
                )
                .expect("prefill")
            },
        );
        out.push(PrefillRow {
            tokens,
            gated,
            seconds,
        });
    }
}

/// cuBLAS bf16 GEMM at `GEMM_SIDE`^3 on `cuda`, TFLOP/s: the prefill's matrix ceiling (cuBLAS
/// is CUDA's; a HIP run reports it absent).
fn cublas_tflops(
    criterion: &mut Criterion,
    backend: &Backend,
    cuda: &CudaBackend,
    rng: &mut SplitMix64,
) -> f64 {
    let blas =
        std::cell::RefCell::new(CudaBlas::new(cuda.stream().clone()).expect("cuBLAS handle"));
    let n = GEMM_SIDE;
    let (w, x) = (
        cuda.stream()
            .clone_htod(&random_bf16(rng, n * n))
            .expect("upload"),
        cuda.stream()
            .clone_htod(&random_bf16(rng, n * n))
            .expect("upload"),
    );
    let mut gemm_y = cuda.stream().alloc_zeros::<bf16>(n * n).expect("allocate");
    let gemm_seconds = bench_graph(
        criterion,
        backend,
        "cublas_bf16",
        &format!("{n}^3"),
        0,
        |_| {
            // on the stream this thread launches to (inside bench_graph's capture, the capture
            // stream): a handle left on the backend's stream ran its GEMMs outside the graph,
            // which then timed nothing (the GEMM bench's fix, 30d10cc)
            let mut blas = blas.borrow_mut();
            // SAFETY: the stream belongs to the handle's context; nothing of the handle's is in
            // flight on another stream (every call is on this thread, one at a time)
            unsafe { blas.set_stream(cuda.stream().clone()) }.expect("cuBLAS stream");
            cublas::gemm_bf16_x_wt(&blas, &w, &x, &mut gemm_y, (n, n, n)).expect("cuBLAS")
        },
    );
    2.0 * (n as f64).powi(3) / gemm_seconds / 1e12
}

fn main() {
    let Some(backend) = common::device_or_skip("gdn") else {
        return;
    };
    let mut criterion = common::criterion();
    common::announce(&backend);
    let copy_gbs = common::copy_bandwidth_gbs(&mut criterion, &backend);

    let mut rng = SplitMix64::new(0x6d6e);
    let n = GEMM_SIDE;
    let matrix_tflops = match &backend {
        Backend::Cuda(cuda) => cublas_tflops(&mut criterion, &backend, cuda, &mut rng),
        _ => f64::NAN,
    };

    let mut steps = Vec::new();
    for batch in BATCHES {
        bench_steps(&mut criterion, &backend, &mut rng, batch, &mut steps);
    }
    let mut prefills = Vec::new();
    for tokens in PREFILL_T {
        bench_prefill(&mut criterion, &backend, &mut rng, tokens, &mut prefills);
    }
    criterion.final_summary();

    println!("\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written)");
    match &backend {
        Backend::Cuda(_) => println!("cuBLAS bf16 {n}^3: {matrix_tflops:.0} TFLOP/s"),
        _ => println!(
            "cuBLAS bf16 {n}^3: absent (cuBLAS is CUDA's; no matrix ceiling on {}, so \"of cuBLAS\" \
             reads NaN)",
            backend.name()
        ),
    }
    println!(
        "\nsteps: state bytes = 2 x B x {} MiB (read + written); floor = bytes / copy bandwidth",
        gdn::state_bytes(SHAPE) >> 20
    );
    println!(
        "(goal, the GDN issue's: a decode step within floor + 3 us; a verify step of n + 1 = 3 \
         within 1.3 x the decode step of its batch)"
    );
    println!(
        "{:<13} {:>3} {:>4} {:>9} {:>9} {:>9} {:>8} {:>9} {:>7} {:>9} {:>4}",
        "kind",
        "B",
        "n+1",
        "us",
        "floor us",
        "-floor",
        "of copy",
        "x decode",
        "x fla",
        "goal us",
        "met"
    );
    for row in &steps {
        let bytes = 2.0 * row.batch as f64 * gdn::state_bytes(SHAPE) as f64;
        let floor = bytes / (copy_gbs * 1e9);
        let decode = steps
            .iter()
            .find(|r| r.kind == "decode" && r.batch == row.batch)
            .map_or(f64::NAN, |r| r.seconds);
        let fla = FLA_DECODE_US
            .iter()
            .find(|(b, _)| *b == row.batch)
            .map_or(f64::NAN, |(_, us)| us * 1e-6);
        let goal = match (row.kind.as_str(), row.tokens) {
            ("decode", _) => Some(floor + 3e-6),
            ("verify", 3) => Some(1.3 * decode),
            _ => None,
        };
        println!(
            "{:<13} {:>3} {:>4} {:>9.2} {:>9.2} {:>9.2} {:>7.1}% {:>9.2} {:>7.1} {:>9} {:>4}",
            row.kind,
            row.batch,
            row.tokens,
            row.seconds * 1e6,
            floor * 1e6,
            (row.seconds - floor) * 1e6,
            100.0 * floor / row.seconds,
            row.seconds / decode,
            if row.kind == "verify" {
                f64::NAN
            } else {
                fla / row.seconds
            },
            goal.map_or("-".into(), |g| format!("{:.2}", g * 1e6)),
            goal.map_or("-", |g| common::met(row.seconds, g)),
        );
    }
    println!(
        "\nprefill (one sequence): FLOP = gdn::chunk_flops (tensor-core products), against cuBLAS"
    );
    println!(
        "{:>6} {:>6} {:>10} {:>9} {:>9} {:>9} {:>7}",
        "T", "gated", "us", "GFLOP", "TFLOP/s", "of cuBLAS", "x fla"
    );
    for row in &prefills {
        let flops = gdn::chunk_flops(SHAPE, row.tokens);
        let tflops = flops / row.seconds / 1e12;
        let fla = FLA_CHUNK_US
            .iter()
            .find(|(t, _)| *t == row.tokens)
            .map_or(f64::NAN, |(_, us)| us * 1e-6);
        println!(
            "{:>6} {:>6} {:>10.1} {:>9.1} {:>9.1} {:>8.1}% {:>7.2}",
            row.tokens,
            row.gated,
            row.seconds * 1e6,
            flops / 1e9,
            tflops,
            100.0 * tflops / matrix_tflops,
            if row.gated {
                f64::NAN
            } else {
                fla / row.seconds
            }
        );
    }
}
