// ---- fp4spec portability layer, rendered for {{ target.name }} ({{ target.chip }}) ----
// Kernels are written once against these names; the vendor differences live here only.
// Every source is self-contained: on NVIDIA it needs only the CUDA headers (cuda_bf16.h), on
// AMD nothing at all (compiled with -nogpuinc -nogpulib).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
// Aligned to their width on every target: arrays of them in shared memory are what 16-byte
// cp.async copies and vector loads write and read (a 4-byte aligned ring put the streaming down
// launch's copies at misaligned addresses once the shared variables before it changed size).
struct alignas(8) u32x2 { u32 x, y; };
struct alignas(16) u32x4 { u32 x, y, z, w; };

#define FP4_WARP_SIZE {{ target.warp_size }}
#define FP4_KERNEL extern "C" __global__

// Every kernel starts with chain_after_previous_grid(). Where the target has programmatic
// dependent launch (the host launches with programmatic stream serialization), it waits until
// the previous kernel has finished and its writes are visible, then lets the next kernel of the
// stream put its blocks on the SMs, so that its launch and ramp overlap this kernel's work (they
// wait at their own call). Waiting before allowing is the rule every kernel keeps: when a kernel
// starts, the one before it has passed its wait, so every kernel before THAT one has finished. A
// kernel may therefore split the call and read, before its wait, what no kernel writes (weights)
// or what only kernels two or more launches back wrote (a layer's recurrent state, written by
// the previous step), with loads that bypass L1:
//   <such loads>; wait_for_previous_grid(); allow_next_grid();
// Elsewhere these are nothing. (Host emulations of the kernels, tests/gdn_emulator.cpp and
// tests/verify_support/cuda_emu.h, define them first.)
#ifndef allow_next_grid
{% if target.instructions.grid_dependency_control %}
#define allow_next_grid() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define wait_for_previous_grid() asm volatile("griddepcontrol.wait;" ::: "memory")
{% else %}
#define allow_next_grid() do {} while (0)
#define wait_for_previous_grid() do {} while (0)
{% endif %}
#define chain_after_previous_grid() \
    do {                            \
        wait_for_previous_grid();   \
        allow_next_grid();          \
    } while (0)
#endif
{% if target.vendor == "nvidia" %}
#include <cuda_bf16.h>
#define FP4_DEVICE __device__ __forceinline__
#define FP4_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)

FP4_DEVICE u32 thread_x() { return threadIdx.x; }
FP4_DEVICE u32 block_x() { return blockIdx.x; }
FP4_DEVICE u32 block_y() { return blockIdx.y; }
FP4_DEVICE u32 block_z() { return blockIdx.z; }
FP4_DEVICE float bits_to_f32(u32 bits) { return __uint_as_float(bits); }
FP4_DEVICE u32 f32_to_bits(float value) { return __float_as_uint(value); }
FP4_DEVICE float f32_nan() { return __uint_as_float(0x7fc00000u); }
FP4_DEVICE float fast_exp(float v) { return __expf(v); }
/// Every thread of the block waits here; shared-memory writes before are visible after.
FP4_DEVICE void block_barrier() { __syncthreads(); }
/// Adds `v` to `*p` (device scope, no ordering of its own); the old value.
FP4_DEVICE u32 atomic_add_u32(u32* p, u32 v) { return atomicAdd(p, v); }
FP4_DEVICE float sqrt_f32(float v) { return sqrtf(v); }
FP4_DEVICE float exp2_f32(float v) { return exp2f(v); }
/// The lanes of a warp wait for each other; their shared-memory writes are visible after.
FP4_DEVICE void warp_barrier() { __syncwarp(); }
/// The calling thread's lane in its warp.
FP4_DEVICE u32 lane_index() { return thread_x() % FP4_WARP_SIZE; }
/// The value `v` of lane `source` (every lane of the warp calls it).
FP4_DEVICE u32 shuffle_from(u32 v, u32 source) { return __shfl_sync(0xffffffffu, v, (int)source); }

/// Sum over the 32 lanes of a warp; every lane gets the total.
FP4_DEVICE float warp_sum(float value) {
    #pragma unroll
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

/// Maximum over the 32 lanes of a warp; every lane gets it.
FP4_DEVICE float warp_max(float value) {
    #pragma unroll
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = other > value ? other : value;
    }
    return value;
}

