// Host emulation of the `gemm` tensor-core kernels for tests/gemm_emulated.rs: the source rendered
// for an mma.sync target is compiled for the CPU with tests/gdn_emulator.cpp's portability layer,
// mma.sync emulation and driver (one OS thread per GPU thread of a block, blocks one after
// another), tests/moe_emulator.cpp's adapters for common/mma.cuh, and the sections below for the
// CUDA built-ins gemm.cu calls directly. cp.async copies at once, so the rings are exercised in
// their fastest order only; what this checks is the partition, the ring and X addressing, the
// chunk bookkeeping and the split-K finishes (through the L2, and in a cluster, whose blocks the
// driver runs at once). Sections start at `//@@ name` lines.

//@@ cuda
#include <algorithm>
namespace emu {
struct Dims { u32 x, y; };
inline thread_local Dims grid;  // set by the driver with the block index
}  // namespace emu
#define gridDim emu::grid
using std::min;
struct alignas(16) float4 { float x, y, z, w; };
FP4_DEVICE float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
FP4_DEVICE float4 __ldcg(const float4* p) { return *p; }
FP4_DEVICE void __syncthreads() { emu::block->arrive_and_wait(); }
FP4_DEVICE void __syncwarp() { emu::warp_sync(); }
FP4_DEVICE void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
FP4_DEVICE u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
FP4_DEVICE u32 __shfl_sync(u32, u32 v, int lane) {
    emu::mine()[0] = v;
    emu::warp_sync();
    const u32 r = (u32)emu::of((u32)lane)[0];
    emu::warp_sync();
    return r;
}

//@@ cp_async
// shared addresses are offsets into the block's dynamic shared memory
FP4_DEVICE u32 cp_async_shared_address(const void* p) { return (u32)(static_cast<const unsigned char*>(p) - emu::dynamic_smem); }
FP4_DEVICE void cp_async16_zfill(void* dst, const void* src, u32 src_bytes) {
    require_copy_aligned(dst, src, 16);
    if (src_bytes == 16) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
}
FP4_DEVICE void cp_async16_zfill_shared(u32 dst, const void* src, u32 src_bytes) {
    cp_async16_zfill(emu::dynamic_smem + dst, src, src_bytes);
}
FP4_DEVICE void cp_async16(void* dst, const void* src) {
    require_copy_aligned(dst, src, 16);
    std::memcpy(dst, src, 16);
}
FP4_DEVICE void cp_async16_shared(u32 dst, const void* src) { cp_async16(emu::dynamic_smem + dst, src); }
FP4_DEVICE void cp_async_commit() {}
template <int N>
FP4_DEVICE void cp_async_wait() {}

//@@ cluster
// Thread block clusters: the driver runs a cluster's blocks at once (tests/gdn_emulator.cpp), each
// with its own dynamic shared memory, which the others find by rank at the same offset.
FP4_DEVICE u32 cluster_blocks_y() { return emu::cluster_y; }
FP4_DEVICE void cluster_barrier() { emu::cluster->arrive_and_wait(); }
FP4_DEVICE float4 load_cluster_f4(const float4* local, u32 rank) {
    const auto offset = reinterpret_cast<const unsigned char*>(local) - emu::dynamic_smem;
    float4 v;
    std::memcpy(&v, emu::cluster_smem.at(rank) + offset, sizeof v);
    return v;
}

//@@ wgmma
// The warpgroup MMA of gemm_*_wgmma_m64, one warp's share at a time: each warp's 16 rows of A
// (its lanes' m16n8k16 A fragments) times B[16 x 64] read from shared memory through the
// descriptor as the no-swizzle K-major layout places it (element (k, n) at start + (k / 8) *
// leading + (n / 8) * stride + (n % 8) * 16 + (k % 8) * 2). Asynchrony, fences, register pins and the proxy
// fence have nothing to order on the host.
FP4_DEVICE void wgmma_fence() {}
FP4_DEVICE void wgmma_commit() {}
template <int N>
FP4_DEVICE void wgmma_wait() {}
FP4_DEVICE void fence_proxy_async_shared() {}
template <class T>
FP4_DEVICE void wgmma_pin(T&) {}
FP4_DEVICE void wgmma_m64n64k16_bf16(float (&d)[32], const u32 (&a)[4], u64 b) {
    u64* me = emu::mine();
    for (int i = 0; i < 4; ++i) me[i] = a[i];
    emu::warp_sync();
    float A[16][16];
    emu_gather_a(A);  // tests/gdn_emulator.cpp's mma section
    emu::warp_sync();
    const u32 start = (u32)(b & 0x3fffu) << 4, leading = (u32)((b >> 16) & 0x3fffu) << 4;
    const u32 stride = (u32)((b >> 32) & 0x3fffu) << 4;
    auto B = [&](u32 kk, u32 n) {
        u16 v;
        std::memcpy(&v, emu::dynamic_smem + start + (kk / 8) * leading + (n / 8) * stride + (n % 8) * 16 + (kk % 8) * 2, 2);
        return bf16_to_f32(v);
    };
    const u32 lane = lane_index(), g = lane / 4, t = lane % 4;
    for (u32 i = 0; i < 8; ++i) {
        for (u32 q = 0; q < 4; ++q) {
            const u32 row = g + 8 * (q / 2), col = 8 * i + 2 * t + (q % 2);
            float sum = 0.0f;
            for (u32 kk = 0; kk < 16; ++kk) sum += A[row][kk] * B(kk, col);
            d[4 * i + q] += sum;
        }
    }
}
