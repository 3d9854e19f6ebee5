//! The vendor-neutral launch layer on every device backend present (CUDA here; HIP on a
//! Strix Halo built with `--features hip`): `Backend::launch` (raw `cuLaunchKernel` /
//! `hipModuleLaunchKernel`) runs the `dequant` kernel bit-exact against the CPU reference, and
//! inside a CUDA graph too; argument lists that do not fit the kernel and buffers of another
//! backend are refused before the launch; events time, copies copy.

use crate::common::{cuda, devices, hip, poisoned, rng, skipped};
use fp4spec::Error;
use fp4spec::backend::{Backend, BackendKind, DeviceVec, KernelArg, LaunchDims};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::dequant;
use half::bf16;

/// Launches `dequant_nvfp4_bf16` through the neutral layer, as a family will once it moves
/// onto it: grid from the target's `[target.dequant]`, arguments in the kernel's order.
fn launch_dequant(
    backend: &Backend,
    packed: &DeviceVec<u8>,
    scales: &DeviceVec<u8>,
    global_scale: f32,
    out: &mut DeviceVec<bf16>,
) -> fp4spec::Result<()> {
    let blocks = scales.len() as u64;
    let threads = backend
        .target()
        .expect("a device")
        .dequant
        .threads_per_block;
    let dims = LaunchDims::linear(blocks.div_ceil(u64::from(threads)) as u32, threads);
    // SAFETY: dequant.cu indexes `blocks` scale bytes, 8 packed bytes and 16 outputs per block;
    // the callers size the buffers so.
    unsafe {
        backend.launch(
            dequant::FAMILY,
            dequant::KERNEL_DEQUANT_NVFP4_BF16,
            &dims,
            &[
                KernelArg::input(packed),
                KernelArg::input(scales),
                KernelArg::f32(global_scale),
                KernelArg::output(out),
                KernelArg::u64(blocks),
            ],
        )
    }
}

