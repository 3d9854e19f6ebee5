//! Weight formats: NVFP4 element and block formats, and safetensors checkpoints.

pub mod nvfp4;
pub mod safetensors;
