//! The `gdn` kernels run on the CPU: the source rendered for sm_90a (ldmatrix, mma.sync and
//! cp.async emulated from the PTX ISA's definitions) and for gfx1151 (its lane-by-lane MMA and
//! global-memory operands) is compiled for the host with tests/gdn_emulator.cpp in place of its
//! vendor layers, and driven with the launches src/kernels/gdn/mod.rs makes (same grids, threads,
//! shared memory and argument lists), against the CPU backend of the launch API on the same
//! inputs. One OS thread per GPU thread, blocks one after another: this checks the kernels'
//! indexing, fragment layouts, shared-memory carve-up, barriers and the cache / ring / commit
//! logic where no GPU is available; it cannot see races between blocks or timing.
//!
//! Needs a C++20 compiler (`$CXX`, else clang++-19, clang++, g++ or c++).

use fp4spec::backend::Backend;
use fp4spec::kernels::Bf16Rows;
use fp4spec::kernels::gdn::reference::{self, LayerParams, RawInputs, SequenceCache};
use fp4spec::kernels::gdn::{
    self, Accepted, ChunkWorkspace, GdnCache, GdnParams, GdnShape, Projections, Sequences, StepMode,
};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target;
use half::bf16;
use std::path::PathBuf;

const KERNEL: usize = 4;
const EMULATOR: &str = include_str!("gdn_emulator.cpp");

#[path = "emulation/driver.rs"]
mod driver;
mod emulation;
use driver::{Arg, Buf, Emu, driver_for};
use emulation::{build_host, splice, splice_if_present};

// ---- building the host binary of a target's rendered source ----

fn section(name: &str) -> &'static str {
    emulation::section(EMULATOR, name)
}

/// The emulator binary for `target` (built once per test process).
fn emulator(target_name: &'static str) -> PathBuf {
    build_host(
        "gdn",
        target_name,
        &["clang++-19", "clang++", "g++", "c++"],
        || emulator_source(target_name),
    )
}

/// `target_name`'s gdn source with the emulator's layers and driver.
fn emulator_source(target_name: &str) -> String {
    let rendered = table::rendered(target_name, "gdn").expect("gdn rendered");
    let mut source = splice(
        rendered.source,
        "// ---- fp4spec portability layer",
        "// ---- end of portability layer ----",
        section("portability"),
    );
    source = splice(
        &source,
        "// ---- what differs between vendors in this family ----",
        "// ---- end of vendor differences ----",
        section("vendor"),
    );
    source = splice(
        &source,
        "// ---- sync vendor primitives ----",
        "// ---- end of sync vendor primitives ----",
        section("sync"),
    );
    source = splice_if_present(
        &source,
        "// ---- mma.sync instructions ----",
        "// ---- end of mma.sync instructions ----",
        section("mma"),
    );
    source = splice_if_present(
        &source,
        "// ---- cp.async instructions ----",
        "// ---- end of cp.async instructions ----",
        section("cp_async"),
    );
    assert!(
        source.contains("GDN_SHARED smem[];"),
        "the kernels declare their dynamic shared memory as expected"
    );
    source = source.replace(
        "GDN_SHARED smem[];",
        "unsigned char* smem = emu::dynamic_smem;",
    );
    source.push_str(&driver_for(section("driver"), rendered.kernels));
    source
}

// ---- the command stream ----

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bytes_bf16(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}
fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}
fn bf16s_as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

// ---- the launches of src/kernels/gdn/mod.rs, on emulator buffers ----

struct Layer {
    conv_weight: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_weight: Vec<f32>,
}

/// One scenario's buffers on the emulator, laid out as GdnCache, Sequences and ChunkWorkspace.
struct Device {
    target: &'static target::TargetFacts,
    shape: GdnShape,
    slots: usize,
    ring: usize,
    params: [Buf; 4],
    state: Buf,
    conv: Buf,
    ring_k: Buf,
    ring_u: Buf,
    ring_g: Buf,
    o_scratch: Buf,
    counters: Buf,
    seq_slots: Buf,
    positions: Buf,
    pending: Buf,
    count: usize,
    ws: [Buf; 7],
}

