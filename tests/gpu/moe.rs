//! GPU checks of the `moe` family: the whole block (one persistent launch: router, top-k,
//! alignment, grouped expert GEMMs, combine) against the CPU reference, on every device backend
//! present (CUDA; HIP on a gfx1151 built with `--features hip`).
//!
//! How a result is judged:
//! - Routing: the experts the GPU chose must be the reference's (f64) for every token, except
//!   where two router logits are closer than the fp32 accumulation can separate (`tie_tolerance`
//!   below, reported as "near ties"); the weights must sum to 1, descend, and match the
//!   reference softmax of the chosen experts within what that logit error allows; the shared
//!   expert's scale within what the same error allows through the sigmoid.
//! - Output: against the reference evaluated with the GPU's routing, in f64, with each expert
//!   activation silu(gate) * up rounded to bf16 as the kernel does; then `compare_bf16`: each
//!   element within bf16 rounding of the output plus 2e-3 of its RMS (fp32 accumulation). NVFP4
//!   weights decode exactly, so W4A16 has no other error source.
//!
//! Outputs start as NaN, so an element the kernel never writes fails.

use crate::common::{devices, poisoned, rng};
use fp4spec::backend::Backend;
use fp4spec::kernels::compare;
use fp4spec::kernels::moe::reference::{self, ExpertRef, MoeShape, Routing};
use fp4spec::kernels::moe::{
    self, ExpertFormat, ExpertWeights, MoeHostWeights, MoeLaunch, MoeWeights, MoeWorkspace,
};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::sync::OnceLock;

/// Qwen3.5/3.6-35B-A3B.
const QWEN: MoeShape = MoeShape {
    experts: 256,
    top_k: 8,
    hidden: 2048,
    intermediate: 512,
    shared_intermediate: 512,
};
const TOKENS: [usize; 7] = [1, 2, 3, 8, 16, 64, 512];

fn shape(
    experts: usize,
    top_k: usize,
    hidden: usize,
    intermediate: usize,
    shared: usize,
) -> MoeShape {
    MoeShape {
        experts,
        top_k,
        hidden,
        intermediate,
        shared_intermediate: shared,
    }
}

// ---- inputs ----

/// bf16 uniform in [-a, a] with RMS `rms`.
fn uniform_bf16(rng: &mut SplitMix64, len: usize, rms: f32) -> Vec<bf16> {
    let a = rms * 3f32.sqrt();
    (0..len)
        .map(|_| bf16::from_f32((2.0 * rng.uniform() - 1.0) * a))
        .collect()
}

/// Synthetic weights ([`MoeHostWeights::synthetic`]), without the shared-expert gate unless
/// `gate`.
fn random_block(seed: u64, s: MoeShape, format: ExpertFormat, gate: bool) -> MoeHostWeights {
    let mut host = MoeHostWeights::synthetic(s, format, seed);
    if !gate {
        host.shared_gate = None;
    }
    host
}

/// `f` over `items` on every core, in order.
fn parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = items.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| scope.spawn(|| part.iter().map(&f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("worker"))
            .collect()
    })
}

// ---- the reference side ----

/// The host weights with every expert expanded to f32 on first use.
struct Reference<'a> {
    host: &'a MoeHostWeights,
    router: Vec<f32>,
    gate: Option<Vec<f32>>,
    dense: Vec<OnceLock<(Vec<f32>, Vec<f32>)>>,
    shared: Option<(Vec<f32>, Vec<f32>)>,
}

impl<'a> Reference<'a> {
    fn new(host: &'a MoeHostWeights) -> Self {
        Self {
            host,
            router: host.router.iter().map(|v| v.to_f32()).collect(),
            gate: host
                .shared_gate
                .as_ref()
                .map(|g| g.iter().map(|v| v.to_f32()).collect()),
            dense: (0..host.shape.experts).map(|_| OnceLock::new()).collect(),
            shared: host.shared.as_ref().map(ExpertWeights::dense),
        }
    }

