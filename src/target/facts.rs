//! The schema of `kernels/targets.toml`.
//!
//! This file is compiled twice: by `build.rs` (which renders the kernel templates with these
//! values and rejects an inconsistent table at build time) and by the crate (which reads the same
//! file for launch shapes). Keep it free of crate-internal imports.

use serde::{Deserialize, Serialize};

/// The whole of `kernels/targets.toml`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetTable {
    /// Every target the crate renders kernels for.
    pub target: Vec<TargetFacts>,
}

/// The GPU vendor, which decides the source dialect and the compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// CUDA C++, compiled with NVRTC (or nvcc).
    Nvidia,
    /// HIP, compiled with clang for amdgcn.
    Amd,
}

/// Facts and tuning parameters of one target.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetFacts {
    /// Target name (`sm_90a`, `sm_121a`, `gfx1151`).
    pub name: String,
    /// Source dialect and compiler family.
    pub vendor: Vendor,
    /// Human-readable chip name.
    pub chip: String,
    /// Architecture string handed to the compiler.
    pub compiler_arch: String,
    /// CUDA compute capability `[major, minor]` (NVIDIA only).
    #[serde(default)]
    pub compute_capability: Option<[u32; 2]>,
    /// Threads per warp / wavefront.
    pub warp_size: u32,
    /// Streaming multiprocessors / compute units.
    pub multiprocessors: u32,
    /// Shared memory (LDS) one block may use, bytes.
    pub max_shared_bytes_per_block: u32,
    /// Instruction classes the target can execute.
    pub instructions: Instructions,
    /// Launch parameters of the `dequant` family.
    pub dequant: DequantTiles,
    /// Launch parameters of the `gemm` family.
    pub gemm: GemmTiles,
    /// Launch parameters of the `norm` family.
    pub norm: NormTiles,
    /// Launch parameters of the `tokens` family.
    pub tokens: TokensTiles,
    /// Launch parameters of the `attention` family.
    pub attention: AttentionTiles,
    /// Launch parameters of the `gdn` family.
    pub gdn: GdnTiles,
    /// Launch parameters of the `verify` family.
    pub verify: VerifyTiles,
    /// Launch parameters of the `moe` family.
    pub moe: MoeTiles,
}

/// Which instruction classes exist on a target (templates branch on these, never on names).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Instructions {
    /// `mma.sync` with bf16 operands and fp32 accumulation.
    pub mma_sync_bf16: bool,
    /// Block-scaled FP4 `mma.sync ... kind::mxf4nvf4`.
    pub mma_block_scaled_fp4: bool,
    /// Hopper warpgroup MMA.
    pub wgmma: bool,
    /// `cp.async` global -> shared copies.
    pub cp_async: bool,
    /// Bulk copies completing on an mbarrier.
    pub bulk_copy_mbarrier: bool,
    /// RDNA WMMA with bf16 operands.
    pub wmma_bf16: bool,
    /// Programmatic dependent launch (`griddepcontrol`, sm_90 and later): a kernel's blocks may
    /// start while the previous kernel in the stream finishes, and wait for it in the kernel.
    pub grid_dependency_control: bool,
    /// Thread block clusters (sm_90 and later): the blocks of a cluster run at once and read
    /// each other's shared memory (`mapa`, `ld.shared::cluster`, `barrier.cluster`).
    pub clusters: bool,
}

impl Instructions {
    /// mma.sync fed from shared memory that cp.async fills: what the staged kernels (the stream
    /// GEMM, the GDN chunk kernels, `attention_decode_mma_g*`) are rendered for.
    pub fn staged_mma(&self) -> bool {
        self.mma_sync_bf16 && self.cp_async
    }

    /// Bulk copies besides the staged kernels: what the MoE's bulk kernels
    /// (`moe_nvfp4_{gate_up,down}_bulk`) are rendered for.
    pub fn bulk_streaming(&self) -> bool {
        self.staged_mma() && self.bulk_copy_mbarrier
    }
}

/// Launch parameters of `dequant_nvfp4_bf16`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DequantTiles {
    /// Threads per block; each thread expands one 16-element NVFP4 block.
    pub threads_per_block: u32,
}

/// Shared-memory bytes of one 64-wide K group in a `gemm_nvfp4_bf16_stream_*` ring: 32 lanes of
/// 16 bytes of weights and 2 of scales (`STREAM_STAGE_BYTES` in `kernels/templates/gemm.cu`).
pub const STREAM_GROUP_BYTES: u32 = 32 * (16 + 2);

/// The most tokens per sequence any target's Gated DeltaNet step may declare
/// (`gdn.step_max_tokens`): the step keeps each token's vectors in shared memory.
pub const GDN_STEP_MAX_TOKENS: u32 = 16;

/// Shared-memory bytes of one 64-wide K group of 64 rows of X in the wgmma kernels' B operand
/// layout (`WG_OPERAND_BYTES` in `kernels/templates/gemm.cu`).
pub const WGMMA_OPERAND_BYTES: u32 = 64 * 64 * 2;

