//! The Gated DeltaNet reference against itself: chunked == recurrent == token-by-token decode,
//! at the real head shape and awkward ones (T = 1, T = 65, dk != dv, chunks that do not divide T),
//! and the conv window carried across calls.

use fp4spec::kernels::gdn::reference::{self as gdn, DeltaInputs, GdnShape};
use fp4spec::rng::SplitMix64;

struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn case(rng: &mut SplitMix64, shape: GdnShape, t: usize) -> Case {
    let mut q = rng.normal_vec(t * shape.key_heads * shape.dk, 1.0);
    let mut k = rng.normal_vec(t * shape.key_heads * shape.dk, 1.0);
    gdn::l2_normalize(&mut q, shape.dk, 1.0 / (shape.dk as f64).sqrt());
    gdn::l2_normalize(&mut k, shape.dk, 1.0);
    let v = rng.normal_vec(t * shape.value_heads * shape.dv, 1.0);
    let a = rng.normal_vec(t * shape.value_heads, 1.0);
    let b = rng.normal_vec(t * shape.value_heads, 1.0);
    let a_log: Vec<f32> = (0..shape.value_heads)
        .map(|h| (h as f32 * 0.1).ln_1p())
        .collect();
    let dt_bias = rng.normal_vec(shape.value_heads, 0.5);
    let (mut g, mut beta) = (Vec::new(), Vec::new());
    for step in 0..t {
        let range = step * shape.value_heads..(step + 1) * shape.value_heads;
        let (gs, bs) = gdn::gates(&a[range.clone()], &b[range], &a_log, &dt_bias);
        g.extend(gs);
        beta.extend(bs);
    }
    let state = rng.normal_vec(shape.state_len(), 0.1);
    Case {
        q,
        k,
        v,
        g,
        beta,
        state,
    }
}

fn inputs(c: &Case, t: usize) -> DeltaInputs<'_> {
    DeltaInputs {
        t,
        q: &c.q,
        k: &c.k,
        v: &c.v,
        g: &c.g,
        beta: &c.beta,
    }
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0.0f64, |m, v| m.max(f64::from(v.abs())))
        .max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs())))
        / scale
}

#[test]
fn chunked_equals_recurrent_at_real_and_awkward_shapes() {
    let mut rng = SplitMix64::new(1);
    let shapes = [
        (
            GdnShape {
                key_heads: 16,
                value_heads: 32,
                dk: 128,
                dv: 128,
            },
            70,
            64,
        ),
        (
            GdnShape {
                key_heads: 2,
                value_heads: 4,
                dk: 32,
                dv: 48,
            },
            65,
            64,
        ),
        (
            GdnShape {
                key_heads: 1,
                value_heads: 3,
                dk: 16,
                dv: 8,
            },
            1,
            64,
        ),
        (
            GdnShape {
                key_heads: 2,
                value_heads: 2,
                dk: 24,
                dv: 40,
            },
            130,
            16,
        ),
    ];
    for (shape, t, chunk) in shapes {
        let c = case(&mut rng, shape, t);
        let mut s_rec = c.state.clone();
        let mut s_chunk = c.state.clone();
        let o_rec = gdn::recurrent(shape, inputs(&c, t), &mut s_rec);
        let o_chunk = gdn::chunked(shape, inputs(&c, t), &mut s_chunk, chunk);
        let (eo, es) = (max_rel(&o_chunk, &o_rec), max_rel(&s_chunk, &s_rec));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "{shape:?} T={t} chunk={chunk}: outputs {eo:.2e}, state {es:.2e}"
        );
    }
}

