//! The `gemm` tensor-core kernels run on the CPU: the source rendered for each mma.sync target is
//! compiled for the host with tests/gemm_emulator.cpp (and the GDN and MoE emulators' layers it
//! names) in place of its vendor layers, and `gemm_nvfp4_bf16_stream_m*` runs with the arguments
//! src/kernels/gemm/mod.rs passes, on partitions that take every path: one and eight warps per
//! tile, K split across blocks, chunks cut short at the end of a split, X rows and columns past
//! M and K. It must match the CPU reference and, where the register kernel
//! (`gemm_nvfp4_bf16_mma_m*`) runs the same partition, that kernel bit for bit. One OS thread per
//! GPU thread, blocks one after another, cp.async copies at once: no timing, no races between
//! blocks.
//!
//! Needs a C++20 compiler (`$CXX`, else clang++-19, clang++, g++ or c++).

use fp4spec::formats::nvfp4::Nvfp4Matrix;
use fp4spec::kernels::compare;
use fp4spec::kernels::gemm::layout::{Bf16Fragments, Nvfp4Fragments, TileGrid};
use fp4spec::kernels::gemm::{self, MmaPlan, RowOrder};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target::{self, TargetFacts};
use half::bf16;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const EMULATOR: &str = include_str!("gemm_emulator.cpp");
const GDN_EMULATOR: &str = include_str!("gdn_emulator.cpp");
const MOE_EMULATOR: &str = include_str!("moe_emulator.cpp");

#[path = "emulation/driver.rs"]
mod driver;
mod emulation;
use driver::{Arg, Buf, Emu, driver_for};
use emulation::{build_host, section, splice, splice_if_present};

/// The host binary of `target`'s rendered gemm source (built once per test process).
fn emulator(target: &TargetFacts) -> PathBuf {
    build_host(
        "gemm",
        &target.name,
        &["clang++-19", "clang++", "g++", "c++"],
        || emulator_source(target),
    )
}

/// `target`'s gemm source with the emulator's layers and driver.
fn emulator_source(target: &TargetFacts) -> String {
    let rendered = table::rendered(&target.name, "gemm").expect("gemm rendered");
    let mut source = splice(
        rendered.source,
        "// ---- fp4spec portability layer",
        "// ---- end of portability layer ----",
        &format!(
            "{}{}",
            section(GDN_EMULATOR, "portability"),
            section(EMULATOR, "cuda")
        ),
    );
    source = splice(
        &source,
        "// ---- inline PTX of the mma building blocks ----",
        "// ---- end of inline PTX of the mma building blocks ----",
        &format!(
            "{}{}",
            section(GDN_EMULATOR, "mma"),
            section(MOE_EMULATOR, "mma_adapters")
        ),
    );
    source = splice(
        &source,
        "// ---- cp.async instructions ----",
        "// ---- end of cp.async instructions ----",
        section(EMULATOR, "cp_async"),
    );
    source = splice_if_present(
        &source,
        "// ---- cluster instructions ----",
        "// ---- end of cluster instructions ----",
        section(EMULATOR, "cluster"),
    );
    source = splice_if_present(
        &source,
        "// ---- wgmma instructions ----",
        "// ---- end of wgmma instructions ----",
        section(EMULATOR, "wgmma"),
    );
    source = source.replace(
        "extern __shared__ __align__(128) u8 wgmma_shared[];",
        "u8* wgmma_shared = emu::dynamic_smem;",
    );
    let shared = "extern __shared__ __align__(16) u8 stream_shared[];";
    assert!(
        source.contains(shared),
        "the stream kernel's dynamic shared memory"
    );
    source = source.replace(shared, "u8* stream_shared = emu::dynamic_smem;");
    let mma_shared = "extern __shared__ __align__(16) u8 mma_shared[];";
    assert!(
        source.contains(mma_shared),
        "the mma kernels' dynamic shared memory (staged X)"
    );
    source = source.replace(mma_shared, "u8* mma_shared = emu::dynamic_smem;");
    source.push_str(&driver_for(
        section(GDN_EMULATOR, "driver"),
        rendered.kernels,
    ));
    let set_block = "emu::self = {t, bx, by};";
    assert!(
        source.contains(set_block),
        "the driver sets the block index"
    );
    source.replace(set_block, "emu::self = {t, bx, by}; emu::grid = {gx, gy};")
}

