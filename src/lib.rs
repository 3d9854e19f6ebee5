//! fp4spec: per-target NVFP4, MoE, Gated DeltaNet, attention and verification kernels for fast
//! Qwen3.5-MoE decode on one unified-memory box (NVIDIA GB10 `sm_121a`, AMD Strix Halo
//! `gfx1151`; numerics and speed measured on `sm_90a`).
//!
//! - [`target`]: the facts of each target, from `kernels/targets.toml`.
//! - [`kernels`]: the kernel families (launch API + CPU reference each) and the table of
//!   rendered sources.
//! - [`backend`]: CPU (references) and CUDA (NVRTC + cudarc); HIP compilation.
//! - [`formats`]: NVFP4, safetensors checkpoints and quantisation configs.
//! - [`checkpoint`]: the checkpoint tools (doctor, MTP graft, NVFP4 quantiser).

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
