//! Family `verify`: batched speculative verification and plain sampling with every sampling
//! control honoured (logit bias, temperature, top-k, top-p, min-p), per-sequence controls,
//! ragged draft counts, counter-based random numbers, per-sequence errors and per-position
//! acceptance statistics (`kernels/templates/verify.cu`).
//!
//! [`reference`](mod@reference) is the definition; the device kernels reproduce it bit for bit (same tokens, same
//! accept counts), which is what the GPU tests check. The kernels never sort the vocabulary:
//!
//! - `verify_histogram` (pass 1 over the logits): each row's blocks histogram the tokens by
//!   weight bucket (octave x `sub_buckets_per_octave`), holding per bucket the token count and
//!   the exact sum of the 24-bit weight mantissas, so histograms add exactly once aligned on
//!   octaves (into a per-row grid, atomically); the row's last block turns that into the row's
//!   histogram and plans which buckets hold the cuts and the draw.
//! - `verify_select` (pass 2): collects the tokens of those buckets (at most
//!   `candidates_per_row`).
//! - `verify_finish` (one block per row): resolves every cut and the draw exactly (a bucket
//!   that was not collected is resolved by radix rounds over the row: slower, same result);
//!   each sequence's last row walks its acceptance chain.
//! - `verify_residual`: only for [`DraftKind::Sampled`], the correction after a rejection (the
//!   residual `max(0, p - q)` needs both rows).
//! - `verify_topk` (then `verify_residual` for sampled drafts) when every sequence has top-k on, at
//!   most the target's `top_k_max`, or is greedy ([`Path::TopK`]). With top-k on, a row's top k
//!   tokens decide every cut and draw (top-p and min-p cut prefixes of them, and no other token
//!   weighs anything), so one pass over the logits is enough: each block keeps its chunks'
//!   candidates in shared memory as order codes, admitting a token only above a floor that rises as
//!   it goes (from the first chunk's per-thread maxima, then from each cut of a full buffer back to
//!   the top k by radix rounds over the codes; a block streaming several chunks loads the next one
//!   before its current one's work and asks the L2 for `top_k_prefetch_chunks` more); a row's
//!   blocks write their candidates and, where they hold 8 or fewer of its top k each on average,
//!   apart, their 8 largest, and raise a shared lower bound on the row's k-th logit (an atomic max
//!   of their own k-th's, not waited for); the row's last block takes the k-th largest of the
//!   pooled codes (distinct tokens of the row: a bound at or near the row's k-th, where the largest
//!   block k-th lies far below it at B = 1, one block per 4096 tokens), keeps the pooled codes
//!   above both bounds and reads a block's whole list only where its 8th pooled code reaches them
//!   (every list where nothing was pooled, all at once); then it ranks the top k (each candidate
//!   counted against the others, no radix rounds, up to `top_k_rank_max` of them, as every block
//!   takes its 8 largest) and finishes the row as `verify_finish` does (one token per thread); the
//!   last row of a sequence walks its chain. Its grid is one wave of `top_k_blocks_per_sm` blocks
//!   per multiprocessor (also its NVIDIA launch bounds).
//! - `verify_greedy`, alone, when every sequence is greedy ([`Path::Greedy`]): a greedy row needs
//!   only its argmax and first bad logit, so pass 1's streaming and each sequence's acceptance
//!   chain share one launch (the last block of a sequence to arrive walks its chain), where the
//!   general path takes three launches and two per-row merge steps.
//!
//! One launch of each serves the whole batch; the controls of every sequence live on the device
//! ([`VerifyWorkspace::set_batch`] uploads them), and [`verify`] allocates nothing and never waits
//! for the host, so it can be captured in a graph. A device (CUDA or HIP) runs the kernels through
//! [`Backend::launch`], each with the one by-value argument [`device::Args`].
//!
//! Reads: `verify_topk` and `verify_greedy` read every processed row once; pass 1 and pass 2
//! each read every processed row once (greedy rows only in pass 1);
//! `verify_finish` reads the collected candidates, and a whole row again only for a bucket too
//! full to collect (rows of nearly equal logits); `verify_residual` reads the two rows of a
//! rejected sampled draft. Tuning per target: `[target.verify]` in `kernels/targets.toml`.
//!
//! Latency, not bandwidth, sets the time at small batches: at B = 1 a row is 61 chunks of 4096
//! logits, one per block, 993 KB read in well under a microsecond, while each kernel is a chain
//! of dependent steps (global round trips of ~0.5-1 us, barriers, one thread's or one warp's
//! serial loops). The kernels are written to keep that chain short:
//! - pass 1 bins a token with three independent 32-bit shared atomics (count, high and low
//!   halves of its mantissa), not one packed 64-bit add, which sm_90 runs as a
//!   compare-and-swap loop (one LDS + ATOMS.CAST round trip per token, serial per thread);
//! - the row's last block plans on a whole warp: every bucket search (rank, weight reached or
//!   exceeded) is a 32-way search, 2 rounds over the buckets instead of 10 dependent loads, and
//!   the plan's bits are warp ballots, one bucket per thread, not 64-step loops;
//! - what a block needs beside its logits arrives in parallel with them rather than after: the
//!   sequence's logit bias is staged in shared memory once per block (no per-thread binary
//!   search in global memory), the first chunk's logits are requested before the sequence,
//!   the probe's token and logit while pass 1 runs, and the finish's pass-2 words and
//!   candidate slots before its histogram scan; the last block takes the grid's anchor from
//!   its own compare-and-swap instead of reading it back;
//! - reductions combine up to three values in two barriers (every warp reduces the partials
//!   itself), where one value took three.
//!
//! `verify_greedy` (H200, BENCHMARKS.md, sixteenth session) takes greedy B = 1 / 8 / 64, n = 1
//! from 13.1 / 39.7 / 91.0 us (the three launches) to 7.6 / 16.3 / 49.7 us. Its streaming keeps
//! x in registers untouched: biased tokens are left out of the register scan and taken one by
//! one, and a grid of one wave (`greedy_blocks_per_sm`, 64 registers) streams more chunks per
//! block. Slower and not kept: biasing by mask in the shared `bias_chunk` (sampled B = 8, n = 1
//! 145.6 -> 160.3 us), the next chunk's loads issued before the current one's scan with the
//! biased logit picked out of the registers (greedy 7.6 / 16.3 / 49.8 -> 8.1 / 17.4 / 52.1 us),
//! and the caller's sequence passed to `finish_sequence` (it moved to local memory).
//!
//! Pass 2 skips a chunk for a warp none of whose tokens reaches one octave below the
//! lowest-weighted bucket it collects or counts in (`pass2_floor`): point-mass B = 64, n = 4
//! 569.6 -> 517.5 us. Two chunks of loads in flight per thread in pass 2, or in both passes,
//! gained under 1% at B = 64 and cost 2% at B = 1 (not kept): the passes stream at a quarter
//! of the DRAM peak for some other reason than the loads in flight.
//!
//! Every "last block" arrival is common/sync.cuh's `block_arrive` (the barrier, then one
//! thread's acquire-release atomic), where each thread ran a sequentially consistent fence
//! before and after (H100, BENCHMARKS.md, forty-sixth session: every case 0.9-5.5% faster, point
//! B = 1, n = 1 17.98 -> 17.00 us; on the H200 of the twelfth session the fences by thread 0
//! alone had gained 1% of a 43 us call). The row passes read the logits with `load_stream_f32`
//! (`ld.global.cs`, evict-first), where NVRTC made the row pointer's loads generic ones (same
//! session: sampled B = 8 77.3 -> 60.2 us, greedy B = 64 62.0 -> 56.4, point B = 64, n = 4 217.7
//! -> 213.0; but point B = 64, n = 1 90.0 -> 91.1 and greedy B = 1 7.94 -> 8.01).
//!
//! Measured and not kept (H200, BENCHMARKS.md, twelfth session): 8 or 4 items per thread instead of
//! 16 (8: B = 1, n = 1 42.8 -> 39.6 us but n = 4 54.2 -> 60.7 and B = 64 slower; 4: slower at
//! nearly every shape). What ncu shows instead at B = 1, n = 1: `verify_histogram` 33 us,
//! `verify_select` 12 us, `verify_finish` 20 us (one block per row); pass 1 at 17% achieved
//! occupancy, its stalls mostly fixed-latency dependencies and barriers, with a 464-byte local
//! stack for its out-of-line calls. Next candidates: the finish's serial chain (a third of the
//! time at B = 1), pass 1's dependent arithmetic per token, and `verify_finish`'s ranking of its
//! candidates by counting (n^2 / 256 compares per thread: nothing at the 2-6 candidates of
//! model-like rows, ~15 us at a full 1024).

