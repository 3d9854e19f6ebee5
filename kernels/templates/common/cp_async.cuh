// ---- cp.async: global -> shared copies whose bytes in flight cost no registers (NVIDIA
// targets with instructions.cp_async). A family includes this inside
// {% raw %}{% if target.instructions.cp_async %}{% endraw %}; the emulated tests replace the marked section. ----
// ---- cp.async instructions ----
FP4_DEVICE u32 cp_async_shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }
/// 16 bytes global -> shared, the destination as cp_async_shared_address gives it (offsets
/// added to one such address cost a 32-bit add, not 64-bit pointer arithmetic per copy).
FP4_DEVICE void cp_async16_shared(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}
/// 16 bytes global -> shared.
FP4_DEVICE void cp_async16(void* dst, const void* src) { cp_async16_shared(cp_async_shared_address(dst), src); }
/// 16 bytes global -> shared at shared address `dst` (as cp_async16_shared), the last
/// 16 - src_bytes of them zero (src_bytes 0 or 16).
FP4_DEVICE void cp_async16_zfill_shared(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/// 16 bytes global -> shared, the last 16 - src_bytes of them zero (src_bytes 0 or 16).
FP4_DEVICE void cp_async16_zfill(void* dst, const void* src, u32 src_bytes) {
    cp_async16_zfill_shared(cp_async_shared_address(dst), src, src_bytes);
}
/// Closes this thread's group of copies issued since the last commit.
FP4_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
FP4_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
// ---- end of cp.async instructions ----