/// The targets the emulator runs: sm_121a renders the same kernels (only the tuning numbers
/// differ) beside W4A4 code whose FP4 conversions the host cannot compile, so the mma.sync
/// targets without it stand for it. Those of them that also have `feature`, described by `what`.
///
/// # Panics
/// When there are none: a test over them would check nothing.
fn emulated_targets(
    what: &str,
    feature: impl Fn(&TargetFacts) -> bool,
) -> Vec<&'static TargetFacts> {
    let targets: Vec<_> = target::all()
        .iter()
        .filter(|t| t.instructions.staged_mma() && !t.instructions.mma_block_scaled_fp4)
        .filter(|t| feature(t))
        .collect();
    assert!(!targets.is_empty(), "no emulated target {what}");
    targets
}

/// A partition: `warps_per_tile` warps per tile, `splits` K ranges of `groups_per_split` groups.
fn plan(warps_per_tile: u32, splits: u32, groups_per_split: u32) -> MmaPlan {
    MmaPlan {
        warps_per_tile,
        splits,
        groups_per_split,
    }
}

/// One product on one partition: the stream kernel (up to 16 rows) and the register kernel
/// launched as src/kernels/gemm/mod.rs launches them (parameters of `mma_nvfp4_arguments`).
struct Case {
    n: usize,
    k: usize,
    m: usize,
    plan: MmaPlan,
}

/// How a split-K launch adds its splits: through the L2 (the tile's last block), or in clusters
/// of the splits (the mma kernels on targets with clusters, `gemm::cluster_candidates`).
#[derive(Clone, Copy, PartialEq)]
enum Finish {
    L2,
    Cluster,
}

impl Finish {
    fn name(self) -> &'static str {
        match self {
            Finish::L2 => "l2",
            Finish::Cluster => "cluster",
        }
    }
}

/// Dynamic shared memory of `kernel` on `case`, as src/kernels/gemm/mod.rs sizes it.
fn shared_bytes(target: &TargetFacts, kernel: &str, case: &Case, finish: Finish) -> usize {
    let in_cluster = finish == Finish::Cluster;
    if kernel.contains("stream") {
        gemm::stream_shared_bytes(&target.gemm, case.m, case.plan.groups_per_split)
    } else if gemm::mma_x_shared(target, case.m) {
        gemm::x_shared_bytes(&target.gemm, case.m, &case.plan, in_cluster)
    } else {
        gemm::mma_shared_bytes(&target.gemm, case.m, in_cluster)
    }
}

/// The blocks per cluster along grid y of a launch of `kernel` on `case` with `finish` (the
/// stream kernel finishes through the L2 only).
fn cluster_y(kernel: &str, case: &Case, finish: Finish) -> u32 {
    match finish {
        Finish::Cluster if !kernel.contains("stream") => case.plan.splits,
        _ => 1,
    }
}

/// Runs `case` on the stream kernel (at most 16 rows) and the register kernel; returns their
/// outputs in that order.
fn run_case(
    exe: &Path,
    target: &TargetFacts,
    case: &Case,
    finish: Finish,
    q: &Nvfp4Matrix,
    x: &[bf16],
) -> Vec<Vec<bf16>> {
    let fragments = Nvfp4Fragments::new(q, RowOrder::Plain).expect("layout");
    let grid = fragments.grid;
    let tiles = &target.gemm;
    let mut emu = Emu::default();
    let words = emu.buffer(
        fragments
            .words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect(),
    );
    let scales = emu.buffer(
        fragments
            .scales
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect(),
    );
    let x_buf = emu.buffer(x.iter().flat_map(|v| v.to_le_bytes()).collect());
    let m_tiles = gemm::row_tiles(case.m);
    let mut outputs = Vec::new();
    let stream = (
        format!("gemm_nvfp4_bf16_stream_m{}", 8 * m_tiles),
        tiles.stream_warps_per_block,
    );
    let register = (
        format!("gemm_nvfp4_bf16_mma_m{}", 8 * m_tiles),
        gemm::mma_block_warps(target, case.m),
    );
    let kernels = if case.m <= gemm::STREAM_MAX_ROWS {
        vec![stream, register]
    } else {
        vec![register]
    };
    for (kernel, warps) in kernels {
        let y = emu.buffer(vec![0xff; 2 * case.m * case.n]);
        let partials = emu.zeros(grid.n_tiles * case.plan.splits as usize * 32 * m_tiles * 16);
        let counters = emu.zeros(4 * grid.n_tiles);
        let shared = shared_bytes(target, &kernel, case, finish);
        let blocks = (grid.n_tiles as u32).div_ceil(warps / case.plan.warps_per_tile);
        emu.launch_clusters(
            &kernel,
            (blocks, case.plan.splits),
            cluster_y(&kernel, case, finish),
            warps * target.warp_size,
            shared,
            &[
                &[
                    Arg::Ptr(x_buf),
                    Arg::Ptr(words),
                    Arg::Ptr(scales),
                    Arg::F32(q.global_scale * 128.0),
                    Arg::Ptr(y),
                    Arg::Null,
                ][..],
                &split_and_shape_args(partials, counters, case, grid),
            ]
            .concat(),
        );
        emu.dump(y);
        outputs.push(y);
    }
    let dumps = emu.run(
        exe,
        &format!("case_{}x{}_m{}_{}", case.n, case.k, case.m, finish.name()),
    );
    outputs.into_iter().map(|y| read_bf16(&dumps, y)).collect()
}

