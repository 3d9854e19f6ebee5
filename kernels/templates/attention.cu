// Family `attention`: the gated full attention of Qwen3.5-MoE on a KV cache (rendered for
// {{ target.name }}). CPU reference: src/kernels/attention/reference.rs. Launch:
// src/kernels/attention/mod.rs.
//
// Three kernels per layer and step, for any mix of rows (decode rows, verify rows, prefill rows;
// row r belongs to cache slot row_slot[r] at position row_pos[r] and attends over positions
// 0 ..= row_pos[r], which makes prefill causal and variable-length for free):
//   attention_prepare       q/k zero-centred RMSNorm per head, partial NeoX RoPE from a host
//                           table, k and v appended to the cache, q to an fp32 buffer;
//   attention_decode        split-K ("flash decoding"): each block takes one (split of
//                           ATTN_SPLIT positions, KV head, row) with one warp per query head of
//                           the GQA group, so K/V rows are fetched once per group; online
//                           softmax in base 2, partial (max, sum, acc) to a workspace;
//   attention_combine_gate  the splits merged, times sigmoid(gate), bf16 out for o_proj (a
//                           block per (row, head), or per part of its dimensions at small
//                           batches).
// The cache holds bf16, or float8_e4m3fn codes of value * (1 / scale) (one key scale and one
// value scale per layer): the prepare kernel takes the format as an argument, the split kernels come
// in both (attention_decode*_fp8 read e4m3 rows, half the bytes of bf16, and decode them exactly;
// the key scale multiplies q, the value scale the split's output).
{% include "common/prelude.cuh" %}
{% include "common/nvfp4.cuh" %}

#define ATTN_PREPARE_WARPS {{ target.attention.prepare_warps_per_block }}
#define ATTN_SPLIT {{ target.attention.split_positions }}
#define ATTN_COMBINE_WARPS {{ target.attention.combine_warps_per_block }}
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_MAX_ELEMS (ATTN_MAX_HEAD_DIM / FP4_WARP_SIZE)
#define ATTN_UNROLL 4
#define LOG2E 1.4426950408889634f
FP4_DEVICE float neg_inf() { return bits_to_f32(0xff800000u); }
// scores are taken in base 2: q . k times log2(e) / sqrt(head_dim)
FP4_DEVICE float score_scale(u32 head_dim) { return LOG2E / sqrt_f32((float)head_dim); }

// One warp per (row, head) item: items [0, rows*heads) are query heads, the next rows*kv_heads
// are KV heads. Lane l owns dimensions l, l + 32, ... (coalesced). RoPE pairs dimension j with
// j + rotary_half (j < rotary_half), read back through the warp's shared row after the norm.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_PREPARE_WARPS * FP4_WARP_SIZE) attention_prepare(
    const u16* __restrict__ q_gate, const u16* __restrict__ k, const u16* __restrict__ v,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    const float* __restrict__ rope, const u32* __restrict__ row_slot,
    const u32* __restrict__ row_pos, float* __restrict__ q_out, void* __restrict__ k_cache,
    void* __restrict__ v_cache, u32 rows, u32 q_stride, u32 k_stride, u32 v_stride, u32 heads, u32 kv_heads, u32 head_dim,
    u32 rotary_half, u32 capacity, float eps, u32 kv_fp8, float key_inverse, float value_inverse) {
    chain_after_previous_grid();
    __shared__ float normed[ATTN_PREPARE_WARPS][ATTN_MAX_HEAD_DIM];
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 item = block_x() * ATTN_PREPARE_WARPS + warp;
    if (item >= rows * (heads + kv_heads)) return;  // whole warps leave; no block barrier below
    const bool is_query = item < rows * heads;
    const u32 row = is_query ? item / heads : (item - rows * heads) / kv_heads;
    const u32 head = is_query ? item % heads : (item - rows * heads) % kv_heads;
    const u16* src = is_query ? q_gate + (u64)row * q_stride + (u64)head * 2 * head_dim
                              : k + (u64)row * k_stride + (u64)head * head_dim;
    const float* weight = is_query ? q_norm : k_norm;
    float x[ATTN_MAX_ELEMS];
    float sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        x[i] = d < head_dim ? bf16_to_f32(src[d]) : 0.0f;
        sum += x[i] * x[i];
    }
    const float inv = 1.0f / sqrt_f32(warp_sum(sum) / (float)head_dim + eps);
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        if (d < head_dim) {
            x[i] *= inv * (1.0f + weight[d]);
            normed[warp][d] = x[i];
        }
    }
    warp_barrier();
    const u32 pos = row_pos[row];
    const float* cos_sin = rope + (u64)pos * rotary_half * 2;
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        if (d < 2 * rotary_half) {
            const u32 j = d % rotary_half;
            const float c = cos_sin[2 * j], s = cos_sin[2 * j + 1];
            x[i] = d < rotary_half ? x[i] * c - normed[warp][d + rotary_half] * s
                                   : x[i] * c + normed[warp][d - rotary_half] * s;
        }
    }
    if (is_query) {
        float* dst = q_out + ((u64)row * heads + head) * head_dim;
        #pragma unroll
        for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
            const u32 d = i * FP4_WARP_SIZE + lane;
            if (d < head_dim) dst[d] = x[i];
        }
        return;
    }
    const u64 at = (((u64)row_slot[row] * capacity + pos) * kv_heads + head) * head_dim;
    const u16* v_src = v + (u64)row * v_stride + (u64)head * head_dim;
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        if (d >= head_dim) continue;
        if (kv_fp8) {
            // value times the f32 inverse of its scale, then to e4m3 (the reference's arithmetic)
            static_cast<u8*>(k_cache)[at + d] = (u8)f32_to_e4m3(x[i] * key_inverse);
            static_cast<u8*>(v_cache)[at + d] = (u8)f32_to_e4m3(bf16_to_f32(v_src[d]) * value_inverse);
        } else {
            static_cast<u16*>(k_cache)[at + d] = f32_to_bf16(x[i]);
            static_cast<u16*>(v_cache)[at + d] = v_src[d];
        }
    }
}

