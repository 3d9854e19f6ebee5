// ---- v_wmma_f32_16x16x16_bf16 operand loaders (AMD targets with instructions.wmma_bf16) ----
// Shared by the `gemm` and `moe` families. Weights arrive in the order of
// src/kernels/gemm/layout.rs (WmmaNvfp4Fragments / WmmaBf16Fragments): per (16-row tile, 64-wide K
// group, tile row) the row's 64 values; block(index, j) is the A operand of the group's WMMA j
// for the row at `index` (NVFP4 decoded exactly in f32: the caller multiplies by global_scale).
typedef short v16s __attribute__((ext_vector_type(16)));
typedef float v8f __attribute__((ext_vector_type(8)));

/// 16 bf16 (raw bits, 32 bytes) as a WMMA operand; zeros when `valid` is false.
FP4_DEVICE v16s load_bf16x16(const u16* p, bool valid) {
    v16s v;
    if (!valid) {
        #pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0;
        return v;
    }
    const u32x4 lo = load_u32x4(p), hi = load_u32x4(p + 8);
    const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[2 * i] = (short)(words[i] & 0xffffu);
        v[2 * i + 1] = (short)(words[i] >> 16);
    }
    return v;
}

struct WmmaNvfp4Weights {
    const u32x4* words;  // [n_tiles][k_groups][16 rows][2]: 32 bytes of nibbles
    const u32* scales;   // [n_tiles][k_groups][16 rows]: four e4m3 bytes
    /// Block j (0..3) of the group at `index` (= (tile * k_groups + group) * 16 + row).
    FP4_DEVICE v16s block(u64 index, int j) const {
        const u32x4 q = load_u32x4(words + index * 2 + j / 2);
        const u32 lo = (j % 2 == 0) ? q.x : q.z, hi = (j % 2 == 0) ? q.y : q.w;
        const float scale = e4m3_to_f32((scales[index] >> (8 * j)) & 0xffu);
        v16s v;
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 nibble = ((i < 8 ? lo : hi) >> (4 * (i % 8))) & 15u;
            v[i] = (short)f32_to_bf16(e2m1_to_f32(nibble) * scale);
        }
        return v;
    }
};

struct WmmaBf16Weights {
    const u16* words;  // [n_tiles][k_groups][16 rows][64]
    FP4_DEVICE v16s block(u64 index, int j) const { return load_bf16x16(words + index * 64 + 16 * j, true); }
};
// ---- end of WMMA operand loaders ----
