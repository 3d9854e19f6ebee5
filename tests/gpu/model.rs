//! The device decode path on CUDA (every layer's kernels, replayed from the captured graph)
//! against the CPU runner on the demo model; speculative decoding with the MTP head against
//! decoding without it.

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

/// e4m3 KV caches: the `_fp8` split kernels inside the captured step.
#[test]
fn device_decode_on_cuda_with_an_fp8_kv_cache_stays_near_the_runner() {
    let Some(backend) = cuda("device_decode_on_cuda_with_an_fp8_kv_cache_stays_near_the_runner")
    else {
        return;
    };
    device_model::decode_matches_runner_on(
        backend,
        &device_model::demo_dir(),
        fp4spec::kernels::attention::KvFormat::FP8_UNIT_SCALES,
        16,
        24,
    );
}

#[test]
fn device_prefill_on_cuda_matches_the_runner() {
    let Some(backend) = cuda("device_prefill_on_cuda_matches_the_runner") else {
        return;
    };
    device_model::prefill_matches_runner(backend, 16);
}

#[test]
fn device_speculation_on_cuda_equals_decoding_without_it() {
    let Some(backend) = cuda("device_speculation_on_cuda_equals_decoding_without_it") else {
        return;
    };
    for drafts in [1, 3, 7] {
        device_model::speculation_matches_plain_decoding(backend, drafts, 40);
    }
}

#[test]
fn device_mtp_drafts_on_cuda_match_the_runner() {
    let Some(backend) = cuda("device_mtp_drafts_on_cuda_match_the_runner") else {
        return;
    };
    device_model::mtp_drafts_match_runner(backend, 5);
}
