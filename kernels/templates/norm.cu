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
// At decode a row is one block's latency chain, so a row of up to NORM_THREADS * NORM_ITEMS
// values is held in registers (one pass over memory) and its norm weight is loaded before the
// wait for the previous kernel (no kernel writes it), and so is the residual when the caller says
// a kernel before the previous one wrote it (`residual_settled`, see chain_after_previous_grid):
// in a decoder layer the previous kernel writes only the delta, so the wait is followed by the
// delta's L2 round trip alone, not also by the residual's (last written a mixer or a MoE block
// earlier, out of the L2 by then at B = 1). Wider rows take the two-pass loop.
#define NORM_ITEMS 8
FP4_KERNEL void FP4_LAUNCH_BOUNDS(NORM_THREADS) rms_norm_residual(
    float* __restrict__ residual, const u16* __restrict__ delta, const float* __restrict__ weight,
    float eps, u16* __restrict__ out, u32 dim, u32 residual_settled) {
    __shared__ float warp_sums[NORM_WARPS];
    const u64 row = block_x();
    float* r = residual + row * dim;
    const bool held = dim <= NORM_THREADS * NORM_ITEMS;
    float w[NORM_ITEMS], v[NORM_ITEMS];
    if (held) {
        #pragma unroll
        for (int j = 0; j < NORM_ITEMS; ++j) {
            const u32 i = j * NORM_THREADS + thread_x();
            w[j] = i < dim ? weight[i] : 0.0f;
            v[j] = residual_settled && i < dim ? load_coherent_f32(r + i) : 0.0f;
        }
    }
    wait_for_previous_grid();
    allow_next_grid();
    float sum = 0.0f;
    if (held) {
        #pragma unroll
        for (int j = 0; j < NORM_ITEMS; ++j) {
            const u32 i = j * NORM_THREADS + thread_x();
            if (i < dim) {
                if (!residual_settled) v[j] = r[i];
                if (delta) v[j] += bf16_to_f32(delta[row * dim + i]);
            }
            sum += v[j] * v[j];
        }
    } else {
        for (u32 i = thread_x(); i < dim; i += NORM_THREADS) {
            float x = r[i];
            if (delta) {
                x += bf16_to_f32(delta[row * dim + i]);
                r[i] = x;
            }
            sum += x * x;
        }
    }
    sum = warp_sum(sum);
    if (thread_x() % FP4_WARP_SIZE == 0) warp_sums[thread_x() / FP4_WARP_SIZE] = sum;
    block_barrier();
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < NORM_WARPS; ++k) total += warp_sums[k];
    const float inv = 1.0f / sqrt_f32(total / (float)dim + eps);
    if (held) {
        #pragma unroll
        for (int j = 0; j < NORM_ITEMS; ++j) {
            const u32 i = j * NORM_THREADS + thread_x();
            if (i < dim) {
                if (delta) r[i] = v[j];
                out[row * dim + i] = f32_to_bf16(v[j] * inv * (1.0f + w[j]));
            }
        }
    } else {
        // the row re-read is this thread's own writes: no barrier needed for them
        for (u32 i = thread_x(); i < dim; i += NORM_THREADS)
            out[row * dim + i] = f32_to_bf16(r[i] * inv * (1.0f + weight[i]));
    }
}
