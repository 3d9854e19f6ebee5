//! The `attention` kernels run on the CPU: the source rendered for each mma.sync target is
//! compiled for the host with tests/attention_emulator.cpp (and the GDN and GEMM emulators'
//! layers it names) in place of its vendor layers, and `attention_decode_mma_g*` runs with the
//! arguments src/kernels/attention/mod.rs passes, beside `attention_decode` (its reference GPU
//! version), on the real head shape and awkward ones (a group of 12 heads, two n8 tiles; head_dim
//! 160, an odd number of k16 steps per k part; a group of one), contexts of one position, of a
//! split and one more, and of several splits, in a cache slot past the first. Each kernel's split
//! partials, merged on the host, must match the CPU reference (f64) to fp32 accuracy: the mma
//! kernel's bf16 hi + lo operands keep it there. `attention_prepare` and `attention_combine_gate`
//! read projections at a row stride wider than each (the model's one [q_gate | k | v] GEMM
//! output): against the CPU path of [`attention::prepare`] and an f64 merge of random partials.
//! One OS thread per GPU thread, blocks one after
//! another, cp.async copies at once: no timing, no races between blocks.
//!
//! Needs a C++20 compiler (`$CXX`, else clang++-19, clang++, g++ or c++).

use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::formats::nvfp4::{e4m3_decode, e4m3_encode};
use fp4spec::kernels::attention::reference::{self, AttentionShape};
use fp4spec::kernels::attention::{
    self, GatedAttention, KERNEL_COMBINE_GATE, KERNEL_DECODE, KERNEL_DECODE_FP8,
    KERNEL_DECODE_MMA_G8, KERNEL_DECODE_MMA_G8_FP8, KERNEL_DECODE_MMA_G16,
    KERNEL_DECODE_MMA_G16_FP8, KERNEL_PREPARE, KvCache, KvFormat, KvStore, Projections, RopeTable,
    Rows,
};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target::{self, TargetFacts};
use half::bf16;
use std::path::{Path, PathBuf};

const EMULATOR: &str = include_str!("attention_emulator.cpp");
const GDN_EMULATOR: &str = include_str!("gdn_emulator.cpp");
const GEMM_EMULATOR: &str = include_str!("gemm_emulator.cpp");

// the attention kernels take no null arguments
#[allow(dead_code)]
#[path = "emulation/driver.rs"]
mod driver;
mod emulation;
use driver::{Arg, Emu, driver_for};
use emulation::{build_host, section, splice};

/// The host binary of `target`'s rendered attention source (built once per test process).
fn emulator(target: &TargetFacts) -> PathBuf {
    build_host(
        "attention",
        &target.name,
        &["clang++-19", "clang++", "g++", "c++"],
        || emulator_source(target),
    )
}

/// `target`'s attention source with the emulator's layers and driver.
fn emulator_source(target: &TargetFacts) -> String {
    let rendered = table::rendered(&target.name, "attention").expect("attention rendered");
    let mut source = splice(
        rendered.source,
        "// ---- fp4spec portability layer",
        "// ---- end of portability layer ----",
        &format!(
            "{}{}",
            section(GDN_EMULATOR, "portability"),
            section(EMULATOR, "attention")
        ),
    );
    source = splice(
        &source,
        "// ---- mma.sync instructions ----",
        "// ---- end of mma.sync instructions ----",
        section(GDN_EMULATOR, "mma"),
    );
    source = splice(
        &source,
        "// ---- cp.async instructions ----",
        "// ---- end of cp.async instructions ----",
        section(GEMM_EMULATOR, "cp_async"),
    );
    let shared = "extern __shared__ __align__(16) u8 attention_shared[];";
    assert!(
        source.contains(shared),
        "the mma kernel's dynamic shared memory"
    );
    source = source.replace(shared, "u8* attention_shared = emu::dynamic_smem;");
    source.push_str(&driver_for(
        section(GDN_EMULATOR, "driver"),
        &[
            KERNEL_DECODE,
            KERNEL_DECODE_MMA_G8,
            KERNEL_DECODE_MMA_G16,
            KERNEL_DECODE_FP8,
            KERNEL_DECODE_MMA_G8_FP8,
            KERNEL_DECODE_MMA_G16_FP8,
            KERNEL_PREPARE,
            KERNEL_COMBINE_GATE,
        ],
    ));
    source
}