    fn expert(&self, e: usize) -> ExpertRef<'_> {
        let (gate_up, down) = self.dense[e].get_or_init(|| self.host.experts[e].dense());
        ExpertRef { gate_up, down }
    }

    /// Router logits `[t][E]` in f64, and per token the largest sum of |x_h r_h| over the
    /// experts (the scale of fp32 accumulation error).
    fn logits(&self, x: &[f32], t: usize) -> (Vec<f64>, Vec<f64>) {
        let (e_count, h) = (self.host.shape.experts, self.host.shape.hidden);
        let rows: Vec<(Vec<f64>, f64)> = parallel(&(0..t).collect::<Vec<_>>(), |&token| {
            let xt = &x[token * h..(token + 1) * h];
            let mut scale = 0.0f64;
            let logits = (0..e_count)
                .map(|e| {
                    let row = &self.router[e * h..(e + 1) * h];
                    let (mut dot, mut abs) = (0.0f64, 0.0f64);
                    for (a, b) in xt.iter().zip(row) {
                        let p = f64::from(*a) * f64::from(*b);
                        dot += p;
                        abs += p.abs();
                    }
                    scale = scale.max(abs);
                    dot
                })
                .collect();
            (logits, scale)
        });
        let scales = rows.iter().map(|r| r.1).collect();
        (rows.into_iter().flat_map(|r| r.0).collect(), scales)
    }

    /// The block for `routing`, activations rounded to bf16 as the kernel does, and the slack
    /// of activations the kernel's fp32 sums may round the other way
    /// (`reference::moe_block_bf16`); tokens in parallel. Unrounded output.
    fn block(&self, x: &[f32], t: usize, routing: &Routing) -> (Vec<f32>, Vec<f64>) {
        let s = self.host.shape;
        let (h, k) = (s.hidden, s.top_k);
        let tokens: Vec<usize> = (0..t).collect();
        let rows = parallel(&tokens, |&token| {
            let one = Routing {
                top_k: k,
                experts: routing.experts[token * k..(token + 1) * k].to_vec(),
                weights: routing.weights[token * k..(token + 1) * k].to_vec(),
                shared_scale: routing
                    .shared_scale
                    .get(token)
                    .map(|s| vec![*s])
                    .unwrap_or_default(),
            };
            reference::moe_block_bf16(
                s,
                &x[token * h..(token + 1) * h],
                1,
                &one,
                |e| self.expert(e),
                self.shared
                    .as_ref()
                    .map(|(gate_up, down)| ExpertRef { gate_up, down }),
            )
        });
        let mut y = Vec::with_capacity(t * h);
        let mut slack = Vec::with_capacity(t * h);
        for (row, row_slack) in rows {
            y.extend(row);
            slack.extend(row_slack);
        }
        (y, slack)
    }
}

/// What the routing check found.
struct RoutingReport {
    /// Tokens whose chosen set differs from the reference only between near-tied experts.
    near_ties: usize,
    /// Distinct experts chosen.
    distinct: usize,
    /// The most tokens one expert got.
    max_count: usize,
}

