//! The Gated DeltaNet reference against itself: chunked == recurrent == token-by-token decode,
//! at the real head shape and awkward ones (T = 1, T = 65, dk != dv, chunks that do not divide T),
//! and the conv window carried across calls; the layer core from raw projections; the
//! speculative step (verify then commit(k) == decoding the first k tokens, for every k, and
//! chains of verify steps replaying their accepted tokens); and the launch API on the CPU
//! backend, whose cache layout (state slots, position ring) must keep those semantics.

use fp4spec::kernels::compare;
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
    compare::max_difference(a, b).1
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

// ---- the layer core from raw projections and the speculative step ----

struct Layer {
    conv_weight: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_weight: Vec<f32>,
}

const KERNEL: usize = 4;

impl Layer {
    fn random(rng: &mut SplitMix64, shape: GdnShape) -> Self {
        Self {
            conv_weight: rng.normal_vec(shape.conv_dim() * KERNEL, 0.5),
            a_log: (0..shape.value_heads)
                .map(|h| (h as f32 * 0.3).ln_1p() - 1.0)
                .collect(),
            dt_bias: rng.normal_vec(shape.value_heads, 0.5),
            norm_weight: rng
                .normal_vec(shape.dv, 0.1)
                .into_iter()
                .map(|w| 1.0 + w)
                .collect(),
        }
    }

    fn params(&self) -> gdn::LayerParams<'_> {
        gdn::LayerParams {
            conv_weight: &self.conv_weight,
            kernel: KERNEL,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm_weight: &self.norm_weight,
            eps: 1e-6,
        }
    }
}

struct Raw {
    qkv: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    z: Vec<f32>,
}

impl Raw {
    fn random(rng: &mut SplitMix64, shape: GdnShape, t: usize) -> Self {
        Self {
            qkv: rng.normal_vec(t * shape.conv_dim(), 1.0),
            a: rng.normal_vec(t * shape.value_heads, 1.0),
            b: rng.normal_vec(t * shape.value_heads, 1.0),
            z: rng.normal_vec(t * shape.value_heads * shape.dv, 1.0),
        }
    }

    /// Tokens `range` of these rows, with or without the gate.
    fn rows(
        &self,
        shape: GdnShape,
        range: std::ops::Range<usize>,
        gated: bool,
    ) -> gdn::RawInputs<'_> {
        let (c, h, z) = (
            shape.conv_dim(),
            shape.value_heads,
            shape.value_heads * shape.dv,
        );
        gdn::RawInputs {
            t: range.len(),
            qkv: &self.qkv[range.start * c..range.end * c],
            a: &self.a[range.start * h..range.end * h],
            b: &self.b[range.start * h..range.end * h],
            z: gated.then(|| &self.z[range.start * z..range.end * z]),
        }
    }
}

fn small_shape() -> GdnShape {
    GdnShape {
        key_heads: 2,
        value_heads: 4,
        dk: 16,
        dv: 24,
    }
}

fn fresh_cache(rng: &mut SplitMix64, shape: GdnShape) -> gdn::SequenceCache {
    gdn::SequenceCache::new(
        rng.normal_vec(shape.state_len(), 0.2),
        rng.normal_vec((KERNEL - 1) * shape.conv_dim(), 1.0),
        7,
    )
}

#[test]
fn decode_steps_equal_the_plain_composition_of_the_reference_functions() {
    let mut rng = SplitMix64::new(4);
    let shape = small_shape();
    let layer = Layer::random(&mut rng, shape);
    let t = 9;
    let raw = Raw::random(&mut rng, shape, t);
    let mut cache = fresh_cache(&mut rng, shape);
    let (mut window, mut state) = (cache.window.clone(), cache.state.clone());
    let want = gdn::layer_core(
        shape,
        layer.params(),
        raw.rows(shape, 0..t, true),
        &mut window,
        &mut state,
        Some(4),
    );
    let mut got = Vec::new();
    for step in 0..t {
        got.extend(cache.step(
            shape,
            layer.params(),
            raw.rows(shape, step..step + 1, true),
            gdn::StepMode::Decode,
        ));
    }
    assert!(
        max_rel(&got, &want) < 1e-5,
        "outputs {:.2e}",
        max_rel(&got, &want)
    );
    assert!(max_rel(&cache.state, &state) < 1e-5);
    assert_eq!(
        cache.window, window,
        "the conv window is the last 3 raw rows"
    );
    assert_eq!(cache.position, 7 + t);
}

