//! The MoE reference against an independent dense formulation (every expert evaluated, the top-k
//! chosen by rank counting instead of sorting), its routing rules (ties to the lower expert id,
//! renormalised softmax weights), at E = 8 k = 2 (tiny) and E = 512 k = 10 (Qwen3-Next).

use fp4spec::kernels::moe::reference::{self as moe, ExpertRef, MoeShape, Routing};
use fp4spec::rng::SplitMix64;

/// Random weights of one block: router `[E][H]`, shared gate `[H]`, experts and shared expert.
struct Block {
    shape: MoeShape,
    router: Vec<f32>,
    shared_gate: Vec<f32>,
    gate_up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
    shared_gate_up: Vec<f32>,
    shared_down: Vec<f32>,
}

impl Block {
    fn random(rng: &mut SplitMix64, shape: MoeShape) -> Self {
        let (e, h, i, s) = (
            shape.experts,
            shape.hidden,
            shape.intermediate,
            shape.shared_intermediate,
        );
        Self {
            shape,
            router: rng.normal_vec(e * h, 0.5),
            shared_gate: rng.normal_vec(h, 0.3),
            gate_up: (0..e).map(|_| rng.normal_vec(2 * i * h, 0.3)).collect(),
            down: (0..e).map(|_| rng.normal_vec(h * i, 0.3)).collect(),
            shared_gate_up: rng.normal_vec(2 * s * h, 0.3),
            shared_down: rng.normal_vec(h * s, 0.3),
        }
    }

    fn expert(&self, e: usize) -> ExpertRef<'_> {
        ExpertRef {
            gate_up: &self.gate_up[e],
            down: &self.down[e],
        }
    }

    fn shared(&self) -> Option<ExpertRef<'_>> {
        (self.shape.shared_intermediate > 0).then(|| ExpertRef {
            gate_up: &self.shared_gate_up,
            down: &self.shared_down,
        })
    }
}

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

/// The dense formulation: softmax over all experts by log-sum-exp, expert `e` kept when fewer
/// than k experts beat it (a higher probability, or an equal one and a lower id), its weight the
/// probability over the kept mass; the output is the sum over ALL experts of weight * MLP, with
/// every matrix product written out in f64.
fn dense_block(b: &Block, x: &[f32], t: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let MoeShape {
        experts,
        top_k,
        hidden: h,
        intermediate: i,
        shared_intermediate: s,
    } = b.shape;
    let mlp = |xt: &[f32], gate_up: &[f32], down: &[f32], inter: usize| -> Vec<f64> {
        let row = |r: usize| -> f64 {
            (0..h)
                .map(|c| f64::from(gate_up[r * h + c]) * f64::from(xt[c]))
                .sum()
        };
        let act: Vec<f64> = (0..inter)
            .map(|j| {
                let (g, u) = (row(j), row(inter + j));
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        (0..h)
            .map(|r| {
                (0..inter)
                    .map(|j| f64::from(down[r * inter + j]) * act[j])
                    .sum()
            })
            .collect()
    };
    let mut y = vec![0.0f64; t * h];
    let mut weights = Vec::new();
    for token in 0..t {
        let xt = &x[token * h..(token + 1) * h];
        let logits: Vec<f64> = (0..experts)
            .map(|e| {
                (0..h)
                    .map(|c| f64::from(b.router[e * h + c]) * f64::from(xt[c]))
                    .sum()
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let log_total = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        let p: Vec<f64> = logits.iter().map(|l| (l - log_total).exp()).collect();
        let kept: Vec<bool> = (0..experts)
            .map(|e| {
                let beaten_by = (0..experts)
                    .filter(|&o| p[o] > p[e] || (p[o] == p[e] && o < e))
                    .count();
                beaten_by < top_k
            })
            .collect();
        let mass: f64 = (0..experts).filter(|&e| kept[e]).map(|e| p[e]).sum();
        let w: Vec<f64> = (0..experts)
            .map(|e| if kept[e] { p[e] / mass } else { 0.0 })
            .collect();
        for e in 0..experts {
            let out = mlp(xt, &b.gate_up[e], &b.down[e], i);
            for (dst, v) in y[token * h..(token + 1) * h].iter_mut().zip(out) {
                *dst += w[e] * v;
            }
        }
        if s > 0 {
            let gate: f64 = (0..h)
                .map(|c| f64::from(b.shared_gate[c]) * f64::from(xt[c]))
                .sum();
            let scale = 1.0 / (1.0 + (-gate).exp());
            let out = mlp(xt, &b.shared_gate_up, &b.shared_down, s);
            for (dst, v) in y[token * h..(token + 1) * h].iter_mut().zip(out) {
                *dst += scale * v;
            }
        }
        weights.push(w);
    }
    (y, weights)
}

fn route(b: &Block, x: &[f32], t: usize) -> Routing {
    let gate = (b.shape.shared_intermediate > 0).then_some(b.shared_gate.as_slice());
    moe::route(b.shape, x, t, &b.router, gate)
}

/// The reference block and the dense formulation agree on the routing and on the output.
fn check_against_dense(shape: MoeShape, t: usize, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let b = Block::random(&mut rng, shape);
    let x = rng.normal_vec(t * shape.hidden, 1.0);
    let routing = route(&b, &x, t);
    let y = moe::moe_block(shape, &x, t, &routing, |e| b.expert(e), b.shared());
    let (want, dense_weights) = dense_block(&b, &x, t);
    let k = shape.top_k;
    for token in 0..t {
        let experts = &routing.experts[token * k..(token + 1) * k];
        let kept: Vec<u32> = (0..shape.experts as u32)
            .filter(|&e| dense_weights[token][e as usize] > 0.0)
            .collect();
        let mut sorted = experts.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, kept, "token {token}: experts chosen");
        for (slot, &e) in experts.iter().enumerate() {
            let (got, want) = (
                routing.weights[token * k + slot],
                dense_weights[token][e as usize],
            );
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * want.max(1e-3),
                "token {token} expert {e}: weight {got} vs dense {want}"
            );
        }
    }
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    for (index, (&got, &want)) in y.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(got) - want).abs() <= 1e-5 * scale,
            "{shape:?} T={t}: y[{}][{}] = {got}, dense {want}",
            index / shape.hidden,
            index % shape.hidden
        );
    }
}

