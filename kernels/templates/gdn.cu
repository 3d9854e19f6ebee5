// Family `gdn`: Gated DeltaNet linear attention from the raw projections (rendered for
// {{ target.name }}). CPU reference: src/kernels/gdn/reference.rs. Launch and the design notes
// (cache layout, the speculative step, why each kernel is shaped as it is): src/kernels/gdn/mod.rs.
//
// Kernels, in the order of a forward:
//   gdn_chunk_prepare_dk{32,64,128}         prefill, per (chunk of 64, value head): conv + SiLU,
//                                            L2 norms, gates, the WY/UT transform (tensor cores)
//   gdn_chunk_state_dk{32,64,128}_dv{16,32} prefill, per (value head, dv slice, sequence): the
//                                            sequential pass over chunks (tensor cores), outputs,
//                                            final state, conv window
//   gdn_gated_norm                          prefill: w * rmsnorm(o) * silu(z) in place
//   gdn_step_dk{128,256}, gdn_step_dk128_dv128
//                                            decode / speculative verify, per (value head, dv
//                                            slice, sequence): everything in one launch
//   gdn_commit                              sequence bookkeeping after a step
{% include "common/prelude.cuh" %}
{% include "common/sync.cuh" %}
{% include "common/block_mma.cuh" %}

#define CHUNK 64
#define CHUNK_THREADS 128
#define STATE_COLUMN_SPLITS {{ target.gdn.chunk_state_column_splits }}
#define STATE_THREADS (256 * STATE_COLUMN_SPLITS)
#define CHUNK_STAGES {{ target.gdn.chunk_stages }}
#define STEP_THREADS {{ target.gdn.step_threads }}
#define STEP_DV {{ target.gdn.step_dv_per_block }}
#define STEP_MAX_TOKENS {{ target.gdn.step_max_tokens }}
#define STEP_WARPS (STEP_THREADS / FP4_WARP_SIZE)
#define STEP_COL_QUADS (STEP_DV / 4)
// a warp's lanes along the columns, its other lanes along the rows; warps side by side over the
// slice's column quads, the rest stacked along the rows (their sums meet in shared memory)
#define STEP_COL_LANES {{ target.gdn.step_column_lanes }}
#define STEP_COL_WARPS (STEP_COL_QUADS / STEP_COL_LANES)
#define STEP_ROW_WARPS (STEP_WARPS / STEP_COL_WARPS)
#define PENDING_GROUP 4
#define STEP_ROW_GROUPS (STEP_THREADS / STEP_COL_QUADS)
// gdn_step's lazy decays: below this scale the state takes it (1 / 2^-32 leaves room for u)
#define LAZY_DECAY_FLOOR 2.3283064e-10f
#define NORM_THREADS 128
#define COMMIT_THREADS 128
#define NORM_BATCH 4  // elements a lane of gated_norm_row loads before using any