/// The mma kernels' arguments from `partials` on (`SplitArgs`, then `TileShape` with the rows,
/// no epilogue), for `case` on `grid`.
fn split_and_shape_args(partials: Buf, counters: Buf, case: &Case, grid: TileGrid) -> [Arg; 10] {
    [
        Arg::Ptr(partials),
        Arg::Ptr(counters),
        Arg::U32(case.m as u32),
        Arg::U32(case.n as u32),
        Arg::U32(case.k as u32),
        Arg::U32(grid.n_tiles as u32),
        Arg::U32(grid.k_groups as u32),
        Arg::U32(case.plan.groups_per_split),
        Arg::U32(case.plan.warps_per_tile),
        Arg::U32(0),
    ]
}

/// A dumped bf16 buffer.
fn read_bf16(dumps: &HashMap<u32, Vec<u8>>, buffer: Buf) -> Vec<bf16> {
    dumps[&buffer.0]
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// Runs `case` on `gemm_bf16_bf16_mma_m*` (parameters of `mma_bf16_arguments`) with the bf16
/// weight `w` (`[n, k]` row-major); returns its output.
fn run_bf16_case(
    exe: &Path,
    target: &TargetFacts,
    case: &Case,
    finish: Finish,
    w: &[bf16],
    x: &[bf16],
) -> Vec<bf16> {
    let fragments = Bf16Fragments::new(w, case.n, case.k, RowOrder::Plain).expect("layout");
    let grid = fragments.grid;
    let warps = gemm::mma_block_warps(target, case.m);
    let m_tiles = gemm::row_tiles(case.m);
    let kernel = format!("gemm_bf16_bf16_mma_m{}", 8 * m_tiles);
    let mut emu = Emu::default();
    let words = emu.buffer(
        fragments
            .words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect(),
    );
    let x_buf = emu.buffer(x.iter().flat_map(|v| v.to_le_bytes()).collect());
    let y = emu.buffer(vec![0xff; 2 * case.m * case.n]);
    let partials = emu.zeros(grid.n_tiles * case.plan.splits as usize * 32 * m_tiles * 16);
    let counters = emu.zeros(4 * grid.n_tiles);
    let blocks = (grid.n_tiles as u32).div_ceil(warps / case.plan.warps_per_tile);
    emu.launch_clusters(
        &kernel,
        (blocks, case.plan.splits),
        cluster_y(&kernel, case, finish),
        warps * target.warp_size,
        shared_bytes(target, &kernel, case, finish),
        &[
            &[
                Arg::Ptr(x_buf),
                Arg::Ptr(words),
                Arg::F32(1.0),
                Arg::Ptr(y),
                Arg::Null,
            ][..],
            &split_and_shape_args(partials, counters, case, grid),
        ]
        .concat(),
    );
    emu.dump(y);
    let dumps = emu.run(
        exe,
        &format!(
            "bf16_case_{}x{}_m{}_{}",
            case.n,
            case.k,
            case.m,
            finish.name()
        ),
    );
    read_bf16(&dumps, y)
}

#[test]
fn the_stream_kernel_matches_the_reference_and_the_register_kernel() {
    for target in emulated_targets("", |_| true) {
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0x57e4);
        for case in [
            // one warp per tile, K not a multiple of 64 (the last group half empty)
            Case {
                n: 300,
                k: 528,
                m: 1,
                plan: plan(1, 1, 9),
            },
            // eight warps per tile, fewer chunks than warps
            Case {
                n: 37,
                k: 528,
                m: 3,
                plan: plan(8, 1, 9),
            },
            // K split in two uneven ranges, chunks cut short, two warps per tile
            Case {
                n: 100,
                k: 1040,
                m: 9,
                plan: plan(2, 2, 9),
            },
            // K split in three, all 16 rows, four warps per tile
            Case {
                n: 64,
                k: 2048,
                m: 16,
                plan: plan(4, 3, 11),
            },
        ] {
            let q =
                Nvfp4Matrix::quantize("W", &rng.normal_vec(case.n * case.k, 0.02), case.n, case.k)
                    .expect("finite");
            let x: Vec<bf16> = rng
                .normal_vec(case.m * case.k, 1.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let outputs = run_case(&exe, target, &case, Finish::L2, &q, &x);
            let [stream, registers] = [&outputs[0], &outputs[1]];
            let (n, k, m) = (case.n, case.k, case.m);
            let want = gemm::reference::nvfp4_gemm_f32(&x, m, q.view());
            assert_agrees(target, "stream", &case, stream, &want);
            let differ = (0..m * n)
                .filter(|&i| stream[i].to_bits() != registers[i].to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "{} ({n}, {k}) M={m}: {differ} outputs differ from the register kernel",
                target.name
            );
        }
    }
}

/// Prints `got` against the CPU reference `want` for `what` on `case` and asserts they agree.
fn assert_agrees(target: &TargetFacts, what: &str, case: &Case, got: &[bf16], want: &[f32]) {
    let (n, k, m) = (case.n, case.k, case.m);
    let agreement = compare::compare_bf16(got, want);
    println!(
        "{} {what} ({n}, {k}) M={m} {:?}: {agreement}",
        target.name, case.plan
    );
    assert!(
        agreement.passed(),
        "{} {what} ({n}, {k}) M={m}: {agreement}",
        target.name
    );
}

/// One case on fresh random X and weights, NVFP4 then bf16: `nvfp4` and `dense` run the kernel
/// under test on them (the quantised matrix / the bf16 `[n, k]` weight, and X), each output
/// against the CPU reference.
fn check_both_formats(
    target: &TargetFacts,
    rng: &mut SplitMix64,
    what: &str,
    case: &Case,
    nvfp4: impl Fn(&Nvfp4Matrix, &[bf16]) -> Vec<bf16>,
    dense: impl Fn(&[bf16], &[bf16]) -> Vec<bf16>,
) {
    let (n, k, m) = (case.n, case.k, case.m);
    let x: Vec<bf16> = rng
        .normal_vec(m * k, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let q = Nvfp4Matrix::quantize("W", &rng.normal_vec(n * k, 0.02), n, k).expect("finite");
    let want = gemm::reference::nvfp4_gemm_f32(&x, m, q.view());
    assert_agrees(target, &format!("{what}nvfp4"), case, &nvfp4(&q, &x), &want);
    let w: Vec<bf16> = rng
        .normal_vec(n * k, 0.02)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let want = gemm::reference::bf16_gemm_f32(&x, m, &w, n, k);
    assert_agrees(target, &format!("{what}bf16"), case, &dense(&w, &x), &want);
}

/// Most warps per tile, up to `wanted`, that a block of the X-ring variants holds whole: the
/// largest power of two dividing its warps (`mma_x_shared_warps_per_block` need not be one).
fn x_shared_tile_warps(target: &TargetFacts, wanted: u32) -> u32 {
    let block = gemm::mma_block_warps(target, 64);
    let mut warps = 1;
    while warps * 2 <= wanted && block % (warps * 2) == 0 {
        warps *= 2;
    }
    warps
}

/// The kernels that stream X through shared memory (`mma_x_shared`: the m48 and m64 variants on
/// `cp.async` targets; 33 and 40 rows run m48) on partitions that take every path: one to eight
/// warps per tile (as many as the target's blocks hold; their sums through the ring's memory), K
/// split with a short last range, K not a multiple of 64, rows past M, NVFP4 and bf16 weights:
/// each against the CPU reference.
#[test]
fn the_x_shared_kernels_match_the_reference() {
    for target in emulated_targets("", |_| true) {
        assert!(gemm::mma_x_shared(target, 33) && !gemm::mma_x_shared(target, 32));
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0x5a4ed);
        for case in [
            Case {
                n: 100,
                k: 528,
                m: 40,
                plan: plan(1, 1, 9),
            },
            Case {
                n: 37,
                k: 1040,
                m: 33,
                plan: plan(x_shared_tile_warps(target, 8), 2, 9),
            },
            Case {
                n: 64,
                k: 2048,
                m: 64,
                plan: plan(x_shared_tile_warps(target, 2), 3, 11),
            },
            Case {
                n: 48,
                k: 192,
                m: 50,
                plan: plan(x_shared_tile_warps(target, 4), 1, 3),
            },
        ] {
            check_both_formats(
                target,
                &mut rng,
                "",
                &case,
                |q, x| run_case(&exe, target, &case, Finish::L2, q, x).remove(0),
                |w, x| run_bf16_case(&exe, target, &case, Finish::L2, w, x),
            );
        }
    }
}

/// The mma kernels' K splits finished in clusters (`finish_in_cluster`: the blocks of a cluster
/// run at once, each tile's sums read from every block's shared memory), on targets with
/// clusters: the same bits as the L2 finish of the same partition, NVFP4 and bf16, for the
/// X-ring variants (m48, m64) and those that load X from global memory (m8, m16, m32), with one
/// and several warps per tile, an odd and an even number of splits, a short last split, a tile
/// group with fewer tiles than a block holds and rows past M; and close to the CPU reference.
#[test]
fn the_mma_kernels_finish_splits_in_clusters_as_through_the_l2() {
    for target in emulated_targets("has clusters", |t| t.instructions.clusters) {
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0xc105);
        for case in [
            Case {
                n: 100,
                k: 1040,
                m: 40,
                plan: plan(1, 3, 6),
            },
            Case {
                n: 37,
                k: 2048,
                m: 64,
                plan: plan(x_shared_tile_warps(target, 2), 4, 8),
            },
            Case {
                n: 208,
                k: 704,
                m: 57,
                plan: plan(x_shared_tile_warps(target, 4), 2, 6),
            },
            Case {
                n: 70,
                k: 1008,
                m: 1,
                plan: plan(2, 3, 6),
            },
            Case {
                n: 160,
                k: 512,
                m: 13,
                plan: plan(1, 2, 4),
            },
            Case {
                n: 48,
                k: 1536,
                m: 29,
                plan: plan(4, 3, 8),
            },
        ] {
            let l2_nvfp4 = std::cell::RefCell::new(Vec::new());
            let l2_bf16 = std::cell::RefCell::new(Vec::new());
            check_both_formats(
                target,
                &mut rng.clone(),
                "l2 ",
                &case,
                |q, x| {
                    let y = run_case(&exe, target, &case, Finish::L2, q, x)
                        .pop()
                        .expect("register kernel");
                    *l2_nvfp4.borrow_mut() = y.clone();
                    y
                },
                |w, x| {
                    let y = run_bf16_case(&exe, target, &case, Finish::L2, w, x);
                    *l2_bf16.borrow_mut() = y.clone();
                    y
                },
            );
            check_both_formats(
                target,
                &mut rng,
                "cluster ",
                &case,
                |q, x| {
                    let y = run_case(&exe, target, &case, Finish::Cluster, q, x)
                        .pop()
                        .expect("register kernel");
                    assert_same_bits(&y, &l2_nvfp4.borrow(), target, "nvfp4", &case);
                    y
                },
                |w, x| {
                    let y = run_bf16_case(&exe, target, &case, Finish::Cluster, w, x);
                    assert_same_bits(&y, &l2_bf16.borrow(), target, "bf16", &case);
                    y
                },
            );
        }
    }
}

