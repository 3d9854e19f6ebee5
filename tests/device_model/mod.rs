//! The device decode path ([`fp4spec::model::device`]) against the CPU runner
//! ([`Model::forward`]) on the embedded demo model, on whichever backend the including test
//! binary passes: the CPU backend in `tests/model_device.rs` (the wiring, in CI) and CUDA in
//! `tests/gpu/model.rs` (the kernels and the captured graph).
//!
//! Two sequences decode in lockstep: a prompt fed one token per step, then greedy steps from the
//! device's own argmax. Every step's logits must match the runner's within bf16 tolerance, and
//! the device's greedy token must equal the runner's wherever the runner's best two logits are
//! further apart than that tolerance (closer than that, bf16 rounding may pick either).

use fp4spec::backend::Backend;
use fp4spec::checkpoint::quantize::{QuantizeOptions, quantize};
use fp4spec::kernels::attention::KvFormat;
use fp4spec::kernels::compare;
use fp4spec::model::cache::SequenceCache;
use fp4spec::model::device::{Decoder, DeviceModel, SpecDecoder};
use fp4spec::model::forward::{ForwardInput, Model, MtpInput};
use fp4spec::model::params::MixerWeights;
use std::path::PathBuf;

/// Largest |device - runner| logit over a step, relative to the largest |runner| logit. The
/// device path rounds every activation the GEMMs read and write to bf16 (8 bits of mantissa,
/// relative error 2^-9 per rounding), the runner keeps f32; through the demo model's 4 layers
/// and the lm_head the measured error is about 1e-2 of the largest logit.
pub const LOGIT_TOLERANCE: f64 = 4e-2;

/// [`LOGIT_TOLERANCE`] with the KV cache in e4m3 while the runner keeps f32: every cached key
/// and value rounded to 3 mantissa bits (relative error up to 2^-4). The demo model's attention
/// is sharp, so now and then a key's rounding moves a step's logits far: on the CPU backend
/// with unit scales, errors of 0.1-4.4% of the largest logit and one step at 16.7% in 48 (the
/// same with key scale 16; a cache saturating everywhere, scales 0.001, gave 90%). So a bound
/// on the largest error and a tighter one on the mean; the greedy tokens are not counted (their
/// margins rarely clear twice this bound).
pub const FP8_LOGIT_TOLERANCE: f64 = 0.25;
/// The bound on the mean relative logit error with an e4m3 cache (measured 1.0% on the CPU).
pub const FP8_MEAN_LOGIT_TOLERANCE: f64 = 0.03;

fn logit_tolerance(kv: KvFormat) -> f64 {
    match kv {
        KvFormat::Bf16 => LOGIT_TOLERANCE,
        KvFormat::Fp8E4m3 { .. } => FP8_LOGIT_TOLERANCE,
    }
}

/// The demo model folder: beside the manifest when built here, else relative to the working
/// directory (the GPU host runs the binaries from the checkout root at another path).
pub fn demo_dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/qwen35-moe-demo");
    if built.exists() {
        built
    } else {
        PathBuf::from("models/qwen35-moe-demo")
    }
}

fn argmax(row: &[f32]) -> (u32, f32) {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    let runner_up = row
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best)
        .fold(f32::NEG_INFINITY, |m, (_, v)| m.max(*v));
    (best as u32, row[best] - runner_up)
}

/// The runner's forward of `token` on `cache`, and the largest |device - runner| logit relative
/// to the largest |runner| logit; panics past `tolerance` naming `what`.
fn runner_step(
    model: &Model,
    cache: &mut SequenceCache,
    token: u32,
    device_row: &[f32],
    tolerance: f64,
    what: &str,
) -> (Vec<f32>, f64, f64) {
    let out = model
        .forward(&mut [ForwardInput {
            cache,
            tokens: &[token],
            record: false,
            all_logits: false,
        }])
        .expect("runner forward");
    let runner = out.into_iter().next().expect("one sequence").logits;
    let scale = runner.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
    let error = compare::max_difference(device_row, &runner).1;
    assert!(
        error <= tolerance,
        "{what}: logits differ by {error:.3e} of the largest (tolerance {tolerance:.0e})"
    );
    (runner, scale, error)
}

