// Host emulation of the `moe` kernels for tests/moe_emulated.rs: the rendered source of a target
// is compiled for the CPU with tests/gdn_emulator.cpp's portability, sync and mma.sync layers
// and the sections below in place of its vendor layers, one OS thread per GPU thread of a block,
// blocks one after another. The persistent kernel needs no second block to be resident (items
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

//@@ driver
// Commands (little-endian) from argv[1]: 1 = buffer (u32 id, u64 bytes, bytes); 2 = launch (u32
// name length, name, u32 grid, u32 threads, then the kernel's 34 parameters (MOE_PARAMETERS) as
// u64: pointers as id << 40 | byte offset, 0 for null); 3 = dump (u32 id) to argv[2] as (u32 id,
// u64 bytes, bytes).
namespace emu {
inline std::vector<std::vector<unsigned char>> buffers(1);
inline void* pointer(u64 v) {
    if (v == 0) return nullptr;
    return buffers.at(v >> 40).data() + (v & ((1ull << 40) - 1));
}
}  // namespace emu

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    // the test adds one {"name", name} entry per kernel of the rendered source
    using MoeKernel = void (*)(MOE_PARAMETERS);
    std::map<std::string, MoeKernel> kernels = {
    };
    FILE* in = std::fopen(argv[1], "rb");
    FILE* out = std::fopen(argv[2], "wb");
    if (!in || !out) return 2;
    auto read = [&](void* p, size_t n) {
        if (std::fread(p, 1, n, in) != n) { std::fprintf(stderr, "truncated command file\n"); std::exit(3); }
    };
    auto u32_ = [&]() { u32 v; read(&v, 4); return v; };
    auto u64_ = [&]() { u64 v; read(&v, 8); return v; };
    for (;;) {
        u32 op;
        if (std::fread(&op, 1, 4, in) != 4) break;
        if (op == 1) {
            const u32 id = u32_();
            const u64 bytes = u64_();
            if (emu::buffers.size() <= id) emu::buffers.resize(id + 1);
            emu::buffers[id].resize(bytes);
            read(emu::buffers[id].data(), bytes);
        } else if (op == 2) {
            std::string name(u32_(), '\0');
            read(name.data(), name.size());
            const u32 grid = u32_(), threads = u32_();
            u64 f[34];
            for (auto& v : f) v = u64_();
            auto found = kernels.find(name);
            if (found == kernels.end()) { std::fprintf(stderr, "no kernel %s\n", name.c_str()); return 3; }
            emu::grid_blocks = grid;
            std::barrier<> block(threads);
            emu::Warps warps(threads);
            std::vector<std::thread> pool;
            for (u32 t = 0; t < threads; ++t) {
                pool.emplace_back([&, t] {
                    emu::block = &block;
                    emu::warps = &warps;
                    for (u32 bx = 0; bx < grid; ++bx) {
                        emu::self = {t, bx, 0};
                        found->second((const u16*)emu::pointer(f[0]), (const u16*)emu::pointer(f[1]),
                                      (u16*)emu::pointer(f[2]), emu::pointer(f[3]), emu::pointer(f[4]),
                                      emu::pointer(f[5]), emu::pointer(f[6]), emu::pointer(f[7]),
                                      (const float*)emu::pointer(f[8]), (const float*)emu::pointer(f[9]),
                                      (u32*)emu::pointer(f[10]), (u32*)emu::pointer(f[11]),
                                      (u32*)emu::pointer(f[12]), (u32*)emu::pointer(f[13]),
                                      (u32*)emu::pointer(f[14]), (u32*)emu::pointer(f[15]),
                                      (u32*)emu::pointer(f[16]), (u32*)emu::pointer(f[17]),
                                      (float*)emu::pointer(f[18]), (float*)emu::pointer(f[19]),
                                      (float*)emu::pointer(f[20]), (float*)emu::pointer(f[21]),
                                      (u16*)emu::pointer(f[22]), (u32)f[23], (u32)f[24], (u32)f[25],
                                      (u32)f[26], (u32)f[27], (u32)f[28], (u32)f[29], (u32)f[30],
                                      (u32)f[31], (const u8*)emu::pointer(f[32]), (u32)f[33]);
                        block.arrive_and_wait();
                    }
                });
            }
            for (auto& th : pool) th.join();
        } else if (op == 3) {
            const u32 id = u32_();
            const u64 bytes = emu::buffers.at(id).size();
            std::fwrite(&id, 4, 1, out);
            std::fwrite(&bytes, 8, 1, out);
            std::fwrite(emu::buffers[id].data(), 1, bytes, out);
        } else {
            std::fprintf(stderr, "unknown command %u\n", op);
            return 3;
        }
    }
    std::fclose(out);
    return 0;
}