// ---- what differs between vendors in this family ----
{% if target.vendor == "nvidia" %}
FP4_DEVICE float shfl_xor(float v, u32 mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
FP4_DEVICE float exp_f32(float v) { return expf(v); }
FP4_DEVICE float log_f32(float v) { return logf(v); }
FP4_DEVICE float rsqrt_f32(float v) { return rsqrtf(v); }
FP4_DEVICE float fast_div(float a, float b) { return __fdividef(a, b); }
#define GDN_SHARED extern __shared__ __align__(16) unsigned char
// gdn_step_*: at large batches the step streams states through as many blocks as are resident
// (kernels/targets.toml, gdn.step_blocks_per_sm at dk 128: the register budget that leaves); the
// dk 256 variant holds twice the state per thread, so half as many
#define PREPARE_BOUNDS CHUNK_THREADS, {{ target.gdn.chunk_prepare_blocks_per_sm }}
#define STEP_BOUNDS(max_dk) STEP_THREADS, ({{ target.gdn.step_blocks_per_sm }} * 128 / (max_dk) > 0 ? {{ target.gdn.step_blocks_per_sm }} * 128 / (max_dk) : 1)
{% else %}
FP4_DEVICE float shfl_xor(float v, u32 mask) {
    const int other = __builtin_amdgcn_ds_bpermute((int)((lane_index() ^ mask) << 2), __builtin_bit_cast(int, v));
    return __builtin_bit_cast(float, other);
}
FP4_DEVICE float exp_f32(float v) { return __builtin_expf(v); }
FP4_DEVICE float log_f32(float v) { return __builtin_logf(v); }
FP4_DEVICE float rsqrt_f32(float v) { return __builtin_amdgcn_rsqf(v); }
FP4_DEVICE float fast_div(float a, float b) { return a * __builtin_amdgcn_rcpf(b); }
#define GDN_SHARED extern __attribute__((shared)) __attribute__((aligned(16))) unsigned char
#define PREPARE_BOUNDS CHUNK_THREADS
#define STEP_BOUNDS(max_dk) STEP_THREADS
{% endif %}
// ---- end of vendor differences ----

typedef long long i64;
/// silu from the exp and reciprocal instructions (a few ulp): expf and an IEEE division are some
/// twenty instructions and a branch, and the prefill's prepare pass runs 192 per thread.
FP4_DEVICE float silu_f32(float v) { return fast_div(v, 1.0f + fast_exp(-v)); }
/// ln(1 + e^v) without a log1p: e^v below -15 (where 1 + e^v rounds to 1), v above 20.
FP4_DEVICE float softplus_f32(float v) { return v > 20.0f ? v : (v < -15.0f ? exp_f32(v) : log_f32(1.0f + exp_f32(v))); }
FP4_DEVICE u32 pack_bf16x2(float lo, float hi) { return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }
/// g = -exp(A_log) softplus(a + dt_bias) (log decay), beta = sigmoid(b).
FP4_DEVICE void gdn_gates(float a, float b, float a_log, float dt_bias, float& g, float& beta) {
    g = -exp_f32(a_log) * softplus_f32(a + dt_bias);
    beta = 1.0f / (1.0f + exp_f32(-b));
}

/// The raw qkv input of channel `ch` at chunk-relative row `row` (may be negative): rows at or
/// after the sequence's first new row come from the inputs, earlier ones from the conv ring by
/// absolute position, positions before 0 are zero.
struct ConvSource {
    const u16* qkv; u32 stride;      // the call's input rows
    i32 first_row;                   // input row of the sequence's first new token
    i32 rel0;                        // row 0 relative to the sequence's first new token
    i64 position0;                   // absolute position of the sequence's first new token
    const u16* ring; u32 ring_len; u32 conv_dim;  // ring slot base of the sequence
    FP4_DEVICE const u16* at(i32 row, u32 ch) const {
        const i32 rel = rel0 + row;
        if (rel >= 0) return qkv + (u64)(first_row + rel) * stride + ch;
        const i64 position = position0 + rel;
        if (position < 0) return nullptr;
        // positions are u32 (the launches' positions[]): a 32-bit remainder, where the i64 one
        // is a software division of some 70 instructions per tap in the step's front end
        return ring + (u64)((u32)position % ring_len) * conv_dim + ch;
    }
    /// 8 consecutive channels (ch % 8 == 0, rows 16-byte aligned) as 4 bf16 pairs, zeros before
    /// position 0.
    FP4_DEVICE u32x4 load8(i32 row, u32 ch) const {
        const u16* p = at(row, ch);
        return p == nullptr ? u32x4{0u, 0u, 0u, 0u} : load_u32x4(p);
    }
    /// One channel's input at `row` as f32, zero before position 0.
    FP4_DEVICE float load1(i32 row, u32 ch) const {
        const u16* p = at(row, ch);
        return p == nullptr ? 0.0f : bf16_to_f32(*p);
    }
    /// Whether row `row` is one of the inputs (else the conv ring's history, or before position 0).
    FP4_DEVICE bool is_input(i32 row) const { return rel0 + row >= 0; }
    /// Whether row `row` exists (at() gives an address): not before position 0.
    FP4_DEVICE bool has(i32 row) const { return rel0 + row >= 0 || position0 + rel0 + row >= 0; }
    /// As at(), but always an address that can be read: where at() has none, the sequence's
    /// first input row (what it reads is dropped: has() is false). Loads through it need no
    /// branch, so a thread issues all of them before it uses the first.
    FP4_DEVICE const u16* readable(i32 row, u32 ch) const {
        const u16* p = at(row, ch);
        return p != nullptr ? p : qkv + (u64)first_row * stride + ch;
    }
};

/// Rows per item of the prefill's conv: a thread convolves 8 channels at CONV_ROWS consecutive
/// rows, so each tap's loads for all of them are in flight together: `kernel` memory round trips
/// per item. With one row per item they were `kernel` round trips per row, the prepare kernel's
/// largest stall (ncu at T = 512, H200, thirteenth session: 110 us, a third of its stall samples
/// on the conv's loads).
#define CONV_ROWS 8

/// silu(conv) of channels ch .. ch + 7 at chunk-relative rows row0 .. row0 + CONV_ROWS - 1:
/// y[r][i] = silu(sum_j w[ch + i][j] x[row0 + r - (kernel - 1) + j]), taps summed in order.
/// Rows from `valid` on are zero (nothing is read for them: past the sequence's last row).
FP4_DEVICE void conv8_silu_rows(const ConvSource& src, const float* __restrict__ conv_w, u32 kernel, u32 row0, u32 valid,
                                u32 ch, float (&y)[CONV_ROWS][8]) {
    #pragma unroll
    for (int r = 0; r < CONV_ROWS; ++r)
        #pragma unroll
        for (int i = 0; i < 8; ++i) y[r][i] = 0.0f;
    for (u32 j = 0; j < kernel; ++j) {
        float w[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = conv_w[(u64)(ch + i) * kernel + j];
        u32x4 x[CONV_ROWS];
        #pragma unroll
        for (int r = 0; r < CONV_ROWS; ++r)
            x[r] = row0 + r < valid ? src.load8((i32)(row0 + r) - (i32)(kernel - 1) + (i32)j, ch) : u32x4{0u, 0u, 0u, 0u};
        #pragma unroll
        for (int r = 0; r < CONV_ROWS; ++r) {
            const u32 words[4] = {x[r].x, x[r].y, x[r].z, x[r].w};
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                y[r][2 * i] += w[2 * i] * bf16_to_f32((u16)(words[i] & 0xffffu));
                y[r][2 * i + 1] += w[2 * i + 1] * bf16_to_f32((u16)(words[i] >> 16));
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < CONV_ROWS; ++r)
        #pragma unroll
        for (int i = 0; i < 8; ++i) y[r][i] = row0 + r < valid ? silu_f32(y[r][i]) : 0.0f;
}

/// Taps of a conv window loaded together (Qwen3.5's kernel is one window).
#define CONV_WINDOW_TAPS 4

/// The conv window of N channels at one row `row`: taps j0 .. j0 + CONV_WINDOW_TAPS - 1 (taps past
/// `kernel` read tap kernel - 1 again and weigh 0; rows before position 0 read a readable row and
/// count 0), loaded in two parts: the weights and the history (rows before the first new row,
/// from the conv ring), then the new rows (the inputs). The decode step issues the first part
/// before its grid wait (the ring's writers are the state's: the step of earlier forwards and the
/// prefill's state kernel), so only the inputs the projection GEMM just wrote are read after it.
/// Nothing is converted until both parts are issued: a load converted at once holds the thread
/// for its round trip before the next one's (the H200's B = 1 step spent 5 to 7.5 us of its ~10
/// in the front end when each tap was loaded and converted under its own branch, clock64 per
/// phase).
template <int N>
struct ConvWindow {
    float w[N][CONV_WINDOW_TAPS];
    u16 raw[N][CONV_WINDOW_TAPS];

    FP4_DEVICE static i32 tap_row(i32 row, u32 kernel, u32 j) { return row - (i32)(kernel - 1) + (i32)j; }
    FP4_DEVICE static u32 tap(u32 kernel, u32 j0, u32 jj) { return min_u32(j0 + jj, kernel - 1); }

    FP4_DEVICE void load_history(const ConvSource& src, const float* __restrict__ conv_w, u32 kernel, i32 row, u32 j0,
                                 const u32 (&ch)[N]) {
        #pragma unroll
        for (int n = 0; n < N; ++n)
            #pragma unroll
            for (u32 jj = 0; jj < CONV_WINDOW_TAPS; ++jj) {
                const u32 j = tap(kernel, j0, jj);
                const i32 r = tap_row(row, kernel, j);
                w[n][jj] = conv_w[(u64)ch[n] * kernel + j];
                raw[n][jj] = 0;
                if (!src.is_input(r) && src.has(r)) raw[n][jj] = load_coherent_u16(src.readable(r, ch[n]));
            }
    }
    FP4_DEVICE void load_inputs(const ConvSource& src, u32 kernel, i32 row, u32 j0, const u32 (&ch)[N]) {
        #pragma unroll
        for (int n = 0; n < N; ++n)
            #pragma unroll
            for (u32 jj = 0; jj < CONV_WINDOW_TAPS; ++jj) {
                const i32 r = tap_row(row, kernel, tap(kernel, j0, jj));
                if (src.is_input(r)) raw[n][jj] = *src.readable(r, ch[n]);
            }
    }
    /// acc[n] += the window's taps of channel n, in tap order.
    FP4_DEVICE void accumulate(const ConvSource& src, u32 kernel, i32 row, u32 j0, float (&acc)[N]) const {
        #pragma unroll
        for (u32 jj = 0; jj < CONV_WINDOW_TAPS; ++jj) {
            const bool in_kernel = j0 + jj < kernel, input = in_kernel && src.has(tap_row(row, kernel, j0 + jj));
            #pragma unroll
            for (int n = 0; n < N; ++n)
                acc[n] += (in_kernel ? w[n][jj] : 0.0f) * (input ? bf16_to_f32(raw[n][jj]) : 0.0f);
        }
    }
    /// The raw input of channel n at `row` itself (tap kernel - 1, held by the window's last tap
    /// when the window starts at tap 0 and kernel <= CONV_WINDOW_TAPS).
    FP4_DEVICE u16 own(int n) const { return raw[n][CONV_WINDOW_TAPS - 1]; }
};

/// silu(conv) of the N channels `ch` at row `row` (one value each). TAPS = CONV_WINDOW_TAPS: a
/// ConvWindow at a time, its loads in flight together; TAPS = 1 (the general step kernels, see
/// FRONT_BATCHED) keeps the earlier form, one tap at a time under its branch: the registers for
/// more are not there.
template <int N, int TAPS>
FP4_DEVICE void conv_silu_n(const ConvSource& src, const float* __restrict__ conv_w, u32 kernel, i32 row,
                            const u32 (&ch)[N], float (&y)[N]) {
    float acc[N];
    #pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    for (u32 j0 = 0; j0 < kernel; j0 += TAPS) {
        if constexpr (TAPS == 1) {
            #pragma unroll
            for (int n = 0; n < N; ++n) acc[n] += conv_w[(u64)ch[n] * kernel + j0] * src.load1(row - (i32)(kernel - 1) + (i32)j0, ch[n]);
        } else {
            static_assert(TAPS == CONV_WINDOW_TAPS, "a batched conv loads one ConvWindow at a time");
            ConvWindow<N> window;
            window.load_history(src, conv_w, kernel, row, j0, ch);
            window.load_inputs(src, kernel, row, j0, ch);
            window.accumulate(src, kernel, row, j0, acc);
        }
    }
    #pragma unroll
    for (int n = 0; n < N; ++n) y[n] = silu_f32(acc[n]);
}

/// Which chunk of which sequence workspace chunk `slot` is: scans cu_seqlens (chunks of 64 per
/// sequence, the last one partial). Returns false when `slot` is past the last chunk.
FP4_DEVICE bool find_chunk(const u32* __restrict__ cu_seqlens, u32 sequences, u32 slot, u32& seq, u32& local) {
    u32 before = 0;
    for (u32 i = 0; i < sequences; ++i) {
        const u32 chunks = (cu_seqlens[i + 1] - cu_seqlens[i] + CHUNK - 1) / CHUNK;
        if (slot < before + chunks) { seq = i; local = slot - before; return true; }
        before += chunks;
    }
    return false;
}

/// The first workspace chunk of sequence `seq`.
FP4_DEVICE u32 first_chunk(const u32* __restrict__ cu_seqlens, u32 seq) {
    u32 before = 0;
    for (u32 i = 0; i < seq; ++i) before += (cu_seqlens[i + 1] - cu_seqlens[i] + CHUNK - 1) / CHUNK;
    return before;
}

/// One warp: out[j] = w(j) * o(j) * rsqrt(mean(o^2) + eps) * silu(z(j)) over `dv` elements; o(j)
/// is fp32 another block wrote, a bf16 row of `out`, or this block's shared memory, z(j) and
/// w(j) global memory or what the block staged in shared memory. A lane loads BATCH of its
/// elements (indices clamped to dv - 1, the extra ones dropped) before it uses or stores any:
/// from global memory NORM_BATCH, since another block's o comes through coherent loads (and an
/// in-place row may alias out), which otherwise wait for each other, an L2 round trip per
/// element of the lane, twice; from shared memory 1, the plain loop.
template <int BATCH, class LoadO, class LoadZ, class LoadW>
FP4_DEVICE void gated_norm_row(LoadO o, LoadZ z, LoadW w, u32 dv, float eps, u16* out) {
    const u32 lane = thread_x() % FP4_WARP_SIZE;
    float sum = 0.0f;
    for (u32 j0 = lane; j0 < dv; j0 += FP4_WARP_SIZE * BATCH) {
        float v[BATCH];
        #pragma unroll
        for (int i = 0; i < BATCH; ++i) v[i] = o(min_u32(j0 + FP4_WARP_SIZE * i, dv - 1));
        #pragma unroll
        for (int i = 0; i < BATCH; ++i)
            if (j0 + FP4_WARP_SIZE * i < dv) sum += v[i] * v[i];
    }
    const float inv = rsqrt_f32(warp_sum(sum) / (float)dv + eps);
    for (u32 j0 = lane; j0 < dv; j0 += FP4_WARP_SIZE * BATCH) {
        float v[BATCH], zv[BATCH], wv[BATCH];
        #pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const u32 j = min_u32(j0 + FP4_WARP_SIZE * i, dv - 1);
            v[i] = o(j);
            zv[i] = z(j);
            wv[i] = w(j);
        }
        #pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const u32 j = j0 + FP4_WARP_SIZE * i;
            if (j < dv) out[j] = f32_to_bf16(wv[i] * v[i] * inv * silu_f32(zv[i]));
        }
    }
}

/// gated_norm_row's z from global memory: a bf16 row.
struct Bf16Row {
    const u16* __restrict__ at;
    FP4_DEVICE float operator()(u32 j) const { return bf16_to_f32(at[j]); }
};
/// gated_norm_row's w from global memory.
struct F32Row {
    const float* __restrict__ at;
    FP4_DEVICE float operator()(u32 j) const { return at[j]; }
};

