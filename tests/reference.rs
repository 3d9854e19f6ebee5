//! The CPU references and the launch API on the CPU backend: shapes, errors, and the references
//! against independent straightforward formulas.

use fp4spec::Error;
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::{Nvfp4Weights, chain, compare, dequant, gemm};
use fp4spec::rng::SplitMix64;
use half::bf16;

fn random_matrix(rng: &mut SplitMix64, n: usize, k: usize) -> Nvfp4Matrix {
    Nvfp4Matrix::quantize("w", &rng.normal_vec(n * k, 0.05), n, k).expect("finite")
}

fn random_bf16(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

#[test]
fn dequant_reference_is_the_matrix_rounded_to_bf16() {
    let mut rng = SplitMix64::new(1);
    let q = random_matrix(&mut rng, 7, 48);
    let got = dequant::reference::dequant_nvfp4_bf16(q.view());
    let want: Vec<bf16> = q.dequantize().into_iter().map(bf16::from_f32).collect();
    assert_eq!(got, want);
}

#[test]
fn gemm_reference_matches_a_dense_product() {
    let mut rng = SplitMix64::new(2);
    let (m, n, k) = (3, 5, 32);
    let q = random_matrix(&mut rng, n, k);
    let x = random_bf16(&mut rng, m * k);
    let dense = q.dequantize();
    let got = gemm::reference::nvfp4_gemm_f32(&x, m, q.view());
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|c| x[i * k + c].to_f64() * dense[j * k + c] as f64)
                .sum();
            assert!(
                (got[i * n + j] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "[{i},{j}]"
            );
        }
    }
}

#[test]
fn cpu_backend_runs_the_references_through_the_launch_api() {
    let backend = Backend::Cpu;
    let mut rng = SplitMix64::new(3);
    let (m, n, k) = (4, 9, 64);
    let q = random_matrix(&mut rng, n, k);
    let x = random_bf16(&mut rng, m * k);
    let w = Nvfp4Weights::upload(&backend, &q).expect("upload");
    let x_dev = backend.upload(&x).expect("upload");
    let mut y = backend.zeros::<bf16>(m * n).expect("zeros");
    gemm::nvfp4_gemm(&backend, &x_dev, m, &w, &mut y).expect("gemm");
    let y = backend.download(&y).expect("download");
    let agreement = compare::compare_bf16(&y, &gemm::reference::nvfp4_gemm_f32(&x, m, q.view()));
    assert!(agreement.passed(), "{agreement}");

    let mut out = backend.zeros::<bf16>(n * k).expect("zeros");
    dequant::dequant_nvfp4(&backend, &w, &mut out).expect("dequant");
    assert_eq!(
        backend.download(&out).expect("download"),
        dequant::reference::dequant_nvfp4_bf16(q.view())
    );
}

#[test]
fn wrong_buffer_lengths_are_errors_naming_the_operand() {
    let backend = Backend::Cpu;
    let mut rng = SplitMix64::new(4);
    let q = random_matrix(&mut rng, 8, 32);
    let w = Nvfp4Weights::upload(&backend, &q).expect("upload");
    let x = backend
        .upload(&random_bf16(&mut rng, 2 * 32))
        .expect("upload");
    let mut y = backend.zeros::<bf16>(3 * 8).expect("zeros");
    let err = gemm::nvfp4_gemm(&backend, &x, 3, &w, &mut y).unwrap_err();
    assert!(
        err.to_string().contains("gemm input X") && err.to_string().contains("[3, 32]"),
        "{err}"
    );
    let mut y = backend.zeros::<bf16>(2 * 7).expect("zeros");
    let err = gemm::nvfp4_gemm(&backend, &x, 2, &w, &mut y).unwrap_err();
    assert!(err.to_string().contains("gemm output Y"), "{err}");
    let mut out = backend.zeros::<bf16>(5).expect("zeros");
    let err = dequant::dequant_nvfp4(&backend, &w, &mut out).unwrap_err();
    assert!(err.to_string().contains("dequant output"), "{err}");
}

#[test]
fn a_malformed_matrix_is_rejected_at_upload() {
    let mut q = random_matrix(&mut SplitMix64::new(5), 2, 32);
    q.scales.pop();
    let err = Nvfp4Weights::upload(&Backend::Cpu, &q)
        .err()
        .expect("rejected");
    assert!(matches!(err, Error::Invalid { .. }), "{err}");
}

