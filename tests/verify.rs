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
// against tests/verify_emu/cuda_emu.h (threads as fibers, real __syncthreads and warp
// exchanges, shuffled scheduling) and run through the same layout, batch encoding, launch grids
// and decoding as the CUDA backend. Same tokens and accept counts as the reference, exactly.

mod emulation {
    use fp4spec::backend::Backend;
    use fp4spec::kernels::table;
    use fp4spec::kernels::verify::{
        self, AcceptanceStats, Batch, Capacity, DraftKind, Layout, RowError, Sequence, Verified,
        VerifyWorkspace, device,
    };
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
static unsigned long long emu_slow_paths = 0;
#define VERIFY_SLOW_PATH_HOOK() (++emu_slow_paths)
#include "verify.cu"
extern "C" int emu_launch(const char* kernel, unsigned gx, unsigned gy, unsigned threads, const void* args) {
    const VerifyArgs a = *static_cast<const VerifyArgs*>(args);
    if (!std::strcmp(kernel, "verify_histogram")) return emu::launch(gx, gy, threads, [a] { verify_histogram(a); });
    if (!std::strcmp(kernel, "verify_select")) return emu::launch(gx, gy, threads, [a] { verify_select(a); });
    if (!std::strcmp(kernel, "verify_finish")) return emu::launch(gx, gy, threads, [a] { verify_finish(a); });
    if (!std::strcmp(kernel, "verify_residual")) return emu::launch(gx, gy, threads, [a] { verify_residual(a); });
    std::fprintf(stderr, "emulation: no kernel %s\n", kernel);
    return 2;
}
extern "C" unsigned long long emu_take_slow_paths() {
    const unsigned long long n = emu_slow_paths;
    emu_slow_paths = 0;
    return n;
}
"#;

    /// The emulated kernels: `emu_launch` and `emu_take_slow_paths`.
    #[derive(Clone, Copy)]
    pub struct Kernels {
        launch: LaunchFn,
        slow_paths: unsafe extern "C" fn() -> u64,
    }

    /// The sm_90a source with its verify tiles replaced by `tiles`.
    fn source_for(tiles: &VerifyTiles) -> String {
        let source = table::rendered("sm_90a", "verify").expect("verify rendered for sm_90a");
        source
            .source
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
                    _ => line.to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
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
                slow_paths: std::mem::transmute::<usize, unsafe extern "C" fn() -> u64>(slow),
            }
        }
    }

    fn compile(source: &str, index: usize) -> (usize, usize) {
        let dir =
            std::env::temp_dir().join(format!("fp4spec-verify-emu-{}-{index}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/verify_emu");
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
            let slow = dlsym(handle, c"emu_take_slow_paths".as_ptr());
            assert!(
                !launch.is_null() && !slow.is_null(),
                "emulation symbols missing"
            );
            (launch as usize, slow as usize)
        }
    }

    /// What one batch produced.
    pub struct Run {
        pub outcomes: Vec<Result<Verified, RowError>>,
        pub stats: AcceptanceStats,
        /// Radix fallbacks the finish took (emulation only).
        pub slow_paths: u64,
    }

    fn address<T>(v: &[T]) -> u64 {
        v.as_ptr() as u64
    }

    /// Runs `batch` through the emulated kernels of `tiles` on fresh (garbage-filled) scratch:
    /// the layout of `multiprocessors` decides how rows split over blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        tiles: &VerifyTiles,
        capacity: Capacity,
        multiprocessors: u32,
        sequences: &[Sequence<'_>],
        kind: DraftKind,
        target: &[f32],
        tokens: &[u32],
        draft_logits: Option<&[f32]>,
    ) -> Run {
        // the emulation is one global machine: one batch at a time across test threads
        static MACHINE: Mutex<()> = Mutex::new(());
        let _machine = MACHINE.lock().unwrap_or_else(|p| p.into_inner());
        let layout = Layout::new(capacity, tiles, multiprocessors).expect("layout");
        let batch = Batch::encode(&layout, sequences, kind).expect("encode");
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
        let outcomes = batch.decode(&layout, &status, &emitted).expect("decode");
        let m = capacity.max_drafts;
        Run {
            outcomes,
            stats: AcceptanceStats {
                drafted: stats[..m].to_vec(),
                accepted: stats[m..2 * m].to_vec(),
            },
            // SAFETY: the wrapper's counter read-and-reset.
            slow_paths: unsafe { (kernels.slow_paths)() },
        }
    }

    /// The CPU backend (the reference) on the same batch.
    pub fn reference(
        capacity: Capacity,
        sequences: &[Sequence<'_>],
        kind: DraftKind,
        target: &[f32],
        tokens: &[u32],
        draft_logits: Option<&[f32]>,
    ) -> Run {
        let backend = Backend::Cpu;
        let mut ws = VerifyWorkspace::new(&backend, capacity).expect("workspace");
        ws.set_batch(sequences, kind).expect("batch");
        let target = backend.upload(target).expect("upload");
        let tokens = backend.upload(tokens).expect("upload");
        let draft = draft_logits.map(|d| backend.upload(d).expect("upload"));
        verify::verify(&backend, &mut ws, &target, &tokens, draft.as_ref()).expect("verify");
        Run {
            outcomes: ws.outcomes().expect("outcomes"),
            stats: ws.stats().expect("stats"),
            slow_paths: 0,
        }
    }
}