impl Device {
    #[allow(clippy::too_many_arguments)]
    fn new(
        emu: &mut Emu,
        target_name: &str,
        shape: GdnShape,
        layer: &Layer,
        slots: usize,
        max_m: usize,
        seq_slots: &[u32],
        positions: &[u32],
        initial: &[(Vec<f32>, Vec<bf16>)],
    ) -> Self {
        let target = target::by_name(target_name).expect("target");
        let ring = (KERNEL - 1).max(max_m) + max_m;
        let (hk, hv, dk, dv, c) = (
            shape.key_heads,
            shape.value_heads,
            shape.dk,
            shape.dv,
            shape.conv_dim(),
        );
        let mut state = vec![0.0f32; slots * shape.state_len()];
        let mut conv = vec![bf16::ZERO; slots * ring * c];
        for ((&slot, &position), (s, window)) in seq_slots.iter().zip(positions).zip(initial) {
            let slot = slot as usize;
            state[slot * shape.state_len()..(slot + 1) * shape.state_len()].copy_from_slice(s);
            for r in 0..KERNEL - 1 {
                if let Some(p) = (position as usize + r).checked_sub(KERNEL - 1) {
                    let at = (slot * ring + p % ring) * c;
                    conv[at..at + c].copy_from_slice(&window[r * c..(r + 1) * c]);
                }
            }
        }
        let chunks = 512 / 64 + seq_slots.len();
        let rows = chunks * 64;
        Self {
            target,
            shape,
            slots,
            ring,
            params: [
                emu.buffer(bytes_f32(&layer.conv_weight)),
                emu.buffer(bytes_f32(&layer.a_log)),
                emu.buffer(bytes_f32(&layer.dt_bias)),
                emu.buffer(bytes_f32(&layer.norm_weight)),
            ],
            state: emu.buffer(bytes_f32(&state)),
            conv: emu.buffer(bytes_bf16(&conv)),
            ring_k: emu.zeros(slots * ring * hk * dk * 4),
            ring_u: emu.zeros(slots * ring * hv * dv * 4),
            ring_g: emu.zeros(slots * ring * hv * 4),
            o_scratch: emu.zeros(slots * max_m * hv * dv * 4),
            counters: emu.zeros(slots * hv * 4),
            seq_slots: emu.buffer(bytes_u32(seq_slots)),
            positions: emu.buffer(bytes_u32(positions)),
            pending: emu.zeros(seq_slots.len() * 4),
            count: seq_slots.len(),
            ws: [
                emu.zeros(rows * hk * dk * 2),
                emu.zeros(rows * hk * dk * 2),
                emu.zeros(rows * hv * dk * 2),
                emu.zeros(rows * hv * dv * 2),
                emu.zeros(rows * hv * 64 * 2),
                emu.zeros(rows * hv * 4),
                emu.zeros((seq_slots.len() + 1) * 4),
            ],
        }
    }

    fn width(&self) -> usize {
        self.shape.value_heads * self.shape.dv
    }

    /// As gdn::step: returns the output buffer.
    fn step(&self, emu: &mut Emu, m: usize, rows: &RowBufs, mode: StepMode, gated: bool) -> Buf {
        let s = self.shape;
        let out = emu.zeros((self.count * m * self.width()).max(1) * 2);
        let tiles = &self.target.gdn;
        let kernel = gdn::step_kernel(s.dk, s.dv);
        let u = |v: usize| Arg::U32(v as u32);
        let args = [
            Arg::Ptr(rows.qkv),
            u(s.conv_dim()),
            Arg::Ptr(rows.a),
            u(s.value_heads),
            Arg::Ptr(rows.b),
            u(s.value_heads),
            if gated { Arg::Ptr(rows.z) } else { Arg::Null },
            u(if gated { self.width() } else { 0 }),
            Arg::Ptr(self.params[0]),
            Arg::Ptr(self.params[1]),
            Arg::Ptr(self.params[2]),
            Arg::Ptr(self.params[3]),
            Arg::F32(1e-6),
            Arg::Ptr(self.state),
            Arg::Ptr(self.conv),
            Arg::Ptr(self.ring_k),
            Arg::Ptr(self.ring_u),
            Arg::Ptr(self.ring_g),
            Arg::Ptr(self.seq_slots),
            Arg::Ptr(self.positions),
            Arg::Ptr(self.pending),
            Arg::Ptr(out),
            Arg::Ptr(self.o_scratch),
            Arg::Ptr(self.counters),
            u(s.key_heads),
            u(s.value_heads),
            u(s.dk),
            u(s.dv),
            u(KERNEL),
            u(self.ring),
            u(self.slots),
            u(m),
            u(usize::from(mode == StepMode::Verify)),
        ];
        let grid = (
            (s.value_heads * s.dv.div_ceil(tiles.step_dv_per_block as usize)) as u32,
            self.count as u32,
        );
        emu.launch(kernel, grid, tiles.step_threads, 0, &args);
        out
    }

