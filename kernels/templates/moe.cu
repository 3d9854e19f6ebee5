// Family `moe`: the sparse mixture-of-experts block of Qwen3.5-MoE in ONE persistent launch
// (rendered for {{ target.name }}): router logits, fp32 softmax / top-k / renormalisation /
// shared-expert gate, alignment of the (token, expert) slots by expert, the grouped gate_up GEMM
// with silu(gate) * up fused, the grouped down GEMM, and the weighted combine over the k experts
// plus the shared expert (plus an optional residual), bf16 out. For small T the same items run
// as three launches (route, gate_up, down), and from moe.stream_min_tokens the down launch
// streams whole tiles per warp with a combine launch of its own (the sections below).
// CPU reference: src/kernels/moe/reference.rs. Launch: src/kernels/moe/mod.rs; weight layouts:
// src/kernels/moe/weights.rs.
//
// The persistent form (one launch; above moe.split_max_tokens, where the three launches'
// boundaries weigh little): the block is a list of work items, claimed in order from a counter in global memory by a grid of resident-sized
// blocks, that hand results to each other through counters:
//   1. router       (router tile group, token chunk): logits[T][E + 1] in fp32 (row E is the
//                   shared-expert gate) as ROUTER_PLANES planes of partial sums over K, summed in
//                   plane order where they are read; the last router item of a chunk routes its
//                   tokens (softmax, top-k, renormalisation, sigmoid of the gate; a warp per token), the
//                   last chunk to be routed aligns every slot by expert, then raises
//                   routing_ready
//   2. shared gate_up  (sub-expert, tile group, token chunk): needs only X
//   then, laid out by the routing (a block that claims one first waits for routing_ready):
//   3. routed gate_up  (active expert rank, tile group)
//   4. shared down     (sub-expert, tile group, token chunk): waits for its gate_up
//   5. routed down     (active expert rank, tile group): issues its weight loads first, then
//                   waits for its expert's gate_up; the last down item of a group of hidden rows
//                   combines those rows for every token.
// A block only ever waits for lower-numbered items, and items are claimed in order, so the
// lowest unfinished item can always proceed: no deadlock, whatever number of blocks is resident.
// Experts nobody chose have no items at all. Every active expert's weights are read once from
// DRAM per launch (an expert with more than ROWS tokens re-reads its tiles from L2 per pass).
//
// Positions: the shared expert (Is columns) runs as S = ceil(Is / I) sub-experts of I columns
// (zero-padded), weight index E + c, positions c * T + t; routed expert slots follow from S * T,
// grouped by expert in rank order. act[position][I] is silu(gate) * up rounded to bf16 (as the
// GEMM family's epilogue), partial[position][H] the expert's down output in fp32; the combine
// adds partials in slot order (deterministic).
//
// Weights: the layouts of src/kernels/gemm/layout.rs, experts concatenated
// ([E + S][tiles][K groups]...), gate_up in RowOrder::GateUp; alphas per expert (gate rows, up
// rows, down) carry the per-tensor scales (NVFP4 fragments on mma.sync: global * 2^7; WMMA
// fragments: global; bf16: 1).
{% include "common/prelude.cuh" %}
{% include "common/nvfp4.cuh" %}
{% include "common/activations.cuh" %}
{% include "common/sync.cuh" %}

#define MOE_WARPS {{ target.moe.warps_per_block }}
#define MOE_THREADS (MOE_WARPS * FP4_WARP_SIZE)
#define MOE_MAX_EXPERTS {{ target.moe.max_experts }}
#define MOE_EXPERTS_PER_LANE (MOE_MAX_EXPERTS / FP4_WARP_SIZE)
static_assert((MOE_EXPERTS_PER_LANE & (MOE_EXPERTS_PER_LANE - 1)) == 0, "route_tokens' arg-max tree: a power of two of experts per lane");
// the routing loads the logits of this many experts per lane at once (route_tokens)
#define ROUTE_BATCH 8
// combine() loads the positions, weights and partials of this many slots at once
#define COMBINE_BATCH 8
// warps sharing one 16-row router tile (they split its K groups); tiles per item = the rest. The
// experts' gate_up and down tiles take theirs from the launch (MoeArgs), so the split launches can
// spread a small batch's tiles over more warps.
#define ROUTER_WARPS_PER_TILE {{ target.moe.router_warps_per_tile }}
// the router's K groups in this many planes of partial logits, summed in plane order by the
// routing (the split route launch gives each plane its own blocks; the persistent launch computes
// them one after another, so both round the logits the same way)
#define ROUTER_PLANES {{ target.moe.router_planes }}
#define ROUTER_TILES_PER_ITEM (MOE_WARPS / ROUTER_WARPS_PER_TILE)
#define TILE_ROWS 16
#define GROUP_COLS 64
// the split gate_up / down items load X through L1 (moe.split_x_through_l1; tile_product)
#define MOE_SPLIT_X_L1 {{ target.moe.split_x_through_l1 }}
{% if target.vendor == "nvidia" %}
// __launch_bounds__(threads, blocks per SM): the grid is sized for that many resident blocks
#define MOE_BOUNDS MOE_THREADS, {{ target.moe.blocks_per_sm }}
// the split launches' expert kernels: more resident blocks (fewer registers), so that a decode
// step's items fit in one wave
#define MOE_SPLIT_BOUNDS MOE_THREADS, {{ target.moe.split_blocks_per_sm }}
// the bulk kernels: as many resident blocks as their shared-memory rings allow
#define MOE_BULK_BOUNDS MOE_THREADS, {{ target.moe.bulk_blocks_per_sm }}
{% else %}
#define MOE_BOUNDS MOE_THREADS
#define MOE_SPLIT_BOUNDS MOE_THREADS
{% endif %}

// Counters in `control`, zero between launches: arrival counters rearm themselves (the block that
// completes one zeroes it), the persistent launch's last block resets the rest.
#define CONTROL_NEXT_ITEM 0u
#define CONTROL_ROUTER_DONE 1u
#define CONTROL_ROUTING_READY 2u
#define CONTROL_BLOCKS_DONE 3u
#define CONTROL_GATE_UP_DONE 4u  // [E + S]: finished gate_up items per rank (sub-experts first)
// then [down groups]: finished down items per group of (down tiles per item) * 16 hidden rows,
// then [chunks]: finished router items per token chunk

/// Everything one launch needs: the kernels' parameters (MOE_PARAMETERS), gathered.
struct MoeArgs {
    const u16* x;             // [T][H] bf16
    const u16* residual;      // [T][H] bf16, or null
    u16* y;                   // [T][H] bf16
    const void* router;       // [E + g][H] router rows (+ the shared gate row), bf16 fragments
    const void* gate_up;      // [E + S] experts' [2I][H] in RowOrder::GateUp, fragments
    const void* gate_up_scales;  // NVFP4 block scales of gate_up (null for bf16)
    const void* down;         // [E + S] experts' [H][I], fragments
    const void* down_scales;  // NVFP4 block scales of down (null for bf16)
    const float* gate_up_alpha;  // [E + S][2]: multiplier of the gate rows, of the up rows
    const float* down_alpha;  // [E + S]
    u32* control;             // counters, see CONTROL_*
    u32* topk_ids;            // [T][k] chosen experts, most probable first
    u32* slot_pos;            // [T][k] position of each slot
    u32* sorted_token;        // [positions] token of each routed position
    u32* active_expert;       // [E] expert id of each active rank (ascending ids)
    u32* active_offset;       // [E] first position of each active rank
    u32* active_count;        // [E] tokens of each active rank
    u32* n_active;            // [1] active experts
    float* logits;            // [ROUTER_PLANES][T][E + 1] partial logits
    float* route_weight;      // [T][k] renormalised probabilities
    float* shared_scale;      // [T] sigmoid(shared gate), 1 without a gate
    float* partial;           // [positions][H] fp32 down outputs
    u16* act;                 // [positions][I] bf16 silu(gate) * up
    u32 tokens;               // T (> 0)
    u32 experts;              // E (<= MOE_MAX_EXPERTS)
    u32 top_k;                // k (<= warp size, <= E)
    u32 hidden;               // H (multiple of 16)
    u32 inter;                // I (multiple of 16)
    u32 shared_experts;       // S
    u32 has_shared_gate;      // 1 when router row E is the shared expert's gate
    u32 gate_up_warps_per_tile;  // warps splitting a gate_up tile's K groups (power of two <= MOE_WARPS)
    u32 down_warps_per_tile;     // the same for a down tile
    const u8* prefetch;          // bytes the route launch asks the L2 for (the next layer's
    u32 prefetch_bytes;          // first dense weights), a multiple of 16; 0: none
};

// The kernels' parameters: MoeArgs's fields one by one, in order (src/kernels/moe/mod.rs passes
// them in this order; separate parameters, so each launch is checked argument by argument).
#define MOE_PARAMETERS                                                                              \
    const u16* x, const u16* residual, u16* y, const void* router, const void* gate_up,           \
        const void* gate_up_scales, const void* down, const void* down_scales,                     \
        const float* gate_up_alpha, const float* down_alpha, u32* control, u32* topk_ids,          \
        u32* slot_pos, u32* sorted_token, u32* active_expert, u32* active_offset,                  \
        u32* active_count, u32* n_active, float* logits, float* route_weight, float* shared_scale, \
        float* partial, u16* act, u32 tokens, u32 experts, u32 top_k, u32 hidden, u32 inter,      \
        u32 shared_experts, u32 has_shared_gate, u32 gate_up_warps_per_tile, u32 down_warps_per_tile, \
        const u8* prefetch, u32 prefetch_bytes
#define MOE_ARGUMENTS                                                                               \
    MoeArgs{x, residual, y, router, gate_up, gate_up_scales, down, down_scales, gate_up_alpha,     \
            down_alpha, control, topk_ids, slot_pos, sorted_token, active_expert, active_offset,   \
            active_count, n_active, logits, route_weight, shared_scale, partial, act, tokens,      \
            experts, top_k, hidden, inter, shared_experts, has_shared_gate, gate_up_warps_per_tile, \
            down_warps_per_tile, prefetch, prefetch_bytes}

/// Item counts of one launch, derived from the sizes (the host only sizes the grid).
struct Plan {
    u32 chunks;          // token chunks of ROWS (shared-expert and router items)
    u32 router_tiles, router_groups;
    u32 router_plane_groups;  // K groups per router plane (the last plane may hold fewer, or none)
    u32 gate_up_tiles, gate_up_groups, gate_up_tiles_per_item;
    u32 down_tiles, down_groups, down_tiles_per_item;
    u32 hidden_k_groups, inter_k_groups;
    u32 end_router, end_shared_gate_up;  // the items before the routing is known
    u32 shared_down_items;
};

FP4_DEVICE u32 div_up(u32 a, u32 b) { return (a + b - 1) / b; }

template <int ROWS>
FP4_DEVICE Plan make_plan(const MoeArgs& a) {
    Plan p;
    p.chunks = div_up(a.tokens, ROWS);
    p.router_tiles = div_up(a.experts + a.has_shared_gate, TILE_ROWS);
    p.router_groups = div_up(p.router_tiles, ROUTER_TILES_PER_ITEM);
    p.gate_up_tiles = div_up(a.inter, TILE_ROWS / 2);  // RowOrder::GateUp: 8 gate + 8 up rows
    p.gate_up_tiles_per_item = MOE_WARPS / a.gate_up_warps_per_tile;
    p.gate_up_groups = div_up(p.gate_up_tiles, p.gate_up_tiles_per_item);
    p.down_tiles = div_up(a.hidden, TILE_ROWS);
    p.down_tiles_per_item = MOE_WARPS / a.down_warps_per_tile;
    p.down_groups = div_up(p.down_tiles, p.down_tiles_per_item);
    p.hidden_k_groups = div_up(a.hidden, GROUP_COLS);
    p.router_plane_groups = div_up(p.hidden_k_groups, ROUTER_PLANES);
    p.inter_k_groups = div_up(a.inter, GROUP_COLS);
    p.end_router = p.router_groups * p.chunks;
    p.end_shared_gate_up = p.end_router + a.shared_experts * p.gate_up_groups * p.chunks;
    p.shared_down_items = a.shared_experts * p.down_groups * p.chunks;
    return p;
}

