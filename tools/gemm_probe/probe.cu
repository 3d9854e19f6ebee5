// gemm probe: times the m64 (or m32) `gemm_*_bf16_mma_m*` kernels of a rendered gemm.cu on the
// GPU host, outside the crate (nvcc, no Rust there), on hand-set partitions; cuBLAS bf16 and the
// device copy bandwidth in the same run. Built and run by run.sh; the sources and cases come
// from variants.py and cases.py (tools/gemm_probe/README.md).
//
//   probe CASES [pdl]    CASES: lines "name fmt n k blocks_x splits groups_per_split
//                        warps_per_tile warps" (fmt bf16 | nvfp4); pdl: launch with programmatic
//                        stream serialization, as the decode graph does
//   PROBE_M=48           rows of X (default 64; the kernel's rows past it are zero)
//   PROBE_KERNEL=m32     time gemm_*_mma_m32 (no X ring) instead of gemm_*_mma_m64
//   PROBE_CLUSTER=1      launch the K splits of a tile group as one cluster (1, splits, 1): the
//                        kernels then finish them there (finish_in_cluster, on targets with
//                        clusters); cases of more than 8 splits are skipped
//
// Each case: 60 launches back to back in a CUDA graph over rotating copies of the weights (512 MiB,
// beyond the 50 MiB L2), the median of 7 replays per launch; then cuBLAS (bf16 cases) the same way;
// a hash of Y's bits so variants that must agree can be compared. Weights are random bytes (NVFP4:
// scale bytes 0x30..0x3f), not a model's: the kernels' time does not depend on the values.
#include GEMM_SOURCE
#include <cublas_v2.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
#include <algorithm>
#include <fstream>
#include <sstream>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void fill_bf16(u16* p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        float v = ((h & 0xffff) / 65536.0f - 0.5f) * 0.25f;
        p[i] = __bfloat16_as_ushort(__float2bfloat16(v));
    }
}
__global__ void fill_bytes(u8* p, size_t n, u32 seed, u8 mask, u8 add) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        p[i] = (u8)((h & mask) + add);
    }
}

struct Case { std::string name, fmt; u32 n, k, bx, splits, gps, wpt, warps; };