/// Shared-memory bytes of one `gemm_*_wgmma_m64` block (NVFP4 weights where `nvfp4`, else
/// bf16): two slots of the B operand ([`WGMMA_OPERAND_BYTES`] each), `gemm.wgmma_x_slots`
/// staging slots of 64 rows of 144 bytes (`WG_STAGE_BYTES`), then each warp's ring of
/// `gemm.wgmma_stages_*` slots of one K group of its tile (`WgmmaSlot`: NVFP4
/// [`STREAM_GROUP_BYTES`], bf16 2 KiB).
pub fn wgmma_shared_bytes(tiles: &GemmTiles, nvfp4: bool) -> u32 {
    let (stages, slot_bytes) = if nvfp4 {
        (tiles.wgmma_stages_nvfp4, STREAM_GROUP_BYTES)
    } else {
        (tiles.wgmma_stages_bf16, 4 * 32 * 16)
    };
    let warps = tiles.wgmma_warpgroups_per_block.saturating_mul(4);
    (2 * WGMMA_OPERAND_BYTES)
        .saturating_add(tiles.wgmma_x_slots.saturating_mul(64 * 144))
        .saturating_add(warps.saturating_mul(stages).saturating_mul(slot_bytes))
}

/// Launch parameters of the `gemm` family: the plain `gemm_nvfp4_bf16_gemv`, the `mma.sync`
/// kernels (with X through shared memory from `mma_x_shared_min_rows`), the staged `stream`
/// kernels and the `wgmma` ones.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmTiles {
    /// Warps per block; each warp owns one output column.
    pub warps_per_block: u32,
    /// Rows of X a warp accumulates in registers per pass over K.
    pub rows_per_pass: u32,
    /// `gemm_*_mma_*`: warps per block (a power of two); each tile gets 1..=this many of them.
    pub mma_warps_per_block: u32,
    /// `gemm_nvfp4_*_mma_*`: 64-wide K groups of weights in flight per warp.
    pub mma_stages_nvfp4: u32,
    /// `gemm_bf16_*_mma_*`: 64-wide K groups of weights in flight per warp.
    pub mma_stages_bf16: u32,
    /// `gemm_*_mma_*`: K groups of each tile's split its block asks the L2 to fetch before it
    /// waits for the previous kernel (0: none; targets without bulk prefetch ignore it).
    pub mma_l2_prefetch_groups: u32,
    /// `gemm_*_mma_*`: split K across blocks until this many warps per multiprocessor have work.
    pub mma_min_warps_per_sm: u32,
    /// `gemm_*_mma_*`: the fewest K groups one split may get.
    pub mma_min_groups_per_split: u32,
    /// `gemm_*_mma_m*` loading X from global memory (the variants below
    /// `mma_x_shared_min_rows` rows) on targets with `clusters`: launches of 2 to this many K
    /// splits finish them in a cluster, as `mma_x_shared_cluster_max_splits` does for the X-ring
    /// variants (at most 8; 0 or 1: through the L2).
    pub mma_cluster_max_splits: u32,
    /// `gemm_*_mma_m*` loading X from global memory: where the plan keeps K whole, double the
    /// warps per tile (up to `mma_warps_per_block`) while the launch's blocks still fit in one
    /// wave of the blocks the device holds at once (the driver's occupancy), so each warp's
    /// chain over K is shorter. Backends without an occupancy query keep the plan.
    pub mma_wave_warps_per_tile: bool,
    /// `gemm_*_mma_m*` variants of at least this many rows stream X through shared memory on
    /// `cp.async` targets (17..=64: from the m32, m48 or m64 variant on).
    pub mma_x_shared_min_rows: u32,
    /// `gemm_*_mma_m*` streaming X: slots of the shared-memory ring X streams
    /// through (rounds of one K group per warp of a tile; at least 2).
    pub mma_x_shared_slots: u32,
    /// `gemm_*_mma_m*` streaming X: most warps per tile (a power of two; K is
    /// split across blocks instead, since a round holds X for each warp of a tile).
    pub mma_x_shared_max_warps_per_tile: u32,
    /// `gemm_*_mma_m*` streaming X: warps per block (1..=32; a multiple of
    /// `mma_x_shared_max_warps_per_tile`, so every tile's warps share one block).
    pub mma_x_shared_warps_per_block: u32,
    /// `gemm_*_mma_m*` streaming X: resident blocks per multiprocessor the
    /// launch bounds ask for.
    pub mma_x_shared_blocks_per_sm: u32,
    /// `gemm_*_mma_m*` streaming X on targets with `clusters`: launches of 2 to this many K
    /// splits (at most 8, the portable cluster size) make each tile group's splits one cluster,
    /// whose blocks add their sums through each other's shared memory; 0 or 1: the partials of
    /// every split go through the L2 to the tile's last block.
    pub mma_x_shared_cluster_max_splits: u32,
    /// `gemm_*_mma_m*` streaming X: the fewest K groups one split may get (their own bound: with
    /// at most `mma_x_shared_max_warps_per_tile` warps per tile, small weights fill the device
    /// only through K splits).
    pub mma_x_shared_min_groups_per_split: u32,
    /// `gemm_nvfp4_*_mma_m*` streaming X: K groups of weights in flight per warp.
    pub mma_x_shared_stages_nvfp4: u32,
    /// `gemm_bf16_*_mma_m*` streaming X: K groups of weights in flight per warp.
    pub mma_x_shared_stages_bf16: u32,
    /// `gemm_*_wgmma_m64` (targets with `wgmma` and `cp.async`): launches of at least this many
    /// rows (33..=64) run the warpgroup kernel in place of `gemm_*_mma_m48` / `_m64`; 65 or
    /// more: never.
    pub wgmma_min_rows: u32,
    /// `gemm_*_wgmma_m64`: launches of 33 rows or more whose weights have at least this many
    /// 16-row tiles run the warpgroup kernel too (0: none).
    pub wgmma_min_tiles: u32,
    /// `gemm_*_wgmma_m64`: warpgroups (of 4 warps, 64 weight rows each) per block (1..=8); they
    /// share the block's X ring.
    pub wgmma_warpgroups_per_block: u32,
    /// `gemm_*_wgmma_m64`: resident blocks per multiprocessor the launch bounds ask for, and the
    /// slots the K-split choice fills.
    pub wgmma_blocks_per_sm: u32,
    /// `gemm_*_wgmma_m64`: staging slots of X (one K group of 64 rows each, 9 KiB; at least 2),
    /// filled this many rounds ahead.
    pub wgmma_x_slots: u32,
    /// `gemm_*_wgmma_m64`: the fewest K groups one split may get.
    pub wgmma_min_groups_per_split: u32,
    /// `gemm_nvfp4_*_wgmma_m64`: slots of each warp's shared-memory weight ring (one K group
    /// each, 576 bytes), filled this many rounds ahead less one; at least `wgmma_x_slots`.
    pub wgmma_stages_nvfp4: u32,
    /// `gemm_bf16_*_wgmma_m64`: the same for bf16 weights (2 KiB a slot).
    pub wgmma_stages_bf16: u32,
    /// `gemm_nvfp4_bf16_stream_*` (targets with `cp.async`): warps per block (a power of two).
    pub stream_warps_per_block: u32,
    /// `gemm_nvfp4_bf16_stream_*`: stages in each warp's shared-memory ring (one computes while
    /// the others are in flight).
    pub stream_stages: u32,
    /// `gemm_nvfp4_bf16_stream_*`: consecutive 64-wide K groups per stage (1..=8).
    pub stream_chunk_groups: u32,
    /// `gemm_nvfp4_bf16_stream_*`: resident blocks per multiprocessor the launch bounds ask
    /// for (they cap the registers per thread).
    pub stream_blocks_per_sm: u32,
    /// `gemm_nvfp4_bf16_stream_*`: most bytes of X one block stages in shared memory; beyond,
    /// K is split across more blocks.
    pub stream_max_x_bytes: u32,
}

