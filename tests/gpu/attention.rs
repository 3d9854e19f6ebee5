//! GPU checks of the `norm` and `attention` families against their CPU launch paths (which run
//! the references) on fresh random inputs: the real Qwen3.6 head shape and awkward ones, decode,
//! verify and prefill rows in one call, contexts longer than one split; bf16 and e4m3 caches
//! (unit scales, and scales that push values into e4m3's subnormals and saturation).

use crate::common::{cuda, random_bf16, rng};
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::e4m3_decode;
use fp4spec::kernels::Bf16Rows;
use fp4spec::kernels::attention::reference::AttentionShape;
use fp4spec::kernels::attention::{
    self, DecodeKernel, GatedAttention, KvCache, KvFormat, KvStore, Projections, RopeTable, Rows,
    Workspace,
};
use fp4spec::kernels::compare::compare_bf16;
use fp4spec::kernels::norm::{self, ResidualWriter};
use fp4spec::rng::SplitMix64;
use half::bf16;

#[test]
fn rms_norm_residual_matches_the_reference() {
    let Some(gpu) = cuda("rms_norm_residual_matches_the_reference") else {
        return;
    };
    let mut rng = rng("norm");
    for (rows, dim) in [(1, 2048), (7, 2048), (64, 2048), (3, 100), (5, 4096)] {
        let residual = rng.normal_vec(rows * dim, 1.0);
        let delta = random_bf16(&mut rng, rows * dim);
        let weight = rng.normal_vec(dim, 0.3);
        // three norms in a row over one residual, as a decoder's: the first adds the delta (the
        // residual uploaded: Earlier), the second reads what the first wrote (PreviousKernel,
        // no delta: it writes nothing), the third adds the delta again to the residual the first
        // wrote two launches back (Earlier: read before its wait)
        let steps = [
            (true, ResidualWriter::Earlier),
            (false, ResidualWriter::PreviousKernel),
            (true, ResidualWriter::Earlier),
        ];
        let run = |backend: &Backend| -> (Vec<f32>, Vec<Vec<bf16>>) {
            let mut r = backend.upload(&residual).expect("upload");
            let d = backend.upload(&delta).expect("upload");
            let w = backend.upload(&weight).expect("upload");
            let mut outs = Vec::new();
            for &(with_delta, written_by) in &steps {
                let mut out = backend
                    .upload(&vec![bf16::NAN; rows * dim])
                    .expect("upload");
                norm::rms_norm_residual(
                    backend,
                    &mut r,
                    written_by,
                    with_delta.then_some(&d),
                    &w,
                    1e-6,
                    &mut out,
                    rows,
                )
                .expect("norm");
                outs.push(out);
            }
            (
                backend.download(&r).expect("r"),
                outs.iter()
                    .map(|o| backend.download(o).expect("out"))
                    .collect(),
            )
        };
        let (cpu_r, cpu_outs) = run(&Backend::Cpu);
        let (gpu_r, gpu_outs) = run(gpu);
        // the residual sums are fp32 additions per element on both sides: exact
        assert!(
            cpu_r
                .iter()
                .zip(&gpu_r)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "[{rows}, {dim}]: residual differs"
        );
        for (i, (cpu_out, gpu_out)) in cpu_outs.iter().zip(&gpu_outs).enumerate() {
            let want: Vec<f32> = cpu_out.iter().map(|v| v.to_f32()).collect();
            let agreement = compare_bf16(gpu_out, &want);
            let (with_delta, written_by) = steps[i];
            println!("norm [{rows}, {dim}] {i}: delta {with_delta}, {written_by:?}: {agreement}");
            assert!(agreement.passed(), "norm [{rows}, {dim}] {i}: {agreement}");
        }
    }
}

