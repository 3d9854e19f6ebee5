//! Bench of the `gemm` family on the device (CUDA, or HIP on a gfx1151), with the ceilings
//! measured in the same run: device-to-device copy bandwidth and, on CUDA only, cuBLAS bf16 on
//! the same shapes (a HIP run says it is absent).
//!
//! The copy is timed as plain in-stream copies between events; every other case as decode runs it:
//! back-to-back calls, each on its own copy of the weights (`common::rotation_copies`: 256 MiB of
//! copies, and as many calls, at least `LAUNCHES`, so every call reads DRAM), captured in one CUDA graph and replayed between CUDA events (on HIP: launched back to
//! back between HIP events); the figure is the median time per call. "bytes" is the fewest bytes
//! the call must move (weights once, X once, Y once).
//!
//! Variants: `gemv` (the straightforward NVFP4 kernel, the reference GPU version), `mma` (the
//! tensor-core kernels on NVFP4 or bf16 weights, as the library chooses them), `stream nvfp4`
//! (the staged NVFP4 stream kernel, `MmaKernel::Staged`, at M <= 16 on targets with cp.async),
//! `wgmma` (`MmaKernel::Wgmma`, NVFP4 and bf16, at M > 32 on targets with wgmma), `cublas`
//! (bf16 weights, the peer).
//!
//! Run: `cargo bench --bench gemm [-- FILTER]` on a CUDA or ROCm host (prints one skip line
//! elsewhere).

mod common;

use common::{COPY_BYTES, LAUNCHES, bench_graph_calls, rotation_copies};
use criterion::Criterion;
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaSlice;
use fp4spec::backend::cuda::CudaBackend;
use fp4spec::backend::cuda::cublas;
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::gemm::{self, Epilogue, Linear, MmaKernel, RowOrder};
use fp4spec::kernels::{Nvfp4Weights, dequant};
use fp4spec::rng::SplitMix64;
use half::bf16;
use std::cell::RefCell;

const MODEL_ROWS: [usize; 7] = [1, 3, 4, 8, 16, 32, 64];
/// Weights of at least 64 MiB: the lm_head and a synthetic large matrix.
const STREAMING_SHAPES: [(usize, usize); 2] = [(248320, 2048), (65536, 4096)];
const STREAMING_ROWS: [usize; 4] = [1, 4, 16, 64];

struct Row {
    set: &'static str,
    variant: &'static str,
    m: usize,
    n: usize,
    k: usize,
    bytes: u64,
    seconds: f64,
}

