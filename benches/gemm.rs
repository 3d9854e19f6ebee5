//! Bench of the `gemm` family on the CUDA device, with the ceilings measured in the same run:
//! device-to-device copy bandwidth and cuBLAS bf16 on the same shapes.
//!
//! The copy is timed as plain in-stream copies between CUDA events; every other case as decode
//! runs it: `LAUNCHES` back-to-back calls captured in one CUDA
//! graph, each on its own copy of the weights (enough copies to exceed the L2 cache), replayed
//! between CUDA events; the figure is the median time per call. "bytes" is the fewest bytes the
//! call must move (weights once, X once, Y once).
//!
//! Variants: `gemv` (the straightforward NVFP4 kernel, the reference GPU version), `mma` (the
//! tensor-core kernels on NVFP4 or bf16 weights), `cublas` (bf16 weights, the peer).
//!
//! Run: `cargo bench --bench gemm [-- FILTER]` on a CUDA host (prints one skip line elsewhere).

use criterion::{Criterion, Throughput};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use fp4spec::backend::cuda::CudaBackend;
use fp4spec::backend::cuda::cublas;
use fp4spec::backend::{Backend, BackendKind, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::gemm::{self, Epilogue, Linear, RowOrder};
use fp4spec::kernels::{Nvfp4Weights, dequant};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::cell::RefCell;
use std::time::Duration;

/// Weight bytes the rotation must cover: several times the H200's 60 MB L2.
const ROTATION_BYTES: u64 = 256 << 20;
/// Calls per captured graph.
const LAUNCHES: usize = 16;
/// Each side of the copy-bandwidth measurement.
const COPY_BYTES: usize = 512 << 20;
const MODEL_ROWS: [usize; 5] = [1, 3, 4, 16, 64];
/// Weights of at least 64 MiB: the lm_head and a synthetic large matrix.
const STREAMING_SHAPES: [(usize, usize); 2] = [(248320, 2048), (65536, 4096)];
const STREAMING_ROWS: [usize; 4] = [1, 4, 16, 64];

/// Per-call seconds of every sample criterion took.
#[derive(Default)]
struct Samples(RefCell<Vec<f64>>);

impl Samples {
    fn median(&self) -> f64 {
        let mut v = self.0.borrow().clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Captures `LAUNCHES` calls of `call(i)` into a graph and benches its replays.
fn bench_graph(
    criterion: &mut Criterion,
    cuda: &CudaBackend,
    group: &str,
    name: &str,
    bytes: u64,
    mut call: impl FnMut(usize),
) -> f64 {
    let stream = cuda.stream();
    for i in 0..LAUNCHES {
        call(i); // warm up: compile, grow scratch, create handles outside the capture
    }
    stream.synchronize().expect("warm-up");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    for i in 0..LAUNCHES {
        call(i);
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a captured graph");
    graph.upload().expect("upload graph");
    let samples = Samples::default();
    let mut g = criterion.benchmark_group(group);
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let start = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            for _ in 0..iters {
                graph.launch().expect("graph launch");
            }
            let end = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            let seconds = f64::from(start.elapsed_ms(&end).expect("event timing")) / 1e3;
            samples
                .0
                .borrow_mut()
                .push(seconds / (iters as f64 * LAUNCHES as f64));
            Duration::from_secs_f64(seconds / LAUNCHES as f64)
        })
    });
    g.finish();
    samples.median()
}

fn copies_for(weight_bytes: u64) -> usize {
    ROTATION_BYTES
        .div_ceil(weight_bytes)
        .clamp(2, LAUNCHES as u64) as usize
}

struct Row {
    set: &'static str,
    variant: &'static str,
    m: usize,
    n: usize,
    k: usize,
    bytes: u64,
    seconds: f64,
}

