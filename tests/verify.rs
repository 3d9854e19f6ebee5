//! The verification reference: greedy equals the argmax chain; sampling verification is lossless
//! (the first emitted token has the processed target distribution, chi-square) for every control,
//! and a verifier that drops logit bias is caught; bad values are per-sequence errors.

use fp4spec::kernels::verify::reference::{
    self as verify, AcceptanceStats, Drafts, RowError, SamplingParams,
};
use fp4spec::rng::SplitMix64;

fn logits(rng: &mut SplitMix64, rows: usize, vocab: usize, spread: f32) -> Vec<f32> {
    rng.normal_vec(rows * vocab, spread)
}

#[test]
fn greedy_verification_is_the_argmax_chain_for_ragged_batches() {
    let mut rng = SplitMix64::new(1);
    let params = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut stats = AcceptanceStats::default();
    for sequence in 0..200 {
        let (vocab, n) = (50, sequence % 5); // ragged: 0..=4 drafts
        let target = logits(&mut rng, n + 1, vocab, 2.0);
        let argmaxes: Vec<u32> = (0..=n)
            .map(|i| {
                verify::greedy_token(&target[i * vocab..(i + 1) * vocab], &params, i).expect("row")
            })
            .collect();
        let agree = rng.next_u64() as usize % (n + 1); // drafts match the first `agree`
        let drafts: Vec<u32> = (0..n)
            .map(|i| {
                if i < agree {
                    argmaxes[i]
                } else {
                    (argmaxes[i] + 1) % vocab as u32
                }
            })
            .collect();
        let out = verify::verify(&target, vocab, &Drafts::PointMass(&drafts), &params, 7)
            .expect("verifies");
        assert_eq!(out.accepted, agree.min(n), "sequence {sequence}");
        assert_eq!(
            out.emitted,
            argmaxes[..=out.accepted].to_vec(),
            "sequence {sequence}"
        );
        stats.record(n, &out);
    }
    let rates = stats.rates();
    assert_eq!(rates.len(), 4);
    assert!(rates.iter().all(|r| (0.0..=1.0).contains(r)));
}

/// Chi-square of observed counts against probabilities (cells with expected >= 5 only; the
/// rest pooled).
fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let trials: u64 = counts.iter().sum();
    let (mut statistic, mut cells, mut pooled_obs, mut pooled_exp) = (0.0, 0usize, 0.0, 0.0);
    for (c, q) in counts.iter().zip(p) {
        let expected = q * trials as f64;
        if expected >= 5.0 {
            statistic += (*c as f64 - expected).powi(2) / expected;
            cells += 1;
        } else {
            pooled_obs += *c as f64;
            pooled_exp += expected;
        }
    }
    if pooled_exp > 0.0 {
        statistic += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        cells += 1;
    }
    (statistic, cells.saturating_sub(1))
}

/// The chi-square quantile at 1 - 1e-4 for `df` degrees of freedom (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.719; // standard normal quantile at 1 - 1e-4
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

const VOCAB: usize = 16;
const TRIALS: u64 = 40_000;

/// First-token counts of sampling verification over `TRIALS` seeds, with 3 drafts.
fn first_token_counts(
    target: &[f32],
    draft_logits: &[f32],
    params: &SamplingParams,
    point_mass: bool,
) -> Vec<u64> {
    let mut counts = vec![0u64; VOCAB];
    let mut rng = SplitMix64::new(99);
    for trial in 0..TRIALS {
        let params = SamplingParams {
            seed: trial,
            ..params.clone()
        };
        // drafts drawn from q (the drafter's processed distribution), as a real drafter would
        let tokens: Vec<u32> = (0..3)
            .map(|i| {
                if point_mass {
                    rng.next_u64() as u32 % VOCAB as u32
                } else {
                    verify::sample(
                        &draft_logits[i * VOCAB..(i + 1) * VOCAB],
                        &params,
                        1_000_000 + i as u64,
                    )
                    .expect("draft")
                }
            })
            .collect();
        let drafts = if point_mass {
            Drafts::PointMass(&tokens)
        } else {
            Drafts::Sampled {
                tokens: &tokens,
                logits: draft_logits,
            }
        };
        let out = verify::verify(target, VOCAB, &drafts, &params, 5).expect("verifies");
        counts[out.emitted[0] as usize] += 1;
    }
    counts
}

fn controls() -> Vec<(&'static str, SamplingParams)> {
    let base = SamplingParams::default();
    vec![
        ("plain", base.clone()),
        (
            "temperature 0.6",
            SamplingParams {
                temperature: 0.6,
                ..base.clone()
            },
        ),
        (
            "top-k 5",
            SamplingParams {
                top_k: 5,
                ..base.clone()
            },
        ),
        (
            "top-p 0.7",
            SamplingParams {
                top_p: 0.7,
                ..base.clone()
            },
        ),
        (
            "min-p 0.15",
            SamplingParams {
                min_p: 0.15,
                ..base.clone()
            },
        ),
        (
            "min-p 0.05 + logit bias",
            SamplingParams {
                min_p: 0.05,
                logit_bias: vec![(3, 1.5), (7, -1.5), (12, 1.0)],
                ..base
            },
        ),
    ]
}

#[test]
fn sampling_verification_is_lossless_for_every_control() {
    let mut rng = SplitMix64::new(2);
    let target = logits(&mut rng, 4, VOCAB, 1.5);
    // a drafter far from the target: different logits, sharper
    let draft = logits(&mut rng, 3, VOCAB, 3.0);
    for (name, params) in controls() {
        let p = verify::processed(&target[..VOCAB], &params, 0).expect("processed");
        for point_mass in [false, true] {
            let counts = first_token_counts(&target, &draft, &params, point_mass);
            let (statistic, df) = chi_square(&counts, &p);
            println!(
                "{name} (point mass {point_mass}): chi2 {statistic:.1}, df {df}, critical {:.1}",
                critical(df)
            );
            assert!(
                statistic < critical(df),
                "{name} (point mass {point_mass}): chi2 {statistic:.1} >= {:.1}",
                critical(df)
            );
            for (token, &c) in counts.iter().enumerate() {
                assert!(
                    p[token] > 0.0 || c == 0,
                    "{name}: token {token} emitted outside the support"
                );
            }
        }
    }
}

