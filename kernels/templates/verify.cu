// Family `verify`: batched speculative verification and plain sampling with every sampling
// control honoured (rendered for {{ target.name }}). The CPU reference is the definition, bit
// for bit: src/kernels/verify/reference.rs. Launch and device interface:
// src/kernels/verify/mod.rs (the structs below are its `device` module).
//
// One launch of each kernel serves the whole batch (rows of every sequence; per-sequence controls
// in `VerifySequence`):
//   verify_histogram  pass 1 over the logits. Blocks of a row histogram its tokens by weight
//                     bucket (octave x sub-bucket; per bucket the token count and the exact sum
//                     of the 24-bit weight mantissas, so histograms of different blocks add
//                     exactly once aligned on octaves), add them atomically into the row's grid
//                     (anchored at the first block's top octave), and find the argmax and the
//                     first bad logit. The row's last block turns the grid into the histogram
//                     below the row's top octave and plans: which buckets hold the top-k, top-p,
//                     min-p cuts and the draw, from the exact bucket counts and weights.
//   verify_select     pass 2 over the logits. Blocks collect the tokens of the planned buckets
//                     (and count what min-p and the probe token need).
//   verify_finish     one block per row finishes it exactly: sorts the candidates, resolves
//                     every cut and the draw inside its bucket (or, when a bucket was not
//                     collected, by radix rounds over the row); the sequence's last row walks
//                     the acceptance chain. Its own kernel so that pass 2 streams at the
//                     occupancy of its few registers.
//   verify_residual   only for sampled drafts after a rejection: the residual max(0, p - q) of
//                     the two rows, drawn by token id.
//   verify_greedy     alone, for a batch of greedy sequences: pass 1's argmax, then each
//                     sequence's acceptance chain, in one launch.
//   verify_topk       for a batch whose every sequence has top-k on (at most top_k_max) or is
//                     greedy: one pass keeps each row's top k candidates, the row's last block
//                     finishes it exactly, the sequence's last row walks the chain; one launch
//                     (then verify_residual for sampled drafts).
// No sort of the vocabulary, no allocation, no host synchronisation: capturable in a graph.
{% include "common/prelude.cuh" %}
{% include "common/sync.cuh" %}
{% if target.warp_size != 32 %}
#error "verify.cu assumes 32-lane warps (u32 ballots)"
{% endif %}

