//! Helpers every GPU test module shares: the device (or the reason there is none), seeded
//! random inputs and poisoned outputs.

use fp4spec::backend::{Backend, BackendKind, DeviceVec};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::sync::OnceLock;

/// The CUDA backend, opened once per binary; `None` (after one skip line naming `test`) when
/// the machine has no CUDA device.
///
/// # Panics
/// When a device is present but the backend does not open (no target for it, no NVRTC or CUDA
/// headers, a driver error): on a GPU host that is a failure, never a skip.
pub fn cuda(test: &str) -> Option<&'static Backend> {
    static BACKEND: OnceLock<Result<Backend, String>> = OnceLock::new();
    match BACKEND.get_or_init(|| Backend::new(BackendKind::Cuda).map_err(|e| e.to_string())) {
        Ok(backend) => Some(backend),
        Err(why) => absent_or_panic(test, why, fp4spec::backend::cuda::device_count(), "CUDA"),
    }
}

/// The HIP backend, opened once per binary; `None` (after one skip line naming `test`) when
/// the machine has no HIP device.
///
/// # Panics
/// When a device is present but the backend does not open.
pub fn hip(test: &str) -> Option<&'static Backend> {
    static BACKEND: OnceLock<Result<Backend, String>> = OnceLock::new();
    match BACKEND.get_or_init(|| Backend::new(BackendKind::Hip).map_err(|e| e.to_string())) {
        Ok(backend) => Some(backend),
        Err(why) => absent_or_panic(
            &format!("{test} on HIP"),
            why,
            fp4spec::backend::hip::device_count(),
            "HIP",
        ),
    }
}

/// A backend that did not open: a skip line when there is no device of its kind, a panic when
/// there are `devices` of them.
fn absent_or_panic(test: &str, why: &str, devices: usize, kind: &str) -> Option<&'static Backend> {
    assert!(
        devices == 0,
        "{test}: the driver reports {devices} {kind} device(s), but the backend did not open: {why}"
    );
    skipped(test, why);
    None
}

/// Every device backend present: CUDA, HIP (one skip line for each that is not).
pub fn devices(test: &str) -> Vec<&'static Backend> {
    cuda(test).into_iter().chain(hip(test)).collect()
}

/// One line, written past libtest's output capture so it shows in a plain `cargo test`.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipped {test}: {why}");
}

/// A generator seeded from `FP4SPEC_SEED` or fresh, the seed printed under `test`.
pub fn rng(test: &str) -> SplitMix64 {
    let seed = std::env::var("FP4SPEC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(SplitMix64::fresh_seed);
    println!("{test}: seed {seed}");
    SplitMix64::new(seed)
}

/// `len` bf16 values from a standard normal distribution.
pub fn random_bf16(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// A device buffer filled with NaN, so an element the kernel never writes cannot pass.
pub fn poisoned(backend: &Backend, len: usize) -> DeviceVec<bf16> {
    backend
        .upload(&vec![bf16::NAN; len])
        .expect("upload poison")
}