pub mod reference;

pub use reference::{AcceptanceStats, Drafts, RowError, SamplingParams, Verified};

use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use crate::target::VerifyTiles;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// The family name (template and module).
pub const FAMILY: &str = "verify";
/// Pass 1: histogram, argmax, bad logits, plan.
pub const KERNEL_HISTOGRAM: &str = "verify_histogram";
/// Pass 2: the candidates of the planned buckets.
pub const KERNEL_SELECT: &str = "verify_select";
/// The exact finish of each row (one block per row) and the acceptance chain of each sequence.
pub const KERNEL_FINISH: &str = "verify_finish";
/// The residual draw after rejecting a sampled draft.
pub const KERNEL_RESIDUAL: &str = "verify_residual";
/// A batch of greedy sequences in one launch: argmax and acceptance chain ([`Path::Greedy`]).
pub const KERNEL_GREEDY: &str = "verify_greedy";
/// A batch whose every sequence keeps at most `top_k_max` tokens, in one launch: each row's top
/// k, its exact finish and the acceptance chains ([`Path::TopK`]).
pub const KERNEL_TOP_K: &str = "verify_topk";

/// Largest vocabulary the kernels take (a token id is 20 bits of their sort keys).
pub const MAX_VOCAB: usize = (1 << 20) - 1;
/// Most blocks one row is split over (the pass-1 merge's shared table).
pub const MAX_BLOCKS_PER_ROW: usize = 256;
/// Most waves of `verify_topk` blocks a batch is split into ([`Layout::split_top_k`]); sizes its
/// per-block candidate slots.
pub const MAX_TOP_K_WAVES: usize = 8;

/// How the drafts of a batch were proposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// A greedy drafter: each draft has probability 1 under q; no draft logits.
    PointMass,
    /// Drafts sampled from the drafter's logit rows, which come with them.
    Sampled,
}

/// One sequence of a batch.
#[derive(Debug, Clone, Copy)]
pub struct Sequence<'a> {
    /// Its controls.
    pub params: &'a SamplingParams,
    /// Position of the token its first target row decides (the first draft's position: the
    /// tokens already in the sequence); it keys the random draws with the seed.
    pub position: u64,
    /// Its number of drafts n (0 = plain sampling of one row); it has n + 1 target rows.
    pub drafts: usize,
}

/// What a [`VerifyWorkspace`] is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Vocabulary size V (1..=[`MAX_VOCAB`]).
    pub vocab: usize,
    /// Most sequences per batch.
    pub max_sequences: usize,
    /// Most drafts per sequence.
    pub max_drafts: usize,
    /// Most logit-bias entries per batch, all sequences together.
    pub max_bias_entries: usize,
}

/// The device interface: the structs `verify.cu` declares, with the same layout.
pub mod device {
    use cudarc::driver::DeviceRepr;

    /// Per-sequence status words (`VSTATUS_WORDS`): code, accepted, error row, error token,
    /// error value bits, residual row, two reserved.
    pub const STATUS_WORDS: usize = 8;
    /// Status: the sequence verified; `emitted` holds accepted + 1 tokens.
    pub const STATUS_OK: u32 = 0;
    /// Status: a NaN or +inf logit (row, token, value).
    pub const STATUS_NONFINITE: u32 = 1;
    /// Status: a row of only -inf (row).
    pub const STATUS_EMPTY: u32 = 2;
    /// Status: a draft token outside the vocabulary (token).
    pub const STATUS_TOKEN: u32 = 3;
    /// Status: the host rejected the sequence's controls.
    pub const STATUS_PARAM: u32 = 4;
    /// Status: waiting for `verify_residual` (never left after a complete launch).
    pub const STATUS_PENDING: u32 = 5;
    /// Status: `verify_greedy` or `verify_topk` ran for a sequence it cannot serve (a graph
    /// captured for a [`super::Path::Greedy`] or [`super::Path::TopK`] batch, replayed after
    /// [`super::VerifyWorkspace::set_batch`] uploaded another kind).
    pub const STATUS_STALE: u32 = 6;
    /// Status: not verified since [`super::VerifyWorkspace::set_batch`] (written by the host
    /// there; every launch overwrites it), so outcomes read before a launch, or after one that
    /// failed, are an error rather than the last batch's tokens.
    pub const STATUS_NOT_RUN: u32 = 7;
    /// `Sequence::flags`: the batch has draft logit rows.
    pub const SEQUENCE_SAMPLED_DRAFTS: u32 = 1;
    /// Octaves of weight below the top that count (the reference's `MASS_OCTAVES`).
    pub const OCTAVES: usize = super::reference::MASS_OCTAVES as usize;
    /// Fixed u64 words of a row's state before its plan (`RS_PLAN`).
    pub const ROW_STATE_FIXED_WORDS: usize = 16;
    /// Octaves a row's pass-1 grid reaches above its anchor (`VHEAD`).
    pub const GRID_HEADROOM: usize = 64;