/// A random batch: ragged draft counts (0 allowed), every control on or off per sequence,
/// logits of several shapes, drafts that agree with the target's argmax for a while.
struct RandomBatch {
    params: Vec<SamplingParams>,
    positions: Vec<u64>,
    drafts: Vec<usize>,
    target: Vec<f32>,
    tokens: Vec<u32>,
    draft_logits: Vec<f32>,
}

fn random_params(rng: &mut SplitMix64, vocab: usize, greedy: bool) -> SamplingParams {
    let mut pick = |n: u64| rng.next_u64() % n;
    let temperature = if greedy {
        0.0
    } else {
        [1.0, 0.7, 1.3, 0.05][pick(4) as usize]
    };
    let top_k = [0, 1, 5, 40, vocab + 3][pick(5) as usize];
    let top_p = [1.0, 0.9, 0.5, 0.999][pick(4) as usize];
    let min_p = [0.0, 0.05, 0.3, 1.0][pick(4) as usize];
    let bias_len = [0, 1, 3, 12][pick(4) as usize];
    let logit_bias = (0..bias_len)
        .map(|i| {
            let token = (pick(vocab as u64)) as u32;
            let value = match i % 4 {
                0 => 2.5,
                1 => -1.0,
                2 => f32::NEG_INFINITY,
                _ => 0.25,
            };
            (token, value)
        })
        .collect();
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        logit_bias,
        seed: pick(u64::MAX),
    }
}

fn random_row(rng: &mut SplitMix64, vocab: usize) -> Vec<f32> {
    let shape = rng.next_u64() % 4;
    let spread = [4.0, 1.0, 0.02, 8.0][shape as usize];
    let mut row = rng.normal_vec(vocab, spread);
    if shape == 3 {
        // bf16-rounded logits: many exact ties
        for v in &mut row {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
    if rng.next_u64() % 3 == 0 {
        row[(rng.next_u64() % vocab as u64) as usize] = f32::NEG_INFINITY;
    }
    row
}

fn random_batch(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    max_drafts: usize,
) -> RandomBatch {
    let mut b = RandomBatch {
        params: Vec::new(),
        positions: Vec::new(),
        drafts: Vec::new(),
        target: Vec::new(),
        tokens: Vec::new(),
        draft_logits: Vec::new(),
    };
    for _ in 0..sequences {
        let greedy = rng.next_u64() % 4 == 0;
        let params = random_params(rng, vocab, greedy);
        let n = (rng.next_u64() % (max_drafts as u64 + 1)) as usize;
        let agree = rng.next_u64() as usize % (n + 1);
        for j in 0..=n {
            let row = random_row(rng, vocab);
            if j < n {
                let best = verify::greedy_token(&row, &SamplingParams::default(), j).unwrap_or(0);
                b.tokens.push(if j < agree {
                    best
                } else {
                    (rng.next_u64() % vocab as u64) as u32
                });
                let mut draft_row = row.clone();
                for v in draft_row.iter_mut().step_by(3) {
                    *v += 0.5;
                }
                b.draft_logits.extend_from_slice(&draft_row);
            }
            b.target.extend_from_slice(&row);
        }
        b.params.push(params);
        b.positions.push(rng.next_u64() % 1_000_000);
        b.drafts.push(n);
    }
    b
}

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
    }
}