/// One attention layer's step on a backend: history rows fill the cache, then the test rows run
/// prepare + attend. Returns (q, keys, out).
struct Scenario {
    shape: AttentionShape,
    format: KvFormat,
    rotary_dim: usize,
    capacity: usize,
    /// (slot, first position, rows) of the history pass, then of the test pass.
    history: Vec<(u32, u32, usize)>,
    step: Vec<(u32, u32, usize)>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

fn rows_of(plan: &[(u32, u32, usize)]) -> (Vec<u32>, Vec<u32>) {
    let mut slots = Vec::new();
    let mut positions = Vec::new();
    for &(slot, first, n) in plan {
        for i in 0..n as u32 {
            slots.push(slot);
            positions.push(first + i);
        }
    }
    (slots, positions)
}

struct Inputs {
    q_gate: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
}

fn inputs(rng: &mut SplitMix64, shape: AttentionShape, rows: usize) -> Inputs {
    Inputs {
        q_gate: random_bf16(rng, rows * shape.heads * 2 * shape.head_dim),
        k: random_bf16(rng, rows * shape.kv_heads * shape.head_dim),
        v: random_bf16(rng, rows * shape.kv_heads * shape.head_dim),
    }
}

/// The cached keys as stored: bf16 values or e4m3 codes.
enum CachedKeys {
    Bf16(Vec<bf16>),
    Fp8(Vec<u8>),
}

/// Each row's `[q_gate | k | v]` side by side, as one GEMM of the three projections writes them.
fn fused_rows(shape: AttentionShape, data: &Inputs) -> Vec<bf16> {
    let (q_width, kv_width) = (shape.q_gate_width(), shape.kv_width());
    data.q_gate
        .chunks_exact(q_width)
        .zip(data.k.chunks_exact(kv_width))
        .zip(data.v.chunks_exact(kv_width))
        .flat_map(|((q, k), v)| q.iter().chain(k).chain(v).copied())
        .collect()
}

/// The scenario's two passes on `backend`: the projections as three matrices (`fused` false) or
/// as the column ranges of one (`fused`: q_gate, k and v at a row stride wider than each).
fn run(
    backend: &Backend,
    decode: DecodeKernel,
    s: &Scenario,
    history: &Inputs,
    step: &Inputs,
    fused: bool,
) -> (Vec<f32>, CachedKeys, Vec<bf16>) {
    let shape = s.shape;
    let rope = RopeTable::new(backend, s.rotary_dim, 1e7, s.capacity).expect("rope");
    let q_norm = backend.upload(&s.q_norm).expect("q_norm");
    let k_norm = backend.upload(&s.k_norm).expect("k_norm");
    let layer = GatedAttention {
        shape,
        q_norm: &q_norm,
        k_norm: &k_norm,
        eps: 1e-6,
        rope: &rope,
    };
    let slots = 1 + s
        .history
        .iter()
        .chain(&s.step)
        .map(|p| p.0)
        .max()
        .unwrap_or(0) as usize;
    let mut cache = KvCache::new(backend, shape, slots, s.capacity, s.format).expect("cache");
    let mut last = None;
    for (plan, data) in [(&s.history, history), (&s.step, step)] {
        let (slot, position) = rows_of(plan);
        let rows = Rows {
            count: slot.len(),
            slot: backend.upload(&slot).expect("slots"),
            position: backend.upload(&position).expect("positions"),
        };
        let n = rows.count;
        let upload = |v: &[bf16]| backend.upload(v).expect("projections");
        let buffers = if fused {
            vec![upload(&fused_rows(shape, data))]
        } else {
            vec![upload(&data.q_gate), upload(&data.k), upload(&data.v)]
        };
        let projections = match &buffers[..] {
            [qkv] => Projections::fused(shape, qkv),
            [q_gate, k, v] => Projections::separate(shape, q_gate, k, v),
            _ => unreachable!("one or three buffers"),
        };
        let mut q = backend
            .upload(&vec![f32::NAN; n * shape.heads * shape.head_dim])
            .expect("q");
        attention::prepare(backend, &layer, &projections, &rows, &mut cache, &mut q)
            .expect("prepare");
        let mut workspace = Workspace::new(backend, shape, n, s.capacity).expect("workspace");
        let mut out = backend
            .upload(&vec![bf16::NAN; n * shape.heads * shape.head_dim])
            .expect("out");
        attention::attend_with(
            backend,
            decode,
            shape,
            &q,
            projections.q_gate,
            &cache,
            &rows,
            &mut workspace,
            &mut out,
        )
        .expect("attend");
        last = Some((
            backend.download(&q).expect("q"),
            backend.download(&out).expect("out"),
        ));
    }
    let (q, out) = last.expect("two passes");
    let keys = match &cache.keys {
        KvStore::Bf16(k) => CachedKeys::Bf16(backend.download(k).expect("keys")),
        KvStore::Fp8(k) => CachedKeys::Fp8(backend.download(k).expect("keys")),
    };
    (q, keys, out)
}

/// e4m3 codes of the same values computed twice (fp32 norm and rotation in another order): equal,
/// or neighbours where the value sat on a rounding boundary, which must be rare.
fn check_fp8_codes(test: &str, got: &[u8], want: &[u8]) {
    let order = |c: u8| -> i32 {
        let magnitude = i32::from(c & 0x7f);
        if c & 0x80 != 0 { -magnitude } else { magnitude }
    };
    let mut differ = 0usize;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g != w {
            differ += 1;
            assert!(
                (order(g) - order(w)).abs() <= 1,
                "{test}: cached key {i}: code {g:#04x} against {w:#04x}"
            );
        }
    }
    println!(
        "{test}: cached e4m3 keys: {differ} of {} one code apart",
        want.len()
    );
    assert!(
        differ * 1000 <= want.len(),
        "{test}: {differ} cached keys differ"
    );
}

