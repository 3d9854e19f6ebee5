// Family `gemm`: Y[M,N] = X[M,K] (bf16) * dequant(W[N,K])^T, fp32 accumulation, bf16 out
// (rendered for {{ target.name }}). CPU reference: src/kernels/gemm/reference.rs.
// Launch: src/kernels/gemm/mod.rs.
{% include "common/prelude.cuh" %}
{% include "common/nvfp4.cuh" %}
{% include "common/activations.cuh" %}

// Epilogues of the tensor-core kernels (src/kernels/gemm/mod.rs: Epilogue::kernel_code).
#define EPILOGUE_NONE 0u
#define EPILOGUE_RESIDUAL 1u
#define EPILOGUE_SILU_MUL 2u

#define GEMV_WARPS {{ target.gemm.warps_per_block }}
#define GEMV_ROWS {{ target.gemm.rows_per_pass }}

// gemm_nvfp4_bf16_gemv: the straightforward kernel. One warp owns one output column n and
// GEMV_ROWS rows of X (grid.y walks the rows); its lanes stride over the K/16 blocks of weight
// row n, decode each block's 16 values in registers, take the dot product with the bf16 rows
// of X, scale once per block, and reduce across the warp at the end. Each weight byte is read
// once per pass over the rows (ceil(M / GEMV_ROWS) times, from cache after the first).
// Requires K % 16 == 0 (checked on the host).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(GEMV_WARPS * FP4_WARP_SIZE) gemm_nvfp4_bf16_gemv(
    const u16* __restrict__ x, const u8* __restrict__ packed, const u8* __restrict__ scales,
    float global_scale, u16* __restrict__ y, u32 m, u32 n, u32 k) {
    chain_after_previous_grid();
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 col = block_x() * GEMV_WARPS + warp;
    if (col >= n) return;  // whole warps leave together; nothing below synchronises the block
    const u32 row0 = block_y() * GEMV_ROWS;
    const u32 k_blocks = k / 16;
    const u8* w_row = packed + (u64)col * (k / 2);
    const u8* s_row = scales + (u64)col * k_blocks;

    float acc[GEMV_ROWS];
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;

    for (u32 b = lane; b < k_blocks; b += FP4_WARP_SIZE) {
        const u32x2 q = load_u32x2(w_row + (u64)b * 8);
        const float scale = e4m3_to_f32(s_row[b]) * global_scale;
        float w[16];
        #pragma unroll
        for (int j = 0; j < 16; ++j) w[j] = e2m1_to_f32(((j < 8 ? q.x : q.y) >> (4 * (j % 8))) & 15u);
        #pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (row0 + r < m) {
                const u16* x_block = x + (u64)(row0 + r) * k + (u64)b * 16;
                const u32x4 lo = load_u32x4(x_block);
                const u32x4 hi = load_u32x4(x_block + 8);
                const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                float dot = 0.0f;
                #pragma unroll
                for (int j = 0; j < 8; ++j) {
                    dot += bf16_to_f32((u16)(words[j] & 0xffffu)) * w[2 * j];
                    dot += bf16_to_f32((u16)(words[j] >> 16)) * w[2 * j + 1];
                }
                acc[r] += dot * scale;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float total = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < m) y[(u64)(row0 + r) * n + col] = f32_to_bf16(total);
    }
}
{% if target.instructions.mma_sync_bf16 %}
// ============================================================================================
// gemm_{nvfp4,bf16}_bf16_mma_m{8,16,32,48,64}: the weight-streaming tensor-core kernels.
// A block holds MMA_WARPS warps: that many tiles of one warp each when the tiles alone fill the
// device, else fewer tiles whose warps split K (and K split across blocks for the smallest N).
//
// Y^T = W X^T on mma.sync.m16n8k16 (bf16 x bf16 -> fp32): W is the A operand (16 rows of N per
// warp tile), X^T the B operand (8 rows of M per n8 tile), so M = 1..64 costs 1..8 MMAs per
// 16x16 weight fragment and the weights are read once whatever M is.
//
// Weights come in the fragment order of src/kernels/gemm/layout.rs: inside each 64-wide
// K group, lane (g = lane / 4, t = lane % 4) owns rows g and g + 8 of the tile and K columns
// [16t, 16t + 16) (one NVFP4 block per row), and MMA j (j = 0..3) consumes columns 16t + 4j ..
// 16t + 4j + 3 of them. That permutes K inside the group identically for W and X (a dot product
// does not care), and makes each lane's X fragment for the whole group one contiguous 32-byte
// run and its weights one 16-byte load (NVFP4: 2 blocks of 8 bytes + 2 scale bytes; bf16: 64
// bytes). The load is the fragment, straight to registers; STAGES groups are in flight per warp.
//
// NVFP4 decode, exact: the codes' bits are stored where a mask of the word (rotated) leaves a
// bf16 of e2m1 * 2^-126 (0.5 as a subnormal; common/mma.cuh, e2m1_word_to_bf16x2_scaled);
// the scale byte (re-encoded at load as unsigned e5m3, exponent offset 10, no subnormals) becomes
// bf16 of s * 2^119 with one multiply-add; their bf16 product e2m1 * s * 2^-7 is exact (<= 6
// significant bits, normal range); the epilogue multiplies by global_scale * 2^7.
// ============================================================================================
#define MMA_WARPS {{ target.gemm.mma_warps_per_block }}
#define L2_PREFETCH_GROUPS {{ target.gemm.mma_l2_prefetch_groups }}

{% include "common/mma.cuh" %}
{% if target.instructions.cp_async %}
{% include "common/cp_async.cuh" %}
{% endif %}
{% if target.instructions.clusters %}
{% include "common/cluster.cuh" %}
{% endif %}
// gemm_*_mma_m* of at least mma_x_shared_min_rows rows on cp.async targets stream X through
// shared memory (gemm_mma, X_SHARED): (threads, resident blocks per SM) cap their registers so
// that mma_x_shared_blocks_per_sm blocks fit
#define MMA_X_WARPS {{ target.gemm.mma_x_shared_warps_per_block }}
#define MMA_X_SHARED_BOUNDS MMA_X_WARPS * FP4_WARP_SIZE, {{ target.gemm.mma_x_shared_blocks_per_sm }}
// the X ring's slots (rounds in flight + the one computed) and bf16 per staged row (64 + 8 pad:
// rows 144 bytes apart, see gemm_mma); src/kernels/gemm/mod.rs, X_RING_ROW_ELEMS, sizes the ring
// the same way
#define X_SLOTS {{ target.gemm.mma_x_shared_slots }}
#define X_ROW 72

/// Writes one lane's 16 x (8 * MT) tile of fp32 results: scaled by alpha, with the epilogue.
template <int MT>
FP4_DEVICE void store_tile(const float (&acc)[MT][4], float alpha, u32 tile, u32 lane, u32 m, u32 n,
                           u32 epilogue, const u16* residual, u16* y) {
    const u32 g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 row = mt * 8 + 2 * t + half;
            if (row >= m) continue;
            const float top = acc[mt][half] * alpha;         // W row tile * 16 + g
            const float bottom = acc[mt][2 + half] * alpha;  // W row tile * 16 + g + 8
            if (epilogue == EPILOGUE_SILU_MUL) {
                // rows g = gate i, g + 8 = up i of output column i = tile * 8 + g; n = columns
                const u32 col = tile * 8 + g;
                if (col < n) y[(u64)row * n + col] = f32_to_bf16(silu(top) * bottom);
            } else {
                const u32 col = tile * 16 + g;
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const u32 c = col + 8 * r;
                    if (c >= n) continue;
                    float v = r == 0 ? top : bottom;
                    const u64 at = (u64)row * n + c;
                    if (epilogue == EPILOGUE_RESIDUAL) v += bf16_to_f32(residual[at]);
                    y[at] = f32_to_bf16(v);
                }
            }
        }
    }
}

/// This lane's X fragment for one K group: rows mt * 8 + g, columns 64 * group + [16t, 16t + 16);
/// zero past K, past M or when `valid` is false (zero weights times garbage could be NaN).
template <int MT>
FP4_DEVICE void load_x_fragment(const u16* __restrict__ x, u32 m, u32 k, u32 group, u32 g, u32 t, bool valid,
                                u32x4 (&xs)[MT][2]) {
    const u32 col = group * 64 + 16 * t;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const u32 row = mt * 8 + g;
        if (valid && row < m && col < k) {
            const u16* p = x + (u64)row * k + col;
            xs[mt][0] = load_u32x4(p);
            xs[mt][1] = load_u32x4(p + 8);
        } else {
            xs[mt][0] = xs[mt][1] = {0u, 0u, 0u, 0u};
        }
    }
}

/// Adds splits s .. s + BATCH - 1 of a tile's partial sums (this lane's; `load(split, mt)` is
/// split's float4 of n8 tile mt) to acc in split order, their loads issued together.
template <int MT, int BATCH, class Load>
FP4_DEVICE void add_splits(float (&acc)[MT][4], u32 s, Load load) {
    float4 v[BATCH][MT];
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) v[b][mt] = load(s + b, mt);
    }
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            acc[mt][0] += v[b][mt].x; acc[mt][1] += v[b][mt].y; acc[mt][2] += v[b][mt].z; acc[mt][3] += v[b][mt].w;
        }
    }
}

