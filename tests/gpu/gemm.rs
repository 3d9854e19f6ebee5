//! GPU checks of the `dequant` and `gemm` families against their CPU references and cuBLAS, on
//! every device backend present (CUDA; HIP on a gfx1151 built with `--features hip`, where the
//! `mma_*` checks run the WMMA kernels); the cuBLAS comparison is CUDA's alone.

use crate::common::{cuda, devices, poisoned, random_bf16, rng, skipped};
use cudarc::cublas::CudaBlas;
use fp4spec::Error;
use fp4spec::backend::cuda::cublas;
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::gemm::{Epilogue, Linear, MmaKernel, RowOrder};
use fp4spec::kernels::{Nvfp4Weights, compare, dequant, gemm};
use fp4spec::rng::SplitMix64;
use half::bf16;

/// The (N, K) shapes of the issue: Qwen3.6-35B-A3B projections, plus one that is not a multiple
/// of any tile (N = 1037 columns, K = 528 = 33 blocks of 16).
const SHAPES: [(usize, usize); 5] = [
    (8192, 2048),
    (2048, 4096),
    (1024, 2048),
    (2048, 512),
    (1037, 528),
];
const ROWS: [usize; 4] = [1, 3, 16, 64];

/// A random NVFP4 matrix with the awkward scale values mixed in: zero, subnormal and maximal
/// block scales, and an all-zero block.
fn awkward_matrix(rng: &mut SplitMix64, n: usize, k: usize) -> Nvfp4Matrix {
    let mut q =
        Nvfp4Matrix::quantize("random W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
    let blocks = q.scales.len();
    for (i, byte) in [0x00u8, 0x01, 0x05, 0x7e, 0x80 | 0x30]
        .into_iter()
        .enumerate()
    {
        let at = (rng.next_u64() as usize + i) % blocks;
        q.scales[at] = byte;
    }
    let zero_block = rng.next_u64() as usize % blocks;
    q.packed[zero_block * 8..zero_block * 8 + 8].fill(0);
    q
}

#[test]
fn dequant_matches_the_cpu_reference_exactly() {
    for backend in devices("dequant_matches_the_cpu_reference_exactly") {
        let mut rng = rng("dequant");
        for (n, k) in SHAPES.into_iter().chain([(1, 16), (37, 528)]) {
            let q = awkward_matrix(&mut rng, n, k);
            let w = Nvfp4Weights::upload(backend, &q).expect("upload");
            let mut out = poisoned(backend, n * k);
            dequant::dequant_nvfp4(backend, &w, &mut out).expect("dequant");
            let got = backend.download(&out).expect("download");
            let want = dequant::reference::dequant_nvfp4_bf16(q.view());
            let mismatches: Vec<usize> = (0..got.len())
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .collect();
            assert!(
                mismatches.is_empty(),
                "dequant [{n}, {k}]: {} elements differ, first at {} ({} vs {})",
                mismatches.len(),
                mismatches[0],
                got[mismatches[0]],
                want[mismatches[0]]
            );
            println!("dequant [{n}, {k}]: bit-exact");
        }
    }
}

#[test]
fn gemm_matches_the_cpu_reference() {
    for backend in devices("gemm_matches_the_cpu_reference") {
        let mut rng = rng("gemm");
        for (n, k) in SHAPES {
            let q = awkward_matrix(&mut rng, n, k);
            let w = Nvfp4Weights::upload(backend, &q).expect("upload");
            for m in ROWS
                .into_iter()
                .chain(if n == 1037 { vec![5, 67] } else { vec![] })
            {
                let x = random_bf16(&mut rng, m * k);
                let x_dev = backend.upload(&x).expect("upload");
                let mut y = poisoned(backend, m * n);
                gemm::nvfp4_gemm(backend, &x_dev, m, &w, &mut y).expect("gemm");
                let got = backend.download(&y).expect("download");
                let agreement =
                    compare::compare_bf16(&got, &gemm::reference::nvfp4_gemm_f32(&x, m, q.view()));
                println!("gemm M={m} N={n} K={k}: {agreement}");
                assert!(agreement.passed(), "gemm M={m} N={n} K={k}: {agreement}");
            }
        }
    }
}

#[test]
fn buffers_from_another_backend_are_errors() {
    for backend in devices("buffers_from_another_backend_are_errors") {
        let q = Nvfp4Matrix::quantize("w", &[1.0; 64], 2, 32).expect("finite");
        let w = Nvfp4Weights::upload(backend, &q).expect("upload");
        let host_x = Backend::Cpu.upload(&[bf16::ONE; 32]).expect("host");
        let mut y = backend.zeros::<bf16>(2).expect("zeros");
        let err = gemm::nvfp4_gemm(backend, &host_x, 1, &w, &mut y).unwrap_err();
        assert!(matches!(err, Error::BackendMismatch { .. }), "{err}");
    }
}

// ---- the tensor-core kernels (gemm_*_mma_*) ----

/// Rows of the issue, 48 (the m48 variant full; 33 runs it with rows past M), plus ones that
/// cross the 64-row launch chunks.
const MMA_ROWS: [usize; 11] = [1, 2, 3, 4, 8, 16, 33, 48, 64, 67, 130];

/// The CPU reference of `X * W^T` for a weight: (X, M) -> unrounded `[M, N]`.
type ReferenceProduct = dyn Fn(&[bf16], usize) -> Vec<f32>;

#[derive(Clone, Copy)]
enum Format {
    Nvfp4,
    /// NVFP4 on the staged stream kernel (`gemm_nvfp4_bf16_stream_m*`, calls of at most 16
    /// rows; more run the register kernel), where the target has cp.async.
    Nvfp4Staged,
    Bf16,
    /// NVFP4 and bf16 on the warpgroup kernels (`gemm_*_wgmma_m64`) at every M, where the
    /// target has them (whatever `gemm.wgmma_min_rows` gives the library).
    Nvfp4Wgmma,
    Bf16Wgmma,
}

impl Format {
    fn kernel(self) -> MmaKernel {
        match self {
            Format::Nvfp4Staged => MmaKernel::Staged,
            Format::Nvfp4Wgmma | Format::Bf16Wgmma => MmaKernel::Wgmma,
            Format::Nvfp4 | Format::Bf16 => MmaKernel::Registers,
        }
    }
}

/// Runs `linear` at every M of `rows` on a fresh random weight and compares with the CPU
/// reference (poisoned output, fresh inputs per M).
fn check_linear(
    test: &str,
    format: Format,
    n: usize,
    k: usize,
    rows: &[usize],
    order: RowOrder,
    residual: bool,
) {
    for backend in devices(test) {
        if matches!(format, Format::Nvfp4Staged)
            && !backend.target().is_some_and(|t| t.instructions.cp_async)
        {
            skipped(test, "the staged stream kernel needs cp.async");
            continue;
        }
        if matches!(format, Format::Nvfp4Wgmma | Format::Bf16Wgmma)
            && !backend.target().is_some_and(gemm::wgmma_rendered)
        {
            skipped(test, "the wgmma kernels need wgmma and cp.async");
            continue;
        }
        let mut rng = rng(test);
        let (linear, reference_product): (Linear, Box<ReferenceProduct>) = match format {
            Format::Nvfp4 | Format::Nvfp4Staged | Format::Nvfp4Wgmma => {
                let q = awkward_matrix(&mut rng, n, k);
                let linear = Linear::nvfp4(backend, &q, order).expect("upload");
                (
                    linear,
                    Box::new(move |x: &[bf16], m: usize| {
                        gemm::reference::nvfp4_gemm_f32(x, m, q.view())
                    }),
                )
            }
            Format::Bf16 | Format::Bf16Wgmma => {
                let w: Vec<bf16> = rng
                    .normal_vec(n * k, 0.02)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                let linear = Linear::bf16(backend, &w, n, k, order).expect("upload");
                (
                    linear,
                    Box::new(move |x: &[bf16], m: usize| {
                        gemm::reference::bf16_gemm_f32(x, m, &w, n, k)
                    }),
                )
            }
        };
        let n_out = linear.out_features();
        for &m in rows {
            let x = random_bf16(&mut rng, m * k);
            let x_dev = backend.upload(&x).expect("upload");
            let mut y = poisoned(backend, m * n_out);
            let product = reference_product(&x, m);
            let kernel = format.kernel();
            let want = if order == RowOrder::GateUp {
                gemm::linear_with(
                    backend,
                    &x_dev,
                    m,
                    &linear,
                    Epilogue::SiluMul,
                    &mut y,
                    kernel,
                )
                .expect("linear");
                gemm::reference::silu_mul(&product, m, n)
            } else if residual {
                let r = random_bf16(&mut rng, m * n);
                let r_dev = backend.upload(&r).expect("upload");
                gemm::linear_with(
                    backend,
                    &x_dev,
                    m,
                    &linear,
                    Epilogue::Residual(&r_dev),
                    &mut y,
                    kernel,
                )
                .expect("linear");
                gemm::reference::add_residual(&product, &r)
            } else {
                gemm::linear_with(backend, &x_dev, m, &linear, Epilogue::None, &mut y, kernel)
                    .expect("linear");
                product
            };
            let agreement = compare::compare_bf16(&backend.download(&y).expect("download"), &want);
            println!("{test} M={m} N={n} K={k}: {agreement}");
            assert!(agreement.passed(), "{test} M={m} N={n} K={k}: {agreement}");
        }
    }
}

#[test]
fn mma_nvfp4_8192x2048() {
    check_linear(
        "mma_nvfp4_8192x2048",
        Format::Nvfp4,
        8192,
        2048,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_4096x2048() {
    check_linear(
        "mma_nvfp4_4096x2048",
        Format::Nvfp4,
        4096,
        2048,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_2048x4096() {
    check_linear(
        "mma_nvfp4_2048x4096",
        Format::Nvfp4,
        2048,
        4096,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_1024x2048() {
    check_linear(
        "mma_nvfp4_1024x2048",
        Format::Nvfp4,
        1024,
        2048,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_2048x512() {
    check_linear(
        "mma_nvfp4_2048x512",
        Format::Nvfp4,
        2048,
        512,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_12288x2048() {
    check_linear(
        "mma_nvfp4_12288x2048",
        Format::Nvfp4,
        12288,
        2048,
        &[1, 3, 16, 64],
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_lm_head() {
    check_linear(
        "mma_nvfp4_lm_head",
        Format::Nvfp4,
        248320,
        2048,
        &[1, 3],
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_awkward_shapes() {
    check_linear(
        "mma_nvfp4_awkward_1037x528",
        Format::Nvfp4,
        1037,
        528,
        &MMA_ROWS,
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_nvfp4_awkward_k16",
        Format::Nvfp4,
        200,
        16,
        &[1, 5, 64],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_nvfp4_awkward_n16",
        Format::Nvfp4,
        16,
        2048,
        &[1],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_nvfp4_awkward_n1",
        Format::Nvfp4,
        1,
        80,
        &[1, 9],
        RowOrder::Plain,
        false,
    );
}
#[test]
fn mma_nvfp4_epilogues() {
    check_linear(
        "mma_nvfp4_residual",
        Format::Nvfp4,
        2048,
        512,
        &[1, 3, 16, 64],
        RowOrder::Plain,
        true,
    );
    check_linear(
        "mma_nvfp4_gate_up",
        Format::Nvfp4,
        1024,
        2048,
        &[1, 3, 16, 64, 67],
        RowOrder::GateUp,
        false,
    );
    check_linear(
        "mma_nvfp4_gate_up_odd",
        Format::Nvfp4,
        2 * 37,
        528,
        &[1, 9],
        RowOrder::GateUp,
        false,
    );
}
/// The staged stream kernel at the register kernel's shapes, rows and epilogues (rows past
/// 16 run the register kernel through the same call: checked too).
#[test]
fn stream_nvfp4_model_shapes() {
    for (n, k) in gemm::MODEL_SHAPES {
        check_linear(
            &format!("stream_nvfp4_{n}x{k}"),
            Format::Nvfp4Staged,
            n,
            k,
            &MMA_ROWS,
            RowOrder::Plain,
            false,
        );
    }
}
#[test]
fn stream_nvfp4_streaming_shapes() {
    check_linear(
        "stream_nvfp4_lm_head",
        Format::Nvfp4Staged,
        248320,
        2048,
        &[1, 3, 16],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "stream_nvfp4_65536x4096",
        Format::Nvfp4Staged,
        65536,
        4096,
        &[1, 4, 16],
        RowOrder::Plain,
        false,
    );
}
#[test]
fn stream_nvfp4_awkward_shapes_and_epilogues() {
    for (test, n, k, rows) in [
        ("stream_nvfp4_awkward_1037x528", 1037, 528, &MMA_ROWS[..]),
        ("stream_nvfp4_awkward_k16", 200, 16, &[1, 5, 64][..]),
        ("stream_nvfp4_awkward_n16", 16, 2048, &[1][..]),
        ("stream_nvfp4_awkward_n1", 1, 80, &[1, 9][..]),
    ] {
        check_linear(
            test,
            Format::Nvfp4Staged,
            n,
            k,
            rows,
            RowOrder::Plain,
            false,
        );
    }
    check_linear(
        "stream_nvfp4_residual",
        Format::Nvfp4Staged,
        2048,
        512,
        &[1, 3, 16, 64],
        RowOrder::Plain,
        true,
    );
    check_linear(
        "stream_nvfp4_gate_up",
        Format::Nvfp4Staged,
        1024,
        2048,
        &[1, 3, 16, 64, 67],
        RowOrder::GateUp,
        false,
    );
    check_linear(
        "stream_nvfp4_gate_up_odd",
        Format::Nvfp4Staged,
        2 * 37,
        528,
        &[1, 9],
        RowOrder::GateUp,
        false,
    );
}

/// The staged kernel refuses what it cannot run, saying why, instead of running another kernel.
#[test]
fn stream_refuses_bf16_weights() {
    for backend in devices("stream_refuses_bf16_weights") {
        let w = vec![bf16::ONE; 16 * 64];
        let linear = Linear::bf16(backend, &w, 16, 64, RowOrder::Plain).expect("upload");
        let x = backend.upload(&[bf16::ONE; 64]).expect("upload");
        let mut y = backend.zeros::<bf16>(16).expect("zeros");
        let err = gemm::linear_with(
            backend,
            &x,
            1,
            &linear,
            Epilogue::None,
            &mut y,
            MmaKernel::Staged,
        )
        .unwrap_err();
        assert!(err.to_string().contains("NVFP4"), "{err}");
    }
}

/// The warpgroup kernels on the model's shapes (the GDN in_proj, the attention projections, the
/// fused expert gate_up with its epilogue), an lm_head slice, a launch of more blocks than the
/// device holds (unsplit, as the lm_head's) and awkward shapes (N not a multiple of 64 rows,
/// K = 16, the residual epilogue), at M from 1 to 130 (two launches).
#[test]
fn wgmma_model_and_awkward_shapes() {
    for format in [Format::Nvfp4Wgmma, Format::Bf16Wgmma] {
        let name = if matches!(format, Format::Nvfp4Wgmma) {
            "wgmma_nvfp4"
        } else {
            "wgmma_bf16"
        };
        for (n, k) in [(12352, 2048), (2048, 4096), (9216, 2048), (24832, 2048)] {
            check_linear(
                &format!("{name}_{n}x{k}"),
                format,
                n,
                k,
                &[1, 33, 64, 130],
                RowOrder::Plain,
                false,
            );
        }
        // more blocks than the device holds at once: the plan leaves K unsplit (as the lm_head's)
        check_linear(
            &format!("{name}_unsplit_34816x256"),
            format,
            34816,
            256,
            &[33, 64],
            RowOrder::Plain,
            false,
        );
        check_linear(
            &format!("{name}_gate_up"),
            format,
            1024,
            2048,
            &[3, 64],
            RowOrder::GateUp,
            false,
        );
        for (n, k) in [(100, 528), (16, 16), (37, 1040)] {
            check_linear(
                &format!("{name}_awkward_{n}x{k}"),
                format,
                n,
                k,
                &[1, 40, 64],
                RowOrder::Plain,
                true,
            );
        }
    }
}

#[test]
fn mma_bf16_model_shapes() {
    for (n, k) in gemm::MODEL_SHAPES {
        check_linear(
            &format!("mma_bf16_{n}x{k}"),
            Format::Bf16,
            n,
            k,
            &[1, 2, 3, 4, 8, 16, 33, 64],
            RowOrder::Plain,
            false,
        );
    }
}
#[test]
fn mma_bf16_lm_head_and_awkward() {
    check_linear(
        "mma_bf16_lm_head",
        Format::Bf16,
        248320,
        2048,
        &[1, 3],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_bf16_awkward_1037x528",
        Format::Bf16,
        1037,
        528,
        &[1, 3, 33, 67],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_bf16_awkward_k16",
        Format::Bf16,
        100,
        16,
        &[1, 64],
        RowOrder::Plain,
        false,
    );
    check_linear(
        "mma_bf16_residual",
        Format::Bf16,
        2048,
        4096,
        &[1, 16],
        RowOrder::Plain,
        true,
    );
    check_linear(
        "mma_bf16_gate_up",
        Format::Bf16,
        1024,
        2048,
        &[1, 16, 64],
        RowOrder::GateUp,
        false,
    );
}

/// With X the identity, Y reads the weights back one product each: the kernel's in-register
/// decode must equal the reference dequantisation bit for bit, subnormal scales included.
#[test]
fn mma_nvfp4_decode_is_exact() {
    for backend in devices("mma_nvfp4_decode_is_exact") {
        let mut rng = rng("mma_nvfp4_decode_is_exact");
        let (n, k) = (1037, 64);
        let mut q = awkward_matrix(&mut rng, n, k);
        q.global_scale = 1.0; // no rounding in the epilogue's multiply
        for (i, byte) in q.scales.iter_mut().enumerate() {
            *byte = (i % 0x7f) as u8; // every finite e4m3 scale, subnormals and zero included
        }
        for (i, byte) in q.packed.iter_mut().enumerate() {
            *byte = (i % 256) as u8; // every nibble pair
        }
        let linear = Linear::nvfp4(backend, &q, RowOrder::Plain).expect("upload");
        let identity: Vec<bf16> = (0..64 * k)
            .map(|i| {
                if i / k == i % k {
                    bf16::ONE
                } else {
                    bf16::ZERO
                }
            })
            .collect();
        let x = backend.upload(&identity).expect("upload");
        let mut y = poisoned(backend, 64 * n);
        gemm::linear(backend, &x, 64, &linear, Epilogue::None, &mut y).expect("linear");
        let y = backend.download(&y).expect("download");
        let want = dequant::reference::dequant_nvfp4_bf16(q.view());
        let mut wrong = 0;
        for row in 0..n {
            for col in 0..64 {
                if y[col * n + row].to_bits() != want[row * k + col].to_bits()
                    && !(y[col * n + row] == want[row * k + col])
                {
                    if wrong < 5 {
                        println!(
                            "W[{row}, {col}]: kernel {} reference {}",
                            y[col * n + row],
                            want[row * k + col]
                        );
                    }
                    wrong += 1;
                }
            }
        }
        assert_eq!(wrong, 0, "{wrong} weights decode differently in the kernel");
    }
}

/// Where the two kernels get the same partition (warps per tile, K splits), each warp of the
/// staged kernel adds the register kernel's products in its order: the outputs must be the same
/// bits, the sharpest check that the rings hand every warp the right groups.
#[test]
fn stream_matches_the_register_kernel_bit_for_bit() {
    for backend in devices("stream_matches_the_register_kernel_bit_for_bit") {
        let target = backend.target().expect("a device backend");
        if !target.instructions.cp_async {
            skipped(
                "stream_matches_the_register_kernel_bit_for_bit",
                "the staged stream kernel needs cp.async",
            );
            continue;
        }
        let multiprocessors = backend.multiprocessors().unwrap_or(target.multiprocessors);
        let tiles = &target.gemm;
        let mut rng = rng("stream_matches_the_register_kernel_bit_for_bit");
        let mut compared = 0;
        for (n, k) in gemm::MODEL_SHAPES
            .into_iter()
            .chain([(1037, 528), (248320, 2048)])
        {
            let q = awkward_matrix(&mut rng, n, k);
            let linear = Linear::nvfp4(backend, &q, RowOrder::Plain).expect("upload");
            for m in [1, 3, 8, 16] {
                let (n_tiles, k_groups) = (n.div_ceil(16), k.div_ceil(64));
                // the partition the register launch runs (gemm.mma_wave_warps_per_tile may widen
                // mma_plan's: (8192, 2048) at M = 1 then takes 8 warps per tile, the staged 4)
                let registers = gemm::register_plan(backend, &linear, m).expect("register plan");
                let staged = gemm::stream_plan(n_tiles, k_groups, m, tiles, multiprocessors);
                if registers != staged {
                    println!("({n}, {k}) M={m}: partitions differ ({registers:?} vs {staged:?})");
                    continue;
                }
                let x = backend
                    .upload(&random_bf16(&mut rng, m * k))
                    .expect("upload");
                let mut outputs = Vec::new();
                for kernel in [MmaKernel::Registers, MmaKernel::Staged] {
                    let mut y = poisoned(backend, m * n);
                    gemm::linear_with(backend, &x, m, &linear, Epilogue::None, &mut y, kernel)
                        .expect("linear");
                    outputs.push(backend.download(&y).expect("download"));
                }
                let differ = (0..m * n)
                    .filter(|&i| outputs[0][i].to_bits() != outputs[1][i].to_bits())
                    .count();
                println!("({n}, {k}) M={m}: {differ} outputs differ");
                assert_eq!(differ, 0, "({n}, {k}) M={m}: {differ} outputs differ");
                compared += 1;
            }
        }
        assert!(
            compared > 0,
            "no shape got the same partition from both kernels: nothing compared"
        );
    }
}

/// The staged kernel's decode, bit for bit, as `mma_nvfp4_decode_is_exact` checks the register
/// kernel's: it takes at most 16 rows, so four launches of 16 rows, launch q with ones at
/// (r, 16 q + r), read K = 64 back 16 columns at a time.
#[test]
fn stream_nvfp4_decode_is_exact() {
    for backend in devices("stream_nvfp4_decode_is_exact") {
        if !backend.target().is_some_and(|t| t.instructions.cp_async) {
            skipped(
                "stream_nvfp4_decode_is_exact",
                "the staged stream kernel needs cp.async",
            );
            continue;
        }
        let mut rng = rng("stream_nvfp4_decode_is_exact");
        let (n, k) = (1037, 64);
        let mut q = awkward_matrix(&mut rng, n, k);
        q.global_scale = 1.0;
        for (i, byte) in q.scales.iter_mut().enumerate() {
            *byte = (i % 0x7f) as u8;
        }
        for (i, byte) in q.packed.iter_mut().enumerate() {
            *byte = (i % 256) as u8;
        }
        let linear = Linear::nvfp4(backend, &q, RowOrder::Plain).expect("upload");
        let want = dequant::reference::dequant_nvfp4_bf16(q.view());
        let mut wrong = 0;
        for quarter in 0..4 {
            let ones: Vec<bf16> = (0..16 * k)
                .map(|i| {
                    if i % k == 16 * quarter + i / k {
                        bf16::ONE
                    } else {
                        bf16::ZERO
                    }
                })
                .collect();
            let x = backend.upload(&ones).expect("upload");
            let mut y = poisoned(backend, 16 * n);
            gemm::linear_with(
                backend,
                &x,
                16,
                &linear,
                Epilogue::None,
                &mut y,
                MmaKernel::Staged,
            )
            .expect("linear");
            let y = backend.download(&y).expect("download");
            for row in 0..n {
                for r in 0..16 {
                    let (got, col) = (y[r * n + row], 16 * quarter + r);
                    let expected = want[row * k + col];
                    if got.to_bits() != expected.to_bits() && got != expected {
                        if wrong < 5 {
                            println!("W[{row}, {col}]: kernel {got} reference {expected}");
                        }
                        wrong += 1;
                    }
                }
            }
        }
        assert_eq!(
            wrong, 0,
            "{wrong} weights decode differently in the stream kernel"
        );
    }
}

/// The peer: cuBLAS bf16 GEMM (fp32 compute) on the same, dequantised weights. Every variant must
/// agree with it to the level of two bf16 roundings; where the f64 reference is affordable, the
/// NVFP4 variants must also be no less accurate than cuBLAS.
#[test]
fn gemm_variants_match_cublas() {
    let Some(backend) = cuda("gemm_variants_match_cublas") else {
        return;
    };
    let Backend::Cuda(device) = backend else {
        unreachable!("cuda() returns the CUDA backend")
    };
    let blas = CudaBlas::new(device.stream().clone()).expect("cuBLAS handle");
    let mut rng = rng("gemm_variants_match_cublas");
    for (n, k, nvfp4) in [
        (2048, 4096, true),
        (8192, 2048, true),
        (1037, 528, true),
        (248320, 2048, false),
    ] {
        let (q, dense) = if nvfp4 {
            let q = awkward_matrix(&mut rng, n, k);
            let dense = dequant::reference::dequant_nvfp4_bf16(q.view());
            (Some(q), dense)
        } else {
            (
                None,
                random_bf16(&mut rng, n * k)
                    .into_iter()
                    .map(|v| bf16::from_f32(v.to_f32() * 0.02))
                    .collect(),
            )
        };
        let DeviceVec::Cuda(dense_dev) = backend.upload(&dense).expect("upload") else {
            unreachable!()
        };
        let mma = match &q {
            Some(q) => Linear::nvfp4(backend, q, RowOrder::Plain),
            None => Linear::bf16(backend, &dense, n, k, RowOrder::Plain),
        }
        .expect("upload");
        let gemv = q
            .as_ref()
            .map(|q| Nvfp4Weights::upload(backend, q).expect("upload"));
        for m in [1, 16, 64] {
            let x = random_bf16(&mut rng, m * k);
            let x_dev = backend.upload(&x).expect("upload");
            let DeviceVec::Cuda(x_slice) = &x_dev else {
                unreachable!()
            };
            let DeviceVec::Cuda(mut theirs) = poisoned(backend, m * n) else {
                unreachable!()
            };
            cublas::gemm_bf16_x_wt(&blas, &dense_dev, x_slice, &mut theirs, (m, n, k))
                .expect("cuBLAS");
            let theirs = backend
                .download(&DeviceVec::Cuda(theirs))
                .expect("download");
            let theirs_f32: Vec<f32> = theirs.iter().map(|v| v.to_f32()).collect();
            let reference = q
                .as_ref()
                .map(|q| gemm::reference::nvfp4_gemm_f32(&x, m, q.view()));
            let mut variants = vec![("mma", poisoned(backend, m * n))];
            gemm::linear(backend, &x_dev, m, &mma, Epilogue::None, &mut variants[0].1)
                .expect("mma");
            if q.is_some() {
                let mut y = poisoned(backend, m * n);
                gemm::linear_with(
                    backend,
                    &x_dev,
                    m,
                    &mma,
                    Epilogue::None,
                    &mut y,
                    MmaKernel::Staged,
                )
                .expect("stream");
                variants.push(("stream", y));
            }
            if let Some(w) = &gemv {
                let mut y = poisoned(backend, m * n);
                gemm::nvfp4_gemm(backend, &x_dev, m, w, &mut y).expect("gemv");
                variants.push(("gemv", y));
            }
            for (variant, y) in variants {
                let ours = backend.download(&y).expect("download");
                let vs_cublas = compare::compare_bf16(&ours, &theirs_f32);
                println!(
                    "{variant} vs cuBLAS M={m} N={n} K={k}: rel L2 {:.2e}",
                    vs_cublas.relative_l2
                );
                assert!(
                    vs_cublas.non_finite == 0 && vs_cublas.relative_l2 < 5e-3,
                    "{variant} vs cuBLAS M={m} N={n} K={k}: {vs_cublas}"
                );
                if let Some(reference) = &reference {
                    let ours_error = compare::compare_bf16(&ours, reference);
                    let cublas_error = compare::compare_bf16(&theirs, reference);
                    assert!(
                        ours_error.passed(),
                        "{variant} vs f64 M={m} N={n} K={k}: {ours_error}"
                    );
                    assert!(
                        ours_error.relative_l2 <= cublas_error.relative_l2 * 1.05,
                        "{variant} M={m} N={n} K={k}: less accurate ({:.2e}) than cuBLAS ({:.2e})",
                        ours_error.relative_l2,
                        cublas_error.relative_l2
                    );
                }
            }
        }
    }
}

/// W4A4 on a device whose target has the block-scaled FP4 MMA (GB10) against the CPU emulation
/// of exactly its math; elsewhere the constructor must refuse with the reason.
#[test]
fn w4a4_matches_the_emulation_or_is_refused() {
    for backend in devices("w4a4_matches_the_emulation_or_is_refused") {
        let target = backend.target().expect("a device backend");
        let mut rng = rng("w4a4");
        let mut q = awkward_matrix(&mut rng, 2048, 2048);
        q.input_scale = Some(3.0 / (6.0 * 448.0));
        if !target.instructions.mma_block_scaled_fp4 {
            let err = Linear::nvfp4_w4a4(backend, &q, RowOrder::Plain)
                .err()
                .expect("refused");
            assert!(err.to_string().contains("no block-scaled FP4 MMA"), "{err}");
            skipped(
                "w4a4_matches_the_emulation (kernel)",
                &format!("{} has no block-scaled FP4 MMA: {err}", target.name),
            );
            continue;
        }
        let linear = Linear::nvfp4_w4a4(backend, &q, RowOrder::Plain).expect("upload");
        for m in [1, 3, 16, 33, 64] {
            let x = random_bf16(&mut rng, m * 2048);
            let x_dev = backend.upload(&x).expect("upload");
            let mut y = poisoned(backend, m * 2048);
            gemm::linear(backend, &x_dev, m, &linear, Epilogue::None, &mut y).expect("linear");
            let want = gemm::reference::nvfp4_w4a4_f32(&x, m, q.view(), 3.0 / (6.0 * 448.0))
                .expect("finite");
            let agreement = compare::compare_bf16(&backend.download(&y).expect("download"), &want);
            println!("w4a4 M={m}: {agreement}");
            assert!(agreement.passed(), "w4a4 M={m}: {agreement}");
        }
    }
}