{% if target.instructions.mma_sync_bf16 %}
// ============================================================================================
// Tile products on mma.sync m16n8k16 (as gemm.cu's gemm_mma): the weight tile is the A operand,
// the tokens the B operand, 8 per n8 tile, so a pass of ROWS tokens costs ROWS / 8 MMAs per
// weight fragment and n8 tiles past the pass's rows are skipped.
// ============================================================================================
{% include "common/mma.cuh" %}
typedef Bf16Weights RouterWeights;
typedef Nvfp4Weights ExpertNvfp4;
typedef Bf16Weights ExpertBf16;
/// The weight accessor over fragment arrays `words` (and NVFP4 block `scales`).
template <class W> FP4_DEVICE W weights_at(const void* words, const void* scales);
template <> FP4_DEVICE Nvfp4Weights weights_at<Nvfp4Weights>(const void* words, const void* scales) {
    return {static_cast<const u32x4*>(words), static_cast<const u16*>(scales)};
}
template <> FP4_DEVICE Bf16Weights weights_at<Bf16Weights>(const void* words, const void*) {
    return {static_cast<const u32x4*>(words)};
}

/// One lane's share of a 16-row weight tile x ROWS tokens: C registers of n8 tile mt at
/// v[4 mt .. 4 mt + 3] (rows g, g / g + 8 of the tile; tokens 8 mt + 2t, + 1).
template <int ROWS>
struct TileAcc {
    static constexpr int MT = ROWS / 8;
    static constexpr int FLOATS = MT * 4;
    /// Token rows of the pass this lane loads X for: x_row(i) for i < X_ROWS.
    static constexpr int X_ROWS = MT;
    float v[FLOATS];
    FP4_DEVICE static u32 x_row(int i, u32 lane) { return i * 8 + lane / 4; }
    /// f(token row of the pass, tile row r in 0..8, value of tile row r, value of tile row r + 8)
    template <class F>
    FP4_DEVICE void for_each_pair(u32 lane, F f) const {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int half = 0; half < 2; ++half)
                f(mt * 8 + 2 * (lane % 4) + half, lane / 4, v[mt * 4 + half], v[mt * 4 + 2 + half]);
        }
    }
};

/// This lane's X fragment (the MMA's B operand) of one K group of token row `row`: its 16
/// columns from `col`, zeros without a row (null) or past K; through L1 or from the L2 (see
/// tile_product's x_through_l1).
FP4_DEVICE void load_x_fragment(const u16* row, u32 col, u32 k, bool through_l1, u32x4 (&xs)[2]) {
    if (row != nullptr && col < k && through_l1) {
        xs[0] = load_u32x4(row + col);
        xs[1] = load_u32x4(row + col + 8);
    } else if (row != nullptr && col < k) {
        xs[0] = load_coherent_u32x4(row + col);
        xs[1] = load_coherent_u32x4(row + col + 8);
    } else {
        xs[0] = xs[1] = {0u, 0u, 0u, 0u};
    }
}

/// This warp's partial product of weight tile `tile` (of a [tiles][k_groups][32] fragment array)
/// with up to ROWS token rows, over the K groups first, first + step, ... < end. x_rows[i] is the
/// bf16 row of token row TileAcc::x_row(i) (null past the pass). The weight loads of the first
/// STAGES groups are issued, and the warp's later groups asked of the L2, before the X rows are
/// waited for: with `wait_counter`, until `*wait_counter >= wait_target` (X produced by other
/// blocks of the launch; a block barrier, so every warp of the block must call it); with
/// `wait_grid`, until the previous kernel has finished (X produced by it: see
/// chain_after_previous_grid, which the caller has not called). X_FIRST: the X fragments of the
/// ring's first STAGES groups are all loaded right after that wait, before any is used (the
/// router, whose warps have two groups each and their weights in registers before the wait: its
/// loads made two L2 round trips one after the other, SASS of moe_route_m8); elsewhere each
/// group's X is loaded at the group (registers for six groups' X are not there). x_through_l1:
/// X was written by an earlier launch and is read only after this block's wait for it (see
/// load_coherent_u32x4), so it may come through L1, where the block's other tiles of the same
/// rows find it; otherwise from the L2 (another block of this launch may have written it).
template <class W, int ROWS, int STAGES, bool X_FIRST = false>
FP4_DEVICE void tile_product(const W& w, u64 tile, u32 k_groups, u32 first, u32 step, u32 end, u32 k,
                             const u16* const (&x_rows)[TileAcc<ROWS>::X_ROWS], u32 rows,
                             const u32* wait_counter, u32 wait_target, bool wait_grid, bool x_through_l1,
                             TileAcc<ROWS>& acc) {
    constexpr int MT = ROWS / 8;
    const u32 lane = lane_index(), t = lane % 4;
    float c[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) c[mt][0] = c[mt][1] = c[mt][2] = c[mt][3] = 0.0f;
    // lane indices fit 32 bits (the host checks the weights hold under 2^32 of them)
    const u32 tile_base = (u32)tile * k_groups * 32 + lane;
    typename W::Group ring[STAGES];
    #pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        const u32 group = first + s * step;
        if (group < end) ring[s] = w.load(tile_base + group * 32);
    }
    // the groups past the ring (and the other parts' between them) at once into the L2: the ring's
    // reloads then wait for the L2, not for DRAM (a warp's groups are otherwise 2-3 DRAM round
    // trips one after another, the whole cost of an expert item at decode sizes)
    const u32 rest = first + STAGES * step;
    if (lane == 0 && rest < end) w.prefetch(tile_base + rest * 32, (end - rest) * 32);
    if (wait_counter) block_wait_at_least(wait_counter, wait_target, "the gate_up items of an expert");
    if (wait_grid) chain_after_previous_grid();
    const u32 m_tiles = (rows + 7) / 8;
    // this lane's X fragments of K group `group` (zeros past the pass's rows and past K)
    auto load_x = [&](u32 group, u32x4 (&xs)[MT][2]) {
        const u32 col = group * GROUP_COLS + 16 * t;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_x_fragment(x_rows[mt], col, k, x_through_l1, xs[mt]);
    };
    u32x4 x_first[X_FIRST ? STAGES : 1][MT][2];
    if constexpr (X_FIRST) {
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) load_x(first + s * step, x_first[s]);
    }
    for (u32 base = first; base < end; base += STAGES * step) {
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            const u32 group = base + s * step;
            if (group < end) {
                u32x4 xs[MT][2];
                if (X_FIRST && base == first) {
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) xs[mt][0] = x_first[s][mt][0], xs[mt][1] = x_first[s][mt][1];
                } else {
                    load_x(group, xs);
                }
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 a[4];
                    w.fragment(ring[s], j, a);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        if (mt < m_tiles) {  // warp-uniform
                            const u32x4& q = xs[mt][j / 2];
                            mma_m16n8k16_bf16(c[mt], a[0], a[1], a[2], a[3], (j % 2 == 0) ? q.x : q.z,
                                              (j % 2 == 0) ? q.y : q.w);
                        }
                    }
                }
                const u32 next = group + STAGES * step;
                if (next < end) ring[s] = w.load(tile_base + next * 32);
            }
        }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc.v[mt * 4 + i] = c[mt][i];
}
{% elif target.instructions.wmma_bf16 %}
// ============================================================================================
// Tile products on v_wmma_f32_16x16x16_bf16 (as gemm.cu's gemm_wmma): the weight tile is the A
// operand, 16 tokens the B operand; a WMMA is one NVFP4 block, decoded exactly in f32. No weight
// ring (compiled and checked here, never run: no AMD GPU is reachable from this project).
// ============================================================================================
{% include "common/wmma.cuh" %}
typedef WmmaBf16Weights RouterWeights;
typedef WmmaNvfp4Weights ExpertNvfp4;
typedef WmmaBf16Weights ExpertBf16;
template <class W> FP4_DEVICE W weights_at(const void* words, const void* scales);
template <> FP4_DEVICE WmmaNvfp4Weights weights_at<WmmaNvfp4Weights>(const void* words, const void* scales) {
    return {static_cast<const u32x4*>(words), static_cast<const u32*>(scales)};
}
template <> FP4_DEVICE WmmaBf16Weights weights_at<WmmaBf16Weights>(const void* words, const void*) {
    return {static_cast<const u16*>(words)};
}

/// One lane's share of a 16-row weight tile x ROWS tokens: D element e of token tile mt at
/// v[8 mt + e] (tile row 2 (e % 4) + lane / 16 (+ 8 for e >= 4), token 16 mt + lane % 16).
template <int ROWS>
struct TileAcc {
    static constexpr int MT = (ROWS + 15) / 16;
    static constexpr int FLOATS = MT * 8;
    static constexpr int X_ROWS = MT;
    float v[FLOATS];
    FP4_DEVICE static u32 x_row(int i, u32 lane) { return i * 16 + lane % 16; }
    template <class F>
    FP4_DEVICE void for_each_pair(u32 lane, F f) const {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) f(mt * 16 + lane % 16, 2 * e + lane / 16, v[mt * 8 + e], v[mt * 8 + e + 4]);
        }
    }
};

/// As the NVIDIA version: this wave's partial product of weight tile `tile` (of a
/// [tiles][k_groups][16 rows] fragment array) with up to ROWS token rows. X_FIRST is the NVIDIA
/// version's (the router's); here X is read per WMMA, with no weight ring ahead of it, and
/// through the one cache path there is (x_through_l1 changes nothing).
template <class W, int ROWS, int STAGES, bool X_FIRST = false>
FP4_DEVICE void tile_product(const W& w, u64 tile, u32 k_groups, u32 first, u32 step, u32 end, u32 k,
                             const u16* const (&x_rows)[TileAcc<ROWS>::X_ROWS], u32 rows,
                             const u32* wait_counter, u32 wait_target, bool wait_grid, bool /*x_through_l1*/,
                             TileAcc<ROWS>& acc) {
    constexpr int MT = (ROWS + 15) / 16;
    const u32 lane = lane_index(), r = lane % 16;
    v8f sums[MT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int e = 0; e < 8; ++e) sums[mt][e] = 0.0f;
    if (wait_counter) block_wait_at_least(wait_counter, wait_target, "the gate_up items of an expert");
    if (wait_grid) chain_after_previous_grid();
    const u32 m_tiles = (rows + 15) / 16;
    for (u32 group = first; group < end; group += step) {
        const u64 index = (tile * k_groups + group) * 16 + r;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 col = group * GROUP_COLS + 16 * j;
            if (col >= k) break;  // uniform: K is a multiple of 16
            const v16s a = w.block(index, j);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (mt < m_tiles) {  // wave-uniform
                    const bool valid = x_rows[mt] != nullptr;
                    const v16s b = load_bf16x16(valid ? x_rows[mt] + col : x_rows[mt], valid);
                    sums[mt] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, sums[mt]);
                }
            }
        }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int e = 0; e < 8; ++e) acc.v[mt * 8 + e] = sums[mt][e];
}
{% endif %}

// ============================================================================================
// The block, written once for every target on top of TileAcc / tile_product.
// ============================================================================================

/// One expert GEMM, gate_up or down: which weights, which rows, and what it waits for.
struct ExpertJob {
    bool gate_up;            // gate_up (X = x rows, out act) or down (X = act rows, out partial)
    u32 expert;              // weight index: a routed expert id, or E + c for shared sub-expert c
    u32 group;               // tile group
    u32 position0;           // position of row 0
    u32 r_begin, r_end;      // rows of this item, in passes of ROWS
    bool gathered;           // gate_up: the token of row r is sorted_token[position0 + r] (else r)
    const u32* wait_counter; // down: weights in flight, then wait for *wait_counter >= wait_target
    u32 wait_target;
    bool wait_grid;          // split down: weights in flight, then wait for the gate_up launch
    bool x_through_l1;       // X from an earlier launch, read after the wait: through L1 (tile_product)
};

/// Block-shared scratch: the cross-warp sums of a tile, or the routing tables (never both live).
template <int ROWS>
struct MoeShared {
    union {
        float part_sums[MOE_WARPS][TileAcc<ROWS>::FLOATS][FP4_WARP_SIZE];
        struct {
            u32 count[MOE_MAX_EXPERTS];   // slots per expert
            u32 offset[MOE_MAX_EXPERTS];  // first position per expert
            u32 fill[MOE_MAX_EXPERTS];    // positions handed out per expert
            u32 scan[MOE_WARPS];          // align_by_scan: each warp's total
            u64 top_k[MOE_WARPS][2][FP4_WARP_SIZE];  // per routing warp: candidates, then choices
        } route;
    };
    ExpertJob job;  // the expert item the block works on
    u32 item;       // the item the block works on (thread 0 claims it)
    u32 flag;       // block_arrive's answer
};