#[allow(clippy::too_many_arguments)]
fn bench_shape(
    criterion: &mut Criterion,
    backend: &Backend,
    cublas_peer: Option<(&CudaBackend, &RefCell<CudaBlas>)>,
    rng: &mut SplitMix64,
    set: &'static str,
    n: usize,
    k: usize,
    rows: &[usize],
    with_gemv: bool,
    out: &mut Vec<Row>,
) {
    let q = Nvfp4Matrix::quantize("bench W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
    let dense = dequant::reference::dequant_nvfp4_bf16(q.view());
    let nvfp4: Vec<Linear> = (0..rotation_copies(q.bytes() as u64))
        .map(|_| Linear::nvfp4(backend, &q, RowOrder::Plain).expect("upload"))
        .collect();
    let bf16_copies = rotation_copies(2 * (n * k) as u64);
    // one timed group streams every copy (small weights: hundreds of them)
    let calls = nvfp4.len().max(bf16_copies).max(LAUNCHES);
    let bf16: Vec<Linear> = (0..bf16_copies)
        .map(|_| Linear::bf16(backend, &dense, n, k, RowOrder::Plain).expect("upload"))
        .collect();
    let dense_dev: Vec<CudaSlice<bf16>> = match cublas_peer {
        Some((cuda, _)) => (0..bf16_copies)
            .map(|_| cuda.stream().clone_htod(&dense).expect("upload"))
            .collect(),
        None => Vec::new(),
    };
    let plain: Vec<Nvfp4Weights> = if with_gemv {
        (0..nvfp4.len())
            .map(|_| Nvfp4Weights::upload(backend, &q).expect("upload"))
            .collect()
    } else {
        Vec::new()
    };
    for &m in rows {
        let x: Vec<bf16> = rng
            .normal_vec(m * k, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let x_dev = backend.upload(&x).expect("upload X");
        let mut y: DeviceVec<bf16> = backend.zeros(m * n).expect("allocate Y");
        let name = format!("M{m}_N{n}_K{k}");
        let record = |out: &mut Vec<Row>, variant, bytes, seconds| {
            out.push(Row {
                set,
                variant,
                m,
                n,
                k,
                bytes,
                seconds,
            })
        };
        let io = 2 * (m * k + m * n) as u64;
        let nvfp4_bytes = nvfp4[0].bytes(m, &Epilogue::None);
        let seconds = bench_graph_calls(
            criterion,
            backend,
            &format!("{set}/mma_nvfp4"),
            &name,
            nvfp4_bytes,
            calls,
            |i| {
                gemm::linear(
                    backend,
                    &x_dev,
                    m,
                    &nvfp4[i % nvfp4.len()],
                    Epilogue::None,
                    &mut y,
                )
                .expect("linear")
            },
        );
        record(out, "mma nvfp4", nvfp4_bytes, seconds);
        let staged = backend
            .target()
            .is_some_and(|t| t.instructions.staged_mma());
        if staged && m <= gemm::STREAM_MAX_ROWS {
            let seconds = bench_graph_calls(
                criterion,
                backend,
                &format!("{set}/stream_nvfp4"),
                &name,
                nvfp4_bytes,
                calls,
                |i| {
                    gemm::linear_with(
                        backend,
                        &x_dev,
                        m,
                        &nvfp4[i % nvfp4.len()],
                        Epilogue::None,
                        &mut y,
                        MmaKernel::Staged,
                    )
                    .expect("linear")
                },
            );
            record(out, "stream nvfp4", nvfp4_bytes, seconds);
        }
        if with_gemv {
            let seconds = bench_graph_calls(
                criterion,
                backend,
                &format!("{set}/gemv_nvfp4"),
                &name,
                nvfp4_bytes,
                calls,
                |i| {
                    gemm::nvfp4_gemm(backend, &x_dev, m, &plain[i % plain.len()], &mut y)
                        .expect("gemv")
                },
            );
            record(out, "gemv nvfp4", nvfp4_bytes, seconds);
        }
        let bf16_bytes = bf16[0].bytes(m, &Epilogue::None);
        let seconds = bench_graph_calls(
            criterion,
            backend,
            &format!("{set}/mma_bf16"),
            &name,
            bf16_bytes,
            calls,
            |i| {
                gemm::linear(
                    backend,
                    &x_dev,
                    m,
                    &bf16[i % bf16.len()],
                    Epilogue::None,
                    &mut y,
                )
                .expect("linear")
            },
        );
        record(out, "mma bf16", bf16_bytes, seconds);
        // the warpgroup kernels, whatever gemm.wgmma_min_rows lets the library use, from 33 rows
        // (below, a warpgroup's 64 columns of X are mostly padding)
        let wgmma = backend.target().is_some_and(gemm::wgmma_rendered);
        if wgmma && m > 32 {
            for (variant, weights, bytes) in [
                ("wgmma nvfp4", &nvfp4, nvfp4_bytes),
                ("wgmma bf16", &bf16, bf16_bytes),
            ] {
                let seconds = bench_graph_calls(
                    criterion,
                    backend,
                    &format!("{set}/{}", variant.replace(' ', "_")),
                    &name,
                    bytes,
                    calls,
                    |i| {
                        gemm::linear_with(
                            backend,
                            &x_dev,
                            m,
                            &weights[i % weights.len()],
                            Epilogue::None,
                            &mut y,
                            MmaKernel::Wgmma,
                        )
                        .expect("linear")
                    },
                );
                record(out, variant, bytes, seconds);
            }
        }
        let Some((cuda, blas)) = cublas_peer else {
            continue;
        };
        let (DeviceVec::Cuda(x_slice), DeviceVec::Cuda(y_slice)) = (&x_dev, &mut y) else {
            unreachable!("cuBLAS runs on the CUDA backend")
        };
        let cublas_bytes = 2 * (n * k) as u64 + io;
        let seconds = bench_graph_calls(
            criterion,
            backend,
            &format!("{set}/cublas_bf16"),
            &name,
            cublas_bytes,
            calls,
            |i| {
                // on the stream this thread launches to: inside bench_graph's capture that is
                // the capture stream, which a handle bound to the backend's stream at creation
                // would bypass (its calls ran outside the graph, which then timed as nothing)
                let mut blas = blas.borrow_mut();
                // SAFETY: the stream belongs to the handle's context; nothing of the handle's
                // is in flight on another stream (every call is on this thread, one at a time)
                unsafe { blas.set_stream(cuda.stream().clone()) }.expect("cuBLAS stream");
                cublas::gemm_bf16_x_wt(
                    &blas,
                    &dense_dev[i % dense_dev.len()],
                    x_slice,
                    y_slice,
                    (m, n, k),
                )
                .expect("cuBLAS")
            },
        );
        record(out, "cublas bf16", cublas_bytes, seconds);
    }
}

fn main() {
    let Some(backend) = common::device_or_skip("gemm") else {
        return;
    };
    common::announce(&backend);
    let mut criterion = common::criterion();
    // cuBLAS is CUDA's: on HIP the peer is absent (said below the table), never stood in for
    let blas = match &backend {
        Backend::Cuda(cuda) => Some((
            &**cuda,
            RefCell::new(CudaBlas::new(cuda.stream().clone()).expect("cuBLAS handle")),
        )),
        _ => None,
    };
    let cublas_peer = blas.as_ref().map(|(cuda, blas)| (*cuda, blas));

    let copy_gbs = common::copy_bandwidth_gbs(&mut criterion, &backend);

    let mut rng = SplitMix64::new(0x5eed);
    let mut rows = Vec::new();
    for (n, k) in STREAMING_SHAPES {
        bench_shape(
            &mut criterion,
            &backend,
            cublas_peer,
            &mut rng,
            "streaming",
            n,
            k,
            &STREAMING_ROWS,
            false,
            &mut rows,
        );
    }
    for (n, k) in gemm::MODEL_SHAPES {
        bench_shape(
            &mut criterion,
            &backend,
            cublas_peer,
            &mut rng,
            "model",
            n,
            k,
            &MODEL_ROWS,
            true,
            &mut rows,
        );
    }
    criterion.final_summary();

    println!(
        "\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written, {} MiB each way)",
        COPY_BYTES >> 20
    );
    println!(
        "floor = bytes / copy bandwidth; x cuBLAS = cuBLAS bf16 time / this time (same M, N, K)"
    );
    if cublas_peer.is_none() {
        println!(
            "cuBLAS bf16: absent (cuBLAS is CUDA's; no peer on {}, so x cuBLAS reads NaN)",
            backend.name()
        );
    }
    println!(
        "{:<9} {:<12} {:>3} {:>6} {:>5} {:>10} {:>8} {:>8} {:>6} {:>7} {:>7} {:>8}",
        "set",
        "variant",
        "M",
        "N",
        "K",
        "bytes",
        "us",
        "floor us",
        "GB/s",
        "of copy",
        "-floor",
        "x cuBLAS"
    );
    for row in &rows {
        let cublas = rows
            .iter()
            .find(|r| r.variant == "cublas bf16" && (r.m, r.n, r.k) == (row.m, row.n, row.k))
            .map_or(f64::NAN, |r| r.seconds);
        let gbs = row.bytes as f64 / row.seconds / 1e9;
        let floor = row.bytes as f64 / (copy_gbs * 1e9);
        println!(
            "{:<9} {:<12} {:>3} {:>6} {:>5} {:>10} {:>8.2} {:>8.2} {:>6.0} {:>6.1}% {:>7.2} {:>8.2}",
            row.set,
            row.variant,
            row.m,
            row.n,
            row.k,
            row.bytes,
            row.seconds * 1e6,
            floor * 1e6,
            gbs,
            100.0 * gbs / copy_gbs,
            (row.seconds - floor) * 1e6,
            cublas / row.seconds
        );
    }
}
