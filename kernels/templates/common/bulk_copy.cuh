// ---- Bulk copies global -> shared completing on an mbarrier (NVIDIA targets with
// instructions.bulk_copy_mbarrier: sm_90a, sm_121a). One thread asks the copy engine for a whole
// contiguous range; the bytes in flight hold no registers and no L1 miss entries, and the
// threads that read the range wait on the barrier's phase. A family includes this inside
// {% raw %}{% if target.instructions.bulk_copy_mbarrier %}{% endraw %}; the emulated tests replace the marked section. ----
// ---- bulk copy instructions ----
FP4_DEVICE u32 bulk_shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }
/// Sets up `bar` for one arrival per phase (the thread that asks for the copies), then makes the
/// set-up visible to the copy engine. Once, before any copy names the barrier.
FP4_DEVICE void mbarrier_init_one(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(bulk_shared_address(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/// The arrival of the phase's one thread, announcing `bytes` to come from its copies.
FP4_DEVICE void mbarrier_arrive_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bulk_shared_address(bar)), "r"(bytes) : "memory");
}
/// Waits until the phase of parity `parity` of `bar` has completed (its bytes have landed and
/// are visible to this thread).
FP4_DEVICE void mbarrier_wait_parity(u64* bar, u32 parity) {
    const u32 address = bulk_shared_address(bar);
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(address), "r"(parity) : "memory");
    }
}
/// Orders this thread's view of the warp's earlier ordinary shared-memory reads (the caller has
/// met the warp's barrier after them) before its next bulk copy into the same bytes: the copy
/// engine writes through the async proxy.
FP4_DEVICE void bulk_fence_after_reads() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`,
/// counted against the phase of `bar` that announced them.
FP4_DEVICE void bulk_copy_to_shared(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(bulk_shared_address(dst)), "l"(src), "r"(bytes), "r"(bulk_shared_address(bar))
                 : "memory");
}
// ---- end of bulk copy instructions ----
