//! Bench of the `gemm` family on the CUDA device, beside the device-to-device copy bandwidth
//! measured in the same run. Reports achieved bytes/s (the fewest bytes the GEMM must move,
//! `nvfp4_gemm_bytes`) as a fraction of the copy bandwidth.
//!
//! Weights rotate over enough copies to exceed the L2 cache, so every launch streams from DRAM
//! as decode does. Timing uses CUDA events around `iters` back-to-back launches.
//!
//! Run: `cargo bench --bench gemm` on a CUDA host (prints one skip line elsewhere).

use criterion::{Criterion, Throughput};
use cudarc::driver::sys::CUevent_flags;
use fp4spec::backend::cuda::CudaBackend;
use fp4spec::backend::{Backend, BackendKind, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::{Nvfp4Weights, gemm};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::cell::RefCell;
use std::time::Duration;

/// Bytes of weights the rotation must cover: several times the H200's 60 MB L2.
const ROTATION_BYTES: u64 = 256 << 20;
/// Each side of the copy-bandwidth measurement.
const COPY_BYTES: usize = 512 << 20;
const SHAPES: [(usize, usize); 4] = [(8192, 2048), (2048, 4096), (1024, 2048), (2048, 512)];
const ROWS: [usize; 3] = [1, 16, 64];

/// Per-iteration seconds of every sample criterion took, so the summary uses the same data.
#[derive(Default)]
struct Samples(RefCell<Vec<f64>>);

impl Samples {
    fn record(&self, iters: u64, elapsed: Duration) {
        self.0
            .borrow_mut()
            .push(elapsed.as_secs_f64() / iters as f64);
    }
    fn median(&self) -> f64 {
        let mut v = self.0.borrow().clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Times `iters` runs of `body` between two CUDA events.
fn time_on_device(cuda: &CudaBackend, iters: u64, mut body: impl FnMut(u64)) -> Duration {
    let stream = cuda.stream();
    let start = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("record start event");
    for i in 0..iters {
        body(i);
    }
    let end = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("record end event");
    let ms = start.elapsed_ms(&end).expect("event timing");
    Duration::from_secs_f64(f64::from(ms) / 1e3)
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
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    println!("device: {}", backend.describe());

    // ceiling: device-to-device copy, bytes read + written
    let copy = Samples::default();
    {
        let src = cuda
            .stream()
            .alloc_zeros::<u8>(COPY_BYTES)
            .expect("allocate copy source");
        let mut dst = cuda
            .stream()
            .alloc_zeros::<u8>(COPY_BYTES)
            .expect("allocate copy destination");
        let mut group = criterion.benchmark_group("copy");
        group.throughput(Throughput::Bytes(2 * COPY_BYTES as u64));
        group.bench_function("device_to_device_512MiB", |b| {
            b.iter_custom(|iters| {
                let t = time_on_device(cuda, iters, |_| {
                    cuda.stream().memcpy_dtod(&src, &mut dst).expect("memcpy")
                });
                copy.record(iters, t);
                t
            })
        });
        group.finish();
    }
    let copy_gbs = 2.0 * COPY_BYTES as f64 / copy.median() / 1e9;

    let mut rng = SplitMix64::new(0x5eed);
    let mut rows = Vec::new();
    let mut group = criterion.benchmark_group("gemm_nvfp4_bf16_gemv");
    for (n, k) in SHAPES {
        let q =
            Nvfp4Matrix::quantize("bench W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
        let copies = ROTATION_BYTES.div_ceil(q.bytes() as u64).clamp(2, 1024) as usize;
        let weights: Vec<Nvfp4Weights> = (0..copies)
            .map(|_| Nvfp4Weights::upload(&backend, &q).expect("upload W"))
            .collect();
        for m in ROWS {
            let x: Vec<bf16> = rng
                .normal_vec(m * k, 1.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let x_dev = backend.upload(&x).expect("upload X");
            let mut y: DeviceVec<bf16> = backend.zeros(m * n).expect("allocate Y");
            let bytes = gemm::nvfp4_gemm_bytes(m, &weights[0]);
            let samples = Samples::default();
            group.throughput(Throughput::Bytes(bytes));
            group.bench_function(format!("M{m}_N{n}_K{k}"), |b| {
                b.iter_custom(|iters| {
                    let t = time_on_device(cuda, iters, |i| {
                        let w = &weights[i as usize % copies];
                        gemm::nvfp4_gemm(&backend, &x_dev, m, w, &mut y).expect("gemm launch");
                    });
                    samples.record(iters, t);
                    t
                })
            });
            let seconds = samples.median();
            rows.push((m, n, k, bytes, seconds));
        }
    }
    group.finish();
    criterion.final_summary();

    println!(
        "\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written, {} MiB each way)",
        COPY_BYTES >> 20
    );
    println!(
        "{:>4} {:>6} {:>6} {:>10} {:>10} {:>8} {:>8}",
        "M", "N", "K", "bytes", "us", "GB/s", "of copy"
    );
    for (m, n, k, bytes, seconds) in rows {
        let gbs = bytes as f64 / seconds / 1e9;
        println!(
            "{m:>4} {n:>6} {k:>6} {bytes:>10} {:>10.2} {gbs:>8.0} {:>7.1}%",
            seconds * 1e6,
            100.0 * gbs / copy_gbs
        );
    }
}