    /// `VerifySequence`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct Sequence {
        /// Seed of its draws.
        pub seed: u64,
        /// Position of the token its first target row decides (`super::Sequence::position`).
        pub position: u64,
        /// 0: greedy.
        pub temperature: f32,
        /// 1: off.
        pub top_p: f32,
        /// 0: off.
        pub min_p: f32,
        /// 0: off (clamped to the vocabulary).
        pub top_k: u32,
        /// n.
        pub drafts: u32,
        /// Its n + 1 target rows, then (sampled drafts) its n draft rows, in the row table.
        pub first_row: u32,
        /// Its first draft token (and draft logit row).
        pub first_draft: u32,
        /// Its bias entries `[bias_begin, bias_end)` in the sorted bias arrays.
        pub bias_begin: u32,
        /// End of its bias entries.
        pub bias_end: u32,
        /// Nonzero: the host rejected its controls.
        pub host_error: u32,
        /// [`SEQUENCE_SAMPLED_DRAFTS`].
        pub flags: u32,
        /// Zero.
        pub reserved: u32,
    }

    /// `VerifyRow`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct Row {
        /// Its sequence.
        pub sequence: u32,
        /// j: target row j (0..=n) or draft row j (0..n).
        pub index: u32,
        /// 1 for a draft row.
        pub is_draft: u32,
        /// Its row of the target or draft logits.
        pub logits_row: u32,
    }

    /// `VerifyArgs`: device addresses and sizes, the one argument of every kernel.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct Args {
        /// `[target rows][vocab]` f32.
        pub target_logits: u64,
        /// `[draft rows][vocab]` f32 (sampled drafts; else any address, unread).
        pub draft_logits: u64,
        /// `[draft rows]` u32.
        pub draft_tokens: u64,
        /// `[sequences]` [`Sequence`].
        pub sequences: u64,
        /// `[rows]` [`Row`].
        pub rows: u64,
        /// Bias tokens, sorted per sequence.
        pub bias_tokens: u64,
        /// Bias values, in the same order.
        pub bias_values: u64,
        /// Scratch: per-block histograms (`verify_topk`: each block's 8 largest candidates,
        /// pooled into a bound on its row's k-th logit where its row has many blocks).
        pub block_hist: u64,
        /// Scratch: per-block summaries.
        pub block_summary: u64,
        /// Scratch: per-row weight grids, zero between launches.
        pub row_grid: u64,
        /// Scratch: per-row grid anchors (`verify_topk`: bounds on the row's k-th logit), zero
        /// between launches.
        pub row_anchor: u64,
        /// Scratch: per-row histograms.
        pub row_hist: u64,
        /// Scratch: per-row state.
        pub row_state: u64,
        /// Scratch: per-row candidates (`verify_topk`: per-block ones).
        pub candidates: u64,
        /// Scratch: residual sums per sequence and chunk.
        pub residual_sums: u64,
        /// Arrival counters, zero between launches.
        pub counters: u64,
        /// Out: `[sequences][max_drafts + 1]` emitted tokens.
        pub emitted: u64,
        /// Out: `[sequences][STATUS_WORDS]`.
        pub status: u64,
        /// In/out: `drafted[max_drafts]`, then `accepted[max_drafts]` (u64, accumulated).
        pub stats: u64,
        /// V.
        pub vocab: u32,
        /// Sequences in the batch.
        pub sequence_count: u32,
        /// Rows in the batch.
        pub row_count: u32,
        /// Stride of `emitted` minus one, length of each `stats` half.
        pub max_drafts: u32,
        /// Chunks of `threads_per_block * items_per_thread` logits per row.
        pub chunks_per_row: u32,
        /// Chunks each pass-1/pass-2 block streams.
        pub chunks_per_block: u32,
        /// Blocks per row of pass 1 and pass 2 (grid x).
        pub blocks_per_row: u32,
        /// Zero.
        pub reserved: u32,
    }

    // verify.cu asserts the same sizes
    const _: () = assert!(std::mem::size_of::<Sequence>() == 64);
    const _: () = assert!(std::mem::size_of::<Row>() == 16);
    const _: () = assert!(std::mem::size_of::<Args>() == 19 * 8 + 8 * 4);

    // SAFETY: plain-old-data structs of integers and floats, laid out as verify.cu declares them;
    // all-zero bits are a valid value of each.
    unsafe impl DeviceRepr for Sequence {}
    // SAFETY: as above.
    unsafe impl cudarc::driver::ValidAsZeroBits for Sequence {}
    // SAFETY: as above.
    unsafe impl DeviceRepr for Row {}
    // SAFETY: as above.
    unsafe impl cudarc::driver::ValidAsZeroBits for Row {}
    // SAFETY: as above; the addresses are only dereferenced by the kernels.
    unsafe impl DeviceRepr for Args {}
}

/// Sizes of every device buffer for a capacity on a target (shared by the device workspace and
/// anything else that runs the kernels, such as a CPU emulation of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The capacity.
    pub capacity: Capacity,
    /// Logits per chunk (`threads_per_block * items_per_thread`).
    pub chunk: usize,
    /// Chunks per row.
    pub chunks_per_row: usize,
    /// Histogram buckets per row (`(OCTAVES + 1) * sub_buckets_per_octave`).
    pub buckets: usize,
    /// u64 words of a row's pass-1 grid (`(OCTAVES + 1 + GRID_HEADROOM) * sub_buckets_per_octave`).
    pub grid_words: usize,
    /// u64 words of one row's state.
    pub row_words: usize,
    /// Candidates per row.
    pub candidates_per_row: usize,
    /// Most rows: target rows plus draft rows.
    pub rows: usize,
    /// Most (row, block) slots of pass 1 (or of `verify_greedy`).
    pub block_slots: usize,
    /// Blocks the launch aims at (multiprocessors x blocks_per_sm).
    pub target_blocks: usize,
    /// Blocks of one wave of `verify_greedy` (multiprocessors x greedy_blocks_per_sm).
    pub greedy_blocks: usize,
    /// Blocks of one wave of `verify_topk` (multiprocessors x top_k_blocks_per_sm).
    pub top_k_blocks: usize,
    /// Threads per block, also the most rows a sequence of a [`Path::Greedy`] batch has.
    pub threads_per_block: usize,
    /// Largest top-k of a [`Path::TopK`] batch (`top_k_max` of the target).
    pub top_k_max: usize,
    /// Candidates per `verify_topk` block (`top_k_buffer` of the target): the u64 slots each
    /// block of a row writes its candidates to.
    pub top_k_buffer: usize,
}

