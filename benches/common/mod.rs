//! What every bench shares: the device (CUDA first, else HIP, else one skip line), the
//! device-to-device copy ceiling measured in the same run on that device, and timing of
//! back-to-back calls: replayed from a CUDA graph on CUDA; on HIP (whose backend captures no
//! graphs) launched one after another between HIP events, which [`announce`] says in the output.
//! Each bench file includes it with `mod common;`.

#![allow(dead_code)] // each bench binary uses its own subset

use criterion::{Criterion, Throughput};
use cudarc::driver::sys::CUevent_flags;
use fp4spec::backend::Backend;
use std::cell::RefCell;
use std::time::Duration;

/// Calls per captured graph (per timed group of launches on HIP), at least.
pub const LAUNCHES: usize = 16;
/// Bytes of distinct inputs (weights, logits) one timed group of calls must stream, several
/// times the L2 of any target (H100 50 MB, H200 60 MB), so every call reads DRAM.
pub const ROTATION_BYTES: u64 = 256 << 20;

/// Copies of an input of `bytes` bytes that together reach [`ROTATION_BYTES`] (1 for an input
/// that large alone); a bench captures at least this many calls, one per copy
/// ([`bench_graph_calls`]).
pub fn rotation_copies(bytes: u64) -> usize {
    ROTATION_BYTES.div_ceil(bytes.max(1)) as usize
}
/// Each side of the copy-bandwidth measurement.
pub const COPY_BYTES: usize = 512 << 20;
/// Copies timed for the ceiling when a name filter skips criterion's copy bench.
const COPY_REPEATS_FILTERED: usize = 15;
/// Criterion's samples per bench ([`criterion`]); the medians are taken over the last this many
/// recorded calls of a timing closure, the measurement's (criterion's warm-up calls the same
/// closure before it, with 1, 2, 4, ... iterations).
pub const SAMPLE_SIZE: usize = 10;

/// The device backend present (CUDA first, then HIP), or `None` after printing
/// `skipped bench <bench>: why` where the machine has no GPU.
///
/// # Panics
/// Where the driver reports a device that the backend cannot open (no NVRTC, no target, a
/// driver error): on a GPU host that is a failure, not a skip.
pub fn device_or_skip(bench: &str) -> Option<Backend> {
    match Backend::auto() {
        (Backend::Cpu, why) => {
            let why = why.unwrap_or_else(|| "no device backend".into());
            let devices =
                fp4spec::backend::cuda::device_count() + fp4spec::backend::hip::device_count();
            assert!(
                devices == 0,
                "bench {bench}: {devices} device(s) present, but no device backend opens: {why}"
            );
            println!("skipped bench {bench}: {why}");
            None
        }
        (backend, _) => Some(backend),
    }
}

/// Prints the device line every bench report starts with (and on HIP how calls are timed).
pub fn announce(backend: &Backend) {
    let units = backend.multiprocessors().unwrap_or(0);
    match backend {
        Backend::Hip(_) => {
            println!("device: {} ({units} CUs)", backend.describe());
            println!(
                "timing: {LAUNCHES} or more back-to-back launches between HIP events (the HIP backend \
                 captures no graphs, so per-launch overhead is included, unlike CUDA's graph \
                 replays)"
            );
        }
        _ => println!("device: {} ({units} SMs)", backend.describe()),
    }
}

/// Criterion settings for device benches: few, short samples (the device lease is short).
pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(SAMPLE_SIZE)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(400))
        .configure_from_args()
}

/// Per-call seconds of every sample criterion took.
#[derive(Default)]
pub struct Samples(pub RefCell<Vec<f64>>);