/// verify(n + 1 tokens) then commit(k) gives, for every k, the outputs, state, conv window and
/// position of decoding the first k tokens one at a time.
#[test]
fn verify_then_commit_k_equals_decoding_the_first_k_tokens_for_every_k() {
    let mut rng = SplitMix64::new(5);
    let shape = small_shape();
    let layer = Layer::random(&mut rng, shape);
    for tokens in [1, 3, 5] {
        let raw = Raw::random(&mut rng, shape, tokens);
        let start = fresh_cache(&mut rng, shape);
        for gated in [false, true] {
            let mut verify = start.clone();
            let verified = verify.step(
                shape,
                layer.params(),
                raw.rows(shape, 0..tokens, gated),
                gdn::StepMode::Verify,
            );
            assert_eq!(
                verify.state, start.state,
                "verify keeps the pre-verify state"
            );
            assert_eq!(verify.position, start.position);
            let width = shape.value_heads * shape.dv;
            for k in 0..=tokens {
                let mut committed = verify.clone();
                committed.commit(k);
                assert_eq!(committed.pending.len(), k);
                committed.replay_pending(shape);
                let mut decoded = start.clone();
                let mut outs = Vec::new();
                for step in 0..k {
                    outs.extend(decoded.step(
                        shape,
                        layer.params(),
                        raw.rows(shape, step..step + 1, gated),
                        gdn::StepMode::Decode,
                    ));
                }
                let what = format!("n+1={tokens} k={k} gated={gated}");
                assert!(
                    max_rel(&verified[..k * width], &outs) < 1e-5,
                    "{what}: outputs {:.2e}",
                    max_rel(&verified[..k * width], &outs)
                );
                assert!(
                    max_rel(&committed.state, &decoded.state) < 1e-5,
                    "{what}: state {:.2e}",
                    max_rel(&committed.state, &decoded.state)
                );
                assert_eq!(committed.window, decoded.window, "{what}: conv window");
                assert_eq!(committed.position, decoded.position, "{what}: position");
            }
        }
    }
}

/// A chain of verify steps with partial acceptance, each next step replaying the accepted
/// tokens inside itself, produces the outputs of plain decoding of the accepted tokens.
#[test]
fn chained_verify_steps_replay_the_accepted_tokens_without_recompute() {
    let mut rng = SplitMix64::new(6);
    let shape = small_shape();
    let layer = Layer::random(&mut rng, shape);
    let width = shape.value_heads * shape.dv;
    let mut spec = fresh_cache(&mut rng, shape);
    let mut plain = spec.clone();
    for (round, accepted) in [3usize, 0, 1, 3, 2].into_iter().enumerate() {
        let raw = Raw::random(&mut rng, shape, 3);
        let outs = spec.step(
            shape,
            layer.params(),
            raw.rows(shape, 0..3, true),
            gdn::StepMode::Verify,
        );
        spec.commit(accepted);
        for step in 0..accepted {
            let want = plain.step(
                shape,
                layer.params(),
                raw.rows(shape, step..step + 1, true),
                gdn::StepMode::Decode,
            );
            let got = &outs[step * width..(step + 1) * width];
            assert!(
                max_rel(got, &want) < 1e-5,
                "round {round} token {step}: {:.2e}",
                max_rel(got, &want)
            );
        }
        assert_eq!(spec.position, plain.position);
    }
    spec.replay_pending(shape);
    assert!(max_rel(&spec.state, &plain.state) < 1e-5);
    assert_eq!(spec.window, plain.window);
}

// ---- the launch API on the CPU backend: the ring layout keeps the reference's semantics ----

use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::kernels::Bf16Rows;
use fp4spec::kernels::gdn::{
    self as api, Accepted, ChunkWorkspace, GdnCache, GdnParams, Projections, Sequences,
};
use half::bf16;

