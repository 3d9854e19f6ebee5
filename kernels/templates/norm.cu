// Family `norm`: the zero-centred RMSNorm of Qwen3.5-MoE fused with the residual add (rendered
// for {{ target.name }}). CPU reference: src/kernels/norm/reference.rs. Launch:
// src/kernels/norm/mod.rs.
{% include "common/prelude.cuh" %}

#define NORM_THREADS {{ target.norm.threads_per_block }}
#define NORM_WARPS (NORM_THREADS / FP4_WARP_SIZE)

// rms_norm_residual: for every row of `dim` values,
//   residual += delta            (when delta is not null; fp32 residual stream, bf16 delta)
//   out = bf16(residual * rsqrt(mean(residual^2) + eps) * (1 + weight))
// One block per row. The residual stays fp32 between layers so the stream of additions does not
// lose bits to bf16 (the CPU runner keeps f32 too); what the GEMMs read is the bf16 `out`.
// The second pass re-reads the row the same threads wrote (their own writes: no barrier needed
// for them, only for the sum).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(NORM_THREADS) rms_norm_residual(
    float* __restrict__ residual, const u16* __restrict__ delta, const float* __restrict__ weight,
    float eps, u16* __restrict__ out, u32 dim) {
    __shared__ float warp_sums[NORM_WARPS];
    const u64 row = block_x();
    float* r = residual + row * dim;
    float sum = 0.0f;
    for (u32 i = thread_x(); i < dim; i += NORM_THREADS) {
        float v = r[i];
        if (delta) {
            v += bf16_to_f32(delta[row * dim + i]);
            r[i] = v;
        }
        sum += v * v;
    }
    sum = warp_sum(sum);
    if (thread_x() % FP4_WARP_SIZE == 0) warp_sums[thread_x() / FP4_WARP_SIZE] = sum;
    block_barrier();
    float total = 0.0f;
    #pragma unroll
    for (int w = 0; w < NORM_WARPS; ++w) total += warp_sums[w];
    const float inv = 1.0f / sqrt_f32(total / (float)dim + eps);
    for (u32 i = thread_x(); i < dim; i += NORM_THREADS)
        out[row * dim + i] = f32_to_bf16(r[i] * inv * (1.0f + weight[i]));
}