#[test]
fn decode_token_by_token_continues_a_prefill_exactly() {
    let mut rng = SplitMix64::new(2);
    let shape = GdnShape {
        key_heads: 2,
        value_heads: 4,
        dk: 32,
        dv: 48,
    };
    let t = 20;
    let c = case(&mut rng, shape, t);
    let mut s_full = c.state.clone();
    let o_full = gdn::recurrent(shape, inputs(&c, t), &mut s_full);
    // chunked prefill of 13 tokens, then 7 single-token decode steps
    let split = 13;
    let mut s = c.state.clone();
    let mut outs = gdn::chunked(shape, inputs(&c, split), &mut s, 8);
    for step in split..t {
        let (kq, kv, kg) = (
            shape.key_heads * shape.dk,
            shape.value_heads * shape.dv,
            shape.value_heads,
        );
        let one = DeltaInputs {
            t: 1,
            q: &c.q[step * kq..(step + 1) * kq],
            k: &c.k[step * kq..(step + 1) * kq],
            v: &c.v[step * kv..(step + 1) * kv],
            g: &c.g[step * kg..(step + 1) * kg],
            beta: &c.beta[step * kg..(step + 1) * kg],
        };
        outs.extend(gdn::recurrent(shape, one, &mut s));
    }
    assert!(max_rel(&outs, &o_full) < 1e-5 && max_rel(&s, &s_full) < 1e-5);
}

#[test]
fn a_zero_state_and_no_decay_reduce_to_the_delta_rule_by_hand() {
    // one head, dk = dv = 2, two tokens, g = 0 (no decay), beta = 1
    let shape = GdnShape {
        key_heads: 1,
        value_heads: 1,
        dk: 2,
        dv: 2,
    };
    let (q, k, v) = (
        [1.0f32, 0.0, 0.0, 1.0],
        [1.0f32, 0.0, 1.0, 0.0],
        [2.0f32, 3.0, 5.0, 7.0],
    );
    let mut state = vec![0.0f32; 4];
    let out = gdn::recurrent(
        shape,
        DeltaInputs {
            t: 2,
            q: &q,
            k: &k,
            v: &v,
            g: &[0.0, 0.0],
            beta: &[1.0, 1.0],
        },
        &mut state,
    );
    // token 0 writes v0 under k0; token 1 replaces it with v1 (same key, beta = 1)
    assert_eq!(out, vec![2.0, 3.0, 0.0, 0.0]);
    assert_eq!(state, vec![5.0, 7.0, 0.0, 0.0]);
}

#[test]
fn the_conv_window_carries_across_calls() {
    let mut rng = SplitMix64::new(3);
    let (channels, kernel, t) = (6, 4, 11);
    let x = rng.normal_vec(t * channels, 1.0);
    let w = rng.normal_vec(channels * kernel, 0.5);
    let mut state_full = vec![0.0f32; (kernel - 1) * channels];
    let full = gdn::conv1d_silu(&x, t, channels, &w, kernel, &mut state_full);
    let mut state = vec![0.0f32; (kernel - 1) * channels];
    let mut parts = gdn::conv1d_silu(&x[..5 * channels], 5, channels, &w, kernel, &mut state);
    for step in 5..t {
        parts.extend(gdn::conv1d_silu(
            &x[step * channels..(step + 1) * channels],
            1,
            channels,
            &w,
            kernel,
            &mut state,
        ));
    }
    assert_eq!(parts, full);
    assert_eq!(state, state_full);
    assert_eq!(
        &state_full[..],
        &x[(t - 3) * channels..],
        "the window is the last kernel - 1 inputs"
    );
    // the first output sees only x0 (zero history): silu(w[c][3] * x0)
    let first = gdn::silu(f64::from(w[3]) * f64::from(x[0])) as f32;
    assert!((full[0] - first).abs() < 1e-6);
}

#[test]
fn gates_norms_and_the_gated_rmsnorm() {
    let (g, beta) = gdn::gates(&[0.0], &[0.0], &[0.0], &[0.0]);
    assert!(
        (g[0] + std::f32::consts::LN_2).abs() < 1e-6,
        "-exp(0) * softplus(0) = -ln 2"
    );
    assert_eq!(beta[0], 0.5);
    let mut x = vec![3.0f32, 4.0];
    gdn::l2_normalize(&mut x, 2, 1.0);
    assert!((x[0] - 0.6).abs() < 1e-6 && (x[1] - 0.8).abs() < 1e-6);
    let y = gdn::gated_rmsnorm(&[1.0, -1.0], &[0.0, 10.0], &[2.0, 2.0], 2, 0.0);
    assert!(y[0].abs() < 1e-6, "silu(0) = 0");
    assert!((y[1] - (-2.0 * gdn::silu(10.0) as f32)).abs() < 1e-5);
}