// ============================================================================================
// gdn_step_dk*: decode (every token final) or speculative verify (tokens provisional) of `m` tokens
// for each of a batch of sequences, from the raw projection rows (row b * m + t). One block per
// (value head h, slice of STEP_DV value columns, sequence b; the last slice masked past dv); the
// slice of the state (dk x STEP_DV fp32) lives in registers: thread (row group tr, column quad tc)
// holds rows tr + STEP_ROW_GROUPS * r, columns 4 tc .. 4 tc + 3, loaded and stored with 16-byte
// accesses. A warp's lanes are STEP_COL_LANES column quads by the rest in row groups
// (gdn.step_column_lanes); on sm_90a each warp holds every row of its 16 columns, so a token's
// sums over dk never leave the warp.
//
//  1. before the wait for the previous kernel, what earlier launches wrote: issue the state loads
//     (the folded position positions[b] - pending[b] > 0, else zeros), the weights of the gates
//     and the norm; in the exact kernel also the first pass's conv windows (weights, the ring's
//     history) and the pending tokens' replay data (into shared memory);
//  2. front end of the m new tokens into shared memory: conv + SiLU (window from the inputs and
//     the conv ring), the factors of the L2 norms and q scale (applied where q and k are used),
//     k.q, gates; the replay data (k, u, g) of the pending tokens from the ring (the general
//     kernels; the exact one staged it in step 1); the raw rows (and in verify mode k and g)
//     written to the ring at the new tokens' positions, each element by one designated block;
//  3. replay the pending tokens: S = e^g S + k u^T (no reduction; the decays of steps 3 and 5
//     are kept as one scale of the registers' state, applied before it is stored);
//  4. verify: store the state now (after the replay: the pre-verify state);
//  5. per new token: one reduction of (S^T k, S^T q) over dk (warp shuffles; where warps are
//     stacked along the rows, then across them through double-buffered shared memory, one
//     barrier per token); u = beta (v - e^g S^T k),
//     o = e^g S^T q + u (k.q), S = e^g S + k u^T; verify: u to the ring;
//  6. decode: store the state after the tokens (after the arrival of step 7 when there is one);
//  7. outputs: raw o as bf16, or through the gated RMSNorm: when one block holds the whole head
//     (dv <= STEP_DV), from o in shared memory after the state's store; else by the last block
//     of (b, h) to finish (o slices in fp32 scratch, an arrival counter per (b, h), reset by
//     that block).
// The ring is sized by the host so the positions written ([pos, pos + m)) never alias those read
// ([pos - max(kernel - 1, pending), pos)).
// ============================================================================================
template <int MAX_DK>
struct StepShared {
    float q[STEP_MAX_TOKENS][MAX_DK];
    float k[STEP_MAX_TOKENS][MAX_DK];
    float pk[STEP_MAX_TOKENS][MAX_DK];
    float v[STEP_MAX_TOKENS][STEP_DV];
    float pu[STEP_MAX_TOKENS][STEP_DV];
    float g[STEP_MAX_TOKENS], beta[STEP_MAX_TOKENS], kq[STEP_MAX_TOKENS], pg[STEP_MAX_TOKENS];
    float rq[STEP_MAX_TOKENS], rk[STEP_MAX_TOKENS];
    float red[2][STEP_ROW_WARPS][2][STEP_DV];  // per-token sums of the warps stacked along the rows
    float o[STEP_MAX_TOKENS][STEP_DV];  // the whole head's o, for its gated norm
    float z[STEP_MAX_TOKENS][STEP_DV];  // and its z and weights, loaded with the front end's loads
    float norm_w[STEP_DV];
    u32 last;
};