#[test]
fn block_matches_the_dense_mixture_e8_k2() {
    check_against_dense(shape(8, 2, 48, 16, 32), 7, 1);
}

#[test]
fn block_matches_the_dense_mixture_e512_k10() {
    check_against_dense(shape(512, 10, 32, 16, 16), 3, 2);
}

#[test]
fn block_matches_the_dense_mixture_without_a_shared_expert() {
    check_against_dense(shape(8, 2, 32, 16, 0), 4, 3);
}

#[test]
fn router_ties_go_to_the_lower_expert_id() {
    let s = shape(8, 2, 4, 4, 0);
    let x = [1.0f32, 0.5, -0.25, 2.0];
    // every router row equal: all probabilities tie, so experts 0 and 1, in that order
    let router = vec![0.5f32; 8 * 4];
    let r = moe::route(s, &x, 1, &router, None);
    assert_eq!(r.experts, [0, 1]);
    assert_eq!(r.weights, [0.5, 0.5]);
    // rows 6 and 3 equal and best, row 5 alone third: 3 before 6 (lower id first among equals)
    let mut router = vec![0.0f32; 8 * 4];
    router[6 * 4..7 * 4].copy_from_slice(&[1.0, 1.0, 1.0, 1.0]);
    router[3 * 4..4 * 4].copy_from_slice(&[1.0, 1.0, 1.0, 1.0]);
    router[5 * 4..6 * 4].copy_from_slice(&[0.5, 0.5, 0.5, 0.5]);
    let r = moe::route(s, &x, 1, &router, None);
    assert_eq!(r.experts, [3, 6]);
    // the best expert alone, then a tie between 2 and 7 for the second place: 2
    let mut router = vec![0.0f32; 8 * 4];
    router[4 * 4] = 3.0;
    router[7 * 4] = 1.0;
    router[2 * 4] = 1.0;
    let r = moe::route(s, &x, 1, &router, None);
    assert_eq!(r.experts, [4, 2]);
}

#[test]
fn weights_are_the_renormalised_softmax_in_descending_order() {
    let s = shape(64, 8, 24, 8, 8);
    let mut rng = SplitMix64::new(4);
    let b = Block::random(&mut rng, s);
    let t = 5;
    let x = rng.normal_vec(t * s.hidden, 1.0);
    let r = route(&b, &x, t);
    assert_eq!(r.experts.len(), t * 8);
    assert_eq!(r.shared_scale.len(), t);
    for token in 0..t {
        let w = &r.weights[token * 8..(token + 1) * 8];
        let e = &r.experts[token * 8..(token + 1) * 8];
        let sum: f32 = w.iter().sum();
        assert!(
            (sum - 1.0).abs() < 1e-6,
            "token {token}: weights sum to {sum}"
        );
        assert!(w.windows(2).all(|p| p[0] >= p[1]), "token {token}: {w:?}");
        let xt = &x[token * s.hidden..(token + 1) * s.hidden];
        let logit = |e: u32| -> f64 {
            let row = &b.router[e as usize * s.hidden..(e as usize + 1) * s.hidden];
            row.iter()
                .zip(xt)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum()
        };
        // w_i / w_j = exp(l_i - l_j): the softmax normaliser cancels in the renormalisation
        for j in 1..8 {
            let ratio = f64::from(w[0]) / f64::from(w[j]);
            let want = (logit(e[0]) - logit(e[j])).exp();
            assert!(
                (ratio / want - 1.0).abs() < 1e-5,
                "token {token}: w0/w{j} = {ratio}, exp(l0 - l{j}) = {want}"
            );
        }
        let gate: f64 = b
            .shared_gate
            .iter()
            .zip(xt)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let scale = 1.0 / (1.0 + (-gate).exp());
        assert!((f64::from(r.shared_scale[token]) - scale).abs() < 1e-6);
    }
}

#[test]
fn a_shared_expert_without_a_gate_has_scale_one() {
    let s = shape(8, 2, 32, 8, 8);
    let mut rng = SplitMix64::new(5);
    let b = Block::random(&mut rng, s);
    let x = rng.normal_vec(2 * s.hidden, 1.0);
    let routing = moe::route(s, &x, 2, &b.router, None);
    assert!(routing.shared_scale.is_empty());
    let y = moe::moe_block(s, &x, 2, &routing, |e| b.expert(e), b.shared());
    for token in 0..2 {
        let xt = &x[token * s.hidden..(token + 1) * s.hidden];
        let mut want = vec![0.0f64; s.hidden];
        for slot in 0..2 {
            let e = routing.experts[token * 2 + slot] as usize;
            let w = f64::from(routing.weights[token * 2 + slot]);
            moe::expert_mlp_accumulate(xt, b.expert(e), s.intermediate, w, &mut want);
        }
        moe::expert_mlp_accumulate(xt, b.shared().expect("shared"), 8, 1.0, &mut want);
        for (got, want) in y[token * s.hidden..(token + 1) * s.hidden]
            .iter()
            .zip(&want)
        {
            assert!((f64::from(*got) - want).abs() <= 1e-6 * want.abs().max(1.0));
        }
    }
}