/// Adds the partial sums of a tile's `parts` warps into its first warp (in warp order, so the
/// result does not depend on timing). Every warp of the block must call it.
template <int ROWS>
FP4_DEVICE void reduce_parts(TileAcc<ROWS>& acc, u32 warp, u32 part, u32 parts, MoeShared<ROWS>& sh) {
    if (parts == 1) return;
    const u32 lane = lane_index();
    if (part > 0) {
        #pragma unroll
        for (int i = 0; i < TileAcc<ROWS>::FLOATS; ++i) sh.part_sums[warp][i][lane] = acc.v[i];
    }
    block_barrier();
    if (part == 0) {
        for (u32 w = warp + 1; w < warp + parts; ++w) {
            #pragma unroll
            for (int i = 0; i < TileAcc<ROWS>::FLOATS; ++i) acc.v[i] += sh.part_sums[w][i][lane];
        }
    }
    block_barrier();
}

/// An unsigned key ordered as the float `v` (not NaN; -0 keyed as +0, so equal values have equal
/// keys), above 0 for every value: 0 stands for "no candidate".
FP4_DEVICE u32 order_key(float v) {
    const u32 bits = v == 0.0f ? 0u : f32_to_bits(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
FP4_DEVICE float from_order_key(u32 key) { return bits_to_f32((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key); }

/// Whether the routing warp aligns the slots itself (align_one_token): one token, whose k choices
/// are its lanes.
FP4_DEVICE bool aligns_in_routing_warp(const MoeArgs& a) { return a.tokens == 1u && a.top_k <= FP4_WARP_SIZE; }

/// align() for one token (the decode of one sequence), by the warp that routed it, lane j holding
/// choice j (`expert`): the k experts are distinct, so each is a group of one slot at rank =
/// the number of chosen experts with lower ids, found with k shuffles. align_slots took two
/// block barriers and two passes over shared memory for it (H200, clock64: 1,490-1,720 cycles of
/// the route launch's chain at T = 1, nineteenth session).
FP4_DEVICE void align_one_token(const MoeArgs& a, u32 expert) {
    const u32 lane = lane_index(), k = a.top_k;
    u32 rank = 0u;
    for (u32 l = 0; l < k; ++l) rank += shuffle_from(expert, l) < expert ? 1u : 0u;
    if (lane < k) {
        const u32 position = a.shared_experts + rank;  // after the shared sub-experts' positions
        a.active_expert[rank] = expert;
        a.active_offset[rank] = position;
        a.active_count[rank] = 1u;
        a.sorted_token[position] = 0u;
        a.slot_pos[lane] = position;
    }
    if (lane == 0) *a.n_active = k;
}

/// The largest of a lane's keys (a tree of maxima: the slots are independent of each other).
FP4_DEVICE u32 lane_largest_key(const u32 (&keys)[MOE_EXPERTS_PER_LANE]) {
    u32 level[MOE_EXPERTS_PER_LANE];
    #pragma unroll
    for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) level[i] = keys[i];
    #pragma unroll
    for (int stride = 1; stride < MOE_EXPERTS_PER_LANE; stride *= 2)
        #pragma unroll
        for (int i = 0; i < MOE_EXPERTS_PER_LANE; i += 2 * stride) level[i] = max_u32(level[i], level[i + stride]);
    return level[0];
}

/// route_tokens' top-k when few experts can be among it, as at every real router's decode: the
/// k-th largest of the lanes' largest keys is a floor that every chosen expert reaches (k distinct
/// experts reach it), so only the experts at or above it (the candidates, usually k to a dozen
/// more) are ranked, each against the others by (key, lower id first) as one 64-bit code, and the
/// expert of rank j goes to lane j. That is a fixed chain of about 50 shuffles and a short shared-
/// memory loop, where the k rounds of route_tokens are k chains of two warp reductions and two
/// trees over the lane's keys each. `scratch`: the warp's 2 x 32 codes of shared memory. Returns
/// false, choosing nothing, when more than a warp of experts reach the floor (ties at it, e.g. a
/// router whose logits are mostly equal): the caller then runs the rounds.
FP4_DEVICE bool top_k_above_floor(const u32 (&keys)[MOE_EXPERTS_PER_LANE], u32 k, u64* scratch, u32& mine,
                                  u32& mine_key, u32& first_key) {
    const u32 lane = lane_index();
    const u32 lane_top = lane_largest_key(keys);
    // the lanes whose largest key fewer than k lanes' exceed hold the k largest of them
    u32 above = 0u;
    #pragma unroll
    for (u32 l = 0; l < FP4_WARP_SIZE; ++l) above += shuffle_from(lane_top, l) > lane_top ? 1u : 0u;
    const u32 floor = warp_min_u32(above < k ? lane_top : 0xffffffffu);
    u32 count = 0u;
    #pragma unroll
    for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) count += keys[i] >= floor ? 1u : 0u;
    const u32 through = warp_inclusive_sum(count);  // candidates of the lanes up to this one
    const u32 total = shuffle_from(through, FP4_WARP_SIZE - 1);
    if (total > FP4_WARP_SIZE) return false;  // uniform
    u64* const candidates = scratch;
    u64* const chosen = scratch + FP4_WARP_SIZE;
    u32 at = through - count;
    #pragma unroll
    for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i)
        if (keys[i] >= floor) candidates[at++] = (u64)keys[i] << 32 | (u64)~(i * FP4_WARP_SIZE + lane);
    warp_barrier();
    // codes are distinct (so are the ids): the ranks are 0 .. total - 1 once each
    const u64 code = lane < total ? candidates[lane] : 0ull;
    u32 rank = 0u;
    for (u32 c = 0; c < total; ++c) rank += candidates[c] > code ? 1u : 0u;
    if (lane < total && rank < k) chosen[rank] = code;
    warp_barrier();  // the next call writes `chosen` only after its own first barrier
    const u64 pick = chosen[lane < k ? lane : 0u];
    first_key = (u32)(chosen[0] >> 32);
    mine = lane < k ? ~(u32)pick : 0u;
    mine_key = lane < k ? (u32)(pick >> 32) : 0u;
    return true;
}

/// Routing of tokens t0 .. t1 (one warp per token), by the block that finished the router
/// items of their chunk last: top-k ids, renormalised weights, the shared expert's scale; the
/// ids also to shared_ids[t * k + j] where that is not null. `top_k_scratch`: MOE_WARPS x 64
/// codes of shared memory (MoeShared::route.top_k).
FP4_DEVICE void route_tokens(const MoeArgs& a, u32 t0, u32 t1, u32* shared_ids, u64* top_k_scratch) {
    const u32 E = a.experts, k = a.top_k, stride = E + 1;
    const u32 lane = lane_index(), warp = thread_x() / FP4_WARP_SIZE;
    const float minus_infinity = bits_to_f32(0xff800000u);
    const u64 plane = (u64)a.tokens * stride;  // floats per plane of partial logits
    for (u32 t = t0 + warp; t < t1; t += MOE_WARPS) {
        const float* row = a.logits + (u64)t * stride;
        // The planes of the shared gate's logit (row E) and of the lane's experts, requested
        // together, ROUTE_BATCH experts per lane at a time, before any is summed: coherent loads
        // are volatile, never speculated, so a load behind `e < E` waited for the sums of the
        // expert before it (one L2 round trip per expert of the lane, nine at E = 256 with the
        // gate; now one). Lanes past E read row E again and drop it.
        float gate_planes[ROUTER_PLANES];
        #pragma unroll
        for (int q = 0; q < ROUTER_PLANES; ++q) gate_planes[q] = load_coherent_f32(row + q * plane + E);
        float l[MOE_EXPERTS_PER_LANE];
        #pragma unroll
        for (int i0 = 0; i0 < MOE_EXPERTS_PER_LANE; i0 += ROUTE_BATCH) {
            if (i0 * FP4_WARP_SIZE >= E) {  // uniform: no expert of the batch exists
                #pragma unroll
                for (int i = 0; i < ROUTE_BATCH && i0 + i < MOE_EXPERTS_PER_LANE; ++i) l[i0 + i] = minus_infinity;
                continue;
            }
            float planes[ROUTE_BATCH][ROUTER_PLANES];
            #pragma unroll
            for (int i = 0; i < ROUTE_BATCH && i0 + i < MOE_EXPERTS_PER_LANE; ++i) {
                const u32 e = min_u32((i0 + i) * FP4_WARP_SIZE + lane, E);
                #pragma unroll
                for (int q = 0; q < ROUTER_PLANES; ++q) planes[i][q] = load_coherent_f32(row + q * plane + e);
            }
            #pragma unroll
            for (int i = 0; i < ROUTE_BATCH && i0 + i < MOE_EXPERTS_PER_LANE; ++i) {
                // logit e of the token: its planes summed in plane order
                float v = 0.0f;
                #pragma unroll
                for (int q = 0; q < ROUTER_PLANES; ++q) v += planes[i][q];
                if (!(v == v) || (i0 + i) * FP4_WARP_SIZE + lane >= E) v = minus_infinity;  // a NaN logit (NaN input) is never preferred
                l[i0 + i] = v;
            }
        }
        // top-k over the logits (softmax is monotone in them), ties to the lower expert id: by
        // top_k_above_floor, else by repeated arg-max. Each lane keeps its experts as order keys
        // (0: taken, or no expert), so a round is a tree of maxima over the lane's keys, the
        // warp's largest key, a tree of minima for the lowest of the lane's slots holding it, and
        // the lowest id over the warp (the warp reductions are one instruction each on NVIDIA);
        // lane j keeps choice j. The probabilities wait until after the loop, so a round is only
        // compares. (H200, T = 1,
        // clock64: the whole routing took 7,040-7,820 cycles with the arg-max over the lane's
        // keys as one chain and a probability per round, 6,170-6,440 with the trees; the rounds
        // themselves 2,820-2,970.)
        u32 keys[MOE_EXPERTS_PER_LANE];
        #pragma unroll
        for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) keys[i] = i * FP4_WARP_SIZE + lane < E ? order_key(l[i]) : 0u;
        u32 mine = 0u, mine_key = 0u, first_key = 0u;
        if (!top_k_above_floor(keys, k, top_k_scratch + warp * 2 * FP4_WARP_SIZE, mine, mine_key, first_key)) {
            for (u32 j = 0; j < k; ++j) {
                // the lane's largest key, then the lowest slot holding it (two trees of min / max)
                const u32 top_key = warp_max_u32(lane_largest_key(keys));
                u32 level[MOE_EXPERTS_PER_LANE];
                #pragma unroll
                for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) level[i] = keys[i] == top_key ? (u32)i : 0xffffffffu;
                #pragma unroll
                for (int stride = 1; stride < MOE_EXPERTS_PER_LANE; stride *= 2)
                    #pragma unroll
                    for (int i = 0; i < MOE_EXPERTS_PER_LANE; i += 2 * stride) level[i] = min_u32(level[i], level[i + stride]);
                const u32 best_e = warp_min_u32(level[0] == 0xffffffffu ? 0xffffffffu : level[0] * FP4_WARP_SIZE + lane);
                // the winner's slot taken, as selects (a store under a branch put the keys in local memory)
                const bool winner = best_e % FP4_WARP_SIZE == lane;
                #pragma unroll
                for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) keys[i] = winner && (u32)i == best_e / FP4_WARP_SIZE ? 0u : keys[i];
                if (lane == j) {
                    mine = best_e;
                    mine_key = top_key;
                }
                if (j == 0) first_key = top_key;
            }
        }
        // renormalised over the k chosen, softmax's sum over all E cancels: exp relative to the
        // largest logit (the first chosen) is all the weights need (the sum over every expert took
        // 1,200-1,410 cycles of the chain at T = 1; the warp's maximum before it, part of the
        // loads' 1,440-1,980, was not timed on its own)
        const float mine_p = lane < k ? fast_exp(from_order_key(mine_key) - from_order_key(first_key)) : 0.0f;
        const float kept = warp_sum(mine_p);
        if (lane < k) {
            a.topk_ids[t * k + lane] = mine;
            a.route_weight[t * k + lane] = mine_p / kept;
            if (shared_ids != nullptr) shared_ids[t * k + lane] = mine;
        }
        if (aligns_in_routing_warp(a)) align_one_token(a, mine);
        if (lane == 0) {
            float gate = 0.0f;
            #pragma unroll
            for (int q = 0; q < ROUTER_PLANES; ++q) gate += gate_planes[q];
            a.shared_scale[t] = a.has_shared_gate ? sigmoid(gate) : 1.0f;
        }
    }
}

/// Whether every slot has a thread of its own and a word of sh.route.count: align() takes
/// align_slots.
FP4_DEVICE bool slots_fit_block(const MoeArgs& a) {
    return a.tokens * a.top_k <= MOE_THREADS && a.tokens * a.top_k <= MOE_MAX_EXPERTS;
}