impl Layout {
    /// The layout of `capacity` on a target with these tiles and multiprocessors.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a vocabulary of 0 or above [`MAX_VOCAB`], or sizes that overflow.
    pub fn new(capacity: Capacity, tiles: &VerifyTiles, multiprocessors: u32) -> Result<Self> {
        if capacity.vocab == 0 || capacity.vocab > MAX_VOCAB {
            return Err(Error::invalid(
                "verify vocabulary",
                format!(
                    "{} tokens; the kernels take 1..={MAX_VOCAB}",
                    capacity.vocab
                ),
            ));
        }
        let chunk = (tiles.threads_per_block * tiles.items_per_thread) as usize;
        let buckets = (device::OCTAVES + 1) * tiles.sub_buckets_per_octave as usize;
        let rows = capacity
            .max_sequences
            .checked_mul(2 * capacity.max_drafts + 1)
            .filter(|&r| r <= u32::MAX as usize / 4)
            .ok_or_else(|| {
                Error::invalid(
                    "verify capacity",
                    format!("{capacity:?} has more rows than the kernels index"),
                )
            })?;
        let target_blocks = (multiprocessors.max(1) * tiles.blocks_per_sm) as usize;
        let greedy_blocks = (multiprocessors.max(1) * tiles.greedy_blocks_per_sm) as usize;
        let top_k_blocks = (multiprocessors.max(1) * tiles.top_k_blocks_per_sm) as usize;
        Ok(Self {
            capacity,
            chunk,
            chunks_per_row: capacity.vocab.div_ceil(chunk),
            buckets,
            grid_words: (device::OCTAVES + 1 + device::GRID_HEADROOM)
                * tiles.sub_buckets_per_octave as usize,
            row_words: device::ROW_STATE_FIXED_WORDS + buckets.div_ceil(64),
            candidates_per_row: tiles.candidates_per_row as usize,
            rows,
            block_slots: target_blocks
                .max(greedy_blocks)
                .max(MAX_TOP_K_WAVES * top_k_blocks)
                + rows,
            target_blocks,
            greedy_blocks,
            top_k_blocks,
            threads_per_block: tiles.threads_per_block as usize,
            top_k_max: tiles.top_k_max as usize,
            top_k_buffer: tiles.top_k_buffer as usize,
        })
    }

    /// Blocks per row and chunks per block of passes 1 and 2 for a batch of `rows` rows: enough
    /// blocks to fill the device, whole chunks each.
    pub fn split(&self, rows: usize) -> (usize, usize) {
        self.split_into(self.target_blocks.div_ceil(rows.max(1)))
    }

    /// As [`Layout::split`] for `verify_greedy`: at most one wave ([`Layout::greedy_blocks`])
    /// while there are fewer rows, each block streaming the chunks one more would have had (a
    /// second wave would wait for the first's chain of round trips).
    pub fn split_greedy(&self, rows: usize) -> (usize, usize) {
        self.split_into(self.greedy_blocks / rows.max(1))
    }

    /// Blocks per row and chunks per block of `verify_topk`: the split with the fewest waves
    /// ([`Layout::top_k_blocks`] blocks each) times chunks per block, over at most
    /// [`MAX_TOP_K_WAVES`] waves (fewer blocks per row on a tie). Below one wave of rows that is
    /// one wave; above, a row splits too, so that the last wave is not a few blocks streaming
    /// whole rows while the rest of the device waits (320 rows of 61 chunks on 264 slots: 4
    /// blocks of 16 chunks per row in 5 waves, 80 chunk times, against 2 waves of whole rows,
    /// 122).
    pub fn split_top_k(&self, rows: usize) -> (usize, usize) {
        let rows = rows.max(1);
        let wave = self.top_k_blocks.max(1);
        let most = (MAX_TOP_K_WAVES * wave / rows).max(1);
        let mut best = self.split_into(1);
        let mut best_cost = usize::MAX;
        for wanted in 1..=most.min(self.chunks_per_row.min(MAX_BLOCKS_PER_ROW)) {
            let (blocks, chunks) = self.split_into(wanted);
            let cost = (rows * blocks).div_ceil(wave) * chunks;
            if cost < best_cost {
                (best, best_cost) = ((blocks, chunks), cost);
            }
        }
        best
    }

    /// Blocks per row (about `wanted`, at least 1, at most one per chunk) and chunks per block.
    fn split_into(&self, wanted: usize) -> (usize, usize) {
        let wanted = wanted.clamp(1, self.chunks_per_row.min(MAX_BLOCKS_PER_ROW));
        let chunks_per_block = self.chunks_per_row.div_ceil(wanted);
        (
            self.chunks_per_row.div_ceil(chunks_per_block),
            chunks_per_block,
        )
    }

    /// u32 counters: one per row, two per sequence.
    pub fn counters(&self) -> usize {
        self.rows + 2 * self.capacity.max_sequences
    }

    /// Length of every buffer [`device::Args`] points at that the workspace owns, in elements.
    pub fn buffer_lengths(&self) -> BufferLengths {
        let cap = &self.capacity;
        BufferLengths {
            sequences: cap.max_sequences,
            rows: self.rows,
            bias: cap.max_bias_entries,
            block_hist: self.block_slots * self.buckets,
            block_summary: self.block_slots * 3,
            row_grid: self.rows * self.grid_words,
            row_anchor: self.rows,
            row_hist: self.rows * self.buckets,
            row_state: self.rows * self.row_words,
            // pass 2's per-row candidates, or verify_topk's per-block ones (split_top_k: at
            // most max(MAX_TOP_K_WAVES * top_k_blocks, rows) blocks)
            candidates: (self.rows * self.candidates_per_row)
                .max((MAX_TOP_K_WAVES * self.top_k_blocks).max(self.rows) * self.top_k_buffer),
            residual_sums: cap.max_sequences * self.chunks_per_row,
            counters: self.counters(),
            emitted: cap.max_sequences * (cap.max_drafts + 1),
            status: cap.max_sequences * device::STATUS_WORDS,
            stats: 2 * cap.max_drafts,
        }
    }

    /// The launches [`verify`] makes for `batch`, in order: kernel name and grid (x, y); each
    /// block has `threads_per_block` threads and no dynamic shared memory.
    pub fn launches(&self, batch: &Batch) -> Vec<(&'static str, (u32, u32))> {
        let rows = batch.rows.len() as u32;
        if rows == 0 {
            return Vec::new();
        }
        let grid = (batch.blocks_per_row as u32, rows);
        let mut out = match batch.path {
            Path::Greedy => return vec![(KERNEL_GREEDY, grid)],
            Path::TopK => vec![(KERNEL_TOP_K, grid)],
            Path::Histogram => vec![
                (KERNEL_HISTOGRAM, grid),
                (KERNEL_SELECT, grid),
                (KERNEL_FINISH, (1, rows)),
            ],
        };
        if batch.kind == DraftKind::Sampled {
            out.push((
                KERNEL_RESIDUAL,
                (self.chunks_per_row as u32, batch.sequences.len() as u32),
            ));
        }
        out
    }
}

/// Element counts of the workspace's device buffers ([`Layout::buffer_lengths`]), one field per
/// [`device::Args`] buffer it owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLengths {
    /// [`device::Sequence`] records.
    pub sequences: usize,
    /// [`device::Row`] records.
    pub rows: usize,
    /// Bias entries (tokens and values each).
    pub bias: usize,
    /// u64 per-block histogram words.
    pub block_hist: usize,
    /// u64 per-block summary words.
    pub block_summary: usize,
    /// u64 per-row grid words.
    pub row_grid: usize,
    /// u32 per-row grid anchors.
    pub row_anchor: usize,
    /// u64 per-row histogram words.
    pub row_hist: usize,
    /// u64 per-row state words.
    pub row_state: usize,
    /// u64 candidate words.
    pub candidates: usize,
    /// u64 residual sums.
    pub residual_sums: usize,
    /// u32 arrival counters.
    pub counters: usize,
    /// u32 emitted tokens.
    pub emitted: usize,
    /// u32 status words.
    pub status: usize,
    /// u64 statistics.
    pub stats: usize,
}