/// This lane's sums of warp `warp` into `sums` ([warp][MT][32 lanes] float4 in shared memory).
template <int MT>
FP4_DEVICE void put_warp_sums(float4* sums, u32 warp, u32 lane, const float (&acc)[MT][4]) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) sums[(warp * MT + mt) * 32 + lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
}

/// Adds the sums of warps warp + 1 .. warp + warps_per_tile - 1 (this lane's, laid out as
/// put_warp_sums writes them) to acc in warp order: a tile's warps added by its first.
template <int MT>
FP4_DEVICE void add_warp_sums(float (&acc)[MT][4], const float4* sums, u32 warp, u32 warps_per_tile, u32 lane) {
    for (u32 w = warp + 1; w < warp + warps_per_tile; ++w) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float4 v = sums[(w * MT + mt) * 32 + lane];
            acc[mt][0] += v.x; acc[mt][1] += v.y; acc[mt][2] += v.z; acc[mt][3] += v.w;
        }
    }
}

/// One warp's sums for a whole tile (or, with split-K, for its split): stored with the epilogue
/// when K is not split; else published to `partials`, and the last of the tile's blocks to
/// arrive (a counter per tile) adds the partials in split order and stores, so the result does
/// not depend on scheduling.
template <int MT>
FP4_DEVICE void finish_tile(float (&acc)[MT][4], float alpha, u32 tile, u32 lane, u32 m, u32 n, u32 epilogue,
                            const u16* residual, u16* y, float* __restrict__ partials, u32* __restrict__ counters) {
    const u32 split = block_y(), splits = gridDim.y;
    if (splits == 1) {
        store_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y);
        return;
    }
    // split-K: publish this split's partial, then the last block of the tile reduces
    float* mine = partials + (((u64)tile * splits + split) * 32 + lane) * (MT * 4);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        *reinterpret_cast<float4*>(mine + mt * 4) = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
    __threadfence();
    u32 arrived = 0;
    if (lane == 0) arrived = atomicAdd(counters + tile, 1u);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived != splits - 1) return;
    __threadfence();
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
    // m64 (MT = 8): the partials of two splits loaded together, one L2 round trip per pair where
    // one split after another took one each (the wgmma kernel's first plan had 16 splits); the
    // sums stay in split order. The smaller variants keep one split at a time: their registers
    // have no room (ptxas 13.0 spilled in gemm_nvfp4_bf16_mma_m8 with two).
    // from the L2: other blocks wrote them
    auto partial = [&](u32 split, int mt) {
        const float* part = partials + (((u64)tile * splits + split) * 32 + lane) * (MT * 4);
        return __ldcg(reinterpret_cast<const float4*>(part + mt * 4));
    };
    u32 s = 0;
    if constexpr (MT >= 8) {
        for (; s + 2 <= splits; s += 2) add_splits<MT, 2>(acc, s, partial);
    }
    for (; s < splits; ++s) add_splits<MT, 1>(acc, s, partial);
    if (lane == 0) counters[tile] = 0;  // ready for the next launch
    store_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y);
}

{% if target.instructions.clusters %}
/// The split-K finish of a launch whose K splits are one cluster (grid y = cluster y = splits;
/// block rank = split), once every warp has its sums: each block's
/// tile sums (its tile's warps added in warp order, as gemm_mma does) go to its own shared
/// memory, a cluster barrier, then the block of rank i % splits reduces the block's tile i from
/// every block's shared memory in split order and stores it (the sums of finish_tile's L2
/// finish, the same bits); a second barrier keeps every block's shared memory alive until the
/// others have read it. Why: the L2 finish stores the partials, fences, counts and reloads them
/// in the tile's last block, a chain of L2 round trips that grew the m64 launches by about
/// 1.4 us per split (the gemm probe, thirty-seventh session); here the partials cross the
/// cluster's network once, and the tiles' stores are spread over the cluster's blocks. `sums`:
/// (the block's warps) * MT * 32 float4 of dynamic shared memory (where the X-ring variants keep
/// their ring).
template <int MT>
FP4_DEVICE void finish_in_cluster(float (&acc)[MT][4], float4* sums, float alpha, u32 tile, u32 lane, u32 warp,
                                  u32 part, bool active, u32 m, u32 n, u32 epilogue, const u16* residual, u16* y,
                                  u32 warps_per_tile) {
    __syncthreads();  // every warp is done with the X ring (if any) the sums overwrite
    put_warp_sums<MT>(sums, warp, lane, acc);
    __syncthreads();
    if (part == 0 && warps_per_tile > 1) {
        add_warp_sums<MT>(acc, sums, warp, warps_per_tile, lane);
        put_warp_sums<MT>(sums, warp, lane, acc);
    }
    cluster_barrier();
    const u32 splits = gridDim.y;
    if (part == 0 && active && (warp / warps_per_tile) % splits == block_y()) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
        // from the shared memory of the cluster's block of rank split; two splits asked for at once
        auto remote = [&](u32 split, int mt) { return load_cluster_f4(sums + (warp * MT + mt) * 32 + lane, split); };
        u32 s = 0;
        for (; s + 2 <= splits; s += 2) add_splits<MT, 2>(acc, s, remote);
        for (; s < splits; ++s) add_splits<MT, 1>(acc, s, remote);
        store_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y);
    }
    cluster_barrier();
}
{% endif %}