{% for max_dk in [128, 256, 128] %}
{# the last is the exact kernel for dk = dv = 128 #}
{% if loop.last %}{% set exact_dv = 128 %}{% else %}{% set exact_dv = 0 %}{% endif %}
{% if exact_dv %}
// gdn_step_dk{{ max_dk }}_dv{{ exact_dv }}: exactly dk = {{ max_dk }} and dv = {{ exact_dv }} (the host picks it
// for that shape only), so every row and column of a thread is in range and its state rows sit
// at constant offsets from one address: each of the 16 stores is one instruction. In the general
// kernel each cost some 20 (the row's address rebuilt, a predicated branch), and the stores'
// address registers were rewritten while earlier stores still read them (ncu, H200, decode
// B = 64: the state's load and store code 42% of the instructions, the stores 28% of the stall
// samples, mostly long-scoreboard waits on those registers). gdn bench, H200, fifteenth session:
// decode B = 1 / 8 / 64 8.72 / 15.02 / 116.00 -> 7.77 / 14.85 / 113.17 us, verify of 3 tokens
// 13.26 / 19.61 / 145.80 -> 12.37 / 18.80 / 143.96.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(STEP_BOUNDS({{ max_dk }})) gdn_step_dk{{ max_dk }}_dv{{ exact_dv }}(
{% else %}
// gdn_step_dk{{ max_dk }}: dk up to {{ max_dk }} (registers and shared memory sized for it), any dv
FP4_KERNEL void FP4_LAUNCH_BOUNDS(STEP_BOUNDS({{ max_dk }})) gdn_step_dk{{ max_dk }}(
{% endif %}
    const u16* __restrict__ qkv, u32 qkv_stride, const u16* __restrict__ a_in, u32 a_stride,
    const u16* __restrict__ b_in, u32 b_stride, const u16* __restrict__ z, u32 z_stride,
    const float* __restrict__ conv_w, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const float* __restrict__ norm_w, float eps,
    float* state, u16* conv_ring, float* ring_k, float* ring_u, float* ring_g,
    const u32* __restrict__ slots, const u32* __restrict__ positions, const u32* __restrict__ pending,
    u16* out, float* o_scratch, u32* counters,
    u32 hk, u32 hv, u32 dk_arg, u32 dv_arg, u32 kernel, u32 ring_len, u32 n_slots, u32 m, u32 verify) {
{% if exact_dv %}
    constexpr u32 dk = {{ max_dk }}, dv = {{ exact_dv }};
    (void)dk_arg; (void)dv_arg;
{% else %}
    const u32 dk = dk_arg, dv = dv_arg;
{% endif %}
    // Before the wait for the previous kernel (the projection GEMM that writes qkv, a, b, z): the
    // sequences' slots, positions and pending counts and the state slice, which kernels two or more
    // launches back wrote (chain_after_previous_grid), with loads that bypass L1. At B = 1 the
    // state's DRAM round trip is then hidden behind the GEMM instead of starting the step's chain.
    constexpr int STEP_MAX_ROWS = {{ max_dk }} / STEP_ROW_GROUPS;
    // The front end's loads all in flight together (the gated norm's first z and weights held in
    // registers across the conv, the conv's 4 taps at once: Qwen3.5's kernel is one group) in
    // the exact kernel, the real shape's; the general one, whose dk and dv are arguments, has no
    // registers for them beside the state (ptxas 13.0 spilled 8 to 64 bytes of it on sm_90a,
    // by how much was batched) and keeps the earlier form: z and the weights stored before the
    // conv, each tap loaded and converted under its own branch.
    constexpr bool FRONT_BATCHED = {% if exact_dv %}true{% else %}false{% endif %};
    constexpr int CONV_TAPS = FRONT_BATCHED ? 4 : 1;
    __shared__ StepShared<{{ max_dk }}> sh;
    const u32 tid = thread_x();
    const u32 warp = tid / FP4_WARP_SIZE, lane = tid % FP4_WARP_SIZE;
    const u32 splits = (dv + STEP_DV - 1) / STEP_DV;  // the last slice masked past dv
    const u32 h = block_x() / splits, split = block_x() % splits;
    const u32 j0 = split * STEP_DV;
    const u32 b = block_y();
    const u32 ratio = hv / hk, kh = h / ratio;
    const u32 given_slot = load_coherent_u32(slots + b);
    const bool slot_ok = given_slot < n_slots;  // a caller's bad slot: nothing is touched
    const u32 slot = slot_ok ? given_slot : 0u;
    const u32 pos = load_coherent_u32(positions + b);
    const u32 pend = min_u32(load_coherent_u32(pending + b), (u32)STEP_MAX_TOKENS);
    const u32 conv_dim = 2 * hk * dk + hv * dv;
    // column quad tc and row group tr of the thread (STEP_COL_LANES lanes along the columns)
    const u32 warp_col = warp % STEP_COL_WARPS, warp_row = warp / STEP_COL_WARPS;
    const u32 tc = warp_col * STEP_COL_LANES + lane % STEP_COL_LANES;
    const u32 tr = warp_row * (FP4_WARP_SIZE / STEP_COL_LANES) + lane / STEP_COL_LANES;
    // dv is a multiple of 16: a thread's 4 columns go together (and where STEP_DV divides dv,
    // every slice is whole: the exact kernel knows it at compile time)
    const bool col_ok = dv % STEP_DV == 0 || j0 + 4 * tc < dv;
    const u32 state_rows = col_ok ? dk : 0u;  // rows this thread stores (one compare per row)
    // the whole head in one block: its gated RMSNorm needs no scratch and no arrival
    const bool whole_head = splits == 1;
    // the thread's row r (row tr + STEP_ROW_GROUPS * r of the head, columns j0 + 4 tc .. + 3): its
    // row 0 from one 64-bit address computation per thread, row r a further r row steps on (a
    // constant offset in the exact kernel), where one full computation per row was some 20
    // instructions of each block's 16-row load and store
    float* const head_state = state + ((u64)slot * hv + h) * dk * dv;
    const u32 row_step = STEP_ROW_GROUPS * dv;
    float* const thread_state = head_state + (tr * dv + j0 + 4 * tc);
    auto state_at = [&](int r) { return thread_state + (u64)((u32)r * row_step); };
    // masked threads load the slice's first columns instead (in the head, never stored): the loads
    // need no column predicate (one per row cost ptxas its registers)
    const float* const thread_load_state = head_state + (tr * dv + j0 + 4 * (col_ok ? tc : 0u));
    auto state_load_at = [&](int r) { return thread_load_state + (u64)((u32)r * row_step); };

    // 1. the state slice
    float s[STEP_MAX_ROWS][4];
    const bool has_state = slot_ok && pos > pend;
    #pragma unroll
    for (int r = 0; r < STEP_MAX_ROWS; ++r) {
        const u32 row = tr + STEP_ROW_GROUPS * r;
        if (has_state && (dk == {{ max_dk }} || row < dk)) {  // every row exists at dk = MAX_DK
            const u32x4 v = load_coherent_u32x4(state_load_at(r));
            s[r][0] = bits_to_f32(v.x); s[r][1] = bits_to_f32(v.y); s[r][2] = bits_to_f32(v.z); s[r][3] = bits_to_f32(v.w);
        } else {
            s[r][0] = s[r][1] = s[r][2] = s[r][3] = 0.0f;
        }
    }

    // The front end's loads that no kernel of this forward writes go before the wait, as the
    // state's: the gates' and the gated norm's weights and, in the exact kernel, the first pass's
    // conv windows (their weights and the ring's history, see ConvWindow). After the wait they
    // were a DRAM round trip at the head of the step's chain: the ring was last touched a forward
    // earlier.
    const bool norm = z != nullptr;
    const bool norm_staged = norm && whole_head;
    const bool z_first = FRONT_BATCHED && norm_staged && tid < m * STEP_DV && tid % STEP_DV < dv;
    const bool w_first = FRONT_BATCHED && norm_staged && tid < dv;
    float gate_in[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // a, b, A_log, dt_bias of token tid
    if (tid < m) {
        gate_in[2] = a_log[h];
        gate_in[3] = dt_bias[h];
    }
    float w_value = 0.0f;
    if (w_first) w_value = norm_w[tid];
    // conv + SiLU of the new tokens' channels as one index space over all threads: (q, k) channel
    // pairs first, then pairs of this block's v columns (at m = 1 a head's 128 q/k pairs and 64 v
    // pairs take one pass of 256 threads)
    const ConvSource src{qkv, qkv_stride, (i32)(b * m), 0, (i64)pos, conv_ring + (u64)slot * ring_len * conv_dim, ring_len, conv_dim};
    const bool qk_writer = h % ratio == 0;  // first value head of the key group writes q/k data
    const u32 qk_items = m * dk, conv_items = qk_items + m * (STEP_DV / 2);
    struct ConvItem {
        u32 t, col, ch[2];  // token, first column (of q/k, or of the block's v slice), channels
        bool qk, live;      // a q/k pair, or v columns; false: v columns past dv (zeros)
    };
    auto conv_item = [&](u32 idx) {
        ConvItem it;
        it.qk = idx < qk_items;
        if (it.qk) {
            it.t = idx / dk;
            it.col = idx % dk;
            it.ch[0] = kh * dk + it.col;
            it.ch[1] = hk * dk + kh * dk + it.col;
            it.live = true;
        } else {
            const u32 pair = idx - qk_items;
            it.t = pair / (STEP_DV / 2);
            it.col = 2 * (pair % (STEP_DV / 2));
            it.ch[0] = 2 * hk * dk + h * dv + j0 + it.col;
            it.ch[1] = it.ch[0] + 1;
            it.live = j0 + it.col < dv;  // dv is a multiple of 16: both columns or neither
        }
        return it;
    };
    // the raw inputs of q/k pairs go to the ring from one block per channel; v columns from theirs
    auto writes_ring = [&](const ConvItem& it) { return it.live && (!it.qk || (qk_writer && it.col % splits == split)); };
    const bool window_early = FRONT_BATCHED && kernel <= CONV_WINDOW_TAPS;
    const bool first_exists = tid < conv_items;
    const ConvItem first = conv_item(tid);
    ConvWindow<2> window;
    if (window_early && first_exists && first.live) window.load_history(src, conv_w, kernel, (i32)first.t, 0, first.ch);

    // rows dk .. MAX_DK - 1 of q, k and the pending k read as zeros (so do the state's), so the
    // token loops multiply every row a thread holds without a test per row (a predicated branch
    // each: some 120 of a token's 600 instructions per warp at dk 128, ncu, fourteenth session)
    for (u32 idx = tid; idx < STEP_MAX_TOKENS * ({{ max_dk }} - dk); idx += STEP_THREADS) {
        const u32 t = idx / ({{ max_dk }} - dk), i = dk + idx % ({{ max_dk }} - dk);
        sh.q[t][i] = sh.k[t][i] = sh.pk[t][i] = 0.0f;
    }
    // The pending tokens' replay data (verify mode) into shared memory, PENDING_GROUP rows of the
    // block's threads loaded before any is stored (a load followed by its store per row made each
    // pending token a round trip). The exact kernel stages them before the wait: the steps of
    // earlier forwards wrote the ring, and a load followed by its store holds the thread for its
    // DRAM round trip while the previous kernel runs instead of after it (a bad slot reads slot
    // 0's rows, dropped). The general kernels have no registers for it beside the state (ptxas
    // 13.0 spilled 20 bytes of gdn_step_dk128 on sm_90a) and stage them after the conv.
    auto stage_pending = [&]() {
        for (u32 base = 0; base < pend * dk; base += PENDING_GROUP * STEP_THREADS) {
            float pk[PENDING_GROUP], pg[PENDING_GROUP];
            #pragma unroll
            for (u32 r = 0; r < PENDING_GROUP; ++r) {
                const u32 idx = base + r * STEP_THREADS + tid, c = idx / dk, i = idx % dk;
                pk[r] = pg[r] = 0.0f;
                if (idx < pend * dk) {
                    const u64 at = (u64)slot * ring_len + (pos - pend + c) % ring_len;
                    pk[r] = load_coherent_f32(ring_k + at * hk * dk + kh * dk + i);
                    if (i == 0) pg[r] = load_coherent_f32(ring_g + at * hv + h);
                }
            }
            #pragma unroll
            for (u32 r = 0; r < PENDING_GROUP; ++r) {
                const u32 idx = base + r * STEP_THREADS + tid, c = idx / dk, i = idx % dk;
                if (idx < pend * dk) {
                    sh.pk[c][i] = pk[r];
                    if (i == 0) sh.pg[c] = pg[r];
                }
            }
        }
        // their u over this block's columns (zero past dv)
        for (u32 base = 0; base < pend * STEP_DV; base += PENDING_GROUP * STEP_THREADS) {
            float pu[PENDING_GROUP];
            #pragma unroll
            for (u32 r = 0; r < PENDING_GROUP; ++r) {
                const u32 idx = base + r * STEP_THREADS + tid, c = idx / STEP_DV, jj = idx % STEP_DV;
                pu[r] = 0.0f;
                if (idx < pend * STEP_DV && j0 + jj < dv) {
                    const u64 at = (u64)slot * ring_len + (pos - pend + c) % ring_len;
                    pu[r] = load_coherent_f32(ring_u + at * hv * dv + h * dv + j0 + jj);
                }
            }
            #pragma unroll
            for (u32 r = 0; r < PENDING_GROUP; ++r) {
                const u32 idx = base + r * STEP_THREADS + tid;
                if (idx < pend * STEP_DV) sh.pu[idx / STEP_DV][idx % STEP_DV] = pu[r];
            }
        }
    };
    if (FRONT_BATCHED) stage_pending();
    chain_after_previous_grid();
    if (!slot_ok) return;  // uniform per block

    // 2. front end: every load of a pass is issued before its first use (the step is a latency
    //    chain at small batches: a block's lifetime, not the state's bytes, sets its cost)
    if (tid < m) {
        gate_in[0] = bf16_to_f32(a_in[(u64)(b * m + tid) * a_stride + h]);
        gate_in[1] = bf16_to_f32(b_in[(u64)(b * m + tid) * b_stride + h]);
    }
    // the gated norm's z when the block holds the whole head, in flight with the conv's loads
    // below (loaded at the norm, it was the last round trip of the block's chain): its first pass
    // into registers now, into shared memory after the conv's loads (a load stored at once holds
    // the thread until it returns, and every load behind it)
    u16 z_raw = 0;
    if (z_first) z_raw = z[(u64)(b * m + tid / STEP_DV) * z_stride + h * dv + tid % STEP_DV];
    // z and the weights into shared memory from index `from` on, a load and its store at a time
    auto stage_norm_inputs = [&](u32 from) {
        for (u32 idx = from; idx < m * STEP_DV; idx += STEP_THREADS) {
            const u32 t = idx / STEP_DV, jj = idx % STEP_DV;
            if (jj < dv) sh.z[t][jj] = bf16_to_f32(z[(u64)(b * m + t) * z_stride + h * dv + jj]);
        }
        for (u32 jj = from; jj < dv; jj += STEP_THREADS) sh.norm_w[jj] = norm_w[jj];
    };
    if (!FRONT_BATCHED && norm_staged) stage_norm_inputs(tid);
    // an item's results: silu(conv) to shared memory, its raw inputs to the ring at its position
    auto finish_item = [&](const ConvItem& it, const float (&y)[2], const u16 (&raw)[2]) {
        if (it.qk) {
            sh.q[it.t][it.col] = y[0];
            sh.k[it.t][it.col] = y[1];
        } else {
            sh.v[it.t][it.col] = y[0];
            sh.v[it.t][it.col + 1] = y[1];
        }
        if (writes_ring(it)) {
            u16* dst = conv_ring + ((u64)slot * ring_len + (pos + it.t) % ring_len) * conv_dim;
            dst[it.ch[0]] = raw[0];
            dst[it.ch[1]] = raw[1];
        }
    };
    u32 idx = tid;
    if (window_early) {  // the first pass from the window loaded before the wait
        if (first_exists) {
            float acc[2] = {0.0f, 0.0f}, y[2] = {0.0f, 0.0f};
            if (first.live) {
                window.load_inputs(src, kernel, (i32)first.t, 0, first.ch);
                window.accumulate(src, kernel, (i32)first.t, 0, acc);
                y[0] = silu_f32(acc[0]);
                y[1] = silu_f32(acc[1]);
            }
            const u16 raw[2] = {window.own(0), window.own(1)};
            finish_item(first, y, raw);
        }
        idx += STEP_THREADS;
    }
    for (; idx < conv_items; idx += STEP_THREADS) {
        const ConvItem it = conv_item(idx);
        u16 raw[2] = {0, 0};
        float y[2] = {0.0f, 0.0f};
        if (writes_ring(it)) {  // issued with the conv's loads, used after them
            raw[0] = qkv[(u64)(b * m + it.t) * qkv_stride + it.ch[0]];
            raw[1] = qkv[(u64)(b * m + it.t) * qkv_stride + it.ch[1]];
        }
        if (it.live) conv_silu_n<2, CONV_TAPS>(src, conv_w, kernel, (i32)it.t, it.ch, y);
        finish_item(it, y, raw);
    }
    if (z_first) sh.z[tid / STEP_DV][tid % STEP_DV] = bf16_to_f32(z_raw);
    if (w_first) sh.norm_w[tid] = w_value;
    if (FRONT_BATCHED && norm_staged) stage_norm_inputs(tid + STEP_THREADS);  // the passes past the first
    if (tid < m) {
        float g, beta;
        gdn_gates(gate_in[0], gate_in[1], gate_in[2], gate_in[3], g, beta);
        sh.g[tid] = g;
        sh.beta[tid] = beta;
        if (verify && split == 0) ring_g[((u64)slot * ring_len + (pos + tid) % ring_len) * hv + h] = g;
    }
    if (!FRONT_BATCHED) stage_pending();
    block_barrier();
    // norms and k.q: warp w takes tokens w, w + STEP_WARPS, ...
    for (u32 t = warp; t < m; t += STEP_WARPS) {
        float qq = 0.0f, kk = 0.0f, kq = 0.0f;
        for (u32 i = lane; i < dk; i += FP4_WARP_SIZE) {
            const float qv = sh.q[t][i], kv = sh.k[t][i];
            qq += qv * qv; kk += kv * kv; kq += kv * qv;
        }
        qq = warp_sum(qq); kk = warp_sum(kk); kq = warp_sum(kq);
        if (lane == 0) {
            const float rq = rsqrt_f32(qq + 1e-6f) * rsqrt_f32((float)dk), rk = rsqrt_f32(kk + 1e-6f);
            sh.rq[t] = rq; sh.rk[t] = rk; sh.kq[t] = kq * rq * rk;
        }
    }
    block_barrier();
    // q and k stay raw in shared memory: the token loop scales its sums by rq, rk and k by rk
    if (verify && qk_writer)
        for (u32 idx = tid; idx < m * dk; idx += STEP_THREADS) {
            const u32 t = idx / dk, i = idx % dk;
            if (i % splits == split)
                ring_k[((u64)slot * ring_len + (pos + t) % ring_len) * hk * dk + kh * dk + i] = sh.k[t][i] * sh.rk[t];
        }

    // The decays are applied lazily: the state is scale * s, so a token adds k (u / scale) to s (one
    // product per element) where S = e^g S + k u^T took two; s is multiplied by scale once, before
    // it is stored, or when scale falls below LAZY_DECAY_FLOOR (then 1 / scale could overflow).
    // A verify of 3 tokens with 3 pending: 6 multiplies per element became 1 (H200, fourteenth
    // session: B = 64 149.97 -> 146.86 us, B = 8 20.03 -> 19.76).
    float scale = 1.0f;
    auto apply_scale = [&]() {
        #pragma unroll
        for (int r = 0; r < STEP_MAX_ROWS; ++r)
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[r][e] *= scale;
        scale = 1.0f;
    };
    auto decay_by = [&](float decay) {  // scale *= decay; returns 1 / scale
        scale *= decay;
        if (scale < LAZY_DECAY_FLOOR) apply_scale();  // uniform per block
        return 1.0f / scale;
    };
    // the state (scale applied) to the slot: verify before its tokens, decode after them
    auto store_state = [&]() {
        apply_scale();
        #pragma unroll
        for (int r = 0; r < STEP_MAX_ROWS; ++r) {
            const u32 row = tr + STEP_ROW_GROUPS * r;
            if (dk == {{ max_dk }} ? col_ok : row < state_rows) store_coherent_u32x4(state_at(r), {f32_to_bits(s[r][0]), f32_to_bits(s[r][1]), f32_to_bits(s[r][2]), f32_to_bits(s[r][3])});
        }
    };
    // 3. replay the pending tokens
    for (u32 c = 0; c < pend; ++c) {
        const float inv = decay_by(exp_f32(sh.pg[c]));
        float pu[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) pu[e] = sh.pu[c][4 * tc + e] * inv;
        #pragma unroll
        for (int r = 0; r < STEP_MAX_ROWS; ++r) {
            const float kr = sh.pk[c][tr + STEP_ROW_GROUPS * r];
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[r][e] += kr * pu[e];
        }
    }
    // 4. verify keeps the pre-verify state
    if (verify) store_state();

    // 5. the new tokens
    for (u32 t = 0; t < m; ++t) {
        float sk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        #pragma unroll
        for (int r = 0; r < STEP_MAX_ROWS; ++r) {
            const u32 row = tr + STEP_ROW_GROUPS * r;
            const float kr = sh.k[t][row], qr = sh.q[t][row];
            #pragma unroll
            for (int e = 0; e < 4; ++e) { sk[e] += s[r][e] * kr; sq[e] += s[r][e] * qr; }
        }
        // over the warp's row lanes (every lane ends with its columns' sums), then, where warps
        // are stacked along the rows, across them through shared memory: one barrier per token
        #pragma unroll
        for (u32 off = STEP_COL_LANES; off < FP4_WARP_SIZE; off *= 2) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) { sk[e] += shfl_xor(sk[e], off); sq[e] += shfl_xor(sq[e], off); }
        }
        float tk[4] = {sk[0], sk[1], sk[2], sk[3]}, tq[4] = {sq[0], sq[1], sq[2], sq[3]};
        if (STEP_ROW_WARPS > 1) {
            if (lane < STEP_COL_LANES) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) { sh.red[t % 2][warp_row][0][4 * tc + e] = sk[e]; sh.red[t % 2][warp_row][1][4 * tc + e] = sq[e]; }
            }
            block_barrier();
            #pragma unroll
            for (int e = 0; e < 4; ++e) tk[e] = tq[e] = 0.0f;
            for (u32 w = 0; w < STEP_ROW_WARPS; ++w) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) { tk[e] += sh.red[t % 2][w][0][4 * tc + e]; tq[e] += sh.red[t % 2][w][1][4 * tc + e]; }
            }
        }
        const float beta = sh.beta[t], kq = sh.kq[t], rk = sh.rk[t], rq = sh.rq[t];
        // e^g S^T k = (e^g scale) s^T k, with the s the sums read (decay_by may fold scale into s)
        const float decay = exp_f32(sh.g[t]), sums_scale = decay * scale;
        const float inv = decay_by(decay);
        float u[4], o[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            u[e] = beta * (sh.v[t][4 * tc + e] - sums_scale * rk * tk[e]);
            o[e] = sums_scale * rq * tq[e] + u[e] * kq;
        }
        // s += k (rk u / scale): 4 products per token instead of one per row
        float ku[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) ku[e] = rk * inv * u[e];
        #pragma unroll
        for (int r = 0; r < STEP_MAX_ROWS; ++r) {
            const float kr = sh.k[t][tr + STEP_ROW_GROUPS * r];
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[r][e] += kr * ku[e];
        }
        if (tr == 0) {
            const u64 row = (u64)(b * m + t);
            const u32 col = h * dv + j0 + 4 * tc;
            if (norm && whole_head) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) sh.o[t][4 * tc + e] = o[e];  // normed after the tokens
            } else if (col_ok && norm) {
                store_coherent_u32x4(o_scratch + row * hv * dv + col, {f32_to_bits(o[0]), f32_to_bits(o[1]), f32_to_bits(o[2]), f32_to_bits(o[3])});
            } else if (col_ok) {
                *reinterpret_cast<u32x2*>(out + row * hv * dv + col) = {pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3])};
            }
            if (verify && col_ok) {
                float* dst = ring_u + ((u64)slot * ring_len + (pos + t) % ring_len) * hv * dv + col;
                store_coherent_u32x4(dst, {f32_to_bits(u[0]), f32_to_bits(u[1]), f32_to_bits(u[2]), f32_to_bits(u[3])});
            }
        }
    }

    // 6. decode folds the tokens into the state (store_state); with the norm, after the arrival
    //    below, so the fence before it waits for the o slices only, not for the state's stores too
    if (!norm || m == 0) {  // uniform per block
        if (!verify) store_state();
        return;
    }
    if (whole_head) {  // the state's registers are free before the norm
        if (!verify) store_state();
        block_barrier();
        for (u32 t = warp; t < m; t += STEP_WARPS) {
            const u64 row = (u64)(b * m + t);
            gated_norm_row<1>([&](u32 j) { return sh.o[t][j]; }, [&](u32 j) { return sh.z[t][j]; },
                           [&](u32 j) { return sh.norm_w[j]; }, dv, eps, out + row * hv * dv + h * dv);
        }
        return;
    }

    // 7. the gated RMSNorm needs the whole head: the last of the head's blocks applies it
    const bool last = block_arrive_and_rearm(counters + (u64)b * hv + h, splits, &sh.last);
    if (!verify) store_state();
    if (!last) return;
    for (u32 t = warp; t < m; t += STEP_WARPS) {
        const u64 row = (u64)(b * m + t);
        const float* o = o_scratch + row * hv * dv + h * dv;
        gated_norm_row<NORM_BATCH>([&](u32 j) { return load_coherent_f32(o + j); }, Bf16Row{z + row * z_stride + h * dv}, F32Row{norm_w},
                       dv, eps, out + row * hv * dv + h * dv);
    }
}
{% endfor %}

