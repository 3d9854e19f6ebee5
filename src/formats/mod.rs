//! Weight formats: NVFP4 element and block formats, safetensors checkpoints, and the
//! quantisation config of NVFP4 checkpoints.

pub mod bf16;
pub mod nvfp4;
pub mod quant_config;
pub mod safetensors;
