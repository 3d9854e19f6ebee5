//! The `attention` decode kernels run on the CPU: the source rendered for each mma.sync target is
//! compiled for the host with tests/attention_emulator.cpp (and the GDN and GEMM emulators'
//! layers it names) in place of its vendor layers, and `attention_decode_mma_g*` runs with the
//! arguments src/kernels/attention/mod.rs passes, beside `attention_decode` (its reference GPU
//! version), on the real head shape and awkward ones (a group of 12 heads, two n8 tiles; head_dim
//! 160, an odd number of k16 steps per k part; a group of one), contexts of one position, of a
//! split and one more, and of several splits, in a cache slot past the first. Each kernel's split
//! partials, merged on the host, must match the CPU reference (f64) to fp32 accuracy: the mma
//! kernel's bf16 hi + lo operands keep it there. One OS thread per GPU thread, blocks one after
//! another, cp.async copies at once: no timing, no races between blocks.
//!
//! Needs a C++20 compiler (`$CXX`, else clang++-19, clang++, g++ or c++).

use fp4spec::kernels::attention::reference::{self, AttentionShape};
use fp4spec::kernels::attention::{
    self, KERNEL_DECODE, KERNEL_DECODE_MMA_G8, KERNEL_DECODE_MMA_G16,
};
use fp4spec::kernels::table;
use fp4spec::rng::SplitMix64;
use fp4spec::target::{self, TargetFacts};
use half::bf16;
use std::path::{Path, PathBuf};

const EMULATOR: &str = include_str!("attention_emulator.cpp");
const GDN_EMULATOR: &str = include_str!("gdn_emulator.cpp");
const GEMM_EMULATOR: &str = include_str!("gemm_emulator.cpp");

// the decode kernels take no null or f32 arguments and no zeroed buffers
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
        &[KERNEL_DECODE, KERNEL_DECODE_MMA_G8, KERNEL_DECODE_MMA_G16],
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

/// The attention of one decode row at position `len - 1` of cache slot 1: each kernel's output
/// (`[heads][head_dim]`, its partials merged in f64), mma kernel first, and the reference's.
fn run_row(
    exe: &Path,
    target: &TargetFacts,
    shape: AttentionShape,
    len: usize,
    rng: &mut SplitMix64,
) -> [Vec<f64>; 3] {
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let split = target.attention.split_positions as usize;
    let capacity = len + 3;
    let splits = capacity.div_ceil(split);
    let q = rng.normal_vec(heads * hd, 1.0);
    let cache_len = 2 * capacity * kv_heads * hd;
    let keys: Vec<bf16> = rng
        .normal_vec(cache_len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let values: Vec<bf16> = rng
        .normal_vec(cache_len, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let mut emu = Emu::default();
    let q_buf = emu.buffer(bytes(&q, f32::to_le_bytes));
    let k_buf = emu.buffer(bytes(&keys, bf16::to_le_bytes));
    let v_buf = emu.buffer(bytes(&values, bf16::to_le_bytes));
    let slot = emu.buffer(1u32.to_le_bytes().to_vec());
    let position = emu.buffer((len as u32 - 1).to_le_bytes().to_vec());
    let mut outputs = Vec::new();
    let (splits32, kv32) = (splits as u32, kv_heads as u32);
    for (kernel, grid, threads, shared) in [
        (
            attention::decode_mma_kernel(shape),
            (kv32, splits32),
            256,
            attention::decode_mma_shared_bytes(shape, split),
        ),
        (
            KERNEL_DECODE,
            (splits32, kv32),
            (heads / kv_heads) as u32 * 32,
            0,
        ),
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
            ],
        );
        emu.dump(ml);
        emu.dump(acc);
        outputs.push((ml, acc));
    }
    let dumps = emu.run(exe, &format!("attention_{heads}x{kv_heads}x{hd}_len{len}"));
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
    let slot_rows = capacity * kv_heads * hd..capacity * kv_heads * hd + len * kv_heads * hd;
    let to_f32 = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let want = reference::attend(
        shape,
        &q,
        &to_f32(&keys[slot_rows.clone()]),
        &to_f32(&values[slot_rows]),
        len,
    );
    [
        merged(outputs[0]),
        merged(outputs[1]),
        want.iter().map(|&v| f64::from(v)).collect(),
    ]
}

#[test]
fn the_mma_decode_kernel_matches_the_reference_and_the_warp_kernel() {
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
            for len in [1, split + 1, 3 * split - 5] {
                let [mma, warp, want] = run_row(&exe, target, shape, len, &mut rng);
                let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
                let mma_name = attention::decode_mma_kernel(shape);
                for (name, got) in [(mma_name, &mma), (KERNEL_DECODE, &warp)] {
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(g, w)| (g - w).abs() / (w.abs() + rms))
                        .fold(
                            0.0f64,
                            |a, e| if e.is_nan() { f64::INFINITY } else { a.max(e) },
                        );
                    println!(
                        "{} {name} {heads}x{kv_heads}x{head_dim} len {len}: worst error {worst:.2e} \
                         of |want| + rms",
                        target.name
                    );
                    // the mma kernel's operands are bf16 hi + lo: each to ~2^-17 = 7.6e-6
                    assert!(
                        worst < 5e-5,
                        "{} {name} {heads}x{kv_heads}x{head_dim} len {len}: error {worst:.2e}",
                        target.name
                    );
                }
            }
        }
    }
}