/// `E` cached values at `p` as floats, bf16 (16-, 8- or 4-byte loads where E allows; `p` is
/// aligned to E elements because head rows start at multiples of head_dim = 32 E) or e4m3 codes
/// (8- or 4-byte loads where E allows).
template <int E>
FP4_DEVICE void load_kv_row(float (&dst)[E], const u16* p) {
    if constexpr (E % 8 == 0) {
        #pragma unroll
        for (int c = 0; c < E / 8; ++c) {
            const u32x4 v = load_u32x4(p + 8 * c);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                dst[8 * c + 2 * i] = bits_to_f32(w[i] << 16);
                dst[8 * c + 2 * i + 1] = bits_to_f32(w[i] & 0xffff0000u);
            }
        }
    } else if constexpr (E % 4 == 0) {
        #pragma unroll
        for (int c = 0; c < E / 4; ++c) {
            const u32x2 v = load_u32x2(p + 4 * c);
            dst[4 * c] = bits_to_f32(v.x << 16);
            dst[4 * c + 1] = bits_to_f32(v.x & 0xffff0000u);
            dst[4 * c + 2] = bits_to_f32(v.y << 16);
            dst[4 * c + 3] = bits_to_f32(v.y & 0xffff0000u);
        }
    } else {
        #pragma unroll
        for (int i = 0; i < E; ++i) dst[i] = bf16_to_f32(p[i]);
    }
}
template <int E>
FP4_DEVICE void load_kv_row(float (&dst)[E], const u8* p) {
    if constexpr (E % 4 == 0) {
        u32 w[E / 4];
        if constexpr (E == 8) {
            const u32x2 v = load_u32x2(p);
            w[0] = v.x;
            w[1] = v.y;
        } else {
            #pragma unroll
            for (int c = 0; c < E / 4; ++c) w[c] = *reinterpret_cast<const u32*>(p + 4 * c);
        }
        #pragma unroll
        for (int i = 0; i < E; ++i) dst[i] = e4m3_to_f32((w[i / 4] >> (8 * (i % 4))) & 0xffu);
    } else {
        #pragma unroll
        for (int i = 0; i < E; ++i) dst[i] = e4m3_to_f32(p[i]);
    }
}

// The body of attention_decode for head_dim = 32 E: lane l owns dimensions [l E, l E + E); the
// chunks of ATTN_SPLIT positions from `start`, `split_stride` apart, below `len`.
// Every step issues the K and V rows of ATTN_UNROLL positions before using any of them (V does
// not depend on the scores), so a warp keeps 2 * ATTN_UNROLL row loads in flight. KV: u16 (bf16
// cache) or u8 (e4m3 codes of value * (1 / scale)).
template <int E, class KV>
FP4_DEVICE void decode_split(const float* q_row, const KV* k_base, const KV* v_base, u64 stride,
                             u32 start, u32 len, u32 split_stride, u32 lane, float key_scale,
                             float value_scale, float* ml, float* acc_out) {
    const float scale = score_scale(E * FP4_WARP_SIZE) * key_scale;
    float qr[E], acc[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        qr[i] = q_row[lane * E + i] * scale;
        acc[i] = 0.0f;
    }
    float m = neg_inf(), l = 0.0f;
    for (u32 chunk = start; chunk < len; chunk += split_stride) {
        for (u32 p = chunk, end = min_u32(len, chunk + ATTN_SPLIT); p < end; p += ATTN_UNROLL) {
            // positions past the end repeat the last one (uniform control flow) and get weight 0
            // through a score of -inf
            float kf[ATTN_UNROLL][E], vf[ATTN_UNROLL][E];
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                const u64 at = (u64)(p + u < end ? p + u : end - 1) * stride + lane * E;
                load_kv_row<E>(kf[u], k_base + at);
                load_kv_row<E>(vf[u], v_base + at);
            }
            float s[ATTN_UNROLL];
            float m_new = m;
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                float dot = 0.0f;
                #pragma unroll
                for (int i = 0; i < E; ++i) dot += qr[i] * kf[u][i];
                s[u] = warp_sum(dot);
                if (p + u >= end) s[u] = neg_inf();
                m_new = s[u] > m_new ? s[u] : m_new;
            }
            const float correction = exp2_f32(m - m_new);
            l *= correction;
            #pragma unroll
            for (int i = 0; i < E; ++i) acc[i] *= correction;
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                const float w = exp2_f32(s[u] - m_new);
                l += w;
                #pragma unroll
                for (int i = 0; i < E; ++i) acc[i] += w * vf[u][i];
            }
            m = m_new;
        }
    }
    if (lane == 0) {
        ml[0] = m;
        ml[1] = l;
    }
    #pragma unroll
    for (int i = 0; i < E; ++i) acc_out[lane * E + i] = acc[i] * value_scale;
}

