// ---- activations shared by the kernel families (fp32 in, fp32 out) ----
/// silu(v) = v * sigmoid(v).
FP4_DEVICE float silu(float v) { return v / (1.0f + fast_exp(-v)); }
/// sigmoid(v) = 1 / (1 + e^-v).
FP4_DEVICE float sigmoid(float v) { return 1.0f / (1.0f + fast_exp(-v)); }
// ---- end of activations ----
