//! cuBLAS as the peer the GEMM tests and benches measure against (a library we did not write).

use crate::error::{Error, Result};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use half::bf16;

/// `Y[m, n] = X[m, k] * W[n, k]^T` in bf16 with fp32 accumulation (`cublasGemmEx`), all
/// row-major: the same product as [`crate::kernels::gemm::linear`] on a dense weight.
///
/// # Errors
/// [`Error::Invalid`] when a buffer's length disagrees with (m, n, k) or a dimension exceeds
/// cuBLAS' 32-bit range, [`Error::Cublas`] when cuBLAS fails.
pub fn gemm_bf16_x_wt(
    blas: &CudaBlas,
    w: &CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    for (what, len, want) in [
        ("cuBLAS W", w.len(), n * k),
        ("cuBLAS X", x.len(), m * k),
        ("cuBLAS Y", y.len(), m * n),
    ] {
        if len != want {
            return Err(Error::invalid(
                what,
                format!("{len} elements, expected {want} for M={m} N={n} K={k}"),
            ));
        }
    }
    let dim = |what: &str, v: usize| {
        i32::try_from(v)
            .map_err(|_| Error::invalid(what, format!("{v} exceeds cuBLAS' 32-bit range")))
    };
    let (m32, n32, k32) = (
        dim("cuBLAS M", m)?,
        dim("cuBLAS N", n)?,
        dim("cuBLAS K", k)?,
    );
    // column-major view of the row-major product: Y^T[n, m] = (W^T)^T[n, k] * X^T[k, m]
    let config = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n32,
        n: m32,
        k: k32,
        alpha: bf16::ONE,
        lda: k32,
        ldb: k32,
        beta: bf16::ZERO,
        ldc: n32,
    };
    // SAFETY: the lengths were checked against the config above.
    unsafe { blas.gemm(config, w, x, y) }.map_err(|e| Error::Cublas {
        op: format!("bf16 GEMM M={m} N={n} K={k}"),
        source: e,
    })
}
