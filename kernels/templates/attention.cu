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
//   attention_combine_gate  the splits merged, times sigmoid(gate), bf16 out for o_proj.
{% include "common/prelude.cuh" %}

#define ATTN_PREPARE_WARPS {{ target.attention.prepare_warps_per_block }}
#define ATTN_SPLIT {{ target.attention.split_positions }}
#define ATTN_COMBINE_WARPS {{ target.attention.combine_warps_per_block }}
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_MAX_ELEMS (ATTN_MAX_HEAD_DIM / FP4_WARP_SIZE)
#define ATTN_UNROLL 4
#define LOG2E 1.4426950408889634f
FP4_DEVICE float neg_inf() { return bits_to_f32(0xff800000u); }

// One warp per (row, head) item: items [0, rows*heads) are query heads, the next rows*kv_heads
// are KV heads. Lane l owns dimensions l, l + 32, ... (coalesced). RoPE pairs dimension j with
// j + rotary_half (j < rotary_half), read back through the warp's shared row after the norm.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_PREPARE_WARPS * FP4_WARP_SIZE) attention_prepare(
    const u16* __restrict__ q_gate, const u16* __restrict__ k, const u16* __restrict__ v,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    const float* __restrict__ rope, const u32* __restrict__ row_slot,
    const u32* __restrict__ row_pos, float* __restrict__ q_out, u16* __restrict__ k_cache,
    u16* __restrict__ v_cache, u32 rows, u32 heads, u32 kv_heads, u32 head_dim,
    u32 rotary_half, u32 capacity, float eps) {
    chain_after_previous_grid();
    __shared__ float normed[ATTN_PREPARE_WARPS][ATTN_MAX_HEAD_DIM];
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 item = block_x() * ATTN_PREPARE_WARPS + warp;
    if (item >= rows * (heads + kv_heads)) return;  // whole warps leave; no block barrier below
    const bool is_query = item < rows * heads;
    const u32 row = is_query ? item / heads : (item - rows * heads) / kv_heads;
    const u32 head = is_query ? item % heads : (item - rows * heads) % kv_heads;
    const u16* src = is_query ? q_gate + ((u64)row * heads + head) * 2 * head_dim
                              : k + ((u64)row * kv_heads + head) * head_dim;
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
    const u16* v_src = v + ((u64)row * kv_heads + head) * head_dim;
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        if (d < head_dim) {
            k_cache[at + d] = f32_to_bf16(x[i]);
            v_cache[at + d] = v_src[d];
        }
    }
}