/// align() (below) when every slot has a thread: thread s takes slot s and, reading every slot's
/// expert from shared memory, counts the slots of its expert (all of them, and those before s)
/// and those of lower experts, then the distinct lower experts: no atomics and no scan, so at
/// T = 1 the alignment is two short loops (align_by_scan takes four block barriers and
/// shared-memory atomics).
/// Positions within an expert follow slot order. `ids_in_shared`: this block routed every token
/// and left the experts in sh.route.count (route_tokens' shared_ids), so they are not read back
/// from topk_ids (an L2 round trip on the routing's critical path).
template <int ROWS>
FP4_DEVICE void align_slots(const MoeArgs& a, MoeShared<ROWS>& sh, bool ids_in_shared) {
    const u32 n = a.tokens * a.top_k, s = thread_x();
    u32* const expert_of = sh.route.count;  // [n] the expert of each slot
    u32* const leads = sh.route.fill;       // [n] 1 when the slot is its expert's first
    if (s < n && !ids_in_shared) expert_of[s] = load_coherent_u32(a.topk_ids + s);
    block_barrier();
    const u32 e = s < n ? expert_of[s] : 0u;
    u32 same = 0u, same_before = 0u, below = 0u;
    for (u32 l = 0; l < n; ++l) {
        const u32 other = expert_of[l];
        same += other == e ? 1u : 0u;
        same_before += other == e && l < s ? 1u : 0u;
        below += other < e ? 1u : 0u;
    }
    const bool lead = s < n && same_before == 0u;
    if (s < n) leads[s] = lead ? 1u : 0u;
    block_barrier();
    u32 rank = 0u, active = 0u;
    for (u32 l = 0; l < n; ++l) {
        const u32 f = leads[l];
        active += f;
        rank += f != 0u && expert_of[l] < e ? 1u : 0u;
    }
    if (s < n) {
        const u32 offset = a.shared_experts * a.tokens + below;
        if (lead) {
            a.active_expert[rank] = e;
            a.active_offset[rank] = offset;
            a.active_count[rank] = same;
        }
        a.sorted_token[offset + same_before] = s / a.top_k;
        a.slot_pos[s] = offset + same_before;
    }
    if (s == 0) *a.n_active = active;
}

/// align_by_scan's slots per thread whose experts are asked for together (registers for them).
#define ALIGN_BATCH 8

/// align() for any number of slots: per expert its slots counted with shared-memory atomics,
/// ranks and first positions from a block scan, then each slot's position from a per-expert
/// atomic. A thread's slots are s = tid, tid + MOE_THREADS, ...; their experts are read from
/// the L2 ALIGN_BATCH at a time into registers, once for both passes: coherent loads are
/// volatile, so a load inside the atomics' loop waited for the atomic before it, one L2 round
/// trip per slot of the thread, twice (4 + 4 at T = 64, k = 8 on 128 threads). The scan is the
/// warps' shuffle scans and one barrier (a Hillis-Steele scan over the block's threads took two
/// barriers per doubling, 14 on 128 threads).
template <int ROWS>
FP4_DEVICE void align_by_scan(const MoeArgs& a, MoeShared<ROWS>& sh) {
    const u32 E = a.experts, k = a.top_k, T = a.tokens, tid = thread_x();
    const u32 slots = T * k, lane = lane_index(), warp = tid / FP4_WARP_SIZE;
    for (u32 e = tid; e < MOE_MAX_EXPERTS; e += MOE_THREADS) sh.route.count[e] = sh.route.fill[e] = 0u;
    // the experts of slots [s0, s0 + ALIGN_BATCH * MOE_THREADS): slot s0 + j * MOE_THREADS + tid
    // in ids[j] (E past the slots)
    const auto load_batch = [&](u32 s0, u32 (&ids)[ALIGN_BATCH]) {
        #pragma unroll
        for (u32 j = 0; j < ALIGN_BATCH; ++j) {
            const u32 slot = s0 + j * MOE_THREADS + tid;
            ids[j] = slot < slots ? load_coherent_u32(a.topk_ids + slot) : E;
        }
    };
    const u32 batch_slots = ALIGN_BATCH * MOE_THREADS;
    u32 ids[ALIGN_BATCH];
    load_batch(0u, ids);  // the only batch up to T * k = 1024 (T = 128 at k = 8)
    block_barrier();
    for (u32 s0 = 0; s0 < slots; s0 += batch_slots) {
        if (s0 > 0u) load_batch(s0, ids);
        #pragma unroll
        for (u32 j = 0; j < ALIGN_BATCH; ++j)
            if (ids[j] < E) atomic_add_block(&sh.route.count[ids[j]], 1u);
    }
    block_barrier();

    // Alignment: an exclusive scan over the experts of (active << 16 | slots) gives each active
    // expert its rank (ascending ids) and its first position (slot counts stay below 2^16: the
    // host caps T * k).
    const u32 per_thread = div_up(E, MOE_THREADS);
    const u32 begin = tid * per_thread, end = min_u32(E, begin + per_thread);
    u32 sum = 0u;
    for (u32 e = begin; e < end; ++e) sum += (sh.route.count[e] ? 0x10000u : 0u) + sh.route.count[e];
    const u32 through = warp_inclusive_sum(sum);
    if (lane == FP4_WARP_SIZE - 1) sh.route.scan[warp] = through;  // the warp's total
    block_barrier();
    u32 running = through - sum, total = 0u;
    #pragma unroll
    for (u32 w = 0; w < MOE_WARPS; ++w) {
        const u32 warp_total = sh.route.scan[w];
        running += w < warp ? warp_total : 0u;
        total += warp_total;
    }
    const u32 first_routed = a.shared_experts * T;
    for (u32 e = begin; e < end; ++e) {
        const u32 count = sh.route.count[e];
        if (count) {
            const u32 rank = running >> 16, offset = first_routed + (running & 0xffffu);
            a.active_expert[rank] = e;
            a.active_offset[rank] = offset;
            a.active_count[rank] = count;
            sh.route.offset[e] = offset;
            running += 0x10000u + count;
        }
    }
    if (tid == 0) *a.n_active = total >> 16;
    block_barrier();
    for (u32 s0 = 0; s0 < slots; s0 += batch_slots) {
        if (slots > batch_slots) load_batch(s0, ids);  // else still the first batch's
        #pragma unroll
        for (u32 j = 0; j < ALIGN_BATCH; ++j) {
            const u32 slot = s0 + j * MOE_THREADS + tid, e = ids[j];
            if (e < E) {
                const u32 position = sh.route.offset[e] + atomic_add_block(&sh.route.fill[e], 1u);
                a.sorted_token[position] = slot / k;
                a.slot_pos[slot] = position;
            }
        }
    }
}

/// The alignment of every slot by expert, by the block that routed the last chunk: per expert
/// its slots, its rank among the active experts (ascending ids) and first position; per slot its
/// position, per position its token; then raises routing_ready where `raise_ready`. Three ways
/// to the same tables (positions within one expert's group may come in another order, which
/// nothing depends on): align_one_token for a single token (route_tokens calls it), align_slots when every slot has a
/// thread of its own (decode and small verify batches), else align_by_scan. `raise_ready`: the
/// persistent launch's blocks wait for routing_ready; the split launches hand the routing on at
/// the kernel boundary and leave the flag down. `ids_in_shared`: as align_slots'.
template <int ROWS>
FP4_DEVICE void align(const MoeArgs& a, MoeShared<ROWS>& sh, bool raise_ready, bool ids_in_shared) {
    if (aligns_in_routing_warp(a)) {
        // route_tokens' warp has aligned the one token's slots (align_one_token)
    } else if (slots_fit_block(a)) {
        align_slots<ROWS>(a, sh, ids_in_shared);
    } else {
        align_by_scan<ROWS>(a, sh);
    }
    if (!raise_ready) return;
    release_before_barrier();
    block_barrier();
    if (thread_x() == 0) store_release_gpu(a.control + CONTROL_ROUTING_READY, 1u);
}

/// Router item: planes [plane_begin, plane_end) of the partial logits of router tile group
/// `group` for the tokens of chunk `chunk`. The chunk's router items arrive on its counter,
/// `arrivals` in all: the last routes its tokens; the last chunk routed aligns them all (both
/// counters rearm themselves). `split`: the route launch of the split form, whose caller has not
/// waited for the previous kernel (the weights load first) and which hands the routing on at the
/// kernel boundary.
template <int ROWS, int STAGES>
FP4_DEVICE void router_item(const MoeArgs& a, const Plan& p, u32 group, u32 chunk, u32 plane_begin, u32 plane_end,
                            u32 arrivals, bool split, MoeShared<ROWS>& sh) {
    const u32 lane = lane_index(), warp = thread_x() / FP4_WARP_SIZE;
    const u32 part = warp % ROUTER_WARPS_PER_TILE;
    const u32 tile = group * ROUTER_TILES_PER_ITEM + warp / ROUTER_WARPS_PER_TILE;
    const bool active = tile < p.router_tiles;
    const u32 r0 = chunk * ROWS, rows = min_u32(ROWS, a.tokens - r0);
    const u16* x_rows[TileAcc<ROWS>::X_ROWS];
    #pragma unroll
    for (int i = 0; i < TileAcc<ROWS>::X_ROWS; ++i) {
        const u32 row = TileAcc<ROWS>::x_row(i, lane);
        x_rows[i] = row < rows ? a.x + (u64)(r0 + row) * a.hidden : nullptr;
    }
    for (u32 plane = plane_begin; plane < plane_end; ++plane) {
        const u32 g0 = plane * p.router_plane_groups;
        const u32 g1 = min_u32(p.hidden_k_groups, g0 + p.router_plane_groups);
        TileAcc<ROWS> acc;
        tile_product<RouterWeights, ROWS, STAGES, true>(weights_at<RouterWeights>(a.router, nullptr), tile, p.hidden_k_groups,
                                                  g0 + part, ROUTER_WARPS_PER_TILE, active ? g1 : 0u, a.hidden, x_rows,
                                                  rows, nullptr, 0u, split && plane == plane_begin, false, acc);
        reduce_parts<ROWS>(acc, warp, part, ROUTER_WARPS_PER_TILE, sh);
        if (active && part == 0) {
            const u32 logit_rows = a.experts + a.has_shared_gate, stride = a.experts + 1;
            acc.for_each_pair(lane, [&](u32 row, u32 r, float top, float bottom) {
                if (row >= rows) return;
                float* out = a.logits + ((u64)plane * a.tokens + r0 + row) * stride;
                const u32 e = tile * TILE_ROWS + r;
                if (e < logit_rows) out[e] = top;
                if (e + 8 < logit_rows) out[e + 8] = bottom;
            });
        }
    }
    if (split) chain_after_previous_grid();  // done in the first plane's product, unless there was none
    u32* const chunk_done = a.control + CONTROL_GATE_UP_DONE + a.experts + a.shared_experts + p.down_groups;
    if (!block_arrive_and_rearm(chunk_done + chunk, arrivals, &sh.flag)) return;
    // one chunk: this block routes every token (the barrier orders its routing before the
    // alignment's reads), no second arrival needed, and the experts chosen stay in shared memory
    // for align_slots; one token: its routing warp aligns it (nothing for the barrier to order)
    const bool one_token = aligns_in_routing_warp(a);
    const bool ids_in_shared = p.chunks == 1 && slots_fit_block(a) && !one_token;
    route_tokens(a, r0, r0 + rows, ids_in_shared ? sh.route.count : nullptr, &sh.route.top_k[0][0][0]);
    if (p.chunks == 1) {
        if (!one_token) block_barrier();
        align<ROWS>(a, sh, !split, ids_in_shared);
    } else if (block_arrive_and_rearm(a.control + CONTROL_ROUTER_DONE, p.chunks, &sh.flag)) {
        align<ROWS>(a, sh, !split, false);
    }
}


