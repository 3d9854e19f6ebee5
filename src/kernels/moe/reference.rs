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
    expert_mlp(x, expert, intermediate, scale, out, |_, gate, up, _, _| {
        gate * sigmoid(gate) * up
    });
}

/// The expert MLP with each activation given by `activation(i, gate, up, gate_row, up_row)`
/// from the exact gate and up sums of row `i`.
fn expert_mlp(
    x: &[f32],
    expert: ExpertRef<'_>,
    intermediate: usize,
    scale: f64,
    out: &mut [f64],
    mut activation: impl FnMut(usize, f64, f64, &[f32], &[f32]) -> f64,
) {
    let h = x.len();
    let act: Vec<f64> = (0..intermediate)
        .map(|i| {
            let gate_row = &expert.gate_up[i * h..(i + 1) * h];
            let up_row = &expert.gate_up[(intermediate + i) * h..(intermediate + i + 1) * h];
            activation(i, dot(x, gate_row), dot(x, up_row), gate_row, up_row)
        })
        .collect();
    for (row, slot) in out.iter_mut().enumerate() {
        let w = &expert.down[row * intermediate..(row + 1) * intermediate];
        let y: f64 = w.iter().zip(&act).map(|(&w, &a)| w as f64 * a).sum();
        *slot += scale * y;
    }
}

/// How far a kernel's fp32 sum over H products may sit from the exact one, relative to the
/// absolute sum of the products. Rounding errors of 2^-24 per addition on partial sums that grow
/// like the running sum leave about 2^-24 of it; 2^-14 is far wider (at H = 2048 it lets most
/// activations round either way: the slack then amounts to one bf16 step per activation), and
/// it is what the H200 checks ran with (2026-12-03: the seeds that had failed pass at <= 0.36 of
/// their bounds); a tighter value is untested on a GPU.
const FP32_SUM_ERROR: f64 = 1.0 / 16384.0;

/// [`expert_mlp_accumulate`] with every activation `silu(gate) * up` rounded to bf16 as the GPU
/// kernels do (round to nearest even, [`crate::formats::bf16::round_f64`]). An activation whose
/// exact value lies so close to a bf16 rounding midpoint that the kernel's fp32 gate and up sums
/// (within `FP32_SUM_ERROR` of their absolute sums) may round it the other way adds
/// `|scale| |down[row][i]|` times the gap between its two possible values to `slack[row]`: the
/// output's legitimate disagreement beyond the reference's own rounding.
pub fn expert_mlp_accumulate_bf16(
    x: &[f32],
    expert: ExpertRef<'_>,
    intermediate: usize,
    scale: f64,
    out: &mut [f64],
    slack: &mut [f64],
) {
    use crate::formats::bf16::round_f64;
    let to_f64 = |v: f64| f64::from(round_f64(v).to_f32());
    let abs_dot = |w: &[f32]| -> f64 {
        x.iter()
            .zip(w)
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum()
    };
    let down = expert.down;
    expert_mlp(
        x,
        expert,
        intermediate,
        scale,
        out,
        |i, gate, up, gate_row, up_row| {
            let sig = sigmoid(gate);
            let exact = gate * sig * up;
            // d(silu(g) u) = silu'(g) u dg + silu(g) du
            let d_silu = sig * (1.0 + gate * (1.0 - sig));
            let reach = FP32_SUM_ERROR
                * ((d_silu * up).abs() * abs_dot(gate_row) + (gate * sig).abs() * abs_dot(up_row));
            let (low, high) = (to_f64(exact - reach), to_f64(exact + reach));
            if low != high {
                let gap = (high - low) * scale.abs();
                for (row, s) in slack.iter_mut().enumerate() {
                    *s += gap * f64::from(down[row * intermediate + i].abs());
                }
            }
            to_f64(exact)
        },
    );
}

/// Each token's output: `accumulate(token, x_token, expert, intermediate, scale, acc)` over its
/// routed experts (scale: the routing weight) and the shared expert (scale: its gate), in f64.
fn block<'a>(
    shape: MoeShape,
    x: &[f32],
    t: usize,
    routing: &Routing,
    expert: impl Fn(usize) -> ExpertRef<'a>,
    shared: Option<ExpertRef<'_>>,
    mut accumulate: impl FnMut(usize, &[f32], ExpertRef<'_>, usize, f64, &mut [f64]),
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
            accumulate(token, xt, expert(e), shape.intermediate, w, &mut acc);
        }
        if let Some(shared) = shared {
            let scale = routing.shared_scale.get(token).copied().unwrap_or(1.0) as f64;
            accumulate(
                token,
                xt,
                shared,
                shape.shared_intermediate,
                scale,
                &mut acc,
            );
        }
        for (dst, &v) in y[token * h..(token + 1) * h].iter_mut().zip(&acc) {
            *dst = v as f32;
        }
    }
    y
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
    block(
        shape,
        x,
        t,
        routing,
        expert,
        shared,
        |_, xt, e, i, scale, acc| expert_mlp_accumulate(xt, e, i, scale, acc),
    )
}

/// [`moe_block`] as the GPU kernels compute it, activations rounded to bf16
/// ([`expert_mlp_accumulate_bf16`]): the output, and per output element the slack from
/// activations whose rounding the kernel's fp32 sums may turn the other way.
pub fn moe_block_bf16<'a>(
    shape: MoeShape,
    x: &[f32],
    t: usize,
    routing: &Routing,
    expert: impl Fn(usize) -> ExpertRef<'a>,
    shared: Option<ExpertRef<'_>>,
) -> (Vec<f32>, Vec<f64>) {
    let h = shape.hidden;
    let mut slack = vec![0.0f64; t * h];
    let y = block(
        shape,
        x,
        t,
        routing,
        expert,
        shared,
        |token, xt, e, i, scale, acc| {
            let token_slack = &mut slack[token * h..(token + 1) * h];
            expert_mlp_accumulate_bf16(xt, e, i, scale, acc, token_slack)
        },
    );
    (y, slack)
}