fn assert_bit_exact(what: &str, got: &[bf16], want: &[bf16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mismatches: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    assert!(
        mismatches.is_empty(),
        "{what}: {} of {} elements differ, first at {} (got {} want {})",
        mismatches.len(),
        got.len(),
        mismatches[0],
        got[mismatches[0]],
        want[mismatches[0]]
    );
}

#[test]
fn dequant_through_the_neutral_launch_matches_the_reference_exactly() {
    let test = "dequant_through_the_neutral_launch_matches_the_reference_exactly";
    for backend in devices(test) {
        let name = backend.name();
        let mut rng = rng(&format!("{test} on {name}"));
        // one block, a partial thread block, a launch of many blocks, a Qwen projection
        for (n, k) in [(1, 16), (3, 48), (257, 1040), (2048, 4096)] {
            let mut q = Nvfp4Matrix::quantize("random W", &rng.normal_vec(n * k, 0.02), n, k)
                .expect("finite");
            q.scales[0] = 0x01; // a subnormal block scale
            let packed = backend.upload(&q.packed).expect("upload packed");
            let scales = backend.upload(&q.scales).expect("upload scales");
            let mut out = poisoned(backend, n * k);
            launch_dequant(backend, &packed, &scales, q.global_scale, &mut out).unwrap_or_else(
                |e| panic!("{name}: dequant [{n}, {k}] through Backend::launch: {e}"),
            );
            let got = backend.download(&out).expect("download");
            let want = dequant::reference::dequant_nvfp4_bf16(q.view());
            let what = format!("{name}: dequant [{n}, {k}] via Backend::launch");
            assert_bit_exact(&what, &got, &want);
            println!("{what}: bit-exact");
        }
    }
}

/// A neutral launch is capturable: recorded into a CUDA graph and replayed, it computes the
/// same as a direct launch.
#[test]
fn a_neutral_launch_replays_from_a_cuda_graph() {
    let test = "a_neutral_launch_replays_from_a_cuda_graph";
    let Some(backend) = cuda(test) else {
        return;
    };
    let mut rng = rng(test);
    let (n, k) = (64, 512);
    let q = Nvfp4Matrix::quantize("random W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
    let packed = backend.upload(&q.packed).expect("upload packed");
    let scales = backend.upload(&q.scales).expect("upload scales");
    let mut out = poisoned(backend, n * k);
    // warm up outside the capture: compile, load, read the parameter sizes
    launch_dequant(backend, &packed, &scales, q.global_scale, &mut out).expect("warm-up");
    backend.synchronize().expect("warm-up");
    let mut replayed = poisoned(backend, n * k);
    let graph = backend
        .capture(|| launch_dequant(backend, &packed, &scales, q.global_scale, &mut replayed))
        .expect("capture");
    graph.launch().expect("replay the graph");
    let got = backend.download(&replayed).expect("download");
    let want = dequant::reference::dequant_nvfp4_bf16(q.view());
    assert_bit_exact("dequant replayed from a graph", &got, &want);
}

/// A capture records its own thread's work only: another thread sharing the backend uploads,
/// copies, downloads and frees in the middle of the capture, and both its results and the
/// replayed graph are right (on one shared capturing stream the other thread's download fails,
/// and its copy lands in the graph, to be replayed against freed memory).
#[test]
fn a_capture_records_only_its_own_thread() {
    let test = "a_capture_records_only_its_own_thread";
    let Some(backend) = cuda(test) else {
        return;
    };
    let bytes = 1 << 20;
    let pattern = |seed: usize| {
        (0..bytes)
            .map(|i| (i * 7 + seed) as u8)
            .collect::<Vec<u8>>()
    };
    let src = backend.upload(&pattern(1)).expect("upload");
    let mut dst = backend.zeros::<u8>(bytes).expect("zeros");
    let middle = std::sync::Barrier::new(2);
    let done = std::sync::Barrier::new(2);
    std::thread::scope(|scope| {
        let other = scope.spawn(|| {
            middle.wait();
            let result = (|| {
                let a = backend.upload(&pattern(2))?;
                let mut b = backend.zeros::<u8>(bytes)?;
                backend.copy(&a, &mut b)?;
                backend.download(&b)
            })();
            done.wait();
            result
        });
        let graph = backend
            .capture(|| {
                backend.copy(&src, &mut dst)?;
                middle.wait();
                done.wait();
                Ok(())
            })
            .expect("capture");
        let other = other.join().expect("the other thread");
        assert_eq!(
            other.expect("the other thread's work during the capture"),
            pattern(2),
            "the other thread's copy"
        );
        assert!(
            backend
                .download(&dst)
                .expect("download")
                .iter()
                .all(|&b| b == 0),
            "the captured copy ran at capture time"
        );
        graph.launch().expect("replay");
        assert_eq!(
            backend.download(&dst).expect("download"),
            pattern(1),
            "replayed copy"
        );
    });
}

/// A capture is ended whatever its recording does: after a recording that fails, one that
/// panics, and one during which an error is recorded in the context (as another thread's failed
/// drop records it; cudarc hands it to the next checked call, which was the capture's own end,
/// and the stream then stayed capturing), captures on the same backend record and replay a
/// copy, and the recorded error is still there for the context's next checked call. On a
/// backend of its own, where that error cannot reach another test's calls.
#[test]
fn a_capture_ends_whatever_its_recording_does() {
    use cudarc::driver::{DriverError, sys::cudaError_enum};
    let test = "a_capture_ends_whatever_its_recording_does";
    if cuda(test).is_none() {
        return;
    }
    let backend = Backend::new(BackendKind::Cuda).expect("a second CUDA backend");
    let Backend::Cuda(device) = &backend else {
        panic!("CUDA asked for, {} opened", backend.name());
    };
    let pattern: Vec<u8> = (0..4096).map(|i| (i * 13 + 5) as u8).collect();
    let src = backend.upload(&pattern).expect("upload");
    let mut scratch = backend.zeros::<u8>(pattern.len()).expect("zeros");
    match backend.capture(|| {
        backend.copy(&src, &mut scratch)?;
        Err(Error::Invalid {
            what: "the recording".into(),
            reason: "fails on purpose".into(),
        })
    }) {
        Err(Error::Invalid { what, .. }) => assert_eq!(what, "the recording"),
        Err(e) => panic!("the recording's own error expected, got {e}"),
        Ok(_) => panic!("a capture whose recording failed returned a graph"),
    }
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        backend.capture(|| {
            // something recorded, so the unwinding capture has a graph to destroy
            backend.copy(&src, &mut scratch)?;
            panic!("a recording that panics on purpose")
        })
    }));
    assert!(panicked.is_err(), "the recording's panic");
    let graph = backend
        .capture(|| {
            backend.copy(&src, &mut scratch)?;
            device
                .context()
                .record_err::<()>(Err(DriverError(cudaError_enum::CUDA_ERROR_INVALID_VALUE)));
            Ok(())
        })
        .expect("a capture after a failed and a panicking one, an error recorded meanwhile");
    assert_eq!(
        device.context().check_err().map_err(|e| e.0),
        Err(cudaError_enum::CUDA_ERROR_INVALID_VALUE),
        "the error recorded during the capture, left for the context's next checked call"
    );
    assert!(
        backend
            .download(&scratch)
            .expect("download")
            .iter()
            .all(|&b| b == 0),
        "a captured copy ran at capture time"
    );
    graph.launch().expect("replay");
    assert_eq!(
        backend.download(&scratch).expect("download"),
        pattern,
        "the copy replayed"
    );
    let mut again = backend.zeros::<u8>(pattern.len()).expect("zeros");
    backend
        .capture(|| backend.copy(&src, &mut again))
        .expect("one more capture")
        .launch()
        .expect("replay");
    assert_eq!(
        backend.download(&again).expect("download"),
        pattern,
        "the last capture's copy replayed"
    );
}