fn check(test: &str, s: Scenario) {
    let Some(gpu) = cuda(test) else {
        return;
    };
    let mut rng = rng(test);
    let history_rows: usize = s.history.iter().map(|p| p.2).sum();
    let step_rows: usize = s.step.iter().map(|p| p.2).sum();
    let history = inputs(&mut rng, s.shape, history_rows);
    let step = inputs(&mut rng, s.shape, step_rows);
    let (cpu_q, cpu_keys, cpu_out) = run(
        &Backend::Cpu,
        DecodeKernel::Warp,
        &s,
        &history,
        &step,
        false,
    );
    let target = gpu.target().expect("a device target");
    for decode in [DecodeKernel::Warp, DecodeKernel::Mma] {
        if !decode.runs_on(target) {
            continue;
        }
        let test = format!("{test} ({})", decode.name());
        // the layout of the model's fused [q; k; v] GEMM (the CPU reference reads three
        // matrices): the kernels' row strides wider than each projection
        let (gpu_q, gpu_keys, gpu_out) = run(gpu, decode, &s, &history, &step, true);
        // fp32 norm and rotation on both sides, in another order: a few ulps of the row's scale
        // (relative to the element alone, an element near zero failed now and then on fresh
        // seeds: 1.19e-4 against the 1e-4 once allowed)
        let q_rms = (cpu_q.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>()
            / cpu_q.len().max(1) as f64)
            .sqrt();
        let q_err = cpu_q
            .iter()
            .zip(&gpu_q)
            .map(|(a, b)| f64::from((a - b).abs()) / (f64::from(a.abs()) + 1e-2 * q_rms))
            .fold(0.0, f64::max);
        println!("{test}: q max error {q_err:.2e} of |q| + 1e-2 rms");
        assert!(
            q_err < 1e-4 && gpu_q.iter().all(|v| v.is_finite()),
            "{test}: q off by {q_err:.2e}"
        );
        match (&cpu_keys, &gpu_keys) {
            (CachedKeys::Bf16(cpu_keys), CachedKeys::Bf16(gpu_keys)) => {
                let want_keys: Vec<f32> = cpu_keys.iter().map(|v| v.to_f32()).collect();
                let keys = compare_bf16(gpu_keys, &want_keys);
                println!("{test}: cached keys {keys}");
                assert!(keys.passed(), "{test}: cached keys {keys}");
            }
            (CachedKeys::Fp8(cpu_keys), CachedKeys::Fp8(gpu_keys)) => {
                check_fp8_codes(&test, gpu_keys, cpu_keys)
            }
            _ => panic!("{test}: the CPU and GPU caches differ in format"),
        }
        let want: Vec<f32> = cpu_out.iter().map(|v| v.to_f32()).collect();
        let agreement = compare_bf16(&gpu_out, &want);
        println!("{test}: gated output {agreement}");
        assert!(agreement.passed(), "{test}: gated output {agreement}");
    }
}

