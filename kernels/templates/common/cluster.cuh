// ---- Thread block clusters (NVIDIA targets with instructions.clusters): the blocks of a
// cluster run at once and read each other's shared memory. A family includes this inside
// {% raw %}{% if target.instructions.clusters %}{% endraw %}; the emulated tests replace the marked section. ----
// ---- cluster instructions ----
/// Blocks per cluster along grid y (1 when the launch made no clusters).
FP4_DEVICE u32 cluster_blocks_y() {
    u32 v;
    asm volatile("mov.u32 %0, %%cluster_nctaid.y;\n" : "=r"(v));
    return v;
}
/// Every thread of the cluster's blocks arrives; this thread's shared-memory writes before it
/// are seen by every thread of the cluster after it (release / acquire at cluster scope).
FP4_DEVICE void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/// The float4 at `local`'s offset in the shared memory of the cluster's block `rank`.
FP4_DEVICE float4 load_cluster_f4(const float4* local, u32 rank) {
    const u32 address = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(address), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {" "%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
    return v;
}
// ---- end of cluster instructions ----