    /// As Sequences::commit.
    fn commit(
        &self,
        emu: &mut Emu,
        accepted: Accepted<'_>,
        counts: Option<&[u32]>,
        mode: StepMode,
    ) {
        let (ptr, uniform) = match (accepted, counts) {
            (Accepted::All(a), _) => (Arg::Null, a),
            (Accepted::PerSequence(_), Some(c)) => (Arg::Ptr(emu.buffer(bytes_u32(c))), 0),
            _ => panic!("per-sequence counts needed"),
        };
        let args = [
            Arg::Ptr(self.positions),
            Arg::Ptr(self.pending),
            ptr,
            Arg::U32(uniform),
            Arg::U32(self.count as u32),
            Arg::U32(u32::from(mode == StepMode::Decode)),
        ];
        emu.launch(
            "gdn_commit",
            ((self.count as u32).div_ceil(128), 1),
            128,
            0,
            &args,
        );
    }

    /// As gdn::prefill: returns the output buffer.
    fn prefill(&self, emu: &mut Emu, cu: &[u32], rows: &RowBufs, gated: bool) -> Buf {
        let s = self.shape;
        let tokens = cu[self.count] as usize;
        let out = emu.zeros((tokens * self.width()).max(1) * 2);
        let cu_buf = emu.buffer(bytes_u32(cu));
        let chunks: usize = cu
            .windows(2)
            .map(|w| ((w[1] - w[0]) as usize).div_ceil(64))
            .sum();
        let u = |v: usize| Arg::U32(v as u32);
        let ws: Vec<Arg> = self.ws[..6].iter().map(|b| Arg::Ptr(*b)).collect();
        if chunks > 0 {
            let mut args = vec![
                Arg::Ptr(rows.qkv),
                u(s.conv_dim()),
                Arg::Ptr(rows.a),
                u(s.value_heads),
                Arg::Ptr(rows.b),
                u(s.value_heads),
                Arg::Ptr(self.params[0]),
                Arg::Ptr(self.params[1]),
                Arg::Ptr(self.params[2]),
                Arg::Ptr(self.conv),
                Arg::Ptr(cu_buf),
                Arg::Ptr(self.seq_slots),
                Arg::Ptr(self.positions),
            ];
            args.extend(&ws);
            args.extend([
                u(s.key_heads),
                u(s.value_heads),
                u(s.dv),
                u(KERNEL),
                u(self.ring),
                u(self.count),
            ]);
            emu.launch(
                &format!("gdn_chunk_prepare_dk{}", s.dk),
                (chunks as u32, s.value_heads as u32),
                128,
                gdn::chunk_prepare_smem(s.dk, s.dv),
                &args,
            );
        }
        let preferred = self.target.gdn.chunk_dv_per_block as usize;
        let dvs = if s.dv % preferred == 0 { preferred } else { 16 };
        let mut args = ws.clone();
        args.extend([
            Arg::Ptr(rows.qkv),
            u(s.conv_dim()),
            Arg::Ptr(self.state),
            Arg::Ptr(self.conv),
            Arg::Ptr(self.ring_k),
            Arg::Ptr(self.ring_u),
            Arg::Ptr(self.ring_g),
            Arg::Ptr(cu_buf),
            Arg::Ptr(self.seq_slots),
            Arg::Ptr(self.positions),
            Arg::Ptr(self.pending),
            Arg::Ptr(out),
            u(s.key_heads),
            u(s.value_heads),
            u(s.dv),
            u(KERNEL),
            u(self.ring),
            u(self.slots),
        ]);
        emu.launch(
            &format!("gdn_chunk_state_dk{}_dv{dvs}", s.dk),
            ((s.value_heads * s.dv / dvs) as u32, self.count as u32),
            gdn::chunk_state_threads(self.target),
            gdn::chunk_state_smem(s.dk, dvs, self.target.gdn.chunk_stages as usize),
            &args,
        );
        if gated && tokens > 0 {
            let args = [
                Arg::Ptr(out),
                Arg::Ptr(rows.z),
                u(self.width()),
                Arg::Ptr(self.params[3]),
                Arg::F32(1e-6),
                u(tokens),
                u(s.value_heads),
                u(s.dv),
            ];
            emu.launch(
                "gdn_gated_norm",
                (((tokens * s.value_heads) as u32).div_ceil(4), 1),
                128,
                0,
                &args,
            );
        }
        out
    }
}

