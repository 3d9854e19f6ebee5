//! The `moe` kernels run on the CPU: the source rendered for sm_90a (mma.sync emulated as in
//! tests/gdn_emulator.cpp) and for gfx1151 (WMMA emulated) is compiled for the host with
//! tests/moe_emulator.cpp in place of its vendor layers and run with the arguments
//! src/kernels/moe/mod.rs passes (the same parameters, block size and kernel layout: the
//! library's [`MoeHostWeights::kernel_layout`] for the target's tensor core), against the CPU
//! reference. One OS thread per GPU thread, blocks one after another: the persistent kernel
//! lets the first block do every item (they are claimed in order), so this checks the item
//! decoding, routing, alignment, fragment addressing, passes, combine and the counters' reset
//! where no GPU is available, and that the split launches (route, gate_up, down) run after it on
//! the same workspace give bit-equal outputs; it cannot see races between blocks or timing.
//!
//! Needs a C++20 compiler (`$CXX`, else clang++-19 or clang++: the gfx1151 source uses clang's
//! vector extensions).

use fp4spec::kernels::compare;
use fp4spec::kernels::gemm::TensorCore;
use fp4spec::kernels::moe::reference::{self, ExpertRef, MoeShape, Routing};
use fp4spec::kernels::moe::{
    ExpertFormat, ExpertWeights, MoeHostWeights, MoeLaunch, SplitGrids, stream_combine_blocks,
    tile_warps,
};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target;
use half::bf16;
use std::path::PathBuf;

const EMULATOR: &str = include_str!("moe_emulator.cpp");
/// The portability layer and mma.sync emulation this emulator builds on.
const GDN_EMULATOR: &str = include_str!("gdn_emulator.cpp");
/// cp.async (copies at once, zero fill) for the streaming launches.
const GEMM_EMULATOR: &str = include_str!("gemm_emulator.cpp");

// the moe kernels take no f32 arguments
#[allow(dead_code)]
#[path = "emulation/driver.rs"]
mod driver;
mod emulation;
use driver::{Arg, Buf, Emu, driver_for};
use emulation::{build_host, section, splice, splice_if_present};

// ---- building the host binary of a target's rendered source ----

/// The emulator binary for `target_name` (built once per test process).
fn emulator(target_name: &'static str) -> PathBuf {
    // clang: the gfx1151 source uses clang's vector extensions
    build_host("moe", target_name, &["clang++-19", "clang++"], || {
        emulator_source(target_name)
    })
}

/// `target_name`'s moe source with the emulator's layers and driver.
fn emulator_source(target_name: &str) -> String {
    let rendered = table::rendered(target_name, "moe").expect("moe rendered");
    let mut source = splice(
        rendered.source,
        "// ---- fp4spec portability layer",
        "// ---- end of portability layer ----",
        section(GDN_EMULATOR, "portability"),
    );
    source = splice(
        &source,
        "// ---- sync vendor primitives ----",
        "// ---- end of sync vendor primitives ----",
        &format!(
            "{}{}",
            section(GDN_EMULATOR, "sync"),
            section(EMULATOR, "sync")
        ),
    );
    source = splice_if_present(
        &source,
        "// ---- inline PTX of the mma building blocks ----",
        "// ---- end of inline PTX of the mma building blocks ----",
        &format!(
            "{}{}",
            section(GDN_EMULATOR, "mma"),
            section(EMULATOR, "mma_adapters")
        ),
    );
    source = splice_if_present(
        &source,
        "// ---- cp.async instructions ----",
        "// ---- end of cp.async instructions ----",
        section(GEMM_EMULATOR, "cp_async"),
    );
    source = splice_if_present(
        &source,
        "// ---- bulk copy instructions ----",
        "// ---- end of bulk copy instructions ----",
        section(EMULATOR, "bulk_copy"),
    );
    source = splice_if_present(
        &source,
        "// ---- end of WMMA operand loaders ----",
        "// ---- end of WMMA operand loaders ----",
        section(EMULATOR, "wmma"),
    );
    source.push_str(&driver_for(
        section(GDN_EMULATOR, "driver"),
        rendered.kernels,
    ));
    source
}

// ---- the command stream (tests/emulation/driver.rs) ----

/// Fills a bf16 output with NaN before a launch that must write all of it: an element a form
/// leaves unwritten then fails the comparison instead of matching an earlier form's.
fn poison_bf16(emu: &mut Emu, buffer: Buf, elements: usize) {
    emu.refill(buffer, vec![0xff; 2 * elements]);
}