/// The weights' fields are public: buffers changed after the upload are refused by the launches
/// that read them, not read past their end.
#[test]
fn weights_whose_buffers_disagree_with_their_shape_are_refused() {
    let backend = Backend::Cpu;
    let q = random_matrix(&mut SplitMix64::new(9), 4, 32);
    let mut w = Nvfp4Weights::upload(&backend, &q).expect("upload");
    w.packed = backend.upload(&[0u8; 8]).expect("upload");
    let x: DeviceVec<bf16> = backend.upload(&[bf16::ONE; 32]).expect("upload");
    let mut y = backend.zeros::<bf16>(4).expect("zeros");
    let err = gemm::nvfp4_gemm(&backend, &x, 1, &w, &mut y).expect_err("short packed");
    assert!(err.to_string().contains("64 packed bytes"), "{err}");
    let mut out = backend.zeros::<bf16>(4 * 32).expect("zeros");
    let err =
        fp4spec::kernels::dequant::dequant_nvfp4(&backend, &w, &mut out).expect_err("short packed");
    assert!(err.to_string().contains("NVFP4 weights"), "{err}");
}

#[test]
fn zero_rows_is_a_no_op() {
    let backend = Backend::Cpu;
    let q = random_matrix(&mut SplitMix64::new(6), 4, 16);
    let w = Nvfp4Weights::upload(&backend, &q).expect("upload");
    let x: DeviceVec<bf16> = backend.upload(&[]).expect("upload");
    let mut y = backend.zeros::<bf16>(0).expect("zeros");
    gemm::nvfp4_gemm(&backend, &x, 0, &w, &mut y).expect("empty gemm");
}

#[test]
fn compare_rejects_wrong_and_non_finite_outputs() {
    let want = vec![1.0f32, -2.0, 3.0, 0.5];
    let exact: Vec<bf16> = want.iter().map(|v| bf16::from_f32(*v)).collect();
    assert!(compare::compare_bf16(&exact, &want).passed());
    let mut off = exact.clone();
    off[2] = bf16::from_f32(3.1);
    assert!(!compare::compare_bf16(&off, &want).passed());
    let mut nan = exact.clone();
    nan[0] = bf16::NAN;
    assert!(!compare::compare_bf16(&nan, &want).passed());
    // a non-finite reference: matched only by the same value, and it does not widen the
    // other elements' allowances
    for bad in [f32::NAN, f32::INFINITY] {
        let mut want_bad = want.clone();
        want_bad[1] = bad;
        let mut got = exact.clone();
        got[1] = bf16::from_f32(bad);
        assert!(
            compare::compare_bf16(&got, &want_bad).passed(),
            "{bad} for {bad}"
        );
        got[1] = bf16::from_f32(-2.0);
        assert!(
            !compare::compare_bf16(&got, &want_bad).passed(),
            "-2 for {bad}"
        );
        got[1] = bf16::from_f32(bad);
        got[2] = bf16::from_f32(30.0);
        assert!(
            !compare::compare_bf16(&got, &want_bad).passed(),
            "30 for 3 beside {bad}"
        );
    }
}

#[test]
fn max_difference_keeps_non_finite_elements() {
    let want = [1.0f32, -4.0, 2.0];
    assert_eq!(
        compare::max_difference(&[1.5, -4.0, 2.0], &want),
        (0.5, 0.125)
    );
    // what a bound of 1 on either figure makes of it
    let fails = |v: f64| v.is_nan() || v > 1.0;
    for bad in [f32::NAN, f32::INFINITY] {
        let (largest, relative) = compare::max_difference(&[1.0, bad, 2.0], &want);
        assert!(
            fails(largest) && fails(relative),
            "{bad}: {largest} {relative}"
        );
        let (largest, relative) = compare::max_difference(&want, &[1.0, bad, 2.0]);
        assert!(
            fails(largest) && fails(relative),
            "{bad} wanted: {largest} {relative}"
        );
    }
}

#[test]
fn backend_kind_parses_and_rejects_unknown_names() {
    assert!("cuda".parse::<fp4spec::backend::BackendKind>().is_ok());
    let err = "rocm".parse::<fp4spec::backend::BackendKind>().unwrap_err();
    assert!(err.to_string().contains("rocm"), "{err}");
}