/// Projection rows as the API takes them (bf16) and as the reference takes them (the same
/// values in f32).
struct ApiRows {
    qkv: Vec<bf16>,
    a: Vec<bf16>,
    b: Vec<bf16>,
    z: Vec<bf16>,
}

fn bf16s(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

impl ApiRows {
    fn random(rng: &mut SplitMix64, shape: GdnShape, rows: usize) -> Self {
        Self {
            qkv: bf16s(rng, rows * shape.conv_dim()),
            a: bf16s(rng, rows * shape.value_heads),
            b: bf16s(rng, rows * shape.value_heads),
            z: bf16s(rng, rows * shape.value_heads * shape.dv),
        }
    }

    fn f32s(v: &[bf16], range: std::ops::Range<usize>, width: usize) -> Vec<f32> {
        v[range.start * width..range.end * width]
            .iter()
            .map(|x| x.to_f32())
            .collect()
    }

    /// Reference outputs of rows `range` through `cache.step`.
    fn reference_step(
        &self,
        shape: GdnShape,
        layer: &Layer,
        cache: &mut gdn::SequenceCache,
        range: std::ops::Range<usize>,
        mode: gdn::StepMode,
    ) -> Vec<bf16> {
        let (c, h, zw) = (
            shape.conv_dim(),
            shape.value_heads,
            shape.value_heads * shape.dv,
        );
        let (qkv, a, b, z) = (
            Self::f32s(&self.qkv, range.clone(), c),
            Self::f32s(&self.a, range.clone(), h),
            Self::f32s(&self.b, range.clone(), h),
            Self::f32s(&self.z, range.clone(), zw),
        );
        let raw = gdn::RawInputs {
            t: range.len(),
            qkv: &qkv,
            a: &a,
            b: &b,
            z: Some(&z),
        };
        cache
            .step(shape, layer.params(), raw, mode)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    }
}

struct Uploaded {
    qkv: DeviceVec<bf16>,
    a: DeviceVec<bf16>,
    b: DeviceVec<bf16>,
    z: DeviceVec<bf16>,
}

impl Uploaded {
    fn new(backend: &Backend, rows: &ApiRows) -> Self {
        Self {
            qkv: backend.upload(&rows.qkv).unwrap(),
            a: backend.upload(&rows.a).unwrap(),
            b: backend.upload(&rows.b).unwrap(),
            z: backend.upload(&rows.z).unwrap(),
        }
    }

    fn projections(&self, shape: GdnShape) -> Projections<'_> {
        Projections {
            qkv: Bf16Rows::packed(&self.qkv, shape.conv_dim()),
            a: Bf16Rows::packed(&self.a, shape.value_heads),
            b: Bf16Rows::packed(&self.b, shape.value_heads),
            z: Some(Bf16Rows::packed(&self.z, shape.value_heads * shape.dv)),
        }
    }
}

