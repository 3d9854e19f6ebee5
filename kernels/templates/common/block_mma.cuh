// ---- block_mma: one warp's 16 x (8 NB) tile of C += A B, k in steps of 16 (bf16 in, fp32 acc) ----
// The accumulator layout is mma.sync.m16n8k16's on every target: lane (g = lane / 4, t = lane % 4)
// holds, for n-block nb, C[g][8 nb + 2t + {0,1}] in acc[nb][0..1] and C[g + 8][...] in
// acc[nb][2..3]. On targets with mma_sync_bf16 the operands come from shared memory through
// ldmatrix; elsewhere (gfx1151 here) the same product is computed lane by lane in fp32 from any
// memory, so kernels written against this header run everywhere with one accumulator layout.
// Operand layouts: A is row-major A[m][k] = a[m * lda + k] or column-major (A_COL:
// A[m][k] = a[k * lda + m]); B is B[k][n] = b[k * ldb + n] (B_KN) or b[n * ldb + k] (B_NK).

FP4_DEVICE u32 acc_row(u32 lane, int i) { return lane / 4 + 8 * (i / 2); }
FP4_DEVICE u32 acc_col(u32 lane, int nb, int i) { return 8 * nb + 2 * (lane % 4) + (i % 2); }

{% if target.instructions.mma_sync_bf16 %}
// ---- mma.sync instructions ----
FP4_DEVICE void mma_bf16_m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

FP4_DEVICE u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

FP4_DEVICE void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}
FP4_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}
// ---- end of mma.sync instructions ----

/// A's fragment of one k16 step: rows m0 .. m0 + 15, columns k0 .. k0 + 15 (shared memory).
template <bool A_COL>
FP4_DEVICE void load_a_fragment(u32 (&fa)[4], const u16* a, u32 lda, u32 m0, u32 k0) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 q = lane / 8, r = lane % 8;
    if (A_COL) {
        // matrices (k0..7 x m0..7), (k0..7 x m0+8..15), (k0+8..15 x m0..7), (k0+8..15 x m0+8..15)
        ldmatrix_x4_trans(fa, a + (u64)(k0 + r + 8 * (q / 2)) * lda + m0 + 8 * (q % 2));
    } else {
        // matrices (m0..7, k0..7), (m0+8..15, k0..7), (m0..7, k0+8..15), (m0+8..15, k0+8..15)
        ldmatrix_x4(fa, a + (u64)(m0 + (lane % 16)) * lda + k0 + 8 * (lane / 16));
    }
}

/// B's fragments of one k16 step for the n-blocks at n and n + 8: {b0, b1} of each.
template <bool B_NK>
FP4_DEVICE void load_b_pair(u32 (&fb)[4], const u16* b, u32 ldb, u32 k0, u32 n) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 q = lane / 8, r = lane % 8;
    if (B_NK) {
        // matrices (nA, k0..7), (nA, k0+8..15), (nB, k0..7), (nB, k0+8..15)
        ldmatrix_x4(fb, b + (u64)(n + r + 8 * (q / 2)) * ldb + k0 + 8 * (q % 2));
    } else {
        // matrices (k0..7 x nA), (k0+8..15 x nA), (k0..7 x nB), (k0+8..15 x nB), transposed
        ldmatrix_x4_trans(fb, b + (u64)(k0 + r + 8 * (q % 2)) * ldb + n + 8 * (q / 2));
    }
}

/// acc += A[m0 .. m0 + 16][k0 .. k0 + 16] * B[k0 .. k0 + 16][n0 .. n0 + 8 NB]. A and B in shared
/// memory, rows 16-byte aligned (lda, ldb multiples of 8). NB is even.
template <int NB, bool A_COL, bool B_NK>
FP4_DEVICE void mma_k16(float (&acc)[NB][4], const u16* a, u32 lda, u32 m0, u32 k0,
                        const u16* b, u32 ldb, u32 n0) {
    static_assert(NB % 2 == 0, "n-blocks are loaded in pairs");
    u32 fa[4];
    load_a_fragment<A_COL>(fa, a, lda, m0, k0);
    #pragma unroll
    for (int p = 0; p < NB / 2; ++p) {
        u32 fb[4];
        load_b_pair<B_NK>(fb, b, ldb, k0, n0 + 16 * p);
        mma_bf16_m16n8k16(acc[2 * p], fa, fb[0], fb[1]);
        mma_bf16_m16n8k16(acc[2 * p + 1], fa, fb[2], fb[3]);
    }
}

