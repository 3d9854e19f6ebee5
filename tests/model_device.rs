//! The device decode path on the CPU backend (the families' references in the kernels' order
//! of calls) against the CPU runner: the wiring of every layer, the caches and the argmax.

mod device_model;

use fp4spec::backend::Backend;
use fp4spec::kernels::attention::KvFormat;
use fp4spec::kernels::compare;
use fp4spec::kernels::gemm::Nvfp4Mode;
use fp4spec::kernels::verify::SamplingParams;
use fp4spec::model::device::{DeviceModel, SyntheticWeights, generate_greedy};
use fp4spec::model::forward::Model;
use fp4spec::model::generate::{FinishReason, Request};
use fp4spec::model::params::MixerWeights;

#[test]
fn device_decode_on_the_cpu_backend_matches_the_runner() {
    device_model::decode_matches_runner(&Backend::Cpu, 12, 12);
}

/// The KV caches in e4m3 (unit scales): the attention family's CPU path stores and reads the
/// codes, the logits stay near the runner's f32 cache.
#[test]
fn device_decode_with_an_fp8_kv_cache_stays_near_the_runner() {
    device_model::decode_matches_runner_on(
        &Backend::Cpu,
        &device_model::demo_dir(),
        KvFormat::FP8_UNIT_SCALES,
        12,
        12,
    );
}

#[test]
fn device_prefill_on_the_cpu_backend_matches_the_runner() {
    device_model::prefill_matches_runner(&Backend::Cpu, 8);
}

#[test]
fn device_speculation_on_the_cpu_backend_equals_decoding_without_it() {
    for drafts in [1, 3] {
        device_model::speculation_matches_plain_decoding(&Backend::Cpu, drafts, 24);
    }
}

/// `generate_greedy` on the device path: the same tokens with and without drafts, the length
/// and stop rules of the CPU runner's `generate` (a stop token ends the sequence and is kept),
/// acceptance only with drafts, and sampling refused.
#[test]
fn device_greedy_generation_with_drafts_equals_it_without() {
    let model = Model::load(device_model::demo_dir()).expect("demo model");
    let device = DeviceModel::from_model(&Backend::Cpu, &model).expect("device model");
    let request = |prompt: &str, max_new_tokens: usize, stop_tokens: Vec<u32>| Request {
        prompt: prompt.bytes().map(u32::from).collect(),
        max_new_tokens,
        params: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop_tokens,
    };
    let plain = generate_greedy(
        &device,
        &[
            request("def fib(n):", 30, vec![]),
            request("Once upon", 0, vec![]),
        ],
        0,
    )
    .expect("plain");
    assert_eq!(plain[0].tokens.len(), 30);
    assert_eq!(plain[0].finish_reason, FinishReason::Length);
    assert!(plain[1].tokens.is_empty());
    // stop at the 12th token of the plain output: kept, nothing after it
    let stop = plain[0].tokens[11];
    let first = plain[0]
        .tokens
        .iter()
        .position(|&t| t == stop)
        .expect("in the output");
    for drafts in [0, 2, 3] {
        let out = generate_greedy(
            &device,
            &[
                request("def fib(n):", 30, vec![]),
                request("def fib(n):", 30, vec![stop]),
            ],
            drafts,
        )
        .expect("generate");
        assert_eq!(out[0].tokens, plain[0].tokens, "{drafts} drafts");
        assert_eq!(
            out[1].tokens,
            plain[0].tokens[..=first],
            "{drafts} drafts, stop"
        );
        assert_eq!(out[1].finish_reason, FinishReason::Stop);
        assert_eq!(out[0].drafted() > 0, drafts > 0, "{drafts} drafts");
        assert!(out[0].accepted() <= out[0].drafted());
    }
    let sampled = Request {
        params: SamplingParams {
            temperature: 0.7,
            ..SamplingParams::default()
        },
        ..request("x", 4, vec![])
    };
    let refused = generate_greedy(&device, &[sampled], 1).expect_err("sampling refused");
    assert!(refused.to_string().contains("greedily"), "{refused}");
}

#[test]
fn device_mtp_drafts_on_the_cpu_backend_match_the_runner() {
    device_model::mtp_drafts_match_runner(&Backend::Cpu, 5);
}

/// The demo model quantised to ModelOpt NVFP4 (per-expert experts): the device path runs the
/// stored codes and scales (its weights stream fewer bytes than the bf16 model's) and matches the
/// runner, which computes with the same codes dequantised.
#[test]
fn device_decode_runs_an_nvfp4_checkpoint_on_its_codes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = device_model::quantised_demo(dir.path(), true);
    let bf16 = DeviceModel::from_model(
        &Backend::Cpu,
        &Model::load(device_model::demo_dir()).expect("demo model"),
    )
    .expect("bf16 device model");
    let nvfp4 = DeviceModel::from_model(&Backend::Cpu, &Model::load(&out).expect("NVFP4 model"))
        .expect("NVFP4 device model");
    let (k, e) = (bf16.config().num_experts_per_tok, 1);
    assert!(
        nvfp4.weight_bytes(e, k) < bf16.weight_bytes(e, k),
        "NVFP4 {} bytes per step, bf16 {}",
        nvfp4.weight_bytes(e, k),
        bf16.weight_bytes(e, k)
    );
    device_model::decode_matches_runner_on(&Backend::Cpu, &out, KvFormat::Bf16, 12, 12);
}

