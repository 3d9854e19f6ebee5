//! fp4spec: per-target NVFP4, MoE, Gated DeltaNet, attention and verification kernels for fast
//! Qwen3.5-MoE decode on one unified-memory box (NVIDIA GB10 `sm_121a`, AMD Strix Halo
//! `gfx1151`; numerics and speed measured on `sm_90a`).
//!
//! - [`target`]: the facts of each target, from `kernels/targets.toml`.
//! - [`kernels`]: the kernel families (launch API + CPU reference each) and the table of
//!   rendered sources.
//! - [`backend`]: CPU (references), CUDA (NVRTC + cudarc) and HIP (gfx1151 code objects on
//!   the HIP runtime, `hip` feature).
//! - [`formats`]: NVFP4, safetensors checkpoints and quantisation configs.
//! - [`checkpoint`]: the checkpoint tools (doctor, MTP graft, NVFP4 quantiser).
//! - [`model`]: the model runner on the CPU, the device decode path (`model::device`) and
//!   generation with MTP speculation.
//! - [`roofline`]: bytes per decode step and the speed they allow; [`spec_metrics`]: acceptance
//!   from a vLLM metrics page.

#![warn(missing_docs)]

pub mod backend;
pub mod checkpoint;
pub mod error;
pub mod formats;
pub mod kernels;
pub mod model;
pub mod rng;
pub mod roofline;
pub mod spec_metrics;
pub mod target;

pub use error::{Error, Result};