impl Samples {
    /// The median per-call time of criterion's measurement (the last [`SAMPLE_SIZE`] samples:
    /// its warm-up's calls, fewer iterations each and so more of the submission gap in them,
    /// come first), seconds.
    pub fn median(&self) -> f64 {
        let all = self.0.borrow();
        let mut v = all[all.len().saturating_sub(SAMPLE_SIZE)..].to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Benches [`LAUNCHES`] calls of `call(i)` back to back; returns the median seconds per call.
/// On CUDA the calls are captured into a graph once and its replays are timed; on HIP they are
/// launched anew for every timed group, between HIP events. `bytes` is what one call must move
/// (criterion's throughput).
pub fn bench_graph(
    criterion: &mut Criterion,
    backend: &Backend,
    group: &str,
    name: &str,
    bytes: u64,
    call: impl FnMut(usize),
) -> f64 {
    bench_graph_calls(criterion, backend, group, name, bytes, LAUNCHES, call)
}

/// [`bench_graph`] with `calls` calls per timed group (`call(0)` to `call(calls - 1)`): as many
/// as a rotation has copies ([`rotation_copies`]) where that is more than [`LAUNCHES`], so one
/// group streams all of them.
pub fn bench_graph_calls(
    criterion: &mut Criterion,
    backend: &Backend,
    group: &str,
    name: &str,
    bytes: u64,
    calls: usize,
    mut call: impl FnMut(usize),
) -> f64 {
    for i in 0..calls {
        call(i); // warm up: compile, grow scratch, create handles outside the capture
    }
    backend.synchronize().expect("warm-up");
    let samples = Samples::default();
    let mut g = criterion.benchmark_group(group);
    g.throughput(Throughput::BytesDecimal(bytes));
    match backend {
        Backend::Cuda(cuda) => {
            let stream = cuda.stream();
            // as the decoders capture: this thread's launches on the backend's capture stream
            // (capturing the backend's own stream would take in any other thread's work)
            let graph = backend
                .capture(|| {
                    (0..calls).for_each(&mut call);
                    Ok(())
                })
                .expect("a captured graph");
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
                        .push(seconds / (iters as f64 * calls as f64));
                    Duration::from_secs_f64(seconds / calls as f64)
                })
            });
        }
        _ => {
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let start = backend.record_event().expect("event");
                    for _ in 0..iters {
                        (0..calls).for_each(&mut call);
                    }
                    let end = backend.record_event().expect("event");
                    let seconds = f64::from(start.elapsed_ms(&end).expect("event timing")) / 1e3;
                    samples
                        .0
                        .borrow_mut()
                        .push(seconds / (iters as f64 * calls as f64));
                    Duration::from_secs_f64(seconds / calls as f64)
                })
            });
        }
    }
    g.finish();
    samples.median()
}

/// Device-to-device copy bandwidth of `backend`, GB/s, counting bytes read plus bytes written:
/// the ceiling every memory-bound figure is reported against. Criterion's `copy` bench when the
/// run's filter selects it, else measured outside criterion (a filtered run printed NaN for its
/// ceiling before, twenty-third session).
pub fn copy_bandwidth_gbs(criterion: &mut Criterion, backend: &Backend) -> f64 {
    let seconds = {
        let src = backend
            .zeros::<u8>(COPY_BYTES)
            .expect("allocate copy source");
        let mut dst = backend
            .zeros::<u8>(COPY_BYTES)
            .expect("allocate copy destination");
        // not captured: inside a graph the same copy ran at 2767 GB/s against 4220 in-stream
        // (H200, 2026-12-02), which would flatter every other figure
        let samples = Samples::default();
        let mut g = criterion.benchmark_group("copy");
        g.throughput(Throughput::BytesDecimal(2 * COPY_BYTES as u64));
        g.bench_function("device_to_device_512MiB", |b| {
            b.iter_custom(|iters| {
                let start = backend.record_event().expect("event");
                for _ in 0..iters {
                    backend.copy(&src, &mut dst).expect("memcpy");
                }
                let end = backend.record_event().expect("event");
                let seconds = f64::from(start.elapsed_ms(&end).expect("event timing")) / 1e3;
                samples.0.borrow_mut().push(seconds / iters as f64);
                Duration::from_secs_f64(seconds)
            })
        });
        g.finish();
        if samples.0.borrow().is_empty() {
            // a name filter left the copy out: measure it anyway (the library's median of single
            // copies), so that the run's figures still have their ceiling beside them
            drop((src, dst));
            let bytes_per_second = backend
                .copy_bandwidth(COPY_BYTES, COPY_REPEATS_FILTERED)
                .expect("copy bandwidth");
            return bytes_per_second / 1e9;
        }
        samples.median()
    };
    2.0 * COPY_BYTES as f64 / seconds / 1e9
}

/// Whether a time met its goal, for the tables: `-` where the case was not timed (NaN: a name
/// filter left it out), never a `no` for a figure that does not exist.
pub fn met(seconds: f64, goal: f64) -> &'static str {
    if seconds.is_nan() {
        "-"
    } else if seconds <= goal {
        "yes"
    } else {
        "no"
    }
}
