// Host emulation of the `gdn` kernels for tests/gdn_emulated.rs: the rendered source of a target
// is compiled for the CPU with the sections below in place of its vendor layers, and run with
// one OS thread per GPU thread of a block (blocks one after another), barriers and warp
// shuffles emulated with std::barrier. On NVIDIA renders ldmatrix and mma.sync are emulated
// from the PTX ISA's fragment layouts, so the kernels' fragment addressing is what is tested;
// cp.async copies at once. Sections start at `//@@ name` lines; the test splices them in.

//@@ portability
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
#define FP4_WARP_SIZE 32
#define FP4_KERNEL extern "C"
#define FP4_DEVICE inline
#define FP4_LAUNCH_BOUNDS(...)
// one launch at a time on the host: nothing to chain after
#define allow_next_grid() do {} while (0)
#define wait_for_previous_grid() do {} while (0)
#define chain_after_previous_grid() do {} while (0)
#define __restrict__ __restrict
#define __shared__ static

namespace emu {
struct Thread { u32 tid, bx, by; };
inline thread_local Thread self;
// blocks along x of the running launch (the driver sets it)
inline u32 grid_blocks = 1;
/// A block's warps: a barrier per warp and the words its shuffles exchange.
struct Warps {
    std::vector<std::unique_ptr<std::barrier<>>> barriers;
    u64 exchange[32][32][8];  // [warp][lane][word]
    explicit Warps(u32 threads) {
        for (u32 w = 0; w < threads / 32; ++w) barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
};
// The running thread's block (set by the driver in each thread: the blocks of a cluster run at
// once, each with its own).
inline thread_local unsigned char* dynamic_smem = nullptr;
inline thread_local std::barrier<>* block = nullptr;
inline thread_local Warps* warps = nullptr;
inline void warp_sync() { warps->barriers[self.tid / 32]->arrive_and_wait(); }
inline u64* mine() { return warps->exchange[self.tid / 32][self.tid % 32]; }
inline u64* of(u32 lane) { return warps->exchange[self.tid / 32][lane]; }
// The running launch's clusters: blocks per cluster along y, a barrier of all their threads and
// each block's dynamic shared memory by rank (blockIdx.y % cluster_y).
inline u32 cluster_y = 1;
inline std::barrier<>* cluster = nullptr;
inline std::vector<unsigned char*> cluster_smem;
}  // namespace emu

FP4_DEVICE u32 thread_x() { return emu::self.tid; }
FP4_DEVICE u32 block_x() { return emu::self.bx; }
FP4_DEVICE u32 block_y() { return emu::self.by; }
FP4_DEVICE u32 lane_index() { return emu::self.tid % 32; }
FP4_DEVICE void warp_barrier() { emu::warp_sync(); }
FP4_DEVICE float bits_to_f32(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
FP4_DEVICE u32 f32_to_bits(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
FP4_DEVICE float f32_nan() { return NAN; }
FP4_DEVICE float fast_exp(float v) { return std::exp(v); }
FP4_DEVICE float sqrt_f32(float v) { return std::sqrt(v); }
FP4_DEVICE u32 shuffle_from(u32 v, u32 source) {
    emu::mine()[0] = v;
    emu::warp_sync();
    const u32 r = (u32)emu::of(source)[0];
    emu::warp_sync();
    return r;
}
FP4_DEVICE float emu_shfl_xor(float v, u32 mask) {
    emu::mine()[0] = f32_to_bits(v);
    emu::warp_sync();
    const float r = bits_to_f32((u32)emu::of(lane_index() ^ mask)[0]);
    emu::warp_sync();
    return r;
}
FP4_DEVICE float warp_sum(float value) {
    for (u32 off = 16; off > 0; off >>= 1) value += emu_shfl_xor(value, off);
    return value;
}
FP4_DEVICE float warp_max(float value) {
    for (u32 off = 16; off > 0; off >>= 1) {
        const float other = emu_shfl_xor(value, off);
        value = other > value ? other : value;
    }
    return value;
}
FP4_DEVICE float bf16_to_f32(u16 bits) { return bits_to_f32((u32)bits << 16); }
FP4_DEVICE u16 f32_to_bf16(float value) {
    const u32 bits = f32_to_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)((bits >> 16) | 0x40u);
    return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
// a product of two bf16 is exact in f32 (8 + 8 significant bits), so one rounding, as the GPU's
FP4_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
    const float lo = bf16_to_f32((u16)(a & 0xffffu)) * bf16_to_f32((u16)(b & 0xffffu));
    const float hi = bf16_to_f32((u16)(a >> 16)) * bf16_to_f32((u16)(b >> 16));
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}
struct alignas(8) u32x2 { u32 x, y; };
struct alignas(16) u32x4 { u32 x, y, z, w; };
// The GPU faults on a vector access or a cp.async copy whose address is not aligned to its size
// (the streaming down launch's ring once sat at a 4-byte aligned shared address): so does the
// emulation.
inline void require_aligned(const void* p, unsigned bytes, const char* what) {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes != 0) {
        std::fprintf(stderr, "%s of %u bytes at misaligned address %p\n", what, bytes, p);
        std::abort();
    }
}
/// A cp.async copy of `bytes`: its source and destination both.
inline void require_copy_aligned(void* dst, const void* src, unsigned bytes) {
    require_aligned(dst, bytes, "cp.async destination");
    require_aligned(src, bytes, "cp.async source");
}
FP4_DEVICE u32x2 load_u32x2(const void* p) {
    require_aligned(p, 8, "vector load");
    u32x2 v;
    std::memcpy(&v, p, 8);
    return v;
}
FP4_DEVICE u32x4 load_u32x4(const void* p) {
    require_aligned(p, 16, "vector load");
    u32x4 v;
    std::memcpy(&v, p, 16);
    return v;
}
FP4_DEVICE void store_u32x4(void* p, u32x4 v) {
    require_aligned(p, 16, "vector store");
    std::memcpy(p, &v, 16);
}
// the host's threads see each other's writes (atomic loads for the counters' data races)
FP4_DEVICE u16 load_coherent_u16(const u16* p) { return *p; }
FP4_DEVICE u32 load_coherent_u32(const u32* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
FP4_DEVICE float load_coherent_f32(const float* p) { return *p; }
FP4_DEVICE u32x4 load_coherent_u32x4(const void* p) { return load_u32x4(p); }
FP4_DEVICE void store_coherent_u32x4(void* p, u32x4 v) { store_u32x4(p, v); }
// a hint to the L2: nothing to do on the host
FP4_DEVICE void prefetch_l2(const void*, u32) {}

//@@ vendor
FP4_DEVICE float shfl_xor(float v, u32 mask) { return emu_shfl_xor(v, mask); }
FP4_DEVICE u32 atomic_add_u32(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE float exp_f32(float v) { return std::exp(v); }
FP4_DEVICE float log_f32(float v) { return std::log(v); }
FP4_DEVICE float rsqrt_f32(float v) { return 1.0f / std::sqrt(v); }
// the reciprocal instruction, rounded as the host rounds one division by another
FP4_DEVICE float fast_div(float a, float b) { return a * (1.0f / b); }
#define STEP_BOUNDS STEP_THREADS
#define PREPARE_BOUNDS CHUNK_THREADS

//@@ sync
// common/sync.cuh's vendor primitives (also the moe emulation's): blocks run one after another
#include <chrono>
FP4_DEVICE u32 grid_blocks() { return emu::grid_blocks; }
FP4_DEVICE void block_barrier() { emu::block->arrive_and_wait(); }
FP4_DEVICE void release_before_barrier() { std::atomic_thread_fence(std::memory_order_seq_cst); }
FP4_DEVICE void acquire_after_barrier() { std::atomic_thread_fence(std::memory_order_seq_cst); }
FP4_DEVICE u32 atomic_add_block(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE u32 atomic_add_relaxed_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE u32 atomic_add_acq_rel_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE void add_release_gpu(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE void store_release_gpu(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE u32 load_acquire_gpu(const u32* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
FP4_DEVICE u32 shuffle_xor(u32 v, int offset) { return f32_to_bits(emu_shfl_xor(bits_to_f32(v), offset)); }
FP4_DEVICE u32 warp_max_u32(u32 v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const u32 other = shuffle_xor(v, offset);
        v = other > v ? other : v;
    }
    return v;
}
FP4_DEVICE u32 warp_min_u32(u32 v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const u32 other = shuffle_xor(v, offset);
        v = other < v ? other : v;
    }
    return v;
}
FP4_DEVICE void spin_pause() { std::this_thread::yield(); }
FP4_DEVICE u64 wall_clock() {
    return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
#define FP4_WALL_CLOCK_PER_SECOND 1000000000ull
// With blocks run one after another a wait can only be satisfied already: one that is not is a
// lost signal or an item waiting for a later one.
FP4_DEVICE void hang_detected(const char* what, u32 value, u32 target) {
    std::fprintf(stderr, "emulated block %u waited for %s (%u, needs %u)\n", block_x(), what, value, target);
    std::exit(4);
}

//@@ mma
// ldmatrix .x4: lanes 8q .. 8q + 7 give the row addresses of matrix q; lane l receives of each
// matrix row l / 4, elements 2 (l % 4) and + 1 (.trans: rows 2 (l % 4) and + 1, element l / 4).
FP4_DEVICE void emu_ldmatrix(u32 (&r)[4], const void* p, bool trans) {
    emu::mine()[0] = (u64)(uintptr_t)p;
    emu::warp_sync();
    const u32 lane = lane_index();
    for (u32 q = 0; q < 4; ++q) {
        u16 e[2];
        for (u32 h = 0; h < 2; ++h) {
            if (trans) {
                const u16* row = (const u16*)(uintptr_t)emu::of(q * 8 + 2 * (lane % 4) + h)[0];
                e[h] = row[lane / 4];
            } else {
                const u16* row = (const u16*)(uintptr_t)emu::of(q * 8 + lane / 4)[0];
                e[h] = row[2 * (lane % 4) + h];
            }
        }
        r[q] = (u32)e[0] | ((u32)e[1] << 16);
    }
    emu::warp_sync();
}
FP4_DEVICE void ldmatrix_x4(u32 (&r)[4], const void* p) { emu_ldmatrix(r, p, false); }
FP4_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], const void* p) { emu_ldmatrix(r, p, true); }
// mma.m16n8k16.row.col bf16: lane (g = l / 4, t = l % 4) holds A[g][2t..], A[g+8][2t..],
// A[g][2t+8..], A[g+8][2t+8..]; B[2t..][g], B[2t+8..][g]; C[g][2t..] and C[g+8][2t..].
// the low / high bf16 of an exchange word
FP4_DEVICE float emu_lo(u64 w) { return bf16_to_f32((u16)(w & 0xffffu)); }
FP4_DEVICE float emu_hi(u64 w) { return bf16_to_f32((u16)((w >> 16) & 0xffffu)); }
// the warp's 16 x 16 A operand from its lanes' fragments (exchange words 0..3 of each lane,
// written before a warp_sync; also the wgmma emulation's, one warp's 16 rows)
FP4_DEVICE void emu_gather_a(float (&A)[16][16]) {
    for (u32 l = 0; l < 32; ++l) {
        const u64* f = emu::of(l);
        const u32 g = l / 4, t = l % 4;
        A[g][2 * t] = emu_lo(f[0]); A[g][2 * t + 1] = emu_hi(f[0]);
        A[g + 8][2 * t] = emu_lo(f[1]); A[g + 8][2 * t + 1] = emu_hi(f[1]);
        A[g][2 * t + 8] = emu_lo(f[2]); A[g][2 * t + 9] = emu_hi(f[2]);
        A[g + 8][2 * t + 8] = emu_lo(f[3]); A[g + 8][2 * t + 9] = emu_hi(f[3]);
    }
}
FP4_DEVICE void mma_bf16_m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    u64* me = emu::mine();
    for (int i = 0; i < 4; ++i) me[i] = a[i];
    me[4] = b0;
    me[5] = b1;
    emu::warp_sync();
    float A[16][16], B[16][8];
    emu_gather_a(A);
    for (u32 l = 0; l < 32; ++l) {
        const u64* f = emu::of(l);
        const u32 g = l / 4, t = l % 4;
        B[2 * t][g] = emu_lo(f[4]); B[2 * t + 1][g] = emu_hi(f[4]);
        B[2 * t + 8][g] = emu_lo(f[5]); B[2 * t + 9][g] = emu_hi(f[5]);
    }
    emu::warp_sync();
    const u32 lane = lane_index(), g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const u32 row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
        c[i] += sum;
    }
}
FP4_DEVICE u32 shared_address(const void*) { return 0; }

//@@ cp_async
FP4_DEVICE void cp_async16(void* dst, const void* src) {
    require_copy_aligned(dst, src, 16);
    std::memcpy(dst, src, 16);
}
// shared addresses are offsets into the block's dynamic shared memory
FP4_DEVICE u32 cp_async_shared_address(const void* p) { return (u32)(static_cast<const unsigned char*>(p) - emu::dynamic_smem); }
FP4_DEVICE void cp_async16_shared(u32 dst, const void* src) { cp_async16(emu::dynamic_smem + dst, src); }
FP4_DEVICE void cp_async_commit() {}
template <int N>
FP4_DEVICE void cp_async_wait() {}

//@@ driver
// Commands (little-endian) from argv[1]: 1 = buffer (u32 id, u64 bytes, bytes), 2 = launch
// (u32 name length, name, u32 grid x, grid y, cluster y (blocks per cluster along y), threads,
// shared bytes, u32 args, per argument u32 kind (0 pointer: u64 id << 40 | byte offset, 1 null,
// 2 u32, 3 f32 bits) and u64 value), 3 = dump (u32 id) to argv[2] as (u32 id, u64 bytes, bytes).
// Blocks run one after another, except that the cluster_y blocks of a cluster run at once.
namespace emu {
struct Arg { u32 kind; u64 value; };
inline std::vector<std::vector<unsigned char>> buffers(1);

template <class T>
T get(const Arg& a) {
    if constexpr (std::is_pointer_v<T>) {
        if (a.kind == 1) return nullptr;
        if (a.kind != 0) { std::fprintf(stderr, "argument kind %u where a pointer is expected\n", a.kind); std::exit(3); }
        auto& buffer = buffers.at(a.value >> 40);
        return reinterpret_cast<T>(buffer.data() + (a.value & ((1ull << 40) - 1)));
    } else if constexpr (std::is_same_v<T, float>) {
        if (a.kind != 3) { std::fprintf(stderr, "argument kind %u where f32 is expected\n", a.kind); std::exit(3); }
        return bits_to_f32((u32)a.value);
    } else {
        if (a.kind != 2) { std::fprintf(stderr, "argument kind %u where u32 is expected\n", a.kind); std::exit(3); }
        return (T)a.value;
    }
}

template <class... Ts, size_t... I>
void call(void (*f)(Ts...), const std::vector<Arg>& a, std::index_sequence<I...>) { f(get<Ts>(a[I])...); }

template <class... Ts>
std::function<void(const std::vector<Arg>&)> kernel(void (*f)(Ts...)) {
    return [f](const std::vector<Arg>& a) {
        if (a.size() != sizeof...(Ts)) { std::fprintf(stderr, "%zu arguments for a kernel of %zu\n", a.size(), sizeof...(Ts)); std::exit(3); }
        call(f, a, std::index_sequence_for<Ts...>{});
    };
}
}  // namespace emu

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    // the test adds one {"name", emu::kernel(name)} entry per kernel of the rendered source
    std::map<std::string, std::function<void(const std::vector<emu::Arg>&)>> kernels = {
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
            emu::buffers[id].resize(bytes + 64);  // slack: 16-byte loads at a row's end stay inside
            read(emu::buffers[id].data(), bytes);
            emu::buffers[id].resize(bytes);
            emu::buffers[id].reserve(bytes + 64);
        } else if (op == 2) {
            std::string name(u32_(), '\0');
            read(name.data(), name.size());
            const u32 gx = u32_(), gy = u32_(), cy = u32_(), threads = u32_(), smem = u32_(), n = u32_();
            std::vector<emu::Arg> args(n);
            for (auto& a : args) { a.kind = u32_(); a.value = u64_(); }
            auto found = kernels.find(name);
            if (found == kernels.end()) { std::fprintf(stderr, "no kernel %s\n", name.c_str()); return 3; }
            if (cy == 0 || gy % cy != 0) { std::fprintf(stderr, "%s: clusters of %u blocks over a grid of %u\n", name.c_str(), cy, gy); return 3; }
            std::vector<std::vector<unsigned char>> shared(cy, std::vector<unsigned char>(smem + 16));
            std::vector<std::unique_ptr<std::barrier<>>> blocks;
            std::vector<std::unique_ptr<emu::Warps>> warps;
            emu::cluster_smem.clear();
            for (u32 r = 0; r < cy; ++r) {
                emu::cluster_smem.push_back(shared[r].data() + (16 - (uintptr_t)shared[r].data() % 16) % 16);
                blocks.push_back(std::make_unique<std::barrier<>>(threads));
                warps.push_back(std::make_unique<emu::Warps>(threads));
            }
            std::barrier<> cluster(threads * cy);
            emu::cluster_y = cy;
            emu::cluster = &cluster;
            emu::grid_blocks = gx;
            std::vector<std::thread> pool;
            for (u32 r = 0; r < cy; ++r) {
                for (u32 t = 0; t < threads; ++t) {
                    pool.emplace_back([&, r, t] {
                        emu::dynamic_smem = emu::cluster_smem[r];
                        emu::block = blocks[r].get();
                        emu::warps = warps[r].get();
                        for (u32 y0 = 0; y0 < gy; y0 += cy)
                            for (u32 bx = 0; bx < gx; ++bx) {
                                const u32 by = y0 + r;
                                emu::self = {t, bx, by};
                                found->second(args);
                                emu::block->arrive_and_wait();
                            }
                    });
                }
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
