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
// no infinities, S.1111.111 is NaN, exponent 0 is subnormal (m * 2^-9).
FP4_DEVICE float e4m3_to_f32(u32 byte) {
    const u32 exponent = (byte >> 3) & 15u;
    const u32 mantissa = byte & 7u;
    if (exponent == 15u && mantissa == 7u) return f32_nan();
    const float magnitude = exponent ? bits_to_f32(((exponent + 120u) << 23) | (mantissa << 20))
                                     : (float)mantissa * 0.001953125f;
    return (byte & 0x80u) ? -magnitude : magnitude;
}
// ---- end of NVFP4 decoding ----