fn bytes_of<T: Copy>(values: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    values.iter().flat_map(|v| to(*v)).collect()
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

// ---- the weights as each target's kernels read them ----

/// Router words, gate_up / down words and scale bytes, alphas and S: the layout
/// src/kernels/moe/mod.rs uploads for `target_name` ([`MoeHostWeights::kernel_layout`] for the
/// target's tensor core), as bytes.
struct Layout {
    router: Vec<u8>,
    gate_up: Vec<u8>,
    gate_up_scales: Option<Vec<u8>>,
    down: Vec<u8>,
    down_scales: Option<Vec<u8>>,
    gate_up_alpha: Vec<f32>,
    down_alpha: Vec<f32>,
    shared_experts: usize,
}

fn layout(host: &MoeHostWeights, target_name: &str) -> Layout {
    let facts = target::by_name(target_name).expect("target");
    let tensor_core = TensorCore::for_target(facts).expect("a tensor-core target");
    let l = host.kernel_layout(tensor_core).expect("kernel layout");
    let le32 = |v: u32| v.to_le_bytes().to_vec();
    Layout {
        router: bytes_of(&l.router, le32),
        gate_up: bytes_of(&l.gate_up, le32),
        gate_up_scales: (!l.gate_up_scales.is_empty()).then(|| l.gate_up_scales.clone()),
        down: bytes_of(&l.down, le32),
        down_scales: (!l.down_scales.is_empty()).then(|| l.down_scales.clone()),
        gate_up_alpha: l.gate_up_alpha,
        down_alpha: l.down_alpha,
        shared_experts: l.shared_experts,
    }
}

// ---- one block on the emulator ----

/// What the emulated launches produced: the persistent launch twice, then the split launches
/// (route, gate_up, down) twice, then (where the target renders them) the streaming form's
/// launches (route, gate_up, streaming down on grids of 1 and 3 blocks, combine), on one
/// workspace.
struct Emulated {
    /// Y after each of the first four (same inputs).
    y: [Vec<bf16>; 4],
    /// Y after each streaming form, named by its down launch and grid (the grids split the units
    /// differently); empty where the target renders no streaming form.
    stream: Vec<(String, Vec<bf16>)>,
    /// The routing of the second persistent launch.
    routing: Routing,
    /// The counters after the persistent launches and after the split ones: all zero when every
    /// launch left them ready for the next (whichever form it takes).
    control: [Vec<u32>; 2],
}

#[allow(clippy::too_many_arguments)]
fn emulate(
    test: &str,
    target_name: &'static str,
    host: &MoeHostWeights,
    x: &[bf16],
    t: usize,
    residual: Option<&[bf16]>,
    grid: u32,
) -> Emulated {
    let s = host.shape;
    let facts = target::by_name(target_name).expect("target");
    let rows = facts
        .moe
        .token_rows
        .iter()
        .copied()
        .find(|&r| r as usize >= t)
        .unwrap_or(*facts.moe.token_rows.last().expect("token rows"));
    let format = match host.format() {
        ExpertFormat::Nvfp4 => "nvfp4",
        ExpertFormat::Bf16 => "bf16",
    };
    let l = layout(host, target_name);
    let (e, k, h, i, sh) = (
        s.experts,
        s.top_k,
        s.hidden,
        s.intermediate,
        l.shared_experts,
    );
    let positions = t * (k + sh);
    let mut emu = Emu::default();
    let bf = |v: &[bf16]| bytes_of(v, |x| x.to_le_bytes().to_vec());
    let fl = |v: &[f32]| bytes_of(v, |x| x.to_le_bytes().to_vec());
    let x_buf = emu.buffer(bf(x));
    let residual_buf = residual.map(|r| emu.buffer(bf(r)));
    let y_buf = emu.zeros(2 * t * h);
    poison_bf16(&mut emu, y_buf, t * h);
    let router = emu.buffer(l.router.clone());
    let gate_up = emu.buffer(l.gate_up.clone());
    let gate_up_scales = l.gate_up_scales.clone().map(|v| emu.buffer(v));
    let down = emu.buffer(l.down.clone());
    let down_scales = l.down_scales.clone().map(|v| emu.buffer(v));
    let gate_up_alpha = emu.buffer(fl(&l.gate_up_alpha));
    let down_alpha = emu.buffer(fl(&l.down_alpha));
    // as MoeWorkspace::new sizes it
    let control = emu.zeros(4 * (4 + e + sh + h.div_ceil(16) + t.div_ceil(8)));
    let topk_ids = emu.zeros(4 * t * k);
    let slot_pos = emu.zeros(4 * t * k);
    let sorted_token = emu.zeros(4 * positions);
    let active_expert = emu.zeros(4 * e);
    let active_offset = emu.zeros(4 * e);
    let active_count = emu.zeros(4 * e);
    let n_active = emu.zeros(4);
    let logits = emu.zeros(4 * facts.moe.router_planes as usize * t * (e + 1));
    let route_weight = emu.zeros(4 * t * k);
    let shared_scale = emu.zeros(4 * t);
    let partial = emu.zeros(4 * positions * h);
    let act = emu.zeros(2 * positions * i);
    let warps = tile_warps(facts, t);
    let ptr = |b: Buf| Arg::Ptr(b);
    let optional = |b: Option<Buf>| b.map_or(Arg::Null, Arg::Ptr);
    let u32_of = |v: usize| Arg::U32(u32::try_from(v).expect("a 32-bit kernel argument"));
    // MOE_PARAMETERS, in order
    let args = [
        ptr(x_buf),
        optional(residual_buf),
        ptr(y_buf),
        ptr(router),
        ptr(gate_up),
        optional(gate_up_scales),
        ptr(down),
        optional(down_scales),
        ptr(gate_up_alpha),
        ptr(down_alpha),
        ptr(control),
        ptr(topk_ids),
        ptr(slot_pos),
        ptr(sorted_token),
        ptr(active_expert),
        ptr(active_offset),
        ptr(active_count),
        ptr(n_active),
        ptr(logits),
        ptr(route_weight),
        ptr(shared_scale),
        ptr(partial),
        ptr(act),
        u32_of(t),
        u32_of(e),
        u32_of(k),
        u32_of(h),
        u32_of(i),
        u32_of(sh),
        Arg::U32(u32::from(host.shared_gate.is_some())),
        Arg::U32(warps.gate_up),
        Arg::U32(warps.down),
        Arg::Null, // no L2 prefetch (a hint: nothing to emulate)
        Arg::U32(0),
    ];
    let kernel = format!("moe_{format}_m{rows}");
    let threads = facts.moe.warps_per_block * facts.warp_size;
    emu.launch(&kernel, (grid, 1), threads, 0, &args);
    emu.dump(y_buf);
    poison_bf16(&mut emu, y_buf, t * h);
    emu.launch(&kernel, (grid, 1), threads, 0, &args);
    for buffer in [y_buf, topk_ids, route_weight, shared_scale, control] {
        emu.dump(buffer);
    }
    let grids = SplitGrids::new(
        facts,
        s,
        l.shared_experts,
        host.shared_gate.is_some(),
        t,
        rows,
    );
    // every form but the persistent one: Y poisoned, then the route launch
    let route = format!("moe_route_m{rows}");
    let start_split_form = |emu: &mut Emu| {
        poison_bf16(emu, y_buf, t * h);
        emu.launch(&route, (grids.route, 1), threads, 0, &args);
    };
    for _ in 0..2 {
        start_split_form(&mut emu);
        emu.launch(
            &format!("moe_{format}_gate_up_m{rows}"),
            (grids.gate_up, 1),
            threads,
            0,
            &args,
        );
        emu.launch(
            &format!("moe_{format}_down_m{rows}"),
            (grids.down, 1),
            threads,
            0,
            &args,
        );
        emu.dump(y_buf);
    }
    emu.dump(control);
    let streams = MoeLaunch::forms(facts).contains(&MoeLaunch::Stream);
    let mut stream_forms = Vec::new();
    if streams {
        // (gate_up, its grid, down): the split gate_up and the register-ring down launch, then
        // the bulk launches where the target has the bulk form
        let split_gate_up = (format!("moe_{format}_gate_up_m{rows}"), grids.gate_up);
        let mut forms = Vec::new();
        for grid in [1, 3] {
            forms.push((
                split_gate_up.clone(),
                format!("moe_{format}_down_stream"),
                grid,
            ));
        }
        if format == "nvfp4" && MoeLaunch::forms(facts).contains(&MoeLaunch::Bulk) {
            for grid in [1, 3] {
                // each bulk launch beside the other form's, then the bulk form itself
                let down_bulk = "moe_nvfp4_down_bulk".to_string();
                forms.push((split_gate_up.clone(), down_bulk.clone(), grid));
                let bulk_gate_up = ("moe_nvfp4_gate_up_bulk".to_string(), grid);
                let down_stream = format!("moe_{format}_down_stream");
                forms.push((bulk_gate_up.clone(), down_stream, grid));
                forms.push((bulk_gate_up, down_bulk, grid));
            }
        }
        for ((gate_up, gate_up_grid), down, grid) in &forms {
            start_split_form(&mut emu);
            emu.launch(gate_up, (*gate_up_grid, 1), threads, 0, &args);
            emu.launch(down, (*grid, 1), threads, 0, &args);
            let combine = stream_combine_blocks(facts, h, t);
            emu.launch("moe_stream_combine", (combine, 1), threads, 0, &args);
            emu.dump(y_buf);
            stream_forms.push(format!("{gate_up} and {down} on {grid} block(s)"));
        }
        emu.dump(control);
    }
    let dumps: Vec<Vec<u8>> = emu
        .run_in_order(&emulator(target_name), test)
        .into_iter()
        .map(|(_, bytes)| bytes)
        .collect();
    let to_bf16 = |b: &[u8]| -> Vec<bf16> {
        b.chunks_exact(2)
            .map(|p| bf16::from_le_bytes([p[0], p[1]]))
            .collect()
    };
    Emulated {
        y: [
            to_bf16(&dumps[0]),
            to_bf16(&dumps[1]),
            to_bf16(&dumps[6]),
            to_bf16(&dumps[7]),
        ],
        routing: Routing {
            top_k: k,
            experts: u32s(&dumps[2]),
            weights: f32s(&dumps[3]),
            shared_scale: if host.shared_gate.is_some() {
                f32s(&dumps[4])
            } else {
                Vec::new()
            },
        },
        stream: stream_forms
            .into_iter()
            .enumerate()
            .map(|(n, form)| (form, to_bf16(&dumps[9 + n])))
            .collect(),
        control: [u32s(&dumps[5]), u32s(dumps.last().expect("dumps"))],
    }
}

/// Runs the block on the emulator and checks it against the reference: the same experts per
/// token, weights and shared scales within fp32 rounding, the output within bf16 rounding of the
/// reference evaluated with the emulated routing (activations rounded to bf16 as the kernel
/// does), two launches bit-identical, and every counter back to zero. Returns the emulated run,
/// for a caller's own checks of it.
fn check(
    test: &str,
    target_name: &'static str,
    host: &MoeHostWeights,
    x: &[bf16],
    t: usize,
    r: Option<&[bf16]>,
    grid: u32,
) -> Emulated {
    let s = host.shape;
    let got = emulate(test, target_name, host, x, t, r, grid);
    let label = format!("{test} {target_name} {:?} T={t} grid={grid}", host.format());
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let router: Vec<f32> = host.router.iter().map(|v| v.to_f32()).collect();
    let gate: Option<Vec<f32>> = host
        .shared_gate
        .as_ref()
        .map(|g| g.iter().map(|v| v.to_f32()).collect());
    let want = reference::route(s, &xf, t, &router, gate.as_deref());
    let k = s.top_k;
    for token in 0..t {
        assert_eq!(
            &got.routing.experts[token * k..(token + 1) * k],
            &want.experts[token * k..(token + 1) * k],
            "{label}: token {token} experts (emulated vs reference, in order)"
        );
        for slot in 0..k {
            let (g, w) = (
                got.routing.weights[token * k + slot],
                want.weights[token * k + slot],
            );
            assert!(
                (g - w).abs() <= 1e-5,
                "{label}: token {token} slot {slot} weight {g} vs {w}"
            );
        }
        if let Some(w) = want.shared_scale.get(token) {
            let g = got.routing.shared_scale[token];
            assert!(
                (g - w).abs() <= 1e-5,
                "{label}: token {token} shared scale {g} vs {w}"
            );
        }
    }
    let dense: Vec<(Vec<f32>, Vec<f32>)> = host.experts.iter().map(ExpertWeights::dense).collect();
    let shared = host.shared.as_ref().map(ExpertWeights::dense);
    let (mut reference_y, slack) = reference::moe_block_bf16(
        s,
        &xf,
        t,
        &got.routing,
        |e| ExpertRef {
            gate_up: &dense[e].0,
            down: &dense[e].1,
        },
        shared
            .as_ref()
            .map(|(gate_up, down)| ExpertRef { gate_up, down }),
    );
    if let Some(r) = r {
        for (w, r) in reference_y.iter_mut().zip(r) {
            *w += r.to_f32();
        }
    }
    let agreement = compare::compare_bf16_with_slack(&got.y[1], &reference_y, &slack);
    println!("{label}: {agreement}");
    assert!(agreement.passed(), "{label}: {agreement}");
    if let Some((_, first)) = got.stream.first() {
        // the streaming forms: their agreement with the reference, the same bits whatever the
        // down launch and its grid, and the split form's bits wherever that sums a down tile in
        // one warp too (above moe.wide_max_tokens)
        let agreement = compare::compare_bf16_with_slack(first, &reference_y, &slack);
        println!("{label} stream: {agreement}");
        assert!(agreement.passed(), "{label} stream: {agreement}");
        let facts = target::by_name(target_name).expect("target");
        if t > facts.moe.wide_max_tokens as usize {
            let differ = differing_bits(first, &got.y[2]);
            assert_eq!(
                differ, 0,
                "{label}: the streaming form differs from the split one in {differ} elements"
            );
        }
        for (form, y) in &got.stream[1..] {
            let differ = differing_bits(first, y);
            assert_eq!(
                differ, 0,
                "{label}: the streaming form with {form} differs from {} in {differ} elements",
                got.stream[0].0
            );
        }
    }
    for (n, y) in got.y.iter().enumerate().skip(1) {
        let differ = differing_bits(y, &got.y[0]);
        assert_eq!(
            differ, 0,
            "{label}: launch {n} (0, 1 persistent; 2, 3 split) differs from launch 0 in {differ} \
             elements (counters not reset, or the forms round differently)"
        );
    }
    for (control, after) in got.control.iter().zip(["persistent", "split and stream"]) {
        assert!(
            control.iter().all(|&c| c == 0),
            "{label}: counters left after the {after} launches: {control:?}"
        );
    }
    got
}

/// Elements of `a` and `b` whose bits differ.
fn differing_bits(a: &[bf16], b: &[bf16]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn shape(
    experts: usize,
    top_k: usize,
    hidden: usize,
    intermediate: usize,
    shared: usize,
) -> MoeShape {
    MoeShape {
        experts,
        top_k,
        hidden,
        intermediate,
        shared_intermediate: shared,
    }
}

fn inputs(seed: u64, len: usize) -> Vec<bf16> {
    SplitMix64::new(seed)
        .normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// E = 8, k = 2, H = 272 and I = 48 (K not a multiple of 64), Is = 80 (two sub-experts, one
/// padded): NVFP4 at T = 9 (two token chunks) with a residual, bf16 at T = 1 without a gate on a
/// grid of two blocks (the second finds no work and resets the counters); and E = 32, k = 8 at
/// T = 1, NVFP4 with a residual.
#[test]
fn the_sm90a_kernels_run_emulated() {
    let s = shape(8, 2, 272, 48, 80);
    let nvfp4 = MoeHostWeights::synthetic(s, ExpertFormat::Nvfp4, 1);
    let (x, r) = (inputs(2, 9 * 272), inputs(3, 9 * 272));
    check("awkward", "sm_90a", &nvfp4, &x, 9, Some(&r), 1);
    let mut bf16_block = MoeHostWeights::synthetic(s, ExpertFormat::Bf16, 4);
    bf16_block.shared_gate = None;
    check(
        "no gate",
        "sm_90a",
        &bf16_block,
        &inputs(5, 272),
        1,
        None,
        2,
    );
    // one token, top-8 of 32: the alignment lays its slots out by the chosen experts' ranks
    // (ascending ids), which are not their slots (most probable first), so a position taken
    // from the wrong one shows (with k = 2 above, the two orders agree half the time)
    let top8 = MoeHostWeights::synthetic(shape(32, 8, 272, 48, 80), ExpertFormat::Nvfp4, 8);
    check(
        "one token, top-8",
        "sm_90a",
        &top8,
        &inputs(9, 272),
        1,
        Some(&inputs(10, 272)),
        1,
    );
}

/// More experts than one batch of the routing's logit loads covers (8 per lane, 256 in all; 300
/// is no multiple of 32) and more slots than one batch of the combine's (8; k = 10, the second
/// batch partly past k), with a two-part shared expert; 5 tokens choose more than 32 distinct
/// experts, so the stream table (build_stream_table) holds ranks past a warp's first row. The
/// shared gate (router row E, which the lanes past E load in place of an expert) follows token
/// 0's signs, so its logit there is far above every expert's: a lane that kept it as an expert
/// would route token 0 to expert >= E.
#[test]
fn the_sm90a_kernels_route_and_combine_past_one_batch_emulated() {
    let mut host = MoeHostWeights::synthetic(shape(300, 10, 272, 48, 80), ExpertFormat::Nvfp4, 31);
    let x = inputs(32, 5 * 272);
    host.shared_gate = Some(
        x[..272]
            .iter()
            .map(|v| bf16::from_f32(if v.to_f32() < 0.0 { -1.0 } else { 1.0 }))
            .collect(),
    );
    let got = check(
        "300 experts, top-10",
        "sm_90a",
        &host,
        &x,
        5,
        Some(&inputs(33, 5 * 272)),
        1,
    );
    let distinct: std::collections::BTreeSet<_> = got.routing.experts.iter().collect();
    assert!(distinct.len() > 32, "{} distinct experts", distinct.len());
}

/// The real hidden size (H = 2048, 32 K groups): in sm_90a's route launch each of a router
/// tile's four warps then takes two groups per plane, whose X fragments it loads together
/// before either product (tile_product's X_FIRST); the other tests' rows give a warp one group.
#[test]
fn the_sm90a_router_takes_two_k_groups_per_warp_at_the_real_hidden_size_emulated() {
    let h = 2048;
    let host = MoeHostWeights::synthetic(shape(8, 2, h, 48, 0), ExpertFormat::Nvfp4, 51);
    check("H = 2048", "sm_90a", &host, &inputs(52, h), 1, None, 1);
}

/// Exact router ties, broken toward the lower expert id as the reference does: with E = 64 a
/// lane holds experts e and e + 32. Token 0's logits are 3 for expert 40, 2 for experts 8 and 33
/// (a tie between lanes), 1 for 5 and 37 (a tie within lane 5): top-4 [40, 8, 33, 5]. Token 1's
/// are their negatives, so its four come from the 59 experts at 0: [0, 1, 2, 3]. Those ties
/// reach past a warp of candidates (the routing's rounds choose); token 2's stay under it (the
/// floor's ranking chooses): its logits are token 0's plus 1 for expert 9 and -1 for the rest,
/// so the fourth lane's largest is 1 and six experts reach it: [40, 8, 33, 5]. Every logit is one
/// bf16 product, exact in the MMA's fp32 sums.
#[test]
fn the_sm90a_kernels_break_router_ties_toward_the_lower_id_emulated() {
    let (experts, h) = (64, 128);
    let mut host = MoeHostWeights::synthetic(shape(experts, 4, h, 48, 80), ExpertFormat::Nvfp4, 41);
    for e in 0..experts {
        let logit = match e {
            40 => 3.0,
            8 | 33 => 2.0,
            5 | 37 => 1.0,
            _ => 0.0,
        };
        let floored = match e {
            9 => 1.0,
            _ if logit == 0.0 => -1.0,
            _ => logit,
        };
        for c in 0..h {
            let value = match c {
                0 => logit,
                1 => floored,
                _ => 0.0,
            };
            host.router[e * h + c] = bf16::from_f32(value);
        }
    }
    let mut x = inputs(42, 3 * h);
    for (t, (first, second)) in [(1.0, 0.0), (-1.0, 0.0), (0.0, 1.0)]
        .into_iter()
        .enumerate()
    {
        x[t * h] = bf16::from_f32(first);
        x[t * h + 1] = bf16::from_f32(second);
    }
    check("router ties", "sm_90a", &host, &x, 3, None, 1);
}

/// The sm_121a source (its own tuning of the same code): the same awkward block, NVFP4 with a
/// residual and bf16 without a gate.
#[test]
fn the_sm121a_kernels_run_emulated() {
    let s = shape(8, 2, 272, 48, 80);
    let nvfp4 = MoeHostWeights::synthetic(s, ExpertFormat::Nvfp4, 21);
    let (x, r) = (inputs(22, 9 * 272), inputs(23, 9 * 272));
    check("registers", "sm_121a", &nvfp4, &x, 9, Some(&r), 1);
    let mut bf16_block = MoeHostWeights::synthetic(s, ExpertFormat::Bf16, 24);
    bf16_block.shared_gate = None;
    check(
        "registers, no gate",
        "sm_121a",
        &bf16_block,
        &inputs(25, 272),
        1,
        None,
        2,
    );
}

/// 32 experts, top-4, no shared expert; expert 5 gets all 20 tokens (three passes of 8).
#[test]
fn the_sm90a_kernels_run_emulated_with_a_crowded_expert() {
    let (s, t) = (shape(32, 4, 64, 32, 0), 20);
    let mut host = MoeHostWeights::synthetic(s, ExpertFormat::Bf16, 6);
    // expert 5's router row leans on input column 0, which every token sets high
    for (c, v) in host.router[5 * 64..6 * 64].iter_mut().enumerate() {
        *v = bf16::from_f32(if c == 0 { 4.0 } else { 0.0 });
    }
    let mut x = inputs(7, t * 64);
    for token in 0..t {
        x[token * 64] = bf16::from_f32(6.0);
    }
    let got = check("crowded", "sm_90a", &host, &x, t, None, 1);
    let count = got.routing.experts.iter().filter(|&&e| e == 5).count();
    assert_eq!(count, t, "expert 5 should get every token");
}

/// E = 8, k = 2, T = 100 on bf16 experts (every expert takes several passes), on inputs where a
/// shared-expert activation lies 2^-21 above a bf16 rounding midpoint, where the output it feeds
/// is a cancelling sum: the reference rounds to nearest even (`formats::bf16::round_f64`; half's
/// own f64 conversion rounded it down and put that output at 1.27x its bound) and allows the
/// other rounding as slack (`reference::moe_block_bf16`).
#[test]
fn the_sm90a_kernels_round_activations_as_the_reference_does() {
    let s = shape(8, 2, 272, 48, 80);
    let host = MoeHostWeights::synthetic(s, ExpertFormat::Bf16, 109);
    check(
        "midpoint",
        "sm_90a",
        &host,
        &inputs(1009, 100 * 272),
        100,
        None,
        1,
    );
}

/// More slots than align_by_scan reads in one batch (ALIGN_BATCH = 8 per thread: 1024 on a block
/// of 128 threads): E = 8, k = 8, T = 130 (1040 slots, every expert chosen by every token), so
/// the slots of its second batch must be counted and placed too; and E = 64, k = 8, T = 20 (160
/// slots), where the experts' scan spans two warps, so the second warp's ranks and positions
/// start from the first warp's total.
#[test]
fn the_sm90a_alignment_takes_several_batches_of_slots_emulated() {
    let two_warps = MoeHostWeights::synthetic(shape(64, 8, 272, 48, 0), ExpertFormat::Nvfp4, 127);
    check(
        "160 slots over 64 experts",
        "sm_90a",
        &two_warps,
        &inputs(1027, 20 * 272),
        20,
        None,
        1,
    );
    let host = MoeHostWeights::synthetic(shape(8, 8, 272, 48, 0), ExpertFormat::Nvfp4, 113);
    let got = check(
        "1040 slots",
        "sm_90a",
        &host,
        &inputs(1013, 130 * 272),
        130,
        None,
        1,
    );
    assert_eq!(got.routing.experts.len(), 1040, "slots routed");
}

/// The gfx1151 source (WMMA tile products) on the same kinds of blocks, shared experts (two
/// sub-experts, one padded) in both formats.
#[test]
fn the_gfx1151_kernels_run_emulated() {
    let s = shape(8, 2, 272, 48, 80);
    let nvfp4 = MoeHostWeights::synthetic(s, ExpertFormat::Nvfp4, 9);
    let (x, r) = (inputs(10, 9 * 272), inputs(11, 9 * 272));
    check("wmma nvfp4", "gfx1151", &nvfp4, &x, 9, Some(&r), 1);
    let s = shape(8, 2, 272, 48, 80);
    let bf16_block = MoeHostWeights::synthetic(s, ExpertFormat::Bf16, 12);
    check(
        "wmma bf16",
        "gfx1151",
        &bf16_block,
        &inputs(13, 3 * 272),
        3,
        None,
        2,
    );
}