#define VT {{ target.verify.threads_per_block }}
{#- NVIDIA: no __launch_bounds__, under which ptxas 13.0 spilled verify_finish and
    verify_residual (without it they take 106 and 96 registers and spill nothing); AMD needs the
    bound, or the compiler sizes VGPRs for 1024-lane work-groups. #}
{%- if target.vendor == "amd" %}{% set bounds = "FP4_LAUNCH_BOUNDS(VT) " %}{% else %}{% set bounds = "" %}{% endif %}
// verify_greedy streams in one wave of greedy_blocks_per_sm blocks per multiprocessor (its grid
// is sized for them); on NVIDIA its launch bounds hold its registers to that
{%- if target.vendor == "amd" %}
#define VGREEDY_BOUNDS VT
{%- else %}
#define VGREEDY_BOUNDS VT, {{ target.verify.greedy_blocks_per_sm }}
{%- endif %}
// verify_topk: the same for top_k_blocks_per_sm
{%- if target.vendor == "amd" %}
#define VTOPK_BOUNDS VT
{%- else %}
#define VTOPK_BOUNDS VT, {{ target.verify.top_k_blocks_per_sm }}
{%- endif %}
#define VI {{ target.verify.items_per_thread }}
#define VG {{ target.verify.sub_buckets_per_octave }}
#define VCAP {{ target.verify.candidates_per_row }}
#define VCHUNK (VT * VI)
#define VWARPS (VT / FP4_WARP_SIZE)
#define VOCT 40                               // reference.rs MASS_OCTAVES
#define VNB ((VOCT + 1) * VG)                 // buckets, the top one first
#define VPLAN_WORDS ((VNB + 63) / 64)
#define VMAX_BLOCKS_PER_ROW 256
#define VMAX_WINDOWS 8
#define VHEAD 64                              // octaves a row's grid reaches above its anchor
#define VGRID ((VOCT + 1 + VHEAD) * VG)
#define VNONE 0xffffffffu
#define VNO_OCTAVE ((i32)0x80000000)
#define VKAPPA_ALL ((1ull << 52) - 1)
#define VCOUNT_SHIFT 44                       // packed bucket: count << 44 | sum of mantissas

// Per-sequence status (mod.rs decodes it).
#define VSTATUS_OK 0u
#define VSTATUS_NONFINITE 1u
#define VSTATUS_EMPTY 2u
#define VSTATUS_TOKEN 3u
#define VSTATUS_PARAM 4u
#define VSTATUS_PENDING 5u
#define VSTATUS_STALE 6u                      // verify_greedy ran for a sequence it cannot serve
#define VSTATUS_WORDS 8                       // code, accepted, error row, token, value bits, residual row
#define VSEQ_SAMPLED_DRAFTS 1u

// Row state, u64 words (written by the kernels, read only by them).
#define RS_STATUS 0        // lo status, hi error token
#define RS_VALUE 1         // lo error value bits, hi argmax
#define RS_TOP 2           // lo top octave, hi top mantissa
#define RS_PROBE 3         // lo probe bucket (VNONE: weight 0 or no probe), hi probe logit bits
#define RS_MINP 4          // lo first bucket min-p does not keep whole, hi end of its partial buckets
#define RS_PASS2 5         // lo candidates collected, hi tokens before the probe in its bucket
#define RS_PASS2_MINP 6    // lo min-p survivors in the partial buckets, hi flags
#define RS_BEFORE_MASS 7   // mantissa sum before the probe in its bucket
#define RS_MASS 8          // u128: kept weight S (8, 9)
#define RS_PROBE_W 10      // u128: probe weight (pass 1), its kept weight (pass 2) (10, 11)
#define RS_PROBE_BEFORE 12 // u128: kept weight before the probe (12, 13)
#define RS_CUT 14          // lo bucket of the last kept token, hi drawn token
#define RS_CUT_KAPPA 15    // kappa of the last kept token (VKAPPA_ALL: its bucket is kept whole)
#define RS_PLAN 16         // VPLAN_WORDS words: buckets pass 2 collects
#define VROW_WORDS (RS_PLAN + VPLAN_WORDS)
#define VFLAG_STREAM 1u
// Marks the rare paths (a CPU emulation of the kernels counts them): VTRACE_RADIX per radix
// fallback of the finish, VTRACE_SPILL per pass-1 block whose top lies above its row's grid,
// VTRACE_TOPK_FULL per verify_topk candidate buffer that filled up (and was cut to its top k).
#define VTRACE_RADIX 0
#define VTRACE_SPILL 1
#define VTRACE_TOPK_FULL 2
#ifndef VERIFY_TRACE
#define VERIFY_TRACE(what)
#endif

typedef long long i64;

// ---- portability: what this family needs beyond common/prelude.cuh ----
{% if target.vendor == "nvidia" %}
// Functions that run once per row or sequence, off the streaming loops: out of line, so that
// their registers do not weigh on the kernels' streaming code.
#define VERIFY_RARE __device__ __noinline__
FP4_DEVICE u32 atomic_cas_u32(u32* p, u32 expected, u32 desired) { return atomicCAS(p, expected, desired); }
FP4_DEVICE u32 atomic_max_u32(u32* p, u32 v) { return atomicMax(p, v); }
FP4_DEVICE u64 atomic_add_u64(u64* p, u64 v) {
    return atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
FP4_DEVICE u32 ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
FP4_DEVICE u32 popcount(u32 v) { return (u32)__popc(v); }
FP4_DEVICE u32 lowest_bit(u32 v) { return (u32)(__ffs((int)v) - 1); }
FP4_DEVICE u32 highest_bit64(u64 v) { return 63u - (u32)__clzll((long long)v); }
// data other blocks of this launch wrote: past L1
FP4_DEVICE u64 load_shared_u64(const u64* p) { return __ldcg(reinterpret_cast<const unsigned long long*>(p)); }
FP4_DEVICE u32 load_shared_u32(const u32* p) { return __ldcg(reinterpret_cast<const unsigned int*>(p)); }
// correctly rounded, never contracted into a fused multiply-add: the reference's arithmetic
FP4_DEVICE float mul32(float a, float b) { return __fmul_rn(a, b); }
FP4_DEVICE float fma32(float a, float b, float c) { return __fmaf_rn(a, b, c); }
FP4_DEVICE float add32(float a, float b) { return __fadd_rn(a, b); }
FP4_DEVICE float sub32(float a, float b) { return __fsub_rn(a, b); }
FP4_DEVICE float div32(float a, float b) { return __fdiv_rn(a, b); }
FP4_DEVICE double mul64(double a, double b) { return __dmul_rn(a, b); }
FP4_DEVICE double add64(double a, double b) { return __dadd_rn(a, b); }
FP4_DEVICE double sub64(double a, double b) { return __dsub_rn(a, b); }
FP4_DEVICE double div64(double a, double b) { return __ddiv_rn(a, b); }
FP4_DEVICE double u64_to_f64(u64 v) { return __ull2double_rn((unsigned long long)v); }
FP4_DEVICE u64 f64_to_u64_nearest(double v) { return (u64)__double2ull_rn(v); }
FP4_DEVICE double floor64(double v) { return floor(v); }
FP4_DEVICE float floor32(float v) { return floorf(v); }
FP4_DEVICE float min32(float a, float b) { return fminf(a, b); }
FP4_DEVICE float max32(float a, float b) { return fmaxf(a, b); }
FP4_DEVICE double bits_to_f64(u64 b) { return __longlong_as_double((long long)b); }
FP4_DEVICE u64 mul_hi_u64(u64 a, u64 b) { return (u64)__umul64hi((unsigned long long)a, (unsigned long long)b); }
{% else %}
// HIP contracts a * b + c into an FMA unless told not to; the reference never does.
#pragma clang fp contract(off)
// Functions that run once per row or sequence: inlined. As calls they cost scratch memory under
// the AMDGPU calling convention (every object a callee gets by reference, VerifyArgs, RowView,
// ..., is copied to the caller's private stack, 496 bytes per lane in verify_histogram and 256
// in verify_finish), and the callee's registers count against the kernel either way.
#define VERIFY_RARE FP4_DEVICE
FP4_DEVICE u64 atomic_add_u64(u64* p, u64 v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE u32 atomic_max_u32(u32* p, u32 v) {
    return __hip_atomic_fetch_max(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE u32 atomic_cas_u32(u32* p, u32 expected, u32 desired) {
    __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                         __HIP_MEMORY_SCOPE_AGENT);
    return expected;
}
FP4_DEVICE u32 ballot(bool p) { return (u32)__builtin_amdgcn_ballot_w32(p); }
FP4_DEVICE u32 popcount(u32 v) { return (u32)__builtin_popcount(v); }
FP4_DEVICE u32 lowest_bit(u32 v) { return (u32)__builtin_ctz(v); }
FP4_DEVICE u32 highest_bit64(u64 v) { return 63u - (u32)__builtin_clzll(v); }
FP4_DEVICE u64 load_shared_u64(const u64* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE u32 load_shared_u32(const u32* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
FP4_DEVICE float mul32(float a, float b) { return a * b; }
FP4_DEVICE float fma32(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
FP4_DEVICE float add32(float a, float b) { return a + b; }
FP4_DEVICE float sub32(float a, float b) { return a - b; }
FP4_DEVICE float div32(float a, float b) { return a / b; }
FP4_DEVICE double mul64(double a, double b) { return a * b; }
FP4_DEVICE double add64(double a, double b) { return a + b; }
FP4_DEVICE double sub64(double a, double b) { return a - b; }
FP4_DEVICE double div64(double a, double b) { return a / b; }
FP4_DEVICE double u64_to_f64(u64 v) { return (double)v; }
FP4_DEVICE u64 f64_to_u64_nearest(double v) { return (u64)__builtin_rint(v); }
FP4_DEVICE double floor64(double v) { return __builtin_floor(v); }
FP4_DEVICE float floor32(float v) { return __builtin_floorf(v); }
FP4_DEVICE float min32(float a, float b) { return __builtin_fminf(a, b); }
FP4_DEVICE float max32(float a, float b) { return __builtin_fmaxf(a, b); }
FP4_DEVICE double bits_to_f64(u64 b) { return __builtin_bit_cast(double, b); }
FP4_DEVICE u64 mul_hi_u64(u64 a, u64 b) { return (u64)(((unsigned __int128)a * b) >> 64); }
{% endif %}
FP4_DEVICE u32 warp_index() { return thread_x() / FP4_WARP_SIZE; }

/// Unsigned 128-bit integers for weights (NVRTC has no __int128 without an extra flag).
struct u128 {
    u64 lo, hi;
};
FP4_DEVICE u128 w128(u64 v) { return {v, 0}; }
FP4_DEVICE u128 operator+(u128 a, u128 b) { return {a.lo + b.lo, a.hi + b.hi + (a.lo + b.lo < a.lo ? 1ull : 0ull)}; }
FP4_DEVICE u128 operator-(u128 a, u128 b) { return {a.lo - b.lo, a.hi - b.hi - (a.lo < b.lo ? 1ull : 0ull)}; }
FP4_DEVICE u128& operator+=(u128& a, u128 b) { return a = a + b; }
FP4_DEVICE bool operator==(u128 a, u128 b) { return a.lo == b.lo && a.hi == b.hi; }
FP4_DEVICE bool operator!=(u128 a, u128 b) { return !(a == b); }
FP4_DEVICE bool operator<(u128 a, u128 b) { return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo); }
FP4_DEVICE bool operator>(u128 a, u128 b) { return b < a; }
FP4_DEVICE bool operator<=(u128 a, u128 b) { return !(b < a); }
FP4_DEVICE bool operator>=(u128 a, u128 b) { return !(a < b); }
FP4_DEVICE u128 operator<<(u128 a, u32 s) {
    if (s == 0) return a;
    if (s >= 128) return {0, 0};
    if (s >= 64) return {0, a.lo << (s - 64)};
    return {a.lo << s, (a.hi << s) | (a.lo >> (64 - s))};
}
FP4_DEVICE u128 operator>>(u128 a, u32 s) {
    if (s == 0) return a;
    if (s >= 128) return {0, 0};
    if (s >= 64) return {a.hi >> (s - 64), 0};
    return {(a.lo >> s) | (a.hi << (64 - s)), a.hi >> s};
}
/// a * m; the product must fit 128 bits.
FP4_DEVICE u128 mul_u32(u128 a, u32 m) { return {a.lo * m, a.hi * m + mul_hi_u64(a.lo, m)}; }
FP4_DEVICE float f32_inf() { return bits_to_f32(0x7f800000u); }

// ---- the device interface (mod.rs `device`: the same layout, repr(C)) ----
struct VerifySequence {
    u64 seed;
    u64 position;       // position of the sequence's first target row
    float temperature;  // 0: greedy
    float top_p;
    float min_p;
    u32 top_k;          // 0: off
    u32 drafts;         // n
    u32 first_row;      // its n + 1 target rows, then (sampled drafts) its n draft rows
    u32 first_draft;    // its draft tokens (and draft logit rows)
    u32 bias_begin;     // its logit bias, sorted by token (list order among equal tokens)
    u32 bias_end;
    u32 host_error;     // nonzero: the host rejected its controls; nothing runs
    u32 flags;          // VSEQ_SAMPLED_DRAFTS
    u32 reserved;
};

struct VerifyRow {
    u32 sequence;
    u32 index;          // j: target row j (0..=n) or draft row j (0..n)
    u32 is_draft;
    u32 logits_row;     // row of target_logits or draft_logits
};

struct VerifyArgs {
    const float* target_logits;     // [target rows][vocab]
    const float* draft_logits;      // [draft rows][vocab] (sampled drafts)
    const u32* draft_tokens;        // [draft rows]
    const VerifySequence* sequences;
    const VerifyRow* rows;
    const u32* bias_tokens;
    const float* bias_values;
    u64* block_hist;                // [rows * blocks_per_row][VNB] (blocks above their row's grid;
                                    // verify_topk: a block's VTOPK_POOL largest candidates)
    u64* block_summary;             // [rows * blocks_per_row][3]
    u64* row_grid;                  // [rows][VGRID], zero between launches
    u32* row_anchor;                // [rows], zero between launches (verify_topk: the row's bound key)
    u64* row_hist;                  // [rows][VNB]
    u64* row_state;                 // [rows][VROW_WORDS]
    u64* candidates;                // [rows][VCAP]: logit bits << 32 | token (verify_topk: order codes,
                                    // [rows][blocks per row][VTOPK_BUF])
    u64* residual_sums;             // [sequences][chunks_per_row]
    u32* counters;                  // [rows + 2 * sequences], zero between launches
    u32* emitted;                   // [sequences][max_drafts + 1]
    u32* status;                    // [sequences][VSTATUS_WORDS]
    u64* stats;                     // drafted[max_drafts], then accepted[max_drafts]
    u32 vocab;
    u32 sequence_count;
    u32 row_count;
    u32 max_drafts;
    u32 chunks_per_row;
    u32 chunks_per_block;           // verify_histogram / verify_select: chunks each block streams
    u32 blocks_per_row;
    u32 reserved;
};

// the layout mod.rs `device` mirrors
static_assert(sizeof(VerifySequence) == 64, "VerifySequence layout");
static_assert(sizeof(VerifyRow) == 16, "VerifyRow layout");
static_assert(sizeof(VerifyArgs) == 19 * 8 + 8 * 4, "VerifyArgs layout");

// ---- the reference's arithmetic, bit for bit ----
#define LOG2_E_BITS 0x3fb8aa3bu

/// reference.rs exp2_mantissa: min(2, p(f)) * 2^23, p the degree-8 Taylor polynomial of 2^f by
/// Horner with correctly rounded fused multiply-adds.
FP4_DEVICE u32 exp2_mantissa(float f) {
    float p = bits_to_f32(0x35b16011u);
    p = fma32(p, f, bits_to_f32(0x377fe5feu));
    p = fma32(p, f, bits_to_f32(0x39218489u));
    p = fma32(p, f, bits_to_f32(0x3aaec3ffu));
    p = fma32(p, f, bits_to_f32(0x3c1d955bu));
    p = fma32(p, f, bits_to_f32(0x3d635847u));
    p = fma32(p, f, bits_to_f32(0x3e75fdf0u));
    p = fma32(p, f, bits_to_f32(0x3f317218u));
    p = fma32(p, f, bits_to_f32(0x3f800000u));
    return (u32)mul32(min32(p, 2.0f), 8388608.0f);
}

struct TokenParts {
    i32 octave;  // k = floor(y)
    u32 sub;     // min(floor(f * VG), VG - 1): the sub-bucket
    float frac;  // f = y - k, rounded: 1 for -2^-25 <= y < 0
};

/// reference.rs octave_mantissa (and the sub-bucket, which only the kernels use).
FP4_DEVICE TokenParts token_parts(float z, float scale) {
    const float y = min32(max32(mul32(z, scale), -1073741824.0f), 1073741824.0f);
    const float k = floor32(y);
    TokenParts p;
    p.octave = (i32)k;
    p.frac = sub32(y, k);
    // f rounds up to 1 for y just below 0: the token is the heaviest of octave k (mantissa
    // exp2_mantissa(1)), in its top sub-bucket; floor(f * VG) = VG would name a bucket of the
    // octave above, whose weights are twice as large
    p.sub = min_u32((u32)floor32(mul32(p.frac, (float)VG)), VG - 1);
    return p;
}

/// Octaves below the row's top, or -1 when the token weighs nothing.
FP4_DEVICE i32 octaves_below(i32 top, i32 octave) {
    const i64 below = (i64)top - (i64)octave;
    return below <= VOCT ? (i32)below : -1;
}
FP4_DEVICE u32 bucket_index(i32 below, u32 sub) { return (u32)below * VG + (VG - 1 - sub); }
FP4_DEVICE i32 bucket_below(u32 bucket) { return (i32)(bucket / VG); }
FP4_DEVICE u32 bucket_sub(u32 bucket) { return VG - 1 - bucket % VG; }
FP4_DEVICE u32 packed_count(u64 packed) { return (u32)(packed >> VCOUNT_SHIFT); }
FP4_DEVICE u64 packed_mantissas(u64 packed) { return packed & ((1ull << VCOUNT_SHIFT) - 1); }
/// A mantissa sum of bucket `bucket` as weight.
FP4_DEVICE u128 bucket_weight(u64 mantissas, u32 bucket) {
    return w128(mantissas) << (VOCT - bucket_below(bucket));
}
FP4_DEVICE double pow2(i32 e) { return bits_to_f64((u64)(1023 + e) << 52); }

/// Ascending with z; -0 never reaches it (canonicalised on load).
FP4_DEVICE u32 order_key(float z) {
    const u32 u = f32_to_bits(z);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
FP4_DEVICE float key_to_f32(u32 key) {
    return bits_to_f32((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
/// Ascending kappa = the order within a bucket: z descending, then token ascending.
FP4_DEVICE u64 kappa_of(float z, u32 token) { return ((u64)(u32)~order_key(z) << 20) | token; }
FP4_DEVICE float kappa_logit(u64 kappa) { return key_to_f32(~(u32)(kappa >> 20)); }
/// Largest z, then lowest token, as the largest code; 0 = nothing.
FP4_DEVICE u64 argmax_code(float z, u32 token) { return ((u64)order_key(z) << 32) | (u32)~token; }

/// reference.rs uniform_bits / uniform.
FP4_DEVICE u64 uniform_bits(u64 seed, u64 position, u64 stream, u64 token) {
    u64 z = seed ^ (position * 0x9e3779b97f4a7c15ull) ^ (stream * 0xd1b54a32d192ed03ull) ^
            (token * 0x8cb92ba72f3d8dd7ull);
    for (int i = 0; i < 2; ++i) {
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
    }
    return z >> 11;
}
#define STREAM_ACCEPT 0ull
#define STREAM_TOKEN 1ull
FP4_DEVICE double uniform01(u64 seed, u64 position, u64 stream) {
    return mul64(add64(u64_to_f64(uniform_bits(seed, position, stream, 0)), 0.5), 0x1p-53);
}

/// reference.rs mass_to_f64.
FP4_DEVICE double mass_to_f64(u128 x) {
    return add64(mul64(u64_to_f64(x.hi), 18446744073709551616.0), u64_to_f64(x.lo));
}
/// A non-negative integral double as u128, exactly.
FP4_DEVICE u128 f64_to_u128(double t) {
    if (t < 18446744073709551616.0) return w128((u64)t);
    const double hi = floor64(mul64(t, 0x1p-64));
    return {(u64)sub64(t, mul64(hi, 18446744073709551616.0)), (u64)hi};
}
/// reference.rs draw_target.
FP4_DEVICE u128 draw_target(double u, u128 total) {
    const u128 t = f64_to_u128(floor64(mul64(u, mass_to_f64(total))));
    return t < total ? t : total - w128(1);
}
/// reference.rs top_p_need: ceil(top_p * mass), exactly.
FP4_DEVICE u128 top_p_need(float top_p, u128 mass) {
    const u32 bits = f32_to_bits(top_p);
    const i32 exponent = (i32)((bits >> 23) & 0xffu);
    const u32 mantissa = exponent == 0 ? (bits & 0x7fffffu) : ((bits & 0x7fffffu) | 0x800000u);
    const i32 power = exponent == 0 ? -149 : exponent - 150;
    const u128 product = mul_u32(mass, mantissa);
    if (power >= 0) return product << power;
    const u32 shift = (u32)-power;
    if (shift >= 128) return w128(product != w128(0) ? 1 : 0);
    const u128 quotient = product >> shift;
    return quotient + w128((quotient << shift) != product ? 1 : 0);
}
/// reference.rs passes_min_p.
FP4_DEVICE bool passes_min_p(u32 mantissa, i32 below, float min_p, u32 top_mantissa) {
    return mul64((double)mantissa, pow2(-below)) >= mul64((double)min_p, (double)top_mantissa);
}

// ---- rows ----
FP4_DEVICE bool row_is_processed(const VerifySequence& seq, const VerifyRow& row) {
    return seq.host_error == 0 && (row.is_draft == 0 || seq.temperature > 0.0f);
}
FP4_DEVICE u32 rows_of(const VerifySequence& seq) {
    return seq.drafts + 1 + ((seq.flags & VSEQ_SAMPLED_DRAFTS) ? seq.drafts : 0);
}

/// One row's logits with its sequence's bias and temperature.
struct RowView {
    const float* logits;
    const u32* bias_tokens;
    const float* bias_values;
    u32 bias_begin;
    u32 bias_end;
    u32 vocab;
    u32 chunks;
    float scale;  // log2(e) / T (0 for greedy)
};

/// A row's logits: they depend on the row alone, not on its sequence.
FP4_DEVICE const float* row_logits(const VerifyArgs& a, const VerifyRow& row) {
    return (row.is_draft ? a.draft_logits : a.target_logits) + (u64)row.logits_row * a.vocab;
}

FP4_DEVICE RowView row_view(const VerifyArgs& a, const VerifyRow& row, const VerifySequence& seq) {
    RowView v;
    v.logits = row_logits(a, row);
    v.bias_tokens = a.bias_tokens;
    v.bias_values = a.bias_values;
    v.bias_begin = seq.bias_begin;
    v.bias_end = seq.bias_end;
    v.vocab = a.vocab;
    v.chunks = a.chunks_per_row;
    v.scale = seq.temperature > 0.0f ? div32(bits_to_f32(LOG2_E_BITS), seq.temperature) : 0.0f;
    return v;
}

/// First bias entry at or after `token`.
FP4_DEVICE u32 first_bias_at(const RowView& v, u32 token) {
    u32 lo = v.bias_begin, hi = v.bias_end;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2;
        if (v.bias_tokens[mid] < token) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/// Calls visit(entry, token, j) for each bias entry of chunk `chunk` on this thread's tokens
/// (token = chunk * VCHUNK + thread_x() + VT * j), in list order.
template <typename Visit>
FP4_DEVICE void for_own_bias(const RowView& v, u32 chunk, Visit visit) {
    const u32 base = chunk * VCHUNK;
    for (u32 i = first_bias_at(v, base); i < v.bias_end; ++i) {
        const u32 token = v.bias_tokens[i];
        if (token >= base + VCHUNK) break;
        const u32 offset = token - base;
        if (offset % VT == thread_x()) visit(i, token, offset / VT);
    }
}

/// Logit `x` of `token` with the bias applied (reference.rs biased, step 1).
FP4_DEVICE float with_bias(const RowView& v, u32 token, float x) {
    float z = x;
    for (u32 i = first_bias_at(v, token); i < v.bias_end && v.bias_tokens[i] == token; ++i)
        z = add32(z, v.bias_values[i]);
    return add32(z, 0.0f);
}

/// The biased logit of one token; `raw` gets the logit itself.
FP4_DEVICE float biased_logit(const RowView& v, u32 token, float* raw) {
    *raw = v.logits[token];
    return with_bias(v, token, *raw);
}

/// Copies the sequence's logit bias (when it has at most VT entries, one per thread) into
/// `tokens` / `values` and points `v` at the copy, visible after the caller's next block_barrier.
/// Each thread of a pass otherwise binary-searches the bias list in global memory per chunk,
/// log2(entries) + 1 dependent loads (4 for the bench's 8 entries) after its logit loads; staged,
/// the whole block pays one load in parallel, and the searches are shared-memory loads.
FP4_DEVICE void stage_bias(RowView& v, u32* tokens, float* values) {
    const u32 n = v.bias_end - v.bias_begin;
    if (n > VT) return;
    if (thread_x() < n) {
        tokens[thread_x()] = v.bias_tokens[v.bias_begin + thread_x()];
        values[thread_x()] = v.bias_values[v.bias_begin + thread_x()];
    }
    v.bias_tokens = tokens;
    v.bias_values = values;
    v.bias_begin = 0;
    v.bias_end = n;
}

/// The logits of chunk `chunk` of a row: element e = chunk * VCHUNK + thread_x() + VT * j is x[j];
/// out-of-vocabulary elements read as -inf.
FP4_DEVICE void load_logits(const float* logits, u32 vocab, u32 chunk, float (&x)[VI]) {
    const u32 first = chunk * VCHUNK + thread_x();
    const float* p = logits + first;
    // Every chunk but a row's last lies inside the vocabulary: its VI loads are constant offsets
    // from one address, where a bounds check per element kept VI addresses live (a 64-bit
    // register pair each).
    if (chunk * VCHUNK + VCHUNK <= vocab) {
        #pragma unroll
        for (int j = 0; j < VI; ++j) x[j] = load_stream_f32(p + VT * j);
        return;
    }
    #pragma unroll
    for (int j = 0; j < VI; ++j) x[j] = first + VT * j < vocab ? load_stream_f32(p + VT * j) : -f32_inf();
}

/// Asks the L2 for chunk `chunk` of a row (its whole 16-byte pieces: a row need not start on
/// one), for a load_logits to come.
FP4_DEVICE void prefetch_chunk(const RowView& v, u32 chunk) {
    const u32 first = chunk * VCHUNK;
    const u64 lo = ((u64)(v.logits + first) + 15) & ~(u64)15;
    const u64 hi = (u64)(v.logits + min_u32(first + VCHUNK, v.vocab)) & ~(u64)15;
    if (hi > lo) prefetch_l2((const void*)lo, (u32)(hi - lo));
}

/// Chunk `chunk` of a row, its logits in z (load_logits), with the bias applied in place. Bit j
/// of the result marks a bad element (NaN or +inf logit, or +inf or NaN after the bias); bad elements
/// read as -inf.
FP4_DEVICE u32 bias_chunk(const RowView& v, u32 chunk, float (&z)[VI]) {
    const float inf = f32_inf();
    u32 bad = 0;
    #pragma unroll
    for (int j = 0; j < VI; ++j)
        if (z[j] != z[j] || z[j] == inf) bad |= 1u << j;
    for_own_bias(v, chunk, [&](u32 entry, u32, u32 slot) {
        const float b = v.bias_values[entry];
        // a NaN stays one: checked per entry, where the bias can make it (+inf, then -inf)
        #pragma unroll
        for (int j = 0; j < VI; ++j) {
            if ((u32)j == slot) {
                z[j] = add32(z[j], b);
                if (z[j] != z[j]) bad |= 1u << j;
            }
        }
    });
    #pragma unroll
    for (int j = 0; j < VI; ++j) {
        if (z[j] == inf) bad |= 1u << j;
        z[j] = (bad >> j) & 1u ? -inf : add32(z[j], 0.0f);
    }
    return bad;
}

/// load_logits, then bias_chunk.
FP4_DEVICE u32 load_chunk(const RowView& v, u32 chunk, float (&z)[VI]) {
    load_logits(v.logits, v.vocab, chunk, z);
    return bias_chunk(v, chunk, z);
}

/// The argmax code of a thread's biased logits z of a chunk, token base + VT * j for z[j] (0: every
/// one is -inf). The tokens ascend with j, so a strict > keeps the lowest token among equal logits:
/// a compare and two selects per token, one code per chunk (bad tokens read -inf).
FP4_DEVICE u64 thread_argmax(const float (&z)[VI], u32 base) {
    float best_z = -f32_inf();
    int best_j = -1;
    #pragma unroll
    for (int j = 0; j < VI; ++j) {
        const bool better = z[j] > best_z;
        best_z = better ? z[j] : best_z;
        best_j = better ? j : best_j;
    }
    return best_j < 0 ? 0 : argmax_code(best_z, base + VT * (u32)best_j);
}

/// Chunk `chunk` of a row, its logits in z (load_logits), biased in place (bias_chunk): the
/// argmax code of its tokens (0: every token is -inf or bad); `bad` is lowered to its first bad
/// token.
FP4_DEVICE u64 argmax_chunk(const RowView& v, u32 chunk, float (&z)[VI], u32& bad) {
    const u32 bad_bits = bias_chunk(v, chunk, z);
    const u32 base = chunk * VCHUNK + thread_x();
    if (bad_bits != 0) bad = min_u32(bad, base + VT * (u32)lowest_bit(bad_bits));
    return thread_argmax(z, base);
}

/// A row's verdict from its argmax code (0: no token) and first bad token (VNONE: none): its
/// status and the words RS_STATUS (status, error token) and RS_VALUE (error value bits, argmax).
struct RowVerdict {
    u32 status;
    u64 status_word;
    u64 value_word;
};
FP4_DEVICE RowVerdict row_verdict(const RowView& v, u64 best, u32 bad) {
    u32 status = VSTATUS_OK, error_token = 0, error_value = 0;
    if (bad != VNONE) {
        status = VSTATUS_NONFINITE;
        error_token = bad;
        float raw;
        const float z = biased_logit(v, error_token, &raw);
        error_value = f32_to_bits((raw != raw || raw == f32_inf()) ? raw : z);
    } else if (best == 0) {
        status = VSTATUS_EMPTY;
    }
    return {status, (u64)status | ((u64)error_token << 32), (u64)error_value | ((u64)~(u32)best << 32)};
}

// ---- block-wide helpers (every thread gets the result) ----
#define VOP_MAX 0
#define VOP_MIN 1
#define VOP_SUM 2
FP4_DEVICE u64 combine(u64 a, u64 b, int op) {
    return op == VOP_MAX ? (a > b ? a : b) : op == VOP_MIN ? (a < b ? a : b) : a + b;
}
/// `v` combined with op over the warp (butterfly: every lane gets the result).
FP4_DEVICE u64 warp_reduce(u64 v, int op) {
    for (u32 offset = FP4_WARP_SIZE / 2; offset > 0; offset >>= 1) v = combine(v, shuffle_from_u64(v, lane_index() ^ offset), op);
    return v;
}
#define VREDUCE 3                             // most values one block_reduce_n combines
/// Reduces v[k] with op[k] over the block, every thread getting the results. `scratch`:
/// VREDUCE * VWARPS words of shared memory. Two barriers for all N values: each warp publishes
/// its partials, then every warp combines the VWARPS partials itself (warp 0 combining and
/// publishing the total took a third barrier per value; the row's last block reduced three
/// values one after another, 9 barriers, now 2).
template <int N>
FP4_DEVICE void block_reduce_n(u64 (&v)[N], const int (&op)[N], u64* scratch) {
    static_assert(N <= VREDUCE, "block_reduce_n: scratch holds VREDUCE values");
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        v[k] = warp_reduce(v[k], op[k]);
        if (lane_index() == 0) scratch[k * VWARPS + warp_index()] = v[k];
    }
    block_barrier();
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        const u64 none = op[k] == VOP_MIN ? ~0ull : 0ull;
        v[k] = warp_reduce(lane_index() < VWARPS ? scratch[k * VWARPS + lane_index()] : none, op[k]);
    }
    // before the next use of scratch
    block_barrier();
}
FP4_DEVICE u64 block_reduce(u64 v, int op, u64* scratch) {
    u64 x[1] = {v};
    const int ops[1] = {op};
    block_reduce_n(x, ops, scratch);
    return x[0];
}

/// Exclusive prefix sums over the VNB buckets of a packed histogram (shared or global):
/// count[b] and weight[b] are the tokens and weight of the buckets before b; [VNB] the totals.
FP4_DEVICE void scan_histogram(const u64* hist, u32* count, u128* weight, u32* warp_count,
                               u128* warp_weight) {
    const u32 per = (VNB + VT - 1) / VT;
    const u32 first = thread_x() * per;
    u32 c = 0;
    u128 w = w128(0);
    for (u32 i = 0; i < per; ++i) {
        const u32 b = first + i;
        if (b < VNB) {
            const u64 h = hist[b];
            c += packed_count(h);
            w += bucket_weight(packed_mantissas(h), b);
        }
    }
    u32 ci = c;
    u128 wi = w;
    for (u32 offset = 1; offset < FP4_WARP_SIZE; offset <<= 1) {
        const u32 src = lane_index() >= offset ? lane_index() - offset : lane_index();
        const u32 co = shuffle_from(ci, src);
        const u128 wo = {shuffle_from_u64(wi.lo, src), shuffle_from_u64(wi.hi, src)};
        if (lane_index() >= offset) {
            ci += co;
            wi += wo;
        }
    }
    if (lane_index() == FP4_WARP_SIZE - 1) {
        warp_count[warp_index()] = ci;
        warp_weight[warp_index()] = wi;
    }
    block_barrier();
    u32 ce = ci - c;
    u128 we = wi - w;
    for (u32 k = 0; k < warp_index(); ++k) {
        ce += warp_count[k];
        we += warp_weight[k];
    }
    for (u32 i = 0; i < per; ++i) {
        const u32 b = first + i;
        if (b < VNB) {
            const u64 h = hist[b];
            count[b] = ce;
            weight[b] = we;
            ce += packed_count(h);
            we += bucket_weight(packed_mantissas(h), b);
        }
    }
    if (thread_x() == VT - 1) {
        count[VNB] = ce;
        weight[VNB] = we;
    }
    block_barrier();
}

/// First i in [0, last] with found(i), for found false then true; `last` when none (found(last)
/// is never asked). The calling warp searches together, each round one probe per lane (a
/// ballot): 2 rounds over the VNB = 656 buckets and 3 over 1024 candidates, where a binary
/// search by one thread is 10 dependent shared loads. The whole warp must call it, converged
/// and with the same arguments; every lane gets the result.
template <typename Found>
FP4_DEVICE u32 warp_search(u32 last, Found found) {
    u32 lo = 0, hi = last;
    while (lo < hi) {
        const u32 stride = (hi - lo + FP4_WARP_SIZE) / FP4_WARP_SIZE;  // ceil((hi - lo + 1) / 32)
        const u32 probe = lo + (lane_index() + 1) * stride - 1;
        const bool inside = probe < hi;
        const u32 hits = ballot(inside && found(probe));
        // the answer lies in the stride after the probes that said no
        const u32 before = hits != 0 ? lowest_bit(hits) : popcount(ballot(inside));
        lo += before * stride;
        hi = min_u32(lo + stride - 1, hi);
    }
    return lo;
}

/// First bucket whose tokens reach past rank `rank` (0-based): count[b + 1] > rank. Warp-wide.
FP4_DEVICE u32 bucket_of_rank(const u32* count, u32 rank) {
    return warp_search(VNB - 1, [&](u32 b) { return count[b + 1] > rank; });
}
/// First bucket whose running weight reaches `need`: weight[b + 1] >= need. Warp-wide.
FP4_DEVICE u32 bucket_reaching(const u128* weight, u128 need) {
    return warp_search(VNB - 1, [&](u32 b) { return weight[b + 1] >= need; });
}
/// First bucket whose running weight exceeds `t`: weight[b + 1] > t. Warp-wide.
FP4_DEVICE u32 bucket_exceeding(const u128* weight, u128 t) {
    return warp_search(VNB - 1, [&](u32 b) { return weight[b + 1] > t; });
}

FP4_DEVICE bool plan_has(const u64* plan, u32 bucket) { return (plan[bucket >> 6] >> (bucket & 63)) & 1ull; }

// ============================================================================================
// verify_histogram: pass 1.
// ============================================================================================
struct HistogramShared {
    // Pass 1 accumulates per bucket the token count and the mantissa sum split at bit 12 in three
    // u32 arrays: each token is three native shared atomics (ATOMS.ADD) with no dependency between
    // them, where one packed u64 add is a compare-and-swap loop on sm_90 (LDS, ATOMS.CAST.SPIN.64,
    // branch back on failure: ~16 serial round trips per thread and chunk, more on hot buckets).
    // Per block a bucket holds < 2^20 tokens (MAX_VOCAB), each adding <= 2^12 to acc_high and
    // < 2^12 to acc_low, so none of them wraps.
    u32 acc_count[VNB];
    u32 acc_high[VNB];
    u32 acc_low[VNB];
    u64 hist[VNB];  // the last block's merged row histogram (packed)
    u32 count[VNB + 1];
    u128 weight[VNB + 1];
    u128 warp_weight[VWARPS];
    u32 warp_count[VWARPS];
    i32 block_top[VMAX_BLOCKS_PER_ROW];  // of the blocks that wrote their own histogram
    u32 block_index[VMAX_BLOCKS_PER_ROW];
    u32 spilled;
    i32 anchor;
    u64 scratch[VREDUCE * VWARPS];
    u32 window_lo[VMAX_WINDOWS];
    u32 window_hi[VMAX_WINDOWS];
    u32 bias_tokens[VT];  // stage_bias
    float bias_values[VT];
    u32 windows;
    u32 marked;  // some planned bucket holds tokens
    u32 last;
{%- if target.vendor == "amd" %}
    u32 merge_lo[VMAX_WINDOWS + 1];  // Plan::add's merged intervals (see Plan)
    u32 merge_hi[VMAX_WINDOWS + 1];
{%- endif %}
};

/// The planner's bucket windows (warp 0, every lane the same): added in order of need, each kept
/// only while the tokens of all kept windows fit the candidate space. Kept as sorted, disjoint
/// intervals.
struct Plan {
    HistogramShared& sh;
{%- if target.vendor == "amd" %}
    // In shared memory (only warp 0 plans; its lanes write the same values): the AMD compiler
    // keeps arrays indexed at run time in scratch memory, not registers. lo and hi are the
    // block's windows themselves (finish() copies them onto themselves).
    u32 *lo, *hi;
    u32 count;
    u32 tokens;  // in the union
    FP4_DEVICE explicit Plan(HistogramShared& shared)
        : sh(shared), lo(shared.window_lo), hi(shared.window_hi), count(0), tokens(0) {}
{%- else %}
    u32 lo[VMAX_WINDOWS], hi[VMAX_WINDOWS];
    u32 count;
    u32 tokens;  // in the union
    FP4_DEVICE explicit Plan(HistogramShared& shared) : sh(shared), count(0), tokens(0) {}
{%- endif %}
    FP4_DEVICE u32 tokens_in(u32 first, u32 last) const { return sh.count[last + 1] - sh.count[first]; }
    FP4_DEVICE void add(u32 first, u32 last) {
        if (first > last || last >= VNB) return;
        // merge [first, last] with the intervals it touches
        u32 merged_lo = first, merged_hi = last, merged_tokens = 0, keep = 0;
{%- if target.vendor == "amd" %}
        u32* new_lo = sh.merge_lo;
        u32* new_hi = sh.merge_hi;
{%- else %}
        u32 new_lo[VMAX_WINDOWS + 1], new_hi[VMAX_WINDOWS + 1];
{%- endif %}
        bool placed = false;
        for (u32 i = 0; i < count; ++i) {
            if (hi[i] + 1 < merged_lo) {
                new_lo[keep] = lo[i];
                new_hi[keep++] = hi[i];
            } else if (lo[i] > merged_hi + 1) {
                if (!placed) {
                    new_lo[keep] = merged_lo;
                    new_hi[keep++] = merged_hi;
                    placed = true;
                }
                new_lo[keep] = lo[i];
                new_hi[keep++] = hi[i];
            } else {
                merged_lo = lo[i] < merged_lo ? lo[i] : merged_lo;
                merged_hi = hi[i] > merged_hi ? hi[i] : merged_hi;
                merged_tokens += tokens_in(lo[i], hi[i]);
            }
        }
        if (!placed) {
            new_lo[keep] = merged_lo;
            new_hi[keep++] = merged_hi;
        }
        const u32 total = tokens - merged_tokens + tokens_in(merged_lo, merged_hi);
        if (total > VCAP || keep > VMAX_WINDOWS) return;
        for (u32 i = 0; i < keep; ++i) {
            lo[i] = new_lo[i];
            hi[i] = new_hi[i];
        }
        count = keep;
        tokens = total;
    }
    /// The buckets of the draw targets [t_lo + shift, t_hi + shift], below `total`.
    FP4_DEVICE void add_draws(u128 t_lo, u128 t_hi, u128 shift, u128 total) {
        u128 a = t_lo + shift, b = t_hi + shift;
        if (a >= total) a = total - w128(1);
        if (b >= total) b = total - w128(1);
        add(bucket_exceeding(sh.weight, a), bucket_exceeding(sh.weight, b));
    }
    FP4_DEVICE void finish() {
        for (u32 i = 0; i < count; ++i) {
            sh.window_lo[i] = lo[i];
            sh.window_hi[i] = hi[i];
        }
        sh.windows = count;
    }
};

/// Bucket `b` of the block's accumulators, packed: count << VCOUNT_SHIFT | mantissa sum.
FP4_DEVICE u64 accumulated(const HistogramShared& sh, u32 b) {
    return ((u64)sh.acc_count[b] << VCOUNT_SHIFT) | (((u64)sh.acc_high[b] << 12) + sh.acc_low[b]);
}

/// Moves one accumulator `shift` buckets down (see shift_histogram).
FP4_DEVICE void shift_accumulator(u32* acc, u32 shift) {
    const u32 per = (VNB + VT - 1) / VT;
    u32 old[(VNB + VT - 1) / VT];
    for (u32 i = 0; i < per; ++i) {
        const u32 b = thread_x() + i * VT;
        old[i] = b < VNB ? acc[b] : 0;
    }
    block_barrier();
    for (u32 i = 0; i < per; ++i) {
        const u32 b = thread_x() + i * VT;
        if (b < VNB) acc[b] = 0;
    }
    block_barrier();
    for (u32 i = 0; i < per; ++i) {
        const u32 b = thread_x() + i * VT;
        if (b < VNB && b + shift < VNB) acc[b + shift] = old[i];
    }
    block_barrier();
}

/// Moves the block histogram `shift` buckets down (its top octave rose); what falls off the
/// bottom weighs nothing against the new top.
FP4_DEVICE void shift_histogram(HistogramShared& sh, u32 shift) {
    shift_accumulator(sh.acc_count, shift);
    shift_accumulator(sh.acc_high, shift);
    shift_accumulator(sh.acc_low, shift);
}

/// Pass 1 of one row's chunks [first, end), z holding the logits of the first (load_logits):
/// bad logits, argmax, and (sampling) the weight histogram relative to the block's top octave.
/// Returns the block's top octave.
FP4_DEVICE i32 histogram_chunks(const RowView& v, bool sampling, u32 first, u32 end,
                                float (&z)[VI], HistogramShared& sh, u64& best, u32& bad) {
    i32 top = VNO_OCTAVE;
    for (u32 chunk = first; chunk < end; ++chunk) {
        if (chunk != first) load_logits(v.logits, v.vocab, chunk, z);
        const u64 chunk_best = argmax_chunk(v, chunk, z, bad);
        best = chunk_best > best ? chunk_best : best;
        if (!sampling) continue;
        const u64 chunk_top = block_reduce(chunk_best, VOP_MAX, sh.scratch);
        if (chunk_top == 0) continue;
        const i32 k = token_parts(key_to_f32((u32)(chunk_top >> 32)), v.scale).octave;
        if (top == VNO_OCTAVE) top = k;
        else if (k > top) {
            const i64 rise = ((i64)k - (i64)top) * VG;
            shift_histogram(sh, rise < VNB ? (u32)rise : VNB);
            top = k;
        }
        #pragma unroll
        for (int j = 0; j < VI; ++j) {
            if (!(z[j] > -f32_inf())) continue;
            const TokenParts p = token_parts(z[j], v.scale);
            const i32 below = octaves_below(top, p.octave);
            if (below < 0) continue;
            const u32 b = bucket_index(below, p.sub);
            const u32 m = exp2_mantissa(p.frac);
            atomic_add_u32(&sh.acc_count[b], 1);
            atomic_add_u32(&sh.acc_high[b], m >> 12);
            atomic_add_u32(&sh.acc_low[b], m & 0xfffu);
        }
        block_barrier();
    }
    return top;
}

/// The planner (pass 1's last block of a sampled row): which buckets pass 2 collects so that
/// every cut and the draw resolve from candidates. Bounds only; pass 2's finish is exact
/// whatever this picks (a bucket it misses is resolved by radix rounds over the row).
VERIFY_RARE void plan_row(const VerifyArgs& a, const VerifyRow& row, const VerifySequence& seq,
                         const RowView& v, u64* state, i32 top, u32 top_mantissa, u32 probe_token,
                         float probe_raw, HistogramShared& sh) {
    scan_histogram(sh.hist, sh.count, sh.weight, sh.warp_count, sh.warp_weight);
    // min-p: buckets [0, keep_end) pass whole, [keep_end, partial_end) in part, the rest not
    u32 keep_end = VNB, partial_end = 0;
    {
        u64 first_not_kept = VNB, last_partial = 0;
        if (seq.min_p > 0.0f) {
            for (u32 b = thread_x(); b < VNB; b += VT) {
                const i32 below = bucket_below(b);
                const u32 sub = bucket_sub(b);
                const u32 low = exp2_mantissa(mul32((float)sub, 1.0f / (float)VG));
                const u32 high = exp2_mantissa(mul32((float)(sub + 1), 1.0f / (float)VG));
                const bool whole = passes_min_p(low, below, seq.min_p, top_mantissa);
                const bool none = !passes_min_p(high, below, seq.min_p, top_mantissa);
                if (!whole && b < first_not_kept) first_not_kept = b;
                if (!whole && !none) last_partial = b + 1;
            }
        }
        u64 ends[2] = {first_not_kept, last_partial};
        block_reduce_n(ends, {VOP_MIN, VOP_MAX}, sh.scratch);
        keep_end = (u32)ends[0];
        partial_end = (u32)ends[1];
        if (partial_end < keep_end) partial_end = keep_end;
    }
    // the probe: the draft token this row's verdict needs the weight of
    u32 probe_bucket = VNONE;
    float probe_z = 0.0f;
    u128 probe_weight = w128(0);
    if (probe_token < a.vocab) {
        probe_z = with_bias(v, probe_token, probe_raw);
        if (probe_z > -f32_inf()) {
            const TokenParts p = token_parts(probe_z, v.scale);
            const i32 below = octaves_below(top, p.octave);
            if (below >= 0) {
                probe_bucket = bucket_index(below, p.sub);
                probe_weight = w128(exp2_mantissa(p.frac)) << (VOCT - below);
            }
        }
    }
    // Warp 0 plans, its lanes in step on the same data, so that each bucket search is one
    // warp-wide search (warp_search) instead of a binary search by one thread.
    if (warp_index() == 0) {
        const u32 n = sh.count[VNB];
        const u32 lk = seq.top_k > 0 && seq.top_k < n ? seq.top_k : n;
        Plan plan(sh);
        // the kept count L and weight S, bounded by whole buckets
        u128 sk_lo, sk_hi;
        u32 top_k_bucket = VNONE;
        {
            const u32 b = bucket_of_rank(sh.count, lk - 1);
            if (lk == sh.count[b + 1]) sk_lo = sk_hi = sh.weight[b + 1];
            else {
                sk_lo = sh.weight[b];
                sk_hi = sh.weight[b + 1];
                top_k_bucket = b;
            }
        }
        u32 lp_lo = n, lp_hi = n, p1 = 1, p2 = 0;
        if (seq.top_p < 1.0f) {
            p1 = bucket_reaching(sh.weight, top_p_need(seq.top_p, sk_lo > w128(0) ? sk_lo : w128(1)));
            p2 = bucket_reaching(sh.weight, top_p_need(seq.top_p, sk_hi));
            lp_lo = sh.count[p1] + 1;
            lp_hi = sh.count[p2 + 1];
        }
        const u32 lm_lo = seq.min_p > 0.0f ? sh.count[keep_end] : n;
        const u32 lm_hi = seq.min_p > 0.0f ? sh.count[partial_end] : n;
        u32 l_lo = min_u32(lk, min_u32(lp_lo, lm_lo)), l_hi = min_u32(lk, min_u32(lp_hi, lm_hi));
        if (l_lo < 1) l_lo = 1;
        if (l_hi < l_lo) l_hi = l_lo;
        const u32 c1 = bucket_of_rank(sh.count, l_lo - 1), c2 = bucket_of_rank(sh.count, l_hi - 1);
        // windows, most needed first; each is taken while all taken fit the candidate space
        if (!(l_lo == l_hi && l_hi == sh.count[c2 + 1])) plan.add(c1, c2);
        if (seq.top_p < 1.0f) {
            if (top_k_bucket != VNONE) plan.add(top_k_bucket, top_k_bucket);
            plan.add(p1, p2);
        }
        if (!row.is_draft) {
            // the draw: t(R) for R = S, or (a rejected point-mass draft x) R = S - w(x) with the
            // targets at or past x moved up by w(x); whether x is kept may still be open
            const double u = uniform01(seq.seed, seq.position + row.index, STREAM_TOKEN);
            const u128 one = w128(1);
            const u128 s_lo = sh.weight[c1] > w128(0) ? sh.weight[c1] : one, s_hi = sh.weight[c2 + 1];
            const bool residual = row.index < seq.drafts && !(seq.flags & VSEQ_SAMPLED_DRAFTS);
            bool maybe_kept = false, maybe_dropped = true;
            if (residual && probe_bucket != VNONE) {
                maybe_kept = sh.count[probe_bucket] < l_hi;
                maybe_dropped = sh.count[probe_bucket + 1] > l_lo;
            }
            if (maybe_dropped) plan.add_draws(draw_target(u, s_lo), draw_target(u, s_hi), w128(0), s_hi);
            if (maybe_kept) {
                const u128 r_hi = s_hi > probe_weight ? s_hi - probe_weight : w128(0);
                const u128 r_lo = s_lo > probe_weight ? s_lo - probe_weight : w128(0);
                if (r_hi > w128(0)) {
                    const u128 t_lo = draw_target(u, r_lo > w128(0) ? r_lo : one), t_hi = draw_target(u, r_hi);
                    plan.add_draws(t_lo, t_hi, w128(0), s_hi);
                    plan.add_draws(t_lo, t_hi, probe_weight, s_hi);
                }
                if (r_lo == w128(0)) plan.add_draws(draw_target(u, s_lo), draw_target(u, s_hi), w128(0), s_hi);
            }
        }
        plan.finish();
        sh.marked = 0;
    }
    block_barrier();
    // The plan's bits, one bucket per thread: each warp's ballot is 32 bits of a plan word (bit i
    // of u64 word w is bucket 64 w + i; little-endian, so its u32 half 2 w + i / 32), written by
    // lane 0. (One thread per word looping over its 64 buckets, each against every window, was a
    // serial chain of ~64 x (windows + 2) shared loads on 11 threads of the row's last block.)
    u32* plan_words = reinterpret_cast<u32*>(state + RS_PLAN);
    for (u32 first = warp_index() * FP4_WARP_SIZE; first < VPLAN_WORDS * 64; first += VT) {
        const u32 b = first + lane_index();
        bool marked = false;
        for (u32 r = 0; r < sh.windows; ++r)
            marked = marked || (b >= sh.window_lo[r] && b <= sh.window_hi[r]);
        const u32 bits = ballot(marked && b < VNB && sh.count[b + 1] > sh.count[b]);
        if (lane_index() == 0) {
            plan_words[first / FP4_WARP_SIZE] = bits;
            if (bits != 0) sh.marked = 1;
        }
    }
    block_barrier();
    if (thread_x() == 0) {
        const bool stream = sh.marked != 0 || probe_bucket != VNONE || partial_end > keep_end;
        state[RS_PROBE] = (u64)probe_bucket | ((u64)f32_to_bits(probe_z) << 32);
        state[RS_MINP] = (u64)keep_end | ((u64)partial_end << 32);
        state[RS_PASS2] = 0;
        state[RS_PASS2_MINP] = (u64)(stream ? VFLAG_STREAM : 0u) << 32;
        state[RS_BEFORE_MASS] = 0;
        state[RS_PROBE_W] = probe_weight.lo;
        state[RS_PROBE_W + 1] = probe_weight.hi;
    }
}

/// The start of a block of a row pass (verify_histogram, verify_greedy, verify_topk): its row,
/// the row's sequence, and its first chunk (returned), whose logits (in z) are requested before
/// the sequence, which they do not depend on: the start is two dependent DRAM round trips (row,
/// then sequence and logits), not three. Out parameters: returned in a struct, the row and the
/// sequence took 8 more bytes of verify_histogram's stack frame (ptxas 13.0, sm_90a).
FP4_DEVICE u32 start_block(const VerifyArgs& a, float (&z)[VI], VerifyRow& row, VerifySequence& seq) {
    row = a.rows[block_y()];
    const u32 first = block_x() * a.chunks_per_block;
    load_logits(row_logits(a, row), a.vocab, first, z);
    seq = a.sequences[row.sequence];
    return first;
}

FP4_KERNEL void {{ bounds }}verify_histogram(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ HistogramShared sh;
    const u32 r = block_y();
    float z[VI];
    VerifyRow row;
    VerifySequence seq;
    const u32 first = start_block(a, z, row, seq);
    if (!row_is_processed(seq, row)) return;
    RowView v = row_view(a, row, seq);
    stage_bias(v, sh.bias_tokens, sh.bias_values);
    const bool sampling = seq.temperature > 0.0f;
    // The probe (the draft token whose weight this row's verdict needs): its token now, its
    // logit after pass 1, so that both arrive while the block works; plan_row on the row's last
    // block had them as two dependent global loads (then the bias search) on its critical path.
    const bool has_probe = sampling && (row.is_draft || row.index < seq.drafts);
    const u32 probe_token = has_probe ? a.draft_tokens[seq.first_draft + row.index] : VNONE;
    for (u32 b = thread_x(); b < VNB; b += VT) {
        sh.acc_count[b] = 0;
        sh.acc_high[b] = 0;
        sh.acc_low[b] = 0;
    }
    block_barrier();
    const u32 end = min_u32(first + a.chunks_per_block, a.chunks_per_row);
    u64 best = 0;
    u32 bad = VNONE;
    const i32 top = histogram_chunks(v, sampling, first, end, z, sh, best, bad);
    const float probe_raw = probe_token < a.vocab ? v.logits[probe_token] : 0.0f;
    {
        u64 found[2] = {best, bad};
        block_reduce_n(found, {VOP_MAX, VOP_MIN}, sh.scratch);
        best = found[0];
        bad = (u32)found[1];
    }
    // the histogram joins the row's grid, anchored at the first block's top octave; a block whose
    // top is more than VHEAD octaves above the anchor keeps its own for the last block to merge
    const u64 slot = (u64)r * a.blocks_per_row + block_x();
    u64* grid = a.row_grid + (u64)r * VGRID;
    bool spilled = false;
    if (sampling && top != VNO_OCTAVE) {
        if (thread_x() == 0) {
            const u32 mine = (u32)top + 0x80000000u;
            const u32 seen = atomic_cas_u32(&a.row_anchor[r], 0u, mine);
            sh.anchor = (i32)((seen == 0 ? mine : seen) - 0x80000000u);
        }
        block_barrier();
        const i32 anchor = sh.anchor;
        spilled = (i64)top - (i64)anchor > VHEAD;
        if (spilled) {
            if (thread_x() == 0) VERIFY_TRACE(VTRACE_SPILL);
            for (u32 b = thread_x(); b < VNB; b += VT) a.block_hist[slot * VNB + b] = accumulated(sh, b);
        } else {
            for (u32 b = thread_x(); b < VNB; b += VT) {
                const u64 h = accumulated(sh, b);
                // octave row of the grid; below it the tokens weigh nothing against the row's top
                const i64 grid_row = ((i64)top - bucket_below(b)) - ((i64)anchor - VOCT);
                if (h != 0 && grid_row >= 0) atomic_add_u64(&grid[grid_row * VG + bucket_sub(b)], h);
            }
        }
    }
    if (thread_x() == 0) {
        a.block_summary[slot * 3] = best;
        a.block_summary[slot * 3 + 1] = (u64)(u32)top | ((u64)bad << 32);
        a.block_summary[slot * 3 + 2] = spilled ? 1 : 0;
    }
    // the row's last block merges and plans
    if (thread_x() == 0) sh.spilled = 0;
    if (!block_arrive_and_rearm(&a.counters[r], a.blocks_per_row, &sh.last)) return;
    u64 row_best = 0, row_bad = ~0ull, row_top = 0;
    for (u32 k = thread_x(); k < a.blocks_per_row; k += VT) {
        const u64* summary = &a.block_summary[((u64)r * a.blocks_per_row + k) * 3];
        const u64 s0 = load_shared_u64(summary), s1 = load_shared_u64(summary + 1);
        row_best = s0 > row_best ? s0 : row_best;
        row_bad = (s1 >> 32) < row_bad ? (s1 >> 32) : row_bad;
        if (load_shared_u64(summary + 2)) {
            const u32 at = atomic_add_u32(&sh.spilled, 1);
            sh.block_top[at] = (i32)(u32)s1;
            sh.block_index[at] = k;
        }
        // offset so that the unsigned max is the signed max
        const u64 t = (u64)((u32)s1 ^ 0x80000000u);
        row_top = t > row_top ? t : row_top;
    }
    u64 merged[3] = {row_best, row_bad, row_top};
    block_reduce_n(merged, {VOP_MAX, VOP_MIN, VOP_MAX}, sh.scratch);
    row_best = merged[0];
    row_bad = merged[1];
    const i32 k_top = (i32)((u32)merged[2] ^ 0x80000000u);
    u64* state = a.row_state + (u64)r * VROW_WORDS;
    if (sampling && k_top != VNO_OCTAVE) {
        // the anchor is set once per row: a block with tokens of its own learnt it from its
        // compare-and-swap; only one without reads it back (an L2 round trip)
        const u32 anchor_word =
            top != VNO_OCTAVE ? (u32)sh.anchor + 0x80000000u : load_shared_u32(&a.row_anchor[r]);
        const i64 grid_bottom = (i64)(i32)(anchor_word - 0x80000000u) - VOCT;
        for (u32 b = thread_x(); b < VNB; b += VT) {
            u64 sum = 0;
            const i64 grid_row = ((i64)k_top - bucket_below(b)) - grid_bottom;
            if (anchor_word != 0 && grid_row >= 0 && grid_row <= VOCT + VHEAD)
                sum += load_shared_u64(&grid[grid_row * VG + bucket_sub(b)]);
            for (u32 i = 0; i < sh.spilled; ++i) {
                const i64 shift = ((i64)k_top - (i64)sh.block_top[i]) * VG;
                if ((i64)b >= shift) {
                    const u64 at = ((u64)r * a.blocks_per_row + sh.block_index[i]) * VNB + (b - (u32)shift);
                    sum += load_shared_u64(&a.block_hist[at]);
                }
            }
            a.row_hist[(u64)r * VNB + b] = sum;
            sh.hist[b] = sum;
        }
        block_barrier();
        for (u32 i = thread_x(); i < VGRID; i += VT) grid[i] = 0;
        if (thread_x() == 0) a.row_anchor[r] = 0;
    }
    block_barrier();
    // row_bad: the least of the blocks' first bad tokens (VNONE: none), after the reduction
    const RowVerdict verdict = row_verdict(v, row_best, (u32)row_bad);
    const u32 status = verdict.status;
    u32 top_mantissa = 0;
    if (status == VSTATUS_OK && sampling)
        top_mantissa = exp2_mantissa(token_parts(key_to_f32((u32)(row_best >> 32)), v.scale).frac);
    if (thread_x() == 0) {
        state[RS_STATUS] = verdict.status_word;
        state[RS_VALUE] = verdict.value_word;
        state[RS_TOP] = (u64)(u32)k_top | ((u64)top_mantissa << 32);
        state[RS_PASS2_MINP] = 0;
    }
    if (status == VSTATUS_OK && sampling) plan_row(a, row, seq, v, state, k_top, top_mantissa, probe_token, probe_raw, sh);
}

// ============================================================================================
// verify_select: pass 2, the exact finish of each row, the acceptance chain of each sequence.
// ============================================================================================
struct SelectShared {
    u64 plan[VPLAN_WORDS];
    u64 scratch[VREDUCE * VWARPS];
    u32 bias_tokens[VT];  // stage_bias
    float bias_values[VT];
};

struct FinishShared {
    u32 count[VNB + 1];
    u128 weight[VNB + 1];
    u128 warp_weight[VWARPS];
    u32 warp_count[VWARPS];
    u64 keys[VCAP];      // candidates: bucket << 52 | kappa
    u64 sorted[VCAP];
    u64 prefix[VCAP];    // inclusive mantissa sums of the sorted candidates
    u32 bin_count[256];
    u64 bin_mass[256];
    u64 scratch[VREDUCE * VWARPS];
    u32 hit;
    u32 pick;
    u32 pick_count;
    u64 pick_mass;
    u64 pick_own;
    u32 last;
};

{% if target.vendor == "nvidia" %}
static_assert(sizeof(FinishShared) <= 48 * 1024, "verify.candidates_per_row too large for static shared memory");
{% endif %}
#define VSELECT_RANK 0       // the token of rank `value` (0-based)
#define VSELECT_REACH 1      // the first token whose running mantissa sum reaches `value`
#define VSELECT_EXCEED 2     // the first token whose running mantissa sum exceeds `value`

/// A token inside its bucket: rank, mantissa sum up to and including it, kappa.
struct Selected {
    u32 rank;
    u64 mass;
    u64 kappa;
};

/// The slow path: radix rounds over the whole row on the kappa bits of the bucket's tokens
/// (for a bucket that pass 2 did not collect). One block; 7 scans of the row.
VERIFY_RARE Selected select_by_scan(const RowView& v, i32 top, u32 bucket, int mode, u64 value,
                                   FinishShared& sh) {
    if (thread_x() == 0) VERIFY_TRACE(VTRACE_RADIX);
    u64 prefix = 0;
    u32 rank = 0;
    u64 mass = 0;
    u32 decided = 0;  // high kappa bits fixed so far
    for (int round = 0; round < 7; ++round) {
        const u32 width = round < 6 ? 8 : 4;
        const u32 shift = 52 - decided - width;
        for (u32 i = thread_x(); i < 256; i += VT) {
            sh.bin_count[i] = 0;
            sh.bin_mass[i] = 0;
        }
        block_barrier();
        for (u32 chunk = 0; chunk < v.chunks; ++chunk) {
            float z[VI];
            load_chunk(v, chunk, z);
            #pragma unroll
            for (int j = 0; j < VI; ++j) {
                if (!(z[j] > -f32_inf())) continue;
                const TokenParts p = token_parts(z[j], v.scale);
                const i32 below = octaves_below(top, p.octave);
                if (below < 0 || bucket_index(below, p.sub) != bucket) continue;
                const u64 kappa = kappa_of(z[j], chunk * VCHUNK + thread_x() + VT * j);
                if ((kappa >> (shift + width)) != (prefix >> (shift + width))) continue;
                const u32 digit = (u32)(kappa >> shift) & ((1u << width) - 1);
                atomic_add_u32(&sh.bin_count[digit], 1);
                atomic_add_u64(&sh.bin_mass[digit], exp2_mantissa(p.frac));
            }
        }
        block_barrier();
        if (thread_x() == 0) {
            // the first non-empty digit (ascending kappa = the order) that holds the target
            u32 c_before = 0, pick = 0;
            u64 m_before = 0;
            for (u32 d = 0; d < (1u << width); ++d) {
                const u32 c = sh.bin_count[d];
                if (c == 0) continue;
                const u64 m = sh.bin_mass[d];
                pick = d;
                const bool here = mode == VSELECT_RANK ? value < (u64)c_before + c
                                  : mode == VSELECT_REACH ? value <= m_before + m
                                                          : value < m_before + m;
                if (here) break;
                c_before += c;
                m_before += m;
            }
            sh.pick = pick;
            sh.pick_count = c_before;
            sh.pick_mass = m_before;
            sh.pick_own = sh.bin_mass[pick];
        }
        block_barrier();
        prefix |= (u64)sh.pick << shift;
        rank += sh.pick_count;
        mass += sh.pick_mass;
        value -= mode == VSELECT_RANK ? (u64)sh.pick_count : sh.pick_mass;
        decided += width;
        block_barrier();
    }
    Selected s;
    s.rank = rank;
    s.mass = mass + sh.pick_own;
    s.kappa = prefix;
    return s;
}

/// First sorted candidate at or after key `key`. Warp-wide.
FP4_DEVICE u32 lower_bound(const u64* sorted, u32 n, u64 key) {
    return warp_search(n, [&](u32 i) { return sorted[i] >= key; });
}

/// A token inside bucket `bucket` (holding `tokens` tokens): from the candidates when pass 2
/// collected the whole bucket, else by scanning the row.
VERIFY_RARE Selected select_in_bucket(const RowView& v, i32 top, u32 bucket, u32 tokens, int mode,
                                     u64 value, u32 n, FinishShared& sh) {
    const u32 s = lower_bound(sh.sorted, n, (u64)bucket << 52);
    const u32 e = lower_bound(sh.sorted, n, (u64)(bucket + 1) << 52);
    if (e - s != tokens || tokens == 0) return select_by_scan(v, top, bucket, mode, value, sh);
    const u64 base = s > 0 ? sh.prefix[s - 1] : 0;
    Selected out;
    if (mode == VSELECT_RANK) {
        const u32 i = s + (u32)value;
        out.rank = (u32)value;
        out.mass = sh.prefix[i] - base;
        out.kappa = sh.sorted[i] & VKAPPA_ALL;
        return out;
    }
    if (thread_x() == 0) sh.hit = e;
    block_barrier();
    for (u32 i = s + thread_x(); i < e; i += VT) {
        const u64 incl = sh.prefix[i] - base;
        const u64 excl = i > s ? sh.prefix[i - 1] - base : 0;
        const bool hit = mode == VSELECT_REACH ? (incl >= value && excl < value)
                                               : (incl > value && excl <= value);
        if (hit) sh.hit = i;
    }
    block_barrier();
    const u32 i = sh.hit;
    block_barrier();
    if (i == e) return select_by_scan(v, top, bucket, mode, value, sh);
    out.rank = i - s;
    out.mass = sh.prefix[i] - base;
    out.kappa = sh.sorted[i] & VKAPPA_ALL;
    return out;
}

/// Weight of the first `kept` tokens of the order, and where the last of them sits.
struct Prefix {
    u128 weight;
    u32 bucket;
    u64 kappa;  // VKAPPA_ALL: the bucket ends with it
};

FP4_DEVICE Prefix prefix_of(const RowView& v, i32 top, u32 kept, u32 n, FinishShared& sh) {
    const u32 b = bucket_of_rank(sh.count, kept - 1);
    const u32 tokens = sh.count[b + 1] - sh.count[b];
    const u32 r = kept - 1 - sh.count[b];
    Prefix out;
    out.bucket = b;
    if (r + 1 == tokens) {
        out.weight = sh.weight[b + 1];
        out.kappa = VKAPPA_ALL;
        return out;
    }
    const Selected s = select_in_bucket(v, top, b, tokens, VSELECT_RANK, r, n, sh);
    out.weight = sh.weight[b] + bucket_weight(s.mass, b);
    out.kappa = s.kappa;
    return out;
}

/// The token of the order whose running weight first exceeds `t`.
FP4_DEVICE u32 token_at(const RowView& v, i32 top, u128 t, u32 n, FinishShared& sh) {
    const u32 b = bucket_exceeding(sh.weight, t);
    const u32 bits = (u32)(VOCT - bucket_below(b));
    const u64 rem = ((t - sh.weight[b]) >> bits).lo;
    const Selected s = select_in_bucket(v, top, b, sh.count[b + 1] - sh.count[b], VSELECT_EXCEED, rem, n, sh);
    return (u32)(s.kappa & 0xfffffu);
}

/// Pass 2's finish of one sampled row: the cuts, the kept weight, the probe, the draw.
FP4_DEVICE void finish_row(const VerifyArgs& a, u32 r, const VerifyRow& row, const VerifySequence& seq,
                           FinishShared& sh) {
    u64* state = a.row_state + (u64)r * VROW_WORDS;
    const RowView v = row_view(a, row, seq);
    const i32 top = (i32)(u32)state[RS_TOP];
    // What pass 2 left (its counts, and all VCAP candidate slots whatever their count: the slots
    // past it are allocated, read and ignored) is loaded before the histogram scan, whose
    // barriers would otherwise keep each of these loads behind the previous one: the count, then
    // the candidates it bounds, then the min-p survivors and the probe's mass were 4 dependent
    // L2 round trips.
    const u64 pass2 = load_shared_u64(&state[RS_PASS2]);
    const u64 pass2_minp = load_shared_u64(&state[RS_PASS2_MINP]);
    const u64 before_mass = load_shared_u64(&state[RS_BEFORE_MASS]);
    u64 slots[(VCAP + VT - 1) / VT];
    #pragma unroll
    for (u32 k = 0; k < (VCAP + VT - 1) / VT; ++k) {
        const u32 i = k * VT + thread_x();
        slots[k] = i < VCAP ? load_shared_u64(&a.candidates[(u64)r * VCAP + i]) : 0;
    }
    scan_histogram(a.row_hist + (u64)r * VNB, sh.count, sh.weight, sh.warp_count, sh.warp_weight);
    // candidates, sorted by (bucket, kappa) through their ranks
    const u32 n = min_u32((u32)pass2, VCAP);
    #pragma unroll
    for (u32 k = 0; k < (VCAP + VT - 1) / VT; ++k) {
        const u32 i = k * VT + thread_x();
        if (i >= n) continue;
        const u64 c = slots[k];
        const float z = bits_to_f32((u32)(c >> 32));
        const TokenParts p = token_parts(z, v.scale);
        const u32 b = bucket_index(octaves_below(top, p.octave), p.sub);
        sh.keys[i] = ((u64)b << 52) | kappa_of(z, (u32)c);
    }
    block_barrier();
    for (u32 i = thread_x(); i < n; i += VT) {
        const u64 key = sh.keys[i];
        u32 rank = 0;
        for (u32 j = 0; j < n; ++j) rank += sh.keys[j] < key ? 1u : 0u;
        sh.sorted[rank] = key;
    }
    block_barrier();
    {
        // inclusive mantissa sums over the sorted candidates, one contiguous run per thread
        const u32 per = (VCAP + VT - 1) / VT;
        const u32 first = thread_x() * per;
        u64 own = 0;
        for (u32 i = first; i < first + per && i < n; ++i) {
            const float z = kappa_logit(sh.sorted[i] & VKAPPA_ALL);
            sh.prefix[i] = exp2_mantissa(token_parts(z, v.scale).frac);
            own += sh.prefix[i];
        }
        const u64 incl = warp_inclusive_sum(own);
        if (lane_index() == FP4_WARP_SIZE - 1) sh.scratch[warp_index()] = incl;
        block_barrier();
        u64 running = incl - own;
        for (u32 k = 0; k < warp_index(); ++k) running += sh.scratch[k];
        for (u32 i = first; i < first + per && i < n; ++i) {
            running += sh.prefix[i];
            sh.prefix[i] = running;
        }
        block_barrier();
    }
    const u32 tokens = sh.count[VNB];
    const u32 lk = seq.top_k > 0 && seq.top_k < tokens ? seq.top_k : tokens;
    u32 lp = tokens;
    if (seq.top_p < 1.0f) {
        const u128 need = top_p_need(seq.top_p, prefix_of(v, top, lk, n, sh).weight);
        const u32 b = bucket_reaching(sh.weight, need);
        const u32 bits = (u32)(VOCT - bucket_below(b));
        const u128 rem = need - sh.weight[b];
        const u64 rem_mantissas = ((rem + ((w128(1) << bits) - w128(1))) >> bits).lo;
        const Selected s = select_in_bucket(v, top, b, sh.count[b + 1] - sh.count[b], VSELECT_REACH,
                                            rem_mantissas, n, sh);
        lp = sh.count[b] + s.rank + 1;
    }
    u32 lm = tokens;
    if (seq.min_p > 0.0f) {
        const u64 minp = state[RS_MINP];
        const u32 keep_end = (u32)minp, partial_end = (u32)(minp >> 32);
        lm = sh.count[keep_end];
        if (partial_end > keep_end) lm += (u32)pass2_minp;
    }
    const u32 kept = min_u32(lk, min_u32(lp, lm));
    const Prefix cut = prefix_of(v, top, kept, n, sh);
    // the probe's kept weight and the kept weight before it
    const u64 probe = state[RS_PROBE];
    const u32 probe_bucket = (u32)probe;
    u128 probe_weight = w128(0), before_probe = w128(0);
    if (probe_bucket != VNONE) {
        const u32 rank = sh.count[probe_bucket] + (u32)(pass2 >> 32);
        if (rank < kept) {
            probe_weight = {state[RS_PROBE_W], state[RS_PROBE_W + 1]};
            before_probe = sh.weight[probe_bucket] +
                           bucket_weight(before_mass, probe_bucket);
        }
    }
    // the draw: the bonus / plain draw, or the correction of a rejected point-mass draft
    u32 drawn = VNONE;
    if (!row.is_draft) {
        const double u = uniform01(seq.seed, seq.position + row.index, STREAM_TOKEN);
        u128 t;
        const u128 rest = cut.weight - probe_weight;
        if (row.index < seq.drafts && !(seq.flags & VSEQ_SAMPLED_DRAFTS) && rest > w128(0)) {
            t = draw_target(u, rest);
            if (probe_weight > w128(0) && t >= before_probe) t += probe_weight;
        } else {
            t = draw_target(u, cut.weight);
        }
        drawn = token_at(v, top, t, n, sh);
    }
    if (thread_x() == 0) {
        state[RS_MASS] = cut.weight.lo;
        state[RS_MASS + 1] = cut.weight.hi;
        state[RS_PROBE_W] = probe_weight.lo;
        state[RS_PROBE_W + 1] = probe_weight.hi;
        state[RS_PROBE_BEFORE] = before_probe.lo;
        state[RS_PROBE_BEFORE + 1] = before_probe.hi;
        state[RS_CUT] = (u64)cut.bucket | ((u64)drawn << 32);
        state[RS_CUT_KAPPA] = cut.kappa;
    }
    block_barrier();
}

/// The first RS_PLAN state words of a sequence's rows, and its drafts: in shared memory when
/// they fit (prefetched by the whole block), else read from global memory one by one.
struct SequenceRows {
    const u64* rows;     // row i's words at rows + i * stride
    u32 stride;
    bool shared;
    const u32* drafts;
    FP4_DEVICE u64 word(u32 row, u32 index) const {
        const u64* p = rows + (u64)row * stride + index;
        return shared ? *p : load_shared_u64(p);
    }
    FP4_DEVICE u128 wide(u32 row, u32 index) const { return {word(row, index), word(row, index + 1)}; }
};

/// Block-wide: brings sequence `s`'s row words and drafts into the shared arrays `words` and
/// `drafts` when they fit (`word_capacity` and `draft_capacity` elements).
FP4_DEVICE SequenceRows gather_sequence(const VerifyArgs& a, const VerifySequence& seq, u64* words,
                                        u32 word_capacity, u32* drafts, u32 draft_capacity) {
    SequenceRows out;
    const u32 rows = rows_of(seq);
    const u64* global_rows = a.row_state + (u64)seq.first_row * VROW_WORDS;
    if (rows * RS_PLAN > word_capacity || seq.drafts > draft_capacity) {
        out.rows = global_rows;
        out.stride = VROW_WORDS;
        out.shared = false;
        out.drafts = a.draft_tokens + seq.first_draft;
        return out;
    }
    for (u32 i = thread_x(); i < rows * RS_PLAN; i += VT)
        words[i] = load_shared_u64(&global_rows[(u64)(i / RS_PLAN) * VROW_WORDS + i % RS_PLAN]);
    for (u32 i = thread_x(); i < seq.drafts; i += VT) drafts[i] = a.draft_tokens[seq.first_draft + i];
    block_barrier();
    out.rows = words;
    out.stride = RS_PLAN;
    out.shared = true;
    out.drafts = drafts;
    return out;
}

/// The acceptance chain of one sequence (thread 0 of its last row's block): the reference's
/// walk, reading rows in order and only as far as the outcome needs them.
VERIFY_RARE void finish_sequence(const VerifyArgs& a, u32 s, const SequenceRows& rows) {
    const VerifySequence seq = a.sequences[s];
    u32* out = a.emitted + (u64)s * (a.max_drafts + 1);
    u32* st = a.status + (u64)s * VSTATUS_WORDS;
    const u32* drafts = rows.drafts;
    const u32 n = seq.drafts;
    const bool sampled = (seq.flags & VSEQ_SAMPLED_DRAFTS) != 0;
    u32 code = VSTATUS_OK, accepted = 0, error_row = 0, error_token = 0, error_value = 0, residual = 0;
    for (u32 j = 0; j < n; ++j) {
        if (drafts[j] >= a.vocab) {
            code = VSTATUS_TOKEN;
            error_token = drafts[j];
            break;
        }
    }
    if (code == VSTATUS_OK && seq.host_error != 0) code = VSTATUS_PARAM;
    for (u32 j = 0; code == VSTATUS_OK; ++j) {
        const u64 p_status = rows.word(j, RS_STATUS);
        if ((u32)p_status != VSTATUS_OK) {
            code = (u32)p_status;
            error_row = j;
            error_token = (u32)(p_status >> 32);
            error_value = (u32)rows.word(j, RS_VALUE);
            break;
        }
        if (seq.temperature == 0.0f) {
            const u32 best = (u32)(rows.word(j, RS_VALUE) >> 32);
            if (j == n || best != drafts[j]) {
                out[j] = best;
                accepted = j;
                break;
            }
            out[j] = drafts[j];
            continue;
        }
        const u32 drawn = (u32)(rows.word(j, RS_CUT) >> 32);
        if (j == n) {
            out[j] = drawn;
            accepted = n;
            break;
        }
        const double u = uniform01(seq.seed, seq.position + j, STREAM_ACCEPT);
        const double w_p = mass_to_f64(rows.wide(j, RS_PROBE_W));
        const double s_p = mass_to_f64(rows.wide(j, RS_MASS));
        bool accept;
        if (sampled) {
            const u32 q = n + 1 + j;
            const u64 q_status = rows.word(q, RS_STATUS);
            if ((u32)q_status != VSTATUS_OK) {
                code = (u32)q_status;
                error_row = j;
                error_token = (u32)(q_status >> 32);
                error_value = (u32)rows.word(q, RS_VALUE);
                break;
            }
            const u128 w_q = rows.wide(q, RS_PROBE_W);
            accept = w_q > w128(0) && mul64(u, mul64(mass_to_f64(w_q), s_p)) <
                                          mul64(w_p, mass_to_f64(rows.wide(q, RS_MASS)));
        } else {
            accept = mul64(u, s_p) < w_p;
        }
        if (accept) {
            out[j] = drafts[j];
            continue;
        }
        accepted = j;
        if (sampled) {
            code = VSTATUS_PENDING;
            residual = j;
        } else {
            out[j] = drawn;
        }
        break;
    }
    if (code == VSTATUS_OK || code == VSTATUS_PENDING) {
        for (u32 i = 0; i < n; ++i) {
            atomic_add_u64(&a.stats[i], 1);
            if (i < accepted) atomic_add_u64(&a.stats[a.max_drafts + i], 1);
        }
    }
    st[0] = code;
    st[1] = accepted;
    st[2] = error_row;
    st[3] = error_token;
    st[4] = error_value;
    st[5] = residual;
}

/// Block-wide, once a row of sequence `s` is done (its state written, or nothing to write):
/// counts it, and the block of the sequence's last row to arrive gathers the sequence's rows
/// (gather_sequence, into `words` and `drafts`) and walks its acceptance chain. `last` is a
/// shared word.
FP4_DEVICE void sequence_row_done(const VerifyArgs& a, u32 s, const VerifySequence& seq, u64* words,
                                  u32 word_capacity, u32* drafts, u32 draft_capacity, u32* last) {
    u32* done = &a.counters[a.row_count + s];
    if (!block_arrive_and_rearm(done, rows_of(seq), last)) return;
    const SequenceRows rows = gather_sequence(a, seq, words, word_capacity, drafts, draft_capacity);
    if (thread_x() == 0) finish_sequence(a, s, rows);
}

/// The least y = z * scale (token_parts, before floor) a token needs for pass 2 to look at it:
/// one octave below the lowest-weighted bucket pass 2 collects or counts in (the planned
/// buckets, the probe's, min-p's partial ones). A token below it lies at least two octaves
/// under that bucket's octave, so in a bucket after it. -inf (look at every token) when the
/// octave is too far from 0 for an exact float; +inf (look at none) when there is nothing to
/// collect or count, where verify_select does not call it.
FP4_DEVICE float pass2_floor(const u64* plan, u32 probe_bucket, u32 keep_end, u32 partial_end, i32 top) {
    u32 last = 0;
    bool any = false;
    for (u32 w = 0; w < VPLAN_WORDS; ++w) {
        if (plan[w] != 0) {
            last = w * 64 + highest_bit64(plan[w]);
            any = true;
        }
    }
    if (probe_bucket != VNONE) {
        last = any && last > probe_bucket ? last : probe_bucket;
        any = true;
    }
    if (partial_end > keep_end) {
        last = any && last > partial_end - 1 ? last : partial_end - 1;
        any = true;
    }
    const i64 octave = (i64)top - bucket_below(last) - 1;
    if (!any) return f32_inf();
    return octave > -(1 << 23) && octave < (1 << 23) ? (float)octave : -f32_inf();
}

/// Pass 2 over one block's chunks: collects the planned buckets' tokens, and counts the tokens
/// before the probe in its bucket and the min-p survivors of the partial buckets.
FP4_DEVICE void select_chunks(const VerifyArgs& a, u32 r, const VerifySequence& seq, RowView v,
                              u64* state, SelectShared& sh) {
    const i32 top = (i32)(u32)state[RS_TOP];
    const u32 top_mantissa = (u32)(state[RS_TOP] >> 32);
    const u64 probe = state[RS_PROBE];
    const u32 probe_bucket = (u32)probe;
    const float probe_z = bits_to_f32((u32)(probe >> 32));
    const VerifyRow row = a.rows[r];
    const u32 probe_token = probe_bucket != VNONE ? a.draft_tokens[seq.first_draft + row.index] : VNONE;
    const u64 minp = state[RS_MINP];
    const u32 keep_end = (u32)minp, partial_end = (u32)(minp >> 32);
    for (u32 w = thread_x(); w < VPLAN_WORDS; w += VT) sh.plan[w] = state[RS_PLAN + w];
    stage_bias(v, sh.bias_tokens, sh.bias_values);
    block_barrier();
    u32* collected = reinterpret_cast<u32*>(&state[RS_PASS2]);
    u64 before = 0, before_mass = 0, survivors = 0;
    const float y_floor = pass2_floor(sh.plan, probe_bucket, keep_end, partial_end, top);
    const u32 first = block_x() * a.chunks_per_block;
    const u32 end = min_u32(first + a.chunks_per_block, a.chunks_per_row);
    for (u32 chunk = first; chunk < end; ++chunk) {
        float z[VI];
        load_chunk(v, chunk, z);
        // a warp none of whose tokens reaches the floor has nothing to collect or count here
        bool reaches = false;
        #pragma unroll
        for (int j = 0; j < VI; ++j) reaches = reaches || max32(mul32(z[j], v.scale), -1073741824.0f) >= y_floor;
        if (ballot(reaches) == 0) continue;
        #pragma unroll
        for (int j = 0; j < VI; ++j) {
            const u32 e = chunk * VCHUNK + thread_x() + VT * j;
            u32 b = VNONE;
            TokenParts p;
            i32 below = -1;
            if (z[j] > -f32_inf()) {
                p = token_parts(z[j], v.scale);
                below = octaves_below(top, p.octave);
                if (below >= 0) b = bucket_index(below, p.sub);
            }
            const bool take = b != VNONE && plan_has(sh.plan, b);
            const u32 mask = ballot(take);
            if (mask != 0) {
                const u32 leader = lowest_bit(mask);
                u32 base = 0;
                if (lane_index() == leader) base = atomic_add_u32(collected, popcount(mask));
                base = shuffle_from(base, leader);
                const u32 slot = base + popcount(mask & ((1u << lane_index()) - 1));
                if (take && slot < VCAP)
                    a.candidates[(u64)r * VCAP + slot] = ((u64)f32_to_bits(z[j]) << 32) | e;
            }
            if (b == VNONE) continue;
            const bool ahead = b == probe_bucket && (z[j] > probe_z || (z[j] == probe_z && e < probe_token));
            const bool partial = b >= keep_end && b < partial_end;
            if (ahead || partial) {
                const u32 m = exp2_mantissa(p.frac);
                if (ahead) {
                    before += 1;
                    before_mass += m;
                }
                if (partial && passes_min_p(m, below, seq.min_p, top_mantissa)) survivors += 1;
            }
        }
    }
    u64 counts[3] = {before, before_mass, survivors};
    block_reduce_n(counts, {VOP_SUM, VOP_SUM, VOP_SUM}, sh.scratch);
    before = counts[0];
    before_mass = counts[1];
    survivors = counts[2];
    if (thread_x() == 0) {
        if (before) atomic_add_u32(collected + 1, (u32)before);
        if (before_mass) atomic_add_u64(&state[RS_BEFORE_MASS], before_mass);
        if (survivors) atomic_add_u32(reinterpret_cast<u32*>(&state[RS_PASS2_MINP]), (u32)survivors);
    }
}

FP4_KERNEL void {{ bounds }}verify_select(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ SelectShared sh;
    const u32 r = block_y();
    u64* state = a.row_state + (u64)r * VROW_WORDS;
    // read beside the row and its sequence, not after them: it depends on neither
    const u64 status = state[RS_STATUS], flags = state[RS_PASS2_MINP];
    const VerifyRow row = a.rows[r];
    const VerifySequence seq = a.sequences[row.sequence];
    if (!row_is_processed(seq, row) || !(seq.temperature > 0.0f)) return;
    if ((u32)status != VSTATUS_OK || !((flags >> 32) & VFLAG_STREAM)) return;
    select_chunks(a, r, seq, row_view(a, row, seq), state, sh);
}

/// One block per row: the exact finish of a sampled row, then (the sequence's last row) the
/// acceptance chain.
FP4_KERNEL void {{ bounds }}verify_finish(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ FinishShared sh;
    const u32 r = block_y();
    // read beside the row and its sequence, not after them: it depends on neither
    const u64 status = a.row_state[(u64)r * VROW_WORDS + RS_STATUS];
    const VerifyRow row = a.rows[r];
    const VerifySequence seq = a.sequences[row.sequence];
    if (row_is_processed(seq, row) && seq.temperature > 0.0f && (u32)status == VSTATUS_OK)
        finish_row(a, r, row, seq, sh);
    sequence_row_done(a, row.sequence, seq, sh.keys, VCAP, sh.bin_count, 256, &sh.last);
}

/// A graph captured for a one-launch batch replays its kernel whatever set_batch uploaded since:
/// a sequence the kernel cannot serve gets VSTATUS_STALE (from its first row's first block), never
/// a token, and its blocks return at once, touching no counter.
FP4_DEVICE void mark_stale(const VerifyArgs& a, const VerifyRow& row) {
    if (thread_x() == 0 && block_x() == 0 && row.index == 0 && !row.is_draft)
        a.status[(u64)row.sequence * VSTATUS_WORDS] = VSTATUS_STALE;
}

// ============================================================================================
// verify_greedy: a batch of greedy sequences in one launch.
// ============================================================================================
// When every sequence of a batch is greedy (temperature 0, controls the host accepted,
// point-mass drafts, at most VT rows each), a row needs only its argmax and first bad logit, and
// one launch replaces the three above: the blocks of a row stream its chunks as pass 1 does,
// and the last block of a sequence to arrive (one counter over the blocks of all its rows, so
// no per-row merge step in between) merges each row's block summaries, a warp per row, and
// walks the acceptance chain.

/// verify_greedy's pass over chunk `chunk` of a row, its raw logits in x (load_logits): raises
/// `best` to the chunk's argmax code (argmax_chunk's code) and lowers `bad` to its first bad
/// token. The few
/// biased tokens are left out of the register scan (a mask) and taken one by one with their
/// bias (with_bias, the logit read again): biasing x in place, as bias_chunk does for the
/// histogram, makes every x[j] a value of the bias loop, which ptxas keeps twice.
FP4_DEVICE void greedy_chunk(const RowView& v, u32 chunk, const float (&x)[VI], u64& best, u32& bad) {
    const u32 base = chunk * VCHUNK;
    const float inf = f32_inf();
    u32 biased = 0;
    for_own_bias(v, chunk, [&](u32, u32 token, u32 slot) {
        biased |= 1u << slot;
        float raw;
        const float z = biased_logit(v, token, &raw);
        if (raw != raw || raw == inf || z == inf || z != z) bad = min_u32(bad, token);
        else if (z > -inf) {
            const u64 code = argmax_code(add32(z, 0.0f), token);
            best = code > best ? code : best;
        }
    });
    float best_z = -inf;
    int best_j = -1;
    u32 bad_bits = 0;
    #pragma unroll
    for (int j = 0; j < VI; ++j) {
        if ((biased >> j) & 1u) continue;
        if (x[j] != x[j] || x[j] == inf) bad_bits |= 1u << j;
        // strict: the lowest of the thread's (ascending) tokens among equal logits; -0 and +0
        // are equal here, as the reference's order has them after its -0 -> +0
        const bool better = x[j] > best_z;
        best_z = better ? x[j] : best_z;
        best_j = better ? j : best_j;
    }
    const u32 first = base + thread_x();
    if (bad_bits != 0) bad = min_u32(bad, first + VT * lowest_bit(bad_bits));
    if (best_j >= 0) {
        const u64 code = argmax_code(add32(best_z, 0.0f), first + VT * (u32)best_j);
        best = code > best ? code : best;
    }
}

struct GreedyShared {
    u64 scratch[VREDUCE * VWARPS];
    u32 bias_tokens[VT];  // stage_bias
    float bias_values[VT];
    u64 rows[2 * VT];  // per row of the sequence: its RS_STATUS and RS_VALUE words
    u32 drafts[VT];
    u32 last;
};
// a greedy chain reads only those two words of a row (finish_sequence): stride 2
static_assert(RS_STATUS == 0 && RS_VALUE == 1, "verify_greedy keeps a row's first two words");

FP4_KERNEL void FP4_LAUNCH_BOUNDS(VGREEDY_BOUNDS) verify_greedy(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ GreedyShared sh;
    const u32 r = block_y();
    float z[VI];
    VerifyRow row;
    VerifySequence seq;
    const u32 first = start_block(a, z, row, seq);
    if (!(seq.temperature == 0.0f) || (seq.flags & VSEQ_SAMPLED_DRAFTS) || seq.drafts >= VT) {
        mark_stale(a, row);
        return;
    }
    RowView v = row_view(a, row, seq);
    stage_bias(v, sh.bias_tokens, sh.bias_values);
    block_barrier();
    const u32 end = min_u32(first + a.chunks_per_block, a.chunks_per_row);
    u64 best = 0;
    u32 bad = VNONE;
    for (u32 chunk = first; chunk < end; ++chunk) {
        if (chunk != first) load_logits(v.logits, v.vocab, chunk, z);
        greedy_chunk(v, chunk, z, best, bad);
    }
    {
        u64 found[2] = {best, bad};
        block_reduce_n(found, {VOP_MAX, VOP_MIN}, sh.scratch);
        best = found[0];
        bad = (u32)found[1];
    }
    if (thread_x() == 0) {
        const u64 slot = (u64)r * a.blocks_per_row + block_x();
        a.block_summary[slot * 3] = best;
        a.block_summary[slot * 3 + 1] = bad;
    }
    const u32 rows = seq.drafts + 1;
    u32* arrived = &a.counters[a.row_count + row.sequence];
    if (!block_arrive_and_rearm(arrived, rows * a.blocks_per_row, &sh.last)) return;
    for (u32 j = warp_index(); j < rows; j += VWARPS) {
        const VerifyRow row_j = a.rows[seq.first_row + j];
        const u64* summary = &a.block_summary[(u64)(seq.first_row + j) * a.blocks_per_row * 3];
        u64 row_best = 0, row_bad = VNONE;
        for (u32 k = lane_index(); k < a.blocks_per_row; k += FP4_WARP_SIZE) {
            const u64 b = load_shared_u64(summary + 3 * k), e = load_shared_u64(summary + 3 * k + 1);
            row_best = b > row_best ? b : row_best;
            row_bad = e < row_bad ? e : row_bad;
        }
        row_best = warp_reduce(row_best, VOP_MAX);
        row_bad = warp_reduce(row_bad, VOP_MIN);
        if (lane_index() == 0) {
            const RowVerdict verdict = row_verdict(row_view(a, row_j, seq), row_best, (u32)row_bad);
            sh.rows[2 * j] = verdict.status_word;
            sh.rows[2 * j + 1] = verdict.value_word;
        }
    }
    for (u32 i = thread_x(); i < seq.drafts; i += VT) sh.drafts[i] = a.draft_tokens[seq.first_draft + i];
    block_barrier();
    if (thread_x() == 0) finish_sequence(a, row.sequence, SequenceRows{sh.rows, 2, true, sh.drafts});
}

// ============================================================================================
// verify_topk: a batch whose every sequence keeps at most VTOPK_MAX tokens, in one launch.
// ============================================================================================
// With top-k on, every cut and draw of a row depends only on the row's first k tokens of the
// order (reference.rs weigh: top-p and min-p cut prefixes of them, and a token outside them
// weighs nothing), so a row needs no histogram: its top k and its first bad logit are enough.
// The blocks of a row keep their chunks' candidates in shared memory as order codes
// (argmax_code: order key, then inverted token id, so the largest code comes first), admitting a
// token only above a floor that only rises: the k-th largest of the first chunk's per-thread
// maxima, then, whenever the buffer fills, the k-th code of the buffer (radix rounds) as it is
// cut back to its top k. A row's blocks (61 at B = 1) each write all their candidates (about 50)
// and, apart, where they are many (topk_pools), their VTOPK_POOL largest, and raise a shared
// lower bound on the row's k-th logit (an atomic max of their own k-th's) without waiting for it.
// The row's last block takes the k-th largest of the pooled codes (distinct tokens of the row: a
// bound at or near the row's k-th, where the largest block k-th lies far below it), keeps the
// pooled codes above it, and reads a block's whole list only where the block's smallest pooled
// code reaches it (it may hold more; every list where nothing was pooled); then it ranks the top
// k and finishes the row as verify_finish does; the last row of a sequence walks its acceptance
// chain. Greedy sequences run with k = 1. Sampled drafts still need verify_residual after it.
#define VTOPK_MAX {{ target.verify.top_k_max }}
#define VTOPK_BUF {{ target.verify.top_k_buffer }}
#define VTOPK_PER ((VTOPK_BUF + VT - 1) / VT)  // buffer entries per thread
#define VTOPK_SORTED VTOPK_MAX                  // the ranked top k: buf[VTOPK_SORTED + rank]
#define VKEY_LOWEST_FINITE 0x00800000u          // order_key(-FLT_MAX)
#define VTOPK_POOL 8                            // candidates each block pools for the row's bound
#define VTOPK_MERGE 8                           // candidates per thread per merge round
#define VTOPK_PREFETCH {{ target.verify.top_k_prefetch_chunks }}  // chunks asked of the L2 ahead
#define VTOPK_RANK_MAX {{ target.verify.top_k_rank_max }}  // candidates rank_codes takes without a cut
static_assert(VTOPK_MAX <= VT && VTOPK_BUF >= VTOPK_MAX + VT, "verify.top_k_max, top_k_buffer");
// the row's tail ranks buf[0, n) into buf[VTOPK_SORTED, ...): n <= VTOPK_RANK_MAX must not reach it
static_assert(VTOPK_RANK_MAX <= VTOPK_SORTED, "verify.top_k_rank_max");
// a block's pooled codes live in its block_hist words, which verify_topk does not otherwise use
static_assert(VNB >= VTOPK_POOL && VT % VTOPK_POOL == 0 && FP4_WARP_SIZE % VTOPK_POOL == 0, "VTOPK_POOL");

struct TopkShared {
    u64 buf[VTOPK_BUF];  // candidate codes; later the ranked top k; later the sequence's rows
    u32 hist[256];  // kth_code's digit counts, zero between its calls
    u32 totals[2 * VWARPS];
    u64 scratch[VREDUCE * VWARPS];
    u32 bias_tokens[VT];  // stage_bias
    float bias_values[VT];
    u32 drafts[VT];
    u32 listed[VMAX_BLOCKS_PER_ROW];  // the merge: blocks whose candidate lists it reads,
    u32 list_start[VMAX_BLOCKS_PER_ROW + 1];  // and where each list starts among all it reads
    u32 list_count[VMAX_BLOCKS_PER_ROW];  // every block's candidate count
    u32 digit[3];
    u32 last;
    u64 words[6];  // the row's kept weight or top-k weight (2), probe weight (2), weight before it (2)
};

/// A block's candidates buf[0, count): every token of its chunks so far that can be among the
/// top k has a code there. A token is admitted when its logit is above `floor` (a token of a later
/// chunk) or its code at least `floor_code` (any token); `bound_key`: the block holds k tokens
/// whose order key is at least it (0: not known). `phase` alternates `totals` halves.
struct TopkState {
    u32 count;
    u32 phase;
    float floor;
    u64 floor_code;
    u32 bound_key;
};

struct Slots {
    u32 offset;  // before this thread
    u32 total;   // the block's
};

/// Block-wide exclusive scan of each thread's count: one barrier (the two halves of `totals`
/// alternate with `phase`, so one call's reads end before the call after next writes).
FP4_DEVICE Slots block_count_scan(u32 count, u32* totals, u32& phase) {
    const u32 incl = warp_inclusive_sum(count);
    u32* t = totals + phase * VWARPS;
    phase ^= 1u;
    if (lane_index() == FP4_WARP_SIZE - 1) t[warp_index()] = incl;
    block_barrier();
    Slots s{incl - count, 0};
    for (u32 w = 0; w < VWARPS; ++w) {
        const u32 x = t[w];
        if (w < warp_index()) s.offset += x;
        s.total += x;
    }
    return s;
}

/// The first thread of the block whose bit is set in its warp's ballot, warp_bits(w) for warp w
/// (VT when none).
template <typename WarpBits>
FP4_DEVICE u32 first_of_ballots(WarpBits warp_bits) {
    for (u32 w = 0; w < VWARPS; ++w) {
        const u32 bits = warp_bits(w);
        if (bits != 0) return w * FP4_WARP_SIZE + lowest_bit(bits);
    }
    return VT;
}

/// Block-wide: the first thread whose `hit` is set (VT when none); one barrier, as
/// block_count_scan.
FP4_DEVICE u32 block_first(bool hit, u32* totals, u32& phase) {
    const u32 bits = ballot(hit);
    u32* t = totals + phase * VWARPS;
    phase ^= 1u;
    if (lane_index() == 0) t[warp_index()] = bits;
    block_barrier();
    return first_of_ballots([&](u32 w) { return t[w]; });
}

/// The largest float below x (finite): z > float_below(x) is z >= x.
FP4_DEVICE float float_below(float x) {
    const u32 b = f32_to_bits(x);
    if ((b & 0x7fffffffu) == 0) return bits_to_f32(0x80000001u);
    return bits_to_f32((b & 0x80000000u) ? b + 1 : b - 1);
}

/// Block-wide: a code T with exactly k of the n distinct codes[0, n) at or above it (n >= k >= 1),
/// to every thread. Radix rounds over 8-bit digits from the top, stopping at the first digit that
/// holds exactly the codes still needed (T is then that prefix, its lower bits zero). sh.hist is
/// zero on entry and on return (verify_topk clears it once): warp 0 clears each round's bins as
/// it reads them, so a round takes two barriers, not three.
FP4_DEVICE u64 kth_code(TopkShared& sh, const u64* codes, u32 n, u32 k) {
    u64 prefix = 0;
    u32 need = k;
    for (int shift = 56;; shift -= 8) {
        const u64 high = shift == 56 ? 0ull : ~0ull << (shift + 8);
        for (u32 i = thread_x(); i < n; i += VT) {
            const u64 c = codes[i];
            if (((c ^ prefix) & high) == 0) atomic_add_u32(&sh.hist[(u32)(c >> shift) & 255u], 1);
        }
        block_barrier();
        if (warp_index() == 0) {
            // lane l holds digits 255 - 8l down to 248 - 8l: lanes ascend as digits descend
            u32 bins[8], own = 0;
            #pragma unroll
            for (u32 i = 0; i < 8; ++i) {
                bins[i] = sh.hist[255 - 8 * lane_index() - i];
                sh.hist[255 - 8 * lane_index() - i] = 0;
                own += bins[i];
            }
            const u32 incl = warp_inclusive_sum(own);
            u32 run = incl - own;
            if (run < need && need <= incl) {
                #pragma unroll
                for (u32 i = 0; i < 8; ++i) {
                    if (run + bins[i] >= need) {
                        sh.digit[0] = 255 - 8 * lane_index() - i;
                        sh.digit[1] = run;
                        sh.digit[2] = bins[i];
                        break;
                    }
                    run += bins[i];
                }
            }
        }
        block_barrier();
        prefix |= (u64)sh.digit[0] << shift;
        need -= sh.digit[1];
        if (sh.digit[2] == need || shift == 0) return prefix;
    }
}

/// Raises the floors to a bound T: k admitted tokens have codes at or above it.
FP4_DEVICE void raise_floor(TopkState& st, u64 t) {
    const u32 key = (u32)(t >> 32);
    if (key < VKEY_LOWEST_FINITE) return;  // below every finite logit: tells nothing
    st.floor = max32(st.floor, key_to_f32(key));
    st.floor_code = t > st.floor_code ? t : st.floor_code;
    st.bound_key = key > st.bound_key ? key : st.bound_key;
}

/// Block-wide: copies the codes of buf[0, count) at or above `threshold` to `out` (shared or
/// global memory, buf itself included: every read comes before the scan's barrier, every write
/// after), returns how many.
FP4_DEVICE u32 copy_codes_from(TopkShared& sh, TopkState& st, u64 threshold, u64* out) {
    u64 mine[VTOPK_PER];
    u32 keep = 0;
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m) {
        const u32 i = thread_x() + VT * m;
        mine[m] = i < st.count ? sh.buf[i] : 0;  // no token's code is 0
        keep += mine[m] != 0 && mine[m] >= threshold ? 1u : 0u;
    }
    const Slots s = block_count_scan(keep, sh.totals, st.phase);
    u32 at = s.offset;
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m)
        if (mine[m] != 0 && mine[m] >= threshold) out[at++] = mine[m];
    return s.total;
}

/// Block-wide: cuts the buffer (count > k) back to its top k codes and raises the floors. A
/// token of a later chunk whose logit equals the k-th one's has a larger id, so it is not among
/// the top k: floor admits only logits above. Inline, as is everything verify_topk calls on its
/// way: a call would save the registers live across it to the stack.
FP4_DEVICE void topk_cut(TopkShared& sh, TopkState& st, u32 k) {
    block_barrier();  // the buffer's last codes are written
    const u64 t = kth_code(sh, sh.buf, st.count, k);
    st.count = copy_codes_from(sh, st, t, sh.buf);
    raise_floor(st, t);
    block_barrier();
}

/// Block-wide: writes the `keep` largest of the n distinct codes[0, n) (n <= VT) in descending
/// order to out[0, min(n, keep)), each at its count of larger codes (out must not overlap
/// codes[0, n)). A code's count is split over the lanes of a power-of-two group (up to a warp, as
/// many as VT / n allow), each counting every group-size-th code, then summed by shuffles: at
/// n = 50 a chain of 13 shared loads, not 50, and no barrier. Up to VTOPK_RANK_MAX codes it takes
/// the top `keep` where a cut would (kth_code's radix rounds, two barriers each, then the copy's
/// scan): the pool of every block, and the row's top k on its serial tail.
FP4_DEVICE void rank_codes(const u64* codes, u32 n, u32 keep, u64* out) {
    u32 group = 1;
    while (group < FP4_WARP_SIZE && group * 2 * n <= VT) group *= 2;
    const u32 e = thread_x() / group, part = thread_x() % group;
    const u64 code = e < n ? codes[e] : 0;
    u32 rank = 0;
    if (e < n)
        for (u32 j = part; j < n; j += group) rank += codes[j] > code ? 1u : 0u;
    for (u32 offset = 1; offset < group; offset <<= 1) rank += shuffle_from(rank, lane_index() ^ offset);
    if (e < n && part == 0 && rank < keep) out[rank] = code;
}

/// Block-wide: appends the codes code_of(j), j < N, whose bit j of `mask` is set (the caller
/// admitted them), when they all fit; false, having written nothing, when they do not.
template <int N, typename CodeOf>
FP4_DEVICE bool topk_append(TopkShared& sh, TopkState& st, u32 mask, CodeOf code_of) {
    const Slots s = block_count_scan(popcount(mask), sh.totals, st.phase);
    if (st.count + s.total > VTOPK_BUF) return false;
    u32 at = st.count + s.offset;
    #pragma unroll
    for (int j = 0; j < N; ++j)
        if ((mask >> j) & 1u) sh.buf[at++] = code_of(j);
    st.count += s.total;
    return true;
}

/// Block-wide: appends each thread's `code` when `in` (one per thread at most); when they do not
/// fit, cuts the full buffer back to its top k first and admits `code` again against the new
/// floor_code. The slow paths take what did not fit whole this way, one per thread at a time,
/// each value read again: no array of them lives across a cut.
FP4_DEVICE void topk_insert_one(TopkShared& sh, TopkState& st, u32 k, u64 code, bool in) {
    Slots s = block_count_scan(in ? 1u : 0u, sh.totals, st.phase);
    if (st.count + s.total > VTOPK_BUF) {
        if (thread_x() == 0) VERIFY_TRACE(VTRACE_TOPK_FULL);
        topk_cut(sh, st, k);
        in = in && code >= st.floor_code;
        s = block_count_scan(in ? 1u : 0u, sh.totals, st.phase);
    }
    if (in) sh.buf[st.count + s.offset] = code;
    st.count += s.total;
}

/// Block-wide: chunk `chunk` of a row that did not fit the buffer whole, one slab (token
/// chunk * VCHUNK + VT * j + thread) at a time, each logit read and biased again as bias_chunk
/// does (a bad token reads -inf). Later slabs hold later tokens, so the float floor admits them.
FP4_DEVICE void topk_insert_slabs(const RowView& v, u32 chunk, TopkShared& sh, TopkState& st, u32 k) {
    for (u32 j = 0; j < VI; ++j) {
        const u32 token = chunk * VCHUNK + VT * j + thread_x();
        float z = -f32_inf();
        if (token < v.vocab) {
            float raw;
            const float biased = biased_logit(v, token, &raw);
            if (!(raw != raw || raw == f32_inf() || biased == f32_inf() || biased != biased)) z = biased;
        }
        topk_insert_one(sh, st, k, argmax_code(z, token), z > st.floor);
    }
}

/// Block-wide, on a block's first chunk (z biased, its tokens first + VT * j): the floors from the
/// k-th largest of the threads' maxima (k distinct tokens reach it; k <= VT); none when fewer
/// than k threads hold a finite logit.
FP4_DEVICE void topk_first_floor(TopkShared& sh, TopkState& st, u32 k, const float (&z)[VI], u32 first) {
    sh.buf[thread_x()] = thread_argmax(z, first);
    block_barrier();
    const u64 t = kth_code(sh, sh.buf, VT, k);
    const u32 key = (u32)(t >> 32);
    if (key < VKEY_LOWEST_FINITE) return;
    // those k maxima tie with the floor's logit at worst, with ids above or below: admit ties
    st.floor = float_below(key_to_f32(key));
    st.floor_code = (u64)key << 32;
    st.bound_key = key;
}

/// Whether a row's blocks pool their largest candidates: where a block holds VTOPK_POOL or fewer
/// of the row's top k on average. With fewer blocks (B = 64: 2 or 4 a row at k = 50) most blocks
/// hold more than VTOPK_POOL of them, the merge reads their lists anyway, and the pool's
/// selection is a cost every block pays for nothing (B = 64, n = 1 and 4: 1.6% and 4.0% faster
/// without it, the lists read at once); with more (sampled drafts at B = 8: 11 blocks of 6
/// chunks) a list read is up to a buffer of candidates (81.3 against 91.4 us; forty-third
/// session, H100).
FP4_DEVICE bool topk_pools(u32 blocks, u32 k) { return blocks * VTOPK_POOL >= k; }

/// Block-wide: writes to `out` the block's VTOPK_POOL largest candidates (all of them, then
/// zeros, where it holds fewer). They are distinct tokens of the row, so the k-th largest of every
/// block's is a lower bound on the row's k-th code; and where the smallest of a block's is below
/// that bound, the block holds no other candidate above it.
FP4_DEVICE void pool_top_codes(TopkShared& sh, TopkState& st, u64* out) {
    if (st.count <= VTOPK_RANK_MAX) {
        rank_codes(sh.buf, st.count, VTOPK_POOL, out);
    } else {
        // no token's code is 0: threshold 1 takes every candidate
        const u64 t = st.count > VTOPK_POOL ? kth_code(sh, sh.buf, st.count, VTOPK_POOL) : 1;
        copy_codes_from(sh, st, t, out);
    }
    for (u32 i = min_u32(st.count, VTOPK_POOL) + thread_x(); i < VTOPK_POOL; i += VT) out[i] = 0;
}

/// The codes the row's blocks pooled (pool_top_codes), those of the first
/// VTOPK_BUF / VTOPK_POOL blocks (any subset of the row's tokens gives a bound): this thread's
/// share, codes[thread + VT m] in `pool[m]`; returns how many there are in all (none where the
/// blocks do not pool, topk_pools).
FP4_DEVICE u32 load_pool(const VerifyArgs& a, u32 r, u32 k, u64 (&pool)[VTOPK_PER]) {
    const u32 blocks = topk_pools(a.blocks_per_row, k) ? min_u32(a.blocks_per_row, VTOPK_BUF / VTOPK_POOL) : 0;
    const u32 n = blocks * VTOPK_POOL;
    const u64* pools = a.block_hist + (u64)r * a.blocks_per_row * VNB;
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m) {
        const u32 i = thread_x() + VT * m;
        pool[m] = i < n ? load_shared_u64(&pools[(u64)(i / VTOPK_POOL) * VNB + i % VTOPK_POOL]) : 0;
    }
    return n;
}

/// Block-wide: the k-th largest of the n pooled codes (load_pool), a lower bound on the row's
/// k-th code; 0 when they hold fewer than k tokens. Uses the buffer.
FP4_DEVICE u64 pooled_bound(TopkShared& sh, const u64 (&pool)[VTOPK_PER], u32 n, u32 k) {
    if (n < k) return 0;  // k >= 1: so too where nothing was pooled
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m) {
        const u32 i = thread_x() + VT * m;
        if (i < n) sh.buf[i] = pool[m];
    }
    // kth_code's first barrier orders these writes before its reads. Empty groups read 0, equal
    // codes where kth_code assumes distinct ones: with fewer than k tokens the bound is 0 (every
    // round's digit is a zero's), with k or more the k-th largest token lies above every zero.
    return kth_code(sh, sh.buf, n, k);
}

/// Where candidate f of the merge's range (the listed blocks' lists one after another) lies in
/// the row's candidate slots: in the listed block of the last start at or before it.
FP4_DEVICE u64 listed_candidate(const TopkShared& sh, u32 n_listed, u32 f) {
    u32 lo = 0, hi = n_listed - 1;
    while (lo < hi) {
        const u32 mid = (lo + hi + 1) / 2;
        if (sh.list_start[mid] <= f) lo = mid;
        else hi = mid - 1;
    }
    return (u64)sh.listed[lo] * VTOPK_BUF + (f - sh.list_start[lo]);
}

/// The block of the row's last arrival: merges what can be among the row's top k into the
/// buffer (st.count codes, all at or above st.floor_code); returns the row's first bad token (the
/// least of the blocks'). Block-wide. The floor is the larger of the row's bound (the largest block
/// k-th) and the pooled one (pooled_bound); the codes above it are the blocks' pooled codes, and
/// only where a block's smallest pooled code reaches the floor (or the block pooled nothing: past
/// VTOPK_BUF / VTOPK_POOL blocks, or none pooled) does the merge read that block's candidate
/// list: at B = 1 the pool of 61 blocks' top 8 holds the row's top 50 but for a block with 8 of
/// them.
FP4_DEVICE u32 topk_merge(const VerifyArgs& a, u32 r, TopkShared& sh, TopkState& st, u32 k) {
    const u32 blocks = a.blocks_per_row;
    // the pool's loads first: they do not depend on the summaries, so the round trips overlap
    u64 pool[VTOPK_PER];
    const u32 pooled = load_pool(a, r, k, pool);
    // the row's bound and every block's count and first bad token, requested together: the bound
    // read after the summaries, and the listed blocks' counts after the listing, were two more
    // L2 round trips on the row's tail
    const u32 key = load_shared_u32(&a.row_anchor[r]);
    const u64* summary = a.block_summary + (u64)r * blocks * 3;
    u64 bad = VNONE;
    for (u32 b = thread_x(); b < blocks; b += VT) {
        const u64 count = load_shared_u64(&summary[3 * b]);
        const u64 first_bad = load_shared_u64(&summary[3 * b + 1]);
        sh.list_count[b] = (u32)count;
        bad = first_bad < bad ? first_bad : bad;
    }
    const u64 bound = pooled_bound(sh, pool, pooled, k);
    st.count = 0;
    st.floor_code = (u64)key << 32 > bound ? (u64)key << 32 : bound;
    block_barrier();  // the buffer is free again (pooled_bound's selection is done)
    // a block's VTOPK_POOL codes lie in VTOPK_POOL consecutive lanes (VT % VTOPK_POOL == 0): the
    // group's least nonzero code decides whether its list holds more above the floor
    u32 mask = 0, listed = 0;
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m) {
        u64 least = pool[m];
        for (u32 offset = 1; offset < VTOPK_POOL; offset <<= 1)
            least = combine(least, shuffle_from_u64(least, lane_index() ^ offset), VOP_MIN);
        const u32 i = thread_x() + VT * m;
        const bool whole_list = least != 0 && least >= st.floor_code;
        if (!whole_list && pool[m] != 0 && pool[m] >= st.floor_code) mask |= 1u << m;
        if (whole_list && i < pooled && i % VTOPK_POOL == 0) listed |= 1u << m;
    }
    // the pooled codes of the other blocks, then the list of blocks to read (those flagged, and
    // every block past the pooled ones)
    topk_append<VTOPK_PER>(sh, st, mask, [&](int m) { return pool[m]; });  // at most VTOPK_BUF fit
    const Slots s = block_count_scan(popcount(listed), sh.totals, st.phase);
    u32 at = s.offset;
    #pragma unroll
    for (u32 m = 0; m < VTOPK_PER; ++m)
        if ((listed >> m) & 1u) sh.listed[at++] = (thread_x() + VT * m) / VTOPK_POOL;
    const u32 pooled_blocks = pooled / VTOPK_POOL;
    for (u32 b = pooled_blocks + thread_x(); b < blocks; b += VT) sh.listed[s.total + b - pooled_blocks] = b;
    const u32 n_listed = s.total + (blocks > pooled_blocks ? blocks - pooled_blocks : 0);
    block_barrier();
    // the listed blocks' counts (loaded with the summaries), then their candidates as one range: a
    // list after another was a chain of round trips (two a block: 2 blocks a row at B = 64 read
    // nothing in parallel)
    u32 total = 0;
    for (u32 l0 = 0; l0 < n_listed; l0 += VT) {
        const u32 l = l0 + thread_x();
        const u32 count = l < n_listed ? sh.list_count[sh.listed[l]] : 0;
        const Slots c = block_count_scan(count, sh.totals, st.phase);
        if (l < n_listed) sh.list_start[l] = total + c.offset;
        total += c.total;
    }
    if (thread_x() == 0) sh.list_start[n_listed] = total;
    block_barrier();
    const u64* written = a.candidates + (u64)r * blocks * VTOPK_BUF;
    for (u32 f0 = 0; f0 < total; f0 += VT * VTOPK_MERGE) {
        u64 code[VTOPK_MERGE];
        u32 in = 0;
        #pragma unroll
        for (int j = 0; j < VTOPK_MERGE; ++j) {
            const u32 f = f0 + thread_x() + VT * (u32)j;
            code[j] = f < total ? load_shared_u64(&written[listed_candidate(sh, n_listed, f)]) : 0;
            if (code[j] != 0 && code[j] >= st.floor_code) in |= 1u << j;
        }
        if (topk_append<VTOPK_MERGE>(sh, st, in, [&](int j) { return code[j]; })) continue;
        // they do not fit whole: one a thread at a time, read again (no array lives across a cut)
        for (u32 j = 0; j < VTOPK_MERGE; ++j) {
            const u32 f = f0 + thread_x() + VT * j;
            const u64 c = f < total ? load_shared_u64(&written[listed_candidate(sh, n_listed, f)]) : 0;
            topk_insert_one(sh, st, k, c, c != 0 && c >= st.floor_code);
        }
    }
    if (thread_x() == 0) a.row_anchor[r] = 0;
    return (u32)block_reduce(bad, VOP_MIN, sh.scratch);
}

/// Block-wide: the row's state from its ranked top n (buf[VTOPK_SORTED, + n)), the words
/// verify_finish writes (status, argmax, top, kept weight, probe, cut, draw) for finish_sequence
/// and verify_residual: reference.rs weigh over those tokens, one per thread. `probe`: the row's
/// draft token (VNONE: none).
FP4_DEVICE void topk_finish_row(const VerifyArgs& a, u32 r, const VerifyRow& row, const VerifySequence& seq,
                                const RowView& v, TopkShared& sh, TopkState& st, u32 n, u32 bad, u32 probe) {
    u64* state = a.row_state + (u64)r * VROW_WORDS;
    const u64 best = n > 0 ? sh.buf[VTOPK_SORTED] : 0;
    if (bad != VNONE || best == 0 || seq.temperature == 0.0f) {
        if (thread_x() == 0) {
            const RowVerdict verdict = row_verdict(v, best, bad);
            state[RS_STATUS] = verdict.status_word;
            state[RS_VALUE] = verdict.value_word;
        }
        return;
    }
    const u32 i = thread_x();
    const bool present = i < n;
    const u64 code = present ? sh.buf[VTOPK_SORTED + i] : best;
    const TokenParts top = token_parts(key_to_f32((u32)(best >> 32)), v.scale);
    const u32 top_mantissa = exp2_mantissa(top.frac);
    const TokenParts p = token_parts(key_to_f32((u32)(code >> 32)), v.scale);
    const u32 mantissa = exp2_mantissa(p.frac);
    // 64-bit: octaves clamp to +-2^30, so the difference can exceed an i32 (-1: weighs nothing)
    const i32 below = octaves_below(top.octave, p.octave);
    const bool positive = present && below >= 0;
    const u128 w = positive ? w128(mantissa) << (u32)(VOCT - below) : w128(0);
    const bool min_p_fails = seq.min_p > 0.0f && !(positive && passes_min_p(mantissa, below, seq.min_p, top_mantissa));
    // inclusive running weight: the 32-bit halves scanned apart (each sum fits in 64 bits); each
    // warp's totals, its first token without weight and its first failing min-p cross one barrier
    // together (three more when each first was a block_first and the top-k mass a shared word)
    u64 lo = warp_inclusive_sum<u64>(w.lo & 0xffffffffull), hi = warp_inclusive_sum<u64>((w >> 32).lo);
    const u32 weightless = ballot(!positive), failing = ballot(min_p_fails);
    if (lane_index() == FP4_WARP_SIZE - 1) {
        sh.scratch[warp_index()] = lo;
        sh.scratch[VWARPS + warp_index()] = hi;
        sh.scratch[2 * VWARPS + warp_index()] = (u64)weightless | (u64)failing << 32;
    }
    if (i == 0)
        for (u32 x = 2; x < 6; ++x) sh.words[x] = 0;
    block_barrier();
    u64 total_lo = 0, total_hi = 0;
    for (u32 x = 0; x < VWARPS; ++x) {
        const u64 warp_lo = sh.scratch[x], warp_hi = sh.scratch[VWARPS + x];
        if (x < warp_index()) {
            lo += warp_lo;
            hi += warp_hi;
        }
        total_lo += warp_lo;
        total_hi += warp_hi;
    }
    const u64* ballots = sh.scratch + 2 * VWARPS;
    const u32 positives = first_of_ballots([&](u32 w) { return (u32)ballots[w]; });
    const u32 min_p_first = first_of_ballots([&](u32 w) { return (u32)(ballots[w] >> 32); });
    const u128 prefix = (w128(hi) << 32) + w128(lo);
    const u32 by_k = min_u32(seq.top_k, positives);
    u32 kept = by_k;
    if (seq.top_p < 1.0f) {
        // the mass of the first by_k tokens is the total: the n <= top_k ranked tokens are all
        // there are, and those past the positives weigh nothing
        const u128 need = top_p_need(seq.top_p, (w128(total_hi) << 32) + w128(total_lo));
        kept = min_u32(kept, block_first(i < by_k && prefix >= need, sh.totals, st.phase) + 1);
    }
    if (seq.min_p > 0.0f) kept = min_u32(kept, min_p_first);
    const bool is_probe = i < kept && ~(u32)code == probe;
    // no thread reads words[0, 2) before the barrier below
    if (i == kept - 1) {
        sh.words[0] = prefix.lo;
        sh.words[1] = prefix.hi;
    }
    if (is_probe) {
        const u128 before = prefix - w;
        sh.words[2] = w.lo;
        sh.words[3] = w.hi;
        sh.words[4] = before.lo;
        sh.words[5] = before.hi;
    }
    block_barrier();
    const u128 mass = {sh.words[0], sh.words[1]};
    const u128 probe_weight = {sh.words[2], sh.words[3]};
    const u128 before_probe = {sh.words[4], sh.words[5]};
    // the draw: the bonus / plain draw, or the correction of a rejected point-mass draft
    u32 drawn = VNONE;
    if (!row.is_draft) {
        const double u = uniform01(seq.seed, seq.position + row.index, STREAM_TOKEN);
        u128 t;
        const u128 rest = mass - probe_weight;
        if (row.index < seq.drafts && !(seq.flags & VSEQ_SAMPLED_DRAFTS) && rest > w128(0)) {
            t = draw_target(u, rest);
            if (probe_weight > w128(0) && t >= before_probe) t += probe_weight;
        } else {
            t = draw_target(u, mass);
        }
        const u32 at = block_first(i < kept && prefix > t, sh.totals, st.phase);
        drawn = ~(u32)sh.buf[VTOPK_SORTED + at];
    }
    if (i == 0) {
        const RowVerdict verdict = row_verdict(v, best, bad);
        const u64 cut = sh.buf[VTOPK_SORTED + kept - 1];
        const float cut_z = key_to_f32((u32)(cut >> 32));
        const TokenParts c = token_parts(cut_z, v.scale);
        state[RS_STATUS] = verdict.status_word;
        state[RS_VALUE] = verdict.value_word;
        state[RS_TOP] = (u64)(u32)top.octave | ((u64)top_mantissa << 32);
        state[RS_MASS] = mass.lo;
        state[RS_MASS + 1] = mass.hi;
        state[RS_PROBE_W] = probe_weight.lo;
        state[RS_PROBE_W + 1] = probe_weight.hi;
        state[RS_PROBE_BEFORE] = before_probe.lo;
        state[RS_PROBE_BEFORE + 1] = before_probe.hi;
        state[RS_CUT] = (u64)bucket_index(octaves_below(top.octave, c.octave), c.sub) | ((u64)drawn << 32);
        state[RS_CUT_KAPPA] = kappa_of(cut_z, ~(u32)cut);
    }
}

/// Whether verify_topk serves a sequence: its controls rejected, greedy, or top-k in 1..VTOPK_MAX.
FP4_DEVICE bool topk_serves(const VerifySequence& seq) {
    return seq.host_error != 0 || seq.temperature == 0.0f || (seq.top_k >= 1 && seq.top_k <= VTOPK_MAX);
}

FP4_KERNEL void FP4_LAUNCH_BOUNDS(VTOPK_BOUNDS) verify_topk(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ TopkShared sh;
    const u32 r = block_y();
    float z[VI];
    VerifyRow row;
    VerifySequence seq;
    const u32 first = start_block(a, z, row, seq);
    if (!topk_serves(seq)) {
        mark_stale(a, row);
        return;
    }
    if (!row_is_processed(seq, row)) {
        if (block_x() == 0)
            sequence_row_done(a, row.sequence, seq, sh.buf, VTOPK_BUF, sh.drafts, VT, &sh.last);
        return;
    }
    RowView v = row_view(a, row, seq);
    // the probe of the row's finish (topk_finish_row: the row's draft token, none on the last
    // target row), loaded now: at the finish it was a round trip on the row's serial tail
    const u32 probe = row.index < seq.drafts ? a.draft_tokens[seq.first_draft + row.index] : VNONE;
    stage_bias(v, sh.bias_tokens, sh.bias_values);
    for (u32 i = thread_x(); i < 256; i += VT) sh.hist[i] = 0;  // kth_code keeps it zero
    block_barrier();
    const u32 k = seq.temperature > 0.0f ? seq.top_k : 1u;
    TopkState st{0, 0, -f32_inf(), 0, 0};
    u32 bad = VNONE;
    const u32 end = min_u32(first + a.chunks_per_block, a.chunks_per_row);
    // chunk + 1 is loaded into registers at chunk's start (below): the L2 is asked for those after
    if (thread_x() == 0)
        for (u32 ahead = 2; ahead < VTOPK_PREFETCH && first + ahead < end; ++ahead) prefetch_chunk(v, first + ahead);
    for (u32 chunk = first; chunk < end; ++chunk) {
        if (VTOPK_PREFETCH > 0 && thread_x() == 0 && chunk + VTOPK_PREFETCH < end)
            prefetch_chunk(v, chunk + VTOPK_PREFETCH);
        // the next chunk's loads go out before this one's work (a block streams its chunks one
        // after another with barriers between: at B = 64, 31 of them, each waited for whole)
        float next[VI];
        const bool more = chunk + 1 < end;
        if (more) load_logits(v.logits, v.vocab, chunk + 1, next);
        const u32 bad_bits = bias_chunk(v, chunk, z);
        const u32 base = chunk * VCHUNK + thread_x();
        if (bad_bits != 0) bad = min_u32(bad, base + VT * (u32)lowest_bit(bad_bits));
        if (chunk == first) topk_first_floor(sh, st, k, z, base);
        u32 mask = 0;
        #pragma unroll
        for (int j = 0; j < VI; ++j)
            if (z[j] > st.floor) mask |= 1u << j;
        if (!topk_append<VI>(sh, st, mask, [&](int j) { return argmax_code(z[j], base + VT * (u32)j); }))
            topk_insert_slabs(v, chunk, sh, st, k);
        if (more)
            #pragma unroll
            for (int j = 0; j < VI; ++j) z[j] = next[j];
    }
    bad = (u32)block_reduce(bad, VOP_MIN, sh.scratch);
    if (a.blocks_per_row > 1) {
        // publish the bound and the pooled codes, write every candidate, arrive. The bound is
        // raised without waiting for the row's (a round trip each block paid to write fewer
        // candidates): the row's last block reads the final one and merges only what reaches it
        // and the pooled codes' bound.
        if (thread_x() == 0) atomic_max_u32(&a.row_anchor[r], st.bound_key);
        const u64 slot = (u64)r * a.blocks_per_row + block_x();
        if (topk_pools(a.blocks_per_row, k)) pool_top_codes(sh, st, a.block_hist + slot * VNB);
        const u32 written = copy_codes_from(sh, st, 0, a.candidates + slot * VTOPK_BUF);
        if (thread_x() == 0) {
            a.block_summary[slot * 3] = written;
            a.block_summary[slot * 3 + 1] = bad;
        }
        if (!block_arrive_and_rearm(&a.counters[r], a.blocks_per_row, &sh.last)) return;
        bad = topk_merge(a, r, sh, st, k);
    }
    // more candidates than rank_codes takes: cut back to the top k first
    if (st.count > k && st.count > VTOPK_RANK_MAX) topk_cut(sh, st, k);
    const u32 n = min_u32(st.count, k);
    block_barrier();
    rank_codes(sh.buf, st.count, k, sh.buf + VTOPK_SORTED);
    block_barrier();
    topk_finish_row(a, r, row, seq, v, sh, st, n, bad, probe);
    sequence_row_done(a, row.sequence, seq, sh.buf, VTOPK_BUF, sh.drafts, VT, &sh.last);
}

// ============================================================================================
// verify_residual: the correction of a rejected sampled draft, max(0, p - q) by token id.
// ============================================================================================
/// What a row's finish left for the residual: its weights' scale and its cut.
struct Side {
    RowView view;
    i32 top;
    u32 cut_bucket;
    u64 cut_kappa;
    double inverse;  // 1 / f64(S)
};

FP4_DEVICE Side side_of(const VerifyArgs& a, u32 r, const VerifySequence& seq) {
    const VerifyRow row = a.rows[r];
    const u64* state = a.row_state + (u64)r * VROW_WORDS;
    Side s;
    s.view = row_view(a, row, seq);
    s.top = (i32)(u32)state[RS_TOP];
    s.cut_bucket = (u32)state[RS_CUT];
    s.cut_kappa = state[RS_CUT_KAPPA];
    s.inverse = div64(1.0, mass_to_f64({state[RS_MASS], state[RS_MASS + 1]}));
    return s;
}

/// f64 of a token's kept weight (0 when filtered out): M * 2^(40 - below), exact.
FP4_DEVICE double kept_weight(const Side& s, float z, u32 token) {
    if (!(z > -f32_inf())) return 0.0;
    const TokenParts p = token_parts(z, s.view.scale);
    const i32 below = octaves_below(s.top, p.octave);
    if (below < 0) return 0.0;
    const u32 b = bucket_index(below, p.sub);
    if (b > s.cut_bucket || (b == s.cut_bucket && kappa_of(z, token) > s.cut_kappa)) return 0.0;
    return mul64((double)exp2_mantissa(p.frac), pow2(VOCT - below));
}

/// reference.rs residual: round((p - q) * 2^62) where positive, for token `e` of logits zp, zq.
FP4_DEVICE u64 residual_of(const Side& p, const Side& q, float zp, float zq, u32 e) {
    const double d = sub64(mul64(kept_weight(p, zp, e), p.inverse), mul64(kept_weight(q, zq, e), q.inverse));
    return d > 0.0 ? f64_to_u64_nearest(mul64(d, 0x1p62)) : 0;
}

struct ResidualShared {
    u64 scratch[VREDUCE * VWARPS];
    u64 warp_sum[VWARPS];
    u32 last;
    u32 chunk;
    u64 offset;
    u32 token;
};

/// Block-wide: `carry` plus the sum of `mine` over the threads before this one (thread order);
/// `carry` advances by the block's total. Two barriers (warp_sum is free again on return).
FP4_DEVICE u64 block_exclusive_sum(u64 mine, u64& carry, u64* warp_sum) {
    const u64 incl = warp_inclusive_sum(mine);
    if (lane_index() == FP4_WARP_SIZE - 1) warp_sum[warp_index()] = incl;
    block_barrier();
    u64 before = carry + incl - mine;
    u64 total = 0;
    for (u32 k = 0; k < VWARPS; ++k) {
        if (k < warp_index()) before += warp_sum[k];
        total += warp_sum[k];
    }
    carry += total;
    block_barrier();
    return before;
}

FP4_KERNEL void {{ bounds }}verify_residual(const VerifyArgs a) {
    chain_after_previous_grid();
    __shared__ ResidualShared sh;
    const u32 s = block_y();
    u32* st = a.status + (u64)s * VSTATUS_WORDS;
    if (st[0] != VSTATUS_PENDING) return;
    const VerifySequence seq = a.sequences[s];
    const u32 j = st[5];
    const Side p = side_of(a, seq.first_row + j, seq);
    const Side q = side_of(a, seq.first_row + seq.drafts + 1 + j, seq);
    u64 own = 0;
    {
        float zp[VI], zq[VI];
        load_chunk(p.view, block_x(), zp);
        load_chunk(q.view, block_x(), zq);
        #pragma unroll
        for (int i = 0; i < VI; ++i)
            own += residual_of(p, q, zp[i], zq[i], block_x() * VCHUNK + thread_x() + VT * i);
    }
    const u64 total_chunk = block_reduce(own, VOP_SUM, sh.scratch);
    if (thread_x() == 0) a.residual_sums[(u64)s * a.chunks_per_row + block_x()] = total_chunk;
    u32* counter = &a.counters[a.row_count + a.sequence_count + s];
    if (!block_arrive_and_rearm(counter, a.chunks_per_row, &sh.last)) return;
    const u64* sums = a.residual_sums + (u64)s * a.chunks_per_row;
    u64 part = 0;
    for (u32 c = thread_x(); c < a.chunks_per_row; c += VT) part += load_shared_u64(&sums[c]);
    const u64 total = block_reduce(part, VOP_SUM, sh.scratch);
    const double u = uniform01(seq.seed, seq.position + j, STREAM_TOKEN);
    if (total == 0) {
        // no residual weight: the plain draw from p
        if (thread_x() == 0) {
            const u64* state = a.row_state + (u64)(seq.first_row + j) * VROW_WORDS;
            sh.token = (u32)(state[RS_CUT] >> 32);
        }
    } else {
        u64 t = (u64)floor64(mul64(u, u64_to_f64(total)));
        if (t > total - 1) t = total - 1;
        // the chunk holding t: a block scan over the chunk sums, one thread per chunk (a loop in
        // one thread waited an L2 round trip per chunk, 61 at V = 248320). t < total, so exactly
        // one chunk holds it.
        u64 carry = 0;
        for (u32 c0 = 0; c0 < a.chunks_per_row; c0 += VT) {
            const u32 c = c0 + thread_x();
            const u64 here = c < a.chunks_per_row ? load_shared_u64(&sums[c]) : 0;
            const u64 before = block_exclusive_sum(here, carry, sh.warp_sum);
            if (here > 0 && before <= t && t < before + here) {
                sh.chunk = c;
                sh.offset = t - before;
            }
        }
        block_barrier();
        const u32 chunk = sh.chunk;
        const u64 local = sh.offset;
        float zp[VI], zq[VI];
        load_chunk(p.view, chunk, zp);
        load_chunk(q.view, chunk, zq);
        // id order inside a chunk: slab i holds tokens chunk * VCHUNK + VT * i + thread
        carry = 0;
        if (thread_x() == 0) sh.token = VNONE;
        block_barrier();
        #pragma unroll
        for (int i = 0; i < VI; ++i) {
            const u32 e = chunk * VCHUNK + VT * (u32)i + thread_x();
            const u64 mine = residual_of(p, q, zp[i], zq[i], e);
            const u64 before = block_exclusive_sum(mine, carry, sh.warp_sum);
            if (mine > 0 && before <= local && local < before + mine) sh.token = e;
        }
    }
    block_barrier();
    if (thread_x() == 0) {
        a.emitted[(u64)s * (a.max_drafts + 1) + j] = sh.token;
        st[0] = VSTATUS_OK;
    }
}
