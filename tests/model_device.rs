//! The device decode path on the CPU backend (the families' references in the kernels' order
//! of calls) against the CPU runner: the wiring of every layer, the caches and the argmax.

mod device_model;

use fp4spec::backend::Backend;

#[test]
fn device_decode_on_the_cpu_backend_matches_the_runner() {
    device_model::decode_matches_runner(&Backend::Cpu, 12, 12);
}

#[test]
fn device_prefill_on_the_cpu_backend_matches_the_runner() {
    device_model::prefill_matches_runner(&Backend::Cpu, 8);
}
