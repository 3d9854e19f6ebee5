//! The device decode path on CUDA (every layer's kernels, replayed from the captured graph)
//! against the CPU runner on the demo model; speculative decoding with the MTP head against
//! decoding without it.

#[path = "../device_model/mod.rs"]
mod device_model;

use crate::common::cuda;
use fp4spec::backend::Backend;
use fp4spec::kernels::attention::KvFormat;
use fp4spec::kernels::compare;
use fp4spec::kernels::gemm::Nvfp4Mode;
use fp4spec::model::device::DeviceModel;
use fp4spec::model::forward::Model;

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
        KvFormat::FP8_UNIT_SCALES,
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

/// The demo model quantised to NVFP4: q, k and v of one scale stacked into one GEMM, then (k
/// re-scaled) as three, both against the runner (the bf16 demo model above stacks them too).
#[test]
fn device_decode_on_cuda_runs_nvfp4_q_k_v_stacked_and_apart() {
    let Some(backend) = cuda("device_decode_on_cuda_runs_nvfp4_q_k_v_stacked_and_apart") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let mut model =
        Model::load(device_model::quantised_demo(dir.path(), false)).expect("NVFP4 model");
    // the demo model's one attention layer and its MTP head's (bf16): both stacked
    assert_eq!(device_model::qkv_stacking(backend, &model), (2, 2));
    device_model::decode_matches_runner_with(backend, &model, KvFormat::Bf16, 16, 16);
    device_model::rescale_attention_keys(&mut model);
    // the target layer's now apart; the MTP head's bf16 ones still stack
    assert_eq!(device_model::qkv_stacking(backend, &model), (1, 2));
    device_model::decode_matches_runner_with(backend, &model, KvFormat::Bf16, 16, 16);
}

/// The per-model W4A4 choice on the device: refused, naming the target, where it has no
/// block-scaled FP4 MMA (the H100 and H200: the check on them); on a target with one (GB10)
/// the teacher-forced logits match the CPU backend's exact emulation of the same W4A4 model.
#[test]
fn device_decode_on_cuda_in_w4a4_runs_only_where_the_target_has_fp4_mma() {
    let Some(backend) =
        cuda("device_decode_on_cuda_in_w4a4_runs_only_where_the_target_has_fp4_mma")
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = Model::load(device_model::quantised_demo(dir.path(), false)).expect("NVFP4 model");
    let target = backend.target().expect("a device backend");
    let built = DeviceModel::from_model_with(backend, &model, Nvfp4Mode::W4a4);
    if !target.instructions.mma_block_scaled_fp4 {
        let err = built.err().expect("W4A4 refused without the FP4 MMA");
        assert!(
            err.to_string().contains(&format!(
                "target {} has no block-scaled FP4 MMA",
                target.name
            )),
            "{err}"
        );
        println!("{}: W4A4 refused: {err}", target.name);
        return;
    }
    let device = built.expect("W4A4 device model");
    let emulated = DeviceModel::from_model_with(&Backend::Cpu, &model, Nvfp4Mode::W4a4)
        .expect("W4A4 on the CPU backend");
    let prompts = device_model::byte_prompts();
    let got = device_model::teacher_forced_logits(&device, &prompts);
    let want = device_model::teacher_forced_logits(&emulated, &prompts);
    let largest = compare::max_difference(&got.concat(), &want.concat()).1;
    println!(
        "{}: W4A4 against its CPU emulation: {largest:.3e}",
        target.name
    );
    assert!(
        largest <= device_model::W4A4_LOGIT_TOLERANCE,
        "{largest:.3e}"
    );
}
