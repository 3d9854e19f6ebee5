//! Every GPU check, in one binary (it is what travels to the GPU host), one module per kernel
//! family. Without a CUDA device each test prints one line saying it was skipped and why, and
//! passes.
//!
//! Inputs are fresh random numbers each run; the seed is printed so a failure can be replayed
//! with `FP4SPEC_SEED=<seed>`.

mod attention;
mod backend;
mod chain;
mod common;
mod gdn;
mod gemm;
mod model;
mod moe;
mod tokens;
mod verify;

use common::skipped;
use fp4spec::Error;
use fp4spec::backend::{Backend, BackendKind};

#[test]
fn cuda_backend_opens_or_says_why_not() {
    match Backend::new(BackendKind::Cuda) {
        Ok(backend) => println!("cuda backend: {}", backend.describe()),
        Err(e) => {
            assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
            let devices = fp4spec::backend::cuda::device_count();
            assert_eq!(devices, 0, "{devices} CUDA device(s) present, yet: {e}");
            skipped(
                "cuda_backend_opens_or_says_why_not (no device to open)",
                &e.to_string(),
            );
        }
    }
}
