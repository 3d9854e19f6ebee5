// ---- the zero-centred RMSNorm's arithmetic, shared by norm.cu's rms_norm_residual and the MoE
// route launch that takes a layer's post-attention norm (moe.cu, norm_rows_into_plane) ----
// Both sum a row's squares in the same order: thread v of RMS_NORM_THREADS adds the values
// v, v + RMS_NORM_THREADS, ... in turn from 0, each warp's lanes are summed by warp_sum, and the
// warps' sums in warp order; then both round alike, so a fused and an unfused layer give the same
// bits (speculative and plain decoding of one sequence may take different forms).
#define RMS_NORM_THREADS {{ target.norm.threads_per_block }}
#define RMS_NORM_WARPS (RMS_NORM_THREADS / FP4_WARP_SIZE)
/// The running sum of squares after one more value.
FP4_DEVICE float rms_norm_accumulate(float sum, float v) { return sum + v * v; }
/// 1 / sqrt(mean of the squares + eps) of a row of `dim` values whose squares sum to `total`.
FP4_DEVICE float rms_norm_inverse(float total, u32 dim, float eps) { return 1.0f / sqrt_f32(total / (float)dim + eps); }
/// The normed value in bf16: v * inverse * (1 + weight).
FP4_DEVICE u16 rms_norm_apply(float v, float inverse, float weight) { return f32_to_bf16(v * inverse * (1.0f + weight)); }
// ---- end of the RMSNorm's arithmetic ----