/// One block: WARPS / warps_per_tile weight tiles of 16 rows, all M rows, over the K groups
/// of split blockIdx.y. The warps_per_tile warps of a tile take the split's groups in turn
/// (warp w of the tile: groups begin + w, begin + w + warps_per_tile, ...) and add their sums
/// through shared memory in warp order. With splits > 1 the tile's partial goes to `partials`
/// and the last of the tile's blocks to finish (a counter per tile) adds the partials in split
/// order and writes Y, so the result does not depend on scheduling. STAGES groups of weights
/// are in flight per warp. WARPS: mma_warps_per_block, or for the X-ring variants
/// mma_x_shared_warps_per_block (a multiple of their largest warps_per_tile, not necessarily a
/// power of two: at M = 64 the block's tiles decide how evenly the waves fill the SMs, and a
/// larger block copies X once for more tiles).
///
/// X: at M <= 32 each lane loads its X fragment from global memory per group (L1 / L2). At
/// M = 64 that was the kernel's limit: a lane's X for one group is MT * 32 bytes, 4x (bf16) to
/// 14x (NVFP4) its weight bytes, re-read by every tile (H200, B = 64 decode step, ncu: the GDN
/// in_proj [12352, 2048] at 524 GB/s, 97 us against 12 us of weights at the copy bandwidth) and
/// waited for when its group is used. So where the target says (X_SHARED: cp.async, at least
/// mma_x_shared_min_rows rows) the block copies X into a ring of X_SLOTS slots in dynamic shared
/// memory, one round ahead of another: round r is the warps_per_tile groups split_begin + r *
/// warps_per_tile + part the block's warps compute next, with a block barrier per round; every
/// warp of the block reads its fragments from there. A ring row (part p's row of a group, X_ROW
/// bf16) holds the group's 64 columns in X's own order, copied in 16-byte pieces; lane (g, t)
/// reads its 16 columns [16t, 16t + 16) of a row as two 16-byte loads, the first feeding MMAs
/// 0 and 1 of the group, the second MMAs 2 and 3. With rows 144 bytes apart the 8 lanes of one
/// phase of a 16-byte load (rows g, g + 1, all t) cover the 32 banks once. (The ring used to
/// hold each MMA's 8 bytes per lane apart, read by one 8-byte load per MMA: twice the loads and
/// copies, and their addresses, in a K loop that ncu found issue-bound.)
template <class Weights, int MT, int STAGES, bool X_SHARED, int WARPS>
FP4_DEVICE void gemm_mma(const u16* __restrict__ x, Weights weights, float alpha, u16* y,
                         const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
                         u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split,
                         u32 warps_per_tile, u32 epilogue) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 part = warp % warps_per_tile;  // which of the tile's warps this is
    const u32 tile = block_x() * (WARPS / warps_per_tile) + warp / warps_per_tile;
    const bool active = tile < n_tiles;      // inactive warps still meet the block barrier
    const u32 split = block_y();
    const u32 split_begin = split * groups_per_split;
    const u32 split_end = active ? min(k_groups, split_begin + groups_per_split) : 0;
    const u32 first = split_begin + part;  // this warp's groups: first + i * warps_per_tile
    const u32 g = lane / 4, t = lane % 4;

    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

    const u64 tile_base = (u64)tile * k_groups * 32 + lane;
    // Before the wait for the previous kernel (weights are constants): the first STAGES groups
    // of every warp into registers, and the first L2_PREFETCH_GROUPS groups of the tile's split
    // asked of the L2 by the tile's first lane, so the stream is under way while the kernels
    // this one depends on finish. Then wait, and only then let the next kernel start: its
    // blocks may read, before their own wait, what the kernels before this one wrote.
    typename Weights::Group ring[STAGES];
    #pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        const u32 group = first + s * warps_per_tile;
        if (group < split_end) ring[s] = weights.load(tile_base + (u64)group * 32);
    }
    if (L2_PREFETCH_GROUPS > 0 && part == 0 && lane == 0 && split_end > split_begin) {
        const u32 groups = min(split_end - split_begin, (u32)L2_PREFETCH_GROUPS);
        weights.prefetch((u64)tile * k_groups * 32 + (u64)split_begin * 32, groups * 32);
    }
    wait_for_previous_grid();
    allow_next_grid();

    extern __shared__ __align__(16) u8 mma_shared[];

    if constexpr (X_SHARED) {
        // rounds of the block's K range (inactive warps copy and meet the barriers too)
        const u32 block_end = min(k_groups, split_begin + groups_per_split);
        const u32 rounds = (block_end - split_begin + warps_per_tile - 1) / warps_per_tile;
        u16* x_ring = reinterpret_cast<u16*>(mma_shared);
        // a slot holds all MT * 8 rows of the variant, those past M zero, so the MMAs read X
        // without a per-fragment row test (SASS of the m64 bf16 kernel: a zeroing CS2R and a
        // predicated LDS per MMA, with their compares and addresses, in a loop that issued about
        // 250 instructions per K group for its 32 MMAs)
        constexpr u32 ROWS = MT * 8;
        const u32 slot_elems = warps_per_tile * ROWS * X_ROW;
        // round r's X into slot r % X_SLOTS in 16-byte pieces (piece q of a ring row is columns
        // 8q ..; K is a multiple of 16, so a piece is wholly inside K or wholly past it), zero
        // past K and past M (the weights are zero past K, and zero times stale shared memory
        // could be NaN); one commit group per round, empty past the end
        auto issue = [&](u32 r) {
            if (r < rounds) {
                u16* slot = x_ring + (r % X_SLOTS) * slot_elems;
                const u32 g0 = split_begin + r * warps_per_tile;
                for (u32 u = thread_x(); u < warps_per_tile * ROWS * 8; u += WARPS * FP4_WARP_SIZE) {
                    const u32 p = u / (ROWS * 8), row = (u / 8) % ROWS, piece = u % 8;
                    const u32 group = g0 + p, col = group * 64 + 8 * piece;
                    const bool inside = group < block_end && col < k && row < m;
                    cp_async16_zfill(slot + (p * ROWS + row) * X_ROW + piece * 8, inside ? x + (u64)row * k + col : x, inside ? 16u : 0u);
                }
            }
            cp_async_commit();
        };
        for (u32 r = 0; r + 1 < X_SLOTS; ++r) issue(r);
        for (u32 r0 = 0; r0 < rounds; r0 += STAGES) {
            #pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                const u32 r = r0 + s;
                if (r >= rounds) break;  // uniform across the block
                cp_async_wait<X_SLOTS - 2>();  // round r landed (this thread's copies) ...
                __syncthreads();               // ... and everyone's; round r - 1's slot is free
                issue(r + X_SLOTS - 1);
                const u32 group = first + r * warps_per_tile;
                if (group >= split_end) continue;
                const u16* xg = x_ring + (r % X_SLOTS) * slot_elems + (part * ROWS + g) * X_ROW + 16 * t;
                // half h: columns 16t + 8h .. of every row tile in one 16-byte load each, then
                // MMAs 2h and 2h + 1 over the row tiles (each accumulator still adds j = 0..3
                // in order, and MT independent MMAs stand between two dependent ones)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    u32x4 xv[MT];
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) xv[mt] = *reinterpret_cast<const u32x4*>(xg + mt * 8 * X_ROW + 8 * h);
                    #pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
                        u32 a[4];
                        weights.fragment(ring[s], 2 * h + jj, a);
                        #pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            const u32 b0 = jj == 0 ? xv[mt].x : xv[mt].z;
                            const u32 b1 = jj == 0 ? xv[mt].y : xv[mt].w;
                            mma_m16n8k16_bf16(acc[mt], a[0], a[1], a[2], a[3], b0, b1);
                        }
                    }
                }
                const u32 next = group + STAGES * warps_per_tile;
                if (next < split_end) ring[s] = weights.load(tile_base + (u64)next * 32);
            }
        }
        cp_async_wait<0>();  // the empty groups past the end: nothing is left in flight
    } else {
        // Where the weights say so (bf16) and M <= 16, the X fragments run one group ahead of
        // their use (two buffers; STAGES is even so each unrolled stage's buffer is a
        // compile-time index). Otherwise the registers are better spent on occupancy and X is
        // loaded when its group is used (measured on the H200: prefetching X cost NVFP4 20% at
        // M = 1, gained bf16 20% at 16).
        constexpr int X_BUFFERS = Weights::PREFETCH_X && MT <= 2 ? 2 : 1;
        static_assert(X_BUFFERS == 1 || STAGES % 2 == 0, "the X double buffer needs an even stage count");
        u32x4 xs[X_BUFFERS][MT][2];
        if (X_BUFFERS == 2) load_x_fragment<MT>(x, m, k, first, g, t, first < split_end, xs[0]);
        for (u32 base = first; base < split_end; base += STAGES * warps_per_tile) {
            #pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                const u32 group = base + s * warps_per_tile;
                if (group < split_end) {
                    const u32 after = group + warps_per_tile;
                    if (X_BUFFERS == 2) load_x_fragment<MT>(x, m, k, after, g, t, after < split_end, xs[(s + 1) % X_BUFFERS]);
                    else load_x_fragment<MT>(x, m, k, group, g, t, true, xs[0]);
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        u32 a[4];
                        weights.fragment(ring[s], j, a);
                        #pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            const u32x4& q = xs[s % X_BUFFERS][mt][j / 2];
                            const u32 b0 = (j % 2 == 0) ? q.x : q.z;
                            const u32 b1 = (j % 2 == 0) ? q.y : q.w;
                            mma_m16n8k16_bf16(acc[mt], a[0], a[1], a[2], a[3], b0, b1);
                        }
                    }
                    const u32 next = group + STAGES * warps_per_tile;
                    if (next < split_end) ring[s] = weights.load(tile_base + (u64)next * 32);
                }
            }
        }
    }

{% if target.instructions.clusters %}
    // K splits launched as one cluster (gemm.mma_x_shared_cluster_max_splits,
    // gemm.mma_cluster_max_splits): finished there, the sums in the dynamic shared memory
    if (gridDim.y > 1 && cluster_blocks_y() == gridDim.y) {
        finish_in_cluster<MT>(acc, reinterpret_cast<float4*>(mma_shared), alpha, tile, lane, warp, part,
                                     active, m, n, epilogue, residual, y, warps_per_tile);
        return;
    }
{% endif %}
    if (warps_per_tile > 1) {
        // the tile's warps add up in warp order through shared memory (uniform branch: every
        // warp of the block reaches the barrier); with X_SHARED in the X area, once every warp
        // is done with X (the host sizes it for both)
        float4* warp_sums;
        if constexpr (X_SHARED) {
            __syncthreads();
            warp_sums = reinterpret_cast<float4*>(mma_shared);
        } else {
            __shared__ float4 static_sums[WARPS * MT * 32];
            warp_sums = static_sums;
        }
        if (part > 0) put_warp_sums<MT>(warp_sums, warp, lane, acc);
        __syncthreads();
        if (part > 0) return;
        add_warp_sums<MT>(acc, warp_sums, warp, warps_per_tile, lane);
    }
    if (!active) return;
    finish_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y, partials, counters);
}

