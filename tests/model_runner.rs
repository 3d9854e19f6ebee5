//! The CPU runner against the golden fixtures of `tools/reference/make_fixtures.py` (HF
//! transformers 5.17, float32): logits of every position, MTP logits, greedy continuations, and
//! greedy with speculation equal to greedy without it, on every layout (text-only, the
//! vision-language wrapper sharded with F32 norms, ModelOpt NVFP4, Qwen3-Next).

use fp4spec::kernels::compare;
use fp4spec::kernels::verify::reference::SamplingParams;
use fp4spec::model::cache::SequenceCache;
use fp4spec::model::forward::{ForwardInput, ForwardOutput, Model, MtpInput};
use fp4spec::model::generate::{self, FinishReason, Request};
use std::path::PathBuf;

/// The fixtures folder: beside the manifest when built here, else relative to the working
/// directory (the GPU host runs the binaries from the checkout root at another path).
fn fixture(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let base = if built.exists() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    base.join(name)
}

struct Reference {
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
    mtp_logits: Vec<Vec<Vec<f32>>>,
    greedy: Vec<Vec<u32>>,
}

fn reference(name: &str) -> Reference {
    let path = fixture(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
    let ids = |v: &serde_json::Value| -> Vec<Vec<u32>> {
        serde_json::from_value(v.clone()).expect("token lists")
    };
    let rows = |v: &serde_json::Value| -> Vec<Vec<Vec<f32>>> {
        serde_json::from_value(v.clone()).expect("logit rows")
    };
    Reference {
        prompts: ids(&v["prompts"]),
        logits: rows(&v["logits"]),
        mtp_logits: rows(&v["mtp_logits"]),
        greedy: ids(&v["greedy"]),
    }
}

/// Largest |ours - theirs| over a row set, relative to the largest |theirs|.
fn max_relative_error(ours: &[f32], theirs: &[Vec<f32>]) -> f64 {
    let flat: Vec<f32> = theirs.iter().flatten().copied().collect();
    assert_eq!(ours.len(), flat.len(), "row count or vocabulary differs");
    compare::max_difference(ours, &flat).1
}

/// fp32 transformers against f64-accumulating references: agreement to ~1e-6 of the logit scale
/// is what the arithmetic gives; 2e-5 leaves room for the longest prompt's accumulated rounding
/// and is still far below any real mistake (a wrong norm, rotary pairing or gate moves logits by
/// 1e-2 or more).
const LOGIT_TOLERANCE: f64 = 2e-5;

/// One sequence's forward over `tokens` with every row's logits.
fn prefill(model: &Model, cache: &mut SequenceCache, tokens: &[u32]) -> ForwardOutput {
    model
        .forward(&mut [ForwardInput {
            cache,
            tokens,
            record: false,
            all_logits: true,
        }])
        .expect("forward")
        .remove(0)
}

fn check_logits(name: &str, with_mtp: bool) {
    let model = Model::load(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r = reference(name);
    let h = model.config.hidden_size;
    for (i, prompt) in r.prompts.iter().enumerate() {
        let mut cache = SequenceCache::new(&model.config);
        let out = prefill(&model, &mut cache, prompt);
        let err = max_relative_error(&out.logits, &r.logits[i]);
        println!(
            "{name} prompt {i} (T = {}): logits max rel err {err:.2e}",
            prompt.len()
        );
        assert!(
            err < LOGIT_TOLERANCE,
            "{name} prompt {i}: logits off by {err:.2e}"
        );
        if with_mtp && prompt.len() > 1 {
            let t = prompt.len();
            let mtp = model
                .mtp_forward(&mut [MtpInput {
                    cache: &mut cache,
                    tokens: &prompt[1..],
                    hidden: &out.hidden[..(t - 1) * h],
                    layer: 0,
                }])
                .expect("MTP forward")
                .remove(0);
            let err = max_relative_error(&mtp.logits, &r.mtp_logits[i]);
            println!("{name} prompt {i}: MTP logits max rel err {err:.2e}");
            assert!(
                err < LOGIT_TOLERANCE,
                "{name} prompt {i}: MTP logits off by {err:.2e}"
            );
        }
    }
}

fn greedy(prompt: &[u32], n: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        params: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop_tokens: Vec::new(),
    }
}

/// Greedy continuations equal transformers', without speculation and with 1, 2 and 4 drafts,
/// for the whole batch of prompts at once (sequences of different lengths).
fn check_greedy(name: &str, spec: &[usize]) {
    let model = Model::load(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r = reference(name);
    let requests: Vec<Request> = r
        .prompts
        .iter()
        .zip(&r.greedy)
        .map(|(p, g)| greedy(p, g.len()))
        .collect();
    for &n in spec {
        let out = generate::generate(&model, &requests, n).expect("generate");
        for (i, (got, want)) in out.iter().zip(&r.greedy).enumerate() {
            assert_eq!(
                &got.tokens, want,
                "{name} prompt {i}: greedy with {n} drafts differs from transformers"
            );
            assert_eq!(got.finish_reason, FinishReason::Length);
            if n > 0 {
                println!(
                    "{name} prompt {i}, {n} drafts: {} forwards, accepted {}/{} drafts",
                    got.forwards,
                    got.accepted(),
                    got.drafted()
                );
            }
        }
    }
}

#[test]
fn text_layout_matches_transformers() {
    check_logits("qwen35_text", true);
}

#[test]
fn vision_language_sharded_layout_matches_transformers() {
    check_logits("qwen35_vl", true);
}

#[test]
fn nvfp4_checkpoint_matches_transformers_on_dequantised_weights() {
    check_logits("qwen35_nvfp4", true);
}

#[test]
fn qwen3_next_layout_matches_transformers() {
    check_logits("qwen3_next", false);
}

#[test]
fn greedy_matches_transformers_with_and_without_speculation() {
    check_greedy("qwen35_text", &[0, 1, 2, 4]);
}

#[test]
fn greedy_nvfp4_and_vl_match_with_and_without_speculation() {
    check_greedy("qwen35_nvfp4", &[0, 1, 2, 4]);
    check_greedy("qwen35_vl", &[0, 1, 2, 4]);
}

#[test]
fn greedy_qwen3_next_matches_transformers() {
    check_greedy("qwen3_next", &[0]);
}

/// Verify-then-commit(k) leaves the caches exactly as decoding the first k tokens one at a time:
/// the next forward gives bit-identical logits, for every k and on both mixers.
#[test]
fn commit_of_any_prefix_equals_decoding_that_prefix() {
    let model = Model::load(fixture("qwen35_text")).expect("fixture");
    let prompt = [5u32, 17, 250, 3, 99];
    let verify_rows = [7u32, 8, 9, 10];
    let next = 42u32;
    let forward = |cache: &mut SequenceCache, tokens: &[u32], record: bool| {
        model
            .forward(&mut [ForwardInput {
                cache,
                tokens,
                record,
                all_logits: false,
            }])
            .expect("forward")
            .remove(0)
            .logits
    };
    for keep in 1..=verify_rows.len() {
        let mut speculative = SequenceCache::new(&model.config);
        forward(&mut speculative, &prompt, false);
        forward(&mut speculative, &verify_rows, true);
        speculative.commit(keep).expect("commit");
        let got = forward(&mut speculative, &[next], false);

        let mut plain = SequenceCache::new(&model.config);
        forward(&mut plain, &prompt, false);
        for token in &verify_rows[..keep] {
            forward(&mut plain, std::slice::from_ref(token), false);
        }
        let want = forward(&mut plain, &[next], false);
        assert_eq!(speculative.len, plain.len);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "commit({keep}) of {} left different caches",
            verify_rows.len()
        );
    }
}

/// Bad input is an error value naming the problem, never a panic.
#[test]
fn bad_inputs_are_errors() {
    let model = Model::load(fixture("qwen35_text")).expect("fixture");
    let mut cache = SequenceCache::new(&model.config);
    let err = model
        .forward(&mut [ForwardInput {
            cache: &mut cache,
            tokens: &[1, 320],
            record: false,
            all_logits: false,
        }])
        .expect_err("token 320 is outside a 320-token vocabulary");
    assert!(
        err.to_string().contains("sequence 0, token 1") && err.to_string().contains("320"),
        "{err}"
    );
    assert!(cache.commit(1).is_err(), "no recorded forward to commit");
    // a keep out of range leaves the recorded forward pending, for a valid commit after it
    model
        .forward(&mut [ForwardInput {
            cache: &mut cache,
            tokens: &[1, 2],
            record: true,
            all_logits: false,
        }])
        .expect("recorded forward");
    assert!(cache.commit(3).is_err(), "keep 3 of 2 recorded tokens");
    cache.commit(1).expect("the record is still pending");
    assert_eq!(cache.len, 1);
    // a cache made for another model (Qwen3-Next's layers) is refused, not indexed past its end
    let next = Model::load(fixture("qwen3_next")).expect("fixture");
    let mut foreign = SequenceCache::new(&next.config);
    foreign.layers.truncate(1);
    let err = model
        .forward(&mut [ForwardInput {
            cache: &mut foreign,
            tokens: &[1],
            record: false,
            all_logits: false,
        }])
        .expect_err("a cache of another model");
    assert!(err.to_string().contains("sequence 0 cache"), "{err}");
    let err = generate::generate(&model, &[greedy(&[], 4)], 0).expect_err("empty prompt");
    assert!(err.to_string().contains("empty prompt"), "{err}");
    let err = generate::generate(&next, &[greedy(&[1], 4)], 2).expect_err("no MTP head");
    assert!(err.to_string().contains("no MTP head"), "{err}");
}

/// The embedded demo model (trained with its MTP head by tools/reference/train_demo.py): greedy
/// with 1, 2 and 4 drafts equals plain greedy on a code-like and a prose-like prompt, and the
/// drafts are really accepted (chance is 1 in 260 for a byte-level model).
#[test]
fn demo_model_speculation_is_lossless_and_accepted() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/qwen35-moe-demo");
    let dir = if dir.exists() {
        dir
    } else {
        PathBuf::from("models/qwen35-moe-demo")
    };
    let model = Model::load(&dir).expect("demo model");
    for prompt in [
        "def scale_width(width, offset):\n",
        "Long ago, the pale merchant opened the window. ",
    ] {
        let request = greedy(
            prompt
                .as_bytes()
                .iter()
                .map(|&b| u32::from(b))
                .collect::<Vec<_>>()
                .as_slice(),
            96,
        );
        let plain = generate::generate(&model, std::slice::from_ref(&request), 0)
            .expect("plain")
            .remove(0);
        for n in [1, 2, 4] {
            let spec = generate::generate(&model, std::slice::from_ref(&request), n)
                .expect("speculative")
                .remove(0);
            assert_eq!(
                spec.tokens, plain.tokens,
                "{prompt:?}: {n} drafts changed the output"
            );
            let first = spec.acceptance.rates()[0];
            println!(
                "{prompt:?}, {n} drafts: acceptance by position {:?}",
                spec.acceptance.rates()
            );
            assert!(
                first > 0.5,
                "{prompt:?}: position-1 acceptance {first} with {n} drafts"
            );
            assert!(
                spec.forwards < plain.forwards,
                "speculation saved no forward"
            );
        }
    }
}