/// Checks the GPU's routing against the reference (module docs); panics with the token, the
/// experts and the logits on a disagreement.
fn check_routing(
    test: &str,
    r: &Reference<'_>,
    x: &[f32],
    t: usize,
    gpu: &Routing,
) -> RoutingReport {
    let s = r.host.shape;
    let (e_count, k, h) = (s.experts, s.top_k, s.hidden);
    let (logits, scales) = r.logits(x, t);
    let want = reference::route(s, x, t, &r.router, r.gate.as_deref());
    assert_eq!(gpu.experts.len(), t * k, "{test}: routing size");
    let mut counts = vec![0usize; e_count];
    let mut near_ties = 0;
    for token in 0..t {
        let l = &logits[token * e_count..(token + 1) * e_count];
        // fp32 accumulation of H products: ~sqrt(H) * 2^-24 of their absolute sum typically,
        // H * 2^-24 at worst; 1e-4 of it sits well above the typical and below the worst case
        let tie_tolerance = 1e-4 * scales[token];
        let got = &gpu.experts[token * k..(token + 1) * k];
        let got_w = &gpu.weights[token * k..(token + 1) * k];
        let want_ids = &want.experts[token * k..(token + 1) * k];
        let context = || {
            let show = |ids: &[u32]| -> String {
                ids.iter()
                    .map(|&e| format!("{e}({:.6})", l.get(e as usize).copied().unwrap_or(f64::NAN)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            format!(
                "{test}: token {token}: GPU chose {} with weights {got_w:?}; reference {} (expert(logit))",
                show(got),
                show(want_ids)
            )
        };
        let mut sorted_got = got.to_vec();
        sorted_got.sort_unstable();
        sorted_got.dedup();
        assert!(
            sorted_got.len() == k && sorted_got.iter().all(|&e| (e as usize) < e_count),
            "{}: not k distinct expert ids",
            context()
        );
        let mut sorted_want = want_ids.to_vec();
        sorted_want.sort_unstable();
        if sorted_got != sorted_want {
            let mut ordered: Vec<f64> = l.to_vec();
            ordered.sort_by(|a, b| b.total_cmp(a));
            let boundary = (ordered[k - 1] + ordered[k]) / 2.0;
            for &e in sorted_got.iter().chain(&sorted_want) {
                let in_both = sorted_got.contains(&e) && sorted_want.contains(&e);
                assert!(
                    in_both || (l[e as usize] - boundary).abs() <= tie_tolerance,
                    "{}: expert {e} differs and its logit is {:.3e} from the k-th boundary (near-tie tolerance {tie_tolerance:.1e})",
                    context(),
                    (l[e as usize] - boundary).abs()
                );
            }
            near_ties += 1;
        }
        // weights: the reference softmax over the GPU's experts, renormalised
        let top = got
            .iter()
            .map(|&e| l[e as usize])
            .fold(f64::NEG_INFINITY, f64::max);
        let mass: f64 = got.iter().map(|&e| (l[e as usize] - top).exp()).sum();
        let sum: f32 = got_w.iter().sum();
        assert!(
            (sum - 1.0).abs() < 1e-5,
            "{}: weights sum to {sum}",
            context()
        );
        assert!(
            got_w.windows(2).all(|p| p[0] >= p[1] - 1e-6),
            "{}: weights do not descend",
            context()
        );
        for (&e, &w) in got.iter().zip(got_w) {
            let expected = (l[e as usize] - top).exp() / mass;
            assert!(
                (f64::from(w) - expected).abs() <= 2.0 * tie_tolerance * expected + 1e-6,
                "{}: expert {e} weight {w} vs reference {expected}",
                context()
            );
            counts[e as usize] += 1;
        }
        if let Some(gate) = &r.gate {
            let xt = &x[token * h..(token + 1) * h];
            let (logit, abs) = xt
                .iter()
                .zip(gate)
                .fold((0.0f64, 0.0f64), |(l, a), (x, g)| {
                    let p = f64::from(*x) * f64::from(*g);
                    (l + p, a + p.abs())
                });
            let scale = 1.0 / (1.0 + (-logit).exp());
            let got = gpu.shared_scale[token];
            // the gate logit carries the router's fp32 error; sigmoid's slope is at most 1/4
            let tolerance = 0.25 * 1e-4 * abs + 1e-6;
            assert!(
                (f64::from(got) - scale).abs() <= tolerance,
                "{test}: token {token}: shared expert scale {got} vs reference {scale} (tolerance {tolerance:.1e})"
            );
        }
    }
    RoutingReport {
        near_ties,
        distinct: counts.iter().filter(|&&c| c > 0).count(),
        max_count: counts.iter().copied().max().unwrap_or(0),
    }
}

/// One input case of a block test.
struct Case {
    /// Tokens.
    t: usize,
    /// `[t][H]` bf16 input.
    x: Vec<bf16>,
    /// Add a random residual.
    residual: bool,
}

/// What one case produced on the device.
struct Outcome {
    routing: Routing,
    y: Vec<bf16>,
}

/// Runs every case through `moe_block` on the device (one workspace, sized for the largest
/// case) and checks routing and output.
fn check_block(
    test: &str,
    backend: &Backend,
    host: &MoeHostWeights,
    cases: &[Case],
    rng: &mut SplitMix64,
) -> Vec<Outcome> {
    let s = host.shape;
    let weights = MoeWeights::new(backend, host).expect("upload MoE weights");
    let capacity = cases.iter().map(|c| c.t).max().unwrap_or(1);
    let mut workspace = MoeWorkspace::new(backend, &weights, capacity).expect("workspace");
    let reference = Reference::new(host);
    let mut outcomes = Vec::new();
    for case in cases {
        let (t, h) = (case.t, s.hidden);
        let x_dev = backend.upload(&case.x).expect("upload X");
        let residual: Option<Vec<bf16>> = case.residual.then(|| uniform_bf16(rng, t * h, 1.0));
        let residual_dev = residual
            .as_ref()
            .map(|r| backend.upload(r).expect("upload residual"));
        // the persistent and split forms run the same items and combine in the same order:
        // equal bits; so do the streaming and bulk forms (where the target has them) wherever
        // the split form sums each down tile in one warp too (above moe.wide_max_tokens)
        let target = backend.target().expect("a device backend");
        let launches = MoeLaunch::forms(target);
        let wide_max = target.moe.wide_max_tokens as usize;
        let mut outputs = Vec::new();
        for &launch in launches {
            let mut y = poisoned(backend, t * h);
            moe::moe_block_with(
                backend,
                &weights,
                &x_dev,
                t,
                residual_dev.as_ref(),
                &mut workspace,
                &mut y,
                launch,
            )
            .unwrap_or_else(|e| panic!("{test} T={t} {launch:?}: {e}"));
            outputs.push(
                backend
                    .download(&y)
                    .unwrap_or_else(|e| panic!("{test} T={t} {launch:?}: {e}")),
            );
        }
        // the streaming and bulk forms (where the target has them), after persistent and split
        let later: Vec<(MoeLaunch, Vec<bf16>)> = launches[2..]
            .iter()
            .copied()
            .zip(outputs.split_off(2))
            .collect();
        let got = outputs.swap_remove(0);
        let differing = got
            .iter()
            .zip(&outputs[0])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "{test} T={t}: the split launches differ from the persistent one in {differing} values"
        );
        let x: Vec<f32> = case.x.iter().map(|v| v.to_f32()).collect();
        let label = format!("{test} {:?} T={t}", weights.format());
        let routing = workspace.routing(backend).expect("routing");
        let report = check_routing(&label, &reference, &x, t, &routing);
        println!(
            "{label}: {} distinct experts (at most {} tokens on one), {} near ties",
            report.distinct, report.max_count, report.near_ties
        );
        let (mut want, slack) = reference.block(&x, t, &routing);
        if let Some(r) = &residual {
            for (w, r) in want.iter_mut().zip(r) {
                *w += r.to_f32();
            }
        }
        let agreement = compare::compare_bf16_with_slack(&got, &want, &slack);
        let (worst, _) = agreement.worst;
        let (token, column) = (worst / h, worst % h);
        println!("{label}: {agreement}");
        if !agreement.passed() {
            print_token_errors(&label, &got, &want, h);
        }
        assert!(
            agreement.passed(),
            "{label}{}: {agreement}; worst at token {token} column {column}: got {} want {} (experts {:?})",
            if residual.is_some() { " +residual" } else { "" },
            got[worst],
            want[worst],
            &routing.experts[token * s.top_k..(token + 1) * s.top_k]
        );
        for (launch, y) in &later {
            let agreement = compare::compare_bf16_with_slack(y, &want, &slack);
            println!("{label} {launch:?}: {agreement}");
            if !agreement.passed() {
                print_token_errors(&format!("{label} {launch:?}"), y, &want, h);
            }
            assert!(agreement.passed(), "{label} {launch:?}: {agreement}");
            if t > wide_max {
                let differing = y
                    .iter()
                    .zip(&got)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differing, 0,
                    "{label}: the {launch:?} form differs from the persistent one in {differing} values"
                );
            }
        }
        outcomes.push(Outcome { routing, y: got });
    }
    outcomes
}

/// On a failure: whether the error is one element or a whole token row (a wrong activation of
/// one (token, expert) slot shows up across every column of that token), for the tokens with the
/// largest errors relative to their row's size.
fn print_token_errors(label: &str, got: &[bf16], want: &[f32], h: usize) {
    let mut rows: Vec<(usize, f64, f64)> = got
        .chunks(h)
        .zip(want.chunks(h))
        .enumerate()
        .map(|(token, (g, w))| {
            let (mut e2, mut w2, mut worst) = (0.0f64, 0.0f64, 0.0f64);
            for (g, w) in g.iter().zip(w) {
                let err = (g.to_f64() - *w as f64).abs();
                let rounding = (*w as f64).abs() / 256.0;
                e2 += err * err;
                w2 += (*w as f64).powi(2);
                worst = worst.max(err - rounding);
            }
            (token, (e2 / w2.max(f64::MIN_POSITIVE)).sqrt(), worst)
        })
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    for (token, rel, worst) in rows.iter().take(4) {
        println!(
            "{label}: token {token}: row rel L2 {rel:.2e}, largest error beyond bf16 rounding {worst:.3e}"
        );
    }
    let mut rels: Vec<f64> = rows.iter().map(|r| r.1).collect();
    rels.sort_by(f64::total_cmp);
    println!(
        "{label}: median row rel L2 {:.2e} over {} tokens",
        rels[rels.len() / 2],
        rels.len()
    );
}

fn random_cases(rng: &mut SplitMix64, hidden: usize, tokens: &[usize]) -> Vec<Case> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| Case {
            t,
            x: uniform_bf16(rng, t * hidden, 1.0),
            residual: i % 2 == 1,
        })
        .collect()
}

