// A CPU emulation of the CUDA dialect the rendered NVIDIA sources use, for running kernels on
// a machine without a GPU (tests/verify.rs). Host C++20, one OS thread:
// - each CUDA thread of a block is a fiber with its own stack; blocks run one after another, in
//   a shuffled order (so the block that arrives last at a counter is not always the same one);
// - __syncthreads and the warp exchanges behind __shfl_sync / __ballot_sync are real barriers:
//   a fiber runs until it reaches one, then the next runnable fiber runs (in a shuffled order
//   each round, so a missing barrier reads stale shared memory instead of passing by luck);
// - a barrier that can never complete (divergent __syncthreads, early exit) is reported;
// - __shared__ variables are static (one block at a time), atomics are plain operations
//   (fibers only switch at barriers), fences are no-ops, arithmetic intrinsics are the IEEE
//   operations they name (compile with -ffp-contract=off).
#pragma once

// one launch at a time: nothing to chain after (common/prelude.cuh keeps these definitions)
#define allow_next_grid() do {} while (0)
#define wait_for_previous_grid() do {} while (0)
#define chain_after_previous_grid() do {} while (0)
// a hint to the L2: nothing to do on the host (its address is still checked: 16-byte aligned)
#define prefetch_l2(p, bytes) emu::prefetch_hint((p), (bytes))
#include <csetjmp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

struct EmuDim {
    unsigned x = 0, y = 0, z = 0;
};

namespace emu {

struct Fiber {
    ucontext_t start;
    jmp_buf resume;
    std::vector<char> stack;
    EmuDim thread_idx;
    bool started = false;
    bool done = false;
    int waiting = 0;            // 0 runnable, 1 block barrier, 2 warp barrier
    unsigned long generation = 0;
};

struct Block {
    std::vector<Fiber> fibers;
    std::function<void()> body;
    unsigned threads = 0;
    unsigned block_arrived = 0;
    unsigned long block_generation = 0;
    std::vector<unsigned> warp_arrived;
    std::vector<unsigned long> warp_generation;
    std::vector<unsigned long long> exchange;  // [warp][32]
    jmp_buf scheduler;
    Fiber* current = nullptr;
    unsigned long long rng = 0x9e3779b97f4a7c15ull;
    const char* failure = nullptr;
};

inline Block& block() {
    static Block b;
    return b;
}
inline EmuDim& block_idx() {
    static EmuDim d;
    return d;
}
inline EmuDim& grid_dim() {
    static EmuDim d;
    return d;
}
inline EmuDim& block_dim() {
    static EmuDim d;
    return d;
}

inline void yield_to_scheduler() {
    Block& b = block();
    if (!_setjmp(b.current->resume)) _longjmp(b.scheduler, 1);
}

inline void fiber_entry() {
    Block& b = block();
    b.body();
    b.current->done = true;
    _longjmp(b.scheduler, 1);
}

/// cp.async.bulk.prefetch.L2's contract, checked (the prefetch itself has nothing to do here): a
/// 16-byte aligned address and a size that is a nonzero multiple of 16.
inline void prefetch_hint(const void* p, unsigned bytes) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) != 0 || bytes == 0 || bytes % 16 != 0)
        block().failure = "an L2 prefetch of a misaligned address or size";
}

inline unsigned lane() { return block().current->thread_idx.x % 32; }
inline unsigned warp() { return block().current->thread_idx.x / 32; }

inline void sync_block() {
    Block& b = block();
    Fiber* f = b.current;
    if (++b.block_arrived == b.threads) {
        b.block_arrived = 0;
        ++b.block_generation;
        for (Fiber& o : b.fibers)
            if (o.waiting == 1) o.waiting = 0;
        return;
    }
    f->waiting = 1;
    f->generation = b.block_generation;
    yield_to_scheduler();
}

inline void sync_warp() {
    Block& b = block();
    Fiber* f = b.current;
    const unsigned w = warp();
    const unsigned first = w * 32, last = first + 32 < b.threads ? first + 32 : b.threads;
    if (++b.warp_arrived[w] == last - first) {
        b.warp_arrived[w] = 0;
        ++b.warp_generation[w];
        for (unsigned t = first; t < last; ++t)
            if (b.fibers[t].waiting == 2) b.fibers[t].waiting = 0;
        return;
    }
    f->waiting = 2;
    yield_to_scheduler();
}

/// Sets `v` to a random permutation of 0..v.size() (Fisher-Yates on the generator `rng`).
inline void shuffle(std::vector<unsigned>& v, unsigned long long& rng) {
    for (unsigned i = 0; i < v.size(); ++i) v[i] = i;
    for (unsigned i = (unsigned)v.size(); i > 1; --i) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned k = (unsigned)((rng >> 33) % i);
        const unsigned tmp = v[i - 1];
        v[i - 1] = v[k];
        v[k] = tmp;
    }
}