#[test]
fn the_cpu_backend_of_the_launch_api_keeps_the_reference_semantics_through_its_ring() {
    let mut rng = SplitMix64::new(7);
    let shape = GdnShape {
        key_heads: 2,
        value_heads: 4,
        dk: 16,
        dv: 32,
    };
    let layer = Layer::random(&mut rng, shape);
    let backend = Backend::Cpu;
    let params = GdnParams::upload(
        &backend,
        shape,
        KERNEL,
        &layer.conv_weight,
        &layer.a_log,
        &layer.dt_bias,
        &layer.norm_weight,
        1e-6,
    )
    .unwrap();
    let mut cache = GdnCache::new(&backend, shape, KERNEL, 3, 3).unwrap();
    let mut workspace = ChunkWorkspace::new(&backend, shape, 64, 2).unwrap();
    // two sequences in slots 2 and 0, both fresh
    let slots = [2usize, 0];
    let mut seqs = Sequences::new(&backend, &[2, 0], &[0, 0]).unwrap();
    let mut reference: Vec<gdn::SequenceCache> = (0..2)
        .map(|_| {
            gdn::SequenceCache::new(
                vec![0.0; shape.state_len()],
                vec![0.0; (KERNEL - 1) * shape.conv_dim()],
                0,
            )
        })
        .collect();
    let width = shape.value_heads * shape.dv;
    let run = |what: &str, got: &DeviceVec<bf16>, want: &[bf16]| {
        let got = backend.download(got).unwrap();
        assert_eq!(got, want, "{what}");
    };

    // prefill 5 and 2 tokens
    let rows = ApiRows::random(&mut rng, shape, 7);
    let up = Uploaded::new(&backend, &rows);
    let mut out = backend.zeros::<bf16>(7 * width).unwrap();
    api::prefill(
        &backend,
        &params,
        &mut cache,
        &mut workspace,
        &seqs,
        &[0, 5, 7],
        &up.projections(shape),
        &mut out,
    )
    .unwrap();
    let mut want = rows.reference_step(
        shape,
        &layer,
        &mut reference[0],
        0..5,
        gdn::StepMode::Decode,
    );
    want.extend(rows.reference_step(
        shape,
        &layer,
        &mut reference[1],
        5..7,
        gdn::StepMode::Decode,
    ));
    run("prefill", &out, &want);
    let lengths = backend.upload(&[5u32, 2]).unwrap();
    seqs.commit(
        &backend,
        Accepted::PerSequence(&lengths),
        api::StepMode::Decode,
    )
    .unwrap();

    // verify 3 tokens each, accept 2 and 0
    let rows = ApiRows::random(&mut rng, shape, 6);
    let up = Uploaded::new(&backend, &rows);
    let mut out = backend.zeros::<bf16>(6 * width).unwrap();
    api::step(
        &backend,
        &params,
        &mut cache,
        &seqs,
        3,
        &up.projections(shape),
        api::StepMode::Verify,
        &mut out,
    )
    .unwrap();
    let mut want = rows.reference_step(
        shape,
        &layer,
        &mut reference[0],
        0..3,
        gdn::StepMode::Verify,
    );
    want.extend(rows.reference_step(
        shape,
        &layer,
        &mut reference[1],
        3..6,
        gdn::StepMode::Verify,
    ));
    run("verify", &out, &want);
    let accepted = backend.upload(&[2u32, 0]).unwrap();
    seqs.commit(
        &backend,
        Accepted::PerSequence(&accepted),
        api::StepMode::Verify,
    )
    .unwrap();
    reference[0].commit(2);
    reference[1].commit(0);
    assert_eq!(seqs.positions(&backend).unwrap(), [7, 2]);
    assert_eq!(seqs.pending(&backend).unwrap(), [2, 0]);

    // one decode step (replays the 2 accepted tokens of sequence 0)
    let rows = ApiRows::random(&mut rng, shape, 2);
    let up = Uploaded::new(&backend, &rows);
    let mut out = backend.zeros::<bf16>(2 * width).unwrap();
    api::step(
        &backend,
        &params,
        &mut cache,
        &seqs,
        1,
        &up.projections(shape),
        api::StepMode::Decode,
        &mut out,
    )
    .unwrap();
    let mut want = rows.reference_step(
        shape,
        &layer,
        &mut reference[0],
        0..1,
        gdn::StepMode::Decode,
    );
    want.extend(rows.reference_step(
        shape,
        &layer,
        &mut reference[1],
        1..2,
        gdn::StepMode::Decode,
    ));
    run("decode after verify", &out, &want);
    seqs.commit(&backend, Accepted::All(1), api::StepMode::Decode)
        .unwrap();

    // verify again, accept 3 and 1, then a prefill continues both (4 tokens and none)
    let rows = ApiRows::random(&mut rng, shape, 6);
    let up = Uploaded::new(&backend, &rows);
    let mut out = backend.zeros::<bf16>(6 * width).unwrap();
    api::step(
        &backend,
        &params,
        &mut cache,
        &seqs,
        3,
        &up.projections(shape),
        api::StepMode::Verify,
        &mut out,
    )
    .unwrap();
    let mut want = rows.reference_step(
        shape,
        &layer,
        &mut reference[0],
        0..3,
        gdn::StepMode::Verify,
    );
    want.extend(rows.reference_step(
        shape,
        &layer,
        &mut reference[1],
        3..6,
        gdn::StepMode::Verify,
    ));
    run("second verify", &out, &want);
    let accepted = backend.upload(&[3u32, 1]).unwrap();
    seqs.commit(
        &backend,
        Accepted::PerSequence(&accepted),
        api::StepMode::Verify,
    )
    .unwrap();
    reference[0].commit(3);
    reference[1].commit(1);
    let rows = ApiRows::random(&mut rng, shape, 4);
    let up = Uploaded::new(&backend, &rows);
    let mut out = backend.zeros::<bf16>(4 * width).unwrap();
    api::prefill(
        &backend,
        &params,
        &mut cache,
        &mut workspace,
        &seqs,
        &[0, 4, 4],
        &up.projections(shape),
        &mut out,
    )
    .unwrap();
    let want = rows.reference_step(
        shape,
        &layer,
        &mut reference[0],
        0..4,
        gdn::StepMode::Decode,
    );
    reference[1].replay_pending(shape);
    run("prefill after verify", &out, &want);
    let lengths = backend.upload(&[4u32, 0]).unwrap();
    seqs.commit(
        &backend,
        Accepted::PerSequence(&lengths),
        api::StepMode::Decode,
    )
    .unwrap();
    api::flush(&backend, &params, &mut cache, &mut seqs).unwrap();
    for (i, r) in reference.iter().enumerate() {
        let position = seqs.positions(&backend).unwrap()[i] as usize;
        assert_eq!(position, r.position, "sequence {i}: position");
        assert_eq!(
            cache.state(&backend, slots[i]).unwrap(),
            r.state,
            "sequence {i}: state"
        );
        let window: Vec<f32> = cache
            .conv_window(&backend, slots[i], position)
            .unwrap()
            .into_iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(window, r.window, "sequence {i}: conv window");
    }
}

