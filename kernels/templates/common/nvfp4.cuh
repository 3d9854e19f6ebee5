// ---- NVFP4 decoding (see src/formats/nvfp4.rs for the CPU twin) ----
// E2M1 nibble: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa;
// magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Built as f32 bits: no table, no local memory.
FP4_DEVICE float e2m1_to_f32(u32 nibble) {
    const u32 exponent = (nibble >> 1) & 3u;
    const u32 mantissa = nibble & 1u;
    u32 bits = exponent ? (((exponent + 126u) << 23) | (mantissa << 22)) : (mantissa ? 0x3f000000u : 0u);
    bits |= (nibble & 8u) << 28;
    return bits_to_f32(bits);
}

// E4M3 (float8_e4m3fn) byte: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa;
// no infinities, S.1111.111 is NaN, exponent 0 is subnormal (m * 2^-9). Exponent and mantissa go
// to an f32's at bit 20 and the product with 2^120 rebiases them: exponent 0 makes a subnormal
// f32 there, which the product scales to m * 2^-9 exactly (these targets' default f32 arithmetic
// keeps subnormals: no -ftz / fast-math), so no branch on the exponent.
FP4_DEVICE float e4m3_to_f32(u32 byte) {
    if ((byte & 0x7fu) == 0x7fu) return f32_nan();
    return bits_to_f32(((byte & 0x80u) << 24) | ((byte & 0x7fu) << 20)) * 0x1p120f;
}

/// Four E4M3 bytes (byte i of `w`) as bf16, exactly (an e4m3 value has 4 significant bits and an
/// exponent within bf16's range, so it is a bf16): elements 0 / 1 in the low / high half of `lo`,
/// elements 2 / 3 of `hi`. Two bytes at a time in the 16-bit halves of a word: exponent and
/// mantissa at bit 4 and the sign at bit 15 make the bf16 of value * 2^-120 (exponent 0 a
/// subnormal bf16), and one bf16x2 product with 2^120 rebiases both exactly; about 3 instructions
/// a code where e4m3_to_f32 and a repack took ~8 (the attention bench's fp8 rows were then no
/// faster than bf16's, H100, twenty-sixth session). The NaN code (S.1111.111) would come out as
/// 480: a word holding one takes e4m3_to_f32 per byte.
FP4_DEVICE void e4m3x4_to_bf16x4(u32 w, u32& lo, u32& hi) {
    if (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) {
        u32 bits[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) bits[i] = f32_to_bits(e4m3_to_f32((w >> (8 * i)) & 0xffu));
        lo = (bits[0] >> 16) | (bits[1] & 0xffff0000u);
        hi = (bits[2] >> 16) | (bits[3] & 0xffff0000u);
        return;
    }
    constexpr u32 TWO_TO_120 = 0x7b807b80u;  // bf16 2^120 in both halves
    const u32 pair01 = (w & 0xffu) | ((w & 0xff00u) << 8), pair23 = ((w >> 16) & 0xffu) | ((w >> 8) & 0xff0000u);
    lo = bf16x2_mul(((pair01 & 0x007f007fu) << 4) | ((pair01 & 0x00800080u) << 8), TWO_TO_120);
    hi = bf16x2_mul(((pair23 & 0x007f007fu) << 4) | ((pair23 & 0x00800080u) << 8), TWO_TO_120);
}

/// fp32 -> E4M3 byte, round to nearest even, saturating to +-448 (infinities too); NaN -> 0x7f.
/// The CPU twin: e4m3_encode in src/formats/nvfp4.rs, bit for bit.
FP4_DEVICE u32 f32_to_e4m3(float v) {
    const u32 bits = f32_to_bits(v);
    const u32 sign = (bits >> 24) & 0x80u;
    const u32 magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7fu;
    u32 code;
    if (magnitude >= 0x43e00000u) {  // 448 and above
        code = 0x7eu;
    } else if (magnitude < 0x3c800000u) {  // below 2^-6: multiples of 2^-9, 8 * 2^-9 carries to code 8
        const float steps = bits_to_f32(magnitude) * 512.0f;  // exact: a power of two, below 8
        code = (u32)steps;
        const float rest = steps - (float)code;  // exact
        if (rest > 0.5f || (rest == 0.5f && (code & 1u))) ++code;
    } else {
        const u32 mantissa = magnitude & 0x7fffffu;
        const u32 rounded = (mantissa + 0x7ffffu + ((mantissa >> 20) & 1u)) >> 20;  // 0..=8, 8 carries
        code = min_u32((((magnitude >> 23) - 120u) << 3) + rounded, 0x7eu);
    }
    return sign | code;
}
// ---- end of NVFP4 decoding ----