// gdn_commit: after a step, positions[i] += accepted[i] (or `uniform` when accepted is null);
// pending[i] = accepted (verify: the accepted tokens wait in the ring for the next step's replay)
// or 0 (fold: decode, prefill and flush stored the state after their tokens).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(COMMIT_THREADS) gdn_commit(u32* positions, u32* pending, const u32* accepted,
                                                             u32 uniform, u32 count, u32 fold) {
    chain_after_previous_grid();
    const u32 i = block_x() * COMMIT_THREADS + thread_x();
    if (i >= count) return;
    const u32 a = accepted != nullptr ? accepted[i] : uniform;
    positions[i] += a;
    pending[i] = fold ? 0u : a;
}

// gdn_gated_norm: rows x value heads of `out` (raw o in bf16, written by the state pass) become
// w * rmsnorm(o) * silu(z), in place; one warp per (row, head).
FP4_KERNEL void FP4_LAUNCH_BOUNDS(NORM_THREADS) gdn_gated_norm(u16* out, const u16* __restrict__ z, u32 z_stride,
                                                               const float* __restrict__ norm_w, float eps,
                                                               u32 rows, u32 hv, u32 dv) {
    chain_after_previous_grid();
    const u64 task = (u64)block_x() * (NORM_THREADS / FP4_WARP_SIZE) + thread_x() / FP4_WARP_SIZE;
    if (task >= (u64)rows * hv) return;  // whole warps
    const u64 row = task / hv, h = task % hv;
    u16* o = out + row * hv * dv + h * dv;
    gated_norm_row<NORM_BATCH>([&](u32 j) { return bf16_to_f32(o[j]); }, Bf16Row{z + row * z_stride + h * dv}, F32Row{norm_w}, dv, eps, o);
}