// grid (splits, kv_heads, rows), one warp per query head of the group; split s takes the chunks
// of ATTN_SPLIT positions s, s + splits, ... (as decode_mma); head_dim a multiple of 32 up to
// 256 (checked on the host). Scores are taken in base 2 (q pre-scaled by log2(e) /
// sqrt(head_dim) and the key scale).
template <class KV>
FP4_DEVICE void decode_warps(const float* q, const KV* k_cache, const KV* v_cache, const u32* row_slot,
                             const u32* row_pos, float* partial_ml, float* partial_acc, u32 heads, u32 kv_heads,
                             u32 head_dim, u32 capacity, u32 splits, float key_scale, float value_scale) {
    chain_after_previous_grid();
    const u32 split = block_x(), kv_head = block_y(), row = block_z();
    const u32 group = heads / kv_heads;
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 head = kv_head * group + warp;
    const u64 part = ((u64)row * heads + head) * splits + split;
    const u32 len = row_pos[row] + 1;
    const u32 start = split * ATTN_SPLIT;
    if (start >= len) {
        if (lane == 0) {
            partial_ml[2 * part] = neg_inf();
            partial_ml[2 * part + 1] = 0.0f;
        }
        return;
    }
    const u32 split_stride = splits * ATTN_SPLIT;
    const u64 stride = (u64)kv_heads * head_dim;
    const u64 base = ((u64)row_slot[row] * capacity * kv_heads + kv_head) * head_dim;
    const float* q_row = q + ((u64)row * heads + head) * head_dim;
    float* ml = partial_ml + 2 * part;
    float* acc = partial_acc + part * head_dim;
    const KV* k = k_cache + base;
    const KV* v = v_cache + base;
    const float ks = key_scale, vs = value_scale;
    switch (head_dim / FP4_WARP_SIZE) {
        case 1: decode_split<1>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 2: decode_split<2>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 3: decode_split<3>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 4: decode_split<4>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 5: decode_split<5>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 6: decode_split<6>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        case 7: decode_split<7>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
        default: decode_split<8>(q_row, k, v, stride, start, len, split_stride, lane, ks, vs, ml, acc); break;
    }
}