#[allow(clippy::too_many_arguments)]
fn bench_shape(
    criterion: &mut Criterion,
    backend: &Backend,
    cuda: &CudaBackend,
    blas: &CudaBlas,
    rng: &mut SplitMix64,
    set: &'static str,
    n: usize,
    k: usize,
    rows: &[usize],
    with_gemv: bool,
    out: &mut Vec<Row>,
) {
    let q = Nvfp4Matrix::quantize("bench W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
    let dense = dequant::reference::dequant_nvfp4_bf16(q.view());
    let nvfp4: Vec<Linear> = (0..copies_for(q.bytes() as u64))
        .map(|_| Linear::nvfp4(backend, &q, RowOrder::Plain).expect("upload"))
        .collect();
    let bf16_copies = copies_for(2 * (n * k) as u64);
    let bf16: Vec<Linear> = (0..bf16_copies)
        .map(|_| Linear::bf16(backend, &dense, n, k, RowOrder::Plain).expect("upload"))
        .collect();
    let dense_dev: Vec<CudaSlice<bf16>> = (0..bf16_copies)
        .map(|_| cuda.stream().clone_htod(&dense).expect("upload"))
        .collect();
    let plain: Vec<Nvfp4Weights> = if with_gemv {
        (0..nvfp4.len())
            .map(|_| Nvfp4Weights::upload(backend, &q).expect("upload"))
            .collect()
    } else {
        Vec::new()
    };
    for &m in rows {
        let x: Vec<bf16> = rng
            .normal_vec(m * k, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let x_dev = backend.upload(&x).expect("upload X");
        let DeviceVec::Cuda(x_slice) = &x_dev else {
            unreachable!("CUDA backend")
        };
        let mut y: DeviceVec<bf16> = backend.zeros(m * n).expect("allocate Y");
        let name = format!("M{m}_N{n}_K{k}");
        let record = |out: &mut Vec<Row>, variant, bytes, seconds| {
            out.push(Row {
                set,
                variant,
                m,
                n,
                k,
                bytes,
                seconds,
            })
        };
        let io = 2 * (m * k + m * n) as u64;
        let nvfp4_bytes = nvfp4[0].bytes(m, &Epilogue::None);
        let seconds = bench_graph(
            criterion,
            cuda,
            &format!("{set}/mma_nvfp4"),
            &name,
            nvfp4_bytes,
            |i| {
                gemm::linear(
                    backend,
                    &x_dev,
                    m,
                    &nvfp4[i % nvfp4.len()],
                    Epilogue::None,
                    &mut y,
                )
                .expect("linear")
            },
        );
        record(out, "mma nvfp4", nvfp4_bytes, seconds);
        if with_gemv {
            let seconds = bench_graph(
                criterion,
                cuda,
                &format!("{set}/gemv_nvfp4"),
                &name,
                nvfp4_bytes,
                |i| {
                    gemm::nvfp4_gemm(backend, &x_dev, m, &plain[i % plain.len()], &mut y)
                        .expect("gemv")
                },
            );
            record(out, "gemv nvfp4", nvfp4_bytes, seconds);
        }
        let bf16_bytes = bf16[0].bytes(m, &Epilogue::None);
        let seconds = bench_graph(
            criterion,
            cuda,
            &format!("{set}/mma_bf16"),
            &name,
            bf16_bytes,
            |i| {
                gemm::linear(
                    backend,
                    &x_dev,
                    m,
                    &bf16[i % bf16.len()],
                    Epilogue::None,
                    &mut y,
                )
                .expect("linear")
            },
        );
        record(out, "mma bf16", bf16_bytes, seconds);
        let DeviceVec::Cuda(y_slice) = &mut y else {
            unreachable!("CUDA backend")
        };
        let cublas_bytes = 2 * (n * k) as u64 + io;
        let seconds = bench_graph(
            criterion,
            cuda,
            &format!("{set}/cublas_bf16"),
            &name,
            cublas_bytes,
            |i| {
                cublas::gemm_bf16_x_wt(
                    blas,
                    &dense_dev[i % dense_dev.len()],
                    x_slice,
                    y_slice,
                    (m, n, k),
                )
                .expect("cuBLAS")
            },
        );
        record(out, "cublas bf16", cublas_bytes, seconds);
    }
}

fn main() {
    let backend = match Backend::new(BackendKind::Cuda) {
        Ok(backend) => backend,
        Err(e) => {
            println!("skipped bench gemm: {e}");
            return;
        }
    };
    let Backend::Cuda(cuda) = &backend else {
        unreachable!("asked for CUDA")
    };
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(400))
        .configure_from_args();
    println!(
        "device: {} ({} SMs)",
        backend.describe(),
        cuda.multiprocessors()
    );
    let blas = CudaBlas::new(cuda.stream().clone()).expect("cuBLAS handle");

    // ceiling: device-to-device copy, bytes read + written
    let copy_seconds = {
        let src = cuda
            .stream()
            .alloc_zeros::<u8>(COPY_BYTES)
            .expect("allocate copy source");
        let mut dst = cuda
            .stream()
            .alloc_zeros::<u8>(COPY_BYTES)
            .expect("allocate copy destination");
        // not captured: inside a graph the same copy ran at 2767 GB/s against 4220 in-stream
        // (H200, 2026-12-02), which would flatter every other figure
        let samples = Samples::default();
        let mut g = criterion.benchmark_group("copy");
        g.throughput(Throughput::Bytes(2 * COPY_BYTES as u64));
        g.bench_function("device_to_device_512MiB", |b| {
            b.iter_custom(|iters| {
                let stream = cuda.stream();
                let start = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .expect("event");
                for _ in 0..iters {
                    stream.memcpy_dtod(&src, &mut dst).expect("memcpy");
                }
                let end = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .expect("event");
                let seconds = f64::from(start.elapsed_ms(&end).expect("event timing")) / 1e3;
                samples.0.borrow_mut().push(seconds / iters as f64);
                Duration::from_secs_f64(seconds)
            })
        });
        g.finish();
        samples.median()
    };
    let copy_gbs = 2.0 * COPY_BYTES as f64 / copy_seconds / 1e9;

    let mut rng = SplitMix64::new(0x5eed);
    let mut rows = Vec::new();
    for (n, k) in STREAMING_SHAPES {
        bench_shape(
            &mut criterion,
            &backend,
            cuda,
            &blas,
            &mut rng,
            "streaming",
            n,
            k,
            &STREAMING_ROWS,
            false,
            &mut rows,
        );
    }
    for (n, k) in gemm::MODEL_SHAPES {
        bench_shape(
            &mut criterion,
            &backend,
            cuda,
            &blas,
            &mut rng,
            "model",
            n,
            k,
            &MODEL_ROWS,
            true,
            &mut rows,
        );
    }
    criterion.final_summary();

    println!(
        "\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written, {} MiB each way)",
        COPY_BYTES >> 20
    );
    println!(
        "floor = bytes / copy bandwidth; x cuBLAS = cuBLAS bf16 time / this time (same M, N, K)"
    );
    println!(
        "{:<9} {:<11} {:>3} {:>6} {:>5} {:>10} {:>8} {:>8} {:>6} {:>7} {:>7} {:>8}",
        "set",
        "variant",
        "M",
        "N",
        "K",
        "bytes",
        "us",
        "floor us",
        "GB/s",
        "of copy",
        "-floor",
        "x cuBLAS"
    );
    for row in &rows {
        let cublas = rows
            .iter()
            .find(|r| r.variant == "cublas bf16" && (r.m, r.n, r.k) == (row.m, row.n, row.k))
            .map_or(f64::NAN, |r| r.seconds);
        let gbs = row.bytes as f64 / row.seconds / 1e9;
        let floor = row.bytes as f64 / (copy_gbs * 1e9);
        println!(
            "{:<9} {:<11} {:>3} {:>6} {:>5} {:>10} {:>8.2} {:>8.2} {:>6.0} {:>6.1}% {:>7.2} {:>8.2}",
            row.set,
            row.variant,
            row.m,
            row.n,
            row.k,
            row.bytes,
            row.seconds * 1e6,
            floor * 1e6,
            gbs,
            100.0 * gbs / copy_gbs,
            (row.seconds - floor) * 1e6,
            cublas / row.seconds
        );
    }
}