{# the variants of src/kernels/gemm/mod.rs, MMA_VARIANT_ROWS #}
{% for rows in [8, 16, 32, 48, 64] %}
{% if rows >= target.gemm.mma_x_shared_min_rows and target.instructions.cp_async %}
{% set x_shared = "true" %}
{% set warps = "MMA_X_WARPS" %}
{% set bounds = "MMA_X_SHARED_BOUNDS" %}
{% set stages_nvfp4 = target.gemm.mma_x_shared_stages_nvfp4 %}
{% set stages_bf16 = target.gemm.mma_x_shared_stages_bf16 %}
{% else %}
{% set x_shared = "false" %}
{% set warps = "MMA_WARPS" %}
{% set bounds = "MMA_WARPS * FP4_WARP_SIZE" %}
{% set stages_nvfp4 = target.gemm.mma_stages_nvfp4 %}
{% set stages_bf16 = target.gemm.mma_stages_bf16 %}
{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS({{ bounds }}) gemm_nvfp4_bf16_mma_m{{ rows }}(
    const u16* __restrict__ x, const u32x4* __restrict__ words, const u16* __restrict__ scales,
    float alpha, u16* y, const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    // gemm_mma waits for the previous grid after its weight prologue
    gemm_mma<Nvfp4Weights, {{ rows }} / 8, {{ stages_nvfp4 }}, {{ x_shared }}, {{ warps }}>(x, Nvfp4Weights{words, scales}, alpha, y, residual, partials, counters,
        m, n, k, n_tiles, k_groups, groups_per_split, warps_per_tile, epilogue);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS({{ bounds }}) gemm_bf16_bf16_mma_m{{ rows }}(
    const u16* __restrict__ x, const u32x4* __restrict__ words,
    float alpha, u16* y, const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    // gemm_mma waits for the previous grid after its weight prologue
    gemm_mma<Bf16Weights, {{ rows }} / 8, {{ stages_bf16 }}, {{ x_shared }}, {{ warps }}>(x, Bf16Weights{words}, alpha, y, residual, partials, counters,
        m, n, k, n_tiles, k_groups, groups_per_split, warps_per_tile, epilogue);
}
{% endfor %}
{% if target.instructions.cp_async %}
// ============================================================================================
// gemm_nvfp4_bf16_stream_m{8,16}: the NVFP4 weight stream of gemm_nvfp4_bf16_mma_m{8,16} with
// the bytes in flight held in shared memory instead of registers.
//
// Why: the register kernel keeps mma_stages_nvfp4 groups (16 B of weights + a 2-byte scale
// load) per lane in registers and loads X from global memory per group. On the H200 at M = 1
// (65536 x 4096, ncu) that left 4 blocks per SM (register-limited, 27 of 64 warps active), 38%
// of scheduler cycles with no eligible warp and 42% of stalls on the L1TEX scoreboard, at 53% of
// DRAM bandwidth. Here:
// - each warp has a ring of STREAM_STAGES stages in shared memory, a stage being STREAM_CHUNK
//   of its K groups; cp.async.cg copies them global -> shared (16 B per lane per group: the
//   lane's own fragment, so a lane reads back only what it copied), and each group's 64 scale
//   bytes arrive as 16-byte copies by 4 lanes instead of a 2-byte load per lane. The bytes in
//   flight cost shared memory, not registers: STREAM_STAGES - 1 stages stay in flight per warp
//   while it computes one, and the launch bounds can ask for more resident warps (sm_90a: 48
//   registers, 5 blocks of 8 warps at M = 1, against 64 and 4 for the register kernel); with
//   one warp per tile (the large-N shapes) a stage is a contiguous CHUNK * 512 B of weights and
//   CHUNK * 64 B of scales, so each warp asks DRAM for longer runs at a time;
// - X for the block's K range (at most 16 rows: the m8 / m16 variants) is copied to shared
//   memory once per block, rows padded by 16 bytes so the 8 rows a warp reads at once fall in
//   different banks; per group a lane reads its fragment from shared memory instead of global.
// The weight layout, the decode (Nvfp4Weights::fragment), the partition (warps per tile, K
// splits) and the split-K finish are the register kernel's; larger M stays on that kernel
// (whose m64 variant streams X through shared memory itself).
//
// Synchronisation: one cp.async group per stage (empty past the end, so the wait count is
// fixed); before computing a stage, cp.async.wait_group STREAM_STAGES - 2 (this lane's copies of
// that stage are done) and __syncwarp (the other lanes' scale copies are visible, and every lane
// has finished the stage computed before, whose slot the next copies overwrite).
// ============================================================================================
#define STREAM_WARPS {{ target.gemm.stream_warps_per_block }}
#define STREAM_STAGES {{ target.gemm.stream_stages }}
#define STREAM_CHUNK {{ target.gemm.stream_chunk_groups }}
// (threads, resident blocks per SM): caps the registers so that many blocks fit
#define STREAM_BOUNDS STREAM_WARPS * FP4_WARP_SIZE, {{ target.gemm.stream_blocks_per_sm }}
/// Shared memory of one stage: STREAM_CHUNK groups of 32 lanes x 16 B weights, then 32 x 2 B
/// scales each (layout.rs, Nvfp4Fragments: the same order as in global memory).
#define STREAM_STAGE_BYTES (STREAM_CHUNK * 32 * (16 + 2))
#define STREAM_RING_BYTES (STREAM_STAGES * STREAM_STAGE_BYTES)

static_assert(STREAM_STAGES >= 2, "one stage computes while the others are in flight");
static_assert(STREAM_CHUNK >= 1 && STREAM_CHUNK <= 8, "a chunk's scales are one 16-byte copy by each of 4 * STREAM_CHUNK lanes");

/// One block of STREAM_WARPS warps, partitioned as gemm_mma's blocks (warps_per_tile warps per
/// tile, K split across blockIdx.y), on dynamic shared memory of STREAM_WARPS rings, then X:
/// m rows of groups_per_split * 64 + 8 bf16 (src/kernels/gemm/mod.rs, stream_shared_bytes,
/// computes the same size). Each warp adds gemm_mma's products in gemm_mma's order, so with the
/// same partition the two kernels write the same bits.
template <int MT>
FP4_DEVICE void gemm_stream(const u16* __restrict__ x, const u32x4* __restrict__ words, const u16* __restrict__ scales,
                            float alpha, u16* y, const u16* residual, float* __restrict__ partials,
                            u32* __restrict__ counters, u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups,
                            u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    extern __shared__ __align__(16) u8 stream_shared[];
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 part = warp % warps_per_tile;
    const u32 tile = block_x() * (STREAM_WARPS / warps_per_tile) + warp / warps_per_tile;
    const bool active = tile < n_tiles;  // inactive warps still copy X and meet the barriers
    const u32 split_begin = block_y() * groups_per_split;
    const u32 split_end = active ? min(k_groups, split_begin + groups_per_split) : 0;
    const u32 g = lane / 4, t = lane % 4;

    u8* ring = stream_shared + warp * STREAM_RING_BYTES;
    u16* xs = reinterpret_cast<u16*>(stream_shared + STREAM_WARPS * STREAM_RING_BYTES);
    const u32 x_stride = groups_per_split * 64 + 8;  // bf16 per staged row of X

    // X of the split's K range, zero past K (the weights are zero-padded there, and zero times
    // stale shared memory could be NaN); its own cp.async group, committed first
    {
        const u32 units_per_row = groups_per_split * 8;  // 16-byte units
        const u32 col0 = split_begin * 64;
        for (u32 u = thread_x(); u < m * units_per_row; u += STREAM_WARPS * FP4_WARP_SIZE) {
            const u32 row = u / units_per_row, col = col0 + (u % units_per_row) * 8;
            const bool inside = col < k;
            cp_async16_zfill(xs + row * x_stride + (col - col0), inside ? x + (u64)row * k + col : x, inside ? 16u : 0u);
        }
        cp_async_commit();
    }

    // This warp's groups are gemm_mma's: split_begin + part + j * warps_per_tile, j = 0 ..
    // groups - 1 (so both kernels add the same products in the same order, and a small K still
    // spreads over all the tile's warps); its chunk i is j = i * STREAM_CHUNK .. + STREAM_CHUNK - 1,
    // contiguous in memory when warps_per_tile = 1 (the large-N streaming shapes). The copy
    // sources and X offsets advance by one chunk at a time: the loop issues about 130
    // instructions per group, most of them the decode, and at 4.3 TB/s an H200 SM must finish a
    // group every ~35 cycles, so per-copy 64-bit address arithmetic would cost issue slots the
    // stream needs.
    const u32 groups = split_end > split_begin + part ? (split_end - split_begin - part + warps_per_tile - 1) / warps_per_tile : 0;
    const u32 mine = (groups + STREAM_CHUNK - 1) / STREAM_CHUNK;  // chunks
    const u32 step = warps_per_tile * STREAM_CHUNK;  // groups from one chunk of this warp to its next
    const u64 first = (u64)tile * k_groups + split_begin + part;
    const u32x4* w_src = words + first * 32 + lane;
    // the scales of the chunk's group lane / 4, 16 B per lane (lanes < 4 * STREAM_CHUNK)
    const u16* s_src = scales + (first + (lane / 4) * warps_per_tile) * 32 + (lane % 4) * 8;
    u32 issued = 0;
    auto issue = [&]() {  // copies this warp's next chunk into slot issued % STREAM_STAGES
        if (issued < mine) {
            u8* stage = ring + (issued % STREAM_STAGES) * STREAM_STAGE_BYTES;
            const u32 j0 = issued * STREAM_CHUNK;
            #pragma unroll
            for (int c = 0; c < STREAM_CHUNK; ++c)
                if (j0 + c < groups) cp_async16(stage + (c * 32 + lane) * 16, w_src + c * warps_per_tile * 32);
            if (lane < 4 * STREAM_CHUNK && j0 + lane / 4 < groups)
                cp_async16(stage + STREAM_CHUNK * 512 + lane * 16, s_src);
            w_src += step * 32;
            s_src += step * 32;
        }
        ++issued;
        cp_async_commit();
    };
    #pragma unroll
    for (int s = 0; s < STREAM_STAGES - 1; ++s) issue();
    cp_async_wait<STREAM_STAGES - 1>();  // X (this thread's copies), then the whole block's
    __syncthreads();

    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
    const Nvfp4Weights decode{};  // only its fragment decode is used: the data is in shared memory
    const u16* x_lane = xs + g * x_stride + part * 64 + 16 * t;  // X of chunk i's first group, row g

    for (u32 i = 0; i < mine; ++i) {
        cp_async_wait<STREAM_STAGES - 2>();  // chunk i has landed (this lane's copies)
        __syncwarp();                        // ... and every lane's; slot (i - 1) is free
        issue();
        const u8* stage = ring + (i % STREAM_STAGES) * STREAM_STAGE_BYTES;
        #pragma unroll
        for (int c = 0; c < STREAM_CHUNK; ++c) {
            if (i * STREAM_CHUNK + c >= groups) break;  // uniform across the warp
            Nvfp4Group w;
            w.w = *reinterpret_cast<const u32x4*>(stage + (c * 32 + lane) * 16);
            w.scales = reinterpret_cast<const u16*>(stage + STREAM_CHUNK * 512)[c * 32 + lane];
            u32x4 xf[MT][2];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (mt * 8 + g < m) {
                    const u16* p = x_lane + mt * 8 * x_stride + c * warps_per_tile * 64;
                    xf[mt][0] = *reinterpret_cast<const u32x4*>(p);
                    xf[mt][1] = *reinterpret_cast<const u32x4*>(p + 8);
                } else {
                    xf[mt][0] = xf[mt][1] = {0u, 0u, 0u, 0u};
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 a[4];
                decode.fragment(w, j, a);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32x4& q = xf[mt][j / 2];
                    mma_m16n8k16_bf16(acc[mt], a[0], a[1], a[2], a[3], (j % 2 == 0) ? q.x : q.z, (j % 2 == 0) ? q.y : q.w);
                }
            }
        }
        x_lane += step * 64;
    }
    // every chunk's copies have landed (the last wait covered chunk mine - 1); said once more
    // because the rings are reused below and a late copy would corrupt the sums
    cp_async_wait<0>();

    if (warps_per_tile > 1) {
        // the tile's warps add up in warp order through shared memory, each partial in its own
        // warp's ring (no copies are pending there)
        static_assert(STREAM_RING_BYTES >= 2 * 32 * 16, "a ring holds a warp's m16 partial");
        float4* sums = reinterpret_cast<float4*>(ring);
        if (part > 0) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) sums[mt * 32 + lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
        }
        __syncthreads();
        if (part > 0) return;
        for (u32 w = warp + 1; w < warp + warps_per_tile; ++w) {
            const float4* other = reinterpret_cast<const float4*>(stream_shared + w * STREAM_RING_BYTES);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float4 v = other[mt * 32 + lane];
                acc[mt][0] += v.x; acc[mt][1] += v.y; acc[mt][2] += v.z; acc[mt][3] += v.w;
            }
        }
    }
    if (!active) return;
    finish_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y, partials, counters);
}