/// bf16 (raw bits) to f32: exact.
FP4_DEVICE float bf16_to_f32(u16 bits) { return __uint_as_float((u32)bits << 16); }
/// f32 to bf16 (raw bits), round to nearest even, NaN stays NaN.
FP4_DEVICE u16 f32_to_bf16(float value) { return __bfloat16_as_ushort(__float2bfloat16_rn(value)); }
/// Two bf16 products at once (raw bits, low and high halves), round to nearest even, subnormal
/// operands and results kept (bf16 arithmetic has no flush to zero).
FP4_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
    const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const u32*>(&p);
}

/// 8- and 16-byte loads and stores; the pointer must be aligned to the width.
FP4_DEVICE u32x2 load_u32x2(const void* p) { uint2 v = *reinterpret_cast<const uint2*>(p); return {v.x, v.y}; }
FP4_DEVICE u32x4 load_u32x4(const void* p) { uint4 v = *reinterpret_cast<const uint4*>(p); return {v.x, v.y, v.z, v.w}; }
FP4_DEVICE void store_u32x4(void* p, u32x4 v) { *reinterpret_cast<uint4*>(p) = make_uint4(v.x, v.y, v.z, v.w); }
/// Loads that bypass L1: data another block wrote during the launch (after a counter's acquire),
/// or an earlier kernel wrote, read before this kernel's grid wait (chain_after_previous_grid).
FP4_DEVICE u16 load_coherent_u16(const u16* p) { return __ldcg(p); }
FP4_DEVICE u32 load_coherent_u32(const u32* p) { return __ldcg(p); }
FP4_DEVICE float load_coherent_f32(const float* p) { return __ldcg(p); }
/// A load of data read once (logits streamed by a row pass): from global memory, evict-first.
FP4_DEVICE float load_stream_f32(const float* p) { return __ldcs(p); }
FP4_DEVICE u32x4 load_coherent_u32x4(const void* p) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    return {v.x, v.y, v.z, v.w};
}
/// Their counterpart: 16 bytes to global memory for another block or a later kernel, not kept in
/// L1, and always one vector store (store_u32x4 came out of NVRTC as four scalar stores in the
/// Gated DeltaNet step, 4x the store instructions of its state).
FP4_DEVICE void store_coherent_u32x4(void* p, u32x4 v) { __stcg(reinterpret_cast<uint4*>(p), make_uint4(v.x, v.y, v.z, v.w)); }
/// Asks the L2 to fetch `bytes` (a multiple of 16, not 0) at `p` (16-byte aligned) and returns at
/// once: a block names what it will read before it waits for the previous kernel, or streams
/// later. (The host emulation of tests/verify_support/cuda_emu.h defines it first, as a macro.)
#ifndef prefetch_l2
FP4_DEVICE void prefetch_l2(const void* p, u32 bytes) {
{% if target.instructions.bulk_copy_mbarrier %}
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(p), "r"(bytes) : "memory");
{% endif %}
}
#endif
{% else %}
// HIP without the ROCm headers: the attributes and builtins clang provides for amdgcn.
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define FP4_DEVICE __device__ inline __attribute__((always_inline))
#define FP4_LAUNCH_BOUNDS(threads) __attribute__((amdgpu_flat_work_group_size(1, threads)))

FP4_DEVICE u32 thread_x() { return __builtin_amdgcn_workitem_id_x(); }
FP4_DEVICE u32 block_x() { return __builtin_amdgcn_workgroup_id_x(); }
FP4_DEVICE u32 block_y() { return __builtin_amdgcn_workgroup_id_y(); }
FP4_DEVICE float bits_to_f32(u32 bits) { return __builtin_bit_cast(float, bits); }
FP4_DEVICE u32 f32_to_bits(float value) { return __builtin_bit_cast(u32, value); }
FP4_DEVICE float f32_nan() { return __builtin_nanf(""); }
FP4_DEVICE float fast_exp(float v) { return __builtin_expf(v); }
/// Every thread of the block waits here; shared-memory (LDS) writes before are visible after.
FP4_DEVICE void block_barrier() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
FP4_DEVICE u32 atomic_add_u32(u32* p, u32 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE float sqrt_f32(float v) { return __builtin_sqrtf(v); }
FP4_DEVICE float exp2_f32(float v) { return __builtin_exp2f(v); }
/// The lanes of a wavefront wait for each other; their LDS writes are visible after.
FP4_DEVICE void warp_barrier() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
FP4_DEVICE u32 block_z() { return __builtin_amdgcn_workgroup_id_z(); }

/// The calling thread's lane in its wavefront.
FP4_DEVICE u32 lane_index() {
{% if target.warp_size == 32 %}
    return __builtin_amdgcn_mbcnt_lo(~0u, 0u);
{% else %}
    return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
{% endif %}
}
FP4_DEVICE u32 shuffle_from(u32 v, u32 source) {
    return (u32)__builtin_amdgcn_ds_bpermute((int)(source << 2), (int)v);
}

/// Sum over the lanes of a wavefront; every lane gets the total.
FP4_DEVICE float warp_sum(float value) {
    const u32 lane = lane_index();
    #pragma unroll
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const int other = __builtin_amdgcn_ds_bpermute((int)((lane ^ offset) << 2), __builtin_bit_cast(int, value));
        value += __builtin_bit_cast(float, other);
    }
    return value;
}