// attention_decode: a bf16 cache; attention_decode_fp8: e4m3 codes
{% for kv in ["u16", "u8"] %}{% if kv == "u8" %}{% set suffix = "_fp8" %}{% else %}{% set suffix = "" %}{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(16 * FP4_WARP_SIZE) attention_decode{{ suffix }}(
    const float* __restrict__ q, const {{ kv }}* __restrict__ k_cache, const {{ kv }}* __restrict__ v_cache,
    const u32* __restrict__ row_slot, const u32* __restrict__ row_pos,
    float* __restrict__ partial_ml, float* __restrict__ partial_acc, u32 heads, u32 kv_heads,
    u32 head_dim, u32 capacity, u32 splits, float key_scale, float value_scale) {
    decode_warps(q, k_cache, v_cache, row_slot, row_pos, partial_ml, partial_acc, heads, kv_heads, head_dim,
                 capacity, splits, key_scale, value_scale);
}
{% endfor %}

{% if target.instructions.mma_sync_bf16 and target.instructions.cp_async %}
// ============================================================================================
// attention_decode_mma_g*: attention_decode's blocks and partials, for targets with mma.sync and
// cp.async. attention_decode's warps each walk the whole split with 2 * ATTN_UNROLL row loads in
// flight, and the group's warps load the SAME rows, so a block has ~8 KiB of distinct KV in flight
// and a long context runs at a fraction of the bandwidth (H200, 20000 positions: ~80 us per layer
// at B = 1 for 41 MB). Here every thread copies its share of the split's K and V rows into shared
// memory at once (cp.async: the whole split, 64 KiB at head_dim 256, in flight per block; the
// warps split their q fragments into registers meanwhile), and both products run on the tensor
// cores, positions as the M dimension and the group's query heads as N (n8 tiles, a group of up to
// 16 heads in two):
//   scores[pos][head] = K[pos][:] . q[head][:]   (A = K rows, ldmatrix; B = q, in registers)
//   out[dim][head]    = sum_pos V[pos][dim] p[head][pos]   (A = V^T, ldmatrix.trans; B = p)
// q and p are fp32 values split into bf16 hi + lo halves, each product run on both (the error of
// hi + lo is ~2^-17 relative), so the result keeps attention_decode's fp32 accuracy with bf16 MMAs.
// No L2 prefetch of the rows before the grid wait (the GEMMs' trick): asking the L2 for them and
// then copying them cost 12% at B = 64 and 20000 positions (H200, seventh session).
// ============================================================================================
{% include "common/block_mma.cuh" %}
{% include "common/cp_async.cuh" %}
#define ATTN_MMA_WARPS 8
#define ATTN_POS_TILES (ATTN_SPLIT / 16)
// warps sharing one 16-position tile of the scores (they split its k16 steps over head_dim)
#define ATTN_K_PARTS (ATTN_MMA_WARPS / ATTN_POS_TILES)
// staged K / V rows hold head_dim + 8 bf16: rows 16 bytes apart in the banks, so the 8 rows of
// an ldmatrix hit distinct banks (head_dim is a multiple of 32)
#define ATTN_ROW_PAD 8
// p rows (per head, bf16) likewise: ATTN_SPLIT + 8
#define ATTN_P_PAD 8
static_assert(ATTN_SPLIT % 32 == 0 && ATTN_MMA_WARPS % ATTN_POS_TILES == 0,
              "split_positions: a multiple of 32 whose 16-position tiles divide the warps");

/// `v` as bf16 hi + lo halves packed in pairs with `w`: {hi(v), hi(w)} and {lo(v), lo(w)}.
FP4_DEVICE void split_bf16_pair(float v, float w, u32& hi, u32& lo) {
    const u16 hv = f32_to_bf16(v), hw = f32_to_bf16(w);
    hi = (u32)hv | ((u32)hw << 16);
    lo = (u32)f32_to_bf16(v - bf16_to_f32(hv)) | ((u32)f32_to_bf16(w - bf16_to_f32(hw)) << 16);
}

// 16-byte pieces of e4m3 rows each thread of an mma block loads per cache (K or V), at most
#define ATTN_FP8_PIECES (ATTN_SPLIT * ATTN_MAX_HEAD_DIM / 16 / (ATTN_MMA_WARPS * FP4_WARP_SIZE))
static_assert(ATTN_FP8_PIECES > 0, "split_positions: at least one e4m3 piece per thread");

// The body of attention_decode_mma_g{8,16}[_fp8]: a group of up to 8 NT heads (NT n8 tiles).
// grid (kv_heads, splits, rows), ATTN_MMA_WARPS warps. The cache is cut in chunks of ATTN_SPLIT
// positions and split s takes the chunks s, s + splits, s + 2 splits, ... below the row's
// length, one after another with a running (max, sum) per head and the output in registers,
// rescaled per chunk (online softmax): with as many splits as chunks (small batches) a block
// takes one chunk, with fewer (the host's choice at large batches) a long context writes and
// merges one partial per split instead of one per chunk, and a short one still spreads its few
// chunks over the splits. Dynamic shared memory (bytes, as
// src/kernels/attention/mod.rs sizes it): K rows, V rows [ATTN_SPLIT][head_dim + ATTN_ROW_PAD]
// bf16, scores [ATTN_K_PARTS][8 NT][ATTN_SPLIT] f32, p hi and lo [8 NT][ATTN_SPLIT + ATTN_P_PAD]
// bf16. KV: u16 (a bf16 cache, copied by cp.async) or u8 (e4m3 codes: every thread loads its
// pieces of the chunk's rows into registers at once, 16 bytes each, and writes them to the same
// bf16 rows, decoded exactly; the key scale multiplies q, the value scale the output).
template <int NT, class KV>
FP4_DEVICE void decode_mma(const float* q, const KV* k_cache, const KV* v_cache, const u32* row_slot,
                           const u32* row_pos, float* partial_ml, float* partial_acc, u32 heads, u32 kv_heads,
                           u32 head_dim, u32 capacity, u32 splits, float key_scale, float value_scale,
                           u8* attention_shared) {
    constexpr bool FP8 = sizeof(KV) == 1;
    // k16 steps of the scores per warp, at most (ATTN_K_PARTS warps share a position tile)
    constexpr int STEPS = ATTN_MAX_HEAD_DIM / 16 / ATTN_K_PARTS;
    // 16-dimension tiles of the output per warp, at most
    constexpr int D_TILES = (ATTN_MAX_HEAD_DIM / 16 + ATTN_MMA_WARPS - 1) / ATTN_MMA_WARPS;
    constexpr u32 THREADS = ATTN_MMA_WARPS * FP4_WARP_SIZE;
    // the KV heads of a split are neighbours in the grid (they read the two halves of the same
    // cache rows; no faster than splits first on the H200, seventh session)
    const u32 kv_head = block_x(), split = block_y(), row = block_z();
    const u32 group = heads / kv_heads;
    const u32 warp = thread_x() / FP4_WARP_SIZE, lane = thread_x() % FP4_WARP_SIZE;
    const u32 g = lane / 4, t = lane % 4;
    const u32 tile = warp % ATTN_POS_TILES, part = warp / ATTN_POS_TILES;
    const u64 first_part = ((u64)row * heads + kv_head * group) * splits + split;  // head 0 of the group
    // row_slot / row_pos come from launches before the previous one: final before the wait
    const u32 len = row_pos[row] + 1;
    if (split * ATTN_SPLIT >= len) {
        chain_after_previous_grid();
        for (u32 h = thread_x(); h < group; h += THREADS) {
            partial_ml[2 * (first_part + (u64)h * splits)] = neg_inf();
            partial_ml[2 * (first_part + (u64)h * splits) + 1] = 0.0f;
        }
        return;
    }
    const u64 stride = (u64)kv_heads * head_dim;
    const u64 base = (u64)row_slot[row] * capacity * stride + (u64)kv_head * head_dim;
    chain_after_previous_grid();

    const u32 row_elems = head_dim + ATTN_ROW_PAD, p_elems = ATTN_SPLIT + ATTN_P_PAD;
    u16* const k_rows = reinterpret_cast<u16*>(attention_shared);
    u16* const v_rows = k_rows + ATTN_SPLIT * row_elems;
    float* const scores = reinterpret_cast<float*>(v_rows + ATTN_SPLIT * row_elems);
    u16* const p_hi = reinterpret_cast<u16*>(scores + ATTN_K_PARTS * 8 * NT * ATTN_SPLIT);
    u16* const p_lo = p_hi + 8 * NT * p_elems;
    // per head of the group: the running max and sum, and the factor this chunk rescales by
    __shared__ float run_m[8 * NT], run_l[8 * NT], rescale[8 * NT];

    // A chunk's rows, 16 bytes per copy or load; positions past the context are zero (their
    // scores are masked, and zeros keep NaN out of the products). issue() starts the copies
    // (bf16) or loads into registers (e4m3); land() finishes them into the bf16 rows.
    const u32 pieces = head_dim / (16 / sizeof(KV));  // per row
    u32x4 k_codes[FP8 ? ATTN_FP8_PIECES : 1], v_codes[FP8 ? ATTN_FP8_PIECES : 1];
    auto issue = [&](u32 chunk_start) {
        const u32 count = min_u32(ATTN_SPLIT, len - chunk_start);
        const u64 chunk_base = base + (u64)chunk_start * stride;
        if constexpr (FP8) {
            #pragma unroll
            for (int j = 0; j < ATTN_FP8_PIECES; ++j) {
                const u32 i = thread_x() + j * THREADS, pos = i / pieces;
                k_codes[j] = v_codes[j] = {0u, 0u, 0u, 0u};
                if (pos < count) {
                    const u64 at = chunk_base + (u64)pos * stride + 16 * (i % pieces);
                    k_codes[j] = load_u32x4(k_cache + at);
                    v_codes[j] = load_u32x4(v_cache + at);
                }
            }
        } else {
            for (u32 i = thread_x(); i < ATTN_SPLIT * pieces; i += THREADS) {
                const u32 pos = i / pieces, c = i % pieces;
                const u64 at = chunk_base + (u64)(pos < count ? pos : 0u) * stride + 8 * c;
                const u32 bytes = pos < count ? 16u : 0u;
                cp_async16_zfill(k_rows + pos * row_elems + 8 * c, k_cache + at, bytes);
                cp_async16_zfill(v_rows + pos * row_elems + 8 * c, v_cache + at, bytes);
            }
            cp_async_commit();
        }
    };
    auto land = [&]() {
        if constexpr (FP8) {
            // 16 codes -> 16 bf16 (32 bytes) at the piece's place in its row
            #pragma unroll
            for (int j = 0; j < ATTN_FP8_PIECES; ++j) {
                const u32 i = thread_x() + j * THREADS, pos = i / pieces;
                if (pos >= ATTN_SPLIT) continue;
                const u32 at = pos * row_elems + 16 * (i % pieces);
                const u32 k_words[4] = {k_codes[j].x, k_codes[j].y, k_codes[j].z, k_codes[j].w};
                const u32 v_words[4] = {v_codes[j].x, v_codes[j].y, v_codes[j].z, v_codes[j].w};
                u32 k_out[8], v_out[8];
                #pragma unroll
                for (int w = 0; w < 4; ++w) {
                    e4m3x4_to_bf16x4(k_words[w], k_out[2 * w], k_out[2 * w + 1]);
                    e4m3x4_to_bf16x4(v_words[w], v_out[2 * w], v_out[2 * w + 1]);
                }
                store_u32x4(k_rows + at, {k_out[0], k_out[1], k_out[2], k_out[3]});
                store_u32x4(k_rows + at + 8, {k_out[4], k_out[5], k_out[6], k_out[7]});
                store_u32x4(v_rows + at, {v_out[0], v_out[1], v_out[2], v_out[3]});
                store_u32x4(v_rows + at + 8, {v_out[4], v_out[5], v_out[6], v_out[7]});
            }
        } else {
            cp_async_wait<0>();
        }
        block_barrier();
    };
    issue(split * ATTN_SPLIT);
    if (thread_x() < 8 * NT) {
        run_m[thread_x()] = neg_inf();
        run_l[thread_x()] = 0.0f;
    }

    // while the rows arrive: this warp's q fragments (the B operand of its k16 steps part, part +
    // ATTN_K_PARTS, ...), scaled, as bf16 hi / lo pairs {b0, b1}; zero past head_dim and the group
    const float scale = score_scale(head_dim) * key_scale;
    const float* q_group = q + ((u64)row * heads + kv_head * group) * head_dim;
    u32 q_hi[STEPS][NT][2], q_lo[STEPS][NT][2];
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const u32 k0 = 16 * (part + ATTN_K_PARTS * i);
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 head = 8 * nt + g;
            q_hi[i][nt][0] = q_hi[i][nt][1] = q_lo[i][nt][0] = q_lo[i][nt][1] = 0u;
            if (k0 < head_dim && head < group) {
                const float* qh = q_group + (u64)head * head_dim + k0 + 2 * t;
                const u32x2 q0 = load_u32x2(qh), q1 = load_u32x2(qh + 8);
                split_bf16_pair(bits_to_f32(q0.x) * scale, bits_to_f32(q0.y) * scale, q_hi[i][nt][0], q_lo[i][nt][0]);
                split_bf16_pair(bits_to_f32(q1.x) * scale, bits_to_f32(q1.y) * scale, q_hi[i][nt][1], q_lo[i][nt][1]);
            }
        }
    }

    // out^T[dim][head], this warp's 16-dimension tiles warp, warp + ATTN_MMA_WARPS, ...
    float out[D_TILES][NT][4] = {};
    const u32 split_stride = splits * ATTN_SPLIT;  // from one chunk of this split to the next
    for (u32 chunk_start = split * ATTN_SPLIT; chunk_start < len; chunk_start += split_stride) {
        const u32 count = min_u32(ATTN_SPLIT, len - chunk_start);
        land();

        // scores: warp (position tile, k part) takes the k16 steps part, part + ATTN_K_PARTS, ...
        {
            float acc[NT][4] = {};
            #pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                const u32 k0 = 16 * (part + ATTN_K_PARTS * i);
                if (k0 < head_dim) {
                    u32 a[4];
                    load_a_fragment<false>(a, k_rows, row_elems, 16 * tile, k0);
                    #pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        mma_bf16_m16n8k16(acc[nt], a, q_hi[i][nt][0], q_hi[i][nt][1]);
                        mma_bf16_m16n8k16(acc[nt], a, q_lo[i][nt][0], q_lo[i][nt][1]);
                    }
                }
            }
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i)
                    scores[(part * 8 * NT + acc_col(lane, nt, i)) * ATTN_SPLIT + 16 * tile + acc_row(lane, i)] =
                        acc[nt][i];
        }
        block_barrier();

        // softmax in base 2 per head (a warp each), online over the chunks: the new running max,
        // the factor the output so far is rescaled by, the running sum, and p = 2^(s - max) as
        // bf16 hi + lo for the second product
        for (u32 h = warp; h < group; h += ATTN_MMA_WARPS) {
            float s[ATTN_SPLIT / FP4_WARP_SIZE];
            float m = run_m[h];
            #pragma unroll
            for (int j = 0; j < ATTN_SPLIT / FP4_WARP_SIZE; ++j) {
                const u32 pos = j * FP4_WARP_SIZE + lane;
                float sum = 0.0f;
                #pragma unroll
                for (u32 kp = 0; kp < ATTN_K_PARTS; ++kp) sum += scores[(kp * 8 * NT + h) * ATTN_SPLIT + pos];
                s[j] = pos < count ? sum : neg_inf();
                m = s[j] > m ? s[j] : m;
            }
            m = warp_max(m);
            float l = 0.0f;
            #pragma unroll
            for (int j = 0; j < ATTN_SPLIT / FP4_WARP_SIZE; ++j) {
                const u32 pos = j * FP4_WARP_SIZE + lane;
                const float p = exp2_f32(s[j] - m);
                l += p;
                const u16 hi = f32_to_bf16(p);
                p_hi[h * p_elems + pos] = hi;
                p_lo[h * p_elems + pos] = f32_to_bf16(p - bf16_to_f32(hi));
            }
            l = warp_sum(l);
            warp_barrier();  // every lane has read run_m[h]
            if (lane == 0) {
                const float factor = exp2_f32(run_m[h] - m);  // 0 at the first chunk (-inf)
                rescale[h] = factor;
                run_l[h] = run_l[h] * factor + l;
                run_m[h] = m;
            }
        }
        block_barrier();

        // out^T += V^T p, after rescaling what the earlier chunks left
        #pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
            const u32 d0 = 16 * (warp + ATTN_MMA_WARPS * dt);
            if (d0 >= head_dim) continue;
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) out[dt][nt][i] *= rescale[acc_col(lane, nt, i)];
            #pragma unroll
            for (u32 p0 = 0; p0 < ATTN_SPLIT; p0 += 16) {
                u32 a[4];
                load_a_fragment<true>(a, v_rows, row_elems, d0, p0);
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    // heads past the group hold stale p: their columns are never stored
                    const u32 at = (8 * nt + g) * p_elems + p0 + 2 * t;
                    mma_bf16_m16n8k16(out[dt][nt], a, *reinterpret_cast<const u32*>(p_hi + at),
                                      *reinterpret_cast<const u32*>(p_hi + at + 8));
                    mma_bf16_m16n8k16(out[dt][nt], a, *reinterpret_cast<const u32*>(p_lo + at),
                                      *reinterpret_cast<const u32*>(p_lo + at + 8));
                }
            }
        }
        block_barrier();  // the rows, scores and p are free for the next chunk
        if (chunk_start + split_stride < len) issue(chunk_start + split_stride);
    }

    if (thread_x() < group) {
        partial_ml[2 * (first_part + (u64)thread_x() * splits)] = run_m[thread_x()];
        partial_ml[2 * (first_part + (u64)thread_x() * splits) + 1] = run_l[thread_x()];
    }
    #pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt) {
        const u32 d0 = 16 * (warp + ATTN_MMA_WARPS * dt);
        if (d0 >= head_dim) continue;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 head = acc_col(lane, nt, i);
                if (head < group)
                    partial_acc[(first_part + (u64)head * splits) * head_dim + d0 + acc_row(lane, i)] =
                        out[dt][nt][i] * value_scale;
            }
    }
}