/// The broken verifier vLLM ships (logit bias not applied to p) must be rejected by the same
/// statistic: otherwise the losslessness test could not fail.
#[test]
fn a_verifier_that_drops_logit_bias_is_caught() {
    let mut rng = SplitMix64::new(3);
    let target = logits(&mut rng, 4, VOCAB, 1.5);
    let draft = logits(&mut rng, 3, VOCAB, 3.0);
    let params = SamplingParams {
        min_p: 0.05,
        logit_bias: vec![(3, 1.5), (7, -1.5), (12, 1.0)],
        ..SamplingParams::default()
    };
    let p = verify::processed(&target[..VOCAB], &params, 0).expect("processed");
    let broken = SamplingParams {
        logit_bias: Vec::new(),
        ..params
    };
    let counts = first_token_counts(&target, &draft, &broken, false);
    let (statistic, df) = chi_square(&counts, &p);
    assert!(
        statistic > critical(df),
        "the broken verifier passed: chi2 {statistic:.1} < {:.1}",
        critical(df)
    );
}

#[test]
fn processing_follows_the_documented_order_and_ties() {
    let params = SamplingParams {
        top_k: 2,
        ..SamplingParams::default()
    };
    // tokens 1 and 2 tie for second place: the lower id stays
    let p = verify::processed(&[0.0, 1.0, 1.0, 3.0], &params, 0).expect("ok");
    assert!(
        p[3] > 0.0 && p[1] > 0.0 && p[2] == 0.0 && p[0] == 0.0,
        "{p:?}"
    );
    let p = verify::processed(
        &[0.0, 0.0, 5.0],
        &SamplingParams {
            top_p: 0.5,
            ..SamplingParams::default()
        },
        0,
    )
    .expect("ok");
    assert_eq!(p, vec![0.0, 0.0, 1.0]);
    let p = verify::processed(
        &[0.0, -10.0, 0.1],
        &SamplingParams {
            min_p: 0.5,
            ..SamplingParams::default()
        },
        0,
    )
    .expect("ok");
    assert!(p[1] == 0.0 && p[0] > 0.0 && p[2] > 0.0);
    let p = verify::processed(
        &[0.0, 1.0],
        &SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(0, 2.0)],
            ..SamplingParams::default()
        },
        0,
    )
    .expect("ok");
    assert_eq!(p, vec![1.0, 0.0], "greedy after bias");
    assert!(
        (verify::processed(&[1.0, 2.0, 3.0], &SamplingParams::default(), 0)
            .expect("ok")
            .iter()
            .sum::<f64>()
            - 1.0)
            .abs()
            < 1e-12
    );
}

/// `f = y - k` rounds to 1 just below zero: such a token is the heaviest of octave -1, never
/// heavier than the lightest of octave 0.
#[test]
fn a_logit_just_below_zero_is_the_top_of_the_octave_below() {
    let c = verify::log2_scale(1.0);
    let top_of_octave_below = verify::exp2_mantissa(1.0);
    assert!((1 << 23..=1 << 24).contains(&top_of_octave_below));
    for z in [-1e-12f32, -1e-40, -2e-8] {
        assert_eq!(
            verify::octave_mantissa(z, c),
            (-1, top_of_octave_below),
            "z = {z:e}"
        );
        assert!(verify::weight(-1, top_of_octave_below, 0) <= verify::weight(0, 1 << 23, 0));
    }
    assert_eq!(verify::octave_mantissa(0.0, c), (0, 1 << 23));
}

#[test]
fn draws_are_keyed_on_seed_and_position_only() {
    let mut rng = SplitMix64::new(4);
    let row = logits(&mut rng, 1, 1000, 1.0);
    let params = SamplingParams {
        seed: 42,
        ..SamplingParams::default()
    };
    let a = verify::sample(&row, &params, 17).expect("sample");
    assert_eq!(
        a,
        verify::sample(&row, &params, 17).expect("sample"),
        "reproducible"
    );
    let distinct: std::collections::BTreeSet<u32> = (0..50)
        .map(|pos| verify::sample(&row, &params, pos).expect("sample"))
        .collect();
    assert!(distinct.len() > 10, "positions draw independently");
    let u = verify::uniform(1, 2, 3, 4);
    assert!(u > 0.0 && u < 1.0 && u != verify::uniform(1, 2, 3, 5));
}

#[test]
fn bad_values_are_per_sequence_errors_never_tokens() {
    let vocab = 8;
    let sampling = SamplingParams::default();
    // a NaN in a row that decides a token is an error: the draft (token 1) is certain under
    // row 0, so row 1 (with the non-finite value) decides the bonus token
    let mut certain = vec![-100.0f32; 2 * vocab];
    certain[1] = 100.0;
    certain[vocab + 3] = f32::INFINITY;
    assert!(matches!(
        verify::verify(&certain, vocab, &Drafts::PointMass(&[1]), &sampling, 0),
        Err(RowError::NonFiniteLogit {
            row: 1,
            token: 3,
            ..
        })
    ));
    assert!(matches!(
        verify::sample(&[0.0, f32::NAN], &sampling, 0),
        Err(RowError::NonFiniteLogit { .. })
    ));
    assert!(matches!(
        verify::sample(&[f32::NEG_INFINITY; 4], &sampling, 0),
        Err(RowError::EmptySupport { .. })
    ));
    for bad in [-1.0, f32::NAN] {
        let params = SamplingParams {
            temperature: bad,
            ..SamplingParams::default()
        };
        assert!(
            matches!(
                verify::sample(&[0.0, 1.0], &params, 0),
                Err(RowError::BadParameter(_))
            ),
            "temperature {bad}"
        );
    }
    let params = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    };
    assert!(matches!(
        verify::sample(&[0.0, 1.0], &params, 0),
        Err(RowError::BadParameter(_))
    ));
    let params = SamplingParams {
        logit_bias: vec![(9, 1.0)],
        ..SamplingParams::default()
    };
    assert!(matches!(
        verify::sample(&[0.0, 1.0], &params, 0),
        Err(RowError::TokenOutOfRange { token: 9, vocab: 2 })
    ));
    assert!(matches!(
        verify::verify(&[0.0; 16], vocab, &Drafts::PointMass(&[8]), &sampling, 0),
        Err(RowError::TokenOutOfRange { token: 8, .. })
    ));
    assert!(matches!(
        verify::verify(&[0.0; 15], vocab, &Drafts::PointMass(&[1]), &sampling, 0),
        Err(RowError::BadParameter(_))
    ));
}