{% for rows in [8, 16] %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(STREAM_BOUNDS) gemm_nvfp4_bf16_stream_m{{ rows }}(
    const u16* __restrict__ x, const u32x4* __restrict__ words, const u16* __restrict__ scales,
    float alpha, u16* y, const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    chain_after_previous_grid();
    gemm_stream<{{ rows }} / 8>(x, words, scales, alpha, y, residual, partials, counters,
        m, n, k, n_tiles, k_groups, groups_per_split, warps_per_tile, epilogue);
}
{% endfor %}
{% endif %}
{% if target.instructions.wgmma and target.instructions.cp_async %}
// ============================================================================================
// gemm_{nvfp4,bf16}_bf16_wgmma_m64: the m64 product on the warpgroup MMA (sm_90a), for launches
// of gemm.wgmma_min_rows rows or more.
//
// Why: at M = 64 the mma.sync kernel issues, per warp and K group, 32 MMAs of m16n8k16 and one
// shared-memory load of an X fragment for each (gemm_mma, X_SHARED); the decode step's dense
// GEMMs at B = 64 ran at 25-70% of the copy bandwidth (cuBLAS about twice as fast on the same
// shapes, BENCHMARKS.md twenty-fifth session). Here a warpgroup (4 warps) owns 64 weight rows
// (4 consecutive 16-row tiles of the fragment layout, warp q the tile 4 * quad + q) and multiplies
// them by all 64 rows of X with 4 wgmma.m64n64k16 per K group: the weights are the A operand
// from registers (a warp's A fragment of wgmma is the mma.sync A fragment of its 16 rows: the
// decode is Weights::fragment unchanged), X^T the B operand read by the tensor cores from
// shared memory, and the accumulator (64 x 64 fp32 over the 128 threads) has the m16n8
// layout per warp, so finish_tile's epilogues and split-K finish apply as they are (MT = 8).
//
// X: the fragment layout permutes K inside a group (MMA j of lane quad t takes columns 16t + 4j
// .. 16t + 4j + 3, layout.rs), so wgmma's step j reads logical column 2t + e as X column
// 16t + 4j + e and 2t + 8 + e as 16t + 4j + 2 + e: each 4-byte word of a row has its own place in
// the B operand, which wgmma reads in the no-swizzle K-major layout (core matrices of 8 rows x 16
// bytes, 128 contiguous bytes; the two along K 128 bytes apart (the descriptor's leading offset),
// the 8-row groups 256 apart (its stride offset)). Copying word by word (cp.async of 4 bytes,
// 32 sectors a warp instruction) made the first version of this kernel slower than mma.sync
// (H100, B = 64 step 14.67 against 13.15 ms). So X goes in two steps:
//   - staging: WG_X_SLOTS slots of one K group, rows as in X (144 bytes apart), filled by 16-byte
//     cp.async, WG_X_SLOTS - 1 rounds ahead (columns past K zero: the weights there are zero and
//     stale shared memory could be NaN; rows past M not copied: their products land in outputs
//     nobody stores);
//   - operand: two slots of the B layout (8 KiB: 4 steps of 2 KiB), each thread moving 16-byte
//     pieces of the staging slot with four 4-byte stores; a warp's stores take one (row group, half
//     of a lane quad's columns): lane (r = lane / 4, t = lane % 4) row r, lane quad t, so each
//     store fills the 32 banks once. The permutation of round r + 1 runs while the tensor cores
//     multiply round r.
// Weights: each warp's own ring of shared-memory slots (gemm.wgmma_stages_*), filled by
// cp.async STAGES - 1 rounds ahead and read back into the A registers at their round (the second
// version held them in registers, 2 bf16 / 3 NVFP4 groups a warp, reloaded once the round's
// wgmma was waited for). This third version streams at the copy bandwidth where many blocks each
// run many rounds (H100, M = 64, (65536, 4096) bf16 183.71 us, 98.8% of copy, against mma.sync
// 202.36 and cuBLAS 192.64; NVFP4 150.45 against 169.32) but stays about twice as slow as
// mma.sync on the model's shapes ((12288, 2048) bf16 41.48 against 21.88 us, the second version
// 40.87): ncu of the GDN in_proj in a B = 64 step, 48.9 us, shows each warp spending ~300
// instructions a round (the X staging and permutation, two barriers) at ~10 cycles each with 8
// to 16 warps per SM, where mma.sync's warps spend ~230 on the same 16 rows and K group
// (BENCHMARKS.md, forty-first session). So gemm.wgmma_min_rows stays 65 on sm_90a; what would
// change it is more work per round and warp (several K groups per round, or more rows per warp).
// Per round r (gemm_wgmma): the A fragments out of the ring, the wgmma of operand slot r % 2
// (issued); the copies of round r + STAGES - 1's weights and round r + WG_X_SLOTS - 1's X; wait
// for this thread's copies of round r + 1, barrier (every thread's copies visible); the
// permutation of round r + 1 into operand slot (r + 1) % 2 (round r - 1's wgmma was retired in
// its round) and the proxy fence that shows it to the tensor cores; barrier; the wait for round
// r's wgmma. (The second version, and this one before ptxas's C7513 / C7518 notes were read,
// had every wgmma serialised by ptxas: see gemm_wgmma.)
// ============================================================================================
#define WG_GROUPS {{ target.gemm.wgmma_warpgroups_per_block }}
#define WG_THREADS (WG_GROUPS * 4 * FP4_WARP_SIZE)
#define WG_X_SLOTS {{ target.gemm.wgmma_x_slots }}
// a staging row: 64 bf16 and 16 bytes of padding (the 8 lanes of a 16-byte shared load phase,
// two rows x four lane quads, then meet each bank once)
#define WG_STAGE_ROW_BYTES 144u
#define WG_STAGE_BYTES (64u * WG_STAGE_ROW_BYTES)
#define WG_OPERAND_BYTES 8192u
#define WG_STEP_BYTES 2048u
/// The descriptor of a no-swizzle K-major operand at shared address `address`: core matrices
/// `leading` bytes apart along K, `stride` bytes apart along M / N (all multiples of 16).
FP4_DEVICE u64 wgmma_descriptor(u32 address, u32 leading, u32 stride) {
    return (u64)((address & 0x3ffffu) >> 4) | ((u64)(leading >> 4) << 16) | ((u64)(stride >> 4) << 32);
}
// ---- wgmma instructions ----
FP4_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FP4_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FP4_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
/// Pins a register's value at this point of the program (no instruction moves across it), so
/// that what a wgmma reads is computed before the first wgmma of a batch: ptxas 13.0 serialises
/// every wgmma where another instruction defines one of their inputs between the first and the
/// commit (C7513). (Emulated as nothing.)
FP4_DEVICE void wgmma_pin(u32& v) { asm volatile("" : "+r"(v)::"memory"); }
FP4_DEVICE void wgmma_pin(u64& v) { asm volatile("" : "+l"(v)::"memory"); }
/// Shared memory written through the generic proxy (cp.async, stores) made visible to the
/// tensor cores' reads (the async proxy); each writing thread, before the barrier.
FP4_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/// d[64 x 64] += A[64 x 16] (bf16, registers: this warp's 16 rows as the m16n8k16 A fragment)
/// * B[16 x 64] (bf16, shared memory, K-major: `b` from wgmma_descriptor), fp32 accumulation.
/// d[4i + q] is the m16n8 accumulator register q of the warp's n8 tile i.
FP4_DEVICE void wgmma_m64n64k16_bf16(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{" "%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u)
        : "memory");
}
// ---- end of wgmma instructions ----