#[test]
fn chain_links_count_on_the_cpu_backend_and_bad_links_are_refused() {
    let backend = Backend::Cpu;
    let mut values = backend.upload(&[5u32, 0, 0, 0]).expect("upload");
    for i in 1..4 {
        chain::link(&backend, &mut values, i, 1, 32).expect("link");
    }
    assert_eq!(backend.download(&values).expect("download"), [5, 6, 7, 8]);
    for (index, blocks, threads) in [(0, 1, 32), (4, 1, 32), (1, 0, 32), (1, 1, 0), (1, 1, 1025)] {
        let err = chain::link(&backend, &mut values, index, blocks, threads)
            .expect_err("a bad link is an error");
        assert!(err.to_string().contains("chain link"), "{err}");
    }
    let err = chain::dependent_launch_seconds(&backend, chain::Handover::Counter, 10, 1, 32, 3)
        .expect_err("the CPU backend times no launches");
    assert!(err.to_string().contains("runs no kernels"), "{err}");
}

#[test]
fn polled_chain_links_count_and_rearm_their_counters_on_the_cpu_backend() {
    let backend = Backend::Cpu;
    let links = 5;
    let mut values = backend.upload(&[0u32; 6]).expect("upload");
    let mut counters = backend.upload(&[4u32, 0, 0, 0, 0, 0]).expect("upload");
    for run in 0..2 {
        for i in 1..=links {
            chain::link_polled(&backend, &mut values, &mut counters, i, links, 4, 64)
                .expect("polled link");
        }
        assert_eq!(
            backend.download(&values).expect("values"),
            [0, 1, 2, 3, 4, 5]
        );
        // every counter but the host's and the last two's rearmed by the link two on
        assert_eq!(
            backend.download(&counters).expect("counters"),
            [4, 0, 0, 0, 4, 4],
            "run {run}"
        );
    }
    let mut short = backend.upload(&[0u32; 3]).expect("upload");
    let mut short_counters = backend.upload(&[1u32, 0, 0]).expect("upload");
    let err = chain::link_polled(&backend, &mut short, &mut short_counters, 1, 2, 1, 32)
        .expect_err("a polled chain of 2 links cannot rearm");
    assert!(err.to_string().contains("polled chain"), "{err}");
}

/// attention::attend refuses a KV cache or workspace made for another layer shape (a larger one
/// would have the kernels run past their buffers) and, on the CPU, a row whose position is past
/// the cache, instead of reading another slot's keys.
#[test]
fn attention_refuses_caches_of_another_shape_and_rows_past_the_cache() {
    use fp4spec::kernels::Bf16Rows;
    use fp4spec::kernels::attention::reference::AttentionShape;
    use fp4spec::kernels::attention::{self, KvCache, KvFormat, Rows, Workspace};
    let cpu = Backend::Cpu;
    let shape = AttentionShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let wider = AttentionShape {
        kv_heads: 4,
        ..shape
    };
    let attend = |cache_shape, position: u32| -> fp4spec::Result<()> {
        let rows = Rows {
            count: 1,
            slot: cpu.upload(&[0u32])?,
            position: cpu.upload(&[position])?,
        };
        let cache = KvCache::new(&cpu, cache_shape, 1, 8, KvFormat::Bf16)?;
        let mut workspace = Workspace::new(&cpu, shape, 1, 8)?;
        let q = cpu.upload(&vec![0.0f32; 4 * 64])?;
        let q_gate = cpu.upload(&vec![bf16::ZERO; 4 * 128])?;
        let q_gate = Bf16Rows::packed(&q_gate, 4 * 128);
        let mut out: DeviceVec<bf16> = cpu.zeros(4 * 64)?;
        attention::attend(
            &cpu,
            shape,
            &q,
            q_gate,
            &cache,
            &rows,
            &mut workspace,
            &mut out,
        )
    };
    attend(shape, 7).expect("the last position of the cache");
    let err = attend(wider, 0).expect_err("a cache of another shape");
    assert!(err.to_string().contains("attention KV cache"), "{err}");
    let err = attend(shape, 8).expect_err("a position past the cache");
    assert!(err.to_string().contains("position 8"), "{err}");
}