/// `E` bf16 values at `p` as floats (16-, 8- or 4-byte loads where E allows; `p` is aligned to
/// E elements because head rows start at multiples of head_dim = 32 E).
template <int E>
FP4_DEVICE void load_bf16_row(float (&dst)[E], const u16* p) {
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

// The body of attention_decode for head_dim = 32 E: lane l owns dimensions [l E, l E + E).
// Every step issues the K and V rows of ATTN_UNROLL positions before using any of them (V does
// not depend on the scores), so a warp keeps 2 * ATTN_UNROLL row loads in flight.
template <int E>
FP4_DEVICE void decode_split(const float* q_row, const u16* k_base, const u16* v_base, u64 stride,
                             u32 start, u32 end, u32 lane, float* ml, float* acc_out) {
    const float scale = LOG2E / sqrt_f32((float)(E * FP4_WARP_SIZE));
    float qr[E], acc[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        qr[i] = q_row[lane * E + i] * scale;
        acc[i] = 0.0f;
    }
    float m = neg_inf(), l = 0.0f;
    for (u32 p = start; p < end; p += ATTN_UNROLL) {
        // positions past the end repeat the last one (uniform control flow) and get weight 0
        // through a score of -inf
        float kf[ATTN_UNROLL][E], vf[ATTN_UNROLL][E];
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const u64 at = (u64)(p + u < end ? p + u : end - 1) * stride + lane * E;
            load_bf16_row<E>(kf[u], k_base + at);
            load_bf16_row<E>(vf[u], v_base + at);
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
    if (lane == 0) {
        ml[0] = m;
        ml[1] = l;
    }
    #pragma unroll
    for (int i = 0; i < E; ++i) acc_out[lane * E + i] = acc[i];
}

// grid (splits, kv_heads, rows), one warp per query head of the group; head_dim a multiple of
// 32 up to 256 (checked on the host). Scores are taken in base 2 (q pre-scaled by
// log2(e) / sqrt(head_dim)).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(16 * FP4_WARP_SIZE) attention_decode(
    const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
    const u32* __restrict__ row_slot, const u32* __restrict__ row_pos,
    float* __restrict__ partial_ml, float* __restrict__ partial_acc, u32 heads, u32 kv_heads,
    u32 head_dim, u32 capacity, u32 splits) {
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
    const u32 end = start + ATTN_SPLIT < len ? start + ATTN_SPLIT : len;
    const u64 stride = (u64)kv_heads * head_dim;
    const u64 base = ((u64)row_slot[row] * capacity * kv_heads + kv_head) * head_dim;
    const float* q_row = q + ((u64)row * heads + head) * head_dim;
    float* ml = partial_ml + 2 * part;
    float* acc = partial_acc + part * head_dim;
    const u16* k = k_cache + base;
    const u16* v = v_cache + base;
    switch (head_dim / FP4_WARP_SIZE) {
        case 1: decode_split<1>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 2: decode_split<2>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 3: decode_split<3>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 4: decode_split<4>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 5: decode_split<5>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 6: decode_split<6>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        case 7: decode_split<7>(q_row, k, v, stride, start, end, lane, ml, acc); break;
        default: decode_split<8>(q_row, k, v, stride, start, end, lane, ml, acc); break;
    }
}

// One block per (row, query head): the row's splits merged, times sigmoid(gate), bf16 out.
// Every warp finds the max and the rescaled sum over all used splits (2 floats per split, cheap
// to repeat); the accumulators, 1 KiB per split at head_dim 256, are split across the warps (warp
// w takes splits w, w + ATTN_COMBINE_WARPS, ...) and their sums added through shared memory: at a
// long context a (row, head) has hundreds of splits, which one warp alone would read as a chain.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_COMBINE_WARPS * FP4_WARP_SIZE) attention_combine_gate(
    const float* __restrict__ partial_ml, const float* __restrict__ partial_acc,
    const u16* __restrict__ q_gate, const u32* __restrict__ row_pos, u16* __restrict__ out,
    u32 rows, u32 heads, u32 head_dim, u32 splits) {
    chain_after_previous_grid();
    __shared__ float warp_acc[ATTN_COMBINE_WARPS][ATTN_MAX_HEAD_DIM];
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 item = block_x();
    const u32 row = item / heads, head = item % heads;
    const u32 used_splits = (row_pos[row] + ATTN_SPLIT) / ATTN_SPLIT;  // splits holding positions
    const u32 used = used_splits < splits ? used_splits : splits;
    const u64 first = (u64)item * splits;
    float m = neg_inf();
    for (u32 s = lane; s < used; s += FP4_WARP_SIZE) {
        const float ms = partial_ml[2 * (first + s)];
        m = ms > m ? ms : m;
    }
    m = warp_max(m);
    float total = 0.0f;
    for (u32 s = lane; s < used; s += FP4_WARP_SIZE)
        total += partial_ml[2 * (first + s) + 1] * exp2_f32(partial_ml[2 * (first + s)] - m);
    total = warp_sum(total);
    float o[ATTN_MAX_ELEMS];
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) o[i] = 0.0f;
    for (u32 s = warp; s < used; s += ATTN_COMBINE_WARPS) {
        const float scale = exp2_f32(partial_ml[2 * (first + s)] - m);
        const float* acc = partial_acc + (first + s) * head_dim;
        #pragma unroll
        for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
            const u32 d = i * FP4_WARP_SIZE + lane;
            if (d < head_dim) o[i] += acc[d] * scale;
        }
    }
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) warp_acc[warp][i * FP4_WARP_SIZE + lane] = o[i];
    block_barrier();
    const u16* gate = q_gate + ((u64)row * heads + head) * 2 * head_dim + head_dim;
    for (u32 d = thread_x(); d < head_dim; d += ATTN_COMBINE_WARPS * FP4_WARP_SIZE) {
        float sum = 0.0f;
        #pragma unroll
        for (int w = 0; w < ATTN_COMBINE_WARPS; ++w) sum += warp_acc[w][d];
        const float g = bf16_to_f32(gate[d]);
        out[(u64)item * head_dim + d] = f32_to_bf16(sum / total / (1.0f + fast_exp(-g)));
    }
}