/// One expert GEMM item. gate_up: act[position] = bf16(silu(gate) * up); down: partial[position]
/// = the fp32 down output. One call site for both kinds (the K loop is the same code), so the
/// compiler keeps one copy of the tile product in registers.
template <class W, int ROWS, int STAGES>
FP4_DEVICE void expert_item(const MoeArgs& a, const Plan& p, const ExpertJob& job, MoeShared<ROWS>& sh) {
    const u32 lane = lane_index(), warp = thread_x() / FP4_WARP_SIZE;
    const u32 n_tiles = job.gate_up ? p.gate_up_tiles : p.down_tiles;
    const u32 k = job.gate_up ? a.hidden : a.inter;
    const u32 k_groups = job.gate_up ? p.hidden_k_groups : p.inter_k_groups;
    // powers of two: the divisions are shifts (MOE_WARPS is a constant)
    const u32 tiles_per_item = job.gate_up ? p.gate_up_tiles_per_item : p.down_tiles_per_item;
    const u32 warps_per_tile = MOE_WARPS / tiles_per_item;
    const u32 part = warp & (warps_per_tile - 1u);
    const u32 tile = job.group * tiles_per_item + warp * tiles_per_item / MOE_WARPS;
    const bool active = tile < n_tiles;
    const W weights = job.gate_up ? weights_at<W>(a.gate_up, a.gate_up_scales) : weights_at<W>(a.down, a.down_scales);
    const float alpha0 = job.gate_up ? a.gate_up_alpha[2 * job.expert] : a.down_alpha[job.expert];
    const float alpha1 = job.gate_up ? a.gate_up_alpha[2 * job.expert + 1] : alpha0;
    for (u32 r0 = job.r_begin; r0 < job.r_end; r0 += ROWS) {
        const u32 rows = min_u32(ROWS, job.r_end - r0);
        const u16* x_rows[TileAcc<ROWS>::X_ROWS];
        #pragma unroll
        for (int i = 0; i < TileAcc<ROWS>::X_ROWS; ++i) {
            const u32 row = TileAcc<ROWS>::x_row(i, lane);
            if (row >= rows) {
                x_rows[i] = nullptr;
            } else if (job.gate_up) {
                const u32 token =
                    job.gathered ? load_coherent_u32(a.sorted_token + job.position0 + r0 + row) : r0 + row;
                x_rows[i] = a.x + (u64)token * a.hidden;
            } else {
                x_rows[i] = a.act + (u64)(job.position0 + r0 + row) * a.inter;
            }
        }
        TileAcc<ROWS> acc;
        tile_product<W, ROWS, STAGES>(weights, (u64)job.expert * n_tiles + tile, k_groups, part, warps_per_tile,
                                      active ? k_groups : 0u, k, x_rows, rows,
                                      r0 == job.r_begin ? job.wait_counter : nullptr, job.wait_target,
                                      r0 == job.r_begin && job.wait_grid, job.x_through_l1, acc);
        reduce_parts<ROWS>(acc, warp, part, warps_per_tile, sh);
        if (active && part == 0) {
            acc.for_each_pair(lane, [&](u32 row, u32 r, float top, float bottom) {
                if (row >= rows) return;
                const u64 position = job.position0 + r0 + row;
                if (job.gate_up) {
                    // tile rows r / r + 8 are gate / up row 8 * tile + r
                    const u32 column = tile * (TILE_ROWS / 2) + r;
                    if (column < a.inter)
                        a.act[position * a.inter + column] = f32_to_bf16(silu(top * alpha0) * (bottom * alpha1));
                } else {
                    const u32 h = tile * TILE_ROWS + r;
                    float* out = a.partial + position * a.hidden;
                    if (h < a.hidden) out[h] = top * alpha0;
                    if (h + 8 < a.hidden) out[h + 8] = bottom * alpha0;
                }
            });
        }
        block_barrier();  // part_sums is reused by the next pass
    }
}

/// The output rows of down group `group` for every token: the routing-weighted sum of the
/// token's k expert outputs in slot order, plus the shared-expert scale times the sum of its
/// sub-experts, plus the residual, rounded once to bf16.
FP4_DEVICE void combine(const MoeArgs& a, const Plan& p, u32 group) {
    const u32 H = a.hidden, T = a.tokens, k = a.top_k;
    const u32 h0 = group * p.down_tiles_per_item * TILE_ROWS;
    const u32 width = min_u32(p.down_tiles_per_item * TILE_ROWS, H - h0);
    for (u32 i = thread_x(); i < T * width; i += MOE_THREADS) {
        const u32 t = i / width, h = h0 + i % width;
        // Loads in flight together (coherent loads are volatile: one used before the next is
        // issued costs an L2 round trip of its own): the shared expert's scale and first
        // sub-expert (dropped without one: both buffers always hold row t), then per batch of
        // COMBINE_BATCH slots their positions and weights, then their partials; at k = 8 the
        // sums wait two round trips, where a loop over the slots waited two per slot.
        const float shared_scale = load_coherent_f32(a.shared_scale + t);
        const float shared_first = load_coherent_f32(a.partial + (u64)t * H + h);
        float sum = 0.0f;
        for (u32 j0 = 0; j0 < k; j0 += COMBINE_BATCH) {
            u32 position[COMBINE_BATCH];
            float weight[COMBINE_BATCH], part[COMBINE_BATCH];
            #pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) {
                const u32 s = t * k + min_u32(j0 + j, k - 1);  // past k: slot k - 1 again, dropped
                position[j] = load_coherent_u32(a.slot_pos + s);
                weight[j] = load_coherent_f32(a.route_weight + s);
            }
            #pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) part[j] = load_coherent_f32(a.partial + (u64)position[j] * H + h);
            #pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j)
                if (j0 + j < k) sum += weight[j] * part[j];
        }
        if (a.shared_experts > 0) {
            float shared = 0.0f;
            shared += shared_first;
            for (u32 c = 1; c < a.shared_experts; ++c)
                shared += load_coherent_f32(a.partial + ((u64)c * T + t) * H + h);
            sum += shared_scale * shared;
        }
        if (a.residual != nullptr) sum += bf16_to_f32(a.residual[(u64)t * H + h]);
        a.y[(u64)t * H + h] = f32_to_bf16(sum);
    }
}

/// The expert item `item` (past the router items; `routed` = item - end_shared_gate_up when the
/// routing is known, n_active its active experts): the shared gate_up items, then per active rank
/// its gate_up groups, the shared down items, per active rank its down groups. Returns the counter
/// the item signals when done (gate_up: its expert's; down: its group of hidden rows').
template <int ROWS>
FP4_DEVICE u32* expert_job(const MoeArgs& a, const Plan& p, u32 item, u32 routed, u32 n_active, ExpertJob& job) {
    const u32 S = a.shared_experts;
    u32* const gate_up_done = a.control + CONTROL_GATE_UP_DONE;
    u32* const down_done = gate_up_done + a.experts + S;
    job.wait_counter = nullptr;
    job.wait_target = 0u;
    job.wait_grid = false;
    job.x_through_l1 = false;
    u32 shared_item = 0u, rank = 0u;
    bool shared;
    if (item < p.end_shared_gate_up) {
        job.gate_up = true;
        shared = true;
        shared_item = item - p.end_router;
    } else if (routed < n_active * p.gate_up_groups) {
        job.gate_up = true;
        shared = false;
        rank = routed / p.gate_up_groups;
        job.group = routed % p.gate_up_groups;
    } else if (routed < n_active * p.gate_up_groups + p.shared_down_items) {
        job.gate_up = false;
        shared = true;
        shared_item = routed - n_active * p.gate_up_groups;
    } else {
        job.gate_up = false;
        shared = false;
        const u32 i = routed - n_active * p.gate_up_groups - p.shared_down_items;
        rank = i / p.down_groups;
        job.group = i % p.down_groups;
    }
    if (shared) {
        // a shared sub-expert: rows are the tokens of one chunk, positions c * T + t
        const u32 per_expert = (job.gate_up ? p.gate_up_groups : p.down_groups) * p.chunks;
        const u32 c = shared_item / per_expert;
        job.expert = a.experts + c;
        job.group = shared_item % per_expert / p.chunks;
        job.position0 = c * a.tokens;
        job.r_begin = (shared_item % p.chunks) * ROWS;
        job.r_end = min_u32(a.tokens, job.r_begin + ROWS);
        job.gathered = false;
        if (job.gate_up) return gate_up_done + c;
        job.wait_counter = gate_up_done + c;
        job.wait_target = p.gate_up_groups * p.chunks;
        return down_done + job.group;
    }
    // an active expert's rank: its expert, rows and positions come from the routing
    job.expert = load_coherent_u32(a.active_expert + rank);
    job.position0 = load_coherent_u32(a.active_offset + rank);
    job.r_begin = 0u;
    job.r_end = load_coherent_u32(a.active_count + rank);
    job.gathered = a.tokens > 1;  // one token: every routed row is token 0, no lookup (a round trip)
    if (job.gate_up) return gate_up_done + S + rank;
    job.wait_counter = gate_up_done + S + rank;
    job.wait_target = p.gate_up_groups;
    return down_done + job.group;
}

/// The persistent launch's last block to get here resets the counters that blocks wait on or
/// claim from (next item, routing_ready, blocks done, gate_up done) for the next launch; the
/// arrival-only counters (down groups, router chunks) rearm themselves. Every thread of every
/// block must call it once.
template <int ROWS>
FP4_DEVICE void reset_counters_when_last(const MoeArgs& a, MoeShared<ROWS>& sh) {
    if (block_arrive(a.control + CONTROL_BLOCKS_DONE, grid_blocks(), &sh.flag)) {
        const u32 counters = CONTROL_GATE_UP_DONE + a.experts + a.shared_experts;
        for (u32 i = thread_x(); i < counters; i += MOE_THREADS) a.control[i] = 0u;
    }
}

// Every moe kernel's start: the arguments and the plan in shared memory, read where used (kept in
// registers across the item loop, they would crowd out the tile products').
#define MOE_LAUNCH_SETUP(args)        \
    __shared__ MoeShared<ROWS> sh;    \
    __shared__ MoeArgs a;             \
    __shared__ Plan p;                \
    if (thread_x() == 0) {            \
        a = args;                     \
        p = make_plan<ROWS>(args);    \
    }                                 \
    block_barrier();

/// The whole block: claims items until none are left; the last block out resets the counters.
template <class W, int ROWS, int STAGES, int ROUTER_STAGES>
FP4_DEVICE void moe_block(const MoeArgs& args) {
    MOE_LAUNCH_SETUP(args)
    const u32 S = a.shared_experts;
    u32 next = 0u;
    if (thread_x() == 0) next = atomic_add_relaxed_gpu(a.control + CONTROL_NEXT_ITEM, 1u);
    for (;;) {
        if (thread_x() == 0) sh.item = next;
        block_barrier();
        const u32 item = sh.item;
        block_barrier();
        // the items past the shared gate_up are laid out by the routing: routed gate_up
        // (n_active ranks), shared down, routed down (n_active ranks); past them, none
        u32 n_active = 0u, routed = 0u;
        if (item >= p.end_shared_gate_up) {
            block_wait_at_least(a.control + CONTROL_ROUTING_READY, 1u, "routing");
            n_active = load_coherent_u32(a.n_active);  // uniform: read after the barrier
            routed = item - p.end_shared_gate_up;
            if (routed >= n_active * (p.gate_up_groups + p.down_groups) + p.shared_down_items) break;
        }
        // claim the following item now: its round trip hides behind this one
        if (thread_x() == 0) next = atomic_add_relaxed_gpu(a.control + CONTROL_NEXT_ITEM, 1u);
        if (item < p.end_router) {
            router_item<ROWS, ROUTER_STAGES>(a, p, item / p.chunks, item % p.chunks, 0u, ROUTER_PLANES,
                                             p.router_groups, false, sh);
            continue;
        }
        ExpertJob job;
        u32* const done = expert_job<ROWS>(a, p, item, routed, n_active, job);
        // the job goes through shared memory: read where used, not held in registers
        if (thread_x() == 0) sh.job = job;
        block_barrier();
        expert_item<W, ROWS, STAGES>(a, p, sh.job, sh);
        if (job.gate_up) {
            block_signal(done);
        } else if (block_arrive_and_rearm(done, n_active + S * p.chunks, &sh.flag)) {
            combine(a, p, job.group);
        }
    }
    reset_counters_when_last<ROWS>(a, sh);
}

// ============================================================================================
// The same block in three launches, for small T: at decode sizes the persistent launch spends
// most of its time with blocks idle until the routing is known (the router phase is a chain of
// dependent steps), while kernel boundaries order the phases for about a microsecond each.
//   moe_route_m*:           the router items, one block per plane, the last routes and aligns;
//   moe_{fmt}_gate_up_m*:   one block per gate_up item (shared, then every possible active rank:
//                           blocks past the n_active ranks leave at once);
//   moe_{fmt}_down_m*:      one block per down item, the last of a hidden-row group combines.
// Items and counters are the persistent kernel's, so the two forms cannot disagree. The split
// launches use only arrival counters, which rearm themselves (no grid-wide reset at the end, and
// routing_ready stays down).
// ============================================================================================


