//! The device decode path on CUDA (every layer's kernels, replayed from the captured graph)
//! against the CPU runner on the demo model.

#[path = "../device_model/mod.rs"]
mod device_model;

use crate::common::cuda;

#[test]
fn device_decode_on_cuda_matches_the_runner() {
    let Some(backend) = cuda("device_decode_on_cuda_matches_the_runner") else {
        return;
    };
    device_model::decode_matches_runner(backend, 16, 24);
}

#[test]
fn device_prefill_on_cuda_matches_the_runner() {
    let Some(backend) = cuda("device_prefill_on_cuda_matches_the_runner") else {
        return;
    };
    device_model::prefill_matches_runner(backend, 16);
}
