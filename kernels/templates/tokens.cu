// Family `tokens`: where a decode step starts and ends, the embedding gather and the greedy
// argmax over the vocabulary (rendered for {{ target.name }}). CPU reference:
// src/kernels/tokens/reference.rs. Launch: src/kernels/tokens/mod.rs.
{% include "common/prelude.cuh" %}
{% include "common/sync.cuh" %}

#define TOKENS_THREADS {{ target.tokens.threads_per_block }}
#define TOKENS_WARPS (TOKENS_THREADS / FP4_WARP_SIZE)
// tokens_argmax: 16-byte loads each thread has in flight at once
#define ARGMAX_LOADS 4

// tokens_embed: residual[row] = f32(table[tokens[row * token_stride]]), one block per row (the
// tokens may be one column of a table, e.g. the drafts at one depth of a [B][n + 1] verify
// table). A token past the vocabulary gives a zero row: the launcher checks host-given tokens,
// and tokens_argmax only writes indices below the vocabulary, so this guard only keeps a
// corrupted buffer in bounds.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(TOKENS_THREADS) tokens_embed(
    const u32* __restrict__ tokens, u32 token_stride, const u16* __restrict__ table, u32 vocab,
    u32 hidden, float* __restrict__ residual) {
    chain_after_previous_grid();
    const u64 row = block_x();
    const u32 token = tokens[row * token_stride];
    const u16* source = table + (u64)token * hidden;
    for (u32 i = thread_x(); i < hidden; i += TOKENS_THREADS)
        residual[row * hidden + i] = token < vocab ? bf16_to_f32(source[i]) : 0.0f;
}

// The better of two (value, index) candidates: the larger value, the lower index on a tie. NaN
// never wins (every comparison with it is false). Searches start from (-inf, no index): a row of
// all NaN ends without an index and gives token 0.
FP4_DEVICE void better(float& value, u32& index, float other_value, u32 other_index) {
    if (other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

// The block's best (value, index) into thread 0's registers.
FP4_DEVICE void block_best(float& value, u32& index) {
    __shared__ float best_values[TOKENS_WARPS];
    __shared__ u32 best_indices[TOKENS_WARPS];
    #pragma unroll
    for (int offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float v = bits_to_f32(shuffle_xor(f32_to_bits(value), offset));
        const u32 i = shuffle_xor(index, offset);
        better(value, index, v, i);
    }
    if (lane_index() == 0) {
        best_values[thread_x() / FP4_WARP_SIZE] = value;
        best_indices[thread_x() / FP4_WARP_SIZE] = index;
    }
    block_barrier();
    if (thread_x() == 0) {
        for (int w = 1; w < TOKENS_WARPS; ++w) better(value, index, best_values[w], best_indices[w]);
    }
}

// tokens_argmax: for every row of bf16 logits (`vocab` wide), the lowest index of the largest
// value into tokens[row * token_stride] (the next step's input, or a column of drafts) and, when `positions` is not null,
// positions[row] += 1 (the attention rows' position of the next step). Grid (splits, rows): block
// (s, row) takes `chunk` values of the row and leaves its best in partial_*[row * splits + s];
// the row's last block to arrive (counters[row], acquire-release) reduces the partials, writes
// the token and resets the counter to 0 for the next launch. One launch, no host round trip.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(TOKENS_THREADS) tokens_argmax(
    const u16* __restrict__ logits, u32 vocab, u32 chunk, float* __restrict__ partial_values,
    u32* __restrict__ partial_indices, u32* __restrict__ counters, u32* __restrict__ tokens,
    u32 token_stride, u32* __restrict__ positions) {
    chain_after_previous_grid();
    __shared__ u32 last;
    const u32 split = block_x(), splits = grid_blocks();
    const u64 row = block_y();
    const u16* values = logits + row * vocab;
    const u32 begin = split * chunk;
    const u32 end = begin + chunk < vocab ? begin + chunk : vocab;
    float best_value = bits_to_f32(0xff800000u); // -inf
    u32 best_index = 0xffffffffu;
    if ((vocab | chunk) % 8 == 0 && (reinterpret_cast<u64>(logits) & 15) == 0) {
        // 8 logits per 16-byte load, ARGMAX_LOADS loads per thread written before any compare
        // (the lm_head's chunk of 8192 at 256 threads is one such round; ptxas 13.0 issues its
        // loads in two pairs), where 2-byte loads, four in flight, took eight DRAM round trips.
        // Past the end a load reads the last unit again (a guarded load was issued only after
        // the compares before it) and its logits count as NaN, which never wins.
        const u32 units = end / 8;
        for (u32 u0 = begin / 8 + thread_x(); u0 < units; u0 += ARGMAX_LOADS * TOKENS_THREADS) {
            u32x4 w[ARGMAX_LOADS];
            #pragma unroll
            for (int q = 0; q < ARGMAX_LOADS; ++q) {
                const u32 u = u0 + q * TOKENS_THREADS;
                w[q] = load_u32x4(values + 8 * (u64)min_u32(u, units - 1));
                if (u >= units) w[q] = u32x4{~0u, ~0u, ~0u, ~0u};
            }
            #pragma unroll
            for (int q = 0; q < ARGMAX_LOADS; ++q) {
                const u32 first = 8 * (u0 + q * TOKENS_THREADS);
                const u32 words[4] = {w[q].x, w[q].y, w[q].z, w[q].w};
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    better(best_value, best_index, bf16_to_f32((u16)(words[j] & 0xffffu)), first + 2 * j);
                    better(best_value, best_index, bf16_to_f32((u16)(words[j] >> 16)), first + 2 * j + 1);
                }
            }
        }
    } else {
        for (u32 i = begin + thread_x(); i < end; i += TOKENS_THREADS)
            better(best_value, best_index, bf16_to_f32(values[i]), i);
    }
    block_best(best_value, best_index);
    if (thread_x() == 0) {
        partial_values[row * splits + split] = best_value;
        partial_indices[row * splits + split] = best_index;
        last = atomic_add_acq_rel_gpu(counters + row, 1u) == splits - 1;
    }
    block_barrier();
    if (!last) return;
    acquire_after_barrier();
    best_value = bits_to_f32(0xff800000u);
    best_index = 0xffffffffu;
    for (u32 s = thread_x(); s < splits; s += TOKENS_THREADS)
        better(best_value, best_index, load_coherent_f32(partial_values + row * splits + s),
               load_coherent_u32(partial_indices + row * splits + s));
    block_best(best_value, best_index);
    if (thread_x() == 0) {
        tokens[row * token_stride] = best_index < vocab ? best_index : 0u;
        if (positions) positions[row] += 1u;
        counters[row] = 0u;
    }
}