#[test]
fn moe_nvfp4_qwen_shape() {
    for backend in devices("moe_nvfp4_qwen_shape") {
        let mut rng = rng("moe_nvfp4_qwen_shape");
        let host = random_block(rng.next_u64(), QWEN, ExpertFormat::Nvfp4, true);
        let cases = random_cases(&mut rng, QWEN.hidden, &TOKENS);
        check_block("moe_nvfp4_qwen_shape", backend, &host, &cases, &mut rng);
    }
}

#[test]
fn moe_bf16_qwen_shape() {
    for backend in devices("moe_bf16_qwen_shape") {
        let mut rng = rng("moe_bf16_qwen_shape");
        let host = random_block(rng.next_u64(), QWEN, ExpertFormat::Bf16, true);
        let cases = random_cases(&mut rng, QWEN.hidden, &TOKENS);
        check_block("moe_bf16_qwen_shape", backend, &host, &cases, &mut rng);
    }
}

/// Every token's top-k is the same k experts (their router rows and one input column make their
/// logits 24 above the rest): each of them gets all T tokens (up to 512: many passes), the other
/// experts none. The others' weights are poisoned (bf16 NaN; NVFP4 an overflowing scale), so
/// reading them would show in the output.
#[test]
fn moe_every_token_to_the_same_experts() {
    let test = "moe_every_token_to_the_same_experts";
    for backend in devices(test) {
        let mut rng = rng(test);
        let chosen: Vec<u32> = vec![3, 77, 78, 130, 200, 201, 254, 255];
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
            let mut host = random_block(rng.next_u64(), QWEN, format, true);
            let h = QWEN.hidden;
            for e in 0..QWEN.experts {
                let boost = if chosen.contains(&(e as u32)) {
                    3.0
                } else {
                    0.0
                };
                host.router[e * h] = bf16::from_f32(boost);
                if !chosen.contains(&(e as u32)) {
                    match &mut host.experts[e] {
                        ExpertWeights::Bf16 { gate_up, down } => {
                            gate_up.fill(bf16::NAN);
                            down.fill(bf16::NAN);
                        }
                        ExpertWeights::Nvfp4 { gate, up, down } => {
                            for m in [gate, up, down] {
                                m.global_scale = f32::MAX;
                            }
                        }
                    }
                }
            }
            let mut cases = random_cases(&mut rng, h, &[5, 512]);
            for case in &mut cases {
                for token in 0..case.t {
                    case.x[token * h] = bf16::from_f32(8.0);
                }
            }
            let outcomes = check_block(test, backend, &host, &cases, &mut rng);
            for (case, outcome) in cases.iter().zip(&outcomes) {
                for token in 0..case.t {
                    let mut got = outcome.routing.experts[token * 8..(token + 1) * 8].to_vec();
                    got.sort_unstable();
                    assert_eq!(got, chosen, "{test} {format:?} T={} token {token}", case.t);
                }
            }
        }
    }
}

