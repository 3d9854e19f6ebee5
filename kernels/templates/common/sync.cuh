// ---- block and grid cooperation: barriers, counters in global memory, warp shuffles ----
// For persistent kernels whose blocks hand work to each other through counters (the `moe`
// family). The protocol is CUTLASS's generic barrier: a producing block writes its data,
// block_signal() / block_arrive() (every thread's writes ordered before one thread's release of
// the counter); a consuming block waits in block_wait_at_least() (thread 0 spins with acquire
// loads, then the block barrier). Data another block wrote during the same launch is read with
// load_coherent_* (from L2, never a stale L1 line). A wait that lasts FP4_WATCHDOG_SECONDS is a
// bug (a lost signal or a deadlock): the kernel traps, so the host sees a launch error instead of
// a hang.
#define FP4_WATCHDOG_SECONDS 4ull
// ---- sync vendor primitives ----
{% if target.vendor == "nvidia" %}
FP4_DEVICE u32 grid_blocks() { return gridDim.x; }
/// Nothing on NVIDIA: bar.sync followed by one thread's release is cumulative (PTX memory model).
FP4_DEVICE void release_before_barrier() {}
/// Nothing on NVIDIA: thread 0's acquire and the barrier order the block's later loads.
FP4_DEVICE void acquire_after_barrier() {}

FP4_DEVICE u32 atomic_add_block(u32* p, u32 v) { return atomicAdd(p, v); }
FP4_DEVICE u32 atomic_add_relaxed_gpu(u32* p, u32 v) { return atomicAdd(p, v); }
FP4_DEVICE u32 atomic_add_acq_rel_gpu(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
FP4_DEVICE void add_release_gpu(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
FP4_DEVICE void store_release_gpu(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
FP4_DEVICE u32 load_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/// The value `v` of the lane `lane ^ offset`.
FP4_DEVICE u32 shuffle_xor(u32 v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
/// The largest / smallest `v` of the warp's lanes, every lane gets it (one redux.sync each).
FP4_DEVICE u32 warp_max_u32(u32 v) { return __reduce_max_sync(0xffffffffu, v); }
FP4_DEVICE u32 warp_min_u32(u32 v) { return __reduce_min_sync(0xffffffffu, v); }

FP4_DEVICE void spin_pause() { __nanosleep(128); }
/// Nanoseconds (the global timer).
FP4_DEVICE u64 wall_clock() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
#define FP4_WALL_CLOCK_PER_SECOND 1000000000ull
FP4_DEVICE void hang_detected(const char* what, u32 value, u32 target) {
    printf("fp4spec watchdog: block %u waited %llu s for %s (%u, needs %u); trapping\n", block_x(),
           FP4_WATCHDOG_SECONDS, what, value, target);
    __trap();
}
{% else %}
FP4_DEVICE u32 grid_blocks() {
    return (__builtin_amdgcn_grid_size_x() + __builtin_amdgcn_workgroup_size_x() - 1) / __builtin_amdgcn_workgroup_size_x();
}
/// Every thread's global writes reach the device scope (the waves of a workgroup may sit on both
/// CUs of a WGP, each with its own L0).
FP4_DEVICE void release_before_barrier() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
/// Every thread drops stale L0 / L1 lines before reading what other blocks wrote.
FP4_DEVICE void acquire_after_barrier() { __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent"); }

FP4_DEVICE u32 atomic_add_block(u32* p, u32 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
FP4_DEVICE u32 atomic_add_relaxed_gpu(u32* p, u32 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE u32 atomic_add_acq_rel_gpu(u32* p, u32 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE void add_release_gpu(u32* p, u32 v) {
    __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE void store_release_gpu(u32* p, u32 v) {
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE u32 load_acquire_gpu(const u32* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}

FP4_DEVICE u32 shuffle_xor(u32 v, int offset) {
    return (u32)__builtin_amdgcn_ds_bpermute((int)((lane_index() ^ offset) << 2), (int)v);
}
FP4_DEVICE u32 warp_max_u32(u32 v) {
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const u32 other = shuffle_xor(v, offset);
        v = other > v ? other : v;
    }
    return v;
}
FP4_DEVICE u32 warp_min_u32(u32 v) {
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const u32 other = shuffle_xor(v, offset);
        v = other < v ? other : v;
    }
    return v;
}

FP4_DEVICE void spin_pause() { __builtin_amdgcn_s_sleep(2); }
/// Ticks of the constant 100 MHz reference clock (RDNA's REALTIME counter).
FP4_DEVICE u64 wall_clock() { return __builtin_readsteadycounter(); }
#define FP4_WALL_CLOCK_PER_SECOND 100000000ull
FP4_DEVICE void hang_detected(const char*, u32, u32) { __builtin_trap(); }
{% endif %}
// ---- end of sync vendor primitives ----

/// Thread 0 waits until `*counter >= target` (acquire), then the whole block proceeds. Every
/// thread of the block must call it.
FP4_DEVICE void block_wait_at_least(const u32* counter, u32 target, const char* what) {
    if (thread_x() == 0) {
        u32 value = load_acquire_gpu(counter);
        if (value < target) {
            const u64 start = wall_clock();
            while ((value = load_acquire_gpu(counter)) < target) {
                spin_pause();
                if (wall_clock() - start > FP4_WATCHDOG_SECONDS * FP4_WALL_CLOCK_PER_SECOND)
                    hang_detected(what, value, target);
            }
        }
    }
    block_barrier();
    acquire_after_barrier();
}

/// Adds 1 to `*counter` once the whole block's earlier writes are visible device-wide. Every
/// thread of the block must call it.
FP4_DEVICE void block_signal(u32* counter) {
    release_before_barrier();
    block_barrier();
    if (thread_x() == 0) add_release_gpu(counter, 1u);
}

/// As block_signal(), and tells every thread whether this block brought `*counter` to `total`
/// (then every other block's signalled writes are visible to it). `flag` is block-shared
/// scratch. Every thread of the block must call it.
FP4_DEVICE bool block_arrive(u32* counter, u32 total, u32* flag) {
    release_before_barrier();
    block_barrier();
    if (thread_x() == 0) *flag = atomic_add_acq_rel_gpu(counter, 1u) + 1u == total ? 1u : 0u;
    block_barrier();
    const bool last = *flag != 0u;
    if (last) acquire_after_barrier();
    return last;
}

/// block_arrive() on a counter that only arrivals touch: the block that completes it sets it back
/// to zero, so the next launch finds it ready without a reset pass (no arrival of this launch
/// follows the last one).
FP4_DEVICE bool block_arrive_and_rearm(u32* counter, u32 total, u32* flag) {
    const bool last = block_arrive(counter, total, flag);
    if (last && thread_x() == 0) *counter = 0u;
    return last;
}
// ---- end of block and grid cooperation ----
