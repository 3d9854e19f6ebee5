// Host emulation of the `gemm` tensor-core kernels for tests/gemm_emulated.rs: the source rendered
// for an mma.sync target is compiled for the CPU with tests/gdn_emulator.cpp's portability layer,
// mma.sync emulation and driver (one OS thread per GPU thread of a block, blocks one after
// another), tests/moe_emulator.cpp's adapters for common/mma.cuh, and the sections below for the
// CUDA built-ins gemm.cu calls directly. cp.async copies at once, so the rings are exercised in
// their fastest order only; what this checks is the partition, the ring and X addressing, the
// chunk bookkeeping and the split-K finish. Sections start at `//@@ name` lines.

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
FP4_DEVICE void cp_async16_zfill(void* dst, const void* src, u32 src_bytes) {
    require_copy_aligned(dst, src, 16);
    if (src_bytes == 16) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
}
FP4_DEVICE void cp_async8_zfill(void* dst, const void* src, u32 src_bytes) {
    require_copy_aligned(dst, src, 8);
    if (src_bytes == 8) std::memcpy(dst, src, 8);
    else std::memset(dst, 0, 8);
}
FP4_DEVICE void cp_async16(void* dst, const void* src) {
    require_copy_aligned(dst, src, 16);
    std::memcpy(dst, src, 16);
}
FP4_DEVICE void cp_async_commit() {}
template <int N>
FP4_DEVICE void cp_async_wait() {}