int main(int argc, char** argv) {
    if (argc < 2) { printf("usage: probe CASES [pdl]\n"); return 2; }
    std::vector<Case> cases;
    std::ifstream f(argv[1]);
    if (!f) { printf("cannot read %s\n", argv[1]); return 2; }
    std::string line;
    while (std::getline(f, line)) {
        if (line.empty() || line[0] == '#') continue;
        std::istringstream s(line); Case c;
        s >> c.name >> c.fmt >> c.n >> c.k >> c.bx >> c.splits >> c.gps >> c.wpt >> c.warps;
        cases.push_back(c);
    }
    const bool pdl = argc > 2 && std::string(argv[2]) == "pdl";
    const u32 M = getenv("PROBE_M") ? (u32)atoi(getenv("PROBE_M")) : 64u;
    if (M < 1 || M > 64) { printf("PROBE_M: 1..64 rows\n"); return 2; }
    const size_t POOL = 512ull << 20;  // rotating weights: beyond the 50 MB L2
    u8* pool; CK(cudaMalloc(&pool, POOL));
    u16 *x, *y, *res; float* partials; u32* counters;
    CK(cudaMalloc(&x, 64 * 16384 * 2)); CK(cudaMalloc(&y, 64 * 65536 * 2)); CK(cudaMalloc(&res, 64 * 65536 * 2));
    CK(cudaMalloc(&partials, 64ull << 20)); CK(cudaMalloc(&counters, 1 << 20)); CK(cudaMemset(counters, 0, 1 << 20));
    fill_bf16<<<1024, 256>>>(x, 64 * 16384, 7); fill_bf16<<<1024, 256>>>(res, 64 * 65536, 9);
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h, st) != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS handle failed\n"); return 1; }
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    // copy bandwidth
    {
        size_t half = POOL / 2;
        for (int i = 0; i < 3; ++i) CK(cudaMemcpyAsync(pool + half, pool, half, cudaMemcpyDeviceToDevice, st));
        cudaEventRecord(e0, st);
        for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(pool + half, pool, half, cudaMemcpyDeviceToDevice, st));
        cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        printf("copy bandwidth %.0f GB/s (read + write)\n", 2.0 * half * 10 / (ms * 1e-3) / 1e9);
    }
    for (auto& c : cases) {
        const bool nv = c.fmt == "nvfp4";
        const size_t wbytes = nv ? (size_t)c.n * c.k / 2 : (size_t)c.n * c.k * 2;
        const size_t sbytes = nv ? (size_t)c.n * c.k / 16 : 0;
        const size_t per = (wbytes + sbytes + 255) / 256 * 256;
        if (per > POOL || c.k > 16384 || c.n > 65536 || c.k % 64 != 0 || c.n % 16 != 0) {
            printf("%s: skipped (weights over 512 MiB, K over 16384, N over 65536, or not whole tiles)\n", c.name.c_str());
            continue;
        }
        const int copies = (int)(POOL / per);
        if (nv) {
            fill_bytes<<<1024, 256>>>(pool, POOL, 3, 0xff, 0);
            // scale bytes e4m3 around 1 (0x30..0x3f); re-encoded layout not needed for timing
            for (int i = 0; i < copies; ++i) fill_bytes<<<256, 256>>>(pool + i * per + wbytes, sbytes, 5 + i, 0x0f, 0x30);
        } else {
            fill_bf16<<<1024, 256>>>((u16*)pool, POOL / 2, 3);
        }
        CK(cudaDeviceSynchronize());
        const u32 n_tiles = c.n / 16, k_groups = c.k / 64;
        const u32 rows_ring = X_SLOTS * c.wpt * 64 * 72 * 2;
        const bool cluster = getenv("PROBE_CLUSTER") && std::string(getenv("PROBE_CLUSTER")) == "1" && c.splits > 1;
        if (cluster && c.splits > 8) {
            printf("%s: skipped (a cluster of %u splits: more than 8 blocks)\n", c.name.c_str(), c.splits);
            continue;
        }
        const u32 sums = c.wpt > 1 || cluster ? c.warps * 8 * 32 * 16 : 0;
        u32 smem = std::max(rows_ring, sums);
        // PROBE_KERNEL=m32: the m32 kernels (no X ring: static shared memory only)
        const bool m32 = getenv("PROBE_KERNEL") && std::string(getenv("PROBE_KERNEL")) == "m32";
        auto kn = m32 ? gemm_nvfp4_bf16_mma_m32 : gemm_nvfp4_bf16_mma_m64;
        auto kb = m32 ? gemm_bf16_bf16_mma_m32 : gemm_bf16_bf16_mma_m64;
        if (m32) smem = 0;
        const void* fn = nv ? (const void*)kn : (const void*)kb;
        if (smem > 0) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const float alpha = 1.0f;
        const u32 epi = 0;
        auto launch = [&](int i) {
            u8* w = pool + (size_t)(i % copies) * per;
            const u32x4* words = (const u32x4*)w;
            const u16* scales = (const u16*)(w + wbytes);
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(c.bx, c.splits, 1); cfg.blockDim = dim3(c.warps * 32, 1, 1);
            cfg.dynamicSmemBytes = smem; cfg.stream = st;
            cudaLaunchAttribute at[2];
            u32 attrs = 0;
            if (pdl) {
                at[attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                at[attrs++].val.programmaticStreamSerializationAllowed = 1;
            }
            if (cluster) {
                at[attrs].id = cudaLaunchAttributeClusterDimension;
                at[attrs].val.clusterDim.x = 1; at[attrs].val.clusterDim.y = c.splits; at[attrs++].val.clusterDim.z = 1;
            }
            cfg.attrs = at; cfg.numAttrs = attrs;
            u16* yy = y; const u16* rr = res; float* pp = partials; u32* cc = counters;
            u32 m = M, n = c.n, k = c.k;
            if (nv) CK(cudaLaunchKernelEx(&cfg, kn, (const u16*)x, words, scales, alpha, yy, rr, pp, cc, m, n, k, n_tiles, k_groups, c.gps, c.wpt, epi));
            else CK(cudaLaunchKernelEx(&cfg, kb, (const u16*)x, words, alpha, yy, rr, pp, cc, m, n, k, n_tiles, k_groups, c.gps, c.wpt, epi));
        };
        auto cublas = [&](int i) {
            u8* w = pool + (size_t)(i % copies) * per;
            float a = 1.0f, b = 0.0f;
            const cublasStatus_t status = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, c.n, M, c.k, &a, w, CUDA_R_16BF, c.k, x, CUDA_R_16BF, c.k, &b, y, CUDA_R_16BF, c.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            if (status != CUBLAS_STATUS_SUCCESS) { printf("cublasGemmEx failed: %d\n", (int)status); exit(1); }
        };
        auto time_graph = [&](auto&& body) {
            const int L = 60;
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < L; ++i) body(i);
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
            std::vector<float> v;
            for (int r = 0; r < 7; ++r) {
                cudaEventRecord(e0, st); CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
                CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); v.push_back(ms * 1000 / L);
            }
            cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
            std::sort(v.begin(), v.end()); return v[3];
        };
        const float us = time_graph(launch);
        // a hash of Y's bits: variants that keep the products and their order must agree
        std::vector<u16> hy((size_t)M * c.n);
        CK(cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost));
        unsigned long long sum = 0; for (size_t i = 0; i < hy.size(); ++i) sum = sum * 1000003ull + hy[i];
        float cb = nv ? 0.0f : time_graph(cublas);
        printf("M=%u %-12s %-5s N=%6u K=%5u grid=%4ux%-2u gps=%3u wpt=%u warps=%2u smem=%6u  %8.2f us  %7.0f GB/s  cublas %7.2f us  sum %016llx\n",
               M, c.name.c_str(), c.fmt.c_str(), c.n, c.k, c.bx, c.splits, c.gps, c.wpt, c.warps, smem, us,
               (wbytes + sbytes) / (us * 1e-6) / 1e9, cb, sum);
    }
    return 0;
}