/// The demo model quantised to ModelOpt NVFP4 into `dir` (experts as per-expert linears where
/// `split_experts`); q, k and v of each attention layer share one per-tensor scale, as
/// `fp4spec quantize` gives linears that engines fuse.
pub fn quantised_demo(dir: &std::path::Path, split_experts: bool) -> PathBuf {
    let out = dir.join("demo-nvfp4");
    let mut options = QuantizeOptions::new(demo_dir(), &out);
    options.split_experts = split_experts;
    quantize(&options, &indicatif::ProgressBar::hidden()).expect("quantize the demo model");
    out
}

/// How far W4A4's logits may lie from W4A16's on the demo model, relative to the largest:
/// activations rounded to E2M1 (a relative step of up to 1/3 per element, averaging out over
/// dot products of 64 to 256 terms) at the quantiser's default input scale 1.0; 6.7e-2 seen on
/// the two prompts here, a broken quantisation (zeros, a wrong scale) moves logits by O(1).
pub const W4A4_LOGIT_TOLERANCE: f64 = 0.15;

/// Two byte-level prompts (a code-like and a prose-like one) for the demo model's vocabulary.
pub fn byte_prompts() -> Vec<Vec<u32>> {
    ["def fib(n): return n", "The quick brown fox jumps"]
        .iter()
        .map(|p| p.bytes().map(u32::from).collect())
        .collect()
}

/// The logits of `device` decoding `prompts` (teacher-forced: every step's input is the
/// prompt's next byte), `[step][sequence * vocab]`.
pub fn teacher_forced_logits(device: &DeviceModel, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let steps = prompts.iter().map(Vec::len).min().expect("prompts");
    let mut decoder = Decoder::new(device, prompts.len(), steps).expect("decoder");
    let first: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
    decoder.start(&first).expect("start");
    let mut logits = Vec::new();
    for step in 0..steps {
        decoder.step().expect("device step");
        logits.push(decoder.logits().expect("logits"));
        if step + 1 < steps {
            let next: Vec<u32> = prompts.iter().map(|p| p[step + 1]).collect();
            decoder.set_tokens(&next).expect("feed the prompt");
        }
    }
    logits
}

/// Doubles each attention layer's k projection's per-tensor scale and its dequantised weight
/// with it: the model computes the same up to rounding, but q, k and v no longer share one
/// scale, so the device path cannot stack them into one weight and runs three GEMMs.
pub fn rescale_attention_keys(model: &mut Model) {
    let mut rescaled = 0;
    for layer in &mut model.weights.layers {
        if let MixerWeights::Attention(a) = &mut layer.mixer {
            let k = a.k.nvfp4.as_mut().expect("an NVFP4 k projection");
            k.global_scale *= 2.0;
            a.k.weight.iter_mut().for_each(|w| *w *= 2.0);
            rescaled += 1;
        }
    }
    assert!(rescaled > 0, "the model has attention layers");
}

/// How `model`'s attention layers run on `backend`: `(stacked, total)`, the layers (the target's
/// and the MTP head's) whose q, k and v run as one GEMM, of all.
pub fn qkv_stacking(backend: &Backend, model: &Model) -> (usize, usize) {
    DeviceModel::from_model(backend, model)
        .expect("device model")
        .stacked_qkv_layers()
}

/// Runs the comparison on `backend` with the demo model; returns the largest relative logit
/// error seen.
pub fn decode_matches_runner(backend: &Backend, prompt_steps: usize, greedy_steps: usize) -> f64 {
    decode_matches_runner_on(
        backend,
        &demo_dir(),
        KvFormat::Bf16,
        prompt_steps,
        greedy_steps,
    )
}

/// [`decode_matches_runner`] with the checkpoint in `dir` (the demo model's vocabulary: the
/// prompts are bytes) and the device's KV caches in `kv` (e4m3: within [`FP8_LOGIT_TOLERANCE`]).
pub fn decode_matches_runner_on(
    backend: &Backend,
    dir: &std::path::Path,
    kv: KvFormat,
    prompt_steps: usize,
    greedy_steps: usize,
) -> f64 {
    let model = Model::load(dir).expect("model loads");
    decode_matches_runner_with(backend, &model, kv, prompt_steps, greedy_steps)
}

