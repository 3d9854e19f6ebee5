// Family `gemm`: Y[M,N] = X[M,K] (bf16) * dequant(W[N,K])^T, fp32 accumulation, bf16 out
// (rendered for {{ target.name }}). CPU reference: src/kernels/gemm/reference.rs.
// Launch: src/kernels/gemm/mod.rs.
{% include "common/prelude.cuh" %}
{% include "common/nvfp4.cuh" %}

#define GEMV_WARPS {{ target.gemm.warps_per_block }}
#define GEMV_ROWS {{ target.gemm.rows_per_pass }}

// gemm_nvfp4_bf16_gemv: the straightforward kernel. One warp owns one output column n and
// GEMV_ROWS rows of X (grid.y walks the rows); its lanes stride over the K/16 blocks of weight
// row n, decode each block's 16 values in registers, take the dot product with the bf16 rows
// of X, scale once per block, and reduce across the warp at the end. Each weight byte is read
// once per pass over the rows (ceil(M / GEMV_ROWS) times, from cache after the first).
// Requires K % 16 == 0 (checked on the host).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(GEMV_WARPS * FP4_WARP_SIZE) gemm_nvfp4_bf16_gemv(
    const u16* __restrict__ x, const u8* __restrict__ packed, const u8* __restrict__ scales,
    float global_scale, u16* __restrict__ y, u32 m, u32 n, u32 k) {
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 col = block_x() * GEMV_WARPS + warp;
    if (col >= n) return;  // whole warps leave together; nothing below synchronises the block
    const u32 row0 = block_y() * GEMV_ROWS;
    const u32 k_blocks = k / 16;
    const u8* w_row = packed + (u64)col * (k / 2);
    const u8* s_row = scales + (u64)col * k_blocks;

    float acc[GEMV_ROWS];
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;

    for (u32 b = lane; b < k_blocks; b += FP4_WARP_SIZE) {
        const u32x2 q = load_u32x2(w_row + (u64)b * 8);
        const float scale = e4m3_to_f32(s_row[b]) * global_scale;
        float w[16];
        #pragma unroll
        for (int j = 0; j < 16; ++j) w[j] = e2m1_to_f32(((j < 8 ? q.x : q.y) >> (4 * (j % 8))) & 15u);
        #pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (row0 + r < m) {
                const u16* x_block = x + (u64)(row0 + r) * k + (u64)b * 16;
                const u32x4 lo = load_u32x4(x_block);
                const u32x4 hi = load_u32x4(x_block + 8);
                const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                float dot = 0.0f;
                #pragma unroll
                for (int j = 0; j < 8; ++j) {
                    dot += bf16_to_f32((u16)(words[j] & 0xffffu)) * w[2 * j];
                    dot += bf16_to_f32((u16)(words[j] >> 16)) * w[2 * j + 1];
                }
                acc[r] += dot * scale;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float total = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < m) y[(u64)(row0 + r) * n + col] = f32_to_bf16(total);
    }
}