/// X columns 16t + 8h .. 16t + 8h + 7 of row `row` of a K group (16 bytes, `v`) into that group's
/// B operand at `operand` (no-swizzle K-major): its four words go to steps 2h / 2h + 1,
/// core-matrix columns 0 / 1 of row group row / 8 (the fragment layout's K order, see above).
FP4_DEVICE void wgmma_store_x_piece(u8* operand, u32 row, u32 t, u32 h, const u32x4& v) {
    u8* base = operand + (row / 8u) * 2u * 128u + (row % 8u) * 16u + t * 4u;
    *reinterpret_cast<u32*>(base + (2 * h) * WG_STEP_BYTES) = v.x;
    *reinterpret_cast<u32*>(base + (2 * h) * WG_STEP_BYTES + 128) = v.y;
    *reinterpret_cast<u32*>(base + (2 * h + 1) * WG_STEP_BYTES) = v.z;
    *reinterpret_cast<u32*>(base + (2 * h + 1) * WG_STEP_BYTES + 128) = v.w;
}

/// Where a warp of a wgmma block of WG_GROUPS quads stands: its 16-row tile (warp q of quad g
/// the tile 4g + q), whether the tile exists (a warp past the last one copies no weights and
/// stores nothing), and split blockIdx.y's K groups [split_begin, block_end), its own
/// [split_begin, split_end) (empty past the last tile).
struct WgmmaWarp {
    u32 lane, warp, tile;
    bool active;
    u32 split_begin, block_end, split_end, rounds;
};
FP4_DEVICE WgmmaWarp wgmma_warp(u32 n_tiles, u32 k_groups, u32 groups_per_split) {
    WgmmaWarp w;
    w.lane = thread_x() % FP4_WARP_SIZE;
    w.warp = thread_x() / FP4_WARP_SIZE;
    w.tile = (block_x() * WG_GROUPS + w.warp / 4) * 4 + w.warp % 4;
    w.active = w.tile < n_tiles;
    w.split_begin = block_y() * groups_per_split;
    w.block_end = min(k_groups, w.split_begin + groups_per_split);
    w.split_end = w.active ? w.block_end : w.split_begin;
    w.rounds = w.block_end - w.split_begin;
    return w;
}

// ---- a warp's weight ring (gemm_*_wgmma_m64): one K group of its tile per slot ----
// Each lane copies its own entries of the fragment arrays (cp.async, 16 bytes) into the warp's
// slot and later reads them back as the Group that Weights::load would have returned, so no
// other lane waits on them; only the NVFP4 scales (2 bytes a lane, 64 a group) are copied by
// lanes 0..3 for the warp, which the block barrier after each round's wait makes visible. (Bulk
// copies of a slot completing on an mbarrier per slot, one or two per warp and round, ran no
// faster at M = 64 and slower where NVFP4 streams: H100, gemm bench (65536, 4096) 167.48 against
// 150.45 us, forty-first session.)
/// Bytes of one slot: NVFP4 32 lanes x 16 bytes of words, then their 32 scales; bf16 the four
/// MMAs' 32 x 16 bytes.
template <class Weights> struct WgmmaSlot;
template <> struct WgmmaSlot<Nvfp4Weights> { static constexpr u32 BYTES = 32u * 16u + 32u * 2u; };
template <> struct WgmmaSlot<Bf16Weights> { static constexpr u32 BYTES = 4u * 32u * 16u; };
/// This lane's copies of lane entry `index` (group * 32 + lane) into the slot at shared address
/// `slot`.
FP4_DEVICE void wgmma_copy_group(const Nvfp4Weights& w, u32 slot, u64 index, u32 lane) {
    cp_async16_shared(slot + lane * 16u, w.words + index);
    if (lane < 4u) cp_async16_shared(slot + 512u + lane * 16u, w.scales + (index - lane) + lane * 8u);
}
FP4_DEVICE void wgmma_copy_group(const Bf16Weights& w, u32 slot, u64 index, u32 lane) {
    const u32x4* group_words = w.words + (index / 32) * 128 + index % 32;
    #pragma unroll
    for (int j = 0; j < 4; ++j) cp_async16_shared(slot + (u32)(j * 32 + lane) * 16u, group_words + j * 32);
}
/// This lane's Group of the slot at `slot` (generic pointer into shared memory).
FP4_DEVICE Nvfp4Group wgmma_slot_group(const Nvfp4Weights&, const u8* slot, u32 lane) {
    return {*reinterpret_cast<const u32x4*>(slot + lane * 16u), (u32)*reinterpret_cast<const u16*>(slot + 512u + lane * 2u)};
}
FP4_DEVICE Bf16Group wgmma_slot_group(const Bf16Weights&, const u8* slot, u32 lane) {
    Bf16Group group;
    #pragma unroll
    for (int j = 0; j < 4; ++j) group.w[j] = *reinterpret_cast<const u32x4*>(slot + (u32)(j * 32 + lane) * 16u);
    return group;
}

/// A warp's weight ring in a wgmma launch: its tile's K groups [split_begin, split_end) (none
/// for a warp past the last tile), round r being group split_begin + r, in slot r % STAGES of
/// SLOT_BYTES at shared address `base` (generic pointer `ptr`).
template <class Weights, int STAGES>
struct WgmmaRing {
    static constexpr u32 SLOT_BYTES = WgmmaSlot<Weights>::BYTES;
    Weights weights;
    u32 base;
    const u8* ptr;
    u64 tile_base;  // this lane's entry of the tile's group 0
    u32 lane, split_begin, split_end;
    /// This lane's copies of round r's weights (none past the warp's range; no commit).
    FP4_DEVICE void copy(u32 r) const {
        const u32 group = split_begin + r;
        if (group < split_end) wgmma_copy_group(weights, base + (r % STAGES) * SLOT_BYTES, tile_base + (u64)group * 32, lane);
    }
    FP4_DEVICE const u8* slot(u32 r) const { return ptr + (r % STAGES) * SLOT_BYTES; }
    /// Warp `w`'s ring in the block's dynamic shared memory `shared`, the warps' rings from byte
    /// `rings_offset` on, one after another.
    static FP4_DEVICE WgmmaRing of(const Weights& weights, u8* shared, u32 rings_offset, const WgmmaWarp& w, u32 k_groups) {
        const u32 offset = rings_offset + w.warp * STAGES * SLOT_BYTES;
        return {weights, cp_async_shared_address(shared) + offset, shared + offset,
                (u64)w.tile * k_groups * 32 + w.lane, w.lane, w.split_begin, w.split_end};
    }
    /// The copies of rounds 0 .. STAGES - 2 in one cp.async group, then lane 0 asks the L2 for
    /// the next L2_PREFETCH_GROUPS groups: what a block does before its wait for the previous
    /// kernel (the weights do not depend on it).
    FP4_DEVICE void start() const {
        for (u32 r = 0; r + 1 < STAGES; ++r) copy(r);
        cp_async_commit();
        if (L2_PREFETCH_GROUPS > 0 && lane == 0 && split_end > split_begin + STAGES - 1) {
            const u32 first = split_begin + STAGES - 1;
            const u32 groups = min(split_end - first, (u32)L2_PREFETCH_GROUPS);
            weights.prefetch(tile_base - lane + (u64)first * 32, groups * 32);
        }
    }
};

/// One K group of a warpgroup's product: this lane's A fragments out of ring slot `slot`, the
/// B operand's descriptors at shared address `operand`, both pinned before the fence (C7513), and
/// the four wgmma.m64n64k16 issued and committed, not waited for. Every warp of the warpgroup
/// calls it, unconditionally (C7518).
template <class Weights>
FP4_DEVICE void wgmma_issue_group(const Weights& weights, const u8* slot, u32 lane, u32 operand, float (&d)[32]) {
    u32 a[4][4];
    u64 b[4];
    const auto group = wgmma_slot_group(weights, slot, lane);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        weights.fragment(group, j, a[j]);
        b[j] = wgmma_descriptor(operand + j * WG_STEP_BYTES, 128u, 256u);
        wgmma_pin(b[j]);
        #pragma unroll
        for (int q = 0; q < 4; ++q) wgmma_pin(a[j][q]);
    }
    wgmma_fence();
    #pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_m64n64k16_bf16(d, a[j], b[j]);
    wgmma_commit();
}

/// The accumulators of a warp's 16-row tile (the m16n8 layout, d[4i + q] of n8 tile i) through
/// gemm_mma's finish.
FP4_DEVICE void wgmma_finish_tile(const float (&d)[32], float alpha, u32 tile, u32 lane, u32 m, u32 n, u32 epilogue,
                                  const u16* residual, u16* y, float* __restrict__ partials, u32* __restrict__ counters) {
    float acc[8][4];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        acc[i][0] = d[4 * i]; acc[i][1] = d[4 * i + 1]; acc[i][2] = d[4 * i + 2]; acc[i][3] = d[4 * i + 3];
    }
    finish_tile<8>(acc, alpha, tile, lane, m, n, epilogue, residual, y, partials, counters);
}