/// Wrong argument lists never reach the device: a u32 where the kernel takes a u64 and a
/// missing argument are refused from the driver's parameter sizes, a host buffer as a
/// BackendMismatch naming the argument; the CPU backend refuses launches. An oversized block
/// is the driver's error, naming the launch.
#[test]
fn cuda_launches_that_do_not_fit_the_kernel_are_error_values() {
    let test = "cuda_launches_that_do_not_fit_the_kernel_are_error_values";
    let Some(backend) = cuda(test) else {
        return;
    };
    let packed = backend.upload(&[0u8; 8]).expect("upload");
    let scales = backend.upload(&[0x38u8]).expect("upload");
    let mut out = poisoned(backend, 16);
    let host = Backend::Cpu.upload(&[0u8; 8]).expect("host");
    let dims = LaunchDims::linear(1, 256);
    let launch = |args: &[KernelArg<'_>], dims: &LaunchDims| {
        // SAFETY: every call below is refused before the kernel runs, or (the oversized block)
        // by the driver.
        unsafe {
            backend.launch(
                dequant::FAMILY,
                dequant::KERNEL_DEQUANT_NVFP4_BF16,
                dims,
                args,
            )
        }
    };
    let narrow = [
        KernelArg::input(&packed),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u32(1),
    ];
    let e = launch(&narrow, &dims).expect_err("u32 for a u64 parameter");
    assert!(
        matches!(&e, Error::Invalid { reason, .. } if reason.contains("argument 4") && reason.contains("8 bytes")),
        "{e}"
    );
    let e = launch(&narrow[..4], &dims).expect_err("a missing argument");
    assert!(e.to_string().contains("takes 5 arguments"), "{e}");
    let mut out = poisoned(backend, 16);
    let with_host = [
        KernelArg::input(&host),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u64(1),
    ];
    let e = launch(&with_host, &dims).expect_err("a host buffer");
    assert!(
        matches!(&e, Error::BackendMismatch { what, found: "cpu", .. } if what.contains("argument 0")),
        "{e}"
    );
    let mut out = poisoned(backend, 16);
    let good = [
        KernelArg::input(&packed),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u64(1),
    ];
    let e = launch(&good, &LaunchDims::linear(1, 4096)).expect_err("4096 threads per block");
    assert!(
        matches!(&e, Error::Cuda { op, .. } if op.contains("dequant_nvfp4_bf16")),
        "{e}"
    );
    launch(&good, &dims).expect("the good launch still runs after the refusals");
    backend.synchronize().expect("no fault");
    let e = unsafe {
        Backend::Cpu.launch(
            dequant::FAMILY,
            dequant::KERNEL_DEQUANT_NVFP4_BF16,
            &dims,
            &[],
        )
    }
    .expect_err("the CPU backend runs no kernels");
    assert!(e.to_string().contains("CPU backend"), "{e}");
}