/// Once its router item is done, every thread of the route launch asks the L2 for an even share
/// of `bytes` from `base`, the next layer's first dense weights, while the routing and the expert
/// launches' latency chains leave DRAM mostly idle (their requests spread over every block's SM,
/// where one SM asking for megabytes took a launch from 11 to 52 us, twelfth session).
FP4_DEVICE void prefetch_share(const u8* base, u32 bytes) {
    if (base == nullptr || bytes == 0u) return;
    const u32 pieces = grid_blocks() * MOE_THREADS, piece = block_x() * MOE_THREADS + thread_x();
    const u32 per = (div_up(bytes, pieces) + 15u) & ~15u;
    const u64 begin = (u64)piece * per;
    if (begin >= bytes) return;
    prefetch_l2(base + begin, (u32)((u64)bytes - begin < per ? (u64)bytes - begin : per));
}

/// One block per (router item, plane): the planes' blocks each hold a quarter (for 4 planes) of
/// the K groups, so every warp's chain of loads and MMAs is that much shorter (at T = 1 the
/// router of 17 tiles is otherwise 17 blocks of long chains, the route launch's whole cost). The
/// router weights load before the wait for the previous kernel (the norm that writes X).
template <int ROWS, int ROUTER_STAGES>
FP4_DEVICE void moe_split_route(const MoeArgs& args) {
    MOE_LAUNCH_SETUP(args)
    const u32 item = block_x() / ROUTER_PLANES, plane = block_x() % ROUTER_PLANES;
    router_item<ROWS, ROUTER_STAGES>(a, p, item / p.chunks, item % p.chunks, plane, plane + 1,
                                     p.router_groups * ROUTER_PLANES, true, sh);
    prefetch_share(a.prefetch, a.prefetch_bytes);
}

/// One block per gate_up item. The shared expert's items run whole before the wait for the route
/// launch: they read X (written by the norm two launches back, final once this kernel starts, see
/// chain_after_previous_grid) and write only their own act rows, which the route launch beside
/// them never touches; so at decode the shared expert costs the step nothing after the routing.
/// The routed items wait first: which expert they multiply is the routing.
template <class W, int ROWS, int STAGES>
FP4_DEVICE void moe_split_gate_up(const MoeArgs& args) {
    MOE_LAUNCH_SETUP(args)
    const u32 item = p.end_router + block_x();
    const bool shared = item < p.end_shared_gate_up;
    if (!shared) chain_after_previous_grid();
    const u32 routed = shared ? 0u : item - p.end_shared_gate_up;
    // the item's rank entries are loaded together with n_active (written by the route launch),
    // not after it: the job is planned as if every expert were active (its rank is below E, so
    // the entries exist) and dropped past the real n_active (one L2 round trip instead of two)
    ExpertJob job;
    expert_job<ROWS>(a, p, item, routed, a.experts, job);
    const u32 n_active = shared ? 0u : load_coherent_u32(a.n_active);
    // a routed item has waited for the route launch (and so for the rows before it); a shared one
    // reads them before any wait
    job.x_through_l1 = MOE_SPLIT_X_L1 && !shared;
    if (shared || routed < n_active * p.gate_up_groups) {
        if (thread_x() == 0) sh.job = job;
        block_barrier();
        expert_item<W, ROWS, STAGES>(a, p, sh.job, sh);
    }
    if (shared) chain_after_previous_grid();  // every block waits before it lets the down launch in
}

/// One block per down item. The routing is read before the wait for the previous kernel: the
/// route launch wrote it two launches back, so it is final once this kernel starts
/// (chain_after_previous_grid), and the down weights stream while the gate_up launch runs; the
/// gate_up outputs are read after the wait, in tile_product.
template <class W, int ROWS, int STAGES>
FP4_DEVICE void moe_split_down(const MoeArgs& args) {
    MOE_LAUNCH_SETUP(args)
    const u32 n_active = load_coherent_u32(a.n_active);
    const u32 routed = n_active * p.gate_up_groups + block_x();
    const bool has_item = routed < n_active * (p.gate_up_groups + p.down_groups) + p.shared_down_items;
    u32* done = nullptr;
    if (has_item) {
        ExpertJob job;
        done = expert_job<ROWS>(a, p, p.end_shared_gate_up + routed, routed, n_active, job);
        job.wait_counter = nullptr;  // every gate_up finished in the previous launch
        job.wait_grid = true;
        job.x_through_l1 = MOE_SPLIT_X_L1;  // the gate_up launch's rows, read after that wait
        if (thread_x() == 0) sh.job = job;
        block_barrier();
        expert_item<W, ROWS, STAGES>(a, p, sh.job, sh);
    }
    // every block waits before it writes anything (a no-op where tile_product already waited;
    // blocks without an item, or a product without rows, have not): the rule of
    // chain_after_previous_grid
    chain_after_previous_grid();
    if (has_item && block_arrive_and_rearm(done, n_active + a.shared_experts * p.chunks, &sh.flag))
        combine(a, p, sh.job.group);
}

{% if target.instructions.mma_sync_bf16 and target.instructions.cp_async %}
// ============================================================================================
// The streaming form, for T from moe.stream_min_tokens to moe.split_max_tokens: the split
// form's route and gate_up launches, then moe_{fmt}_down_stream and moe_stream_combine. Why: at
// T = 16..64 the split down launch is 8448 items of 4 tiles of 8 K groups (T = 64), each a short
// chain of its own (its job read from the routing, each K group's X fragment loaded from L2 when
// the group is used, the epilogue), and the last item of each group of hidden rows combines
// them for every token; ncu at B = 64 (H200, eighth session): 148 us at 19% of DRAM bandwidth for
// 131 MB of weights. Here a grid of resident blocks splits the launch's units, (token chunk,
// 16-row tile) pairs in chunk order, evenly over its warps; a warp owns whole tiles (one warp sums
// a tile's K groups in order, as the split down launch does; no block barrier after the start)
// and walks its units' (tile, K group) sequence as ONE stream: the stages_* groups in flight,
// weights in registers (as tile_product) and X fragments copied by cp.async into the warp's
// ring in shared memory (each lane copies, and reads back, its own 32-byte fragment), so
// neither waits at a unit's edge. Chunks: the shared sub-experts' chunks of STREAM_ROWS tokens
// first, then each active rank's (a rank with more tokens has several); each block builds the
// table of chunks per rank from the routing. The combine is its own launch (every hidden row of
// every token, in slot order as combine()): the units of one hidden row finish all over the grid.
// Measured and not kept (eighth session, BENCHMARKS.md): the same streaming for gate_up (slower
// than the split items, which split K over 2 warps and ask the L2 for their tiles) and L2
// prefetch windows ahead of the stream (slower at every T: the L2 thrashes).
// ============================================================================================
{% include "common/cp_async.cuh" %}
#define STREAM_ROWS 8
// Out of line: a chunk's lookup runs a few times per warp, off the streaming loop, whose
// unrolled stages would otherwise each carry a copy (tests/moe_emulator.cpp defines it first).
#ifndef STREAM_RARE
#define STREAM_RARE __device__ __noinline__
#endif

/// The launch's chunks: chunk_begin[r] routed chunks come before rank r's ([n_active]: all).
struct StreamTable {
    u32 chunk_begin[MOE_MAX_EXPERTS + 1];
    u32 count[MOE_MAX_EXPERTS];  // tokens of rank r
    u32 n_active, shared_chunks, chunks;
};

/// Builds the table from the routing (warp 0; a block barrier, so every thread must call it).
/// Lane L reads ranks L, L + 32, ...: each load of the warp is one line of the L2, which every
/// block of the launch asks for at once. (Lane L reading ranks [8 L, 8 L + 8) spread each load
/// over up to 8 lines, 56 requests per block at 217 active experts.)
FP4_DEVICE void build_stream_table(const MoeArgs& a, StreamTable& st) {
    if (thread_x() < FP4_WARP_SIZE) {
        const u32 lane = lane_index();
        const u32 n_active = load_coherent_u32(a.n_active);
        u32 counts[MOE_EXPERTS_PER_LANE];
        #pragma unroll
        for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) {
            const u32 r = i * FP4_WARP_SIZE + lane;
            counts[i] = r < n_active ? load_coherent_u32(a.active_count + r) : 0u;
        }
        // rank i * 32 + lane's first chunk: the chunks of the rows of ranks before i, then of the
        // lanes before it in row i (the rows' scans are independent: their shuffles overlap)
        u32 begin = 0u;
        #pragma unroll
        for (int i = 0; i < MOE_EXPERTS_PER_LANE; ++i) {
            if (i * FP4_WARP_SIZE >= n_active) break;  // uniform
            const u32 chunks = div_up(counts[i], STREAM_ROWS);
            const u32 through = warp_inclusive_sum(chunks);
            const u32 r = i * FP4_WARP_SIZE + lane;
            if (r < n_active) {
                st.count[r] = counts[i];
                st.chunk_begin[r] = begin + through - chunks;
            }
            begin += shuffle_from(through, FP4_WARP_SIZE - 1);
        }
        if (lane == 0) {
            st.chunk_begin[n_active] = begin;
            st.n_active = n_active;
            st.shared_chunks = a.shared_experts * div_up(a.tokens, STREAM_ROWS);
            st.chunks = st.shared_chunks + begin;
        }
    }
    block_barrier();
}

/// One chunk: its weight index (a routed expert, or E + c for shared sub-expert c), its first
/// position and its rows (positions position0 ..).
struct StreamChunk {
    u32 expert, position0, rows;
};

/// Chunk `c` of the launch's list: a shared sub-expert's (no lookup), or the routed rank whose
/// chunks hold it (a binary search of the table, then the rank's expert and first position).
FP4_DEVICE StreamChunk stream_chunk(const MoeArgs& a, const StreamTable& st, u32 c) {
    StreamChunk k;
    if (c < st.shared_chunks) {
        const u32 per_expert = div_up(a.tokens, STREAM_ROWS), sub = c / per_expert;
        const u32 r_begin = (c % per_expert) * STREAM_ROWS;
        k.expert = a.experts + sub;
        k.position0 = sub * a.tokens + r_begin;
        k.rows = min_u32(STREAM_ROWS, a.tokens - r_begin);
        return k;
    }
    c -= st.shared_chunks;
    u32 lo = 0u, hi = st.n_active;  // chunk_begin[lo] <= c < chunk_begin[hi]
    while (hi - lo > 1u) {
        const u32 mid = (lo + hi) / 2u;
        if (st.chunk_begin[mid] <= c) lo = mid;
        else hi = mid;
    }
    const u32 r_begin = (c - st.chunk_begin[lo]) * STREAM_ROWS;
    k.expert = load_coherent_u32(a.active_expert + lo);
    k.position0 = load_coherent_u32(a.active_offset + lo) + r_begin;
    k.rows = min_u32(STREAM_ROWS, st.count[lo] - r_begin);
    return k;
}

/// Where a warp's stream stands: unit (chunk, tile) and K group, the chunk, and for the loads the
/// weight index of the unit's group 0 and this lane's X row (null past the chunk's rows).
struct StreamCursor {
    u32 chunk, tile, group;
    StreamChunk meta;
    u32 tile_base;
    const u16* x_row;
};

/// The cursor at unit `unit`, group 0 (unit < the launch's units).
STREAM_RARE StreamCursor stream_cursor(const MoeArgs& a, const StreamTable& st, u32 n_tiles, u32 k_groups, u32 unit) {
    StreamCursor cur;
    cur.chunk = unit / n_tiles;
    cur.tile = unit % n_tiles;
    cur.group = 0u;
    cur.meta = stream_chunk(a, st, cur.chunk);
    cur.tile_base = (cur.meta.expert * n_tiles + cur.tile) * k_groups * 32u + lane_index();
    const u32 row = lane_index() / 4u;  // this lane's token row of the MMA's B operand
    cur.x_row = row < cur.meta.rows ? a.act + (u64)(cur.meta.position0 + row) * a.inter : nullptr;
    return cur;
}

/// The next (unit, group) of the stream (the caller knows it exists).
FP4_DEVICE void stream_advance(const MoeArgs& a, const StreamTable& st, u32 n_tiles, u32 k_groups, StreamCursor& cur) {
    if (++cur.group < k_groups) return;
    const u32 unit = cur.chunk * n_tiles + cur.tile + 1u;
    if (cur.tile + 1u < n_tiles) {  // same chunk: the next tile of the same expert
        ++cur.tile;
        cur.group = 0u;
        cur.tile_base += k_groups * 32u;
        return;
    }
    cur = stream_cursor(a, st, n_tiles, k_groups, unit);
}