/// Token 0 alone is routed to expert 123 (one input column pushes its logit up by 24 for token
/// 0 and down by 24 for the others); most other experts get one or no token at T = 64.
#[test]
fn moe_an_expert_with_exactly_one_token() {
    let test = "moe_an_expert_with_exactly_one_token";
    for backend in devices(test) {
        let mut rng = rng(test);
        let (h, lonely) = (QWEN.hidden, 123usize);
        let mut host = random_block(rng.next_u64(), QWEN, ExpertFormat::Nvfp4, true);
        for e in 0..QWEN.experts {
            host.router[e * h + 1] = bf16::from_f32(if e == lonely { 3.0 } else { 0.0 });
        }
        let mut cases = random_cases(&mut rng, h, &[64]);
        for token in 0..64 {
            cases[0].x[token * h + 1] = bf16::from_f32(if token == 0 { 8.0 } else { -8.0 });
        }
        let outcomes = check_block(test, backend, &host, &cases, &mut rng);
        let routing = &outcomes[0].routing;
        let count = routing
            .experts
            .iter()
            .filter(|&&e| e as usize == lonely)
            .count();
        assert_eq!(count, 1, "{test}: expert {lonely} got {count} tokens");
        assert!(routing.experts[..8].contains(&(lonely as u32)));
    }
}

