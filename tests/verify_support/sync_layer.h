// common/sync.cuh's vendor primitives on tests/verify_support/cuda_emu.h, spliced into the
// rendered verify.cu in place of its inline PTX (tests/verify.rs): those its block and grid
// cooperation part calls (verify uses block_arrive). One OS thread runs every fiber and fibers
// switch only at barriers, so plain loads, stores and read-modify-writes are the atomics and
// fences they stand for.
#pragma once

FP4_DEVICE void release_before_barrier() {}
FP4_DEVICE void acquire_after_barrier() {}
FP4_DEVICE u32 atomic_add_acq_rel_gpu(u32* p, u32 v) { return atomicAdd(p, v); }
FP4_DEVICE void add_release_gpu(u32* p, u32 v) { atomicAdd(p, v); }
FP4_DEVICE u32 load_acquire_gpu(const u32* p) { return *p; }
// blocks run one after another: a wait can only be satisfied already, one that is not is a lost
// signal (reported at once rather than spun on)
FP4_DEVICE void spin_pause() {}
FP4_DEVICE u64 wall_clock() { return 0; }
#define FP4_WALL_CLOCK_PER_SECOND 1ull
FP4_DEVICE void hang_detected(const char* what, u32 value, u32 target) {
    std::fprintf(stderr, "emulated block %u waited for %s (%u, needs %u)\n", block_x(), what, value, target);
    std::abort();
}