/// Projection rows, on the emulator and as host values.
struct RowBufs {
    qkv: Buf,
    a: Buf,
    b: Buf,
    z: Buf,
    host: [Vec<bf16>; 4],
}

fn random_bf16(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
    rng.normal_vec(len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

impl RowBufs {
    fn new(emu: &mut Emu, rng: &mut SplitMix64, shape: GdnShape, rows: usize) -> Self {
        let host = [
            random_bf16(rng, rows * shape.conv_dim()),
            random_bf16(rng, rows * shape.value_heads),
            random_bf16(rng, rows * shape.value_heads),
            random_bf16(rng, rows * shape.value_heads * shape.dv),
        ];
        let (pad_bytes, n) = (64, host.clone());
        let mut up = |v: &[bf16]| {
            let mut b = bytes_bf16(v);
            b.extend(vec![0; pad_bytes]);
            emu.buffer(b)
        };
        Self {
            qkv: up(&n[0]),
            a: up(&n[1]),
            b: up(&n[2]),
            z: up(&n[3]),
            host,
        }
    }
}

// ---- the CPU side: the launch API on Backend::Cpu ----

struct Cpu {
    params: GdnParams,
    cache: GdnCache,
    seqs: Sequences,
    workspace: ChunkWorkspace,
}

impl Cpu {
    fn run(
        &mut self,
        shape: GdnShape,
        rows: &RowBufs,
        m: usize,
        cu: Option<&[u32]>,
        mode: StepMode,
        gated: bool,
    ) -> Vec<f32> {
        let cpu = Backend::Cpu;
        let up = |v: &Vec<bf16>| cpu.upload(v).expect("upload");
        let (qkv, a, b, z) = (
            up(&rows.host[0]),
            up(&rows.host[1]),
            up(&rows.host[2]),
            up(&rows.host[3]),
        );
        let projections = Projections {
            qkv: Bf16Rows::packed(&qkv, shape.conv_dim()),
            a: Bf16Rows::packed(&a, shape.value_heads),
            b: Bf16Rows::packed(&b, shape.value_heads),
            z: gated.then(|| Bf16Rows::packed(&z, shape.value_heads * shape.dv)),
        };
        let tokens = cu.map_or(self.seqs.len() * m, |c| c[c.len() - 1] as usize);
        let mut out = cpu
            .zeros::<bf16>((tokens * shape.value_heads * shape.dv).max(1))
            .expect("zeros");
        if tokens == 0 {
            out = cpu.zeros::<bf16>(0).expect("zeros");
        }
        match cu {
            Some(cu) => gdn::prefill(
                &cpu,
                &self.params,
                &mut self.cache,
                &mut self.workspace,
                &self.seqs,
                cu,
                &projections,
                &mut out,
            )
            .expect("cpu prefill"),
            None => gdn::step(
                &cpu,
                &self.params,
                &mut self.cache,
                &self.seqs,
                m,
                &projections,
                mode,
                &mut out,
            )
            .expect("cpu step"),
        }
        cpu.download(&out)
            .expect("download")
            .iter()
            .map(|x| x.to_f32())
            .collect()
    }
}

#[derive(Clone, Copy)]
struct Tolerance {
    elem_rel: f64,
    rms_rel: f64,
    max_rel: f64,
}
const STEP_OUT: Tolerance = Tolerance {
    elem_rel: 1.0 / 64.0,
    rms_rel: 2e-3,
    max_rel: 0.0,
};
const STEP_STATE: Tolerance = Tolerance {
    elem_rel: 0.0,
    rms_rel: 0.0,
    max_rel: 5e-5,
};
/// Gated outputs after a chunked prefill: the norm divides each row and head by its own rms, so a
/// row whose o is small (U - W S cancelling) carries the bf16 error floor of the larger terms at
/// the scale of the normalised output; the raw outputs are held to CHUNK.
const CHUNK_GATED: Tolerance = Tolerance {
    elem_rel: 1.0 / 8.0,
    rms_rel: 1e-1,
    max_rel: 0.0,
};
const CHUNK: Tolerance = Tolerance {
    elem_rel: 1.0 / 16.0,
    rms_rel: 3e-2,
    max_rel: 0.0,
};

/// Standard deviations of the chunk kernels' rounding model a prefill output may differ by (as in
/// tests/gpu/gdn.rs, which says how it was calibrated).
const ROUNDING_SIGMAS: f64 = 8.0;

/// What an output is held to: a [`Tolerance`], or an allowance per element (a prefill's, from
/// `reference::chunked_allowance`).
enum Allowance {
    Rms(Tolerance),
    Each(Vec<f64>),
}

fn check(what: &str, got: &[f32], want: &[f32], allowance: &Allowance) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let n = want.len().max(1) as f64;
    let rms = (want.iter().map(|w| f64::from(*w).powi(2)).sum::<f64>() / n).sqrt();
    let max = want.iter().fold(0.0f64, |m, w| m.max(f64::from(w.abs())));
    let mut worst = (0usize, 0.0f64);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = if g.is_finite() {
            f64::from((g - w).abs())
        } else {
            f64::INFINITY
        };
        let allowed = match allowance {
            Allowance::Rms(tol) => {
                tol.elem_rel * f64::from(w.abs()) + tol.rms_rel * rms + tol.max_rel * max
            }
            Allowance::Each(each) => each[i],
        } + 1e-30;
        if err / allowed > worst.1 {
            worst = (i, err / allowed);
        }
    }
    let (d2, w2) = got
        .iter()
        .zip(want)
        .fold((0.0f64, 0.0f64), |(d, w), (g, x)| {
            (d + f64::from(g - x).powi(2), w + f64::from(*x).powi(2))
        });
    let line = format!(
        "{what}: rel L2 {:.1e}, worst element {} got {} want {} at {:.2} of its allowance",
        (d2 / w2.max(1e-300)).sqrt(),
        worst.0,
        got[worst.0],
        want[worst.0],
        worst.1
    );
    println!("{line}");
    assert!(worst.1 <= 1.0, "{line}");
}