fn bytes<T: Copy, const N: usize>(v: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// One test's cache as the kernels read it: `[2 slots][capacity][kv_heads][head_dim]` bf16
/// values or e4m3 codes.
enum Cache {
    Bf16(Vec<bf16>),
    Fp8(Vec<u8>),
}

impl Cache {
    /// `len` random values of N(0, 1) in `format` (e4m3: the codes of value / scale).
    fn random(rng: &mut SplitMix64, len: usize, format: KvFormat, value: bool) -> Self {
        let v = rng.normal_vec(len, 1.0);
        match format {
            KvFormat::Bf16 => Self::Bf16(v.into_iter().map(bf16::from_f32).collect()),
            KvFormat::Fp8E4m3 {
                key_scale,
                value_scale,
            } => {
                let scale = if value { value_scale } else { key_scale };
                Self::Fp8(v.into_iter().map(|x| e4m3_encode(x / scale)).collect())
            }
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Self::Bf16(v) => bytes(v, bf16::to_le_bytes),
            Self::Fp8(v) => v.clone(),
        }
    }

    /// Elements `range` as the reference reads them (e4m3: decoded times `scale`).
    fn values(&self, range: std::ops::Range<usize>, scale: f32) -> Vec<f32> {
        match self {
            Self::Bf16(v) => v[range].iter().map(|x| x.to_f32()).collect(),
            Self::Fp8(v) => v[range].iter().map(|&c| e4m3_decode(c) * scale).collect(),
        }
    }
}

/// The split kernels of `format` (mma first, then warp).
fn kernels(shape: AttentionShape, format: KvFormat) -> [&'static str; 2] {
    [
        attention::decode_mma_kernel(shape, format),
        attention::decode_warp_kernel(format),
    ]
}

/// The attention of one decode row `q` at position `len - 1` of cache slot 1 over `keys` and
/// `values` (`capacity` = len + 3 positions per slot) in `splits` splits (None: one per chunk of
/// split_positions; fewer: each takes every splits-th chunk): each kernel's output
/// (`[heads][head_dim]`, its partials merged in f64), mma kernel first.
#[allow(clippy::too_many_arguments)]
fn run_kernels(
    exe: &Path,
    target: &TargetFacts,
    shape: AttentionShape,
    (len, splits): (usize, Option<usize>),
    format: KvFormat,
    q: &[f32],
    keys: &Cache,
    values: &Cache,
    name: &str,
) -> [Vec<f64>; 2] {
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let split = target.attention.split_positions as usize;
    let capacity = len + 3;
    let splits = splits.unwrap_or(capacity.div_ceil(split));
    let (key_scale, value_scale) = format.scales();
    let mut emu = Emu::default();
    let q_buf = emu.buffer(bytes(q, f32::to_le_bytes));
    let k_buf = emu.buffer(keys.bytes());
    let v_buf = emu.buffer(values.bytes());
    let slot = emu.buffer(1u32.to_le_bytes().to_vec());
    let position = emu.buffer((len as u32 - 1).to_le_bytes().to_vec());
    let mut outputs = Vec::new();
    let (splits32, kv32) = (splits as u32, kv_heads as u32);
    let [mma, warp] = kernels(shape, format);
    for (kernel, grid, threads, shared) in [
        (
            mma,
            (kv32, splits32),
            256,
            attention::decode_mma_shared_bytes(shape, split),
        ),
        (warp, (splits32, kv32), (heads / kv_heads) as u32 * 32, 0),
    ] {
        // NaN: a partial the kernel leaves unwritten poisons the merge
        let ml = emu.buffer(bytes(&vec![f32::NAN; 2 * heads * splits], f32::to_le_bytes));
        let acc = emu.buffer(bytes(
            &vec![f32::NAN; heads * splits * hd],
            f32::to_le_bytes,
        ));
        emu.launch(
            kernel,
            grid,
            threads,
            shared,
            &[
                Arg::Ptr(q_buf),
                Arg::Ptr(k_buf),
                Arg::Ptr(v_buf),
                Arg::Ptr(slot),
                Arg::Ptr(position),
                Arg::Ptr(ml),
                Arg::Ptr(acc),
                Arg::U32(heads as u32),
                Arg::U32(kv_heads as u32),
                Arg::U32(hd as u32),
                Arg::U32(capacity as u32),
                Arg::U32(splits as u32),
                Arg::F32(key_scale),
                Arg::F32(value_scale),
            ],
        );
        emu.dump(ml);
        emu.dump(acc);
        outputs.push((ml, acc));
    }
    let dumps = emu.run(exe, name);
    let merged = |(ml, acc): (driver::Buf, driver::Buf)| -> Vec<f64> {
        let (ml, acc) = (f32s(&dumps[&ml.0]), f32s(&dumps[&acc.0]));
        let mut out = vec![0.0f64; heads * hd];
        for h in 0..heads {
            let parts = h * splits..(h + 1) * splits;
            let m = parts
                .clone()
                .map(|p| f64::from(ml[2 * p]))
                .fold(f64::NEG_INFINITY, f64::max);
            let mut total = 0.0;
            for p in parts {
                let w = (f64::from(ml[2 * p]) - m).exp2();
                if w == 0.0 {
                    continue; // an empty split: (-inf, 0) and an accumulator never written
                }
                total += f64::from(ml[2 * p + 1]) * w;
                for d in 0..hd {
                    out[h * hd + d] += f64::from(acc[p * hd + d]) * w;
                }
            }
            for v in &mut out[h * hd..(h + 1) * hd] {
                *v /= total;
            }
        }
        out
    };
    [merged(outputs[0]), merged(outputs[1])]
}

/// [`run_kernels`] on a random row and cache in `format`, and the reference's output, last.
fn run_row(
    exe: &Path,
    target: &TargetFacts,
    shape: AttentionShape,
    (len, splits): (usize, Option<usize>),
    format: KvFormat,
    rng: &mut SplitMix64,
) -> [Vec<f64>; 3] {
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let capacity = len + 3;
    let q = rng.normal_vec(heads * hd, 1.0);
    let cache_len = 2 * capacity * kv_heads * hd;
    let keys = Cache::random(rng, cache_len, format, false);
    let values = Cache::random(rng, cache_len, format, true);
    let name = format!(
        "attention_{}_{heads}x{kv_heads}x{hd}_len{len}_splits{splits:?}",
        format.name()
    );
    let [mma, warp] = run_kernels(
        exe,
        target,
        shape,
        (len, splits),
        format,
        &q,
        &keys,
        &values,
        &name,
    );
    let (key_scale, value_scale) = format.scales();
    let slot_rows = capacity * kv_heads * hd..capacity * kv_heads * hd + len * kv_heads * hd;
    let want = reference::attend(
        shape,
        &q,
        &keys.values(slot_rows.clone(), key_scale),
        &values.values(slot_rows, value_scale),
        len,
    );
    [mma, warp, want.iter().map(|&v| f64::from(v)).collect()]
}

#[test]
fn the_mma_decode_kernel_matches_the_reference_and_the_warp_kernel() {
    // e4m3 scales that put stored keys near 4 and values near 1/4 (many of them subnormal)
    let fp8 = KvFormat::Fp8E4m3 {
        key_scale: 0.25,
        value_scale: 4.0,
    };
    for target in target::all().iter().filter(|t| t.instructions.staged_mma()) {
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0xa77e);
        let split = target.attention.split_positions as usize;
        for (heads, kv_heads, head_dim) in [(16, 2, 256), (24, 2, 160), (6, 6, 96), (4, 2, 32)] {
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim,
            };
            // (splits: None = one per chunk; 2 and 1 = each split several chunks, every
            // second / every one, with the online softmax across them)
            for (format, len, splits) in [
                (KvFormat::Bf16, 1, None),
                (KvFormat::Bf16, split + 1, None),
                (KvFormat::Bf16, 3 * split - 5, None),
                (KvFormat::Bf16, 5 * split - 7, Some(2)),
                (KvFormat::Bf16, 2 * split + 1, Some(1)),
                (fp8, 1, None),
                (fp8, 2 * split + 3, None),
                (fp8, 4 * split + 9, Some(2)),
            ] {
                let [mma, warp, want] =
                    run_row(&exe, target, shape, (len, splits), format, &mut rng);
                let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
                let [mma_name, warp_name] = kernels(shape, format);
                for (name, got) in [(mma_name, &mma), (warp_name, &warp)] {
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(g, w)| (g - w).abs() / (w.abs() + rms))
                        .fold(
                            0.0f64,
                            |a, e| if e.is_nan() { f64::INFINITY } else { a.max(e) },
                        );
                    println!(
                        "{} {name} {heads}x{kv_heads}x{head_dim} len {len} splits {splits:?}: \
                         worst error {worst:.2e} of |want| + rms",
                        target.name
                    );
                    // the mma kernel's operands are bf16 hi + lo: each to ~2^-17 = 7.6e-6
                    assert!(
                        worst < 5e-5,
                        "{} {name} {heads}x{kv_heads}x{head_dim} len {len} splits {splits:?}: \
                         error {worst:.2e}",
                        target.name
                    );
                }
            }
        }
    }
}