/// One block: WG_GROUPS quads of 64 weight rows, all (at most 64) rows of X, over the K groups
/// of split blockIdx.y. Each warp's weights come through its own ring of STAGES slots in shared
/// memory, STAGES - 1 rounds ahead (the first ones asked for before the wait for the previous
/// kernel, as gemm_mma); X through the staging slots, WG_X_SLOTS - 1 rounds ahead. The copies of
/// a round are one cp.async group: round r's group holds the weights of round r + STAGES - 1 and
/// the X of round r + WG_X_SLOTS - 1, so waiting until WG_X_SLOTS - 2 groups are pending leaves
/// round r + 1's X and weights landed (STAGES >= WG_X_SLOTS; it also waits for the weights of
/// rounds up to r + STAGES - WG_X_SLOTS + 1). The finish is gemm_mma's (finish_tile per 16-row
/// tile), so the split-K scratch and counters are the mma kernels'.
template <class Weights, int STAGES>
FP4_DEVICE void gemm_wgmma(const u16* __restrict__ x, Weights weights, float alpha, u16* y,
                           const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
                           u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 epilogue) {
    static_assert(STAGES >= WG_X_SLOTS, "round r + 1's weights must be in the groups the X wait covers");
    extern __shared__ __align__(128) u8 wgmma_shared[];
    const WgmmaWarp w = wgmma_warp(n_tiles, k_groups, groups_per_split);
    const u32 lane = w.lane, warp = w.warp, split_begin = w.split_begin, rounds = w.rounds;
    // dynamic shared memory: the two operand slots, the staging slots, then the warps' weight
    // rings (wgmma_shared_bytes in src/target/facts.rs sizes it the same way)
    const u32 operand_base = cp_async_shared_address(wgmma_shared);
    const u32 stage_base = operand_base + 2 * WG_OPERAND_BYTES;
    u8* const stage_ptr = wgmma_shared + 2 * WG_OPERAND_BYTES;
    const auto ring = WgmmaRing<Weights, STAGES>::of(weights, wgmma_shared,
                                                     2 * WG_OPERAND_BYTES + WG_X_SLOTS * WG_STAGE_BYTES, w, k_groups);
    // round r's X into staging slot r % WG_X_SLOTS (16-byte pieces: row, 8 columns; columns past K
    // zero: the weights there are zero and stale shared memory could be NaN; rows past M not
    // copied: their products land in outputs nobody stores)
    auto copy_x = [&](u32 r) {
        if (r >= rounds) return;
        const u32 slot = stage_base + (r % WG_X_SLOTS) * WG_STAGE_BYTES;
        const u32 col0 = (split_begin + r) * 64;
        for (u32 piece = thread_x(); piece < m * 8; piece += WG_THREADS) {
            const u32 row = piece / 8, col = col0 + (piece % 8) * 8;
            const bool inside = col < k;
            cp_async16_zfill_shared(slot + row * WG_STAGE_ROW_BYTES + (piece % 8) * 16,
                                    inside ? x + (u64)row * k + col : x, inside ? 16u : 0u);
        }
    };
    ring.start();
    wait_for_previous_grid();
    allow_next_grid();
    // X of rounds 0 .. WG_X_SLOTS - 2, a group each (possibly empty): with the loop's groups,
    // round r + 1's X is always followed by exactly WG_X_SLOTS - 2 groups at round r's wait
    for (u32 r = 0; r + 1 < WG_X_SLOTS; ++r) {
        copy_x(r);
        cp_async_commit();
    }

    // staging slot of round r -> operand slot r % 2: item q of a warp is row group q % 8, half
    // q / 8 of the lane quad's 16 columns (words 0..3: step 2h + w / 2, core-matrix column w % 2)
    const u32 r8 = lane / 4, t = lane % 4;
    auto permute = [&](u32 r) {
        if (r >= rounds) return;
        const u8* src = stage_ptr + (r % WG_X_SLOTS) * WG_STAGE_BYTES;
        u8* dst = wgmma_shared + (r % 2) * WG_OPERAND_BYTES;
        for (u32 q = warp; q < 16; q += WG_THREADS / FP4_WARP_SIZE) {
            const u32 ng = q % 8, h = q / 8, row = ng * 8 + r8;
            if (row >= m) continue;
            wgmma_store_x_piece(dst, row, t, h, *reinterpret_cast<const u32x4*>(src + row * WG_STAGE_ROW_BYTES + 32 * t + 16 * h));
        }
    };
    cp_async_wait<WG_X_SLOTS - 2>();  // round 0's weights and X landed (this thread's copies) ...
    __syncthreads();                   // ... and everyone's
    permute(0);
    fence_proxy_async_shared();
    __syncthreads();

    float d[32];
    #pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    // round r: its A fragments out of the ring, its wgmma issued; while the tensor cores multiply,
    // the copies of round r + STAGES - 1's weights and round r + WG_X_SLOTS - 1's X into the
    // slots round r - 1 freed, the wait for round r + 1's copies and round r + 1's operand; then
    // the wait for the wgmma. Every warpgroup issues and waits for its wgmma unconditionally, and
    // each round's is retired within the round: ptxas 13.0 serialises every wgmma of the kernel
    // where one sits in a branch that depends on the warp (C7518: a quad past the weights) or
    // where a round's A fragments are written while the previous round's wgmma is in flight
    // (C7513, even with two sets of A registers). A warp past the last tile reads its ring's
    // unwritten slots: its products land in rows nobody stores.
    auto round = [&](u32 r) {
        wgmma_issue_group(weights, ring.slot(r), lane, operand_base + (r % 2) * WG_OPERAND_BYTES, d);
        ring.copy(r + STAGES - 1);
        copy_x(r + WG_X_SLOTS - 1);
        cp_async_commit();
        cp_async_wait<WG_X_SLOTS - 2>();  // round r + 1 landed (this thread's copies) ...
        __syncthreads();                   // ... and everyone's
        permute(r + 1);
        fence_proxy_async_shared();
        __syncthreads();  // round r + 1's operand complete
        wgmma_wait<0>();
    };
    for (u32 r = 0; r < rounds; ++r) round(r);
    cp_async_wait<0>();  // the empty groups past the end: nothing is left in flight
    if (w.active) wgmma_finish_tile(d, alpha, w.tile, lane, m, n, epilogue, residual, y, partials, counters);
}

// (threads, resident blocks per SM): caps the registers so that wgmma_blocks_per_sm blocks fit
#define WG_BOUNDS WG_THREADS, {{ target.gemm.wgmma_blocks_per_sm }}
// the same parameters as gemm_*_mma_m64 (warps_per_tile unused: a warpgroup owns a quad)
FP4_KERNEL void FP4_LAUNCH_BOUNDS(WG_BOUNDS) gemm_nvfp4_bf16_wgmma_m64(
    const u16* __restrict__ x, const u32x4* __restrict__ words, const u16* __restrict__ scales,
    float alpha, u16* y, const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    (void)warps_per_tile;
    gemm_wgmma<Nvfp4Weights, {{ target.gemm.wgmma_stages_nvfp4 }}>(x, Nvfp4Weights{words, scales}, alpha, y, residual,
        partials, counters, m, n, k, n_tiles, k_groups, groups_per_split, epilogue);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(WG_BOUNDS) gemm_bf16_bf16_wgmma_m64(
    const u16* __restrict__ x, const u32x4* __restrict__ words,
    float alpha, u16* y, const u16* residual, float* __restrict__ partials, u32* __restrict__ counters,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 groups_per_split, u32 warps_per_tile, u32 epilogue) {
    (void)warps_per_tile;
    gemm_wgmma<Bf16Weights, {{ target.gemm.wgmma_stages_bf16 }}>(x, Bf16Weights{words}, alpha, y, residual,
        partials, counters, m, n, k, n_tiles, k_groups, groups_per_split, epilogue);
}
{% endif %}
{% endif %}
{% if target.instructions.mma_block_scaled_fp4 %}
// ============================================================================================
// W4A4 on the block-scaled FP4 tensor cores (GB10): X is quantised to NVFP4 with the
// checkpoint's input_scale (quantize_nvfp4_rows), then gemm_nvfp4_nvfp4_mma_m* multiplies e2m1
// codes with their ue4m3 block scales in mma.sync m16n8k64 kind::mxf4nvf4 and applies
// alpha = input_scale * weight_scale_2 in the epilogue. CPU emulation of exactly this math:
// src/kernels/gemm/reference.rs (nvfp4_w4a4_f32).
//
// Fragment and scale layouts as read from the PTX ISA (m16n8k64 .e2m1: A registers 0/1 = rows
// g / g + 8 at K 8t .. 8t + 7, registers 2/3 the same at K 32 + 8t; B registers 0/1 = column g at
// K 8t / 32 + 8t; element i of a register at bits 4i; scale_vec::4X: one .b32 of four ue4m3 per
// row, selector {0, 0}: lane t = 0 of each quad supplies row g, t = 1 row g + 8). They have NOT
// been run: no GB10 is reachable from this project; tests/gpu/gemm.rs checks them on any device whose
// target has the instruction.
// ============================================================================================
#define QUANTIZE_THREADS 256

/// Four fp32 pairs -> eight e2m1 nibbles (element 2i in the low nibble of byte i), RNE, saturating.
FP4_DEVICE u32 f32x8_to_e2m1x8(const float (&v)[8]) {
    u32 packed;
    asm("{\n"
        ".reg .b8 b0, b1, b2, b3;\n"
        "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
        "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
        "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
        "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
        "mov.b32 %0, {b0, b1, b2, b3};\n"
        "}\n"
        : "=r"(packed)
        : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]));
    return packed;
}

