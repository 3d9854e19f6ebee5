// Family `dequant`: NVFP4 matrix -> bf16 (rendered for {{ target.name }}).
// CPU reference: src/kernels/dequant/reference.rs. Launch: src/kernels/dequant/mod.rs.
{% include "common/prelude.cuh" %}
{% include "common/nvfp4.cuh" %}

#define DEQUANT_THREADS {{ target.dequant.threads_per_block }}

// One thread expands one 16-element block: 8 packed bytes (low nibble = even element) and its
// e4m3 scale in, 32 bytes of bf16 out. Blocks are numbered row-major over [rows, cols / 16], which
// is also the layout of the scale tensor, so block i's scale is scales[i].
// value = e2m1 * (e4m3_scale * global_scale), rounded once to bf16 (the reference's order).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(DEQUANT_THREADS) dequant_nvfp4_bf16(
    const u8* __restrict__ packed, const u8* __restrict__ scales, float global_scale,
    u16* __restrict__ out, u64 blocks) {
    chain_after_previous_grid();
    const u64 block = (u64)block_x() * DEQUANT_THREADS + thread_x();
    if (block >= blocks) return;
    const u32x2 q = load_u32x2(packed + block * 8);
    const float scale = e4m3_to_f32(scales[block]) * global_scale;
    u32 pairs[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 word = i < 4 ? q.x : q.y;
        const u32 byte = (word >> (8 * (i % 4))) & 0xffu;
        const u32 lo = f32_to_bf16(e2m1_to_f32(byte & 15u) * scale);
        const u32 hi = f32_to_bf16(e2m1_to_f32(byte >> 4) * scale);
        pairs[i] = lo | (hi << 16);
    }
    store_u32x4(out + block * 16, {pairs[0], pairs[1], pairs[2], pairs[3]});
    store_u32x4(out + block * 16 + 8, {pairs[4], pairs[5], pairs[6], pairs[7]});
}
