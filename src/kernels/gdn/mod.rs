//! Family `gdn`: Gated DeltaNet linear attention. So far the CPU reference (conv1d + SiLU and its
//! window, gates, L2 norms, the gated delta rule recurrent and chunked, the gated RMSNorm), the
//! definition the prefill, decode and speculative-verify kernels will reproduce.

pub mod reference;