fn norms(rng: &mut SplitMix64, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    (rng.normal_vec(head_dim, 0.3), rng.normal_vec(head_dim, 0.3))
}

#[test]
fn attention_real_shape_decode_verify_prefill() {
    check(
        "attention_real_shape_decode_verify_prefill",
        real_shape_scenario(KvFormat::Bf16, 1),
    );
}

/// Qwen3.6's head shape (16 query heads over 2 KV heads of 256), the cache in `format`, norms
/// from `seed`.
fn real_shape_scenario(format: KvFormat, seed: u64) -> Scenario {
    let (q_norm, k_norm) = norms(&mut SplitMix64::new(seed), 256);
    Scenario {
        shape: AttentionShape {
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
        },
        format,
        rotary_dim: 64,
        capacity: 1300,
        // slot 0: 1100 tokens of context (5 splits), slot 1: 500, slot 2: empty
        history: vec![(0, 0, 1100), (1, 0, 500)],
        // a decode row, three verify rows, a 37-token prefill
        step: vec![(0, 1100, 1), (1, 500, 3), (2, 0, 37)],
        q_norm,
        k_norm,
    }
}

/// A context of more than 32 splits: each lane of the combine merges several splits' (max, sum)
/// and each warp several accumulator slices, the combine's loops past their first round. A small
/// head shape, since the CPU reference runs the history's prefill, quadratic in its length (4150
/// positions of the real shape kept a test thread busy for minutes).
#[test]
fn attention_long_context_many_splits() {
    let (q_norm, k_norm) = norms(&mut SplitMix64::new(5), 32);
    check(
        "attention_long_context_many_splits",
        Scenario {
            shape: AttentionShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
            },
            format: KvFormat::Bf16,
            rotary_dim: 16,
            capacity: 2300,
            history: vec![(0, 0, 2200)],
            // a decode row and its draft: 35 splits of 64 positions (sm_90a), 69 of 32 (sm_121a)
            step: vec![(0, 2200, 2)],
            q_norm,
            k_norm,
        },
    );
}

#[test]
fn attention_fp8_cache_real_shape() {
    check(
        "attention_fp8_cache_real_shape",
        real_shape_scenario(KvFormat::FP8_UNIT_SCALES, 3),
    );
}

#[test]
fn attention_fp8_cache_awkward_shapes_and_scales() {
    // key scale 1/128: normed keys of ~1 are stored as ~128, those above 3.5 saturate at 448;
    // value scale 8: values of ~1 are stored as ~0.125, those below 1/8 in e4m3's subnormals
    let format = KvFormat::Fp8E4m3 {
        key_scale: 1.0 / 128.0,
        value_scale: 8.0,
    };
    awkward_shapes(
        "attention_fp8_awkward",
        format,
        &[(6, 6, 96, 96), (12, 1, 160, 40)],
        4,
    );
}