/// Per-element allowances of a gated prefill of `rows` (`cu` offsets) for the CPU side's
/// sequences (`seq_slots`, nothing pending), from the rounding model.
fn prefill_allowance(
    cpu: &Cpu,
    shape: GdnShape,
    layer: &Layer,
    seq_slots: &[u32],
    cu: &[u32],
    rows: &RowBufs,
) -> Vec<f64> {
    let backend = Backend::Cpu;
    let positions = cpu.seqs.positions(&backend).expect("positions");
    let host: Vec<Vec<f32>> = rows
        .host
        .iter()
        .map(|v| v.iter().map(|x| x.to_f32()).collect())
        .collect();
    let params = LayerParams {
        conv_weight: &layer.conv_weight,
        kernel: KERNEL,
        a_log: &layer.a_log,
        dt_bias: &layer.dt_bias,
        norm_weight: &layer.norm_weight,
        eps: 1e-6,
    };
    let (c, hv) = (shape.conv_dim(), shape.value_heads);
    let width = hv * shape.dv;
    let mut allowed = Vec::new();
    for ((&slot, &position), range) in seq_slots.iter().zip(&positions).zip(cu.windows(2)) {
        let (slot, position) = (slot as usize, position as usize);
        let state = if position > 0 {
            cpu.cache.state(&backend, slot).expect("state")
        } else {
            vec![0.0; shape.state_len()]
        };
        let window = cpu
            .cache
            .conv_window(&backend, slot, position)
            .expect("window");
        let seq = SequenceCache::new(state, window.iter().map(|x| x.to_f32()).collect(), position);
        let (a, b) = (range[0] as usize, range[1] as usize);
        let raw = RawInputs {
            t: b - a,
            qkv: &host[0][a * c..b * c],
            a: &host[1][a * hv..b * hv],
            b: &host[2][a * hv..b * hv],
            z: Some(&host[3][a * width..b * width]),
        };
        let (out, _) =
            reference::chunked_allowance(shape, params, raw, &seq, gdn::CHUNK, ROUNDING_SIGMAS);
        allowed.extend(out);
    }
    allowed
}