/// `fp4spec quantize` on the BF16 fixture, end to end: doctor passes, the runner loads the
/// fused ModelOpt experts and the per-expert split to bit-identical weights, and the
/// compressed-tensors form (its own global-scale convention) too, the logits stay near the BF16 model's (NVFP4
/// error), and greedy speculation stays lossless on the quantised model.
#[test]
fn quantised_fixture_loads_in_every_layout_and_stays_lossless() {
    use fp4spec::checkpoint::{doctor, quantize};
    use fp4spec::formats::quant_config::Convention;
    let tmp = tempfile::tempdir().expect("temp dir");
    let source = fixture("qwen35_text");
    let layouts: [(&str, Convention, bool); 3] = [
        ("fused", Convention::ModelOpt, false),
        ("split", Convention::ModelOpt, true),
        ("compressed", Convention::CompressedTensors, false),
    ];
    let mut logits: Vec<Vec<f32>> = Vec::new();
    let prompt = [3u32, 141, 59, 26, 5, 35, 89];
    for (name, convention, split_experts) in layouts {
        let out = tmp.path().join(name);
        let mut options = quantize::QuantizeOptions::new(&source, &out);
        options.convention = convention;
        options.split_experts = split_experts;
        quantize::quantize(&options, &indicatif::ProgressBar::hidden()).expect("quantize");
        let findings = doctor::diagnose(&out).expect("doctor");
        assert!(findings.healthy(), "{name}: {:#?}", findings.findings);
        let model = Model::load(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        logits.push(prefill(&model, &mut SequenceCache::new(&model.config), &prompt).logits);
        if name == "fused" {
            let requests = [greedy(&prompt, 16)];
            let plain = generate::generate(&model, &requests, 0).expect("plain");
            let spec = generate::generate(&model, &requests, 3).expect("speculative");
            assert_eq!(plain[0].tokens, spec[0].tokens, "quantised model, 3 drafts");
        }
    }
    assert!(
        logits[0]
            .iter()
            .zip(&logits[1])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the per-expert split loads other weights than the fused experts"
    );
    let bf16 = Model::load(&source).expect("fixture");
    let reference = prefill(&bf16, &mut SequenceCache::new(&bf16.config), &prompt).logits;
    for (i, (name, ..)) in layouts.iter().enumerate() {
        let err = max_relative_error(&logits[i], std::slice::from_ref(&reference));
        println!("NVFP4 ({name}) against BF16 logits: max rel err {err:.3}");
        assert!(
            err > 1e-4 && err < 0.25,
            "{name}: logits off by {err} of the BF16 scale"
        );
    }
}