/// Qwen3-Next: 512 experts, top-10 (NVFP4 at its real size; bf16 smaller, with a shared expert
/// twice the routed width, i.e. two sub-experts).
#[test]
fn moe_e512_k10() {
    let test = "moe_e512_k10";
    for backend in devices(test) {
        let mut rng = rng(test);
        let next = shape(512, 10, 2048, 512, 512);
        let host = random_block(rng.next_u64(), next, ExpertFormat::Nvfp4, true);
        let cases = random_cases(&mut rng, next.hidden, &[1, 7, 64]);
        check_block(test, backend, &host, &cases, &mut rng);
        let small = shape(512, 10, 1024, 256, 512);
        let host = random_block(rng.next_u64(), small, ExpertFormat::Bf16, true);
        let cases = random_cases(&mut rng, small.hidden, &[1, 16]);
        check_block(test, backend, &host, &cases, &mut rng);
    }
}

/// E = 8, k = 2 at awkward sizes: H = 272 and I = 48 (K not a multiple of 64), Is = 80 (a padded
/// second sub-expert); without a shared-expert gate (scale 1) and without a shared expert. Then
/// 100 tokens through a 40-token workspace (three launches, split form) give the same bits as
/// one persistent launch: every token's routing and output depend on that token only (the split
/// and persistent forms sum alike; the streaming form is checked against the reference).
#[test]
fn moe_e8_k2_awkward() {
    let test = "moe_e8_k2_awkward";
    for backend in devices(test) {
        let mut rng = rng(test);
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
            for (s, gate) in [
                (shape(8, 2, 272, 48, 80), true),
                (shape(8, 2, 272, 48, 80), false),
                (shape(8, 2, 272, 48, 0), false),
            ] {
                let host = random_block(rng.next_u64(), s, format, gate);
                // the 100-token case is at an even index: no residual
                let cases = random_cases(&mut rng, s.hidden, &[1, 7, 100, 33]);
                let outcomes = check_block(test, backend, &host, &cases, &mut rng);
                let weights = MoeWeights::new(backend, &host).expect("weights");
                let mut small = MoeWorkspace::new(backend, &weights, 40).expect("workspace");
                let case = &cases[2];
                let x = backend.upload(&case.x).expect("x");
                let mut y = poisoned(backend, case.t * s.hidden);
                moe::moe_block_with(
                    backend,
                    &weights,
                    &x,
                    case.t,
                    None,
                    &mut small,
                    &mut y,
                    MoeLaunch::Split,
                )
                .expect("three launches");
                let chunked = backend.download(&y).expect("y");
                let differ = chunked
                    .iter()
                    .zip(&outcomes[2].y)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ, 0,
                    "{test} {format:?} {s:?}: 3 launches of at most 40 tokens differ from one of 100 in {differ} elements"
                );
            }
        }
    }
}