/// This warp's X ring: per stage, per lane its 32-byte fragment as two 16-byte halves.
template <int STAGES>
struct StreamRing {
    u32x4 x[STAGES][2][FP4_WARP_SIZE];
};

/// Copies this lane's X fragment of the cursor's group into ring stage `s` (zeros past the
/// chunk's rows and past K; `anywhere` is a valid global address for the copies of no bytes).
template <int STAGES>
FP4_DEVICE void stream_copy_x(const StreamCursor& cur, u32 k, const u16* anywhere, StreamRing<STAGES>& ring, int s) {
    const u32 col = cur.group * GROUP_COLS + 16u * (lane_index() % 4u);
    const bool valid = cur.x_row != nullptr && col < k;
    const u16* src = valid ? cur.x_row + col : anywhere;
    cp_async16_zfill(&ring.x[s][0][lane_index()], src, valid ? 16u : 0u);
    cp_async16_zfill(&ring.x[s][1][lane_index()], valid ? src + 8 : src, valid ? 16u : 0u);
}

/// The epilogue of one unit (tile `tile` of chunk `meta`): its down partial rows (fp32).
FP4_DEVICE void stream_store(const MoeArgs& a, u32 tile, const StreamChunk& meta, float alpha, const float (&c)[4]) {
    const u32 lane = lane_index(), h = tile * TILE_ROWS + lane / 4u;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 row = 2u * (lane % 4u) + half;
        if (row >= meta.rows) continue;
        float* out = a.partial + (u64)(meta.position0 + row) * a.hidden;
        if (h < a.hidden) out[h] = c[half] * alpha;
        if (h + 8u < a.hidden) out[h + 8u] = c[2 + half] * alpha;
    }
}

/// The streaming down launch. The routing (the route launch wrote it two launches back) is read,
/// and the first weight loads issued, before the wait for the gate_up launch, whose act rows
/// are the X.
template <class W, int STAGES>
FP4_DEVICE void moe_stream_down(const MoeArgs& args) {
    __shared__ MoeArgs a;
    __shared__ StreamTable st;
    __shared__ StreamRing<STAGES> rings[MOE_WARPS];
    if (thread_x() == 0) a = args;
    block_barrier();
    build_stream_table(a, st);
    const u32 n_tiles = div_up(a.hidden, TILE_ROWS), k = a.inter, k_groups = div_up(k, GROUP_COLS);
    const W weights = weights_at<W>(a.down, a.down_scales);
    // this warp's units [u0, u1) of the launch's, as even a share as whole units allow
    const u32 warps = grid_blocks() * MOE_WARPS, warp = block_x() * MOE_WARPS + thread_x() / FP4_WARP_SIZE;
    const u32 units = st.chunks * n_tiles;
    const u32 u0 = (u32)((u64)units * warp / warps), u1 = (u32)((u64)units * (warp + 1u) / warps);
    StreamRing<STAGES>& ring = rings[thread_x() / FP4_WARP_SIZE];
    const u32 steps = (u1 - u0) * k_groups;  // (unit, group) pairs of this warp
    typename W::Group w_ring[STAGES];
    StreamCursor load = {}, use = {};
    if (steps > 0u) {
        load = stream_cursor(a, st, n_tiles, k_groups, u0);
        use = load;
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            if ((u32)s < steps) {  // the load cursor ends at the last step in the ring
                if (s > 0) stream_advance(a, st, n_tiles, k_groups, load);
                w_ring[s] = weights.load(load.tile_base + load.group * 32u);
            }
        }
    }
    chain_after_previous_grid();
    if (steps == 0u) return;
    // the prologue's X copies, one commit per stage (a later step waits for its own stage)
    {
        StreamCursor x_cur = use;
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            if ((u32)s < steps) {
                if (s > 0) stream_advance(a, st, n_tiles, k_groups, x_cur);
                stream_copy_x(x_cur, k, a.x, ring, s);
            }
            cp_async_commit();
        }
    }
    float alpha = 0.0f;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 base = 0u; base < steps; base += STAGES) {
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            const u32 step = base + s;
            if (step < steps) {  // warp-uniform
                if (use.group == 0u) alpha = a.down_alpha[use.meta.expert];  // arrives while the unit runs
                cp_async_wait<STAGES - 1>();
                const u32x4 lo = ring.x[s][0][lane_index()], hi = ring.x[s][1][lane_index()];
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 frag[4];
                    weights.fragment(w_ring[s], j, frag);
                    const u32x4& q = j / 2 == 0 ? lo : hi;
                    mma_m16n8k16_bf16(c, frag[0], frag[1], frag[2], frag[3], (j % 2 == 0) ? q.x : q.z,
                                      (j % 2 == 0) ? q.y : q.w);
                }
                // refill this stage with the step STAGES ahead (its X slot was read above: the
                // MMAs consumed the registers)
                if (step + STAGES < steps) {
                    stream_advance(a, st, n_tiles, k_groups, load);
                    w_ring[s] = weights.load(load.tile_base + load.group * 32u);
                    stream_copy_x(load, k, a.x, ring, s);
                }
                cp_async_commit();
                if (use.group + 1u == k_groups) {
                    stream_store(a, use.tile, use.meta, alpha, c);
                    c[0] = c[1] = c[2] = c[3] = 0.0f;
                }
                if (step + 1u < steps) stream_advance(a, st, n_tiles, k_groups, use);
            }
        }
    }
}

{% if target.instructions.bulk_copy_mbarrier %}
// --------------------------------------------------------------------------------------------
// The bulk form (MoeLaunch::Bulk, NVFP4 experts): the split route launch, then
// moe_nvfp4_gate_up_bulk and moe_nvfp4_down_bulk, then moe_stream_combine. Both expert launches
// walk the streaming form's units (chunk, tile) in moe_stream_down's order and split, and sum
// as the split items do, but each warp's weights come through a ring of slots in shared memory
// (moe.bulk_gate_up_slots / bulk_down_slots), a slot BULK_SLOT_GROUPS K groups of one tile
// (their words and their block scales: two contiguous ranges of the fragment arrays, two bulk
// copies asked for by lane 0 and completing on the slot's mbarrier). Why: the register rings
// hold at most stages_nvfp4 groups per warp (576 bytes each: 3.4 KB at 6) and each 16-byte load
// holds an L1 miss entry until it returns; at B = 64 the gate_up items and the streaming down
// launch moved their weights at 30-45% of the H200's bandwidth (ncu, ninth and nineteenth
// sessions), waiting on those loads.
// A slot of 8 groups is 4.6 KB asked for as two requests of the copy engine (fewer, larger
// copies ran faster than 4 x 4 or 8 x 2); one slot per warp ran faster than two on the H100, the
// SM's other warps hiding each one's wait (targets.toml).
// X (the tokens' rows, or the act rows) comes into registers BULK_X_AHEAD groups ahead of the
// MMAs, across slots and units: loaded one group ahead, a chunk's rows missed L1 (its carve-out is
// what the rings leave) and the warps waited on the L2 at every group (ncu, thirtieth session:
// the top stalls of both kernels at B = 64 were the MMAs' X operands, long scoreboard); each unit
// also looked its token rows up again, a second L2 round trip before its first X load. The rows
// are looked up only when the chunk changes.
// --------------------------------------------------------------------------------------------
{% include "common/bulk_copy.cuh" %}
#define BULK_SLOT_GROUPS {{ target.moe.bulk_slot_groups }}
#define BULK_X_AHEAD {{ target.moe.bulk_x_groups_ahead }}

/// One slot of a warp's ring: up to BULK_SLOT_GROUPS K groups of one NVFP4 tile, as the
/// fragment arrays hold them (per group 32 lanes' words, then 32 lanes' scales).
struct alignas(16) BulkSlot {
    u32x4 words[BULK_SLOT_GROUPS][FP4_WARP_SIZE];
    u16 scales[BULK_SLOT_GROUPS][FP4_WARP_SIZE];
};
static_assert(sizeof(BulkSlot) % 16 == 0, "bulk copies land on 16-byte boundaries");

/// Where a warp's walk over its units stands: the unit's tile and chunk (looked up again only
/// when the chunk changes).
struct BulkUnit {
    u32 chunk, tile;
    StreamChunk meta;
};

/// Moves `u` to unit `unit`; true when its chunk changed (and so its meta was looked up).
FP4_DEVICE bool bulk_seek(const MoeArgs& a, const StreamTable& st, u32 n_tiles, u32 unit, BulkUnit& u) {
    const u32 chunk = unit / n_tiles;
    u.tile = unit % n_tiles;
    if (chunk == u.chunk) return false;
    u.chunk = chunk;
    u.meta = stream_chunk(a, st, chunk);
    return true;
}

/// This lane's X row of chunk `meta` (null past its rows): GATE_UP the token's row of x (a
/// shared sub-expert's positions are sub * T + token, a routed rank's gathered through
/// sorted_token), else the act row.
template <bool GATE_UP>
FP4_DEVICE const u16* bulk_x_row(const MoeArgs& a, const StreamChunk& meta) {
    const u32 row = lane_index() / 4u;  // this lane's token row of the MMA's B operand
    if (row >= meta.rows) return nullptr;
    if (!GATE_UP) return a.act + (u64)(meta.position0 + row) * a.inter;
    const u32 token = meta.expert >= a.experts ? (meta.position0 + row) % a.tokens
                                               : load_coherent_u32(a.sorted_token + meta.position0 + row);
    return a.x + (u64)token * a.hidden;
}