/// Launch parameters of `rms_norm_residual`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NormTiles {
    /// Threads per block; one block per row.
    pub threads_per_block: u32,
}

/// Launch parameters of the `tokens` family.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensTiles {
    /// Threads per block of `tokens_embed` (one block per row) and `tokens_argmax`.
    pub threads_per_block: u32,
    /// Logits one `tokens_argmax` block searches (a row takes `ceil(vocab / argmax_chunk)`
    /// blocks).
    pub argmax_chunk: u32,
}

/// Launch parameters of the `attention` family.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionTiles {
    /// `attention_prepare`: warps per block, one (row, head) each.
    pub prepare_warps_per_block: u32,
    /// `attention_decode`: KV positions per chunk (a split takes one or more chunks; a block per
    /// split, KV head and row).
    pub split_positions: u32,
    /// `attention_decode`: each row's chunks get their own split while the call's blocks (rows x
    /// KV heads x splits) stay within this many per multiprocessor; past that, the splits are
    /// cut to that many blocks' worth and each takes several chunks.
    pub decode_blocks_per_sm: u32,
    /// `attention_combine_gate`: warps per block, one block per (row, head) and part of its
    /// dimensions, the warps splitting its splits.
    pub combine_warps_per_block: u32,
    /// `attention_combine_gate`: a head's dimensions are cut over several blocks (multiples of
    /// 32) until the launch has this many blocks per multiprocessor (or each block 32).
    pub combine_blocks_per_sm: u32,
}

/// Launch parameters of the `gdn` family (Gated DeltaNet).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GdnTiles {
    /// `gdn_step`: threads per block.
    pub step_threads: u32,
    /// `gdn_step`: value columns (of one head's state) per block; each thread holds 4 of them.
    pub step_dv_per_block: u32,
    /// `gdn_step`: lanes of a warp side by side along the value columns (4 columns each); the
    /// warp's other lanes, and further warps when the block's columns run out, split the rows.
    /// The per-token sums over rows are warp shuffles, plus one block barrier per token only when
    /// more than one warp holds rows of the same columns.
    pub step_column_lanes: u32,
    /// `gdn_step`: most tokens per sequence in one step (and pending from the last one).
    pub step_max_tokens: u32,
    /// `gdn_step`: resident blocks per multiprocessor the kernel is compiled for (its launch
    /// bounds on NVIDIA, which cap its registers; unused on AMD).
    pub step_blocks_per_sm: u32,
    /// `gdn_chunk_state_*`: value columns per block (16 or 32; 16 when dv is not a multiple).
    pub chunk_dv_per_block: u32,
    /// `gdn_chunk_state_*`: chunks of operands staged ahead in shared memory (cp.async); 0 reads
    /// them from global memory (targets without `cp.async` / `ldmatrix`).
    pub chunk_stages: u32,
    /// `gdn_chunk_prepare_*`: resident blocks per multiprocessor it is compiled for (its launch
    /// bounds on NVIDIA, which cap its registers; unused on AMD).
    pub chunk_prepare_blocks_per_sm: u32,
    /// `gdn_chunk_state_*`: column slices (1 or 2) each warp's products take of a block's value
    /// columns; a block runs `256 * chunk_state_column_splits` threads.
    pub chunk_state_column_splits: u32,
}