/// Which kernels serve a batch ([`Layout::launches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `verify_histogram`, `verify_select`, `verify_finish` (and `verify_residual` for sampled
    /// drafts): any controls.
    Histogram,
    /// `verify_greedy` alone: every sequence greedy with controls the host accepted, point-mass
    /// drafts, fewer drafts than a block has threads.
    Greedy,
    /// `verify_topk` (and `verify_residual` for sampled drafts): every sequence greedy, rejected
    /// by the host, or with top-k in `1..=top_k_max`, so that a row's top k decide everything.
    TopK,
}

/// A batch encoded for the device: what [`VerifyWorkspace::set_batch`] uploads.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Per sequence.
    pub sequences: Vec<device::Sequence>,
    /// Target rows of every sequence, then its draft rows.
    pub rows: Vec<device::Row>,
    /// Bias tokens, sorted per sequence (list order among equal tokens).
    pub bias_tokens: Vec<u32>,
    /// Bias values in the same order.
    pub bias_values: Vec<f32>,
    /// The host's verdict on each sequence's controls.
    pub host_errors: Vec<Option<RowError>>,
    /// Each sequence's controls as given (the CPU backend runs the reference on them).
    pub params: Vec<SamplingParams>,
    /// How the drafts were proposed.
    pub kind: DraftKind,
    /// Target rows (rows of the target logits).
    pub target_rows: usize,
    /// Draft tokens (and draft logit rows).
    pub draft_rows: usize,
    /// Blocks per row of passes 1 and 2 (or of `verify_greedy`, [`Layout::split_greedy`], and
    /// `verify_topk`, [`Layout::split_top_k`]).
    pub blocks_per_row: usize,
    /// Chunks each of those blocks streams.
    pub chunks_per_block: usize,
    /// The kernels that serve it.
    pub path: Path,
}

impl Batch {
    /// Encodes `sequences` for `layout`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the batch exceeds the capacity (sequences, drafts per sequence,
    /// bias entries). Bad controls are not errors here: they become that sequence's status.
    pub fn encode(layout: &Layout, sequences: &[Sequence<'_>], kind: DraftKind) -> Result<Self> {
        let cap = &layout.capacity;
        if sequences.len() > cap.max_sequences {
            return Err(Error::invalid(
                "verify batch",
                format!(
                    "{} sequences; the workspace holds {}",
                    sequences.len(),
                    cap.max_sequences
                ),
            ));
        }
        let mut batch = Batch {
            sequences: Vec::with_capacity(sequences.len()),
            rows: Vec::new(),
            bias_tokens: Vec::new(),
            bias_values: Vec::new(),
            host_errors: Vec::with_capacity(sequences.len()),
            params: sequences.iter().map(|s| s.params.clone()).collect(),
            kind,
            target_rows: 0,
            draft_rows: 0,
            blocks_per_row: 0,
            chunks_per_block: 0,
            path: Path::Histogram,
        };
        let sampled = kind == DraftKind::Sampled;
        let (mut greedy, mut top_k) = (kind == DraftKind::PointMass, true);
        for (s, seq) in sequences.iter().enumerate() {
            if seq.drafts > cap.max_drafts {
                return Err(Error::invalid(
                    format!("verify sequence {s}"),
                    format!(
                        "{} drafts; the workspace holds {}",
                        seq.drafts, cap.max_drafts
                    ),
                ));
            }
            let params = seq.params;
            let host_error = reference::check_params(params, cap.vocab).err();
            let bias_begin = batch.bias_tokens.len();
            if host_error.is_none() {
                let mut bias = params.logit_bias.clone();
                bias.sort_by_key(|&(token, _)| token); // stable: list order among equals
                for (token, value) in bias {
                    batch.bias_tokens.push(token);
                    batch.bias_values.push(value);
                }
            }
            if batch.bias_tokens.len() > cap.max_bias_entries {
                return Err(Error::invalid(
                    "verify batch",
                    format!(
                        "{} logit-bias entries so far; the workspace holds {}",
                        batch.bias_tokens.len(),
                        cap.max_bias_entries
                    ),
                ));
            }
            let n = seq.drafts as u32;
            let first_row = batch.rows.len() as u32;
            for j in 0..=n {
                batch.rows.push(device::Row {
                    sequence: s as u32,
                    index: j,
                    is_draft: 0,
                    logits_row: (batch.target_rows + j as usize) as u32,
                });
            }
            if sampled {
                for j in 0..n {
                    batch.rows.push(device::Row {
                        sequence: s as u32,
                        index: j,
                        is_draft: 1,
                        logits_row: (batch.draft_rows + j as usize) as u32,
                    });
                }
            }
            batch.sequences.push(device::Sequence {
                seed: params.seed,
                position: seq.position,
                temperature: params.temperature,
                top_p: params.top_p,
                min_p: params.min_p,
                top_k: params.top_k.min(cap.vocab) as u32,
                drafts: n,
                first_row,
                first_draft: batch.draft_rows as u32,
                bias_begin: bias_begin as u32,
                bias_end: batch.bias_tokens.len() as u32,
                host_error: u32::from(host_error.is_some()),
                flags: if sampled {
                    device::SEQUENCE_SAMPLED_DRAFTS
                } else {
                    0
                },
                reserved: 0,
            });
            greedy &= params.temperature == 0.0
                && host_error.is_none()
                && seq.drafts < layout.threads_per_block;
            top_k &= host_error.is_some()
                || params.temperature == 0.0
                || (1..=layout.top_k_max).contains(&params.top_k.min(cap.vocab));
            batch.host_errors.push(host_error);
            batch.target_rows += seq.drafts + 1;
            batch.draft_rows += seq.drafts;
        }
        batch.path = if greedy {
            Path::Greedy
        } else if top_k {
            Path::TopK
        } else {
            Path::Histogram
        };
        let (blocks_per_row, chunks_per_block) = match batch.path {
            Path::Histogram => layout.split(batch.rows.len()),
            Path::Greedy => layout.split_greedy(batch.rows.len()),
            Path::TopK => layout.split_top_k(batch.rows.len()),
        };
        batch.blocks_per_row = blocks_per_row;
        batch.chunks_per_block = chunks_per_block;
        Ok(batch)
    }

    /// The outcome of every sequence from the status and emitted words the kernels wrote.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a status word is not one the kernels write (a launch that did not
    /// complete).
    pub fn decode(
        &self,
        layout: &Layout,
        status: &[u32],
        emitted: &[u32],
    ) -> Result<Vec<std::result::Result<Verified, RowError>>> {
        let stride = layout.capacity.max_drafts + 1;
        (0..self.sequences.len())
            .map(|s| {
                let st = &status[s * device::STATUS_WORDS..(s + 1) * device::STATUS_WORDS];
                let (row, token) = (st[2] as usize, st[3]);
                Ok(match st[0] {
                    device::STATUS_OK => {
                        let accepted = st[1] as usize;
                        Ok(Verified {
                            accepted,
                            emitted: emitted[s * stride..s * stride + accepted + 1].to_vec(),
                        })
                    }
                    device::STATUS_NONFINITE => Err(RowError::NonFiniteLogit {
                        row,
                        token: token as usize,
                        value: f32::from_bits(st[4]),
                    }),
                    device::STATUS_EMPTY => Err(RowError::EmptySupport { row }),
                    device::STATUS_TOKEN => Err(RowError::TokenOutOfRange {
                        token,
                        vocab: layout.capacity.vocab,
                    }),
                    device::STATUS_PARAM => Err(self.host_errors[s].clone().ok_or_else(|| {
                        Error::invalid(
                            format!("verify sequence {s}"),
                            "the kernels report a parameter error the host did not find",
                        )
                    })?),
                    device::STATUS_NOT_RUN => {
                        return Err(Error::invalid(
                            format!("verify sequence {s}"),
                            "not verified since the batch was set: run verify (or replay its \
                             graph) before reading outcomes",
                        ));
                    }
                    device::STATUS_STALE => {
                        return Err(Error::invalid(
                            format!("verify sequence {s}"),
                            "the launches that ran were planned for a batch of greedy or top-k \
                             sequences (a replayed graph?); capture them again for this batch",
                        ));
                    }
                    code => {
                        return Err(Error::invalid(
                            format!("verify sequence {s}"),
                            format!("status {code} after the launch (incomplete launch?)"),
                        ));
                    }
                })
            })
            .collect()
    }

    /// Rows of both kinds.
    pub fn row_count(&self) -> usize {
        self.rows.len()
    }
}

/// Device buffers of a workspace on a device backend, and that backend (the workspace's copies
/// go through it).
struct DeviceBuffers {
    backend: Backend,
    sequences: DeviceVec<device::Sequence>,
    rows: DeviceVec<device::Row>,
    bias_tokens: DeviceVec<u32>,
    bias_values: DeviceVec<f32>,
    block_hist: DeviceVec<u64>,
    block_summary: DeviceVec<u64>,
    row_grid: DeviceVec<u64>,
    row_anchor: DeviceVec<u32>,
    row_hist: DeviceVec<u64>,
    row_state: DeviceVec<u64>,
    candidates: DeviceVec<u64>,
    residual_sums: DeviceVec<u64>,
    counters: DeviceVec<u32>,
    emitted: DeviceVec<u32>,
    status: DeviceVec<u32>,
    stats: DeviceVec<u64>,
}

enum Storage {
    Host {
        outcomes: Vec<std::result::Result<Verified, RowError>>,
        stats: AcceptanceStats,
    },
    Device(Box<DeviceBuffers>),
}

/// Everything [`verify`] needs on its backend, allocated once: the batch's controls, scratch,
/// and the outputs (emitted tokens, per-sequence status, acceptance statistics).
pub struct VerifyWorkspace {
    layout: Layout,
    batch: Option<Batch>,
    storage: Storage,
}

/// `len` zeroed elements on `backend`, at least one (an allocation of 0 bytes fails); a failure
/// names the workspace buffer `what`.
fn alloc<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
    backend: &Backend,
    what: &str,
    len: usize,
) -> Result<DeviceVec<T>> {
    backend
        .zeros(len.max(1))
        .map_err(|e| e.during(&format!("verify workspace `{what}`")))
}

