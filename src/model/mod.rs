//! The model runner: configuration ([`config`]), the tensor check of a checkpoint ([`weights`]),
//! the weights in host memory ([`params`]), per-sequence caches ([`cache`]), the forward and the
//! MTP head ([`forward`]), and generation with MTP speculative decoding ([`generate`]), plus a
//! byte-level tokenizer ([`tokenizer`]).
//!
//! This is the CPU reference path: every step is a kernel family's CPU reference, f32
//! activations with f64 accumulation, NVFP4 weights dequantised (W4A16). The CUDA path of the
//! full-size decode issue runs the same steps through the families' GPU launch APIs.

pub mod cache;
pub mod config;
pub mod device;
pub mod forward;
pub mod generate;
pub mod params;
pub mod tokenizer;
pub mod weights;
