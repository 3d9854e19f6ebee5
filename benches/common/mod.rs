//! What every bench shares: the CUDA device (or one skip line), the device-to-device copy
//! ceiling measured in the same run, and timing of back-to-back calls replayed from a CUDA graph.
//! Each bench file includes it with `mod common;`.

#![allow(dead_code)] // each bench binary uses its own subset

use criterion::{Criterion, Throughput};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use fp4spec::backend::cuda::CudaBackend;
use fp4spec::backend::{Backend, BackendKind};
use std::cell::RefCell;
use std::time::Duration;

/// Calls per captured graph.
pub const LAUNCHES: usize = 16;
/// Each side of the copy-bandwidth measurement.
pub const COPY_BYTES: usize = 512 << 20;

/// The CUDA backend, or `None` after printing `skipped bench <bench>: why`.
pub fn cuda_or_skip(bench: &str) -> Option<Backend> {
    match Backend::new(BackendKind::Cuda) {
        Ok(backend) => Some(backend),
        Err(e) => {
            println!("skipped bench {bench}: {e}");
            None
        }
    }
}

/// The CUDA side of a backend [`cuda_or_skip`] opened, after printing the device line every
/// bench report starts with.
pub fn announce(backend: &Backend) -> &CudaBackend {
    let Backend::Cuda(cuda) = backend else {
        unreachable!("cuda_or_skip opens CUDA only")
    };
    println!(
        "device: {} ({} SMs)",
        backend.describe(),
        cuda.multiprocessors()
    );
    cuda
}

/// Criterion settings for device benches: few, short samples (the device lease is short).
pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(400))
        .configure_from_args()
}

/// Per-call seconds of every sample criterion took.
#[derive(Default)]
pub struct Samples(pub RefCell<Vec<f64>>);

impl Samples {
    /// The median per-call time, seconds.
    pub fn median(&self) -> f64 {
        let mut v = self.0.borrow().clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Captures `LAUNCHES` calls of `call(i)` into a graph and benches its replays; returns the
/// median seconds per call. `bytes` is what one call must move (criterion's throughput).
pub fn bench_graph(
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

/// Device-to-device copy bandwidth, GB/s, counting bytes read plus bytes written: the ceiling
/// every memory-bound figure is reported against.
pub fn copy_bandwidth_gbs(criterion: &mut Criterion, cuda: &CudaBackend) -> f64 {
    let seconds = {
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
    2.0 * COPY_BYTES as f64 / seconds / 1e9
}
