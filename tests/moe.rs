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
        for (e, (gate_up, down)) in b.gate_up.iter().zip(&b.down).enumerate() {
            let out = mlp(xt, gate_up, down, i);
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
    for (token, dense) in dense_weights.iter().enumerate() {
        let experts = &routing.experts[token * k..(token + 1) * k];
        let kept: Vec<u32> = (0..shape.experts as u32)
            .filter(|&e| dense[e as usize] > 0.0)
            .collect();
        let mut sorted = experts.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, kept, "token {token}: experts chosen");
        for (slot, &e) in experts.iter().enumerate() {
            let (got, want) = (routing.weights[token * k + slot], dense[e as usize]);
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

// ---- the launch API on the CPU backend, the weights, their kernel layout and the loader ----

use fp4spec::Error;
use fp4spec::backend::Backend;
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::formats::safetensors::Checkpoint;
use fp4spec::kernels::gemm::TensorCore;
use fp4spec::kernels::moe::{
    self as family, ExpertFormat, ExpertWeights, FusedBlock, MoeHostWeights, MoeWeights,
    MoeWorkspace,
};
use half::bf16;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::Path;

fn bf16_vec(rng: &mut SplitMix64, len: usize, scale: f32) -> Vec<bf16> {
    rng.normal_vec(len, scale)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

fn nvfp4(rng: &mut SplitMix64, rows: usize, cols: usize, scale: f32) -> Nvfp4Matrix {
    let mut m = Nvfp4Matrix::quantize("random", &rng.normal_vec(rows * cols, scale), rows, cols)
        .expect("finite");
    m.input_scale = Some(0.01 + rng.uniform());
    m
}

fn nvfp4_expert(rng: &mut SplitMix64, h: usize, i: usize) -> ExpertWeights {
    ExpertWeights::Nvfp4 {
        gate: nvfp4(rng, i, h, 0.3),
        up: nvfp4(rng, i, h, 0.2),
        down: nvfp4(rng, h, i, 0.4),
    }
}

fn bf16_expert(rng: &mut SplitMix64, h: usize, i: usize) -> ExpertWeights {
    ExpertWeights::Bf16 {
        gate_up: bf16_vec(rng, 2 * i * h, 0.3),
        down: bf16_vec(rng, h * i, 0.3),
    }
}

/// A random block in `format` (the shared expert in `shared_format`).
fn host_block(
    rng: &mut SplitMix64,
    s: MoeShape,
    format: ExpertFormat,
    shared_format: ExpertFormat,
) -> MoeHostWeights {
    let make = |rng: &mut SplitMix64, f: ExpertFormat, inter: usize| match f {
        ExpertFormat::Nvfp4 => nvfp4_expert(rng, s.hidden, inter),
        ExpertFormat::Bf16 => bf16_expert(rng, s.hidden, inter),
    };
    let experts = (0..s.experts)
        .map(|_| make(rng, format, s.intermediate))
        .collect();
    let shared =
        (s.shared_intermediate > 0).then(|| make(rng, shared_format, s.shared_intermediate));
    MoeHostWeights {
        shape: s,
        router: bf16_vec(rng, s.experts * s.hidden, 0.5),
        shared_gate: shared.is_some().then(|| bf16_vec(rng, s.hidden, 0.3)),
        experts,
        shared,
    }
}

/// The reference on the host weights: routing and unrounded output.
fn reference_of(host: &MoeHostWeights, x: &[bf16], t: usize) -> (Routing, Vec<f32>) {
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let router: Vec<f32> = host.router.iter().map(|v| v.to_f32()).collect();
    let gate: Option<Vec<f32>> = host
        .shared_gate
        .as_ref()
        .map(|g| g.iter().map(|v| v.to_f32()).collect());
    let routing = moe::route(host.shape, &xf, t, &router, gate.as_deref());
    let dense: Vec<(Vec<f32>, Vec<f32>)> = host.experts.iter().map(|e| e.dense()).collect();
    let shared = host.shared.as_ref().map(|e| e.dense());
    let y = moe::moe_block(
        host.shape,
        &xf,
        t,
        &routing,
        |e| ExpertRef {
            gate_up: &dense[e].0,
            down: &dense[e].1,
        },
        shared
            .as_ref()
            .map(|(gate_up, down)| ExpertRef { gate_up, down }),
    );
    (routing, y)
}

fn run_cpu(
    host: &MoeHostWeights,
    x: &[bf16],
    t: usize,
    residual: Option<&[bf16]>,
) -> (Vec<bf16>, Routing) {
    let backend = Backend::Cpu;
    let weights = MoeWeights::new(&backend, host).expect("weights");
    let mut workspace = MoeWorkspace::new(&backend, &weights, t).expect("workspace");
    let x_dev = backend.upload(x).expect("x");
    let residual_dev = residual.map(|r| backend.upload(r).expect("residual"));
    let mut y = backend.zeros::<bf16>(t * host.shape.hidden).expect("y");
    family::moe_block(
        &backend,
        &weights,
        &x_dev,
        t,
        residual_dev.as_ref(),
        &mut workspace,
        &mut y,
    )
    .expect("moe_block");
    (
        backend.download(&y).expect("y"),
        workspace.routing(&backend).expect("routing"),
    )
}

#[test]
fn the_cpu_backend_runs_the_reference_with_bf16_experts_and_a_residual() {
    let s = shape(8, 2, 64, 32, 48);
    let mut rng = SplitMix64::new(11);
    let host = host_block(&mut rng, s, ExpertFormat::Bf16, ExpertFormat::Bf16);
    let t = 5;
    let x = bf16_vec(&mut rng, t * s.hidden, 1.0);
    let residual = bf16_vec(&mut rng, t * s.hidden, 1.0);
    let (y, routing) = run_cpu(&host, &x, t, Some(&residual));
    let (want_routing, want) = reference_of(&host, &x, t);
    assert_eq!(routing, want_routing);
    for (index, (got, (w, r))) in y.iter().zip(want.iter().zip(&residual)).enumerate() {
        assert_eq!(
            got.to_bits(),
            bf16::from_f32(w + r.to_f32()).to_bits(),
            "y[{index}]"
        );
    }
}

#[test]
fn the_cpu_backend_dequantises_nvfp4_experts() {
    let s = shape(16, 4, 64, 32, 32);
    let mut rng = SplitMix64::new(12);
    let host = host_block(&mut rng, s, ExpertFormat::Nvfp4, ExpertFormat::Nvfp4);
    let t = 3;
    let x = bf16_vec(&mut rng, t * s.hidden, 1.0);
    let (y, routing) = run_cpu(&host, &x, t, None);
    let (want_routing, want) = reference_of(&host, &x, t);
    assert_eq!(routing, want_routing);
    let as_bits: Vec<u16> = want.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), as_bits);
}

/// What unit `unit` of the kernel layout must hold: a routed expert, or shared sub-expert c
/// (columns c * I .. (c + 1) * I of the shared expert, zero past Is).
fn expected_unit(host: &MoeHostWeights, unit: usize) -> (Vec<f32>, Vec<f32>) {
    let s = host.shape;
    if unit < s.experts {
        return host.experts[unit].dense();
    }
    let (h, i, is) = (s.hidden, s.intermediate, s.shared_intermediate);
    let c = unit - s.experts;
    let (gate_up, down) = host.shared.as_ref().expect("shared").dense();
    let mut part = vec![0.0f32; 2 * i * h];
    let mut part_down = vec![0.0f32; h * i];
    for j in 0..i {
        let column = c * i + j;
        if column >= is {
            continue;
        }
        part[j * h..(j + 1) * h].copy_from_slice(&gate_up[column * h..(column + 1) * h]);
        part[(i + j) * h..(i + j + 1) * h]
            .copy_from_slice(&gate_up[(is + column) * h..(is + column + 1) * h]);
        for row in 0..h {
            part_down[row * i + j] = down[row * is + column];
        }
    }
    (part, part_down)
}

/// Both tensor cores' layouts (mma.sync for CUDA, WMMA for gfx1151) decode back to the weights.
#[test]
fn the_kernel_layout_decodes_back_to_the_weights() {
    // Is = 80 with I = 32: the shared expert runs as 3 sub-experts, the last one half padding
    let s = shape(4, 2, 80, 32, 80);
    for (format, shared_format, tensor_core) in [
        (ExpertFormat::Bf16, ExpertFormat::Bf16, TensorCore::MmaSync),
        (
            ExpertFormat::Nvfp4,
            ExpertFormat::Nvfp4,
            TensorCore::MmaSync,
        ),
        (ExpertFormat::Bf16, ExpertFormat::Nvfp4, TensorCore::MmaSync),
        (ExpertFormat::Bf16, ExpertFormat::Bf16, TensorCore::Wmma),
        (ExpertFormat::Nvfp4, ExpertFormat::Nvfp4, TensorCore::Wmma),
        (ExpertFormat::Bf16, ExpertFormat::Nvfp4, TensorCore::Wmma),
    ] {
        let mut rng = SplitMix64::new(13);
        let host = host_block(&mut rng, s, format, shared_format);
        let layout = host.kernel_layout(tensor_core).expect("layout");
        assert_eq!(layout.tensor_core, tensor_core);
        assert_eq!(layout.shared_experts, 3);
        assert_eq!(layout.units(), s.experts + 3);
        assert!(layout.has_shared_gate);
        // bf16 is bit-exact; NVFP4 scales multiply in another order (e2m1 * e5m3 exactly, then
        // the per-tensor alpha) than the reference's e2m1 * (e4m3 * scale_2): within an ulp or two
        let exact = format == ExpertFormat::Bf16 && shared_format == ExpertFormat::Bf16;
        for unit in 0..layout.units() {
            let (gate_up, down) = layout.unit_dense(unit).expect("unit");
            let (want_gate_up, want_down) = expected_unit(&host, unit);
            for (what, got, want) in [
                ("gate_up", &gate_up, &want_gate_up),
                ("down", &down, &want_down),
            ] {
                assert_eq!(got.len(), want.len(), "unit {unit} {what}: element count");
                for (index, (g, w)) in got.iter().zip(want).enumerate() {
                    let ok = if exact {
                        g.to_bits() == w.to_bits() || (*g == 0.0 && *w == 0.0)
                    } else {
                        (g - w).abs() <= 1e-6 * w.abs()
                    };
                    assert!(
                        ok,
                        "{tensor_core:?} {format:?}/{shared_format:?} unit {unit} {what}[{index}]: \
                         {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn mixed_or_malformed_weights_are_errors() {
    let s = shape(4, 2, 32, 16, 16);
    let mut rng = SplitMix64::new(14);
    let bad = host_block(&mut rng, s, ExpertFormat::Nvfp4, ExpertFormat::Bf16);
    let err = bad.check().unwrap_err().to_string();
    assert!(
        err.contains("shared expert") && err.contains("NVFP4"),
        "{err}"
    );
    let mut mixed = host_block(&mut rng, s, ExpertFormat::Nvfp4, ExpertFormat::Nvfp4);
    mixed.experts[2] = bf16_expert(&mut rng, 32, 16);
    let err = mixed.check().unwrap_err().to_string();
    assert!(err.contains("expert 2"), "{err}");
    let mut short = host_block(&mut rng, s, ExpertFormat::Bf16, ExpertFormat::Bf16);
    short.router.pop();
    assert!(short.check().unwrap_err().to_string().contains("router"));
    let mut too_many = host_block(&mut rng, s, ExpertFormat::Bf16, ExpertFormat::Bf16);
    too_many.shape.top_k = 5;
    assert!(matches!(too_many.check(), Err(Error::Invalid { .. })));
    let router = vec![0.0f32; 4 * 32];
    let err = MoeHostWeights::from_fused(
        s,
        &FusedBlock {
            router: &router,
            shared_gate: None,
            gate_up: &[0.0f32; 10],
            down: &[],
            shared: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("gate_up"), "{err}");
}

#[test]
fn launch_arguments_are_checked() {
    let s = shape(4, 2, 32, 16, 16);
    let mut rng = SplitMix64::new(15);
    let backend = Backend::Cpu;
    let host = host_block(&mut rng, s, ExpertFormat::Bf16, ExpertFormat::Bf16);
    let weights = MoeWeights::new(&backend, &host).expect("weights");
    assert!(MoeWorkspace::new(&backend, &weights, 0).is_err());
    assert!(MoeWorkspace::new(&backend, &weights, 40000).is_err()); // 80000 slots
    let mut workspace = MoeWorkspace::new(&backend, &weights, 4).expect("workspace");
    assert!(workspace.routing(&backend).is_err(), "no block has run yet");
    let x = backend.upload(&[bf16::ONE; 2 * 32]).expect("x");
    let mut y = backend.zeros::<bf16>(3 * 32).expect("y");
    let err = family::moe_block(&backend, &weights, &x, 2, None, &mut workspace, &mut y)
        .unwrap_err()
        .to_string();
    assert!(err.contains("MoE output Y"), "{err}");
    let other = MoeWeights::new(
        &backend,
        &host_block(
            &mut rng,
            shape(8, 2, 32, 16, 16),
            ExpertFormat::Bf16,
            ExpertFormat::Bf16,
        ),
    )
    .expect("other");
    let mut y = backend.zeros::<bf16>(2 * 32).expect("y");
    let err = family::moe_block(&backend, &other, &x, 2, None, &mut workspace, &mut y)
        .unwrap_err()
        .to_string();
    assert!(err.contains("workspace"), "{err}");
    // more tokens than the workspace takes run in several launches
    let x = bf16_vec(&mut rng, 9 * 32, 1.0);
    let (y, _) = run_cpu(&host, &x, 9, None);
    let (_, want) = reference_of(&host, &x, 9);
    assert_eq!(y.len(), want.len());
    let x_dev = backend.upload(&x).expect("x");
    let mut chunked = backend.zeros::<bf16>(9 * 32).expect("y");
    family::moe_block(
        &backend,
        &weights,
        &x_dev,
        9,
        None,
        &mut workspace,
        &mut chunked,
    )
    .expect("chunked");
    assert_eq!(backend.download(&chunked).expect("y"), y);
}

// ---- the checkpoint loader ----

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn tensor(name: String, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Tensor {
    Tensor {
        name,
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

fn bf16_tensor(name: String, shape: &[usize], values: &[bf16]) -> Tensor {
    let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensor(name, Dtype::BF16, shape, data)
}

fn f32_tensor(name: String, shape: &[usize], values: &[bf16]) -> Tensor {
    let data = values
        .iter()
        .flat_map(|v| v.to_f32().to_le_bytes())
        .collect();
    tensor(name, Dtype::F32, shape, data)
}

fn nvfp4_tensors(out: &mut Vec<Tensor>, prefix: &str, m: &Nvfp4Matrix) {
    out.push(tensor(
        format!("{prefix}.weight"),
        Dtype::U8,
        &[m.rows, m.cols / 2],
        m.packed.clone(),
    ));
    out.push(tensor(
        format!("{prefix}.weight_scale"),
        Dtype::F8_E4M3,
        &[m.rows, m.cols / 16],
        m.scales.clone(),
    ));
    out.push(tensor(
        format!("{prefix}.weight_scale_2"),
        Dtype::F32,
        &[],
        m.global_scale.to_le_bytes().to_vec(),
    ));
    if let Some(input) = m.input_scale {
        out.push(tensor(
            format!("{prefix}.input_scale"),
            Dtype::F32,
            &[],
            input.to_le_bytes().to_vec(),
        ));
    }
}

/// One expert's tensors under `prefix` (`...experts.3.`): float 2-D (`as_f32` picks F32 over
/// BF16) or NVFP4.
fn expert_tensors(
    out: &mut Vec<Tensor>,
    prefix: &str,
    e: &ExpertWeights,
    h: usize,
    i: usize,
    as_f32: bool,
) {
    match e {
        ExpertWeights::Bf16 { gate_up, down } => {
            let make = if as_f32 { f32_tensor } else { bf16_tensor };
            out.push(make(
                format!("{prefix}gate_proj.weight"),
                &[i, h],
                &gate_up[..i * h],
            ));
            out.push(make(
                format!("{prefix}up_proj.weight"),
                &[i, h],
                &gate_up[i * h..],
            ));
            out.push(make(format!("{prefix}down_proj.weight"), &[h, i], down));
        }
        ExpertWeights::Nvfp4 { gate, up, down } => {
            nvfp4_tensors(out, &format!("{prefix}gate_proj"), gate);
            nvfp4_tensors(out, &format!("{prefix}up_proj"), up);
            nvfp4_tensors(out, &format!("{prefix}down_proj"), down);
        }
    }
}

/// The block as checkpoint tensors under `p`: fused 3-D experts (bf16 only) or per expert.
fn block_tensors(host: &MoeHostWeights, p: &str, fused: bool, as_f32: bool) -> Vec<Tensor> {
    let s = host.shape;
    let (e, h, i) = (s.experts, s.hidden, s.intermediate);
    let mut out = vec![bf16_tensor(
        format!("{p}gate.weight"),
        &[e, h],
        &host.router,
    )];
    if let Some(gate) = &host.shared_gate {
        out.push(bf16_tensor(
            format!("{p}shared_expert_gate.weight"),
            &[1, h],
            gate,
        ));
    }
    if fused {
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for expert in &host.experts {
            let ExpertWeights::Bf16 {
                gate_up: g,
                down: d,
            } = expert
            else {
                panic!("fused experts are float")
            };
            gate_up.extend_from_slice(g);
            down.extend_from_slice(d);
        }
        out.push(bf16_tensor(
            format!("{p}experts.gate_up_proj"),
            &[e, 2 * i, h],
            &gate_up,
        ));
        out.push(bf16_tensor(
            format!("{p}experts.down_proj"),
            &[e, h, i],
            &down,
        ));
    } else {
        for (index, expert) in host.experts.iter().enumerate() {
            expert_tensors(
                &mut out,
                &format!("{p}experts.{index}."),
                expert,
                h,
                i,
                as_f32,
            );
        }
    }
    if let Some(shared) = &host.shared {
        expert_tensors(
            &mut out,
            &format!("{p}shared_expert."),
            shared,
            h,
            s.shared_intermediate,
            as_f32,
        );
    }
    out
}

fn write(dir: &Path, tensors: &[Tensor]) -> Checkpoint {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).expect("view"),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    std::fs::write(
        &path,
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
    Checkpoint::open(dir).expect("open")
}

#[test]
fn the_loader_reads_fused_per_expert_and_nvfp4_experts() {
    let s = shape(6, 2, 32, 16, 32);
    let prefix = "model.layers.3.mlp.";
    let mut rng = SplitMix64::new(16);
    for (format, fused, as_f32) in [
        (ExpertFormat::Bf16, true, false),
        (ExpertFormat::Bf16, false, true),
        (ExpertFormat::Nvfp4, false, false),
    ] {
        let host = host_block(&mut rng, s, format, format);
        let dir = tempfile::tempdir().expect("tempdir");
        let checkpoint = write(dir.path(), &block_tensors(&host, prefix, fused, as_f32));
        let loaded = MoeHostWeights::load(&checkpoint, prefix, s).expect("load");
        assert_eq!(loaded, host, "{format:?} fused={fused} f32={as_f32}");
        // and onto a backend
        let weights = MoeWeights::load(&Backend::Cpu, &checkpoint, prefix, s).expect("weights");
        assert_eq!(weights.format(), format);
        assert_eq!(weights.expert_bytes(), host.expert_bytes());
    }
}

#[test]
fn a_missing_nvfp4_scale_is_an_error_naming_the_tensor() {
    let s = shape(4, 2, 32, 16, 16);
    let prefix = "mtp.layers.0.mlp.";
    let mut rng = SplitMix64::new(17);
    let host = host_block(&mut rng, s, ExpertFormat::Nvfp4, ExpertFormat::Nvfp4);
    for missing in [
        "mtp.layers.0.mlp.experts.2.up_proj.weight_scale_2",
        "mtp.layers.0.mlp.experts.1.down_proj.weight_scale",
        "mtp.layers.0.mlp.shared_expert.gate_proj.weight_scale",
    ] {
        let tensors: Vec<Tensor> = block_tensors(&host, prefix, false, false)
            .into_iter()
            .filter(|t| t.name != missing)
            .collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let checkpoint = write(dir.path(), &tensors);
        match MoeHostWeights::load(&checkpoint, prefix, s) {
            Err(Error::MissingTensor { tensor, .. }) => assert_eq!(tensor, missing),
            other => panic!("{missing}: {other:?}"),
        }
    }
    // one expert stored in bf16 among NVFP4 ones
    let mut tensors: Vec<Tensor> = block_tensors(&host, prefix, false, false)
        .into_iter()
        .filter(|t| !t.name.starts_with("mtp.layers.0.mlp.experts.3."))
        .collect();
    expert_tensors(
        &mut tensors,
        &format!("{prefix}experts.3."),
        &bf16_expert(&mut rng, 32, 16),
        32,
        16,
        false,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let checkpoint = write(dir.path(), &tensors);
    let err = MoeHostWeights::load(&checkpoint, prefix, s)
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.3.gate_proj"), "{err}");
    // a shape that disagrees with the config names the tensor
    let err = MoeHostWeights::load(&checkpoint, prefix, shape(4, 2, 32, 32, 16))
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.0.gate_proj"), "{err}");
}

/// Rows `first .. first + count` of an NVFP4 matrix (its scales kept).
fn nvfp4_row_slice(m: &Nvfp4Matrix, first: usize, count: usize) -> Nvfp4Matrix {
    let (bytes, blocks) = (m.cols / 2, m.cols / 16);
    Nvfp4Matrix {
        rows: count,
        cols: m.cols,
        packed: m.packed[first * bytes..(first + count) * bytes].to_vec(),
        scales: m.scales[first * blocks..(first + count) * blocks].to_vec(),
        global_scale: m.global_scale,
        input_scale: m.input_scale,
    }
}

/// A fused 3-D NVFP4 expert tensor `name` (`[E, N, K/2]`) with its per-expert scales.
fn fused_nvfp4_tensors(out: &mut Vec<Tensor>, name: &str, matrices: &[Nvfp4Matrix]) {
    let (e, rows, cols) = (matrices.len(), matrices[0].rows, matrices[0].cols);
    let cat =
        |f: &dyn Fn(&Nvfp4Matrix) -> Vec<u8>| matrices.iter().flat_map(f).collect::<Vec<u8>>();
    out.push(tensor(
        name.into(),
        Dtype::U8,
        &[e, rows, cols / 2],
        cat(&|m| m.packed.clone()),
    ));
    out.push(tensor(
        format!("{name}_weight_scale"),
        Dtype::F8_E4M3,
        &[e, rows, cols / 16],
        cat(&|m| m.scales.clone()),
    ));
    out.push(tensor(
        format!("{name}_weight_scale_2"),
        Dtype::F32,
        &[e],
        cat(&|m| m.global_scale.to_le_bytes().to_vec()),
    ));
    out.push(tensor(
        format!("{name}_input_scale"),
        Dtype::F32,
        &[e],
        cat(&|m| m.input_scale.expect("input scale").to_le_bytes().to_vec()),
    ));
}

#[test]
fn the_loader_reads_fused_nvfp4_experts_with_their_own_scales() {
    let s = shape(4, 2, 32, 16, 16);
    let prefix = "model.language_model.layers.0.mlp.";
    let mut rng = SplitMix64::new(18);
    let mut host = host_block(&mut rng, s, ExpertFormat::Nvfp4, ExpertFormat::Nvfp4);
    // each expert's [gate; up] quantised as one matrix: one scale_2 per expert for both
    let gate_ups: Vec<Nvfp4Matrix> = (0..4).map(|_| nvfp4(&mut rng, 32, 32, 0.3)).collect();
    let downs: Vec<Nvfp4Matrix> = (0..4).map(|_| nvfp4(&mut rng, 32, 16, 0.4)).collect();
    for (e, (gate_up, down)) in gate_ups.iter().zip(&downs).enumerate() {
        host.experts[e] = ExpertWeights::Nvfp4 {
            gate: nvfp4_row_slice(gate_up, 0, 16),
            up: nvfp4_row_slice(gate_up, 16, 16),
            down: down.clone(),
        };
    }
    let mut tensors = vec![bf16_tensor(
        format!("{prefix}gate.weight"),
        &[4, 32],
        &host.router,
    )];
    tensors.push(bf16_tensor(
        format!("{prefix}shared_expert_gate.weight"),
        &[1, 32],
        host.shared_gate.as_ref().expect("gate"),
    ));
    fused_nvfp4_tensors(
        &mut tensors,
        &format!("{prefix}experts.gate_up_proj"),
        &gate_ups,
    );
    fused_nvfp4_tensors(&mut tensors, &format!("{prefix}experts.down_proj"), &downs);
    expert_tensors(
        &mut tensors,
        &format!("{prefix}shared_expert."),
        host.shared.as_ref().expect("shared"),
        32,
        16,
        false,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let checkpoint = write(dir.path(), &tensors);
    assert_eq!(
        MoeHostWeights::load(&checkpoint, prefix, s).expect("load"),
        host
    );
    // a missing per-expert scale is named
    let missing = format!("{prefix}experts.down_proj_weight_scale_2");
    let tensors: Vec<Tensor> = tensors.into_iter().filter(|t| t.name != missing).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let checkpoint = write(dir.path(), &tensors);
    match MoeHostWeights::load(&checkpoint, prefix, s) {
        Err(Error::MissingTensor { tensor, .. }) => assert_eq!(tensor, missing),
        other => panic!("{other:?}"),
    }
}