/// Launch parameters of the `verify` family (`verify_*`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyTiles {
    /// Threads per block (a multiple of the warp size, at most 1024).
    pub threads_per_block: u32,
    /// Logits each thread holds per chunk; a chunk is `threads_per_block * items_per_thread`.
    pub items_per_thread: u32,
    /// Histogram buckets per octave of token weight (a power of two, 1..=64).
    pub sub_buckets_per_octave: u32,
    /// Tokens per row kept around the cuts for the exact finish (1..=1024: the finish holds
    /// three u64 per candidate in static shared memory).
    pub candidates_per_row: u32,
    /// Blocks per multiprocessor the launch aims its grid at.
    pub blocks_per_sm: u32,
    /// Resident blocks per multiprocessor of `verify_greedy`: its grid is one wave of them, and
    /// on NVIDIA its launch bounds ask for them.
    pub greedy_blocks_per_sm: u32,
    /// Resident blocks per multiprocessor of `verify_topk`: its grid is one wave of them, and on
    /// NVIDIA its launch bounds ask for them.
    pub top_k_blocks_per_sm: u32,
    /// Largest top-k (1..=`threads_per_block`) that `verify_topk` serves in one launch; a batch
    /// with a sequence above it (or top-k off) takes the histogram passes.
    pub top_k_max: u32,
    /// Candidate tokens a `verify_topk` block holds in shared memory (8 bytes each), at least
    /// `top_k_max + threads_per_block`: a full buffer is cut back to the block's top k.
    pub top_k_buffer: u32,
    /// Chunks past the one it reads (0..=4) that a `verify_topk` block streaming several asks
    /// the L2 cache for, so that their loads wait on the L2 rather than on DRAM (0: none; a
    /// target without an L2 prefetch instruction ignores it). The next chunk is loaded into
    /// registers as the current one's work starts, so 1 only repeats that load as a hint.
    pub top_k_prefetch_chunks: u32,
    /// Candidates (0..=`top_k_max`) up to which a `verify_topk` block ranks its buffer directly
    /// (every code counted against the others, no barrier) to take its top few, where more are
    /// first cut by radix rounds over their digits (0: always cut).
    pub top_k_rank_max: u32,
}

/// Launch parameters of the `moe` family: one persistent launch per MoE block
/// (`moe_{nvfp4,bf16}_m{rows}`), or three for small T (`moe_route_m{rows}`,
/// `moe_{nvfp4,bf16}_{gate_up,down}_m{rows}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeTiles {
    /// Warps per block (a power of two).
    pub warps_per_block: u32,
    /// Resident blocks per multiprocessor the grid is sized for (and the kernels' launch bounds).
    pub blocks_per_sm: u32,
    /// Warps splitting the K groups of one 16-row router tile (a power of two dividing
    /// `warps_per_block`; an item holds the rest as tiles).
    pub router_warps_per_tile: u32,
    /// As `router_warps_per_tile`, for the experts' gate_up tiles.
    pub gate_up_warps_per_tile: u32,
    /// As `router_warps_per_tile`, for the experts' down tiles.
    pub down_warps_per_tile: u32,
    /// NVFP4 expert weights: 64-wide K groups in flight per warp.
    pub stages_nvfp4: u32,
    /// bf16 expert weights: 64-wide K groups in flight per warp.
    pub stages_bf16: u32,
    /// Router weights (bf16): 64-wide K groups in flight per warp.
    pub router_stages: u32,
    /// Tokens per pass of the kernel variants (ascending multiples of 8); an expert with more
    /// tokens than its variant's pass takes several passes.
    pub token_rows: Vec<u32>,
    /// The most routed experts a block may have (the warp size times a power of two, at most 32:
    /// the routing's top-k keeps that many per lane in registers, and takes maxima over them as
    /// a tree).
    pub max_experts: u32,
    /// Resident blocks per SM the split launches' gate_up and down kernels are compiled for
    /// (their launch bounds: fewer registers per thread than the persistent kernel's).
    pub split_blocks_per_sm: u32,
    /// Launches of at most this many tokens use the `wide_*_warps_per_tile` (more warps per
    /// tile, each a shorter chain); 0 never.
    pub wide_max_tokens: u32,
    /// As `gate_up_warps_per_tile`, for launches of at most `wide_max_tokens` tokens.
    pub wide_gate_up_warps_per_tile: u32,
    /// As `down_warps_per_tile`, for launches of at most `wide_max_tokens` tokens.
    pub wide_down_warps_per_tile: u32,
    /// Blocks of at most this many tokens run as the three split launches (route, gate_up,
    /// down) instead of the persistent one; 0 never.
    pub split_max_tokens: u32,
    /// Planes of partial router logits: the router's K groups split this many ways (the split
    /// route launch gives each plane its own blocks), summed in plane order by the routing.
    pub router_planes: u32,
    /// Blocks of at least this many tokens (and at most `split_max_tokens`) run in the streaming
    /// form (the split route and gate_up launches, then `moe_{format}_down_stream` and
    /// `moe_stream_combine`); 0 never. Only on targets with mma.sync and cp.async, which render
    /// those kernels.
    pub stream_min_tokens: u32,
    /// Bytes of the next layer's first dense weight the route launch asks the L2 for, while the
    /// MoE block's latency chains leave DRAM idle; rounded down to 16, at most the weight; 0:
    /// none.
    pub prefetch_next_layer_bytes: u32,
    /// Blocks of at most this many tokens prefetch (`prefetch_next_layer_bytes`); larger blocks
    /// keep the bandwidth for their own experts.
    pub prefetch_next_layer_max_tokens: u32,
    /// The split gate_up and down launches load the tokens' rows through L1 (where the block's
    /// other tiles of the same expert find them) instead of from the L2 for every tile; only
    /// rows an earlier launch wrote, read after the block's wait for it.
    pub split_x_through_l1: bool,
    /// Blocks of at least this many tokens (and at most `split_max_tokens`) run in the bulk form
    /// ([`crate::kernels::moe::MoeLaunch::Bulk`]: the split route launch, then
    /// `moe_nvfp4_gate_up_bulk`, `moe_nvfp4_down_bulk` and `moe_stream_combine`, whose NVFP4
    /// weights arrive by bulk copies); 0 never. Targets with bulk copies and the streaming
    /// kernels render the bulk kernels whatever this says, so the bench and tests can run them.
    pub bulk_min_tokens: u32,
    /// Slots of each warp's shared-memory weight ring in `moe_nvfp4_gate_up_bulk`.
    pub bulk_gate_up_slots: u32,
    /// Slots of each warp's shared-memory weight ring in `moe_nvfp4_down_bulk`.
    pub bulk_down_slots: u32,
    /// K groups (64 columns of one 16-row tile, 576 bytes in NVFP4) per slot of that ring.
    pub bulk_slot_groups: u32,
    /// K groups each lane's X fragments (32 bytes per group) are loaded ahead of the bulk
    /// kernels' MMAs, in registers; divides `bulk_slot_groups`.
    pub bulk_x_groups_ahead: u32,
    /// Resident blocks per SM the bulk kernels are compiled for, and their grids.
    pub bulk_blocks_per_sm: u32,
}