// tokens_accept_greedy: greedy verification of a speculative step and its bookkeeping, one block
// per sequence b, after the verify forward (rows [pending, d_1 .. d_n] at positions p .. p + n)
// and the MTP catch-up over the same rows. With t_r the target's greedy token of row r, the
// sequence accepts a = the length of the prefix where d_{r+1} == t_r, so t_0 .. t_a are its new
// tokens (the accepted drafts and the target's own next token) at positions p + 1 .. p + a + 1:
//   history[b][p + 1 + i] = t_i (i <= a, below `capacity`); verify_tokens[b][0] = t_a (the next
//   pending token); accepted[b] = a + 1 (what the Gated DeltaNet commit keeps);
//   row_positions[b][r] += a + 1 (the next verify rows); chain_positions[b] = p + a + 1 (the first
//   chained draft's position); chain_hidden[b] = mtp_hidden[b][a] (the catch-up row that
//   predicts the first draft of the next step); stats[b][0] += 1, stats[b][1 + j] += 1 for j < a.
// Every thread finds a itself (n <= a few reads), and reads p before the barrier that precedes
// the writes.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(TOKENS_THREADS) tokens_accept_greedy(
    u32* __restrict__ verify_tokens, const u32* __restrict__ target, const u16* __restrict__ mtp_hidden,
    u16* __restrict__ chain_hidden, u32* __restrict__ accepted, u32* __restrict__ row_positions,
    u32* __restrict__ chain_positions, u32* __restrict__ history, u32* __restrict__ stats,
    u32 n, u32 hidden, u32 capacity) {
    chain_after_previous_grid();
    const u64 b = block_x();
    const u64 first = b * (n + 1);
    u32 a = 0;
    while (a < n && verify_tokens[first + 1 + a] == target[first + a]) ++a;
    const u32 p = row_positions[first];
    const u16* source = mtp_hidden + (first + a) * hidden;
    for (u32 i = thread_x(); i < hidden; i += TOKENS_THREADS) chain_hidden[b * hidden + i] = source[i];
    block_barrier();
    for (u32 r = thread_x(); r <= n; r += TOKENS_THREADS) row_positions[first + r] = p + r + a + 1;
    if (thread_x() == 0) {
        for (u32 i = 0; i <= a; ++i)
            if (p + 1 + i < capacity) history[b * capacity + p + 1 + i] = target[first + i];
        verify_tokens[first] = target[first + a];
        accepted[b] = a + 1;
        chain_positions[b] = p + a + 1;
        stats[first] += 1;
        for (u32 j = 0; j < a; ++j) stats[first + 1 + j] += 1;
    }
}
