// Host emulation of the `moe` kernels for tests/moe_emulated.rs: the rendered source of a target
// is compiled for the CPU with tests/gdn_emulator.cpp's portability, sync and mma.sync layers
// and the sections below in place of its vendor layers, and run by gdn_emulator.cpp's driver:
// one OS thread per GPU thread of a block, blocks one after another. The persistent kernel needs no second block to be resident (items
// are claimed in order), so one block does all the work and the later ones find none: that checks
// the item decoding, routing, alignment, fragment addressing, combine and the counters' reset.
// Sections start at `//@@ name` lines; the test splices them in.

//@@ sync
// after gdn_emulator.cpp's sync layer: the streaming form's rare paths inline
#define STREAM_RARE inline

//@@ bulk_copy
// common/bulk_copy.cuh: a copy happens at once; the mbarrier's low half counts its completed
// phases (the parity waiters test), its high half the bytes announced and not yet copied.
FP4_DEVICE void mbarrier_init_one(u64* bar) { __atomic_store_n(bar, 0ull, __ATOMIC_SEQ_CST); }
FP4_DEVICE void mbarrier_arrive_expect_bytes(u64* bar, u32 bytes) {
    __atomic_fetch_add(bar, (u64)bytes << 32, __ATOMIC_SEQ_CST);
}
FP4_DEVICE void bulk_copy_to_shared(void* dst, const void* src, u32 bytes, u64* bar) {
    if (bytes % 16 != 0 || (uintptr_t)dst % 16 != 0 || (uintptr_t)src % 16 != 0) {
        std::fprintf(stderr, "bulk copy of %u bytes from %p to %p: not 16-byte multiples\n", bytes, src, dst);
        std::exit(5);
    }
    std::memcpy(dst, src, bytes);
    const u64 left = __atomic_sub_fetch(bar, (u64)bytes << 32, __ATOMIC_SEQ_CST);
    if ((left >> 32) == 0) __atomic_fetch_add(bar, 1ull, __ATOMIC_SEQ_CST);  // the phase completes
}
FP4_DEVICE void bulk_fence_after_reads() { std::atomic_thread_fence(std::memory_order_seq_cst); }
FP4_DEVICE void mbarrier_wait_parity(u64* bar, u32 parity) {
    while ((__atomic_load_n(bar, __ATOMIC_SEQ_CST) & 1u) == parity) std::this_thread::yield();
}

//@@ mma_adapters
// common/mma.cuh's inline PTX, on the emulation of tests/gdn_emulator.cpp
FP4_DEVICE void mma_m16n8k16_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    mma_bf16_m16n8k16(c, a, b0, b1);
}
// mul.rn.bf16x2: each half multiplied in f32 (exact for two bf16) and rounded to bf16
FP4_DEVICE u32 mul_bf16x2(u32 a, u32 b) {
    const u32 lo = f32_to_bf16(bf16_to_f32((u16)(a & 0xffffu)) * bf16_to_f32((u16)(b & 0xffffu)));
    const u32 hi = f32_to_bf16(bf16_to_f32((u16)(a >> 16)) * bf16_to_f32((u16)(b >> 16)));
    return lo | (hi << 16);
}
FP4_DEVICE u32x4 load_stream_u32x4(const void* p) { return load_u32x4(p); }
FP4_DEVICE u32 load_stream_u16(const void* p) { u16 v; std::memcpy(&v, p, 2); return v; }

//@@ wmma
// v_wmma_f32_16x16x16_bf16 (wave32): lane l holds A row l % 16 and B column l % 16 (16 values
// each, K in order; lanes l and l + 16 hold the same); D element v of lane l is row 2v + l / 16,
// column l % 16. The lanes trade their operands through the warp exchange.
FP4_DEVICE v8f emu_wmma(v16s a, v16s b, v8f c) {
    u64* me = emu::mine();
    for (int i = 0; i < 4; ++i) {
        u64 wa = 0, wb = 0;
        for (int j = 0; j < 4; ++j) {
            wa |= (u64)(u16)a[4 * i + j] << (16 * j);
            wb |= (u64)(u16)b[4 * i + j] << (16 * j);
        }
        me[i] = wa;
        me[4 + i] = wb;
    }
    emu::warp_sync();
    float A[16][16], B[16][16];
    for (u32 l = 0; l < 16; ++l) {
        const u64* f = emu::of(l);
        for (int kk = 0; kk < 16; ++kk) {
            A[l][kk] = bf16_to_f32((u16)(f[kk / 4] >> (16 * (kk % 4))));
            B[kk][l] = bf16_to_f32((u16)(f[4 + kk / 4] >> (16 * (kk % 4))));
        }
    }
    emu::warp_sync();
    const u32 lane = lane_index();
    for (int v = 0; v < 8; ++v) {
        const u32 row = 2 * v + lane / 16, col = lane % 16;
        float sum = 0.0f;
        for (int kk = 0; kk < 16; ++kk) sum += A[row][kk] * B[kk][col];
        c[v] += sum;
    }
    return c;
}
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32 emu_wmma