/// fp32 -> e4m3 byte, RNE, saturating at 448: GB10's conversion instruction, where
/// common/nvfp4.cuh's f32_to_e4m3 is its portable twin (bit for bit) for the targets and the CPU
/// emulations without it.
FP4_DEVICE u32 f32_to_e4m3_cvt(float v) {
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(0.0f), "f"(v));
    return pair & 0xffu;
}

// One thread per 16-element block of X: block scale e4m3(amax / (6 * input_scale)) (zero -> 1.0),
// elements e2m1(x / (block_scale * input_scale)). Blocks are row-major over [M, K / 16], the
// layout of both outputs.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(QUANTIZE_THREADS) quantize_nvfp4_rows(
    const u16* __restrict__ x, float input_scale, u8* __restrict__ packed, u8* __restrict__ scales, u64 blocks) {
    chain_after_previous_grid();
    const u64 block = (u64)block_x() * QUANTIZE_THREADS + thread_x();
    if (block >= blocks) return;
    const u32x4 lo = load_u32x4(x + block * 16), hi = load_u32x4(x + block * 16 + 8);
    const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float v[16];
    float amax = 0.0f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[2 * i] = bf16_to_f32((u16)(words[i] & 0xffffu));
        v[2 * i + 1] = bf16_to_f32((u16)(words[i] >> 16));
        amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
    }
    u32 code = f32_to_e4m3_cvt(__fdiv_rn(amax, 6.0f * input_scale));
    if (e4m3_to_f32(code) == 0.0f) code = 0x38u;
    const float scale = e4m3_to_f32(code) * input_scale;
    float lower[8], upper[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        lower[i] = __fdiv_rn(v[i], scale);
        upper[i] = __fdiv_rn(v[8 + i], scale);
    }
    u32x2 out = {f32x8_to_e2m1x8(lower), f32x8_to_e2m1x8(upper)};
    *reinterpret_cast<uint2*>(packed + block * 8) = make_uint2(out.x, out.y);
    scales[block] = (u8)code;
}

FP4_DEVICE void mma_m16n8k64_nvfp4(float (&c)[4], const u32x4& a, u32 b0, u32 b1, u32 scale_a, u32 scale_b) {
    asm volatile(
        "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3 "
        "{ %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3}, %10, {0, 0}, %11, {0, 0};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1), "r"(scale_a), "r"(scale_b));
}

/// One warp per 16-row weight tile over all K (K % 64 == 0, checked on the host).
template <int MT>
FP4_DEVICE void gemm_w4a4(const u8* __restrict__ xq, const u8* __restrict__ xs, const u32x4* __restrict__ words,
                          const u32* __restrict__ w_scales, float alpha, u16* y, const u16* residual,
                          u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 epilogue) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 tile = block_x() * MMA_WARPS + thread_x() / FP4_WARP_SIZE;
    if (tile >= n_tiles) return;  // whole warps; nothing below synchronises the block
    const u32 g = lane / 4, t = lane % 4;
    float acc[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
    for (u32 group = 0; group < k_groups; ++group) {
        const u64 index = (u64)tile * k_groups + group;
        const u32x4 a = load_stream_u32x4(words + index * 32 + lane);
        const u32 scale_a = w_scales[index * 16 + g + 8 * (t & 1u)];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const u32 row = mt * 8 + g;
            u32 b0 = 0u, b1 = 0u, scale_b = 0x38383838u;
            if (row < m) {
                const u8* xr = xq + (u64)row * (k / 2) + group * 32;
                b0 = *reinterpret_cast<const u32*>(xr + 4 * t);
                b1 = *reinterpret_cast<const u32*>(xr + 16 + 4 * t);
                scale_b = *reinterpret_cast<const u32*>(xs + (u64)row * (k / 16) + group * 4);
            }
            mma_m16n8k64_nvfp4(acc[mt], a, b0, b1, scale_a, scale_b);
        }
    }
    store_tile<MT>(acc, alpha, tile, lane, m, n, epilogue, residual, y);
}

// Up to 32 rows per launch: at 64 ptxas 13.0 spills (the host runs larger M in chunks of 32).
{% for rows in [8, 16, 32] %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MMA_WARPS * FP4_WARP_SIZE) gemm_nvfp4_nvfp4_mma_m{{ rows }}(
    const u8* __restrict__ xq, const u8* __restrict__ xs, const u32x4* __restrict__ words,
    const u32* __restrict__ w_scales, float alpha, u16* y, const u16* residual,
    u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 epilogue) {
    chain_after_previous_grid();
    gemm_w4a4<{{ rows }} / 8>(xq, xs, words, w_scales, alpha, y, residual, m, n, k, n_tiles, k_groups, epilogue);
}
{% endfor %}
{% endif %}
{% if target.instructions.wmma_bf16 %}
// ============================================================================================
// gemm_{nvfp4,bf16}_bf16_wmma_m{16,32,64}: the tensor-core kernels for RDNA 3.5 (gfx1151),
// Y^T = W X^T on v_wmma_f32_16x16x16_bf16 (wave32). One wave per 16-row weight tile, all of K.
// Operand layout of the instruction: lane l and lane l + 16 both hold A row l % 16 and B column
// l % 16 (all 16 K values, in order); D holds row 2v + l / 16, column l % 16 in element v.
// Weights come as in src/kernels/gemm/layout.rs (Wmma*Fragments): per (tile, 64-wide K group,
// tile row) the row's 64 values contiguous (NVFP4: 32 bytes of nibbles + one u32 of its four
// e4m3 block scales; bf16: 128 bytes). One WMMA is one NVFP4 block, decoded exactly in f32
// (e2m1 * e4m3 has <= 6 significant bits, so its bf16 is exact) before the product.
// Compiled and checked here; not run (no AMD GPU is reachable from this project).
// ============================================================================================
#define WMMA_WAVES {{ target.gemm.mma_warps_per_block }}
{% include "common/wmma.cuh" %}

template <class Weights, int MT>
FP4_DEVICE void gemm_wmma(const u16* __restrict__ x, Weights weights, float alpha, u16* y, const u16* residual,
                          u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 epilogue) {
    const u32 lane = lane_index();
    const u32 tile = block_x() * WMMA_WAVES + thread_x() / FP4_WARP_SIZE;
    if (tile >= n_tiles) return;  // whole waves; nothing below synchronises the block
    const u32 r = lane % 16, h = lane / 16;
    v8f acc[MT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int v = 0; v < 8; ++v) acc[mt][v] = 0.0f;
    for (u32 group = 0; group < k_groups; ++group) {
        const u64 index = ((u64)tile * k_groups + group) * 16 + r;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 col = group * 64 + 16 * j;
            if (col >= k) break;  // uniform: K is a multiple of 16
            const v16s a = weights.block(index, j);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32 row = mt * 16 + r;
                const v16s b = load_bf16x16(x + (u64)row * k + col, row < m);
                acc[mt] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, acc[mt]);
            }
        }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const u32 row = mt * 16 + r;
        if (row >= m) continue;
        if (epilogue == EPILOGUE_SILU_MUL) {
            // tile rows 0..7 are gate rows 8 * tile + i, 8..15 the matching up rows; this lane
            // holds tile rows 2v + h, so gate i = 2v + h (v < 4) pairs with element v + 4
            #pragma unroll
            for (int v = 0; v < 4; ++v) {
                const u32 col = tile * 8 + 2 * v + h;
                if (col < n) y[(u64)row * n + col] = f32_to_bf16(silu(acc[mt][v] * alpha) * (acc[mt][v + 4] * alpha));
            }
        } else {
            #pragma unroll
            for (int v = 0; v < 8; ++v) {
                const u32 col = tile * 16 + 2 * v + h;
                if (col >= n) continue;
                float value = acc[mt][v] * alpha;
                const u64 at = (u64)row * n + col;
                if (epilogue == EPILOGUE_RESIDUAL) value += bf16_to_f32(residual[at]);
                y[at] = f32_to_bf16(value);
            }
        }
    }
}

{% for rows in [16, 32, 64] %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(WMMA_WAVES * FP4_WARP_SIZE) gemm_nvfp4_bf16_wmma_m{{ rows }}(
    const u16* __restrict__ x, const u32x4* __restrict__ words, const u32* __restrict__ scales, float alpha,
    u16* y, const u16* residual, u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 epilogue) {
    chain_after_previous_grid();
    gemm_wmma<WmmaNvfp4Weights, {{ rows }} / 16>(x, WmmaNvfp4Weights{words, scales}, alpha, y, residual, m, n, k, n_tiles, k_groups, epilogue);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(WMMA_WAVES * FP4_WARP_SIZE) gemm_bf16_bf16_wmma_m{{ rows }}(
    const u16* __restrict__ x, const u16* __restrict__ words, float alpha,
    u16* y, const u16* residual, u32 m, u32 n, u32 k, u32 n_tiles, u32 k_groups, u32 epilogue) {
    chain_after_previous_grid();
    gemm_wmma<WmmaBf16Weights, {{ rows }} / 16>(x, WmmaBf16Weights{words}, alpha, y, residual, m, n, k, n_tiles, k_groups, epilogue);
}
{% endfor %}
{% endif %}