impl VerifyWorkspace {
    /// A workspace for batches up to `capacity` on `backend`.
    ///
    /// # Errors
    /// As [`Layout::new`]; [`Error::Cuda`] / [`Error::Hip`] when an allocation fails.
    pub fn new(backend: &Backend, capacity: Capacity) -> Result<Self> {
        let (tiles, multiprocessors) = match backend.target() {
            None => (&crate::target::all()[0].verify, 1),
            Some(target) => (
                &target.verify,
                backend.multiprocessors().unwrap_or(target.multiprocessors),
            ),
        };
        let layout = Layout::new(capacity, tiles, multiprocessors)?;
        let storage = match backend {
            Backend::Cpu => Storage::Host {
                outcomes: Vec::new(),
                stats: AcceptanceStats {
                    drafted: vec![0; capacity.max_drafts],
                    accepted: vec![0; capacity.max_drafts],
                },
            },
            Backend::Cuda(_) | Backend::Hip(_) => {
                let n = layout.buffer_lengths();
                Storage::Device(Box::new(DeviceBuffers {
                    backend: backend.clone(),
                    sequences: alloc(backend, "sequences", n.sequences)?,
                    rows: alloc(backend, "rows", n.rows)?,
                    bias_tokens: alloc(backend, "bias_tokens", n.bias)?,
                    bias_values: alloc(backend, "bias_values", n.bias)?,
                    block_hist: alloc(backend, "block_hist", n.block_hist)?,
                    block_summary: alloc(backend, "block_summary", n.block_summary)?,
                    row_grid: alloc(backend, "row_grid", n.row_grid)?,
                    row_anchor: alloc(backend, "row_anchor", n.row_anchor)?,
                    row_hist: alloc(backend, "row_hist", n.row_hist)?,
                    row_state: alloc(backend, "row_state", n.row_state)?,
                    candidates: alloc(backend, "candidates", n.candidates)?,
                    residual_sums: alloc(backend, "residual_sums", n.residual_sums)?,
                    counters: alloc(backend, "counters", n.counters)?,
                    emitted: alloc(backend, "emitted", n.emitted)?,
                    status: alloc(backend, "status", n.status)?,
                    stats: alloc(backend, "stats", n.stats)?,
                }))
            }
        };
        Ok(Self {
            layout,
            batch: None,
            storage,
        })
    }

    /// The buffer layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The batch [`verify`] runs next (and the one it ran last).
    pub fn batch(&self) -> Option<&Batch> {
        self.batch.as_ref()
    }