/// Events time work on the queue; a device-to-device copy copies.
#[test]
fn events_time_and_copies_copy() {
    let test = "events_time_and_copies_copy";
    for backend in devices(test) {
        let name = backend.name();
        let bytes = 64 << 20;
        let src = backend
            .upload(&(0..bytes).map(|i| i as u8).collect::<Vec<u8>>())
            .expect("upload");
        let mut dst = backend.zeros::<u8>(bytes).expect("zeros");
        let start = backend.record_event().expect("event");
        backend.copy(&src, &mut dst).expect("copy");
        let end = backend.record_event().expect("event");
        let ms = start.elapsed_ms(&end).expect("elapsed");
        assert!(
            ms > 0.0 && ms < 1000.0,
            "{name}: a 64 MiB copy took {ms} ms"
        );
        println!(
            "{name}: 64 MiB device copy {ms:.3} ms, {:.0} GB/s (read + write)",
            2.0 * bytes as f64 / (f64::from(ms) * 1e-3) / 1e9
        );
        let back = backend.download(&dst).expect("download");
        let wrong = back.iter().enumerate().position(|(i, &b)| b != i as u8);
        assert_eq!(wrong, None, "{name}: the copy differs at this byte");
        let mut short = backend.zeros::<u8>(bytes - 1).expect("zeros");
        assert!(backend.copy(&src, &mut short).is_err());
    }
}

/// On HIP, launches are checked against the code object's metadata: a u32 for a u64, a missing
/// argument, a block above the kernel's launch bounds and a host buffer are refused.
#[test]
fn hip_launches_that_do_not_fit_the_kernel_are_error_values() {
    let test = "hip_launches_that_do_not_fit_the_kernel_are_error_values";
    let Some(backend) = hip(test) else {
        return;
    };
    let packed = backend.upload(&[0u8; 8]).expect("upload");
    let scales = backend.upload(&[0x38u8]).expect("upload");
    let mut out = poisoned(backend, 16);
    let host = Backend::Cpu.upload(&[0u8; 8]).expect("host");
    let launch = |args: &[KernelArg<'_>], dims: &LaunchDims| {
        // SAFETY: every call but the last is refused before the kernel runs; the last is the
        // one-block launch the buffers are sized for.
        unsafe {
            backend.launch(
                dequant::FAMILY,
                dequant::KERNEL_DEQUANT_NVFP4_BF16,
                dims,
                args,
            )
        }
    };
    let dims = LaunchDims::linear(1, 256);
    let narrow = [
        KernelArg::input(&packed),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u32(1),
    ];
    let e = launch(&narrow, &dims).expect_err("u32 for a u64 parameter");
    assert!(e.to_string().contains("argument 4"), "{e}");
    let e = launch(&narrow[..4], &dims).expect_err("a missing argument");
    assert!(e.to_string().contains("takes 5 arguments"), "{e}");
    let mut out = poisoned(backend, 16);
    let good = [
        KernelArg::input(&packed),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u64(1),
    ];
    let e = launch(&good, &LaunchDims::linear(1, 1024)).expect_err("above the launch bounds");
    assert!(e.to_string().contains("threads"), "{e}");
    let mut out = poisoned(backend, 16);
    let with_host = [
        KernelArg::input(&host),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u64(1),
    ];
    let e = launch(&with_host, &dims).expect_err("a host buffer");
    assert!(
        matches!(e, Error::BackendMismatch { found: "cpu", .. }),
        "{e}"
    );
    launch(&good, &dims).expect("the good launch runs after the refusals");
    backend.synchronize().expect("no fault");
}

#[test]
fn hip_backend_opens_or_says_why_not() {
    match Backend::new(BackendKind::Hip) {
        Ok(backend) => println!("hip backend: {}", backend.describe()),
        Err(e) => {
            assert!(matches!(e, Error::HipUnavailable(_)), "{e}");
            let devices = fp4spec::backend::hip::device_count();
            assert_eq!(devices, 0, "{devices} HIP device(s) present, yet: {e}");
            skipped(
                "hip_backend_opens_or_says_why_not (no HIP device to open)",
                &e.to_string(),
            );
        }
    }
}