/// The quantised demo model with each attention layer's k projection re-scaled
/// ([`device_model::rescale_attention_keys`]): the device path runs q, k and v as three GEMMs
/// (the quantised model above runs one) and still matches the runner.
#[test]
fn device_decode_runs_q_k_v_of_different_scales_as_three_linears() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut model =
        Model::load(device_model::quantised_demo(dir.path(), false)).expect("NVFP4 model");
    // the demo model's one attention layer and its MTP head's (bf16): both stacked
    assert_eq!(device_model::qkv_stacking(&Backend::Cpu, &model), (2, 2));
    device_model::rescale_attention_keys(&mut model);
    // the target layer's now apart; the MTP head's bf16 ones still stack
    assert_eq!(device_model::qkv_stacking(&Backend::Cpu, &model), (1, 2));
    device_model::decode_matches_runner_with(&Backend::Cpu, &model, KvFormat::Bf16, 8, 8);
}

/// The per-model W4A4 choice (`DeviceModel::from_model_with`): refused, naming the reason, where
/// an NVFP4 linear has no input scale; with the quantiser's input scales the CPU backend runs
/// the exact emulation of the block-scaled FP4 path (activations quantised to NVFP4), whose
/// logits differ from W4A16's (it really quantises) by no more than activation rounding makes
/// of them.
#[test]
fn device_decode_in_w4a4_quantises_activations_and_stays_near_w4a16() {
    let dir = tempfile::tempdir().expect("temp dir");
    let quantised = device_model::quantised_demo(dir.path(), false);
    let model = Model::load(&quantised).expect("NVFP4 model");
    let mut unscaled = Model::load(&quantised).expect("NVFP4 model");
    let attention = unscaled
        .weights
        .layers
        .iter_mut()
        .find_map(|l| match &mut l.mixer {
            MixerWeights::Attention(a) => Some(a),
            MixerWeights::Gdn(_) => None,
        })
        .expect("an attention layer");
    attention
        .o
        .nvfp4
        .as_mut()
        .expect("an NVFP4 o_proj")
        .input_scale = None;
    let err = DeviceModel::from_model_with(&Backend::Cpu, &unscaled, Nvfp4Mode::W4a4)
        .err()
        .expect("W4A4 without an input scale");
    assert!(err.to_string().contains("input_scale"), "{err}");
    let w4a16 = DeviceModel::from_model(&Backend::Cpu, &model).expect("W4A16 device model");
    let w4a4 = DeviceModel::from_model_with(&Backend::Cpu, &model, Nvfp4Mode::W4a4)
        .expect("W4A4 device model");
    let prompts = device_model::byte_prompts();
    let (a, b) = (
        device_model::teacher_forced_logits(&w4a16, &prompts),
        device_model::teacher_forced_logits(&w4a4, &prompts),
    );
    let (a, b) = (a.concat(), b.concat());
    let largest = compare::max_difference(&b, &a).1;
    let differ = a != b;
    println!("W4A4 against W4A16: largest logit difference {largest:.3e} of the largest logit");
    assert!(
        differ,
        "W4A4 computed exactly what W4A16 did: nothing was quantised"
    );
    assert!(
        largest <= device_model::W4A4_LOGIT_TOLERANCE,
        "{largest:.3e}"
    );
}

/// Synthetic weights in W4A4 (what `bench decode --nvfp4 w4a4` builds) decode on the CPU
/// backend with finite logits that differ from the same weights in W4A16; bf16 weights refuse
/// W4A4 (nothing NVFP4 to multiply).
#[test]
fn synthetic_weights_decode_in_w4a4() {
    let config = Model::load(device_model::demo_dir())
        .expect("demo model")
        .config;
    let build = |weights, mode| DeviceModel::synthetic(&Backend::Cpu, &config, weights, mode, 7);
    let err = build(SyntheticWeights::Bf16, Nvfp4Mode::W4a4)
        .err()
        .expect("bf16 weights in W4A4");
    assert!(err.to_string().contains("W4A4"), "{err}");
    let prompts = device_model::byte_prompts();
    let logits = |mode| {
        let model = build(SyntheticWeights::Nvfp4, mode).expect("synthetic model");
        device_model::teacher_forced_logits(&model, &prompts).concat()
    };
    let (w4a16, w4a4) = (logits(Nvfp4Mode::W4a16), logits(Nvfp4Mode::W4a4));
    assert!(w4a4.iter().all(|v| v.is_finite()), "non-finite W4A4 logits");
    assert_ne!(w4a16, w4a4, "W4A4 computed exactly what W4A16 did");
}