impl TargetTable {
    /// Parses the table and checks that every target's parameters fit the target.
    pub fn parse(text: &str) -> Result<Self, String> {
        let table: TargetTable =
            toml::from_str(text).map_err(|e| format!("kernels/targets.toml: {e}"))?;
        let mut seen = std::collections::BTreeSet::new();
        for t in &table.target {
            if !seen.insert(t.name.clone()) {
                return Err(format!(
                    "kernels/targets.toml: target `{}` appears twice",
                    t.name
                ));
            }
            t.validate()?;
        }
        Ok(table)
    }
}

/// The product of targets.toml values in 64 bits, saturating: a thread count or a byte size
/// compared with its limit, never wrapped (or a debug-build panic) on an absurd entry.
fn product(factors: &[u32]) -> u64 {
    factors
        .iter()
        .fold(1u64, |p, &f| p.saturating_mul(u64::from(f)))
}

impl TargetFacts {
    fn validate(&self) -> Result<(), String> {
        let name = &self.name;
        let fail = |what: String| Err(format!("kernels/targets.toml: target `{name}`: {what}"));
        if self.vendor == Vendor::Nvidia && self.compute_capability.is_none() {
            return fail("an nvidia target needs compute_capability".into());
        }
        if self.vendor == Vendor::Amd && self.compute_capability.is_some() {
            return fail("compute_capability is a CUDA notion; an amd target has none".into());
        }
        if !matches!(self.warp_size, 32 | 64) {
            return fail(format!("warp_size {} is neither 32 nor 64", self.warp_size));
        }
        let threads = self.dequant.threads_per_block;
        if threads == 0 || threads > 1024 || threads % self.warp_size != 0 {
            return fail(format!(
                "dequant.threads_per_block {threads} must be a multiple of warp_size {} in 1..=1024",
                self.warp_size
            ));
        }
        let gemm_threads = product(&[self.gemm.warps_per_block, self.warp_size]);
        if self.gemm.warps_per_block == 0 || gemm_threads > 1024 {
            return fail(format!(
                "gemm.warps_per_block {} gives {gemm_threads} threads (1..=1024)",
                self.gemm.warps_per_block
            ));
        }
        let mma_threads = product(&[self.gemm.mma_warps_per_block, self.warp_size]);
        if self.gemm.mma_warps_per_block == 0 || mma_threads > 1024 {
            return fail(format!(
                "gemm.mma_warps_per_block {} gives {mma_threads} threads (1..=1024)",
                self.gemm.mma_warps_per_block
            ));
        }
        if !(1..=8).contains(&self.gemm.mma_stages_nvfp4)
            || !(1..=8).contains(&self.gemm.mma_stages_bf16)
            || !(1..=8).contains(&self.gemm.mma_x_shared_stages_nvfp4)
            || !(1..=8).contains(&self.gemm.mma_x_shared_stages_bf16)
        {
            return fail("gemm.mma_stages_* must be in 1..=8 (registers per stage)".into());
        }
        if !matches!(self.gemm.mma_warps_per_block, 1 | 2 | 4 | 8 | 16) {
            return fail(format!(
                "gemm.mma_warps_per_block {} must be a power of two (tiles share blocks)",
                self.gemm.mma_warps_per_block
            ));
        }
        let x_ring = product(&[
            self.gemm.mma_x_shared_slots,
            self.gemm.mma_x_shared_max_warps_per_tile,
            64 * (64 + 8) * 2,
        ]);
        if self.gemm.mma_x_shared_blocks_per_sm == 0
            || !(17..=64).contains(&self.gemm.mma_x_shared_min_rows)
            || self.gemm.mma_x_shared_slots < 2
            || !self.gemm.mma_x_shared_max_warps_per_tile.is_power_of_two()
            || !(1..=32).contains(&self.gemm.mma_x_shared_warps_per_block)
            || product(&[self.gemm.mma_x_shared_warps_per_block, self.warp_size]) > 1024
            || self.gemm.mma_x_shared_warps_per_block % self.gemm.mma_x_shared_max_warps_per_tile
                != 0
            || x_ring > u64::from(self.max_shared_bytes_per_block)
        {
            return fail(format!(
                "gemm.mma_x_shared_*: blocks_per_sm positive, min_rows in 17..=64, at least 2 slots, \
                 max_warps_per_tile a power of two dividing warps_per_block (at most 1024 \
                 threads), and the ring at 64 rows ({x_ring} bytes) within \
                 max_shared_bytes_per_block"
            ));
        }
        if self.gemm.mma_x_shared_cluster_max_splits > 8 || self.gemm.mma_cluster_max_splits > 8 {
            return fail(format!(
                "gemm.mma_x_shared_cluster_max_splits {} and gemm.mma_cluster_max_splits {} must \
                 be at most 8 (the portable cluster size)",
                self.gemm.mma_x_shared_cluster_max_splits, self.gemm.mma_cluster_max_splits
            ));
        }
        if self.gemm.mma_min_warps_per_sm == 0
            || self.gemm.mma_min_groups_per_split == 0
            || self.gemm.mma_x_shared_min_groups_per_split == 0
        {
            return fail(
                "gemm.mma_min_warps_per_sm, gemm.mma_min_groups_per_split and \
                 gemm.mma_x_shared_min_groups_per_split must be positive"
                    .into(),
            );
        }
        let wg = &self.gemm;
        let wg_ring = wgmma_shared_bytes(wg, true).max(wgmma_shared_bytes(wg, false));
        if !(1..=8).contains(&wg.wgmma_warpgroups_per_block)
            || product(&[wg.wgmma_warpgroups_per_block, 4, self.warp_size]) > 1024
            || wg.wgmma_blocks_per_sm == 0
            || wg.wgmma_x_slots < 2
            || wg.wgmma_min_groups_per_split == 0
            || wg.wgmma_stages_nvfp4 < wg.wgmma_x_slots
            || wg.wgmma_stages_bf16 < wg.wgmma_x_slots
            || wg.wgmma_min_rows < 33
            || (self.instructions.wgmma && wg_ring > self.max_shared_bytes_per_block)
        {
            return fail(format!(
                "gemm.wgmma_*: warpgroups_per_block in 1..=8 (at most 1024 threads), \
                 blocks_per_sm and min_groups_per_split positive, min_rows at least 33, \
                 at least 2 x slots, stages of each format at least x_slots, and on wgmma \
                 targets the shared memory ({wg_ring} bytes) within max_shared_bytes_per_block"
            ));
        }
        let stream = &self.gemm;
        if !matches!(stream.stream_warps_per_block, 1 | 2 | 4 | 8 | 16)
            || product(&[stream.stream_warps_per_block, self.warp_size]) > 1024
        {
            return fail(format!(
                "gemm.stream_warps_per_block {} must be a power of two of at most 1024 threads",
                stream.stream_warps_per_block
            ));
        }
        if stream.stream_stages < 2
            || !(1..=8).contains(&stream.stream_chunk_groups)
            || stream.stream_blocks_per_sm == 0
        {
            return fail(
                "gemm.stream_stages must be at least 2, stream_chunk_groups in 1..=8 and \
                 stream_blocks_per_sm positive"
                    .into(),
            );
        }
        if self.instructions.cp_async {
            // the rings plus the most X a block stages must fit in a block, and X at least one
            // row of one K group
            let rings = product(&[
                stream.stream_warps_per_block,
                stream.stream_stages,
                stream.stream_chunk_groups,
                STREAM_GROUP_BYTES,
            ]);
            if rings + u64::from(stream.stream_max_x_bytes)
                > u64::from(self.max_shared_bytes_per_block)
                || stream.stream_max_x_bytes < 128 + 16
            {
                return fail(format!(
                    "gemm.stream_*: {rings} bytes of rings and stream_max_x_bytes {} (at least \
                     144) exceed max_shared_bytes_per_block {}",
                    stream.stream_max_x_bytes, self.max_shared_bytes_per_block
                ));
            }
        }
        let norm = self.norm.threads_per_block;
        if norm == 0 || norm > 1024 || norm % self.warp_size != 0 {
            return fail(format!(
                "norm.threads_per_block {norm} must be a multiple of warp_size {} in 1..=1024",
                self.warp_size
            ));
        }
        let tokens = &self.tokens;
        if tokens.threads_per_block == 0
            || tokens.threads_per_block > 1024
            || tokens.threads_per_block % self.warp_size != 0
            || tokens.argmax_chunk == 0
        {
            return fail(format!(
                "tokens.threads_per_block {} must be a multiple of warp_size {} in 1..=1024 and \
                 tokens.argmax_chunk {} positive",
                tokens.threads_per_block, self.warp_size, tokens.argmax_chunk
            ));
        }
        let a = &self.attention;
        for (field, warps) in [
            ("prepare_warps_per_block", a.prepare_warps_per_block),
            ("combine_warps_per_block", a.combine_warps_per_block),
        ] {
            if warps == 0 || product(&[warps, self.warp_size]) > 1024 {
                return fail(format!(
                    "attention.{field} {warps}: 1..=1024 threads per block"
                ));
            }
        }
        if a.split_positions == 0 {
            return fail("attention.split_positions must be positive".into());
        }
        if a.combine_blocks_per_sm == 0 {
            return fail("attention.combine_blocks_per_sm must be positive".into());
        }
        // attention_decode_mma: 16-position tiles over 8 warps, 32 positions per softmax lane pass
        if self.instructions.staged_mma() && !matches!(a.split_positions, 32 | 64 | 128) {
            return fail(format!(
                "attention.split_positions {}: 32, 64 or 128 on a target with mma.sync and \
                 cp.async (attention_decode_mma's tiles)",
                a.split_positions
            ));
        }
        let gdn = &self.gdn;
        let lanes = gdn.step_dv_per_block / 4;
        if !matches!(gdn.step_dv_per_block, 4 | 8 | 16 | 32 | 64 | 128)
            || lanes > self.warp_size
            || gdn.step_threads % self.warp_size != 0
            || gdn.step_threads > 1024
            || gdn.step_threads / lanes.max(1) == 0
            || 128 % (gdn.step_threads / lanes.max(1)) != 0
        {
            return fail(format!(
                "gdn.step_threads {} and gdn.step_dv_per_block {}: the block must be whole warps \
                 and its row groups (threads / (dv_per_block / 4)) must divide 128",
                gdn.step_threads, gdn.step_dv_per_block
            ));
        }
        let column_lanes = gdn.step_column_lanes;
        if !column_lanes.is_power_of_two()
            || column_lanes > self.warp_size
            || column_lanes > lanes
            || lanes % column_lanes != 0
            || (gdn.step_threads / self.warp_size) % (lanes / column_lanes) != 0
        {
            return fail(format!(
                "gdn.step_column_lanes {column_lanes}: a power of two dividing the warp ({}) and the \
                 block's column quads ({lanes}), and the block's warps ({}) a multiple of the warps \
                 across its columns",
                self.warp_size,
                gdn.step_threads / self.warp_size
            ));
        }
        if gdn.step_blocks_per_sm == 0 {
            return fail("gdn.step_blocks_per_sm must be positive".into());
        }
        if !(1..=GDN_STEP_MAX_TOKENS).contains(&gdn.step_max_tokens) {
            return fail(format!(
                "gdn.step_max_tokens must be in 1..={GDN_STEP_MAX_TOKENS} (shared memory per token)"
            ));
        }
        if !matches!(gdn.chunk_dv_per_block, 16 | 32) {
            return fail("gdn.chunk_dv_per_block must be 16 or 32".into());
        }
        if gdn.chunk_prepare_blocks_per_sm == 0 {
            return fail("gdn.chunk_prepare_blocks_per_sm must be positive".into());
        }
        if !matches!(gdn.chunk_state_column_splits, 1 | 2) {
            return fail("gdn.chunk_state_column_splits must be 1 or 2".into());
        }
        let staged = self.instructions.staged_mma();
        if (staged && !(1..=3).contains(&gdn.chunk_stages)) || (!staged && gdn.chunk_stages != 0) {
            return fail(format!(
                "gdn.chunk_stages {}: 1..=3 where mma.sync and cp.async exist (ldmatrix reads \
                 shared memory), 0 elsewhere",
                gdn.chunk_stages
            ));
        }
        let verify = &self.verify;
        if verify.threads_per_block == 0
            || verify.threads_per_block > 1024
            || verify.threads_per_block % self.warp_size != 0
        {
            return fail(format!(
                "verify.threads_per_block {} must be a multiple of warp_size {} in 1..=1024",
                verify.threads_per_block, self.warp_size
            ));
        }
        if !(1..=32).contains(&verify.items_per_thread) {
            return fail(format!(
                "verify.items_per_thread {} outside 1..=32 (registers)",
                verify.items_per_thread
            ));
        }
        if !verify.sub_buckets_per_octave.is_power_of_two() || verify.sub_buckets_per_octave > 64 {
            return fail(format!(
                "verify.sub_buckets_per_octave {} must be a power of two up to 64",
                verify.sub_buckets_per_octave
            ));
        }
        if !(1..=1024).contains(&verify.candidates_per_row)
            || verify.blocks_per_sm == 0
            || verify.greedy_blocks_per_sm == 0
        {
            return fail(
                "verify.candidates_per_row must be in 1..=1024, verify.blocks_per_sm and \
                 verify.greedy_blocks_per_sm positive"
                    .into(),
            );
        }
        if verify.top_k_blocks_per_sm == 0
            || !(1..=verify.threads_per_block).contains(&verify.top_k_max)
            || u64::from(verify.top_k_buffer)
                < u64::from(verify.top_k_max) + u64::from(verify.threads_per_block)
            || verify.top_k_buffer > 4096
            || verify.top_k_prefetch_chunks > 4
            || verify.top_k_rank_max > verify.top_k_max
        {
            return fail(format!(
                "verify.top_k_blocks_per_sm {} must be positive, verify.top_k_max {} in \
                 1..=threads_per_block, verify.top_k_buffer {} in \
                 top_k_max + threads_per_block..=4096 (shared memory), \
                 verify.top_k_prefetch_chunks {} in 0..=4 and verify.top_k_rank_max {} in \
                 0..=top_k_max",
                verify.top_k_blocks_per_sm,
                verify.top_k_max,
                verify.top_k_buffer,
                verify.top_k_prefetch_chunks,
                verify.top_k_rank_max
            ));
        }
        self.validate_moe()?;
        if !(1..=16).contains(&self.gemm.rows_per_pass) {
            return fail(format!(
                "gemm.rows_per_pass {} outside 1..=16 (register accumulators)",
                self.gemm.rows_per_pass
            ));
        }
        Ok(())
    }