/// Runs `batch` on the CPU backend and on the emulated kernels of `tiles` (one layout per
/// multiprocessor count), asserts the outcomes and statistics are equal, returns the emulation's
/// radix fallbacks.
fn check_emulated(
    test: &str,
    tiles: &VerifyTiles,
    vocab: usize,
    batch: &RandomBatch,
    kinds: &[DraftKind],
    multiprocessors: &[u32],
) -> u64 {
    use fp4spec::kernels::verify::{Capacity, Sequence};
    let capacity = Capacity {
        vocab,
        max_sequences: batch.params.len().max(1),
        max_drafts: batch.drafts.iter().copied().max().unwrap_or(0).max(1),
        max_bias_entries: batch
            .params
            .iter()
            .map(|p| p.logit_bias.len())
            .sum::<usize>()
            .max(1),
    };
    let sequences: Vec<Sequence> = batch
        .params
        .iter()
        .zip(&batch.positions)
        .zip(&batch.drafts)
        .map(|((params, &position), &drafts)| Sequence {
            params,
            position,
            drafts,
        })
        .collect();
    let mut slow_paths = 0;
    for &kind in kinds {
        let draft = (kind == DraftKind::Sampled).then_some(batch.draft_logits.as_slice());
        let want = emulation::reference(
            capacity,
            &sequences,
            kind,
            &batch.target,
            &batch.tokens,
            draft,
        );
        for &sms in multiprocessors {
            let got = emulation::run(
                tiles,
                capacity,
                sms,
                &sequences,
                kind,
                &batch.target,
                &batch.tokens,
                draft,
            );
            for (s, (g, w)) in got.outcomes.iter().zip(&want.outcomes).enumerate() {
                // Debug text: a NaN error value equals itself
                assert_eq!(
                    format!("{g:?}"),
                    format!("{w:?}"),
                    "{test} V={vocab} {kind:?} {sms} SMs: sequence {s} (n={}, position {}, {:?})",
                    batch.drafts[s],
                    batch.positions[s],
                    batch.params[s]
                );
            }
            assert_eq!(
                got.stats, want.stats,
                "{test} V={vocab} {kind:?} {sms} SMs: statistics"
            );
            slow_paths += got.slow_paths;
        }
        let errors = want.outcomes.iter().filter(|o| o.is_err()).count();
        println!(
            "{test} V={vocab} {kind:?}: {} sequences equal ({errors} errors), accepted {:?} of {:?}",
            want.outcomes.len(),
            want.stats.accepted,
            want.stats.drafted
        );
    }
    println!("{test} V={vocab}: {slow_paths} radix fallbacks");
    slow_paths
}

use fp4spec::kernels::verify::DraftKind;
use fp4spec::target::VerifyTiles;

#[test]
fn emulated_kernels_equal_the_reference_on_random_ragged_batches() {
    let mut rng = SplitMix64::new(11);
    for (vocab, sequences) in [(37usize, 8usize), (1000, 6), (20000, 4)] {
        let batch = random_batch(&mut rng, vocab, sequences, 4);
        let kinds = [DraftKind::PointMass, DraftKind::Sampled];
        check_emulated("random", &sm90_tiles(), vocab, &batch, &kinds, &[132, 1]);
    }
}

#[test]
fn emulated_kernels_equal_the_reference_through_the_radix_fallback() {
    let mut rng = SplitMix64::new(12);
    let mut slow_paths = 0;
    for (vocab, sequences) in [(37usize, 6usize), (300, 6), (3001, 3)] {
        let batch = random_batch(&mut rng, vocab, sequences, 3);
        let kinds = [DraftKind::PointMass, DraftKind::Sampled];
        slow_paths += check_emulated("tiny tiles", &tiny_tiles(), vocab, &batch, &kinds, &[4, 1]);
    }
    assert!(slow_paths > 50, "the fallback ran only {slow_paths} times");
}

#[test]
fn emulated_kernels_equal_the_reference_at_the_full_vocabulary() {
    let mut rng = SplitMix64::new(13);
    let vocab = 248_320;
    let batch = random_batch(&mut rng, vocab, 3, 2);
    let kinds = [DraftKind::PointMass, DraftKind::Sampled];
    check_emulated("V=248320", &sm90_tiles(), vocab, &batch, &kinds, &[132]);
}

/// Logit rows shaped like a language model's: a broad bulk and a few strong candidates, the
/// drafts mostly the target's favourite.
fn model_like_batch(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    drafts: usize,
    params: &SamplingParams,
) -> RandomBatch {
    let mut b = RandomBatch {
        params: Vec::new(),
        positions: Vec::new(),
        drafts: Vec::new(),
        target: Vec::new(),
        tokens: Vec::new(),
        draft_logits: Vec::new(),
    };
    for s in 0..sequences {
        for j in 0..=drafts {
            let mut row = rng.normal_vec(vocab, 2.0);
            for k in 0..8 {
                let t = (rng.next_u64() % vocab as u64) as usize;
                row[t] = 12.0 - k as f32;
            }
            if j < drafts {
                let best = verify::greedy_token(&row, params, j).expect("row");
                b.tokens.push(if rng.next_u64() % 4 == 0 {
                    (rng.next_u64() % vocab as u64) as u32
                } else {
                    best
                });
                let mut draft_row = row.clone();
                for v in draft_row.iter_mut().step_by(5) {
                    *v += 1.0;
                }
                b.draft_logits.extend_from_slice(&draft_row);
            }
            b.target.extend_from_slice(&row);
        }
        b.params.push(SamplingParams {
            seed: 1000 + s as u64,
            ..params.clone()
        });
        b.positions.push(100 * s as u64);
        b.drafts.push(drafts);
    }
    b
}

