//! Family `moe`: the sparse mixture-of-experts block of Qwen3.5-MoE (router softmax over all
//! experts, top-k, renormalisation; per expert `down(silu(gate x) * up x)`; a shared expert scaled
//! by `sigmoid(shared_expert_gate x)`). So far the CPU reference, the definition the fused GPU
//! kernels (router, alignment, grouped expert GEMMs, combine) reproduce.

pub mod reference;