/// [`decode_matches_runner_on`] with a model already loaded (and perhaps changed).
pub fn decode_matches_runner_with(
    backend: &Backend,
    model: &Model,
    kv: KvFormat,
    prompt_steps: usize,
    greedy_steps: usize,
) -> f64 {
    let mut device = DeviceModel::from_model(backend, model).expect("device model");
    device.set_kv_format(kv);
    let tolerance = logit_tolerance(kv);
    let prompts: Vec<Vec<u32>> = ["def fib(n): return n", "The quick brown fox jumps"]
        .iter()
        .map(|p| p.bytes().map(u32::from).take(prompt_steps).collect())
        .collect();
    let mut decoder =
        Decoder::new(&device, prompts.len(), prompt_steps + greedy_steps).expect("decoder");
    let mut caches: Vec<SequenceCache> = prompts
        .iter()
        .map(|_| SequenceCache::new(&model.config))
        .collect();
    let vocab = model.config.vocab_size;
    let mut inputs: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
    decoder.start(&inputs).expect("start");
    let (mut worst, mut sum) = (0.0f64, 0.0f64);
    let mut checked_tokens = 0;
    for step in 0..prompt_steps + greedy_steps {
        decoder.step().expect("device step");
        let device_logits = decoder.logits().expect("device logits");
        let device_tokens = decoder.tokens().expect("device tokens");
        let mut next = Vec::new();
        for (s, cache) in caches.iter_mut().enumerate() {
            let (runner, scale, error) = runner_step(
                model,
                cache,
                inputs[s],
                &device_logits[s * vocab..(s + 1) * vocab],
                tolerance,
                &format!(
                    "{}: {} KV, sequence {s} step {step}",
                    backend.name(),
                    kv.name()
                ),
            );
            worst = worst.max(error);
            sum += error;
            let (token, margin) = argmax(&runner);
            if f64::from(margin) > 2.0 * tolerance * scale {
                assert_eq!(
                    device_tokens[s],
                    token,
                    "{}: sequence {s} step {step}: greedy token (runner margin {margin})",
                    backend.name()
                );
                checked_tokens += 1;
            }
            next.push(if step + 1 < prompt_steps {
                prompts[s][step + 1]
            } else {
                device_tokens[s]
            });
        }
        inputs = next;
        if step + 1 < prompt_steps {
            decoder.set_tokens(&inputs).expect("feed the prompt");
        }
    }
    let rows = caches.len() * (prompt_steps + greedy_steps);
    let mean = sum / rows as f64;
    match kv {
        KvFormat::Bf16 => assert!(
            checked_tokens * 2 >= rows,
            "only {checked_tokens} greedy tokens had a clear margin: the check is too weak"
        ),
        KvFormat::Fp8E4m3 { .. } => assert!(
            mean <= FP8_MEAN_LOGIT_TOLERANCE,
            "{}: e4m3 KV: mean logit error {mean:.3e} (bound {FP8_MEAN_LOGIT_TOLERANCE:.0e})",
            backend.name()
        ),
    }
    println!(
        "{}: device decode ({} KV) vs the CPU runner, {} sequences x {} steps (graph: {}): \
         largest logit error {worst:.3e} of the largest logit (mean {mean:.3e}), \
         {checked_tokens} greedy tokens checked",
        backend.name(),
        kv.name(),
        caches.len(),
        prompt_steps + greedy_steps,
        decoder.replays_graph()
    );
    worst
}