    /// Sets the batch: each sequence's controls, position and draft count (the target logits
    /// then hold, per sequence in order, its n + 1 rows; the draft tokens and draft logits its
    /// n). Copies them to the device; call it before [`verify`], outside any captured graph.
    ///
    /// A captured graph replays the launches of the batch it was captured with, grids and
    /// arguments included ([`Layout::launches`]): a new batch needs the same sequence and row
    /// counts. A graph of a [`Path::Greedy`] batch serves only sequences at temperature 0 with
    /// point-mass drafts and fewer drafts than a block has threads, one of a [`Path::TopK`] batch
    /// only sequences it would take again; any other gets [`Error::Invalid`] from
    /// [`VerifyWorkspace::outcomes`], never a token.
    ///
    /// # Errors
    /// As [`Batch::encode`]; [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn set_batch(&mut self, sequences: &[Sequence<'_>], kind: DraftKind) -> Result<()> {
        let batch = Batch::encode(&self.layout, sequences, kind)?;
        // a copy that fails below leaves no batch set, not the last one half replaced
        self.batch = None;
        // until a launch of this batch, its outcomes are an error, not the last batch's
        match &mut self.storage {
            Storage::Host { outcomes, .. } => outcomes.clear(),
            Storage::Device(buffers) => {
                let b = &mut **buffers;
                // Batch::encode kept the batch within the capacity the buffers were sized for
                if !batch.sequences.is_empty() {
                    let mut status = vec![0u32; batch.sequences.len() * device::STATUS_WORDS];
                    status
                        .iter_mut()
                        .step_by(device::STATUS_WORDS)
                        .for_each(|code| *code = device::STATUS_NOT_RUN);
                    b.backend.write(&mut b.status, 0, &status)?;
                    b.backend.write(&mut b.sequences, 0, &batch.sequences)?;
                    b.backend.write(&mut b.rows, 0, &batch.rows)?;
                }
                if !batch.bias_tokens.is_empty() {
                    b.backend.write(&mut b.bias_tokens, 0, &batch.bias_tokens)?;
                    b.backend.write(&mut b.bias_values, 0, &batch.bias_values)?;
                }
            }
        }
        self.batch = Some(batch);
        Ok(())
    }

    /// Each sequence's outcome of the last [`verify`] (waits for it).
    ///
    /// # Errors
    /// [`Error::Invalid`] before any batch was set, when the batch set last has not been verified
    /// (no launch since [`VerifyWorkspace::set_batch`], or the last one failed), for a replayed
    /// graph of a greedy or top-k batch that cannot serve the batch set, or an incomplete
    /// launch; [`Error::Cuda`] / [`Error::Hip`] when the copy fails (where an asynchronous fault
    /// of the kernels shows).
    pub fn outcomes(&self) -> Result<Vec<std::result::Result<Verified, RowError>>> {
        let batch = self.batch.as_ref().ok_or_else(no_batch)?;
        match &self.storage {
            Storage::Host { outcomes, .. } => {
                if outcomes.len() != batch.sequences.len() {
                    return Err(Error::invalid(
                        "verify outcomes",
                        "not verified since the batch was set: run verify before reading them",
                    ));
                }
                Ok(outcomes.clone())
            }
            Storage::Device(b) => {
                let status = b.backend.download(&b.status)?;
                let emitted = b.backend.download(&b.emitted)?;
                batch.decode(&self.layout, &status, &emitted)
            }
        }
    }

    /// Drafted and accepted counts by draft position, summed over every sequence verified
    /// without error since the workspace was made or [`VerifyWorkspace::reset_stats`] ran
    /// (`max_drafts` positions).
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn stats(&self) -> Result<AcceptanceStats> {
        match &self.storage {
            Storage::Host { stats, .. } => Ok(stats.clone()),
            Storage::Device(b) => {
                let words = b.backend.download(&b.stats)?;
                let n = self.layout.capacity.max_drafts;
                Ok(AcceptanceStats {
                    drafted: words[..n].to_vec(),
                    accepted: words[n..2 * n].to_vec(),
                })
            }
        }
    }

    /// Zeroes the acceptance statistics.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the memset fails.
    pub fn reset_stats(&mut self) -> Result<()> {
        match &mut self.storage {
            Storage::Host { stats, .. } => {
                stats.drafted.fill(0);
                stats.accepted.fill(0);
            }
            Storage::Device(b) => b.backend.fill_zeros(&mut b.stats)?,
        }
        Ok(())
    }

    /// The emitted tokens on the device, `[max_sequences][max_drafts + 1]` (`None` on the CPU
    /// backend): sequence s's `accepted + 1` tokens start at `s * (max_drafts + 1)`.
    pub fn emitted_device(&self) -> Option<&DeviceVec<u32>> {
        match &self.storage {
            Storage::Device(buffers) => Some(&buffers.emitted),
            Storage::Host { .. } => None,
        }
    }

    /// The per-sequence status words on the device, `[max_sequences][device::STATUS_WORDS]`
    /// (`None` on the CPU backend): word 0 the code (`device::STATUS_*`), word 1 the accepted
    /// count.
    pub fn status_device(&self) -> Option<&DeviceVec<u32>> {
        match &self.storage {
            Storage::Device(buffers) => Some(&buffers.status),
            Storage::Host { .. } => None,
        }
    }
}

fn no_batch() -> Error {
    Error::invalid("verify workspace", "no batch was set (set_batch first)")
}

/// Bytes [`verify`] must read at least for the current batch of `workspace`: every target row
/// (and draft row) of the logits once.
pub fn logits_bytes(workspace: &VerifyWorkspace) -> u64 {
    workspace.batch.as_ref().map_or(0, |b| {
        let rows = b.target_rows
            + if b.kind == DraftKind::Sampled {
                b.draft_rows
            } else {
                0
            };
        (rows * workspace.layout.capacity.vocab * 4) as u64
    })
}

/// Verifies (and samples) the workspace's batch: `target_logits` is `[target rows][V]` f32 (each
/// sequence's n + 1 rows in order), `draft_tokens` its drafts (`[draft rows]`), `draft_logits`
/// `[draft rows][V]` for [`DraftKind::Sampled`]. Outcomes land in the workspace
/// ([`VerifyWorkspace::outcomes`], or on the device for a runner that keeps them there); bad
/// values are per-sequence errors, never tokens. On a device: four launches at most, no allocation,
/// no host synchronisation.
///
/// # Errors
/// [`Error::Invalid`] with no batch set or buffers that disagree with it,
/// [`Error::BackendMismatch`] for buffers of another backend, [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`] from the device path.
pub fn verify(
    backend: &Backend,
    workspace: &mut VerifyWorkspace,
    target_logits: &DeviceVec<f32>,
    draft_tokens: &DeviceVec<u32>,
    draft_logits: Option<&DeviceVec<f32>>,
) -> Result<()> {
    let layout = workspace.layout;
    let batch = workspace.batch.as_ref().ok_or_else(no_batch)?;
    let vocab = layout.capacity.vocab;
    super::check_len(
        "verify target logits",
        target_logits,
        batch.target_rows * vocab,
        &format!("[{}, {vocab}]", batch.target_rows),
    )?;
    if draft_tokens.len() < batch.draft_rows {
        return Err(Error::invalid(
            "verify draft tokens",
            format!(
                "{} tokens for a batch of {} drafts",
                draft_tokens.len(),
                batch.draft_rows
            ),
        ));
    }
    let draft_logits = match (batch.kind, draft_logits) {
        (DraftKind::Sampled, Some(d)) => {
            super::check_len(
                "verify draft logits",
                d,
                batch.draft_rows * vocab,
                &format!("[{}, {vocab}]", batch.draft_rows),
            )?;
            Some(d)
        }
        (DraftKind::Sampled, None) => {
            return Err(Error::invalid(
                "verify draft logits",
                "sampled drafts need their logit rows",
            ));
        }
        (DraftKind::PointMass, _) => None,
    };
    match (&mut workspace.storage, backend) {
        (Storage::Host { outcomes, stats }, Backend::Cpu) => {
            let DeviceVec::Host(target) = target_logits else {
                return Err(backend.mismatch("verify target logits", target_logits));
            };
            let DeviceVec::Host(tokens) = draft_tokens else {
                return Err(backend.mismatch("verify draft tokens", draft_tokens));
            };
            let draft = match draft_logits {
                Some(DeviceVec::Host(d)) => Some(d.as_slice()),
                Some(other) => return Err(backend.mismatch("verify draft logits", other)),
                None => None,
            };
            *outcomes = verify_on_host(batch, vocab, target, tokens, draft, stats);
            Ok(())
        }
        (Storage::Device(buffers), Backend::Cuda(_) | Backend::Hip(_))
            if buffers.backend.name() == backend.name() =>
        {
            launch(
                backend,
                &layout,
                batch,
                buffers,
                target_logits,
                draft_tokens,
                draft_logits,
            )
        }
        _ => Err(Error::invalid(
            "verify workspace",
            format!("made for another backend than {}", backend.name()),
        )),
    }
}

