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
use fp4spec::kernels::gemm::layout::Nvfp4Fragments;
use fp4spec::kernels::gemm::{self, MmaPlan, RowOrder};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target::{self, TargetFacts};
use half::bf16;
use std::path::{Path, PathBuf};

const EMULATOR: &str = include_str!("gemm_emulator.cpp");
const GDN_EMULATOR: &str = include_str!("gdn_emulator.cpp");
const MOE_EMULATOR: &str = include_str!("moe_emulator.cpp");

#[path = "emulation/driver.rs"]
mod driver;
mod emulation;
use driver::{Arg, Buf, Emu, driver_for};
use emulation::{build_host, section, splice};

/// The host binary of `target`'s rendered gemm source.
fn emulator(target: &TargetFacts) -> PathBuf {
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
    let shared = "extern __shared__ __align__(16) u8 stream_shared[];";
    assert!(
        source.contains(shared),
        "the stream kernel's dynamic shared memory"
    );
    source = source.replace(shared, "u8* stream_shared = emu::dynamic_smem;");
    source.push_str(&driver_for(
        section(GDN_EMULATOR, "driver"),
        rendered.kernels,
    ));
    let set_block = "emu::self = {t, bx, by};";
    assert!(
        source.contains(set_block),
        "the driver sets the block index"
    );
    source = source.replace(set_block, "emu::self = {t, bx, by}; emu::grid = {gx, gy};");
    build_host(
        "gemm",
        &target.name,
        &source,
        &["clang++-19", "clang++", "g++", "c++"],
    )
}

/// One product on one partition: the stream kernel and the register kernel launched as
/// src/kernels/gemm/mod.rs launches them (parameters of `mma_nvfp4_arguments`).
struct Case {
    n: usize,
    k: usize,
    m: usize,
    plan: MmaPlan,
}

/// Runs `case` on both kernels; returns their outputs, stream kernel first.
fn run_case(
    exe: &Path,
    target: &TargetFacts,
    case: &Case,
    q: &Nvfp4Matrix,
    x: &[bf16],
) -> [Vec<bf16>; 2] {
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
    let m_tiles = case.m.div_ceil(8).next_power_of_two();
    let mut outputs = Vec::new();
    for (kernel, warps) in [
        (
            format!("gemm_nvfp4_bf16_stream_m{}", 8 * m_tiles),
            tiles.stream_warps_per_block,
        ),
        (
            format!("gemm_nvfp4_bf16_mma_m{}", 8 * m_tiles),
            tiles.mma_warps_per_block,
        ),
    ] {
        let y = emu.buffer(vec![0xff; 2 * case.m * case.n]);
        let partials = emu.zeros(grid.n_tiles * case.plan.splits as usize * 32 * m_tiles * 16);
        let counters = emu.zeros(4 * grid.n_tiles);
        let shared = if kernel.contains("stream") {
            gemm::stream_shared_bytes(tiles, case.m, case.plan.groups_per_split)
        } else {
            0
        };
        let blocks = (grid.n_tiles as u32).div_ceil(warps / case.plan.warps_per_tile);
        emu.launch(
            &kernel,
            (blocks, case.plan.splits),
            warps * target.warp_size,
            shared,
            &[
                Arg::Ptr(x_buf),
                Arg::Ptr(words),
                Arg::Ptr(scales),
                Arg::F32(q.global_scale * 128.0),
                Arg::Ptr(y),
                Arg::Null,
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
            ],
        );
        emu.dump(y);
        outputs.push(y);
    }
    let dumps = emu.run(exe, &format!("case_{}x{}_m{}", case.n, case.k, case.m));
    let read = |b: Buf| -> Vec<bf16> {
        dumps[&b.0]
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    [read(outputs[0]), read(outputs[1])]
}

#[test]
fn the_stream_kernel_matches_the_reference_and_the_register_kernel() {
    // sm_121a renders the same stream kernel (only the stream_* numbers differ) beside W4A4
    // code whose FP4 conversions the host cannot compile: the targets without it stand for it
    for target in target::all()
        .iter()
        .filter(|t| t.instructions.staged_mma() && !t.instructions.mma_block_scaled_fp4)
    {
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0x57e4);
        let plan = |warps_per_tile, splits, groups_per_split| MmaPlan {
            warps_per_tile,
            splits,
            groups_per_split,
        };
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
            let [stream, registers] = run_case(&exe, target, &case, &q, &x);
            let (n, k, m) = (case.n, case.k, case.m);
            let want = gemm::reference::nvfp4_gemm_f32(&x, m, q.view());
            let agreement = compare::compare_bf16(&stream, &want);
            println!(
                "{} stream ({n}, {k}) M={m} {:?}: {agreement}",
                target.name, case.plan
            );
            assert!(
                agreement.passed(),
                "{} stream ({n}, {k}) M={m}: {agreement}",
                target.name
            );
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
