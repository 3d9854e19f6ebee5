//! Family `norm`: the zero-centred RMSNorm of Qwen3.5-MoE (`x * rsqrt(mean(x^2) + eps) * (1 + w)`,
//! used for the layer norms, the final norm, q/k norms and every MTP norm). So far the CPU
//! reference; the GPU kernel (fused with the residual add) comes with the full-size decode issue.

pub mod reference;
