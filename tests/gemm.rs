//! The tensor-core GEMM's weight layouts and launch plan, on the CPU: the fragments decode back
//! to the source matrix, and an emulation of exactly the kernel's data flow (fragment loads,
//! bit-trick decode, bf16 scale products, the K permutation, MMA tiles) reproduces the
//! reference product.

use fp4spec::backend::Backend;
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::compare;
use fp4spec::kernels::gemm::layout::{Bf16Fragments, GROUP_COLS, Nvfp4Fragments, RowOrder};
use fp4spec::kernels::gemm::{self, Epilogue, Linear, reference};
use fp4spec::rng::SplitMix64;
use half::bf16;
use proptest::prelude::*;

fn matrix(rng: &mut SplitMix64, n: usize, k: usize) -> Nvfp4Matrix {
    let mut q = Nvfp4Matrix::quantize("w", &rng.normal_vec(n * k, 0.05), n, k).expect("finite");
    // awkward scales: zero, subnormal, maximal and negative
    for (i, byte) in [0x00u8, 0x01, 0x06, 0x7e, 0xb0].into_iter().enumerate() {
        let at = (rng.next_u64() as usize + i) % q.scales.len();
        q.scales[at] = byte;
    }
    q
}

fn bf16_vec(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

proptest! {
    #[test]
    fn nvfp4_fragments_decode_to_the_matrix(n in 1usize..40, blocks in 1usize..9, seed in any::<u64>(), gate_up in any::<bool>()) {
        let n = if gate_up { n * 2 } else { n };
        let k = blocks * 16;
        let q = matrix(&mut SplitMix64::new(seed), n, k);
        let order = if gate_up { RowOrder::GateUp } else { RowOrder::Plain };
        let f = Nvfp4Fragments::new(&q, order).expect("layout");
        let view = q.view();
        for r in 0..n {
            for c in 0..k {
                prop_assert_eq!(f.value(r, c), view.value(r, c), "[{}, {}]", r, c);
            }
        }
    }
}

/// bf16x2 of e2m1 * 2^-126 of A register `register` of an MMA word: the kernel's bit trick
/// (common/mma.cuh, e2m1_word_to_bf16x2_scaled), written out here.
fn e2m1x2_scaled(w: u32, register: usize) -> [f32; 2] {
    const CODES: u32 = 0x81C0_81C0;
    const MANTISSAS: u32 = 0x0040_0040;
    let bits = match register {
        0 => w & CODES,
        1 => w.rotate_left(4) & CODES,
        2 => w.rotate_left(10) & CODES,
        _ => (w.rotate_left(6) & MANTISSAS) | (w.rotate_left(14) & CODES & !MANTISSAS),
    };
    [
        f32::from_bits((bits & 0xffff) << 16),
        f32::from_bits(bits & 0xffff_0000),
    ]
}

/// bf16 of s * 2^119 from the e5m3 byte (the kernel's multiply-add).
fn scale_scaled(byte: u32) -> f32 {
    let bits = byte * 0x0010 + 0x7600;
    f32::from_bits(bits << 16)
}

fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// The kernel's A operand value for (tile row, actual K column) of one group, decoded the way
/// the kernel does it: e2m1 * 2^-126 times s * 2^119, rounded to bf16 (exact by design).
fn kernel_weight(
    f: &Nvfp4Fragments,
    tile: usize,
    group: usize,
    tile_row: usize,
    col_in_group: usize,
) -> f32 {
    let (t, c) = (col_in_group / 16, col_in_group % 16);
    let lane = (tile_row % 8) * 4 + t;
    let upper = tile_row >= 8;
    let index = f.grid.lane_index(tile, group, lane);
    let word = f.words[index * 4 + c / 4];
    let register = 2 * ((c % 4) / 2) + usize::from(upper);
    let pair = e2m1x2_scaled(word, register);
    let scale = scale_scaled(u32::from(
        (f.scales[index] >> if upper { 8 } else { 0 }) as u8,
    ));
    round_bf16(pair[c % 2] * scale)
}

/// Emulates `gemm_nvfp4_bf16_mma_*`: per tile and group, the A operand from the fragments, the
/// product accumulated in f64 (the MMA's fp32 order is not modelled), times alpha.
fn emulate_nvfp4(f: &Nvfp4Fragments, x: &[bf16], m: usize) -> Vec<f32> {
    let k = f.grid.cols;
    let mut y = vec![0.0f32; m * f.grid.rows];
    for tile in 0..f.grid.n_tiles {
        for tile_row in 0..16 {
            let Some(row) = f.grid.row_order.source_row(f.grid.rows, tile, tile_row) else {
                continue;
            };
            for i in 0..m {
                let mut acc = 0.0f64;
                for group in 0..f.grid.k_groups {
                    for c in 0..GROUP_COLS {
                        let col = group * GROUP_COLS + c;
                        if col >= k {
                            continue;
                        }
                        acc += kernel_weight(f, tile, group, tile_row, c) as f64
                            * x[i * k + col].to_f64();
                    }
                }
                y[i * f.grid.rows + row] = (acc * (f.global_scale as f64 * 128.0)) as f32;
            }
        }
    }
    y
}

#[test]
fn the_kernel_decode_is_exact_for_every_nibble_and_scale() {
    for scale_byte in (0u8..=0x7e).filter(|b| *b != 0) {
        let s = fp4spec::formats::nvfp4::e4m3_decode(scale_byte);
        let q = Nvfp4Matrix {
            rows: 1,
            cols: 16,
            packed: (0u8..8).map(|i| (2 * i) | ((2 * i + 1) << 4)).collect(),
            scales: vec![scale_byte],
            global_scale: 1.0,
            input_scale: None,
        };
        let f = Nvfp4Fragments::new(&q, RowOrder::Plain).expect("layout");
        for c in 0..16 {
            let got = kernel_weight(&f, 0, 0, 0, c) * 128.0;
            let want = fp4spec::formats::nvfp4::e2m1_decode(c as u8) * s;
            assert_eq!(got, want, "scale {scale_byte:#x} nibble {c:#x}");
        }
    }
}

#[test]
fn the_emulated_kernel_matches_the_reference() {
    let mut rng = SplitMix64::new(11);
    for (m, n, k) in [(1, 16, 16), (3, 40, 80), (9, 37, 208), (17, 64, 128)] {
        let q = matrix(&mut rng, n, k);
        let x = bf16_vec(&mut rng, m * k);
        let f = Nvfp4Fragments::new(&q, RowOrder::Plain).expect("layout");
        let got: Vec<bf16> = emulate_nvfp4(&f, &x, m)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let agreement = compare::compare_bf16(&got, &reference::nvfp4_gemm_f32(&x, m, q.view()));
        assert!(agreement.passed(), "M={m} N={n} K={k}: {agreement}");
    }
}

#[test]
fn bf16_fragments_hold_each_element_once_in_register_order() {
    let (n, k) = (24, 80);
    // distinct, finite, nonzero bit patterns (padding is zero): any misplaced element shows
    let values: Vec<bf16> = (0..n * k).map(|i| bf16::from_bits(1 + i as u16)).collect();
    let f = Bf16Fragments::new(&values, n, k, RowOrder::Plain).expect("layout");
    let mut seen = vec![0u32; n * k];
    for tile in 0..f.grid.n_tiles {
        for group in 0..f.grid.k_groups {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                let index = f.grid.lane_index(tile, group, lane);
                for j in 0..4 {
                    for r in 0..4 {
                        let word = f.words[Bf16Fragments::word_index(index, j, r)];
                        let row = tile * 16 + g + 8 * (r % 2);
                        let col = group * 64 + 16 * t + 4 * j + 2 * (r / 2);
                        for (half, c) in [(word & 0xffff, col), (word >> 16, col + 1)] {
                            if row < n && c < k {
                                assert_eq!(
                                    half as u16,
                                    values[row * k + c].to_bits(),
                                    "[{row}, {c}]"
                                );
                                seen[row * k + c] += 1;
                            } else {
                                assert_eq!(half, 0, "padding must be zero");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(seen.iter().all(|&s| s == 1));
}

#[test]
fn mma_plans_fill_the_machine_without_empty_splits() {
    // H200: 132 SMs x 16 warps = 2112 warps wanted
    // lm_head: 15520 tiles, one warp each
    assert_eq!(
        gemm::mma_plan(15520, 32, 8, 132, 16, 8),
        gemm::MmaPlan {
            warps_per_tile: 1,
            splits: 1,
            groups_per_split: 32
        }
    );
    // (8192, 2048): 512 tiles -> 8 warps per tile, no split
    assert_eq!(
        gemm::mma_plan(512, 32, 8, 132, 16, 8),
        gemm::MmaPlan {
            warps_per_tile: 8,
            splits: 1,
            groups_per_split: 32
        }
    );
    // (12288, 2048): 768 tiles -> 4 warps per tile
    assert_eq!(gemm::mma_plan(768, 32, 8, 132, 16, 8).warps_per_tile, 4);
    // (2048, 4096): 128 tiles x 8 warps = 1024 -> split K in 3 (22 + 22 + 20 groups)
    let plan = gemm::mma_plan(128, 64, 8, 132, 16, 8);
    assert_eq!((plan.warps_per_tile, plan.splits), (8, 3), "{plan:?}");
    // K = 16: one group, one split
    assert_eq!(
        gemm::mma_plan(1, 1, 8, 132, 16, 8),
        gemm::MmaPlan {
            warps_per_tile: 8,
            splits: 1,
            groups_per_split: 1
        }
    );
    for (tiles, groups) in [(64, 32), (128, 64), (8, 8), (3, 5), (1, 200), (5000, 2)] {
        let plan = gemm::mma_plan(tiles, groups, 8, 48, 16, 8);
        assert!(
            (plan.splits - 1) * plan.groups_per_split < groups as u32
                && plan.splits * plan.groups_per_split >= groups as u32,
            "{tiles} {groups}: {plan:?}"
        );
        assert!(
            plan.splits == 1 || plan.groups_per_split >= 8,
            "{tiles} {groups}: {plan:?}"
        );
        assert!(plan.warps_per_tile.is_power_of_two() && plan.warps_per_tile <= 8);
    }
}

#[test]
fn linear_on_the_cpu_applies_each_epilogue() {
    let backend = Backend::Cpu;
    let mut rng = SplitMix64::new(12);
    let (m, n, k) = (3, 32, 64);
    let q = matrix(&mut rng, n, k);
    let x = bf16_vec(&mut rng, m * k);
    let x_dev = backend.upload(&x).expect("upload");
    let product = reference::nvfp4_gemm_f32(&x, m, q.view());

    let plain = Linear::nvfp4(&backend, &q, RowOrder::Plain).expect("linear");
    let residual = bf16_vec(&mut rng, m * n);
    let residual_dev = backend.upload(&residual).expect("upload");
    let mut y = backend.zeros::<bf16>(m * n).expect("zeros");
    gemm::linear(
        &backend,
        &x_dev,
        m,
        &plain,
        Epilogue::Residual(&residual_dev),
        &mut y,
    )
    .expect("residual");
    let want = reference::add_residual(&product, &residual);
    assert!(compare::compare_bf16(&backend.download(&y).expect("download"), &want).passed());

    let gate_up = Linear::nvfp4(&backend, &q, RowOrder::GateUp).expect("linear");
    assert_eq!(gate_up.out_features(), n / 2);
    let mut y = backend.zeros::<bf16>(m * n / 2).expect("zeros");
    gemm::linear(&backend, &x_dev, m, &gate_up, Epilogue::SiluMul, &mut y).expect("silu_mul");
    let want = reference::silu_mul(&product, m, n);
    assert!(compare::compare_bf16(&backend.download(&y).expect("download"), &want).passed());

    let err = gemm::linear(&backend, &x_dev, m, &gate_up, Epilogue::None, &mut y).unwrap_err();
    assert!(err.to_string().contains("GateUp"), "{err}");
    let mut y = backend.zeros::<bf16>(m * n).expect("zeros");
    let err = gemm::linear(&backend, &x_dev, m, &plain, Epilogue::SiluMul, &mut y).unwrap_err();
    assert!(err.to_string().contains("GateUp"), "{err}");
    let err = gemm::linear(&backend, &x_dev, m + 1, &plain, Epilogue::None, &mut y).unwrap_err();
    assert!(err.to_string().contains("linear input X"), "{err}");
}

#[test]
fn bf16_linear_on_the_cpu_matches_the_dense_reference() {
    let backend = Backend::Cpu;
    let mut rng = SplitMix64::new(13);
    let (m, n, k) = (2, 20, 48);
    let w = bf16_vec(&mut rng, n * k);
    let x = bf16_vec(&mut rng, m * k);
    let linear = Linear::bf16(&backend, &w, n, k, RowOrder::Plain).expect("linear");
    let x_dev = backend.upload(&x).expect("upload");
    let mut y = backend.zeros::<bf16>(m * n).expect("zeros");
    gemm::linear(&backend, &x_dev, m, &linear, Epilogue::None, &mut y).expect("linear");
    let want = reference::bf16_gemm_f32(&x, m, &w, n, k);
    assert!(compare::compare_bf16(&backend.download(&y).expect("download"), &want).passed());
    assert!(Linear::bf16(&backend, &w, n, k + 1, RowOrder::Plain).is_err());
    assert!(
        Linear::bf16(&backend, &w[..(n - 1) * k], n - 1, k, RowOrder::GateUp).is_err(),
        "odd gate/up rows"
    );
}

// ---- W4A4 (block-scaled FP4 MMA, GB10) ----

use fp4spec::formats::nvfp4::{e2m1_decode, e2m1_half_step, e4m3_decode};
use fp4spec::kernels::gemm::layout::W4a4Fragments;
use fp4spec::kernels::gemm::{Nvfp4Mode, WeightFormat};

#[test]
fn w4a4_fragments_hold_each_code_and_scale_where_the_mma_reads_them() {
    let mut rng = SplitMix64::new(21);
    for (n, k, order) in [(37, 128, RowOrder::Plain), (2 * 21, 192, RowOrder::GateUp)] {
        let q = matrix(&mut rng, n, k);
        let f = W4a4Fragments::new(&q, order).expect("layout");
        let view = q.view();
        for row in 0..n {
            let (tile, tile_row) = order.locate(n, row);
            for col in 0..k {
                let (group, c) = (col / 64, col % 64);
                let (half, t, i) = (c / 32, (c % 32) / 8, c % 8);
                let lane = (tile_row % 8) * 4 + t;
                let index = f.grid.lane_index(tile, group, lane);
                let word = f.words[index * 4 + 2 * half + usize::from(tile_row >= 8)];
                let nibble = ((word >> (4 * i)) & 0xf) as u8;
                let scale_byte = (f.scales[(tile * f.grid.k_groups + group) * 16 + tile_row]
                    >> (8 * (c / 16))) as u8;
                assert!(scale_byte & 0x80 == 0, "ue4m3 has no sign");
                let got = e2m1_decode(nibble) * (e4m3_decode(scale_byte) * f.global_scale);
                assert_eq!(got, view.value(row, col), "[{row}, {col}]");
            }
        }
    }
    let q = matrix(&mut rng, 16, 80);
    assert!(
        W4a4Fragments::new(&q, RowOrder::Plain).is_err(),
        "K = 80 is not a multiple of 64"
    );
}

/// The W4A4 result differs from W4A16 only by the activation quantisation: per output at most
/// sum_k half_step(|x_k| / s_k) * s_k * |w_k|, with s_k the activation block scale times
/// input_scale.
#[test]
fn w4a4_emulation_is_within_the_activation_quantisation_bound_of_w4a16() {
    let mut rng = SplitMix64::new(22);
    for (m, n, k) in [(1, 24, 64), (5, 40, 256), (9, 17, 512)] {
        let q = matrix(&mut rng, n, k);
        let x = bf16_vec(&mut rng, m * k);
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.to_f32().abs()));
        let input_scale = amax / (6.0 * 448.0);
        let w4a4 = reference::nvfp4_w4a4_f32(&x, m, q.view(), input_scale).expect("finite");
        let w4a16 = reference::nvfp4_gemm_f32(&x, m, q.view());
        let xq = reference::quantize_activations(&x, m, k, input_scale).expect("finite");
        let view = q.view();
        let mut tight = 0usize;
        for row in 0..m {
            for col in 0..n {
                let bound: f64 = (0..k)
                    .map(|c| {
                        let s = f64::from(e4m3_decode(xq.scales[row * (k / 16) + c / 16]))
                            * f64::from(input_scale);
                        let v = f64::from(x[row * k + c].to_f32());
                        f64::from(e2m1_half_step((v / s).abs() as f32))
                            * s
                            * f64::from(view.value(col, c)).abs()
                    })
                    .sum();
                let diff = f64::from(w4a4[row * n + col] - w4a16[row * n + col]).abs();
                assert!(
                    diff <= bound * 1.0001 + 1e-6,
                    "M={m} N={n} K={k} [{row}, {col}]: |W4A4 - W4A16| = {diff} > {bound}"
                );
                tight += usize::from(diff > bound * 0.01);
            }
        }
        assert!(
            tight > 0,
            "the quantisation error must be visible, or the emulation skipped quantising"
        );
    }
}

#[test]
fn w4a4_linear_on_the_cpu_runs_the_emulation_and_checks_its_inputs() {
    let backend = Backend::Cpu;
    let mut rng = SplitMix64::new(23);
    let (m, n, k) = (3, 32, 128);
    let mut q = matrix(&mut rng, n, k);
    let x = bf16_vec(&mut rng, m * k);
    let err = Linear::nvfp4_in(&backend, &q, RowOrder::Plain, Nvfp4Mode::W4a4)
        .err()
        .expect("no input_scale");
    assert!(err.to_string().contains("input_scale"), "{err}");
    q.input_scale = Some(0.004);
    let linear = Linear::nvfp4_in(&backend, &q, RowOrder::Plain, Nvfp4Mode::W4a4).expect("W4A4");
    assert_eq!(linear.format(), WeightFormat::Nvfp4W4a4);
    let x_dev = backend.upload(&x).expect("upload");
    let mut y = backend.zeros::<bf16>(m * n).expect("zeros");
    gemm::linear(&backend, &x_dev, m, &linear, Epilogue::None, &mut y).expect("linear");
    let want = reference::nvfp4_w4a4_f32(&x, m, q.view(), 0.004).expect("finite");
    assert!(compare::compare_bf16(&backend.download(&y).expect("download"), &want).passed());
    let gate_up =
        Linear::nvfp4_in(&backend, &q, RowOrder::GateUp, Nvfp4Mode::W4a4).expect("W4A4 gate/up");
    let mut y = backend.zeros::<bf16>(m * n / 2).expect("zeros");
    gemm::linear(&backend, &x_dev, m, &gate_up, Epilogue::SiluMul, &mut y).expect("silu_mul");
    assert!(
        compare::compare_bf16(
            &backend.download(&y).expect("download"),
            &reference::silu_mul(&want, m, n)
        )
        .passed()
    );
}

// ---- the gfx1151 WMMA layouts ----

use fp4spec::kernels::gemm::layout::{WmmaBf16Fragments, WmmaNvfp4Fragments};

#[test]
fn wmma_nvfp4_fragments_decode_to_the_matrix() {
    let mut rng = SplitMix64::new(31);
    for (n, k, order) in [
        (37, 80, RowOrder::Plain),
        (2 * 13, 208, RowOrder::GateUp),
        (16, 16, RowOrder::Plain),
    ] {
        let q = matrix(&mut rng, n, k);
        let f = WmmaNvfp4Fragments::new(&q, order).expect("layout");
        let view = q.view();
        for row in 0..n {
            for col in 0..k {
                assert_eq!(f.value(row, col), view.value(row, col), "[{row}, {col}]");
            }
        }
    }
}

#[test]
fn wmma_bf16_fragments_hold_each_row_contiguously_per_group() {
    let (n, k) = (21, 80);
    // distinct, finite, nonzero bit patterns (padding is zero): any misplaced element shows
    let values: Vec<bf16> = (0..n * k).map(|i| bf16::from_bits(1 + i as u16)).collect();
    let f = WmmaBf16Fragments::new(&values, n, k, RowOrder::Plain).expect("layout");
    for tile in 0..f.grid.n_tiles {
        for tile_row in 0..16 {
            for group in 0..f.grid.k_groups {
                for c in 0..64 {
                    let got = f.values[((tile * f.grid.k_groups + group) * 16 + tile_row) * 64 + c];
                    let (row, col) = (tile * 16 + tile_row, group * 64 + c);
                    let want = if row < n && col < k {
                        values[row * k + col].to_bits()
                    } else {
                        0
                    };
                    assert_eq!(got, want, "[{row}, {col}]");
                }
            }
        }
    }
}