/// Maximum over the lanes of a wavefront; every lane gets it.
FP4_DEVICE float warp_max(float value) {
    const u32 lane = lane_index();
    #pragma unroll
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const int other = __builtin_amdgcn_ds_bpermute((int)((lane ^ offset) << 2), __builtin_bit_cast(int, value));
        const float o = __builtin_bit_cast(float, other);
        value = o > value ? o : value;
    }
    return value;
}

FP4_DEVICE float bf16_to_f32(u16 bits) { return __builtin_bit_cast(float, (u32)bits << 16); }
FP4_DEVICE u16 f32_to_bf16(float value) {
    const u32 bits = __builtin_bit_cast(u32, value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)((bits >> 16) | 0x40u);
    return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
/// Two bf16 products at once (raw bits), through f32: no packed bf16 arithmetic here.
FP4_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
    const float lo = bf16_to_f32((u16)(a & 0xffffu)) * bf16_to_f32((u16)(b & 0xffffu));
    const float hi = bf16_to_f32((u16)(a >> 16)) * bf16_to_f32((u16)(b >> 16));
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

FP4_DEVICE u32x2 load_u32x2(const void* p) { return *reinterpret_cast<const u32x2*>(p); }
FP4_DEVICE u32x4 load_u32x4(const void* p) { return *reinterpret_cast<const u32x4*>(p); }
FP4_DEVICE void store_u32x4(void* p, u32x4 v) { *reinterpret_cast<u32x4*>(p) = v; }
/// Plain loads: with no grid dependency control nothing is read before a kernel's start, and
/// after acquire_after_barrier() (common/sync.cuh) plain loads see every released write.
FP4_DEVICE u16 load_coherent_u16(const u16* p) { return *p; }
FP4_DEVICE u32 load_coherent_u32(const u32* p) { return *p; }
FP4_DEVICE float load_coherent_f32(const float* p) { return *p; }
FP4_DEVICE u32x4 load_coherent_u32x4(const void* p) { return load_u32x4(p); }
FP4_DEVICE float load_stream_f32(const float* p) { return __builtin_nontemporal_load(p); }
FP4_DEVICE void store_coherent_u32x4(void* p, u32x4 v) { store_u32x4(p, v); }
/// An L2 prefetch hint (nothing on this target: no instruction for it in this layer).
FP4_DEVICE void prefetch_l2(const void*, u32) {}
{% endif %}
// ---- end of portability layer ----

// ---- shared by every family (outside the portability layer, so emulated builds keep it) ----
FP4_DEVICE u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }
FP4_DEVICE u32 max_u32(u32 a, u32 b) { return a > b ? a : b; }
/// The 64-bit value `v` of lane `source` (every lane of the warp calls it).
FP4_DEVICE u64 shuffle_from_u64(u64 v, u32 source) {
    return (u64)shuffle_from((u32)v, source) | ((u64)shuffle_from((u32)(v >> 32), source) << 32);
}
/// Inclusive prefix sum (u32 or u64) over the lanes of a warp: lane l gets the sum of lanes 0..=l
/// (every lane calls it).
template <typename T>
FP4_DEVICE T warp_inclusive_sum(T v) {
    const u32 lane = lane_index();
    #pragma unroll
    for (u32 offset = 1; offset < FP4_WARP_SIZE; offset <<= 1) {
        const u32 source = lane >= offset ? lane - offset : lane;
        T other;
        if constexpr (sizeof(T) == 8) other = (T)shuffle_from_u64((u64)v, source);
        else other = (T)shuffle_from((u32)v, source);
        if (lane >= offset) v += other;
    }
    return v;
}
