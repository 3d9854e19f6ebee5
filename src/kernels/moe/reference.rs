//! CPU reference of the `moe` family (../shared/reference/qwen3_5_moe.md, "Sparse MoE"): f64
//! accumulation, f32 at the interfaces.
//!
//! Layouts (row-major): activations `[T][H]`; router weight `[E][H]`; expert `e`'s fused
//! `gate_up` `[2I][H]` (rows `[gate I; up I]`) and `down` `[H][I]`; the shared expert's
//! `gate_up` `[2Is][H]` and `down` `[H][Is]`; the shared expert gate `[H]`.

/// Sizes of one MoE block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Routed experts (E).
    pub experts: usize,
    /// Experts per token (k).
    pub top_k: usize,
    /// Hidden size (H).
    pub hidden: usize,
    /// Routed expert intermediate size (I).
    pub intermediate: usize,
    /// Shared expert intermediate size (Is); 0 for a block without a shared expert.
    pub shared_intermediate: usize,
}

/// The router's decision for `T` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token (k).
    pub top_k: usize,
    /// `[T][k]` selected experts, most probable first (ties: the lower expert id first).
    pub experts: Vec<u32>,
    /// `[T][k]` their weights: the softmax probabilities renormalised to sum to 1 per token.
    pub weights: Vec<f32>,
    /// `[T]` the shared expert's scale, `sigmoid(shared_expert_gate . x)` (empty without a
    /// shared expert).
    pub shared_scale: Vec<f32>,
}

/// One expert's (or the shared expert's) weights, dense f32: `gate_up` `[2I][H]` with the gate
/// rows first, `down` `[H][I]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRef<'a> {
    /// `[2I][H]`, rows `[gate; up]`.
    pub gate_up: &'a [f32],
    /// `[H][I]`.
    pub down: &'a [f32],
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Routes `t` tokens of `x`: router logits `x . router[e]`, softmax over all `E` experts in f64,
/// the `k` largest (ties to the lower expert id), renormalised; and the shared expert's scale
/// when `shared_gate` (`[H]`) is given.
pub fn route(
    shape: MoeShape,
    x: &[f32],
    t: usize,
    router: &[f32],
    shared_gate: Option<&[f32]>,
) -> Routing {
    let (e_count, h, k) = (shape.experts, shape.hidden, shape.top_k);
    let mut experts = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    let mut shared_scale = Vec::new();
    for token in 0..t {
        let xt = &x[token * h..(token + 1) * h];
        let logits: Vec<f64> = (0..e_count)
            .map(|e| dot(xt, &router[e * h..(e + 1) * h]))
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = logits.iter().map(|&l| (l - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        let mut order: Vec<usize> = (0..e_count).collect();
        // stable sort by descending probability keeps the lower id first among equals
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
        let chosen = &order[..k];
        let mass: f64 = chosen.iter().map(|&e| exps[e] / total).sum();
        for &e in chosen {
            experts.push(e as u32);
            weights.push((exps[e] / total / mass) as f32);
        }
        if let Some(gate) = shared_gate {
            shared_scale.push(sigmoid(dot(xt, gate)) as f32);
        }
    }
    Routing {
        top_k: k,
        experts,
        weights,
        shared_scale,
    }
}

/// One expert's MLP on one token: `down (silu(gate x) * (up x))`, added into `out` (`[H]`)
/// times `scale`.
pub fn expert_mlp_accumulate(
    x: &[f32],
    expert: ExpertRef<'_>,
    intermediate: usize,
    scale: f64,
    out: &mut [f64],
) {
    expert_mlp_accumulate_with(x, expert, intermediate, scale, out, |act| act);
}

/// [`expert_mlp_accumulate`] with every activation `silu(gate) * up` passed through `round`
/// before the down projection (the GPU kernels round it to bf16, as the GEMM family's
/// `silu(gate) * up` epilogue does).
pub fn expert_mlp_accumulate_with(
    x: &[f32],
    expert: ExpertRef<'_>,
    intermediate: usize,
    scale: f64,
    out: &mut [f64],
    round: impl Fn(f64) -> f64,
) {
    let h = x.len();
    let act: Vec<f64> = (0..intermediate)
        .map(|i| {
            let gate = dot(x, &expert.gate_up[i * h..(i + 1) * h]);
            let up = dot(
                x,
                &expert.gate_up[(intermediate + i) * h..(intermediate + i + 1) * h],
            );
            round(gate * sigmoid(gate) * up)
        })
        .collect();
    for (row, slot) in out.iter_mut().enumerate() {
        let w = &expert.down[row * intermediate..(row + 1) * intermediate];
        let y: f64 = w.iter().zip(&act).map(|(&w, &a)| w as f64 * a).sum();
        *slot += scale * y;
    }
}

/// The whole block for `t` tokens: the weighted sum of each token's routed experts
/// (`expert(e)` gives expert `e`'s weights) plus the shared expert times its scale.
pub fn moe_block<'a>(
    shape: MoeShape,
    x: &[f32],
    t: usize,
    routing: &Routing,
    expert: impl Fn(usize) -> ExpertRef<'a>,
    shared: Option<ExpertRef<'_>>,
) -> Vec<f32> {
    moe_block_with(shape, x, t, routing, expert, shared, |act| act)
}

/// [`moe_block`] with every expert activation passed through `round`
/// ([`expert_mlp_accumulate_with`]).
pub fn moe_block_with<'a>(
    shape: MoeShape,
    x: &[f32],
    t: usize,
    routing: &Routing,
    expert: impl Fn(usize) -> ExpertRef<'a>,
    shared: Option<ExpertRef<'_>>,
    round: impl Fn(f64) -> f64 + Copy,
) -> Vec<f32> {
    let (h, k) = (shape.hidden, shape.top_k);
    let mut y = vec![0.0f32; t * h];
    let mut acc = vec![0.0f64; h];
    for token in 0..t {
        let xt = &x[token * h..(token + 1) * h];
        acc.fill(0.0);
        for slot in 0..k {
            let e = routing.experts[token * k + slot] as usize;
            let w = routing.weights[token * k + slot] as f64;
            expert_mlp_accumulate_with(xt, expert(e), shape.intermediate, w, &mut acc, round);
        }
        if let Some(shared) = shared {
            let scale = routing.shared_scale.get(token).copied().unwrap_or(1.0) as f64;
            expert_mlp_accumulate_with(
                xt,
                shared,
                shape.shared_intermediate,
                scale,
                &mut acc,
                round,
            );
        }
        for (dst, &v) in y[token * h..(token + 1) * h].iter_mut().zip(&acc) {
            *dst = v as f32;
        }
    }
    y
}