/// Exact router ties: all rows equal but a few, so the GPU must pick exactly the reference's
/// experts in its order (lower id first among equal logits).
#[test]
fn moe_router_ties_go_to_the_lower_id() {
    let test = "moe_router_ties_go_to_the_lower_id";
    for backend in devices(test) {
        let mut rng = rng(test);
        let s = shape(256, 8, 2048, 64, 64);
        let mut host = random_block(rng.next_u64(), s, ExpertFormat::Bf16, true);
        let h = s.hidden;
        let common: Vec<bf16> = host.router[..h].to_vec();
        let best: Vec<bf16> = common
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() * 2.0))
            .collect();
        for e in 0..s.experts {
            // 250, 7 and 3 tie for the top; 100 alone after them; all others tie below
            let row = match e {
                3 | 7 | 250 => &best,
                _ => &common,
            };
            host.router[e * h..(e + 1) * h].copy_from_slice(row);
        }
        for v in &mut host.router[100 * h..101 * h] {
            *v = bf16::from_f32(v.to_f32() * 1.5);
        }
        // inputs aligned with the common row, so the ordering above holds for every token
        let mut cases = random_cases(&mut rng, h, &[4]);
        for token in 0..4 {
            for (slot, c) in cases[0].x[token * h..(token + 1) * h]
                .iter_mut()
                .zip(&common)
            {
                *slot = bf16::from_f32(c.to_f32() * 30.0 + 0.1 * rng.normal());
            }
        }
        let outcomes = check_block(test, backend, &host, &cases, &mut rng);
        let x: Vec<f32> = cases[0].x.iter().map(|v| v.to_f32()).collect();
        let router: Vec<f32> = host.router.iter().map(|v| v.to_f32()).collect();
        let gate: Vec<f32> = host
            .shared_gate
            .as_ref()
            .expect("gate")
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let want = reference::route(s, &x, 4, &router, Some(&gate));
        for token in 0..4 {
            assert_eq!(
                &outcomes[0].routing.experts[token * 8..(token + 1) * 8],
                &want.experts[token * 8..(token + 1) * 8],
                "{test}: token {token} (reference: 3 7 250 100 0 1 2 4)"
            );
        }
        assert_eq!(&want.experts[..8], &[3, 7, 250, 100, 0, 1, 2, 4]);
    }
}

/// Two launches give the same bits (the combine adds in slot order, split K in warp order).
#[test]
fn moe_is_deterministic() {
    let test = "moe_is_deterministic";
    for backend in devices(test) {
        let mut rng = rng(test);
        let host = random_block(rng.next_u64(), QWEN, ExpertFormat::Nvfp4, true);
        let weights = MoeWeights::new(backend, &host).expect("weights");
        let mut workspace = MoeWorkspace::new(backend, &weights, 64).expect("workspace");
        for t in [1, 64] {
            let x = backend
                .upload(&uniform_bf16(&mut rng, t * QWEN.hidden, 1.0))
                .expect("x");
            let mut outputs = Vec::new();
            for _ in 0..2 {
                let mut y = poisoned(backend, t * QWEN.hidden);
                moe::moe_block(backend, &weights, &x, t, None, &mut workspace, &mut y)
                    .expect("moe_block");
                outputs.push(backend.download(&y).expect("y"));
            }
            let differ = outputs[0]
                .iter()
                .zip(&outputs[1])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "{test} T={t}: two launches differ in {differ} elements"
            );
        }
    }
}