/// acc0 += A0 B and acc1 += A1 B for one k16 step (A0, A1 row-major with the same lda), B's
/// fragments loaded once.
template <int NB, bool B_NK>
FP4_DEVICE void mma_k16_pair(float (&acc0)[NB][4], const u16* a0, float (&acc1)[NB][4], const u16* a1, u32 lda,
                             u32 m0, u32 k0, const u16* b, u32 ldb, u32 n0) {
    static_assert(NB % 2 == 0, "n-blocks are loaded in pairs");
    u32 fa0[4], fa1[4];
    load_a_fragment<false>(fa0, a0, lda, m0, k0);
    load_a_fragment<false>(fa1, a1, lda, m0, k0);
    #pragma unroll
    for (int p = 0; p < NB / 2; ++p) {
        u32 fb[4];
        load_b_pair<B_NK>(fb, b, ldb, k0, n0 + 16 * p);
        mma_bf16_m16n8k16(acc0[2 * p], fa0, fb[0], fb[1]);
        mma_bf16_m16n8k16(acc0[2 * p + 1], fa0, fb[2], fb[3]);
        mma_bf16_m16n8k16(acc1[2 * p], fa1, fb[0], fb[1]);
        mma_bf16_m16n8k16(acc1[2 * p + 1], fa1, fb[2], fb[3]);
    }
}
{% else %}
/// acc += A[m0 .. m0 + 16][k0 .. k0 + 16] * B[k0 .. k0 + 16][n0 .. n0 + 8 NB], lane by lane in
/// fp32 (no matrix instructions used on this target); A and B in any memory. The k loop stays
/// rolled so the registers are the accumulators and a few operands.
template <int NB, bool A_COL, bool B_NK>
FP4_DEVICE void mma_k16(float (&acc)[NB][4], const u16* a, u32 lda, u32 m0, u32 k0,
                        const u16* b, u32 ldb, u32 n0) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 m = m0 + lane / 4, n = n0 + 2 * (lane % 4);
    #pragma unroll 1
    for (u32 k = k0; k < k0 + 16; ++k) {
        const float a0 = bf16_to_f32(A_COL ? a[(u64)k * lda + m] : a[(u64)m * lda + k]);
        const float a1 = bf16_to_f32(A_COL ? a[(u64)k * lda + m + 8] : a[(u64)(m + 8) * lda + k]);
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const u32 col = n + 8 * nb;
            const float b0 = bf16_to_f32(B_NK ? b[(u64)col * ldb + k] : b[(u64)k * ldb + col]);
            const float b1 = bf16_to_f32(B_NK ? b[(u64)(col + 1) * ldb + k] : b[(u64)k * ldb + col + 1]);
            acc[nb][0] += a0 * b0; acc[nb][1] += a0 * b1;
            acc[nb][2] += a1 * b0; acc[nb][3] += a1 * b1;
        }
    }
}
{% endif %}
{% if not target.instructions.mma_sync_bf16 %}
/// acc0 += A0 B and acc1 += A1 B for one k16 step (A0, A1 row-major with the same lda).
template <int NB, bool B_NK>
FP4_DEVICE void mma_k16_pair(float (&acc0)[NB][4], const u16* a0, float (&acc1)[NB][4], const u16* a1, u32 lda,
                             u32 m0, u32 k0, const u16* b, u32 ldb, u32 n0) {
    mma_k16<NB, false, B_NK>(acc0, a0, lda, m0, k0, b, ldb, n0);
    mma_k16<NB, false, B_NK>(acc1, a1, lda, m0, k0, b, ldb, n0);
}
{% endif %}
// ---- end of block_mma ----
