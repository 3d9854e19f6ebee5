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

// grid (splits, kv_heads, rows), one warp per query head of the group. Scores are taken in base
// 2 (q pre-scaled by log2(e) / sqrt(head_dim)); ATTN_UNROLL positions per step keep several
// K rows and warp reductions in flight.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(16 * FP4_WARP_SIZE) attention_decode(
    const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
    const u32* __restrict__ row_slot, const u32* __restrict__ row_pos,
    float* __restrict__ partial_ml, float* __restrict__ partial_acc, u32 heads, u32 kv_heads,
    u32 head_dim, u32 capacity, u32 splits) {
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
    const float scale = LOG2E / sqrt_f32((float)head_dim);
    float qr[ATTN_MAX_ELEMS], acc[ATTN_MAX_ELEMS];
    const float* q_row = q + ((u64)row * heads + head) * head_dim;
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        qr[i] = d < head_dim ? q_row[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    const u64 stride = (u64)kv_heads * head_dim;
    const u64 base = ((u64)row_slot[row] * capacity * kv_heads + kv_head) * head_dim;
    float m = neg_inf(), l = 0.0f;
    for (u32 p = start; p < end; p += ATTN_UNROLL) {
        // positions past the end repeat the last one (uniform control flow, no spills) and get
        // weight 0 through a score of -inf
        float s[ATTN_UNROLL];
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const u32 at = p + u < end ? p + u : end - 1;
            const u16* k_row = k_cache + base + (u64)at * stride;
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
                const u32 d = i * FP4_WARP_SIZE + lane;
                if (d < head_dim) dot += qr[i] * bf16_to_f32(k_row[d]);
            }
            s[u] = dot;
        }
        float m_new = m;
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            s[u] = warp_sum(s[u]);
            if (p + u >= end) s[u] = neg_inf();
            m_new = s[u] > m_new ? s[u] : m_new;
        }
        const float correction = exp2_f32(m - m_new);
        l *= correction;
        #pragma unroll
        for (int i = 0; i < ATTN_MAX_ELEMS; ++i) acc[i] *= correction;
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const float w = exp2_f32(s[u] - m_new);
            l += w;
            const u32 at = p + u < end ? p + u : end - 1;
            const u16* v_row = v_cache + base + (u64)at * stride;
            #pragma unroll
            for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
                const u32 d = i * FP4_WARP_SIZE + lane;
                if (d < head_dim) acc[i] += w * bf16_to_f32(v_row[d]);
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        partial_ml[2 * part] = m;
        partial_ml[2 * part + 1] = l;
    }
    #pragma unroll
    for (int i = 0; i < ATTN_MAX_ELEMS; ++i) {
        const u32 d = i * FP4_WARP_SIZE + lane;
        if (d < head_dim) partial_acc[part * head_dim + d] = acc[i];
    }
}

// One warp per (row, query head): the row's splits merged, times sigmoid(gate), bf16 out.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(ATTN_COMBINE_WARPS * FP4_WARP_SIZE) attention_combine_gate(
    const float* __restrict__ partial_ml, const float* __restrict__ partial_acc,
    const u16* __restrict__ q_gate, const u32* __restrict__ row_pos, u16* __restrict__ out,
    u32 rows, u32 heads, u32 head_dim, u32 splits) {
    const u32 warp = thread_x() / FP4_WARP_SIZE;
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    const u32 item = block_x() * ATTN_COMBINE_WARPS + warp;
    if (item >= rows * heads) return;
    const u32 row = item / heads, head = item % heads;
    const u32 used = (row_pos[row] + ATTN_SPLIT) / ATTN_SPLIT;  // splits holding positions
    const u64 first = (u64)item * splits;
    float m = neg_inf();
    for (u32 s = 0; s < used; ++s) m = partial_ml[2 * (first + s)] > m ? partial_ml[2 * (first + s)] : m;
    float total = 0.0f;
    for (u32 s = 0; s < used; ++s) total += partial_ml[2 * (first + s) + 1] * exp2_f32(partial_ml[2 * (first + s)] - m);
    const u16* gate = q_gate + ((u64)row * heads + head) * 2 * head_dim + head_dim;
    for (u32 d = lane; d < head_dim; d += FP4_WARP_SIZE) {
        float o = 0.0f;
        for (u32 s = 0; s < used; ++s)
            o += partial_acc[(first + s) * head_dim + d] * exp2_f32(partial_ml[2 * (first + s)] - m);
        const float g = bf16_to_f32(gate[d]);
        out[(u64)item * head_dim + d] = f32_to_bf16(o / total / (1.0f + fast_exp(-g)));
    }
}
