//! Family `verify`: speculative verification and sampling with every sampling control honoured
//! (logit bias, temperature, top-k, top-p, min-p), per-sequence parameters, counter-based random
//! numbers, and per-position acceptance statistics. So far the CPU reference, which defines the
//! arithmetic the GPU kernels will reproduce; the kernels and their launch API come next.

pub mod reference;