// attention_decode_mma_g8: groups of 1 to 8 query heads per KV head (one n8 tile); _g16: 9 to
// 16; _fp8: the same over e4m3 codes
{% for tiles in [1, 2] %}{% for kv in ["u16", "u8"] %}{% if kv == "u8" %}{% set suffix = "_fp8" %}{% else %}{% set suffix = "" %}{% endif %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_MMA_WARPS * FP4_WARP_SIZE) attention_decode_mma_g{{ 8 * tiles }}{{ suffix }}(
    const float* __restrict__ q, const {{ kv }}* __restrict__ k_cache, const {{ kv }}* __restrict__ v_cache,
    const u32* __restrict__ row_slot, const u32* __restrict__ row_pos,
    float* __restrict__ partial_ml, float* __restrict__ partial_acc, u32 heads, u32 kv_heads,
    u32 head_dim, u32 capacity, u32 splits, float key_scale, float value_scale) {
    extern __shared__ __align__(16) u8 attention_shared[];
    decode_mma<{{ tiles }}>(q, k_cache, v_cache, row_slot, row_pos, partial_ml, partial_acc, heads, kv_heads,
                            head_dim, capacity, splits, key_scale, value_scale, attention_shared);
}
{% endfor %}{% endfor %}
{% endif %}

// One block per (row, query head, dims_per_block dimensions): the row's splits merged, times
// sigmoid(gate), bf16 out. Every warp finds the max and the rescaled sum over all used splits (2
// floats per split, cheap to repeat; one pass, each lane's splits merged online); the
// accumulators are split across the warps (warp w takes splits w, w + ATTN_COMBINE_WARPS, ...;
// lane l dimensions l, l + 32, ... of the block's range) and their sums added through shared
// memory. After the row's position, every load that depends on nothing else is requested at
// once: each lane's first (max, sum), each warp's first accumulator slice and each thread's gate,
// so a row of up to 32 splits waits for one round trip to the L2 instead of four (max, sum,
// accumulators, gate one after another). At a long context a (row, head) has hundreds of splits
// (313 at 20000 positions): at small batches the host cuts each head's dimensions over several
// blocks so those reads spread over the SMs (one block per (row, head) read them as chains of 40
// loads per warp on 16 SMs at B = 1), at large batches one block takes a head.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_COMBINE_WARPS * FP4_WARP_SIZE) attention_combine_gate(
    const float* __restrict__ partial_ml, const float* __restrict__ partial_acc,
    const u16* __restrict__ q_gate, const u32* __restrict__ row_pos, u16* __restrict__ out,
    u32 rows, u32 q_stride, u32 heads, u32 head_dim, u32 splits, u32 dims_per_block) {
    chain_after_previous_grid();
    __shared__ float warp_acc[ATTN_COMBINE_WARPS][ATTN_MAX_HEAD_DIM];
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 item = block_x(), d0 = block_y() * dims_per_block;
    const u32 d1 = min_u32(head_dim, d0 + dims_per_block);
    const u32 row = item / heads, head = item % heads;
    const u32 used_splits = (row_pos[row] + ATTN_SPLIT) / ATTN_SPLIT;  // splits holding positions
    const u32 used = used_splits < splits ? used_splits : splits;
    const u64 first = (u64)item * splits;
    // the gates of the thread's output dimensions d0 + thread_x(), + the block's threads, ...
    constexpr u32 threads = ATTN_COMBINE_WARPS * FP4_WARP_SIZE;
    constexpr u32 outs = (ATTN_MAX_HEAD_DIM + threads - 1) / threads;
    const u16* gate = q_gate + (u64)row * q_stride + (u64)head * 2 * head_dim + head_dim;
    float g[outs];
    #pragma unroll
    for (u32 j = 0; j < outs; ++j) {
        const u32 d = d0 + thread_x() + j * threads;
        g[j] = d < d1 ? bf16_to_f32(gate[d]) : 0.0f;
    }
    u32x2 ml = {0xff800000u, 0u};  // (-inf, 0): no split
    if (lane < used) ml = load_u32x2(partial_ml + 2 * (first + lane));
    float acc0[ATTN_MAX_ELEMS];
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = d0 + i * FP4_WARP_SIZE + lane;
        acc0[i] = warp < used && d < d1 ? partial_acc[(first + warp) * head_dim + d] : 0.0f;
    }
    const float first_max = bits_to_f32(ml.x);  // of split `lane`
    float m = first_max, l = bits_to_f32(ml.y);
    for (u32 s = lane + FP4_WARP_SIZE; s < used; s += FP4_WARP_SIZE) {
        const float ms = partial_ml[2 * (first + s)], ls = partial_ml[2 * (first + s) + 1];
        if (ms > m) {
            l = l * exp2_f32(m - ms) + ls;
            m = ms;
        } else if (ms > neg_inf()) {  // a split of no score adds nothing (and -inf - -inf is NaN)
            l += ls * exp2_f32(ms - m);
        }
    }
    const float row_max = warp_max(m);
    const float total = warp_sum(l * exp2_f32(m - row_max));  // lanes without a split add 0
    const auto split_scale = [&](u32 s) {
        return s < FP4_WARP_SIZE ? exp2_f32(bits_to_f32(shuffle_from(f32_to_bits(first_max), s)) - row_max)
                                 : exp2_f32(partial_ml[2 * (first + s)] - row_max);
    };
    float o[ATTN_MAX_ELEMS];
    {
        // every lane asks (shuffles are warp-wide); only the warp's own first split counts
        const float scale = split_scale(warp < FP4_WARP_SIZE ? warp : 0u);
        #pragma unroll
        for (int i = 0; i < ATTN_MAX_ELEMS; ++i) o[i] = warp < used ? acc0[i] * scale : 0.0f;
    }
    // two splits per step: left to the compiler's own unrolling, this loop spilled 4 bytes on sm_121a
    #pragma unroll 2
    for (u32 s = warp + ATTN_COMBINE_WARPS; s < used; s += ATTN_COMBINE_WARPS) {
        const float scale = split_scale(s);
        const float* acc = partial_acc + (first + s) * head_dim;
        #pragma unroll
        for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
            const u32 d = d0 + i * FP4_WARP_SIZE + lane;
            if (d < d1) o[i] += acc[d] * scale;
        }
    }
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) warp_acc[warp][i * FP4_WARP_SIZE + lane] = o[i];
    block_barrier();
    #pragma unroll
    for (u32 j = 0; j < outs; ++j) {
        const u32 d = d0 + thread_x() + j * threads;
        if (d >= d1) break;
        float sum = 0.0f;
        #pragma unroll
        for (int w = 0; w < ATTN_COMBINE_WARPS; ++w) sum += warp_acc[w][d - d0];
        out[(u64)item * head_dim + d] = f32_to_bf16(sum / total / (1.0f + fast_exp(-g[j])));
    }
}