/// `cluster` and `l2` (one launch's outputs with either finish) are the same bits.
fn assert_same_bits(cluster: &[bf16], l2: &[bf16], target: &TargetFacts, what: &str, case: &Case) {
    assert_eq!(cluster.len(), l2.len());
    if let Some(i) = (0..l2.len()).find(|&i| cluster[i].to_bits() != l2[i].to_bits()) {
        panic!(
            "{} {what} ({} x {} x {}, {:?}): the cluster finish gives {} at {i}, the L2 finish {}",
            target.name, case.m, case.n, case.k, case.plan, cluster[i], l2[i]
        );
    }
}

/// The weights of one wgmma case, as the device holds them.
enum WgmmaWeights<'a> {
    Nvfp4(&'a Nvfp4Matrix),
    Bf16(&'a [bf16]),
}

/// Runs `case` (its plan's splits and groups per split; one warp per tile) on
/// `gemm_{nvfp4,bf16}_bf16_wgmma_m64` with the blocks, threads and shared memory
/// src/kernels/gemm/mod.rs gives it (`wgmma_dims`); returns its output.
fn run_wgmma_case(
    exe: &Path,
    target: &TargetFacts,
    case: &Case,
    weights: WgmmaWeights<'_>,
    x: &[bf16],
) -> Vec<bf16> {
    let tiles = &target.gemm;
    let mut emu = Emu::default();
    let le = |words: &[u32]| {
        words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let (kernel, grid, mut head) = match weights {
        WgmmaWeights::Nvfp4(q) => {
            let fragments = Nvfp4Fragments::new(q, RowOrder::Plain).expect("layout");
            let words = emu.buffer(le(&fragments.words));
            let scales = emu.buffer(
                fragments
                    .scales
                    .iter()
                    .flat_map(|s| s.to_le_bytes())
                    .collect(),
            );
            let args = vec![
                Arg::Ptr(words),
                Arg::Ptr(scales),
                Arg::F32(q.global_scale * 128.0),
            ];
            ("gemm_nvfp4_bf16_wgmma_m64", fragments.grid, args)
        }
        WgmmaWeights::Bf16(w) => {
            let fragments = Bf16Fragments::new(w, case.n, case.k, RowOrder::Plain).expect("layout");
            let words = emu.buffer(le(&fragments.words));
            let args = vec![Arg::Ptr(words), Arg::F32(1.0)];
            ("gemm_bf16_bf16_wgmma_m64", fragments.grid, args)
        }
    };
    let x_buf = emu.buffer(x.iter().flat_map(|v| v.to_le_bytes()).collect());
    let y = emu.buffer(vec![0xff; 2 * case.m * case.n]);
    let partials = emu.zeros(grid.n_tiles * case.plan.splits as usize * 32 * 8 * 16);
    let counters = emu.zeros(4 * grid.n_tiles);
    head.insert(0, Arg::Ptr(x_buf));
    head.extend([Arg::Ptr(y), Arg::Null]);
    let quads = (grid.n_tiles as u32).div_ceil(4);
    let warpgroups = tiles.wgmma_warpgroups_per_block;
    let shared = fp4spec::target::wgmma_shared_bytes(tiles, kernel.contains("nvfp4"));
    emu.launch(
        kernel,
        (quads.div_ceil(warpgroups), case.plan.splits),
        warpgroups * 4 * target.warp_size,
        shared as usize,
        &[
            &head[..],
            &split_and_shape_args(partials, counters, case, grid),
        ]
        .concat(),
    );
    emu.dump(y);
    let dumps = emu.run(exe, &format!("{kernel}_{}x{}_m{}", case.n, case.k, case.m));
    read_bf16(&dumps, y)
}

/// The warpgroup kernels (`wgmma_rendered`: targets with wgmma and cp.async) on partitions that
/// take every path: a last quad of one to three live tiles and a quad of none in a block, K
/// split with a short last range, K not a multiple of 64, rows past M, more rounds than the
/// X ring's slots and the weight stages; NVFP4 and bf16 weights, each against the CPU reference.
#[test]
fn the_wgmma_kernels_match_the_reference() {
    for target in emulated_targets("has the wgmma kernels", gemm::wgmma_rendered) {
        assert!(
            !gemm::mma_wgmma(target, 32, usize::MAX),
            "wgmma is the m48 / m64 variants'"
        );
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0x36a3);
        for case in [
            // 7 tiles: one quad whole, one of 3 live tiles; K = 8.25 groups, unsplit
            Case {
                n: 100,
                k: 528,
                m: 40,
                plan: plan(1, 1, 9),
            },
            // 3 tiles (one quad of 3, its block's second quad empty), K split 9 + 7
            Case {
                n: 37,
                k: 1040,
                m: 33,
                plan: plan(1, 2, 9),
            },
            // 4 quads over 2 blocks, all 64 rows, K split 11 + 11 + 10
            Case {
                n: 256,
                k: 2048,
                m: 64,
                plan: plan(1, 3, 11),
            },
        ] {
            check_both_formats(
                target,
                &mut rng,
                "wgmma ",
                &case,
                |q, x| run_wgmma_case(&exe, target, &case, WgmmaWeights::Nvfp4(q), x),
                |w, x| run_wgmma_case(&exe, target, &case, WgmmaWeights::Bf16(w), x),
            );
        }
    }
}