#[test]
fn emulated_kernels_keep_model_like_batches_on_the_fast_path() {
    let mut rng = SplitMix64::new(14);
    let all_controls = SamplingParams {
        temperature: 0.7,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.05,
        logit_bias: vec![(3, 2.0), (17, -1.5), (99, f32::NEG_INFINITY), (1234, 0.5)],
        seed: 0,
    };
    let top_p_only = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        ..SamplingParams::default()
    };
    let kinds = [DraftKind::PointMass, DraftKind::Sampled];
    for (name, params) in [("all controls", &all_controls), ("top-p only", &top_p_only)] {
        let batch = model_like_batch(&mut rng, 20_000, 4, 3, params);
        let slow = check_emulated(name, &sm90_tiles(), 20_000, &batch, &kinds, &[132]);
        assert_eq!(slow, 0, "{name}: the plan missed a bucket {slow} times");
    }
}

#[test]
fn emulated_kernels_report_every_bad_value_as_the_reference_does() {
    let vocab = 64;
    let mut rng = SplitMix64::new(15);
    let sampling = SamplingParams::default();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut b = RandomBatch {
        params: Vec::new(),
        positions: Vec::new(),
        drafts: Vec::new(),
        target: Vec::new(),
        tokens: Vec::new(),
        draft_logits: Vec::new(),
    };
    // (controls, rows: (logit edits per target row), drafts, draft logit edit)
    type Edit = fn(&mut [f32]);
    let certain: Edit = |row| {
        row.fill(-50.0);
        row[1] = 50.0;
    };
    let nan: Edit = |row| row[7] = f32::NAN;
    let inf: Edit = |row| row[9] = f32::INFINITY;
    let masked: Edit = |row| row.fill(f32::NEG_INFINITY);
    let huge: Edit = |row| row[5] = 3.0e38;
    let none: Edit = |_| {};
    let cases: Vec<(SamplingParams, Vec<Edit>, Vec<u32>)> = vec![
        // NaN in the row deciding the bonus token after an accepted certain draft
        (sampling.clone(), vec![certain, nan], vec![1]),
        (greedy.clone(), vec![certain, nan], vec![1]),
        // +inf in the first row
        (sampling.clone(), vec![inf, none], vec![1]),
        // a NaN after a greedy rejection is never looked at
        (greedy.clone(), vec![certain, nan], vec![2]),
        // every token masked
        (sampling.clone(), vec![masked], vec![]),
        (greedy.clone(), vec![masked], vec![]),
        // a draft outside the vocabulary (before everything else)
        (sampling.clone(), vec![nan, none], vec![vocab as u32]),
        // bad controls
        (
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        (
            SamplingParams {
                temperature: 1.0e-40,
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        (
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        (
            SamplingParams {
                logit_bias: vec![(vocab as u32 + 5, 1.0)],
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        (
            SamplingParams {
                logit_bias: vec![(2, f32::NAN)],
                ..SamplingParams::default()
            },
            vec![none],
            vec![],
        ),
        // a bias that overflows a logit to +inf
        (
            SamplingParams {
                logit_bias: vec![(5, 3.0e38)],
                ..SamplingParams::default()
            },
            vec![huge],
            vec![],
        ),
        // the same token biased twice, and a ban
        (
            SamplingParams {
                logit_bias: vec![(4, 1.0), (4, 2.5), (1, f32::NEG_INFINITY)],
                min_p: 0.1,
                ..SamplingParams::default()
            },
            vec![none, none],
            vec![4],
        ),
    ];
    for (s, (params, edits, drafts)) in cases.into_iter().enumerate() {
        for (j, edit) in edits.iter().enumerate() {
            let mut row = rng.normal_vec(vocab, 1.0);
            edit(&mut row);
            if j < drafts.len() {
                let mut draft_row = rng.normal_vec(vocab, 1.0);
                if s == 2 {
                    draft_row[3] = f32::NAN; // a bad draft row, reached after row 0
                }
                b.draft_logits.extend_from_slice(&draft_row);
            }
            b.target.extend_from_slice(&row);
        }
        assert_eq!(edits.len(), drafts.len() + 1);
        b.tokens.extend_from_slice(&drafts);
        b.params.push(params);
        b.positions.push(s as u64);
        b.drafts.push(drafts.len());
    }
    let kinds = [DraftKind::PointMass, DraftKind::Sampled];
    check_emulated("bad values", &sm90_tiles(), vocab, &b, &kinds, &[132]);
}