fn layer(rng: &mut SplitMix64, shape: GdnShape) -> Layer {
    Layer {
        conv_weight: rng.normal_vec(shape.conv_dim() * KERNEL, 0.5),
        a_log: (0..shape.value_heads)
            .map(|h| (h as f32 * 0.3).ln_1p() - 1.0)
            .collect(),
        dt_bias: rng.normal_vec(shape.value_heads, 0.5),
        norm_weight: rng
            .normal_vec(shape.dv, 0.1)
            .into_iter()
            .map(|w| 1.0 + w)
            .collect(),
    }
}

/// One scenario on one target: prefill (optional), verify, commit, decode, verify, prefill that
/// replays pending tokens, flush; every output, the final states, conv windows, positions and
/// pending counts against the CPU backend.
fn scenario(target_name: &'static str, shape: GdnShape, with_prefill: bool, seed: u64) {
    let exe = emulator(target_name);
    let mut rng = SplitMix64::new(seed);
    let layer = layer(&mut rng, shape);
    let (slots, max_m) = (2usize, 3usize);
    let seq_slots = [1u32, 0];
    let positions = [5u32, 0];
    let initial: Vec<(Vec<f32>, Vec<bf16>)> = (0..2)
        .map(|_| {
            (
                rng.normal_vec(shape.state_len(), 0.3),
                random_bf16(&mut rng, (KERNEL - 1) * shape.conv_dim()),
            )
        })
        .collect();
    let cpu_backend = Backend::Cpu;
    let mut cpu = Cpu {
        params: GdnParams::upload(
            &cpu_backend,
            shape,
            KERNEL,
            &layer.conv_weight,
            &layer.a_log,
            &layer.dt_bias,
            &layer.norm_weight,
            1e-6,
        )
        .expect("params"),
        cache: GdnCache::new(&cpu_backend, shape, KERNEL, slots, max_m).expect("cache"),
        seqs: Sequences::new(&cpu_backend, &seq_slots, &positions).expect("sequences"),
        workspace: ChunkWorkspace::new(&cpu_backend, shape, 512, 2).expect("workspace"),
    };
    for ((&slot, &position), (state, window)) in seq_slots.iter().zip(&positions).zip(&initial) {
        cpu.cache
            .set_sequence(
                &cpu_backend,
                slot as usize,
                position as usize,
                state,
                window,
            )
            .expect("set");
    }
    let mut emu = Emu::default();
    let dev = Device::new(
        &mut emu,
        target_name,
        shape,
        &layer,
        slots,
        max_m,
        &seq_slots,
        &positions,
        &initial,
    );
    let mut outputs: Vec<(String, Buf, Vec<f32>, Allowance)> = Vec::new();
    let tol_after = |gated: bool| match (with_prefill, gated) {
        (false, _) => STEP_OUT,
        (true, false) => CHUNK,
        (true, true) => CHUNK_GATED,
    };
    let cpu_commit = |cpu: &mut Cpu, counts: &[u32], mode: StepMode| {
        let c = cpu_backend.upload(counts).expect("upload");
        cpu.seqs
            .commit(&cpu_backend, Accepted::PerSequence(&c), mode)
            .expect("commit");
    };
    let dummy = cpu_backend.upload(&[0u32]).expect("dummy");
    let commit = |cpu: &mut Cpu, emu: &mut Emu, counts: &[u32], mode: StepMode| {
        cpu_commit(cpu, counts, mode);
        dev.commit(emu, Accepted::PerSequence(&dummy), Some(counts), mode);
    };
    if with_prefill {
        let cu = [0u32, 70, 73];
        let rows = RowBufs::new(&mut emu, &mut rng, shape, 73);
        let allowed = prefill_allowance(&cpu, shape, &layer, &seq_slots, &cu, &rows);
        let want = cpu.run(shape, &rows, 0, Some(&cu), StepMode::Decode, true);
        outputs.push((
            "prefill [70, 3] gated".into(),
            dev.prefill(&mut emu, &cu, &rows, true),
            want,
            Allowance::Each(allowed),
        ));
        commit(&mut cpu, &mut emu, &[70, 3], StepMode::Decode);
    }
    let rows = RowBufs::new(&mut emu, &mut rng, shape, 6);
    let want = cpu.run(shape, &rows, 3, None, StepMode::Verify, true);
    outputs.push((
        "verify 3 gated".into(),
        dev.step(&mut emu, 3, &rows, StepMode::Verify, true),
        want,
        Allowance::Rms(tol_after(true)),
    ));
    commit(&mut cpu, &mut emu, &[2, 0], StepMode::Verify);
    let rows = RowBufs::new(&mut emu, &mut rng, shape, 2);
    let want = cpu.run(shape, &rows, 1, None, StepMode::Decode, true);
    outputs.push((
        "decode after accepting 2 and 0".into(),
        dev.step(&mut emu, 1, &rows, StepMode::Decode, true),
        want,
        Allowance::Rms(tol_after(true)),
    ));
    commit(&mut cpu, &mut emu, &[1, 1], StepMode::Decode);
    let rows = RowBufs::new(&mut emu, &mut rng, shape, 4);
    let want = cpu.run(shape, &rows, 2, None, StepMode::Verify, false);
    outputs.push((
        "verify 2 raw".into(),
        dev.step(&mut emu, 2, &rows, StepMode::Verify, false),
        want,
        Allowance::Rms(tol_after(false)),
    ));
    commit(&mut cpu, &mut emu, &[1, 2], StepMode::Verify);
    if with_prefill {
        let cu = [0u32, 5, 5];
        let rows = RowBufs::new(&mut emu, &mut rng, shape, 5);
        let want = cpu.run(shape, &rows, 0, Some(&cu), StepMode::Decode, false);
        outputs.push((
            "prefill [5, 0] after verify".into(),
            dev.prefill(&mut emu, &cu, &rows, false),
            want,
            Allowance::Rms(CHUNK),
        ));
        commit(&mut cpu, &mut emu, &[5, 0], StepMode::Decode);
    } else {
        let rows = RowBufs::new(&mut emu, &mut rng, shape, 2);
        let want = cpu.run(shape, &rows, 1, None, StepMode::Decode, false);
        outputs.push((
            "decode after accepting 1 and 2".into(),
            dev.step(&mut emu, 1, &rows, StepMode::Decode, false),
            want,
            Allowance::Rms(tol_after(false)),
        ));
        commit(&mut cpu, &mut emu, &[1, 1], StepMode::Decode);
    }
    // flush both
    gdn::flush(&cpu_backend, &cpu.params, &mut cpu.cache, &mut cpu.seqs).expect("flush");
    let empty = RowBufs::new(&mut emu, &mut rng, shape, 0);
    dev.step(&mut emu, 0, &empty, StepMode::Decode, false);
    dev.commit(&mut emu, Accepted::All(0), None, StepMode::Decode);
    for (_, b, _, _) in &outputs {
        emu.dump(*b);
    }
    for b in [dev.state, dev.conv, dev.positions, dev.pending] {
        emu.dump(b);
    }
    let what = format!(
        "{target_name} {shape:?}{}",
        if with_prefill { " with prefill" } else { "" }
    );
    let dumps = emu.run(&exe, &format!("s{seed}"));
    for (name, b, want, allowance) in &outputs {
        let got = bf16s_as_f32(&dumps[&b.0]);
        check(
            &format!("{what}: {name}"),
            &got[..want.len()],
            want,
            allowance,
        );
    }
    let positions = u32s(&dumps[&dev.positions.0]);
    assert_eq!(
        positions,
        cpu.seqs.positions(&cpu_backend).expect("positions"),
        "{what}: positions"
    );
    assert_eq!(
        u32s(&dumps[&dev.pending.0]),
        [0, 0],
        "{what}: pending after the flush"
    );
    let state = f32s(&dumps[&dev.state.0]);
    let size = shape.state_len();
    let conv = &dumps[&dev.conv.0];
    for (i, &slot) in seq_slots.iter().enumerate() {
        let slot = slot as usize;
        let want = cpu.cache.state(&cpu_backend, slot).expect("state");
        check(
            &format!("{what}: final state of slot {slot}"),
            &state[slot * size..(slot + 1) * size],
            &want,
            &Allowance::Rms(if with_prefill { CHUNK } else { STEP_STATE }),
        );
        let position = positions[i] as usize;
        let want = cpu
            .cache
            .conv_window(&cpu_backend, slot, position)
            .expect("window");
        let c = shape.conv_dim();
        for r in 0..KERNEL - 1 {
            let Some(p) = (position + r).checked_sub(KERNEL - 1) else {
                continue;
            };
            let at = (slot * dev.ring + p % dev.ring) * c * 2;
            let got = &conv[at..at + 2 * c];
            let want_row = bytes_bf16(&want[r * c..(r + 1) * c]);
            assert!(
                got == want_row.as_slice(),
                "{what}: conv window row {r} of slot {slot} at position {position}"
            );
        }
    }
}

