//! Family `attention`: the gated full attention of Qwen3.5-MoE (q/k RMSNorm per head, partial
//! NeoX RoPE, causal GQA over a KV cache, the sigmoid output gate). So far the CPU reference; the
//! decode and prefill kernels come with the full-size decode issue.

pub mod reference;