// ============================================================================================
// Prefill, chunk 64, WY / UT form (../shared/reference/kernels.md), in two tensor-core passes
// over a workspace, for a batch of sequences given by cu_seqlens (chunks never span sequences;
// a sequence's last chunk is zero-padded to 64 rows).
//
// gdn_chunk_prepare_dk{DK}: one block (4 warps) per (workspace chunk, value head h), all chunks
// in parallel. Conv + SiLU of the chunk's q, k (key head h / ratio) and v (head h) channels from
// the raw rows (history from earlier rows or the conv ring), L2 norms and q scale (bf16 tiles in
// shared memory), gates and gamma = cumsum(g); then on tensor cores (warp w: rows 16w..16w+15):
//   K K^T -> A = strictly_lower(diag(beta) K K^T * Gamma)  (fp32, shared)
//   Q K^T -> M = lower(Q K^T * Gamma)                       (bf16, workspace)
// T = (I + A)^-1 in fp32 (16x16 diagonal blocks by column substitution, off-diagonal blocks by
// block rows), T_w = T diag(beta e^gamma), T_u = T diag(beta) in bf16, and
//   W = T_w K, U = T_u V   (bf16, workspace), and gamma (fp32, workspace).
// Padded rows get beta = 0 and g = 0, so their W, U, M rows are zero and gamma stays at the
// chunk's last value.
// ============================================================================================
#define PAD 8  // bf16 elements of row padding: rows 16-byte aligned, ldmatrix conflict-free

{% for dk in [32, 64, 128] %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(PREPARE_BOUNDS) gdn_chunk_prepare_dk{{ dk }}(
    const u16* __restrict__ qkv, u32 qkv_stride, const u16* __restrict__ a_in, u32 a_stride,
    const u16* __restrict__ b_in, u32 b_stride,
    const float* __restrict__ conv_w, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const u16* __restrict__ conv_ring, const u32* __restrict__ cu_seqlens, const u32* __restrict__ slots,
    const u32* __restrict__ positions,
    u16* ws_q, u16* ws_k, u16* ws_w, u16* ws_u, u16* ws_m, float* ws_gamma,
    u32 hk, u32 hv, u32 dv, u32 kernel, u32 ring_len, u32 sequences) {
    chain_after_previous_grid();
    constexpr u32 DK = {{ dk }};
    constexpr u32 LDK = DK + PAD;
    constexpr u32 LDA = CHUNK + PAD;  // fp32 A / T rows; the same bytes hold T_w and T_u (bf16) later
    GDN_SHARED smem[];
    const u32 ldx = (DK > dv ? DK : dv) + PAD;
    u16* xa = reinterpret_cast<u16*>(smem);                        // [64][ldx]: q, then v
    u16* xb = xa + CHUNK * ldx;                                    // [64][LDK]: k
    float* a_s = reinterpret_cast<float*>(xb + CHUNK * LDK);       // [64][LDA] fp32
    u16* tw_s = reinterpret_cast<u16*>(a_s);                       // [64][LDA] bf16 (after T)
    u16* tu_s = tw_s + CHUNK * LDA;                                // [64][LDA] bf16
    float* gam_s = a_s + CHUNK * LDA;                              // [64]
    float* beta_s = gam_s + CHUNK;                                 // [64]
    float* p_s = beta_s + CHUNK;                                   // [3][16][16] block products

    const u32 tid = thread_x(), warp = tid / FP4_WARP_SIZE, lane = tid % FP4_WARP_SIZE;
    const u32 chunk = block_x(), h = block_y();
    u32 seq, local;
    if (!find_chunk(cu_seqlens, sequences, chunk, seq, local)) return;
    const u32 ratio = hv / hk, kh = h / ratio;
    const u32 conv_dim = 2 * hk * DK + hv * dv;
    const u32 len = cu_seqlens[seq + 1] - cu_seqlens[seq];
    const u32 valid = min_u32((u32)CHUNK, len - local * CHUNK);
    const u32 row0 = cu_seqlens[seq] + local * CHUNK;
    const ConvSource src{qkv, qkv_stride, (i32)cu_seqlens[seq], (i32)(local * CHUNK), (i64)positions[seq],
                         conv_ring + (u64)slots[seq] * ring_len * conv_dim, ring_len, conv_dim};

    // conv + SiLU + L2 norms of q and k: an item is 8 channels of CONV_ROWS rows, the GROUPS items
    // of a row block adjacent lanes of one warp (the items are a multiple of 32)
    constexpr u32 GROUPS = DK / 8;
    const bool qk_writer = h % ratio == 0;
    u16* q_out = ws_q + ((u64)chunk * hk + kh) * CHUNK * DK;
    u16* k_out = ws_k + ((u64)chunk * hk + kh) * CHUNK * DK;
    for (u32 idx = tid; idx < CHUNK / CONV_ROWS * GROUPS; idx += CHUNK_THREADS) {
        const u32 r0 = CONV_ROWS * (idx / GROUPS), ch = 8 * (idx % GROUPS);
        #pragma unroll 1
        for (u32 is_k = 0; is_k < 2; ++is_k) {
            float y[CONV_ROWS][8];
            conv8_silu_rows(src, conv_w, kernel, r0, valid, (is_k ? hk * DK : 0u) + kh * DK + ch, y);
            u16* tile = is_k ? xb + ch : xa + ch;
            const u32 ld = is_k ? LDK : ldx;
            u16* out = (is_k ? k_out : q_out) + ch;
            #pragma unroll
            for (int r = 0; r < CONV_ROWS; ++r) {
                float sq = 0.0f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) sq += y[r][i] * y[r][i];
                #pragma unroll
                for (u32 off = 1; off < GROUPS; off *= 2) sq += shfl_xor(sq, off);
                const float scale = is_k ? rsqrt_f32(sq + 1e-6f) : rsqrt_f32(sq + 1e-6f) * rsqrt_f32((float)DK);
                const u32x4 packed = {pack_bf16x2(y[r][0] * scale, y[r][1] * scale), pack_bf16x2(y[r][2] * scale, y[r][3] * scale),
                                      pack_bf16x2(y[r][4] * scale, y[r][5] * scale), pack_bf16x2(y[r][6] * scale, y[r][7] * scale)};
                store_u32x4(tile + (r0 + r) * ld, packed);
                if (qk_writer) store_u32x4(out + (r0 + r) * DK, packed);
            }
        }
    }
    // gates: g and beta per row (zero past the sequence), gamma by a plain prefix sum
    if (tid < CHUNK) {
        float g = 0.0f, beta = 0.0f;
        if (tid < valid)
            gdn_gates(bf16_to_f32(a_in[(u64)(row0 + tid) * a_stride + h]), bf16_to_f32(b_in[(u64)(row0 + tid) * b_stride + h]),
                      a_log[h], dt_bias[h], g, beta);
        gam_s[tid] = g;
        beta_s[tid] = beta;
    }
    block_barrier();
    float gamma_mine = 0.0f;
    if (tid < CHUNK) for (u32 i = 0; i <= tid; ++i) gamma_mine += gam_s[i];
    block_barrier();
    if (tid < CHUNK) {
        gam_s[tid] = gamma_mine;
        ws_gamma[((u64)chunk * hv + h) * CHUNK + tid] = gamma_mine;
    }
    block_barrier();

    // K K^T and Q K^T on tensor cores: warp w owns rows 16w .. 16w + 15, all 64 columns
    {
        float kk[8][4], qk[8][4];
        #pragma unroll
        for (int nb = 0; nb < 8; ++nb)
            #pragma unroll
            for (int e = 0; e < 4; ++e) kk[nb][e] = qk[nb][e] = 0.0f;
        #pragma unroll
        for (u32 k0 = 0; k0 < DK; k0 += 16) {
            if (ldx == LDK) {
                mma_k16_pair<8, true>(kk, xb, qk, xa, LDK, 16 * warp, k0, xb, LDK, 0);
            } else {
                mma_k16<8, false, true>(kk, xb, LDK, 16 * warp, k0, xb, LDK, 0);
                mma_k16<8, false, true>(qk, xa, ldx, 16 * warp, k0, xb, LDK, 0);
            }
        }
        u16* m_out = ws_m + ((u64)chunk * hv + h) * CHUNK * CHUNK;
        #pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 i = 16 * warp + acc_row(lane, 2 * half);
                float mv[2];
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 j = acc_col(lane, nb, e);
                    const float decay = j <= i ? exp_f32(gam_s[i] - gam_s[j]) : 0.0f;
                    a_s[i * LDA + j] = j < i ? beta_s[i] * kk[nb][2 * half + e] * decay : 0.0f;
                    mv[e] = qk[nb][2 * half + e] * decay;
                }
                *reinterpret_cast<u32*>(m_out + i * CHUNK + acc_col(lane, nb, 0)) = pack_bf16x2(mv[0], mv[1]);
            }
        }
    }
    block_barrier();

    // v (into q's tile, free now) and the diagonal 16x16 blocks of T by column substitution
    for (u32 idx = tid; idx < CHUNK / CONV_ROWS * (dv / 8); idx += CHUNK_THREADS) {
        const u32 r0 = CONV_ROWS * (idx / (dv / 8)), ch = 8 * (idx % (dv / 8));
        float v[CONV_ROWS][8];
        conv8_silu_rows(src, conv_w, kernel, r0, valid, 2 * hk * DK + h * dv + ch, v);
        #pragma unroll
        for (int r = 0; r < CONV_ROWS; ++r)
            store_u32x4(xa + (r0 + r) * ldx + ch, {pack_bf16x2(v[r][0], v[r][1]), pack_bf16x2(v[r][2], v[r][3]),
                                                   pack_bf16x2(v[r][4], v[r][5]), pack_bf16x2(v[r][6], v[r][7])});
    }
    float x[16];
    const u32 column = tid % CHUNK, base = 16 * (column / 16), lc = column % 16;
    if (tid < CHUNK) {
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            float sum = i == (int)lc ? 1.0f : 0.0f;
            #pragma unroll
            for (int j = 0; j < i; ++j) sum -= a_s[(base + i) * LDA + base + j] * x[j];
            x[i] = i < (int)lc ? 0.0f : sum;
        }
    }
    block_barrier();
    if (tid < CHUNK) {
        #pragma unroll
        for (int i = 0; i < 16; ++i) a_s[(base + i) * LDA + base + lc] = x[i];
    }
    block_barrier();
    // block rows 1..3: T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj (the 16-term sums unrolled from one
    // row and one column pointer: immediate offsets, not an address computation per load)
    for (u32 bi = 1; bi < 4; ++bi) {
        for (u32 e = tid; e < bi * 256; e += CHUNK_THREADS) {
            const u32 bj = e / 256, r = (e / 16) % 16, c = e % 16;
            float sum = 0.0f;
            for (u32 bk = bj; bk < bi; ++bk) {
                const float* a_row = a_s + (16 * bi + r) * LDA + 16 * bk;
                const float* t_col = a_s + 16 * bk * LDA + 16 * bj + c;
                #pragma unroll
                for (u32 kk = 0; kk < 16; ++kk) sum += a_row[kk] * t_col[kk * LDA];
            }
            p_s[e] = sum;
        }
        block_barrier();
        for (u32 e = tid; e < bi * 256; e += CHUNK_THREADS) {
            const u32 bj = e / 256, r = (e / 16) % 16, c = e % 16;
            const float* t_row = a_s + (16 * bi + r) * LDA + 16 * bi;
            const float* p_col = p_s + bj * 256 + c;
            float sum = 0.0f;
            #pragma unroll
            for (u32 kk = 0; kk < 16; ++kk) sum -= t_row[kk] * p_col[kk * 16];
            a_s[(16 * bi + r) * LDA + 16 * bj + c] = sum;
        }
        block_barrier();
    }
    // T_w = T diag(beta e^gamma), T_u = T diag(beta), bf16, over the same bytes
    float tv[CHUNK * CHUNK / CHUNK_THREADS];
    #pragma unroll
    for (u32 e = 0; e < CHUNK * CHUNK / CHUNK_THREADS; ++e) {
        const u32 idx = tid + e * CHUNK_THREADS;
        tv[e] = a_s[(idx / CHUNK) * LDA + idx % CHUNK];
    }
    block_barrier();
    #pragma unroll
    for (u32 e = 0; e < CHUNK * CHUNK / CHUNK_THREADS; ++e) {
        const u32 idx = tid + e * CHUNK_THREADS, i = idx / CHUNK, j = idx % CHUNK;
        tw_s[i * LDA + j] = f32_to_bf16(tv[e] * beta_s[j] * exp_f32(gam_s[j]));
        tu_s[i * LDA + j] = f32_to_bf16(tv[e] * beta_s[j]);
    }
    block_barrier();

    // W = T_w K and U = T_u V on tensor cores (T lower triangular: k-blocks up to the warp's own)
    // W's columns in passes of up to 64 (8 n-blocks of 8; dk 32 takes one pass of 4)
    constexpr int WNB = DK < 64 ? DK / 8 : 8;
    u16* w_out = ws_w + ((u64)chunk * hv + h) * CHUNK * DK;
    for (u32 n0 = 0; n0 < DK; n0 += 8 * WNB) {
        float acc[WNB][4];
        #pragma unroll
        for (int nb = 0; nb < WNB; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
        for (u32 k0 = 0; k0 <= 16 * warp; k0 += 16) mma_k16<WNB, false, false>(acc, tw_s, LDA, 16 * warp, k0, xb, LDK, n0);
        #pragma unroll
        for (int nb = 0; nb < WNB; ++nb)
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 i = 16 * warp + acc_row(lane, 2 * half);
                *reinterpret_cast<u32*>(w_out + i * DK + n0 + acc_col(lane, nb, 0)) = pack_bf16x2(acc[nb][2 * half], acc[nb][2 * half + 1]);
            }
    }
    u16* u_out = ws_u + ((u64)chunk * hv + h) * CHUNK * dv;
    for (u32 n0 = 0; n0 < dv; n0 += 16) {
        float acc[2][4];
        #pragma unroll
        for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
        for (u32 k0 = 0; k0 <= 16 * warp; k0 += 16) mma_k16<2, false, false>(acc, tu_s, LDA, 16 * warp, k0, xa, ldx, n0);
        #pragma unroll
        for (int nb = 0; nb < 2; ++nb)
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 i = 16 * warp + acc_row(lane, 2 * half);
                *reinterpret_cast<u32*>(u_out + i * dv + n0 + acc_col(lane, nb, 0)) = pack_bf16x2(acc[nb][2 * half], acc[nb][2 * half + 1]);
            }
    }
}
{% endfor %}

