// ---- mma.sync m16n8k16 building blocks (NVIDIA targets with instructions.mma_sync_bf16) ----
// Shared by the `gemm` and `moe` families. Weights arrive in the fragment order of
// src/kernels/gemm/layout.rs (Nvfp4Fragments / Bf16Fragments): per (16-row tile, 64-wide K group,
// lane) the lane's A fragments for the group's four MMAs (NVFP4: one 16-byte load). The NVFP4 decode is
// exact: a fragment value is e2m1 * s * 2^-7 (s the e5m3 block scale), so the caller multiplies
// by global_scale * 2^7 after accumulation.
// ---- inline PTX of the mma building blocks ----
FP4_DEVICE void mma_m16n8k16_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

FP4_DEVICE u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/// Streaming loads: weights are read exactly once, keep them out of L1.
FP4_DEVICE u32x4 load_stream_u32x4(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
FP4_DEVICE u32 load_stream_u16(const void* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
    return v;
}
// ---- end of inline PTX of the mma building blocks ----

/// `w` rotated left by BITS (0 < BITS < 32): one funnel shift.
template <u32 BITS>
FP4_DEVICE u32 rotate_left(u32 w) { return (w << BITS) | (w >> (32u - BITS)); }

/// The four A registers of one MMA word (src/kernels/gemm/layout.rs, code_bits), each a bf16x2 of
/// e2m1 * 2^-126: a code's sign at bit 15 / 31 and its exponent and mantissa bits at 8..6 / 24..22
/// (exact; 0.5 is a subnormal). Registers 0..2 are one mask of the word rotated by 0, 4 and 10
/// bits, register 3 the mantissas of it rotated by 6 and the rest of it rotated by 14: 9
/// instructions per word, where shifts within 16-bit halves took 11 (ptxas 13.0, sm_90a) and one
/// shift and two masks per register 15 (H200, ncu: the decode was most of the MoE kernels'
/// instructions).
FP4_DEVICE void e2m1_word_to_bf16x2_scaled(u32 w, u32 (&v)[4]) {
    constexpr u32 CODES = 0x81C081C0u;  // sign and exponent / mantissa bits of both halves
    constexpr u32 MANTISSAS = 0x00400040u;
    // each rotation of w itself: rotating by 10 and 14 as further rotations of the one by 6 made
    // ptxas 13.0 emit more instructions (the sm_90a bulk gate_up loop: 690 against 598)
    v[0] = w & CODES;
    v[1] = rotate_left<4>(w) & CODES;
    v[2] = rotate_left<10>(w) & CODES;
    v[3] = (rotate_left<6>(w) & MANTISSAS) | (rotate_left<14>(w) & (CODES & ~MANTISSAS));
}

/// A re-encoded scale byte -> bf16x2 {s * 2^119, s * 2^119}.
FP4_DEVICE u32 scale_to_bf16x2(u32 byte) { return byte * 0x00100010u + 0x76007600u; }

/// One K group (64 columns) of one lane's weights, as loaded.
struct Nvfp4Group { u32x4 w; u32 scales; };
struct Bf16Group { u32x4 w[4]; };

struct Nvfp4Weights {
    static constexpr bool PREFETCH_X = false;
    const u32x4* words;   // [n_tiles][k_groups][32]
    const u16* scales;    // [n_tiles][k_groups][32]
    typedef Nvfp4Group Group;
    FP4_DEVICE Group load(u64 index) const { return {load_stream_u32x4(words + index), load_stream_u16(scales + index)}; }
    /// L2 prefetch of the `count` lane entries from `index` (whole groups: count % 32 == 0).
    FP4_DEVICE void prefetch(u64 index, u32 count) const {
        prefetch_l2(words + index, count * 16u);
        prefetch_l2(scales + index, count * 2u);
    }
    /// The four A registers of MMA j of a group.
    FP4_DEVICE void fragment(const Group& group, int j, u32 (&a)[4]) const {
        const u32 word = j == 0 ? group.w.x : j == 1 ? group.w.y : j == 2 ? group.w.z : group.w.w;
        const u32 scale_g = scale_to_bf16x2(group.scales & 0xffu);
        const u32 scale_g8 = scale_to_bf16x2(group.scales >> 8);
        u32 v[4];
        e2m1_word_to_bf16x2_scaled(word, v);
        a[0] = mul_bf16x2(v[0], scale_g);
        a[1] = mul_bf16x2(v[1], scale_g8);
        a[2] = mul_bf16x2(v[2], scale_g);
        a[3] = mul_bf16x2(v[3], scale_g8);
    }
};

struct Bf16Weights {
    static constexpr bool PREFETCH_X = true;
    const u32x4* words;   // [n_tiles][k_groups][4 MMAs][32 lanes]
    typedef Bf16Group Group;
    /// L2 prefetch of the `count` lane entries from `index` (whole groups: count % 32 == 0).
    FP4_DEVICE void prefetch(u64 index, u32 count) const { prefetch_l2(words + index * 4, count * 64u); }
    /// Lane entry `index` (group * 32 + lane): its four MMAs' registers, each load 512 contiguous
    /// bytes across the warp.
    FP4_DEVICE Group load(u64 index) const {
        const u32x4* group_words = words + (index / 32) * 128 + index % 32;
        Group group;
        #pragma unroll
        for (int j = 0; j < 4; ++j) group.w[j] = load_stream_u32x4(group_words + j * 32);
        return group;
    }
    FP4_DEVICE void fragment(const Group& group, int j, u32 (&a)[4]) const {
        a[0] = group.w[j].x; a[1] = group.w[j].y; a[2] = group.w[j].z; a[3] = group.w[j].w;
    }
};
// ---- end of mma.sync building blocks ----