#[test]
fn the_launch_api_names_what_is_wrong() {
    let backend = Backend::Cpu;
    let shape = small_shape();
    let err = GdnCache::new(&backend, shape, KERNEL, 1, 2).err().unwrap();
    assert!(err.to_string().contains("dv = 24"), "{err}");
    let shape = GdnShape { dv: 32, ..shape };
    let mut cache = GdnCache::new(&backend, shape, KERNEL, 1, 2).unwrap();
    let zeros = |n| vec![0.0f32; n];
    let params = GdnParams::upload(
        &backend,
        shape,
        KERNEL,
        &zeros(shape.conv_dim() * KERNEL),
        &zeros(4),
        &zeros(4),
        &zeros(32),
        1e-6,
    )
    .unwrap();
    let err = GdnParams::upload(
        &backend,
        shape,
        KERNEL,
        &zeros(3),
        &zeros(4),
        &zeros(4),
        &zeros(32),
        1e-6,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("conv1d.weight"), "{err}");
    let seqs = Sequences::new(&backend, &[0], &[0]).unwrap();
    let data = backend.zeros::<bf16>(3 * shape.conv_dim()).unwrap();
    let rows = Projections {
        qkv: Bf16Rows::packed(&data, shape.conv_dim()),
        a: Bf16Rows::packed(&data, 4),
        b: Bf16Rows::packed(&data, 4),
        z: None,
    };
    let mut out = backend.zeros::<bf16>(3 * 128).unwrap();
    let err = api::step(
        &backend,
        &params,
        &mut cache,
        &seqs,
        3,
        &rows,
        api::StepMode::Verify,
        &mut out,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("at most 1 of 2"), "{err}");
    let mut workspace = ChunkWorkspace::new(&backend, shape, 64, 1).unwrap();
    let err = api::prefill(
        &backend,
        &params,
        &mut cache,
        &mut workspace,
        &seqs,
        &[1, 3],
        &rows,
        &mut out,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("cu_seqlens"), "{err}");
    let short = Bf16Rows::packed(&data, shape.conv_dim() + 8);
    let err = api::prefill(
        &backend,
        &params,
        &mut cache,
        &mut workspace,
        &seqs,
        &[0, 3],
        &Projections { qkv: short, ..rows },
        &mut out,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("qkv rows"), "{err}");
}