// ============================================================================================
// gdn_chunk_state_dk{DK}_dv{DVS}: one block per (value head h, slice of DVS value columns,
// sequence), walking the sequence's chunks in order. The first half of its warps are the state
// warps: the state slice (DK x DVS fp32) stays in their registers in the accumulator layout, with
// a bf16 copy in shared memory as the B operand. The second half are the output warps. Each half
// is 4 warps per column slice (gdn.chunk_state_column_splits; 1 slice, 8 warps, on every target
// today, so below warp w of a role is warp w of 4). Per chunk (operands staged CHUNK_STAGES chunks ahead with cp.async where the
// target has it), chunk rows 16w..16w+15 for warp w of either role:
//   state warps:  X = W S, V' = U - X      (V' and e^(gamma_last - gamma) V' to shared, bf16)
//   output warps: Y = Q S, O = e^gamma Y
//   -- barrier --
//   state warps:  S = e^gamma_last S + K^T (e^(gamma_last - gamma) V'), its bf16 copy
//   output warps: O += M V' (causal: k-blocks up to the warp's own), O to `out`
// The two roles split what was one chain of products per warp (4 warps, one per scheduler:
// 34.1 us for the 8 chunks of T = 512 under ncu --set full, H200, thirteenth session) into two
// shorter chains side by side.
// O goes to `out` as bf16 (raw; gdn_gated_norm applies the gated RMSNorm when asked). Before the
// chunks: the initial state (the folded position > 0) with the pending tokens replayed; after:
// the final state to the slot and the last kernel - 1 raw rows to the conv ring (designated
// channels per block; the prepare pass, which reads the ring, has finished).
// ============================================================================================
{% if target.instructions.cp_async %}
{% include "common/cp_async.cuh" %}
{% endif %}

{% if target.gdn.chunk_stages > 0 %}
/// cp.async of a [CHUNK][COLS] bf16 tile (COLS % 8 == 0), source rows `src_ld` apart, to the
/// shared address `dst` with rows `dst_ld` elements apart, by the block's STATE_THREADS threads:
/// a thread copies the 16-byte pieces of one column, every STATE_THREADS / (COLS / 8) rows
/// (addresses from one row and column per thread, not a division and 64-bit pointer arithmetic
/// per piece: the stage loads were over a quarter of the pass's instructions).
template <u32 COLS>
FP4_DEVICE void stage_tile(u32 dst, u32 dst_ld, const u16* src, u32 src_ld, u32 tid) {
    constexpr u32 PIECES = COLS / 8, ROWS_PER_PASS = STATE_THREADS / PIECES;
    const u32 r0 = tid / PIECES, col = 8 * (tid % PIECES);
    const u32 d = dst + 2 * (r0 * dst_ld + col);
    const u16* s = src + (u64)r0 * src_ld + col;
    #pragma unroll
    for (u32 r = 0; r < CHUNK; r += ROWS_PER_PASS)
        if (r0 + r < CHUNK) cp_async16_shared(d + 2 * r * dst_ld, s + (u64)r * src_ld);
}
{% endif %}