const SMALL: GdnShape = GdnShape {
    key_heads: 2,
    value_heads: 4,
    dk: 64,
    dv: 32,
};
const DK128_DV64: GdnShape = GdnShape {
    key_heads: 1,
    value_heads: 2,
    dk: 128,
    dv: 64,
};
/// The real model's head dimensions (one key head): the exact kernel, `gdn_step_dk128_dv128`.
const DK128_DV128: GdnShape = GdnShape {
    key_heads: 1,
    value_heads: 2,
    dk: 128,
    dv: 128,
};
/// The demo model's heads (dk = dv = 32): the chunk kernels' smallest dk, where two of the
/// state kernel's four warps hold no state rows.
const DK32: GdnShape = GdnShape {
    key_heads: 2,
    value_heads: 4,
    dk: 32,
    dv: 32,
};
const DV48: GdnShape = GdnShape {
    key_heads: 1,
    value_heads: 2,
    dk: 128,
    dv: 48,
};

#[test]
fn emulated_sm_90a_steps_match_the_cpu_reference() {
    scenario("sm_90a", SMALL, false, 11);
}

#[test]
fn emulated_sm_90a_prefill_and_steps_match_the_cpu_reference() {
    scenario("sm_90a", SMALL, true, 12);
    scenario("sm_90a", DV48, true, 13);
    scenario("sm_90a", DK128_DV64, true, 16);
    scenario("sm_90a", DK32, true, 19);
    scenario("sm_90a", DK128_DV128, true, 20);
}

#[test]
fn emulated_sm_121a_prefill_and_steps_match_the_cpu_reference() {
    scenario("sm_121a", DK128_DV64, true, 17);
    scenario("sm_121a", DK128_DV128, false, 21);
    scenario(
        "sm_121a",
        GdnShape {
            key_heads: 1,
            value_heads: 2,
            dk: 64,
            dv: 128,
        },
        true,
        18,
    );
}

#[test]
fn emulated_gfx1151_prefill_and_steps_match_the_cpu_reference() {
    scenario("gfx1151", SMALL, true, 14);
    scenario("gfx1151", DV48, false, 15);
}