/// The bulk-copy streaming launch of one side of the experts: GATE_UP (X = the tokens' rows,
/// out act = silu(gate) * up, as the split gate_up items) or down (X = act, out the partial
/// rows, as moe_stream_down). A unit's K groups are summed into ACCUMULATORS accumulators, group
/// g into g % ACCUMULATORS, then added in order: the split items' sum when their tile's
/// ACCUMULATORS warps take groups part, part + warps, ... and reduce_parts adds them, so the
/// forms give the same bits wherever the split items use the target's warps per tile (above
/// moe.wide_max_tokens; the wide items below sum in more parts). The down side reads the
/// routing and starts its first slots before the wait for the previous launch (routing two
/// launches back, weights constant); the gate_up side needs the routing of the launch just
/// before it, so it waits first.
template <bool GATE_UP, int ACCUMULATORS, int SLOTS>
FP4_DEVICE void moe_bulk_experts(const MoeArgs& args) {
    static_assert(BULK_SLOT_GROUPS % ACCUMULATORS == 0, "a slot's groups map to the accumulators the same way");
    static_assert(BULK_SLOT_GROUPS % BULK_X_AHEAD == 0, "a slot position's X register is the same in every slot");
    __shared__ MoeArgs a;
    __shared__ StreamTable st;
    __shared__ BulkSlot ring[MOE_WARPS][SLOTS];
    __shared__ u64 bars[MOE_WARPS][SLOTS];
    if (thread_x() == 0) a = args;
    if (GATE_UP) chain_after_previous_grid();
    block_barrier();
    build_stream_table(a, st);
    const u32 lane = lane_index(), warp = thread_x() / FP4_WARP_SIZE;
    // gate_up tiles are 8 gate + 8 up rows (RowOrder::GateUp), down tiles 16 hidden rows
    const u32 n_tiles = GATE_UP ? div_up(a.inter, TILE_ROWS / 2) : div_up(a.hidden, TILE_ROWS);
    const u32 k = GATE_UP ? a.hidden : a.inter, k_groups = div_up(k, GROUP_COLS);
    const u32 parts = div_up(k_groups, BULK_SLOT_GROUPS);  // slots per unit
    const u8* const words = static_cast<const u8*>(GATE_UP ? a.gate_up : a.down);
    const u8* const scales = static_cast<const u8*>(GATE_UP ? a.gate_up_scales : a.down_scales);
    // this warp's units [u0, u1) of the launch's, as moe_stream_down splits them
    const u32 warps = grid_blocks() * MOE_WARPS, global_warp = block_x() * MOE_WARPS + warp;
    const u32 units = st.chunks * n_tiles;
    const u32 u0 = (u32)((u64)units * global_warp / warps), u1 = (u32)((u64)units * (global_warp + 1u) / warps);
    const u32 steps = (u1 - u0) * parts;  // slot fills of this warp
    BulkSlot* const my_ring = ring[warp];
    u64* const my_bars = bars[warp];
    BulkUnit load = {0xffffffffu, 0u, {}};
    // lane 0: step `step`'s groups of its unit into slot step % SLOTS
    auto fill = [&](u32 step) {
        const u32 slot = step % SLOTS, g0 = (step % parts) * BULK_SLOT_GROUPS;
        const u32 groups = min_u32(BULK_SLOT_GROUPS, k_groups - g0);
        bulk_seek(a, st, n_tiles, u0 + step / parts, load);
        const u64 entry = ((u64)(load.meta.expert * n_tiles + load.tile) * k_groups + g0) * FP4_WARP_SIZE;
        mbarrier_arrive_expect_bytes(&my_bars[slot], groups * FP4_WARP_SIZE * (16u + 2u));
        bulk_copy_to_shared(my_ring[slot].words, words + entry * 16u, groups * FP4_WARP_SIZE * 16u, &my_bars[slot]);
        bulk_copy_to_shared(my_ring[slot].scales, scales + entry * 2u, groups * FP4_WARP_SIZE * 2u, &my_bars[slot]);
    };
    // the barriers, and the first slots' weights (for the down side before the wait)
    if (lane == 0 && steps > 0u) {
        for (u32 s = 0; s < SLOTS; ++s) mbarrier_init_one(&my_bars[s]);
        for (u32 s = 0; s < SLOTS && s < steps; ++s) fill(s);
    }
    warp_barrier();  // the other lanes wait on barriers lane 0 has set up
    if (!GATE_UP) chain_after_previous_grid();
    if (steps == 0u) return;
    const ExpertNvfp4 weights = weights_at<ExpertNvfp4>(words, scales);
    // `ahead`: the unit of the step after the current one, whose X the slot's last
    // BULK_X_AHEAD groups load; `use`: the current step's unit (its rows and expert)
    BulkUnit ahead = {0xffffffffu, 0u, {}}, use = ahead;
    bulk_seek(a, st, n_tiles, u0, ahead);
    const u16* x_row = bulk_x_row<GATE_UP>(a, ahead.meta);
    // this lane's X of the slot position BULK_X_AHEAD past the one consumed: xq[g % BULK_X_AHEAD]
    // holds position g's (step 0's first positions loaded here)
    u32x4 xq[BULK_X_AHEAD][2];
    const u32 x_col = 16u * (lane % 4u);
    #pragma unroll
    for (u32 g = 0; g < BULK_X_AHEAD; ++g) load_x_fragment(x_row, g * GROUP_COLS + x_col, k, MOE_SPLIT_X_L1, xq[g]);
    float alpha0 = 0.0f, alpha1 = 0.0f;
    float c[ACCUMULATORS][4];
    for (u32 step = 0; step < steps; ++step) {
        const u32 slot = step % SLOTS, part = step % parts;
        const u32 g0 = part * BULK_SLOT_GROUPS, groups = min_u32(BULK_SLOT_GROUPS, k_groups - g0);
        if (part == 0u) {
            use = ahead;
            alpha0 = GATE_UP ? a.gate_up_alpha[2 * use.meta.expert] : a.down_alpha[use.meta.expert];
            alpha1 = GATE_UP ? a.gate_up_alpha[2 * use.meta.expert + 1] : alpha0;
            #pragma unroll
            for (int p = 0; p < ACCUMULATORS; ++p) c[p][0] = c[p][1] = c[p][2] = c[p][3] = 0.0f;
        }
        // the next step's X row: the same unless its unit is of another chunk (none past the end)
        const u32 next_part = (step + 1u) % parts;
        const u16* x_row_next = x_row;
        if (step + 1u == steps) x_row_next = nullptr;
        else if (next_part == 0u && bulk_seek(a, st, n_tiles, u0 + (step + 1u) / parts, ahead))
            x_row_next = bulk_x_row<GATE_UP>(a, ahead.meta);
        mbarrier_wait_parity(&my_bars[slot], (step / SLOTS) & 1u);
        warp_barrier();  // the lanes leave the wait's loop apart; the MMAs need them together
        #pragma unroll
        for (u32 g = 0; g < BULK_SLOT_GROUPS; ++g) {
            u32x4(&xs)[2] = xq[g % BULK_X_AHEAD];
            if (g < groups) {  // warp-uniform
                const Nvfp4Group group = {my_ring[slot].words[g][lane], my_ring[slot].scales[g][lane]};
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 frag[4];
                    weights.fragment(group, j, frag);
                    const u32x4& q = xs[j / 2];
                    mma_m16n8k16_bf16(c[g % ACCUMULATORS], frag[0], frag[1], frag[2], frag[3],
                                      (j % 2 == 0) ? q.x : q.z, (j % 2 == 0) ? q.y : q.w);
                }
            }
            // position g + BULK_X_AHEAD: of this slot, or of the next step's (zeros past K: a
            // slot's positions past its groups, or past the last step)
            if (g + BULK_X_AHEAD < BULK_SLOT_GROUPS)
                load_x_fragment(x_row, (g0 + g + BULK_X_AHEAD) * GROUP_COLS + x_col, k, MOE_SPLIT_X_L1, xs);
            else
                load_x_fragment(x_row_next, (next_part * BULK_SLOT_GROUPS + g + BULK_X_AHEAD - BULK_SLOT_GROUPS) * GROUP_COLS + x_col,
                                k, MOE_SPLIT_X_L1, xs);
        }
        x_row = x_row_next;
        warp_barrier();  // every lane has read the slot before lane 0 asks for its next bytes
        if (lane == 0 && step + SLOTS < steps) {
            bulk_fence_after_reads();
            fill(step + SLOTS);
        }
        if (part + 1u == parts) {
            #pragma unroll
            for (int p = 1; p < ACCUMULATORS; ++p)
                #pragma unroll
                for (int i = 0; i < 4; ++i) c[0][i] += c[p][i];
            if (GATE_UP) {
                // tile rows r / r + 8 are gate / up column 8 * tile + r (as expert_item)
                const u32 column = use.tile * (TILE_ROWS / 2) + lane / 4u;
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 row = 2u * (lane % 4u) + half;
                    if (row < use.meta.rows && column < a.inter)
                        a.act[(u64)(use.meta.position0 + row) * a.inter + column] =
                            f32_to_bf16(silu(c[0][half] * alpha0) * (c[0][2 + half] * alpha1));
                }
            } else {
                stream_store(a, use.tile, use.meta, alpha0, c[0]);
            }
        }
    }
}
{% endif %}

/// Every token's output rows: the routing-weighted sum of its k expert outputs in slot order,
/// plus the shared-expert scale times the sum of its sub-experts, plus the residual, rounded once
/// to bf16 (combine()'s sums in combine()'s order, so the same bits; 4 hidden rows per thread). The routing (two launches back) and the
/// residual load before the wait for the down launch.
FP4_DEVICE void moe_stream_combine_block(const MoeArgs& a) {
    __shared__ u32 slot_position[FP4_WARP_SIZE];
    __shared__ float slot_weight[FP4_WARP_SIZE];
    const u32 per_token = div_up(a.hidden, 4u * MOE_THREADS);
    const u32 t = block_x() / per_token, h = (block_x() % per_token) * 4u * MOE_THREADS + 4u * thread_x();
    const u32 k = a.top_k, H = a.hidden, T = a.tokens;
    if (thread_x() < k) {
        slot_position[thread_x()] = load_coherent_u32(a.slot_pos + t * k + thread_x());
        slot_weight[thread_x()] = load_coherent_f32(a.route_weight + t * k + thread_x());
    }
    const float shared_scale = a.shared_experts > 0u ? load_coherent_f32(a.shared_scale + t) : 0.0f;
    float residual[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool has_residual = a.residual != nullptr;
    if (has_residual && h < H) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) residual[i] = bf16_to_f32(a.residual[(u64)t * H + h + i]);
    }
    block_barrier();
    chain_after_previous_grid();
    if (h >= H) return;  // H is a multiple of 16: a thread's 4 rows are all in or all out
    // as in combine(): the shared expert's first sub-expert (dropped without one) and a batch of
    // slots' partials in flight together, one L2 round trip per COMBINE_BATCH slots
    const u32x4 shared_first = load_coherent_u32x4(a.partial + (u64)t * H + h);
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 j0 = 0; j0 < k; j0 += COMBINE_BATCH) {
        u32x4 part[COMBINE_BATCH];
        #pragma unroll
        for (int j = 0; j < COMBINE_BATCH; ++j)
            part[j] = load_coherent_u32x4(a.partial + (u64)slot_position[min_u32(j0 + j, k - 1)] * H + h);
        #pragma unroll
        for (int j = 0; j < COMBINE_BATCH; ++j) {
            // a guard, not a `break`: past a break ptxas sank each load to its use (8 round trips)
            if (j0 + j < k) {
                const u32x4& p = part[j];
                const float w = slot_weight[j0 + j];
                sum[0] += w * bits_to_f32(p.x); sum[1] += w * bits_to_f32(p.y);
                sum[2] += w * bits_to_f32(p.z); sum[3] += w * bits_to_f32(p.w);
            }
        }
    }
    if (a.shared_experts > 0u) {
        float shared[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 c = 0; c < a.shared_experts; ++c) {
            const u32x4 p = c == 0 ? shared_first : load_coherent_u32x4(a.partial + ((u64)c * T + t) * H + h);
            shared[0] += bits_to_f32(p.x); shared[1] += bits_to_f32(p.y);
            shared[2] += bits_to_f32(p.z); shared[3] += bits_to_f32(p.w);
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) sum[i] += shared_scale * shared[i];
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (has_residual) sum[i] += residual[i];  // added only where there is one, as combine()
        a.y[(u64)t * H + h + i] = f32_to_bf16(sum[i]);
    }
}
{% endif %}

// Kernels: expert weights NVFP4 or bf16, ROWS tokens per pass (the host picks the smallest
// variant that holds T; an expert with more tokens takes more passes).
{% for rows in target.moe.token_rows %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_BOUNDS) moe_nvfp4_m{{ rows }}(MOE_PARAMETERS) {
    chain_after_previous_grid();
    moe_block<ExpertNvfp4, {{ rows }}, {{ target.moe.stages_nvfp4 }}, {{ target.moe.router_stages }}>(MOE_ARGUMENTS);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_BOUNDS) moe_bf16_m{{ rows }}(MOE_PARAMETERS) {
    chain_after_previous_grid();
    moe_block<ExpertBf16, {{ rows }}, {{ target.moe.stages_bf16 }}, {{ target.moe.router_stages }}>(MOE_ARGUMENTS);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_BOUNDS) moe_route_m{{ rows }}(MOE_PARAMETERS) {
    moe_split_route<{{ rows }}, {{ target.moe.router_stages }}>(MOE_ARGUMENTS);
}
{% for format in ["nvfp4", "bf16"] %}{% if format == "nvfp4" %}{% set weights = "ExpertNvfp4" %}{% set stages = target.moe.stages_nvfp4 %}{% else %}{% set weights = "ExpertBf16" %}{% set stages = target.moe.stages_bf16 %}{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_SPLIT_BOUNDS) moe_{{ format }}_gate_up_m{{ rows }}(MOE_PARAMETERS) {
    moe_split_gate_up<{{ weights }}, {{ rows }}, {{ stages }}>(MOE_ARGUMENTS);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_SPLIT_BOUNDS) moe_{{ format }}_down_m{{ rows }}(MOE_PARAMETERS) {
    moe_split_down<{{ weights }}, {{ rows }}, {{ stages }}>(MOE_ARGUMENTS);
}
{% endfor %}{% endfor %}
{% if target.instructions.mma_sync_bf16 and target.instructions.cp_async %}
{% for format in ["nvfp4", "bf16"] %}{% if format == "nvfp4" %}{% set weights = "ExpertNvfp4" %}{% set stages = target.moe.stages_nvfp4 %}{% else %}{% set weights = "ExpertBf16" %}{% set stages = target.moe.stages_bf16 %}{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_SPLIT_BOUNDS) moe_{{ format }}_down_stream(MOE_PARAMETERS) {
    moe_stream_down<{{ weights }}, {{ stages }}>(MOE_ARGUMENTS);
}
{% endfor %}
{% if target.instructions.bulk_copy_mbarrier %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_BULK_BOUNDS) moe_nvfp4_gate_up_bulk(MOE_PARAMETERS) {
    moe_bulk_experts<true, {{ target.moe.gate_up_warps_per_tile }},
                     {{ target.moe.bulk_gate_up_slots }}>(MOE_ARGUMENTS);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_BULK_BOUNDS) moe_nvfp4_down_bulk(MOE_PARAMETERS) {
    moe_bulk_experts<false, 1, {{ target.moe.bulk_down_slots }}>(MOE_ARGUMENTS);
}
{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(MOE_THREADS) moe_stream_combine(MOE_PARAMETERS) {
    moe_stream_combine_block(MOE_ARGUMENTS);
}
{% endif %}