{% for dk in [32, 64, 128] %}{% for dvs in [16, 32] %}
FP4_KERNEL void FP4_LAUNCH_BOUNDS(STATE_THREADS) gdn_chunk_state_dk{{ dk }}_dv{{ dvs }}(
    const u16* __restrict__ ws_q, const u16* __restrict__ ws_k, const u16* __restrict__ ws_w,
    const u16* __restrict__ ws_u, const u16* __restrict__ ws_m, const float* __restrict__ ws_gamma,
    const u16* __restrict__ qkv, u32 qkv_stride,
    float* state, u16* conv_ring, const float* __restrict__ ring_k, const float* __restrict__ ring_u,
    const float* __restrict__ ring_g,
    const u32* __restrict__ cu_seqlens, const u32* __restrict__ slots, const u32* __restrict__ positions,
    const u32* __restrict__ pending, u16* out,
    u32 hk, u32 hv, u32 dv, u32 kernel, u32 ring_len, u32 n_slots) {
    chain_after_previous_grid();
    // ROLE_WARPS warps per role. The products: role warp r takes chunk rows 16 (r % 4) .. + 15
    // and column slice r / 4 of CS (STATE_COLUMN_SPLITS where each slice keeps an even number of
    // n-blocks, else 1: warps past the slices only load and wait). The state's DK rows in blocks
    // of 16: state warp r holds blocks r, r + ROLE_WARPS, ...: MB per warp (`owns` says which
    // where DK runs out first).
    constexpr u32 DK = {{ dk }}, DVS = {{ dvs }}, NB = DVS / 8;
    constexpr u32 CS = NB / 2 >= STATE_COLUMN_SPLITS ? STATE_COLUMN_SPLITS : 1, NBS = NB / CS;
    constexpr u32 ROLE_WARPS = 4 * STATE_COLUMN_SPLITS, MB = (DK + 16 * ROLE_WARPS - 1) / (16 * ROLE_WARPS);
    constexpr u32 LDK = DK + PAD, LDM = CHUNK + PAD, LDV = DVS + PAD;
    GDN_SHARED smem[];
    const u32 tid = thread_x(), lane = tid % FP4_WARP_SIZE;
    const bool state_warp = tid < STATE_THREADS / 2;
    const u32 role_warp = (tid / FP4_WARP_SIZE) % ROLE_WARPS;
    const u32 warp = role_warp % 4, n0 = 8 * NBS * (role_warp / 4);
    const bool computes = role_warp / 4 < CS;
    const u32 splits = dv / DVS;
    const u32 h = block_x() / splits, split = block_x() % splits, j0 = split * DVS;
    const u32 seq = block_y();
    const u32 ratio = hv / hk, kh = h / ratio;
    // (constant true from dk 64 up; blocks past an unowned one are not owned either)
    auto owns = [&](u32 mb) { return state_warp && 16 * (role_warp + ROLE_WARPS * mb) < DK; };
    const u32 slot = slots[seq];
    if (slot >= n_slots) return;
    const u32 conv_dim = 2 * hk * DK + hv * dv;
    const u32 row_first = cu_seqlens[seq], len = cu_seqlens[seq + 1] - row_first;
    const u32 pos = positions[seq], pend = pending[seq];
    const u32 chunk_first = first_chunk(cu_seqlens, seq), chunks = (len + CHUNK - 1) / CHUNK;

    u16* sb_s = reinterpret_cast<u16*>(smem);  // [DK][LDV]: S as bf16
    u16* vp_s = sb_s + DK * LDV;                // [64][LDV]: V'
    u16* vq_s = vp_s + CHUNK * LDV;             // [64][LDV]: e^(gamma_last - gamma) V'
    unsigned char* stage_base = reinterpret_cast<unsigned char*>(vq_s + CHUNK * LDV);
    constexpr u32 STAGE_BYTES = (3 * CHUNK * LDK + CHUNK * LDM + CHUNK * LDV) * 2 + CHUNK * 4;

    // the conv window after the call: raw rows of the last kernel - 1 positions, by position
    {
        const u32 end = pos + len, from = end - min_u32(len, kernel - 1);
        for (u32 p = from; p < end; ++p) {
            const u16* src = qkv + (u64)(row_first + p - pos) * qkv_stride;
            u16* dst = conv_ring + ((u64)slot * ring_len + p % ring_len) * conv_dim;
            for (u32 c = tid; c < DVS; c += STATE_THREADS) dst[2 * hk * DK + h * dv + j0 + c] = src[2 * hk * DK + h * dv + j0 + c];
            if (h % ratio == 0)
                for (u32 c = split + splits * tid; c < DK; c += splits * STATE_THREADS) {
                    dst[kh * DK + c] = src[kh * DK + c];
                    dst[hk * DK + kh * DK + c] = src[hk * DK + kh * DK + c];
                }
        }
    }

    // the initial state, with the pending tokens replayed
    float s[MB][NB][4];
    float* s_base = state + (u64)slot * hv * DK * dv + (u64)h * DK * dv + j0;
    #pragma unroll
    for (u32 mb = 0; mb < MB && owns(mb); ++mb)
        #pragma unroll
        for (u32 nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 i = 16 * (role_warp + ROLE_WARPS * mb) + acc_row(lane, e), j = acc_col(lane, nb, e);
                s[mb][nb][e] = pos > pend ? s_base[(u64)i * dv + j] : 0.0f;
            }
    for (u32 c = 0; c < pend; ++c) {
        const u64 at = (u64)slot * ring_len + (pos - pend + c) % ring_len;
        const float decay = exp_f32(ring_g[at * hv + h]);
        #pragma unroll
        for (u32 mb = 0; mb < MB && owns(mb); ++mb)
            #pragma unroll
            for (u32 nb = 0; nb < NB; ++nb)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 i = 16 * (role_warp + ROLE_WARPS * mb) + acc_row(lane, e), j = acc_col(lane, nb, e);
                    s[mb][nb][e] = decay * s[mb][nb][e] + ring_k[at * hk * DK + kh * DK + i] * ring_u[at * hv * dv + h * dv + j0 + j];
                }
    }
    // S as the B operand
    auto store_sb = [&]() {
        #pragma unroll
        for (u32 mb = 0; mb < MB && owns(mb); ++mb)
            #pragma unroll
            for (u32 nb = 0; nb < NB; ++nb)
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 i = 16 * (role_warp + ROLE_WARPS * mb) + acc_row(lane, 2 * half);
                    *reinterpret_cast<u32*>(sb_s + i * LDV + acc_col(lane, nb, 0)) = pack_bf16x2(s[mb][nb][2 * half], s[mb][nb][2 * half + 1]);
                }
    };
    store_sb();

    // where chunk c's operands are: a shared-memory stage, or (no stages) the workspace itself
    struct Operands { const u16 *w, *q, *k, *m, *u; const float* gamma; u32 ldk, ldm, ldu; };
    auto global_operands = [&](u32 c) {
        const u64 ch = chunk_first + c;
        return Operands{ws_w + (ch * hv + h) * CHUNK * DK, ws_q + (ch * hk + kh) * CHUNK * DK, ws_k + (ch * hk + kh) * CHUNK * DK,
                        ws_m + (ch * hv + h) * CHUNK * CHUNK, ws_u + (ch * hv + h) * CHUNK * dv + j0, ws_gamma + (ch * hv + h) * CHUNK,
                        DK, CHUNK, dv};
    };
{% if target.gdn.chunk_stages > 0 %}
    auto stage_operands = [&](u32 c) {
        unsigned char* base = stage_base + (c % CHUNK_STAGES) * STAGE_BYTES;
        const u16* w = reinterpret_cast<const u16*>(base);
        const u16* q = w + CHUNK * LDK;
        const u16* k = q + CHUNK * LDK;
        const u16* m = k + CHUNK * LDK;
        const u16* u = m + CHUNK * LDM;
        const float* gamma = reinterpret_cast<const float*>(u + CHUNK * LDV);
        return Operands{w, q, k, m, u, gamma, LDK, LDM, LDV};
    };
    auto load_stage = [&](u32 c) {
        if (c < chunks) {
            const Operands g = global_operands(c), d = stage_operands(c);
            stage_tile<DK>(cp_async_shared_address(d.w), LDK, g.w, DK, tid);
            stage_tile<DK>(cp_async_shared_address(d.q), LDK, g.q, DK, tid);
            stage_tile<DK>(cp_async_shared_address(d.k), LDK, g.k, DK, tid);
            stage_tile<CHUNK>(cp_async_shared_address(d.m), LDM, g.m, CHUNK, tid);
            stage_tile<DVS>(cp_async_shared_address(d.u), LDV, g.u, dv, tid);
            if (tid < CHUNK / 4) cp_async16((void*)(d.gamma + 4 * tid), g.gamma + 4 * tid);
        }
        cp_async_commit();  // one group per chunk, empty past the end, so the wait count is fixed
    };
    #pragma unroll
    for (u32 c = 0; c < CHUNK_STAGES; ++c) load_stage(c);
{% endif %}
    block_barrier();

    for (u32 c = 0; c < chunks; ++c) {
{% if target.gdn.chunk_stages > 0 %}
        cp_async_wait<CHUNK_STAGES - 1>();
        block_barrier();
        const Operands op = stage_operands(c);
{% else %}
        const Operands op = global_operands(c);
{% endif %}
        const u32 valid = min_u32((u32)CHUNK, len - c * CHUNK);
        const float gamma_last = op.gamma[CHUNK - 1];
        // state warps X = W S, output warps Y = Q S: acc
        float acc[NBS][4];
        #pragma unroll
        for (u32 nb = 0; nb < NBS; ++nb)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[nb][e] = 0.0f;
        if (computes) {
            const u16* a_rows = state_warp ? op.w : op.q;
            // the thread's two rows' factors, e^(gamma_last - gamma) (state) or e^gamma (output),
            // while the products run
            float factor[2];
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float gi = op.gamma[16 * warp + acc_row(lane, 2 * half)];
                factor[half] = exp_f32(state_warp ? gamma_last - gi : gi);
            }
            #pragma unroll
            for (u32 k0 = 0; k0 < DK; k0 += 16) mma_k16<NBS, false, false>(acc, a_rows, op.ldk, 16 * warp, k0, sb_s, LDV, n0);
            #pragma unroll
            for (u32 nb = 0; nb < NBS; ++nb)
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 i = 16 * warp + acc_row(lane, 2 * half), j = n0 + acc_col(lane, nb, 0);
                    if (state_warp) {
                        // V' = U - X
                        float vp[2];
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) vp[e] = bf16_to_f32(op.u[i * op.ldu + j + e]) - acc[nb][2 * half + e];
                        *reinterpret_cast<u32*>(vp_s + i * LDV + j) = pack_bf16x2(vp[0], vp[1]);
                        *reinterpret_cast<u32*>(vq_s + i * LDV + j) = pack_bf16x2(vp[0] * factor[half], vp[1] * factor[half]);
                    } else {
                        // O = e^gamma Y
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) acc[nb][2 * half + e] *= factor[half];
                    }
                }
        }
        block_barrier();  // V' is whole; every read of S's bf16 copy is done
        if (state_warp) {
            // S = e^gamma_last S + K^T V''
            const float decay = exp_f32(gamma_last);
            #pragma unroll
            for (u32 mb = 0; mb < MB && owns(mb); ++mb) {
                #pragma unroll
                for (u32 nb = 0; nb < NB; ++nb)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[mb][nb][e] *= decay;
                #pragma unroll
                for (u32 k0 = 0; k0 < CHUNK; k0 += 16) mma_k16<NB, true, false>(s[mb], op.k, op.ldk, 16 * (role_warp + ROLE_WARPS * mb), k0, vq_s, LDV, 0);
            }
        } else if (computes) {
            // O += M V', then out
            for (u32 k0 = 0; k0 <= 16 * warp; k0 += 16) mma_k16<NBS, false, false>(acc, op.m, op.ldm, 16 * warp, k0, vp_s, LDV, n0);
            #pragma unroll
            for (u32 nb = 0; nb < NBS; ++nb)
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 i = 16 * warp + acc_row(lane, 2 * half);
                    if (i < valid)
                        *reinterpret_cast<u32*>(out + (u64)(row_first + c * CHUNK + i) * hv * dv + h * dv + j0 + n0 + acc_col(lane, nb, 0)) =
                            pack_bf16x2(acc[nb][2 * half], acc[nb][2 * half + 1]);
                }
        }
        store_sb();
        block_barrier();  // S, V' and the stage buffer are free again
{% if target.gdn.chunk_stages > 0 %}
        load_stage(c + CHUNK_STAGES);
{% endif %}
    }

    // the final state
    #pragma unroll
    for (u32 mb = 0; mb < MB && owns(mb); ++mb)
        #pragma unroll
        for (u32 nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 i = 16 * (role_warp + ROLE_WARPS * mb) + acc_row(lane, 2 * half), j = acc_col(lane, nb, 0);
                *reinterpret_cast<u32x2*>(s_base + (u64)i * dv + j) = {f32_to_bits(s[mb][nb][2 * half]), f32_to_bits(s[mb][nb][2 * half + 1])};
            }
}
{% endfor %}{% endfor %}