// ---- the kernels, run on a CPU emulation of CUDA, against the reference ----
//
// There is no GPU here, so the rendered sm_90a source of `verify.cu` is compiled as host C++
// against tests/verify_support/cuda_emu.h (threads as fibers, real __syncthreads and warp
// exchanges, shuffled scheduling) and run through the same layout, batch encoding, launch grids
// and decoding as the CUDA backend. Same tokens and accept counts as the reference, exactly.

// the shared splicing of emulated layers (only `splice` here)
#[allow(dead_code)]
#[path = "emulation/mod.rs"]
mod layers;

mod emulation {
    use crate::batches;
    use fp4spec::kernels::table;
    use fp4spec::kernels::verify::{AcceptanceStats, Batch, DraftKind, Layout, device, reference};
    use fp4spec::target::VerifyTiles;
    use std::ffi::{CStr, CString, c_char, c_int, c_void};
    use std::path::PathBuf;
    use std::sync::Mutex;

    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlerror() -> *const c_char;
    }
    const RTLD_NOW: c_int = 2;

    type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, *const c_void) -> c_int;

    const WRAPPER: &str = r#"
static unsigned long long emu_trace[3] = {0, 0, 0};
#define VERIFY_TRACE(what) (++emu_trace[what])
#include "verify.cu"
extern "C" int emu_launch(const char* kernel, unsigned gx, unsigned gy, unsigned threads, const void* args) {
    const VerifyArgs a = *static_cast<const VerifyArgs*>(args);
    if (!std::strcmp(kernel, "verify_histogram")) return emu::launch(gx, gy, threads, [a] { verify_histogram(a); });
    if (!std::strcmp(kernel, "verify_select")) return emu::launch(gx, gy, threads, [a] { verify_select(a); });
    if (!std::strcmp(kernel, "verify_finish")) return emu::launch(gx, gy, threads, [a] { verify_finish(a); });
    if (!std::strcmp(kernel, "verify_residual")) return emu::launch(gx, gy, threads, [a] { verify_residual(a); });
    if (!std::strcmp(kernel, "verify_greedy")) return emu::launch(gx, gy, threads, [a] { verify_greedy(a); });
    if (!std::strcmp(kernel, "verify_topk")) return emu::launch(gx, gy, threads, [a] { verify_topk(a); });
    std::fprintf(stderr, "emulation: no kernel %s\n", kernel);
    return 2;
}
extern "C" unsigned long long emu_take_trace(int what) {
    const unsigned long long n = emu_trace[what];
    emu_trace[what] = 0;
    return n;
}
"#;

    /// The emulated kernels: `emu_launch` and `emu_take_trace`.
    #[derive(Clone, Copy)]
    pub struct Kernels {
        launch: LaunchFn,
        trace: unsafe extern "C" fn(c_int) -> u64,
    }

    /// The sm_90a source with its verify tiles replaced by `tiles` and common/sync.cuh's inline
    /// PTX by verify_support/sync_layer.h.
    fn source_for(tiles: &VerifyTiles) -> String {
        let source = table::rendered("sm_90a", "verify").expect("verify rendered for sm_90a");
        crate::layers::splice(
            source.source,
            "// ---- sync vendor primitives ----",
            "// ---- end of sync vendor primitives ----",
            "#include \"sync_layer.h\"\n",
        )
        .lines()
        .map(|line| {
            let define = |name: &str, value: u32| format!("#define {name} {value}");
            match line
                .split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .as_slice()
            {
                ["#define", "VT"] => define("VT", tiles.threads_per_block),
                ["#define", "VI"] => define("VI", tiles.items_per_thread),
                ["#define", "VG"] => define("VG", tiles.sub_buckets_per_octave),
                ["#define", "VCAP"] => define("VCAP", tiles.candidates_per_row),
                ["#define", "VTOPK_MAX"] => define("VTOPK_MAX", tiles.top_k_max),
                ["#define", "VTOPK_BUF"] => define("VTOPK_BUF", tiles.top_k_buffer),
                ["#define", "VTOPK_PREFETCH"] => {
                    define("VTOPK_PREFETCH", tiles.top_k_prefetch_chunks)
                }
                ["#define", "VTOPK_RANK_MAX"] => define("VTOPK_RANK_MAX", tiles.top_k_rank_max),
                _ => line.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// The value of `#define NAME` in the source for `tiles` (a row state word's index).
    fn rendered_define(tiles: &VerifyTiles, name: &str) -> usize {
        let prefix = format!("#define {name} ");
        source_for(tiles)
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("verify.cu defines no {name}"))
    }

    /// The emulated kernels for `tiles` (compiled once per tiles and test binary).
    pub fn kernels(tiles: &VerifyTiles) -> Kernels {
        static LIBRARIES: Mutex<Vec<(String, usize, usize)>> = Mutex::new(Vec::new());
        let source = source_for(tiles);
        let key = format!("{tiles:?}");
        let mut libraries = LIBRARIES.lock().unwrap_or_else(|p| p.into_inner());
        let (launch, slow) = match libraries.iter().find(|(k, _, _)| *k == key) {
            Some(&(_, launch, slow)) => (launch, slow),
            None => {
                let found = compile(&source, libraries.len());
                libraries.push((key, found.0, found.1));
                found
            }
        };
        // SAFETY: the addresses of the wrapper's two functions, with these signatures.
        unsafe {
            Kernels {
                launch: std::mem::transmute::<usize, LaunchFn>(launch),
                trace: std::mem::transmute::<usize, unsafe extern "C" fn(c_int) -> u64>(slow),
            }
        }
    }

    fn compile(source: &str, index: usize) -> (usize, usize) {
        let dir =
            std::env::temp_dir().join(format!("fp4spec-verify-emu-{}-{index}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/verify_support");
        std::fs::write(dir.join("verify.cu"), source).expect("write source");
        std::fs::write(dir.join("wrapper.cpp"), WRAPPER).expect("write wrapper");
        let library = dir.join("libverify_emu.so");
        let compiler = ["clang++-19", "clang++"]
            .into_iter()
            .find(|c| {
                std::process::Command::new(c)
                    .arg("--version")
                    .output()
                    .is_ok()
            })
            .expect(
                "no clang++ for the CUDA emulation: run the tests as \
                 `bash tools/toolchains.sh cargo test --release`",
            );
        let out = std::process::Command::new(compiler)
            .args([
                "-std=c++20",
                "-O1",
                "-g0",
                "-w",
                "-fPIC",
                "-shared",
                "-ffp-contract=off",
            ])
            .args(["-fno-fast-math", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0"])
            .arg(format!("-I{}", here.display()))
            .arg(format!("-I{}", dir.display()))
            .arg("-include")
            .arg(here.join("cuda_emu.h"))
            .arg(dir.join("wrapper.cpp"))
            .arg("-o")
            .arg(&library)
            .output()
            .expect("run clang++");
        assert!(
            out.status.success(),
            "the emulation did not compile:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = CString::new(library.to_string_lossy().as_bytes()).expect("path");
        // SAFETY: dlopen/dlsym on a library this test just built.
        unsafe {
            let handle = dlopen(path.as_ptr(), RTLD_NOW);
            assert!(
                !handle.is_null(),
                "dlopen: {}",
                CStr::from_ptr(dlerror()).to_string_lossy()
            );
            let launch = dlsym(handle, c"emu_launch".as_ptr());
            let slow = dlsym(handle, c"emu_take_trace".as_ptr());
            assert!(
                !launch.is_null() && !slow.is_null(),
                "emulation symbols missing"
            );
            (launch as usize, slow as usize)
        }
    }

    fn address<T>(v: &[T]) -> u64 {
        v.as_ptr() as u64
    }

    /// How often the kernels took their rare paths.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Trace {
        /// Radix fallbacks of the finish (a bucket pass 2 did not collect).
        pub radix_fallbacks: u64,
        /// Pass-1 blocks whose top lay above their row's grid.
        pub spilled_blocks: u64,
        /// verify_topk candidate buffers that filled up (and were cut back to their top k).
        pub full_top_k_buffers: u64,
    }

    impl std::ops::AddAssign for Trace {
        fn add_assign(&mut self, other: Trace) {
            self.radix_fallbacks += other.radix_fallbacks;
            self.spilled_blocks += other.spilled_blocks;
            self.full_top_k_buffers += other.full_top_k_buffers;
        }
    }

    /// Runs `batch` through the emulated kernels of `tiles` on fresh (garbage-filled) scratch
    /// (the layout of `multiprocessors` decides how rows split over blocks); also returns how
    /// often they took their rare paths.
    pub fn run(
        tiles: &VerifyTiles,
        multiprocessors: u32,
        batch: &batches::Batch,
        vocab: usize,
        kind: DraftKind,
    ) -> (batches::Run, Trace) {
        let capacity = batch.capacity(vocab);
        let sequences = batch.sequences();
        let (target, tokens, draft_logits) = (
            &batch.target[..],
            &batch.tokens[..],
            batch.draft_logits_for(kind),
        );
        // the emulation is one global machine: one batch at a time across test threads
        static MACHINE: Mutex<()> = Mutex::new(());
        let _machine = MACHINE.lock().unwrap_or_else(|p| p.into_inner());
        let params = &batch.params;
        let layout = Layout::new(capacity, tiles, multiprocessors).expect("layout");
        let batch = Batch::encode(&layout, &sequences, kind).expect("encode");
        let n = layout.buffer_lengths();
        let garbage = 0xa5a5_a5a5_a5a5_a5a5u64;
        let mut seqs = vec![device::Sequence::default(); n.sequences];
        seqs[..batch.sequences.len()].copy_from_slice(&batch.sequences);
        let mut rows = vec![device::Row::default(); n.rows];
        rows[..batch.rows.len()].copy_from_slice(&batch.rows);
        let mut bias_tokens = vec![0u32; n.bias.max(1)];
        bias_tokens[..batch.bias_tokens.len()].copy_from_slice(&batch.bias_tokens);
        let mut bias_values = vec![0f32; n.bias.max(1)];
        bias_values[..batch.bias_values.len()].copy_from_slice(&batch.bias_values);
        let block_hist = vec![garbage; n.block_hist];
        let block_summary = vec![garbage; n.block_summary];
        let row_grid = vec![0u64; n.row_grid];
        let row_anchor = vec![0u32; n.row_anchor];
        let row_hist = vec![garbage; n.row_hist];
        let row_state = vec![garbage; n.row_state];
        let candidates = vec![garbage; n.candidates];
        let residual_sums = vec![garbage; n.residual_sums];
        let counters = vec![0u32; n.counters];
        let emitted = vec![0xdead_beefu32; n.emitted];
        let status = vec![0xdead_beefu32; n.status];
        let stats = vec![0u64; n.stats.max(1)];
        let no_draft_logits = [0f32; 1];
        let tokens_or_dummy = if tokens.is_empty() {
            &[0u32][..]
        } else {
            tokens
        };
        let args = device::Args {
            target_logits: address(target),
            draft_logits: address(draft_logits.unwrap_or(&no_draft_logits)),
            draft_tokens: address(tokens_or_dummy),
            sequences: address(&seqs),
            rows: address(&rows),
            bias_tokens: address(&bias_tokens),
            bias_values: address(&bias_values),
            block_hist: address(&block_hist),
            block_summary: address(&block_summary),
            row_grid: address(&row_grid),
            row_anchor: address(&row_anchor),
            row_hist: address(&row_hist),
            row_state: address(&row_state),
            candidates: address(&candidates),
            residual_sums: address(&residual_sums),
            counters: address(&counters),
            emitted: address(&emitted),
            status: address(&status),
            stats: address(&stats),
            vocab: capacity.vocab as u32,
            sequence_count: batch.sequences.len() as u32,
            row_count: batch.rows.len() as u32,
            max_drafts: capacity.max_drafts as u32,
            chunks_per_row: layout.chunks_per_row as u32,
            chunks_per_block: batch.chunks_per_block as u32,
            blocks_per_row: batch.blocks_per_row as u32,
            reserved: 0,
        };
        let kernels = kernels(tiles);
        for (kernel, (x, y)) in layout.launches(&batch) {
            let name = CString::new(kernel).expect("name");
            // SAFETY: every address in `args` points into a live buffer sized by the layout.
            let rc = unsafe {
                (kernels.launch)(
                    name.as_ptr(),
                    x,
                    y,
                    tiles.threads_per_block,
                    &args as *const device::Args as *const c_void,
                )
            };
            assert_eq!(rc, 0, "emulated {kernel} did not complete");
        }
        assert!(
            counters.iter().all(|&c| c == 0),
            "arrival counters left nonzero: {counters:?}"
        );
        assert!(
            row_grid.iter().all(|&c| c == 0) && row_anchor.iter().all(|&c| c == 0),
            "row grids or anchors left nonzero"
        );
        // every processed row's kept weight (its row state's two RS_MASS words) is the
        // reference's exactly: a top k short of a token that top-p or min-p cut anyway changes
        // no outcome, but it changes this
        let mass_word = rendered_define(tiles, "RS_MASS");
        for (r, row) in batch.rows.iter().enumerate() {
            let s = row.sequence as usize;
            let logits = match (row.is_draft, draft_logits) {
                _ if params[s].temperature <= 0.0 => continue,
                (0, _) => target,
                (_, Some(draft)) => draft,
                (_, None) => continue,
            };
            let at = row.logits_row as usize * vocab;
            let Ok(weighed) =
                reference::weigh(&logits[at..at + vocab], &params[s], row.index as usize)
            else {
                continue;
            };
            let words = &row_state[r * layout.row_words + mass_word..][..2];
            assert_eq!(
                u128::from(words[0]) | u128::from(words[1]) << 64,
                weighed.mass(),
                "row {r} (sequence {s}, draft {}, index {}): kept weight",
                row.is_draft,
                row.index
            );
        }
        let outcomes = batch.decode(&layout, &status, &emitted).expect("decode");
        let m = capacity.max_drafts;
        let run = batches::Run {
            outcomes,
            stats: AcceptanceStats {
                drafted: stats[..m].to_vec(),
                accepted: stats[m..2 * m].to_vec(),
            },
        };
        // SAFETY: the wrapper's counters, read and reset
        let trace = unsafe {
            Trace {
                radix_fallbacks: (kernels.trace)(0),
                spilled_blocks: (kernels.trace)(1),
                full_top_k_buffers: (kernels.trace)(2),
            }
        };
        (run, trace)
    }
}

#[path = "verify_support/batches.rs"]
mod batches;

use fp4spec::backend::Backend;
use fp4spec::kernels::verify::{self as kernels, DraftKind, Layout};
use fp4spec::target::VerifyTiles;

fn sm90_tiles() -> VerifyTiles {
    fp4spec::target::by_name("sm_90a")
        .expect("sm_90a")
        .verify
        .clone()
}

/// Tiles small enough that rows span many chunks, blocks stream several chunks (shifting their
/// histograms), buckets are coarse and almost no bucket fits the candidates: the radix fallback
/// everywhere.
fn tiny_tiles() -> VerifyTiles {
    VerifyTiles {
        threads_per_block: 64,
        items_per_thread: 2,
        sub_buckets_per_octave: 2,
        candidates_per_row: 4,
        blocks_per_sm: 2,
        greedy_blocks_per_sm: 2,
        top_k_blocks_per_sm: 2,
        top_k_max: 8,
        top_k_buffer: 72,
        top_k_prefetch_chunks: 1,
        top_k_rank_max: 8,
    }
}

/// Runs `batch` on the CPU backend and on the emulated kernels of `tiles` (one layout per
/// multiprocessor count), asserts outcomes and statistics are equal, returns how often the
/// kernels took their rare paths.
fn check_emulated(
    test: &str,
    tiles: &VerifyTiles,
    vocab: usize,
    batch: &batches::Batch,
    multiprocessors: &[u32],
) -> emulation::Trace {
    let mut trace = emulation::Trace::default();
    for kind in [DraftKind::PointMass, DraftKind::Sampled] {
        let want = batches::on_backend(&Backend::Cpu, batch, vocab, kind);
        for &sms in multiprocessors {
            let (got, t) = emulation::run(tiles, sms, batch, vocab, kind);
            batches::assert_same(
                &format!("{test} V={vocab} {kind:?} {sms} SMs"),
                batch,
                vocab,
                &got,
                &want,
            );
            trace += t;
        }
        let errors = want.outcomes.iter().filter(|o| o.is_err()).count();
        println!(
            "{test} V={vocab} {kind:?}: {} sequences equal ({errors} errors), accepted {:?} of {:?}",
            want.outcomes.len(),
            want.stats.accepted,
            want.stats.drafted
        );
    }
    println!("{test} V={vocab}: {trace:?}");
    trace
}

#[test]
fn emulated_kernels_equal_the_reference_on_random_ragged_batches() {
    let mut rng = SplitMix64::new(11);
    for (vocab, sequences) in [(37usize, 8usize), (1000, 6), (20000, 4)] {
        let batch = batches::random(&mut rng, vocab, sequences, 4);
        check_emulated("random", &sm90_tiles(), vocab, &batch, &[132, 1]);
    }
}

#[test]
fn emulated_kernels_equal_the_reference_through_the_radix_fallback() {
    let mut rng = SplitMix64::new(12);
    let mut trace = emulation::Trace::default();
    for (vocab, sequences) in [(37usize, 6usize), (300, 6), (3001, 3)] {
        let batch = batches::random(&mut rng, vocab, sequences, 3);
        trace += check_emulated("tiny tiles", &tiny_tiles(), vocab, &batch, &[4, 1]);
    }
    assert!(
        trace.radix_fallbacks > 50,
        "the fallback ran only {trace:?}"
    );
}

/// 9001 tokens in chunks of 128 (tiny tiles): 71 chunks, more than a block's 64 threads, so the
/// residual draw scans the chunk sums in two rounds and finds its chunk in the second.
#[test]
fn emulated_residual_draws_find_a_chunk_past_the_first_scan_round() {
    let mut rng = SplitMix64::new(18);
    let batch = batches::residual_at_the_end(&mut rng, 9001, 4, 2);
    check_emulated("residual at the end", &tiny_tiles(), 9001, &batch, &[4]);
}

/// Logits just below zero weigh as the top of octave -1 (f rounds to 1), in the candidates'
/// path (20000 tokens, the device's tiles) and the radix fallback (tiny tiles).
#[test]
fn emulated_kernels_equal_the_reference_when_logits_straddle_zero() {
    let mut rng = SplitMix64::new(17);
    let batch = batches::straddling_zero(&mut rng, 20_000, 6, 3);
    check_emulated("straddling zero", &sm90_tiles(), 20_000, &batch, &[132, 1]);
    let batch = batches::straddling_zero(&mut rng, 3001, 4, 2);
    check_emulated("straddling zero", &tiny_tiles(), 3001, &batch, &[4]);
}

/// The GPU's flat-row batch (tests/gpu/verify.rs) at the seed that failed on the H200.
#[test]
fn emulated_kernels_equal_the_reference_on_flat_rows() {
    let mut rng = SplitMix64::new(16_347_963_035_196_152_572);
    let vocab = 248_320;
    let batch = batches::flat_rows(&mut rng, vocab);
    check_emulated("flat rows", &sm90_tiles(), vocab, &batch, &[132]);
}

#[test]
fn emulated_kernels_equal_the_reference_at_the_full_vocabulary() {
    let mut rng = SplitMix64::new(13);
    let vocab = 248_320;
    let batch = batches::random(&mut rng, vocab, 3, 2);
    check_emulated("full vocabulary", &sm90_tiles(), vocab, &batch, &[132]);
}

/// Model-like rows stay on each path's fast path: the histogram passes' plan never misses a
/// bucket (top-k off), and no `verify_topk` block fills its candidate buffer (top-k 50: the first
/// chunk's floor admits about k tokens, later chunks a few).
#[test]
fn emulated_kernels_keep_model_like_batches_on_the_fast_path() {
    let mut rng = SplitMix64::new(14);
    let top_p_only = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        ..SamplingParams::default()
    };
    let top_k_off = SamplingParams {
        top_k: 0,
        ..batches::all_controls()
    };
    for (name, params) in [("all but top-k", top_k_off), ("top-p only", top_p_only)] {
        let batch = batches::model_like(&mut rng, 20_000, 4, 3, &params);
        let trace = check_emulated(name, &sm90_tiles(), 20_000, &batch, &[132]);
        assert_eq!(
            trace.radix_fallbacks, 0,
            "{name}: the plan missed a bucket: {trace:?}"
        );
    }
    let batch = batches::model_like(&mut rng, 20_000, 4, 3, &batches::all_controls());
    let trace = check_emulated("all controls", &sm90_tiles(), 20_000, &batch, &[132, 1]);
    assert_eq!(
        trace.full_top_k_buffers, 0,
        "a verify_topk buffer filled up: {trace:?}"
    );
}

/// At the full vocabulary a row spreads over a wave of blocks (61 at B = 1 on 132 SMs), each
/// writing the ~50 candidates above its own floor: the row's last block must not merge them all
/// (over 3000, three times its buffer), but only those reaching the bound its blocks' pooled
/// codes give (the k-th largest of them), so that its buffer never fills.
#[test]
fn emulated_top_k_merges_only_what_the_pooled_bound_admits() {
    let mut rng = SplitMix64::new(19);
    let vocab = 248_320;
    let batch = batches::model_like(&mut rng, vocab, 1, 1, &batches::all_controls());
    let trace = check_emulated(
        "full-vocabulary merge",
        &sm90_tiles(),
        vocab,
        &batch,
        &[132, 8],
    );
    assert_eq!(
        trace.full_top_k_buffers, 0,
        "a verify_topk buffer filled up: {trace:?}"
    );
}

/// A block holding more of the row's top k than it pools (VTOPK_POOL = 8 of 64 nearly equal top
/// tokens in one chunk): the merge must read that block's whole candidate list, with fewer pooled
/// codes than k (20000 tokens: 5 blocks a row, too few to pool, so every list is read) and with
/// more (the full vocabulary: 61), or the draws over the top 50 differ.
#[test]
fn emulated_top_k_reads_the_list_of_a_block_holding_the_top() {
    let mut rng = SplitMix64::new(21);
    for (vocab, start) in [(20_000usize, 4100usize), (248_320, 5 * 4096 + 7)] {
        let batch = batches::clustered_top(&mut rng, vocab, 3, 2, start);
        check_emulated("clustered top", &sm90_tiles(), vocab, &batch, &[132]);
    }
}

/// Rows with one logit far above the rest at a low temperature: the blocks holding it have tops
/// hundreds of octaves above the grid anchored at another block, and keep their own histograms.
#[test]
fn emulated_kernels_equal_the_reference_with_spiked_rows() {
    let mut rng = SplitMix64::new(16);
    let vocab = 20_000;
    let batch = batches::spiked(&mut rng, vocab, 4, 2);
    let trace = check_emulated("spiked", &sm90_tiles(), vocab, &batch, &[132, 1]);
    assert!(
        trace.spilled_blocks > 0,
        "no block kept its own histogram: {trace:?}"
    );
}

/// Batches of greedy sequences with point-mass drafts take the one-launch path (`verify_greedy`)
/// and give the reference's outcomes: random ragged batches with bias, and every bad value a
/// greedy sequence can have, on one block per row and on many (132 and 1 multiprocessors, the
/// device's tiles and tiny ones). Sampled drafts take the general path on the same sequences.
#[test]
fn emulated_greedy_batches_equal_the_reference_in_one_launch() {
    let mut rng = SplitMix64::new(18);
    let (bad, bad_vocab) = batches::bad_values(&mut rng);
    let mut cases = vec![("bad values", bad.greedy_sequences(bad_vocab), bad_vocab)];
    for (vocab, sequences) in [(37usize, 8usize), (1000, 6), (20_000, 4)] {
        let batch = batches::random(&mut rng, vocab, sequences, 4);
        cases.push(("random", batch.greedy_sequences(vocab), vocab));
    }
    for (name, batch, vocab) in &cases {
        for tiles in [sm90_tiles(), tiny_tiles()] {
            for sms in [132, 1] {
                let layout = Layout::new(batch.capacity(*vocab), &tiles, sms).expect("layout");
                let encoded =
                    kernels::Batch::encode(&layout, &batch.sequences(), DraftKind::PointMass)
                        .expect("encode");
                let grid = (encoded.blocks_per_row as u32, encoded.rows.len() as u32);
                assert_eq!(
                    layout.launches(&encoded),
                    vec![(kernels::KERNEL_GREEDY, grid)],
                    "{name} V={vocab}"
                );
            }
            check_emulated(&format!("greedy {name}"), &tiles, *vocab, batch, &[132, 1]);
        }
    }
}

/// Batches whose every sequence has top-k on (up to the tiles' `top_k_max`), or is greedy, or was
/// rejected by the host, take the one-launch top-k path (`verify_topk`, then `verify_residual`
/// for sampled drafts) and give the reference's outcomes: random ragged batches (one of 1001
/// tokens: rows off 16-byte boundaries, which the blocks' L2 prefetches must respect), flat rows
/// (every logit tied), the bad-value batch and a full vocabulary; on one block per row and on
/// many. The tiny tiles' buffers (72 candidates, k up to 8) and the flat rows' fill up over and
/// over.
#[test]
fn emulated_top_k_batches_equal_the_reference_in_one_launch() {
    let mut rng = SplitMix64::new(19);
    let (bad, bad_vocab) = batches::bad_values(&mut rng);
    let mut cases = vec![("bad values", bad, bad_vocab)];
    for (vocab, sequences) in [(37usize, 8usize), (1001, 6), (20_000, 4)] {
        cases.push((
            "random",
            batches::random(&mut rng, vocab, sequences, 4),
            vocab,
        ));
    }
    cases.push(("flat rows", batches::flat_rows(&mut rng, 3000), 3000));
    let mut fills = 0;
    for (name, batch, vocab) in &cases {
        for (tiles, ks) in [
            (sm90_tiles(), &[1usize, 50, 256, 7, 20][..]),
            (tiny_tiles(), &[1, 8, 3][..]),
        ] {
            let batch = batch.with_top_k(ks);
            for sms in [132, 1] {
                let layout = Layout::new(batch.capacity(*vocab), &tiles, sms).expect("layout");
                for kind in [DraftKind::PointMass, DraftKind::Sampled] {
                    let encoded =
                        kernels::Batch::encode(&layout, &batch.sequences(), kind).expect("encode");
                    let first = layout.launches(&encoded)[0];
                    assert_eq!(
                        first,
                        (
                            kernels::KERNEL_TOP_K,
                            (encoded.blocks_per_row as u32, encoded.rows.len() as u32)
                        ),
                        "{name} V={vocab} {kind:?}"
                    );
                }
            }
            fills += check_emulated(&format!("top-k {name}"), &tiles, *vocab, &batch, &[132, 1])
                .full_top_k_buffers;
        }
    }
    // top-k off in one sequence: the histogram passes; then all on: verify_topk
    let batch = batches::clamped_octaves(300);
    check_emulated("clamped octaves", &sm90_tiles(), 300, &batch, &[132, 1]);
    let batch = batch.with_top_k(&[5, 2]);
    check_emulated(
        "top-k clamped octaves",
        &sm90_tiles(),
        300,
        &batch,
        &[132, 1],
    );
    let mut full = SplitMix64::new(20);
    let vocab = 248_320;
    let batch = batches::random(&mut full, vocab, 3, 2).with_top_k(&[50, 1, 256]);
    check_emulated(
        "top-k full vocabulary",
        &sm90_tiles(),
        vocab,
        &batch,
        &[132],
    );
    assert!(fills > 20, "the buffers filled only {fills} times");
}

/// A logit the bias makes NaN (+inf, then -inf) is a bad value of that token on every path (the
/// histogram passes, verify_topk, verify_greedy), as in the reference.
#[test]
fn emulated_kernels_report_a_nan_made_by_the_bias() {
    let batch = batches::nan_after_bias(300);
    for kind in [DraftKind::PointMass, DraftKind::Sampled] {
        let run = batches::on_backend(&Backend::Cpu, &batch, 300, kind);
        for outcome in &run.outcomes {
            assert!(
                matches!(outcome, Err(RowError::NonFiniteLogit { row: 0, token: 5, value })
                    if value.is_nan()),
                "NaN after bias: {outcome:?}"
            );
        }
    }
    check_emulated("NaN after bias", &sm90_tiles(), 300, &batch, &[132, 1]);
    check_emulated(
        "top-k NaN after bias",
        &sm90_tiles(),
        300,
        &batch.with_top_k(&[20]),
        &[132, 1],
    );
    check_emulated(
        "greedy NaN after bias",
        &sm90_tiles(),
        300,
        &batch.greedy_sequences(300),
        &[132, 1],
    );
}

#[test]
fn emulated_kernels_report_every_bad_value_as_the_reference_does() {
    let (batch, vocab) = batches::bad_values(&mut SplitMix64::new(15));
    check_emulated("bad values", &sm90_tiles(), vocab, &batch, &[132]);
}
/// The bad-value batch (shared with the GPU tests) gives each status it is meant to.
#[test]
fn the_bad_value_batch_covers_every_status() {
    let (batch, vocab) = batches::bad_values(&mut SplitMix64::new(15));
    let shape = |o: &Result<verify::Verified, RowError>| match o {
        Ok(_) => "ok".to_string(),
        Err(RowError::NonFiniteLogit { row, token, .. }) => format!("nonfinite {row} {token}"),
        Err(RowError::EmptySupport { row }) => format!("empty {row}"),
        Err(RowError::TokenOutOfRange { token, .. }) => format!("token {token}"),
        Err(RowError::BadParameter(_)) => "parameter".to_string(),
    };
    let mut expected = vec![
        "nonfinite 1 7",
        "nonfinite 1 7",
        "nonfinite 0 9",
        "ok",
        "ok",
        "empty 0",
        "empty 0",
        "token 64",
        "parameter",
        "parameter",
        "parameter",
        "parameter",
        "parameter",
        "token 69",
        "parameter",
        "parameter",
        "nonfinite 0 5",
        "ok",
        "ok",
    ];
    for kind in [DraftKind::PointMass, DraftKind::Sampled] {
        if kind == DraftKind::Sampled {
            expected[4] = "nonfinite 0 7"; // the bad draft row is read only with sampled drafts
        }
        let run = batches::on_backend(&Backend::Cpu, &batch, vocab, kind);
        let got: Vec<String> = run.outcomes.iter().map(shape).collect();
        assert_eq!(got, expected, "{kind:?}");
    }
}

/// verify_topk's split: one wave of blocks while the rows fit in it, rows split further beyond
/// (sm_90a tiles, 132 multiprocessors, V = 248320: 61 chunks per row, 264 blocks per wave).
#[test]
fn top_k_batches_split_into_few_short_waves() {
    let capacity = kernels::Capacity {
        vocab: 248_320,
        max_sequences: 64,
        max_drafts: 8,
        max_bias_entries: 1,
    };
    let layout = Layout::new(capacity, &sm90_tiles(), 132).expect("layout");
    assert_eq!(layout.top_k_blocks, 264);
    assert_eq!(layout.split_top_k(2), (61, 1));
    assert_eq!(layout.split_top_k(128), (2, 31));
    assert_eq!(layout.split_top_k(320), (4, 16));
    assert_eq!(layout.split_top_k(576), (3, 21));
    for rows in 1..=layout.rows {
        let (blocks, chunks) = layout.split_top_k(rows);
        assert!(
            blocks * chunks >= layout.chunks_per_row
                && (blocks - 1) * chunks < layout.chunks_per_row
        );
        assert!(rows * blocks <= (kernels::MAX_TOP_K_WAVES * layout.top_k_blocks).max(rows));
    }
}

/// The constants the template and the device module share agree (a drift would misread every
/// buffer).
#[test]
fn the_template_and_the_device_module_agree() {
    use fp4spec::kernels::verify::{MAX_BLOCKS_PER_ROW, device, reference};
    for t in fp4spec::target::all() {
        let source = fp4spec::kernels::table::rendered(&t.name, "verify").expect("rendered");
        let define = |name: &str| -> u64 {
            let line = source
                .source
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
                .unwrap_or_else(|| panic!("{}: no #define {name}", t.name));
            let value = line
                .split_whitespace()
                .nth(2)
                .expect("value")
                .trim_end_matches('u');
            value
                .parse()
                .unwrap_or_else(|_| panic!("{}: {line}", t.name))
        };
        assert_eq!(define("VOCT"), reference::MASS_OCTAVES as u64);
        assert_eq!(define("VOCT"), device::OCTAVES as u64);
        assert_eq!(define("RS_PLAN"), device::ROW_STATE_FIXED_WORDS as u64);
        assert_eq!(define("VHEAD"), device::GRID_HEADROOM as u64);
        assert_eq!(define("VSTATUS_WORDS"), device::STATUS_WORDS as u64);
        assert_eq!(define("VMAX_BLOCKS_PER_ROW"), MAX_BLOCKS_PER_ROW as u64);
        assert_eq!(
            define("VSEQ_SAMPLED_DRAFTS"),
            u64::from(device::SEQUENCE_SAMPLED_DRAFTS)
        );
        for (name, code) in [
            ("VSTATUS_OK", device::STATUS_OK),
            ("VSTATUS_NONFINITE", device::STATUS_NONFINITE),
            ("VSTATUS_EMPTY", device::STATUS_EMPTY),
            ("VSTATUS_TOKEN", device::STATUS_TOKEN),
            ("VSTATUS_PARAM", device::STATUS_PARAM),
            ("VSTATUS_PENDING", device::STATUS_PENDING),
            ("VSTATUS_STALE", device::STATUS_STALE),
        ] {
            assert_eq!(define(name), u64::from(code), "{}: {name}", t.name);
        }
        for bits in reference::EXP2_COEFFICIENT_BITS {
            assert!(
                source.source.contains(&format!("0x{bits:08x}u")),
                "{}: the exp2 coefficient {bits:#010x} is not in the template",
                t.name
            );
        }
        assert!(
            source
                .source
                .contains(&format!("#define VT {}", t.verify.threads_per_block))
        );
    }
}

/// Outcomes read before the batch set last was verified (no launch since `set_batch`) are an
/// error, never the last batch's tokens read against the new one.
#[test]
fn outcomes_of_a_batch_not_yet_verified_are_an_error() {
    let mut rng = SplitMix64::new(31);
    let vocab = 32768;
    let batch = batches::model_like(&mut rng, vocab, 2, 2, &batches::all_controls());
    let cpu = Backend::Cpu;
    let mut ws = kernels::VerifyWorkspace::new(&cpu, batch.capacity(vocab)).expect("workspace");
    let not_verified = |ws: &kernels::VerifyWorkspace| {
        let err = ws.outcomes().expect_err("outcomes of a batch not verified");
        assert!(err.to_string().contains("not verified"), "{err}");
    };
    ws.set_batch(&batch.sequences(), DraftKind::PointMass)
        .expect("set_batch");
    not_verified(&ws);
    let target = cpu.upload(&batch.target).expect("upload");
    let tokens = cpu.upload(&batch.tokens).expect("upload");
    kernels::verify(&cpu, &mut ws, &target, &tokens, None).expect("verify");
    assert_eq!(ws.outcomes().expect("outcomes").len(), 2);
    ws.set_batch(&batch.sequences(), DraftKind::PointMass)
        .expect("set_batch");
    not_verified(&ws);
}