/// Every e4m3 code through the fp8 split kernels on the device, exactly: one cached position
/// (softmax weight 1) whose value row holds the 256 codes, q = 0 and gates of 0, so the output is
/// each code's value times the value scale times sigmoid(0) = 1/2, a bf16 without rounding (NaN
/// codes give NaN). Checks what the emulation cannot: that the device's bf16x2 products keep
/// the subnormal codes.
#[test]
fn attention_fp8_kernels_decode_every_code_exactly() {
    let Some(gpu) = cuda("attention_fp8_kernels_decode_every_code_exactly") else {
        return;
    };
    let shape = AttentionShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 256,
    };
    let value_scale = 2.0;
    let format = KvFormat::Fp8E4m3 {
        key_scale: 1.0,
        value_scale,
    };
    let codes: Vec<u8> = (0..=255u8).collect();
    let target = gpu.target().expect("a device target");
    for decode in [DecodeKernel::Warp, DecodeKernel::Mma] {
        if !decode.runs_on(target) {
            continue;
        }
        let run = || -> fp4spec::Result<Vec<bf16>> {
            let mut cache = KvCache::new(gpu, shape, 1, 4, format)?;
            cache.keys = KvStore::Fp8(gpu.upload(&[0x38u8; 4 * 256])?); // 1.0
            let mut values = vec![0u8; 4 * 256];
            values[..256].copy_from_slice(&codes);
            cache.values = KvStore::Fp8(gpu.upload(&values)?);
            let rows = Rows {
                count: 1,
                slot: gpu.upload(&[0u32])?,
                position: gpu.upload(&[0u32])?,
            };
            let q = gpu.upload(&vec![0.0f32; 4 * 256])?;
            let q_gate = gpu.upload(&vec![bf16::ZERO; 4 * 512])?;
            let q_gate = Bf16Rows::packed(&q_gate, 4 * 512);
            let mut workspace = Workspace::new(gpu, shape, 1, 4)?;
            // poisoned: codes 0x00 and 0x80 decode to +-0, which an unwritten zero would match
            let mut out: DeviceVec<bf16> = gpu.upload(&vec![bf16::NAN; 4 * 256])?;
            attention::attend_with(
                gpu,
                decode,
                shape,
                &q,
                q_gate,
                &cache,
                &rows,
                &mut workspace,
                &mut out,
            )?;
            gpu.download(&out)
        };
        let out = run().expect("attend");
        for h in 0..4 {
            for (&c, got) in codes.iter().zip(&out[h * 256..(h + 1) * 256]) {
                let want = e4m3_decode(c) * value_scale * 0.5;
                assert!(
                    got.to_f32() == want || (got.is_nan() && want.is_nan()),
                    "{}: code {c:#04x} gave {got}, want {want}",
                    decode.name()
                );
            }
        }
        println!("{}: all 256 e4m3 codes exact", decode.name());
    }
}

#[test]
fn attention_awkward_shapes() {
    let shapes = [(4, 2, 32, 8), (6, 6, 96, 96), (12, 1, 160, 40)];
    awkward_shapes("attention_awkward", KvFormat::Bf16, &shapes, 2);
}

/// [`check`] of each (heads, kv_heads, head_dim, rotary_dim) in `shapes` with its cache in
/// `format`: a row at the start of slot 0, two after 257 tokens of slot 1, five more of slot 0.
fn awkward_shapes(
    test: &str,
    format: KvFormat,
    shapes: &[(usize, usize, usize, usize)],
    seed: u64,
) {
    for &(heads, kv_heads, head_dim, rotary_dim) in shapes {
        let (q_norm, k_norm) = norms(&mut SplitMix64::new(seed), head_dim);
        check(
            &format!("{test}_{heads}x{kv_heads}x{head_dim}"),
            Scenario {
                shape: AttentionShape {
                    heads,
                    kv_heads,
                    head_dim,
                },
                format,
                rotary_dim,
                capacity: 600,
                history: vec![(1, 0, 257)],
                step: vec![(0, 0, 1), (1, 257, 2), (0, 1, 5)],
                q_norm,
                k_norm,
            },
        );
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let Some(gpu) = cuda("attention_rejects_bad_shapes") else {
        return;
    };
    let shape = AttentionShape {
        heads: 34,
        kv_heads: 2,
        head_dim: 64,
    };
    let err = Workspace::new(gpu, shape, 1, 10)
        .and_then(|mut w| {
            let rows = Rows {
                count: 1,
                slot: gpu.upload(&[0u32])?,
                position: gpu.upload(&[0u32])?,
            };
            let cache = KvCache::new(gpu, shape, 1, 10, KvFormat::Bf16)?;
            let q = gpu.upload(&vec![0.0f32; 34 * 64])?;
            let q_gate = gpu.upload(&vec![bf16::ZERO; 34 * 128])?;
            let q_gate = Bf16Rows::packed(&q_gate, 34 * 128);
            let mut out: DeviceVec<bf16> = gpu.zeros(34 * 64)?;
            attention::attend(gpu, shape, &q, q_gate, &cache, &rows, &mut w, &mut out)
        })
        .expect_err("a group of 17 query heads per KV head");
    assert!(err.to_string().contains("groups of 1..=16"), "{err}");
}