/// The CPU backend: the reference, sequence by sequence.
fn verify_on_host(
    batch: &Batch,
    vocab: usize,
    target: &[f32],
    tokens: &[u32],
    draft_logits: Option<&[f32]>,
    stats: &mut AcceptanceStats,
) -> Vec<std::result::Result<Verified, RowError>> {
    let mut target_row = 0;
    batch
        .sequences
        .iter()
        .enumerate()
        .map(|(s, seq)| {
            let n = seq.drafts as usize;
            let first = seq.first_draft as usize;
            let rows = &target[target_row * vocab..(target_row + n + 1) * vocab];
            target_row += n + 1;
            let drafted = &tokens[first..first + n];
            let drafts = match draft_logits {
                Some(d) => Drafts::Sampled {
                    tokens: drafted,
                    logits: &d[first * vocab..(first + n) * vocab],
                },
                None => Drafts::PointMass(drafted),
            };
            let outcome = reference::verify(rows, vocab, &drafts, &batch.params[s], seq.position);
            if let Ok(verified) = &outcome {
                stats.record(n, verified);
            }
            outcome
        })
        .collect()
}

/// The device address of `buffer`, which must be `backend`'s: the kernels' one argument
/// carries addresses, which the launch's own checks do not see.
fn address_on<T>(backend: &Backend, buffer: &DeviceVec<T>, what: &str) -> Result<u64> {
    match buffer.device_address() {
        Some(address) if buffer.backend_name() == backend.name() => Ok(address),
        _ => Err(backend.mismatch(what, buffer)),
    }
}

/// The arguments of every verify kernel: the one `VerifyArgs`, by value.
fn verify_arguments(args: &device::Args) -> [KernelArg<'_>; 1] {
    [KernelArg::by_value(args)]
}

/// The device path of [`verify`] (buffers checked against the batch by the caller): the
/// launches of [`Layout::launches`], each with the same [`device::Args`].
fn launch(
    backend: &Backend,
    layout: &Layout,
    batch: &Batch,
    b: &DeviceBuffers,
    target: &DeviceVec<f32>,
    tokens: &DeviceVec<u32>,
    draft: Option<&DeviceVec<f32>>,
) -> Result<()> {
    let rows = batch.row_count();
    if rows == 0 {
        return Ok(());
    }
    let rows32 = super::check_u32("verify rows", rows)?;
    super::check_grid_y("verify batch", rows32, "rows")?;
    let Some(device_target) = backend.target() else {
        return Err(backend.mismatch("verify launch", target));
    };
    let args = device::Args {
        target_logits: address_on(backend, target, "verify target logits")?,
        // without draft rows the kernels never read it; any valid address will do
        draft_logits: address_on(backend, draft.unwrap_or(target), "verify draft logits")?,
        draft_tokens: address_on(backend, tokens, "verify draft tokens")?,
        sequences: address_on(backend, &b.sequences, "verify sequences")?,
        rows: address_on(backend, &b.rows, "verify rows")?,
        bias_tokens: address_on(backend, &b.bias_tokens, "verify bias tokens")?,
        bias_values: address_on(backend, &b.bias_values, "verify bias values")?,
        block_hist: address_on(backend, &b.block_hist, "verify block histograms")?,
        block_summary: address_on(backend, &b.block_summary, "verify block summaries")?,
        row_grid: address_on(backend, &b.row_grid, "verify row grids")?,
        row_anchor: address_on(backend, &b.row_anchor, "verify row anchors")?,
        row_hist: address_on(backend, &b.row_hist, "verify row histograms")?,
        row_state: address_on(backend, &b.row_state, "verify row state")?,
        candidates: address_on(backend, &b.candidates, "verify candidates")?,
        residual_sums: address_on(backend, &b.residual_sums, "verify residual sums")?,
        counters: address_on(backend, &b.counters, "verify counters")?,
        emitted: address_on(backend, &b.emitted, "verify emitted tokens")?,
        status: address_on(backend, &b.status, "verify status")?,
        stats: address_on(backend, &b.stats, "verify statistics")?,
        vocab: layout.capacity.vocab as u32,
        sequence_count: batch.sequences.len() as u32,
        row_count: rows32,
        max_drafts: layout.capacity.max_drafts as u32,
        chunks_per_row: layout.chunks_per_row as u32,
        chunks_per_block: batch.chunks_per_block as u32,
        blocks_per_row: batch.blocks_per_row as u32,
        reserved: 0,
    };
    let threads = device_target.verify.threads_per_block;
    for (kernel, (x, y)) in layout.launches(batch) {
        let dims = LaunchDims {
            grid: (x, y, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            cluster: (1, 1, 1),
        };
        // SAFETY: `Args` is the kernels' one argument, laid out as verify.cu declares it; every
        // address points into a buffer of this backend sized by `layout` for this batch
        // (checked above and by the caller), and the buffers outlive the launch (frees wait
        // for the queued work).
        unsafe { backend.launch(FAMILY, kernel, &dims, &verify_arguments(&args)) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::launch_check;
    use crate::target;

    #[test]
    fn the_octaves_are_the_templates() {
        crate::kernels::table::assert_defines(
            super::FAMILY,
            |_| true,
            &[("VOCT", super::device::OCTAVES.to_string())],
        );
    }

    /// The one by-value argument of every verify kernel ([`verify_arguments`]) meets every
    /// target's compiled kernels: a `.b8[184]` parameter in the PTX of the NVIDIA targets, a
    /// 184-byte `by_value` argument in gfx1151's code object metadata.
    #[test]
    fn the_argument_list_meets_the_compiled_kernels_parameters() {
        let args = device::Args::default();
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            for kernel in [
                KERNEL_HISTOGRAM,
                KERNEL_SELECT,
                KERNEL_FINISH,
                KERNEL_RESIDUAL,
                KERNEL_GREEDY,
            ] {
                checks.check(&t.name, kernel, &verify_arguments(&args));
            }
        }
        checks.assert_all_match();
    }
}