/// Runs `body` as a grid of grid_x * grid_y blocks of `threads` threads. Returns 0, or 1 after
/// printing why the launch could not complete.
inline int launch(unsigned grid_x, unsigned grid_y, unsigned threads, std::function<void()> body) {
    Block& b = block();
    b.threads = threads;
    b.body = std::move(body);
    b.failure = nullptr;
    b.fibers.resize(threads);
    for (Fiber& f : b.fibers)
        if (f.stack.empty()) f.stack.resize(256 * 1024);
    const unsigned warps = (threads + 31) / 32;
    b.warp_arrived.assign(warps, 0);
    b.warp_generation.assign(warps, 0);
    b.exchange.assign(warps * 32, 0);
    grid_dim() = {grid_x, grid_y, 1};
    block_dim() = {threads, 1, 1};
    std::vector<unsigned> order(threads);
    // the blocks in a random order (a fixed generator: reproducible runs)
    std::vector<unsigned> blocks(grid_x * grid_y);
    shuffle(blocks, b.rng);
    for (const unsigned block_number : blocks) {
        const unsigned bx = block_number % grid_x, by = block_number / grid_x;
        block_idx() = {bx, by, 0};
        b.block_arrived = 0;
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = b.fibers[t];
            f.thread_idx = {t, 0, 0};
            f.started = false;
            f.done = false;
            f.waiting = 0;
            getcontext(&f.start);
            f.start.uc_stack.ss_sp = f.stack.data();
            f.start.uc_stack.ss_size = f.stack.size();
            f.start.uc_link = nullptr;
            makecontext(&f.start, fiber_entry, 0);
        }
        for (;;) {
            // one round: every runnable fiber runs to its next barrier, in a shuffled order
            shuffle(order, b.rng);
            bool ran = false, all_done = true;
            for (unsigned i = 0; i < threads; ++i) {
                Fiber& f = b.fibers[order[i]];
                if (f.done) continue;
                all_done = false;
                if (f.waiting != 0) continue;
                ran = true;
                b.current = &f;
                if (!_setjmp(b.scheduler)) {
                    if (!f.started) {
                        f.started = true;
                        ucontext_t here;
                        // first entry on the fiber's own stack; it comes back by longjmp
                        swapcontext(&here, &f.start);
                    } else {
                        _longjmp(f.resume, 1);
                    }
                }
            }
            if (all_done) break;
            if (!ran) {
                unsigned done = 0, at_block = 0, at_warp = 0;
                for (Fiber& f : b.fibers) {
                    done += f.done;
                    at_block += f.waiting == 1;
                    at_warp += f.waiting == 2;
                }
                std::fprintf(stderr,
                             "emulation: block (%u, %u) cannot go on: %u threads exited, %u wait "
                             "at __syncthreads, %u at a warp exchange\n",
                             bx, by, done, at_block, at_warp);
                return 1;
            }
        }
        if (b.failure) {
            std::fprintf(stderr, "emulation: block (%u, %u): %s\n", bx, by, b.failure);
            return 1;
        }
    }
    return 0;
}

template <class T>
inline T exchange(T value, unsigned src_lane) {
    Block& b = block();
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    const unsigned w = warp();
    sync_warp();  // the previous exchange's reads are done
    b.exchange[w * 32 + lane()] = bits;
    sync_warp();
    const unsigned long long got = b.exchange[w * 32 + (src_lane & 31)];
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

}  // namespace emu

#define threadIdx (emu::block().current->thread_idx)
#define blockIdx (emu::block_idx())
#define blockDim (emu::block_dim())
#define gridDim (emu::grid_dim())
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__

inline void __syncthreads() { emu::sync_block(); }
// the whole warp (the kernels call it with every lane; common/prelude.cuh warp_barrier)
inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }
inline void __threadfence() {}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) { return emu::exchange(v, (unsigned)src); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) { return emu::exchange(v, emu::lane() ^ (unsigned)mask); }
inline unsigned __ballot_sync(unsigned, bool p) {
    emu::Block& b = emu::block();
    const unsigned w = emu::warp();
    emu::sync_warp();
    b.exchange[w * 32 + emu::lane()] = p ? 1 : 0;
    emu::sync_warp();
    unsigned mask = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (b.exchange[w * 32 + l]) mask |= 1u << l;
    return mask;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
    const unsigned old = *p;
    if (old == expected) *p = desired;
    return old;
}
inline unsigned long long __ldcg(const unsigned long long* p) { return *p; }
inline unsigned short __ldcg(const unsigned short* p) { return *p; }
inline unsigned __ldcg(const unsigned* p) { return *p; }
inline float __ldcg(const float* p) { return *p; }
inline float __ldcs(const float* p) { return *p; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __ull2double_rn(unsigned long long v) { return (double)v; }
inline unsigned long long __double2ull_rn(double v) { return (unsigned long long)std::nearbyint(v); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float __expf(float v) { return std::exp(v); }
struct __nv_bfloat16 {
    unsigned short bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40u)};
    return {(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.bits; }
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
// a product of two bf16 is exact in f32, so one rounding, as the GPU's
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
    auto mul = [](__nv_bfloat16 p, __nv_bfloat16 q) {
        return __float2bfloat16_rn(__uint_as_float((unsigned)p.bits << 16) *
                                   __uint_as_float((unsigned)q.bits << 16));
    };
    return {mul(a.x, b.x), mul(a.y, b.y)};
}
struct uint2 {
    unsigned x, y;
};
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint4 __ldcg(const uint4* p) { return *p; }
inline void __stcg(uint4* p, uint4 v) { *p = v; }