/// Two prompts of different lengths through [`Decoder::prefill`] (one forward over every prompt
/// row but the last of each), then greedy steps: every step's logits against the runner's on the
/// same tokens (the runner runs each whole prompt, then the same continuation). Returns the
/// largest relative logit error.
pub fn prefill_matches_runner(backend: &Backend, greedy_steps: usize) -> f64 {
    let model = Model::load(demo_dir()).expect("demo model loads");
    let device = DeviceModel::from_model(backend, &model).expect("device model");
    let prompts: Vec<Vec<u32>> = [
        "fn main() { let total = items.iter().sum(); }",
        "Once upon a time there",
    ]
    .iter()
    .map(|p| p.bytes().map(u32::from).collect())
    .collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut decoder =
        Decoder::new(&device, prompts.len(), longest + greedy_steps + 1).expect("decoder");
    let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    decoder.prefill(&views).expect("device prefill");
    let vocab = model.config.vocab_size;
    let mut caches: Vec<SequenceCache> = prompts
        .iter()
        .map(|_| SequenceCache::new(&model.config))
        .collect();
    // the runner takes each prompt but its last token in one forward, then token by token
    for (cache, prompt) in caches.iter_mut().zip(&prompts) {
        model
            .forward(&mut [ForwardInput {
                cache,
                tokens: &prompt[..prompt.len() - 1],
                record: false,
                all_logits: false,
            }])
            .expect("runner prefill");
    }
    let mut inputs: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
    let mut worst = 0.0f64;
    for step in 0..greedy_steps {
        decoder.step().expect("device step");
        let device_logits = decoder.logits().expect("device logits");
        let device_tokens = decoder.tokens().expect("device tokens");
        for (s, cache) in caches.iter_mut().enumerate() {
            let (_, _, error) = runner_step(
                &model,
                cache,
                inputs[s],
                &device_logits[s * vocab..(s + 1) * vocab],
                LOGIT_TOLERANCE,
                &format!("{}: prefill then step {step}, sequence {s}", backend.name()),
            );
            worst = worst.max(error);
        }
        // both continue with the device's tokens, so a near-tie cannot split them
        inputs = device_tokens;
    }
    println!(
        "{}: device prefill ({} and {} prompt tokens) then {greedy_steps} steps vs the CPU \
         runner: largest logit error {worst:.3e} of the largest logit",
        backend.name(),
        prompts[0].len(),
        prompts[1].len()
    );
    worst
}

/// Prompts of different lengths for the speculative tests (one is a single token: its first
/// drafts come from no hidden at all).
fn spec_prompts() -> Vec<Vec<u32>> {
    ["def fib(n):\n    if n < 2:", "Once upon a time", "x"]
        .iter()
        .map(|p| p.bytes().map(u32::from).collect())
        .collect()
}

/// Greedy decoding with `drafts` MTP drafts per step against greedy decoding without them, both
/// on the device path: every sequence's first `tokens` generated tokens must be equal, except
/// that a sequence may part ways at a token where the plain decoder's best two logits were
/// within bf16 noise (rounding differs between a verify forward and a decode step; on the CPU
/// backend nothing may part). Returns the acceptance rate per draft depth.
pub fn speculation_matches_plain_decoding(
    backend: &Backend,
    drafts: usize,
    tokens: usize,
) -> Vec<f64> {
    let model = Model::load(demo_dir()).expect("demo model loads");
    let device = DeviceModel::from_model(backend, &model).expect("device model");
    let prompts = spec_prompts();
    let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = longest + tokens + 2 * drafts + 2 * (drafts + 1);
    // plain: the tokens and each step's margin between the best two logits
    let mut plain = Decoder::new(&device, prompts.len(), capacity).expect("decoder");
    plain.prefill(&views).expect("plain prefill");
    let vocab = model.config.vocab_size;
    let mut plain_tokens = vec![Vec::new(); prompts.len()];
    let mut margins = vec![Vec::new(); prompts.len()];
    for _ in 0..tokens {
        plain.step().expect("plain step");
        let logits = plain.logits().expect("logits");
        for (s, token) in plain.tokens().expect("tokens").into_iter().enumerate() {
            let row = &logits[s * vocab..(s + 1) * vocab];
            let (_, margin) = argmax(row);
            let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            plain_tokens[s].push(token);
            margins[s].push(f64::from(margin) / f64::from(scale));
        }
    }
    let mut spec = SpecDecoder::new(&device, prompts.len(), capacity, drafts).expect("spec");
    spec.prefill(&views).expect("spec prefill");
    let mut steps = 0;
    while spec
        .generated()
        .expect("generated")
        .iter()
        .any(|g| g.len() < tokens)
    {
        spec.step().expect("spec step");
        steps += 1;
        assert!(steps <= tokens, "{steps} steps without {tokens} tokens");
    }
    let generated = spec.generated().expect("generated");
    let exact = matches!(backend, Backend::Cpu);
    for (s, (got, want)) in generated.iter().zip(&plain_tokens).enumerate() {
        if let Some(i) = (0..tokens).find(|&i| got[i] != want[i]) {
            assert!(
                !exact && margins[s][i] < 2.0 * LOGIT_TOLERANCE,
                "{}: sequence {s}, {drafts} drafts: token {i} is {} with speculation, {} \
                 without (margin {:.2e} of the largest logit)\nwith:    {:?}\nwithout: {:?}",
                backend.name(),
                got[i],
                want[i],
                margins[s][i],
                &got[..tokens],
                want
            );
        }
    }
    let stats = spec.acceptance().expect("acceptance");
    let rates: Vec<f64> = stats
        .drafted
        .iter()
        .zip(&stats.accepted)
        .map(|(&d, &a)| {
            assert!(a <= d, "accepted {a} of {d} drafts");
            a as f64 / d.max(1) as f64
        })
        .collect();
    let emitted: usize = generated.iter().map(Vec::len).sum();
    println!(
        "{}: {drafts} drafts per step: {emitted} tokens in {steps} steps over {} sequences \
         (graph: {}), acceptance per depth {rates:.2?}, equal to decoding without drafts",
        backend.name(),
        prompts.len(),
        spec.replays_graph()
    );
    rates
}