    fn validate_moe(&self) -> Result<(), String> {
        let fail = |what: String| {
            Err(format!(
                "kernels/targets.toml: target `{}`: moe.{what}",
                self.name
            ))
        };
        let m = &self.moe;
        if !m.warps_per_block.is_power_of_two()
            || product(&[m.warps_per_block, self.warp_size]) > 1024
        {
            return fail(format!(
                "warps_per_block {} must be a power of two with at most 1024 threads",
                m.warps_per_block
            ));
        }
        if m.blocks_per_sm == 0 || m.split_blocks_per_sm == 0 {
            return fail("blocks_per_sm and split_blocks_per_sm must be positive".into());
        }
        for (name, warps) in [
            ("router_warps_per_tile", m.router_warps_per_tile),
            ("gate_up_warps_per_tile", m.gate_up_warps_per_tile),
            ("down_warps_per_tile", m.down_warps_per_tile),
            ("wide_gate_up_warps_per_tile", m.wide_gate_up_warps_per_tile),
            ("wide_down_warps_per_tile", m.wide_down_warps_per_tile),
        ] {
            if !warps.is_power_of_two() || warps > m.warps_per_block {
                return fail(format!(
                    "{name} {warps} must be a power of two dividing warps_per_block {}",
                    m.warps_per_block
                ));
            }
        }
        for (name, stages) in [
            ("stages_nvfp4", m.stages_nvfp4),
            ("stages_bf16", m.stages_bf16),
            ("router_stages", m.router_stages),
        ] {
            if !(1..=8).contains(&stages) {
                return fail(format!(
                    "{name} {stages} outside 1..=8 (registers per stage)"
                ));
            }
        }
        if !(1..=16).contains(&m.router_planes) {
            return fail(format!(
                "router_planes {} outside 1..=16 (each plane is a pass over [T][E + 1] logits)",
                m.router_planes
            ));
        }
        if m.token_rows.is_empty()
            || m.token_rows.windows(2).any(|w| w[0] >= w[1])
            || m.token_rows
                .iter()
                .any(|r| *r == 0 || r % 8 != 0 || *r > 64)
        {
            return fail(format!(
                "token_rows {:?} must be ascending multiples of 8 in 8..=64",
                m.token_rows
            ));
        }
        if m.stream_min_tokens > 0 && !self.instructions.staged_mma() {
            return fail(format!(
                "stream_min_tokens {}: the streaming launches need mma.sync and cp.async (0 turns them off)",
                m.stream_min_tokens
            ));
        }
        let slots = m.bulk_gate_up_slots.max(m.bulk_down_slots);
        let ring = product(&[m.warps_per_block, slots, m.bulk_slot_groups, 576]);
        if self.instructions.bulk_streaming()
            && (m.bulk_gate_up_slots == 0
                || m.bulk_down_slots == 0
                || !(1..=16).contains(&m.bulk_slot_groups)
                || m.bulk_slot_groups % m.gate_up_warps_per_tile != 0
                || m.bulk_x_groups_ahead == 0
                || m.bulk_slot_groups % m.bulk_x_groups_ahead != 0
                || ring > 40 * 1024
                || m.bulk_blocks_per_sm == 0)
        {
            // the ring is static shared memory, under 48 KB beside the stream's chunk table; a
            // slot's groups go to the gate_up accumulators as the split items' warps take them
            return fail(format!(
                "bulk_gate_up_slots {} and bulk_down_slots {} must be positive, bulk_slot_groups \
                 {} in 1..=16 and a multiple of gate_up_warps_per_tile {} and of \
                 bulk_x_groups_ahead {} (positive), warps x slots x groups x 576 bytes ({ring}) \
                 at most 40 KB, bulk_blocks_per_sm positive",
                m.bulk_gate_up_slots,
                m.bulk_down_slots,
                m.bulk_slot_groups,
                m.gate_up_warps_per_tile,
                m.bulk_x_groups_ahead
            ));
        }
        if m.bulk_min_tokens > 0 && !self.instructions.bulk_streaming() {
            return fail(format!(
                "bulk_min_tokens {}: the bulk kernels need bulk copies, mma.sync and cp.async (0 turns them off)",
                m.bulk_min_tokens
            ));
        }
        if m.max_experts == 0
            || m.max_experts % self.warp_size != 0
            || !(m.max_experts / self.warp_size).is_power_of_two()
            || u64::from(m.max_experts) > product(&[32, self.warp_size])
        {
            return fail(format!(
                "max_experts {} must be warp_size {} times a power of two, at most 32",
                m.max_experts, self.warp_size
            ));
        }
        Ok(())
    }
}