/// Every e4m3 code through both fp8 kernels, exactly: one position (softmax weight 1) and q = 0,
/// so the output is the cached value row itself times the value scale; head_dim 256 holds the
/// 256 codes (NaN ones included, which must come out NaN).
#[test]
fn the_fp8_kernels_decode_every_e4m3_code_exactly() {
    let shape = AttentionShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 256,
    };
    let value_scale = 0.5;
    let format = KvFormat::Fp8E4m3 {
        key_scale: 1.0,
        value_scale,
    };
    let capacity = 1 + 3;
    let codes: Vec<u8> = (0..=255u8).collect();
    // slot 1, position 0 holds the codes; every other row zeros
    let mut values = vec![0u8; 2 * capacity * 256];
    values[capacity * 256..capacity * 256 + 256].copy_from_slice(&codes);
    let keys = Cache::Fp8(vec![0x38; 2 * capacity * 256]); // 1.0 everywhere
    let q = vec![0.0f32; 4 * 256];
    for target in target::all().iter().filter(|t| t.instructions.staged_mma()) {
        let exe = emulator(target);
        let outputs = run_kernels(
            &exe,
            target,
            shape,
            (1, None),
            format,
            &q,
            &keys,
            &Cache::Fp8(values.clone()),
            "attention_fp8_every_code",
        );
        for (name, out) in kernels(shape, format).iter().zip(&outputs) {
            for h in 0..4 {
                for (c, got) in codes.iter().zip(&out[h * 256..(h + 1) * 256]) {
                    let want = f64::from(e4m3_decode(*c) * value_scale);
                    // equal values (the products' accumulators turn -0 into +0)
                    assert!(
                        *got == want || (got.is_nan() && want.is_nan()),
                        "{} {name}: code {c:#04x} gave {got}, want {want}",
                        target.name
                    );
                }
            }
        }
    }
}

fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    bytes(v, |x| x.to_bits().to_le_bytes())
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

/// `attention_prepare` and `attention_combine_gate` on two rows whose q_gate, k and v are the
/// column ranges of one buffer, rows `projection_width + 24` elements apart with NaN between
/// (the model's fused GEMM output; a read off its range poisons the results): prepare's q and
/// cached keys against the CPU path on three packed matrices (fp32 in another order: within a
/// few ulps), its cached values equal; the combine's gated output against an f64 merge of
/// random partials of 3 and 1 used splits (the unused ones NaN), within a bf16 rounding.
#[test]
fn prepare_and_combine_read_strided_projections() {
    let shape = AttentionShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let (q_width, kv_width) = (shape.q_gate_width(), shape.kv_width());
    let stride = shape.projection_width() + 24;
    let (capacity, rotary_dim) = (8, 32);
    let (slots, positions) = ([1u32, 0], [5u32, 2]);
    let cpu = Backend::Cpu;
    for target in target::all().iter().filter(|t| t.instructions.staged_mma()) {
        let exe = emulator(target);
        let mut rng = SplitMix64::new(0x57e1);
        let random_bf16 = |rng: &mut SplitMix64, n: usize| -> Vec<bf16> {
            rng.normal_vec(n, 1.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        };
        let (q_gate, k, v) = (
            random_bf16(&mut rng, 2 * q_width),
            random_bf16(&mut rng, 2 * kv_width),
            random_bf16(&mut rng, 2 * kv_width),
        );
        let (q_norm, k_norm) = (rng.normal_vec(hd, 0.3), rng.normal_vec(hd, 0.3));

        // the CPU path on three packed matrices
        let rope = RopeTable::new(&cpu, rotary_dim, 1e7, capacity).expect("rope");
        let (qn, kn) = (
            DeviceVec::Host(q_norm.clone()),
            DeviceVec::Host(k_norm.clone()),
        );
        let layer = GatedAttention {
            shape,
            q_norm: &qn,
            k_norm: &kn,
            eps: 1e-6,
            rope: &rope,
        };
        let host = |v: &[bf16]| DeviceVec::Host(v.to_vec());
        let (qg_host, k_host, v_host) = (host(&q_gate), host(&k), host(&v));
        let rows = Rows {
            count: 2,
            slot: DeviceVec::Host(slots.to_vec()),
            position: DeviceVec::Host(positions.to_vec()),
        };
        let mut cache = KvCache::new(&cpu, shape, 2, capacity, KvFormat::Bf16).expect("cache");
        let mut q = DeviceVec::Host(vec![0.0f32; 2 * heads * hd]);
        attention::prepare(
            &cpu,
            &layer,
            &Projections::separate(shape, &qg_host, &k_host, &v_host),
            &rows,
            &mut cache,
            &mut q,
        )
        .expect("CPU prepare");
        let DeviceVec::Host(want_q) = q else {
            unreachable!("a host buffer")
        };
        let cached = |store: &KvStore| -> Vec<f32> {
            match store {
                KvStore::Bf16(DeviceVec::Host(v)) => v.iter().map(|x| x.to_f32()).collect(),
                _ => unreachable!("a host bf16 cache"),
            }
        };
        let (want_keys, want_values) = (cached(&cache.keys), cached(&cache.values));

        // the kernels on one strided buffer
        let mut fused = vec![bf16::NAN; 2 * stride];
        for r in 0..2 {
            let row = &mut fused[r * stride..];
            row[..q_width].copy_from_slice(&q_gate[r * q_width..][..q_width]);
            row[q_width..][..kv_width].copy_from_slice(&k[r * kv_width..][..kv_width]);
            row[q_width + kv_width..][..kv_width].copy_from_slice(&v[r * kv_width..][..kv_width]);
        }
        let mut emu = Emu::default();
        let qg_buf = emu.buffer(bf16_bytes(&fused));
        let k_buf = emu.buffer(bf16_bytes(&fused[q_width..]));
        let v_buf = emu.buffer(bf16_bytes(&fused[q_width + kv_width..]));
        let u32s = |v: &[u32]| bytes(v, u32::to_le_bytes);
        let DeviceVec::Host(table) = &rope.cos_sin else {
            unreachable!("a host table")
        };
        let (slot_buf, pos_buf) = (emu.buffer(u32s(&slots)), emu.buffer(u32s(&positions)));
        let q_out = emu.buffer(bytes(&vec![f32::NAN; 2 * heads * hd], f32::to_le_bytes));
        let cache_elems = 2 * capacity * kv_width;
        let (k_cache, v_cache) = (emu.zeros(2 * cache_elems), emu.zeros(2 * cache_elems));
        let items = (2 * (heads + kv_heads)) as u32;
        let warps = target.attention.prepare_warps_per_block;
        let stride32 = stride as u32;
        let args = [
            Arg::Ptr(qg_buf),
            Arg::Ptr(k_buf),
            Arg::Ptr(v_buf),
            Arg::Ptr(emu.buffer(bytes(&q_norm, f32::to_le_bytes))),
            Arg::Ptr(emu.buffer(bytes(&k_norm, f32::to_le_bytes))),
            Arg::Ptr(emu.buffer(bytes(table, f32::to_le_bytes))),
            Arg::Ptr(slot_buf),
            Arg::Ptr(pos_buf),
            Arg::Ptr(q_out),
            Arg::Ptr(k_cache),
            Arg::Ptr(v_cache),
            Arg::U32(2),
            Arg::U32(stride32),
            Arg::U32(stride32),
            Arg::U32(stride32),
            Arg::U32(heads as u32),
            Arg::U32(kv_heads as u32),
            Arg::U32(hd as u32),
            Arg::U32(rotary_dim as u32 / 2),
            Arg::U32(capacity as u32),
            Arg::F32(1e-6),
            Arg::U32(0),
            Arg::F32(1.0),
            Arg::F32(1.0),
        ];
        emu.launch(
            KERNEL_PREPARE,
            (items.div_ceil(warps), 1),
            warps * 32,
            0,
            &args,
        );

        // the combine: row 0 at a position of three used splits, row 1 of one, four splits
        let split = target.attention.split_positions;
        let splits = 4usize;
        let combine_positions = [3 * split - 1, 2];
        let used = |r: usize| ((combine_positions[r] + split) / split) as usize;
        let mut ml = vec![f32::NAN; 2 * heads * splits * 2];
        let mut acc = vec![f32::NAN; 2 * heads * splits * hd];
        for item in 0..2 * heads {
            for s in 0..used(item / heads) {
                let p = item * splits + s;
                ml[2 * p] = 2.0 * rng.uniform() - 1.0;
                ml[2 * p + 1] = 0.5 + rng.uniform();
                for (d, a) in acc[p * hd..(p + 1) * hd].iter_mut().enumerate() {
                    *a = rng.normal_vec(1, 1.0)[0] + d as f32 * 0.01;
                }
            }
        }
        let out = emu.buffer(bf16_bytes(&vec![bf16::NAN; 2 * heads * hd]));
        let (ml_buf, acc_buf) = (
            emu.buffer(bytes(&ml, f32::to_le_bytes)),
            emu.buffer(bytes(&acc, f32::to_le_bytes)),
        );
        let combine_pos = emu.buffer(u32s(&combine_positions));
        let dims_per_block = 32u32;
        let combine_warps = target.attention.combine_warps_per_block;
        emu.launch(
            KERNEL_COMBINE_GATE,
            ((2 * heads) as u32, hd as u32 / dims_per_block),
            combine_warps * 32,
            0,
            &[
                Arg::Ptr(ml_buf),
                Arg::Ptr(acc_buf),
                Arg::Ptr(qg_buf),
                Arg::Ptr(combine_pos),
                Arg::Ptr(out),
                Arg::U32(2),
                Arg::U32(stride32),
                Arg::U32(heads as u32),
                Arg::U32(hd as u32),
                Arg::U32(splits as u32),
                Arg::U32(dims_per_block),
            ],
        );
        for b in [q_out, k_cache, v_cache, out] {
            emu.dump(b);
        }
        let dumps = emu.run(&exe, "attention_strided_projections");

        let got_q = f32s(&dumps[&q_out.0]);
        let q_rms = (want_q.iter().map(|v| v * v).sum::<f32>() / want_q.len() as f32).sqrt();
        for (i, (g, w)) in got_q.iter().zip(&want_q).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (w.abs() + q_rms),
                "{}: q[{i}] {g} against {w}",
                target.name
            );
        }
        let got_keys = bf16s(&dumps[&k_cache.0]);
        for (i, (g, w)) in got_keys.iter().zip(&want_keys).enumerate() {
            // one bf16 rounding of fp32 values computed in another order
            assert!(
                (g - w).abs() <= w.abs() / 128.0 + 1e-6,
                "{}: cached key {i} {g} against {w}",
                target.name
            );
        }
        assert_eq!(
            bf16s(&dumps[&v_cache.0]),
            want_values,
            "{}: cached values",
            target.name
        );
        let got = bf16s(&dumps[&out.0]);
        for item in 0..2 * heads {
            let (row, head) = (item / heads, item % heads);
            let parts: Vec<usize> = (0..used(row)).map(|s| item * splits + s).collect();
            let max = parts
                .iter()
                .map(|&p| f64::from(ml[2 * p]))
                .fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = parts
                .iter()
                .map(|&p| f64::from(ml[2 * p + 1]) * (f64::from(ml[2 * p]) - max).exp2())
                .sum();
            for d in 0..hd {
                let merged: f64 = parts
                    .iter()
                    .map(|&p| f64::from(acc[p * hd + d]) * (f64::from(ml[2 * p]) - max).exp2())
                    .sum::<f64>()
                    / total;
                let gate = f64::from(q_gate[row * q_width + head * 2 * hd + hd + d].to_f32());
                let want = merged / (1.0 + (-gate).exp());
                let g = f64::from(got[item * hd + d]);
                assert!(
                    (g - want).abs() <= want.abs() / 128.0 + 1e-6,
                    "{}: row {row} head {head} dimension {d}: {g} against {want}",
                    target.name
                );
            }
        }
    }
}