/// The device MTP head against the runner's: after a prefill, each sequence's first drafts
/// equal the runner's (its MTP over the prompt's rows, then chained rows), as far as the
/// runner's draft logits have a clear best token. Returns the drafts checked.
pub fn mtp_drafts_match_runner(backend: &Backend, drafts: usize) -> usize {
    let model = Model::load(demo_dir()).expect("demo model loads");
    let device = DeviceModel::from_model(backend, &model).expect("device model");
    let prompts: Vec<Vec<u32>> = [
        "def fib(n):\n    if n < 2:",
        "Once upon a time",
        "for (int i = 0; i < n; ++i) {",
        "The capital of France is",
        "import numpy as np\nx = np.",
        "SELECT name FROM users WHERE",
    ]
    .iter()
    .map(|p| p.bytes().map(u32::from).collect())
    .collect();
    let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut spec =
        SpecDecoder::new(&device, prompts.len(), longest + 4 * drafts + 4, drafts).expect("spec");
    spec.prefill(&views).expect("spec prefill");
    let device_drafts = spec.next_drafts().expect("drafts");
    let h = model.config.hidden_size;
    let depth = model.config.mtp_num_hidden_layers.max(1);
    let mut checked = 0;
    for (s, prompt) in prompts.iter().enumerate() {
        let mut cache = SequenceCache::new(&model.config);
        let rows = &prompt[..prompt.len() - 1];
        let target = model
            .forward(&mut [ForwardInput {
                cache: &mut cache,
                tokens: rows,
                record: false,
                all_logits: false,
            }])
            .expect("runner prefill")
            .remove(0);
        let mut out = model
            .mtp_forward(&mut [MtpInput {
                cache: &mut cache,
                tokens: &prompt[1..],
                hidden: &target.hidden,
                layer: 0,
            }])
            .expect("runner MTP")
            .remove(0);
        let vocab = model.config.vocab_size;
        let mut logits = out.logits[(rows.len() - 1) * vocab..].to_vec();
        let mut hidden = out.hidden[(rows.len() - 1) * h..].to_vec();
        for d in 0..drafts {
            let (token, margin) = argmax(&logits);
            let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if f64::from(margin) <= 2.0 * LOGIT_TOLERANCE * f64::from(scale) {
                break;
            }
            assert_eq!(
                device_drafts[s][d],
                token,
                "{}: sequence {s} draft {d}: device {:?}",
                backend.name(),
                device_drafts[s]
            );
            checked += 1;
            out = model
                .mtp_forward(&mut [MtpInput {
                    cache: &mut cache,
                    tokens: &[token],
                    hidden: &hidden,
                    layer: (d + 1) % depth,
                }])
                .expect("runner chained MTP")
                .remove(0);
            logits = out.logits;
            hidden = out.hidden;
        }
    }
    assert!(
        checked >= prompts.len(),
        "only {checked} drafts had a clear margin"
    );
    println!(
        "{}: device MTP drafts equal the runner's: {checked} drafts checked",
        backend.name()
    );
    checked
}
