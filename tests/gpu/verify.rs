//! GPU checks of the `verify` family: the kernels give exactly the reference's outcomes (same
//! tokens, same accept counts, same errors, same statistics) on random ragged batches with every
//! control, at V = 248320 and small V, greedy and sampling, point-mass and sampled drafts, every
//! bad value, through the radix fallback, with logits just below zero, on every device backend
//! present (CUDA; HIP on a gfx1151 built with `--features hip`), and (CUDA only: the HIP backend
//! captures no graphs) replayed from a CUDA graph.

#[path = "../verify_support/batches.rs"]
mod batches;

use crate::common::{cuda, devices, rng};
use batches::{Batch, Run, assert_same, on_backend};
use fp4spec::Error;
use fp4spec::backend::{Backend, DeviceVec, Graph};
use fp4spec::kernels::verify::{self, DraftKind, Path, SamplingParams, VerifyWorkspace};

const KINDS: [DraftKind; 2] = [DraftKind::PointMass, DraftKind::Sampled];
/// Top-k values that put a batch on the top-k path (`top_k_max` is 256 on every target).
const TOP_KS: &[usize] = &[50, 1, 256, 7, 20];

/// A device against the CPU reference for both kinds of drafts; prints one line per kind.
fn check(backend: &Backend, what: &str, batch: &Batch, vocab: usize) {
    for kind in KINDS {
        let want = on_backend(&Backend::Cpu, batch, vocab, kind);
        let got = on_backend(backend, batch, vocab, kind);
        assert_same(&format!("{what} {kind:?}"), batch, vocab, &got, &want);
        let errors = want.outcomes.iter().filter(|o| o.is_err()).count();
        println!(
            "{what} {kind:?}: {} sequences equal ({errors} errors), accepted {:?} of {:?}",
            want.outcomes.len(),
            want.stats.accepted,
            want.stats.drafted
        );
    }
}

#[test]
fn verify_equals_the_reference_on_random_ragged_batches() {
    for backend in devices("verify_equals_the_reference_on_random_ragged_batches") {
        let mut rng = rng("verify random batches");
        for (vocab, sequences) in [(37usize, 16usize), (1000, 16), (20_000, 8), (248_320, 8)] {
            let batch = batches::random(&mut rng, vocab, sequences, 4);
            check(
                backend,
                &format!("random V={vocab} B={sequences}"),
                &batch,
                vocab,
            );
            // the same sequences greedy: one launch of verify_greedy with point-mass drafts
            check(
                backend,
                &format!("greedy random V={vocab} B={sequences}"),
                &batch.greedy_sequences(vocab),
                vocab,
            );
            // with top-k on everywhere: verify_topk
            check(
                backend,
                &format!("top-k random V={vocab} B={sequences}"),
                &batch.with_top_k(TOP_KS),
                vocab,
            );
        }
    }
}

#[test]
fn verify_equals_the_reference_at_the_bench_shapes() {
    for backend in devices("verify_equals_the_reference_at_the_bench_shapes") {
        let mut rng = rng("verify bench shapes");
        let params = batches::all_controls();
        // top-k 50: verify_topk; top-k off: the histogram passes
        let top_k_off = SamplingParams {
            top_k: 0,
            ..params.clone()
        };
        for (sequences, drafts) in [(1usize, 1usize), (8, 2), (64, 4)] {
            for (what, params) in [("all controls", &params), ("top-k off", &top_k_off)] {
                let batch = batches::model_like(&mut rng, 248_320, sequences, drafts, params);
                check(
                    backend,
                    &format!("{what} B={sequences} n={drafts}"),
                    &batch,
                    248_320,
                );
            }
        }
        let greedy = SamplingParams {
            temperature: 0.0,
            ..batches::all_controls()
        };
        let batch = batches::model_like(&mut rng, 248_320, 8, 4, &greedy);
        check(backend, "greedy B=8 n=4", &batch, 248_320);
    }
}

#[test]
fn verify_reports_every_bad_value_as_the_reference_does() {
    for backend in devices("verify_reports_every_bad_value_as_the_reference_does") {
        let bad = batches::bad_values(&mut rng("verify bad values"));
        for (what, (batch, vocab)) in [
            ("bad values", bad),
            ("NaN after bias", (batches::nan_after_bias(300), 300)),
            ("clamped octaves", (batches::clamped_octaves(300), 300)),
        ] {
            check(backend, what, &batch, vocab);
            check(
                backend,
                &format!("top-k {what}"),
                &batch.with_top_k(TOP_KS),
                vocab,
            );
            check(
                backend,
                &format!("greedy {what}"),
                &batch.greedy_sequences(vocab),
                vocab,
            );
        }
    }
}

/// Rows whose cut and draw buckets hold far more tokens than the candidate space: nearly flat
/// rows, exactly flat rows (ties broken by id only), bf16 plateaus; the finish resolves them by
/// radix rounds over the row.
#[test]
fn verify_equals_the_reference_through_the_radix_fallback() {
    for backend in devices("verify_equals_the_reference_through_the_radix_fallback") {
        let mut rng = rng("verify radix fallback");
        let vocab = 248_320;
        let batch = batches::flat_rows(&mut rng, vocab);
        check(backend, "flat rows", &batch, vocab);
        // every logit tied: verify_topk's buffers fill and are cut on ids alone
        check(backend, "top-k flat rows", &batch.with_top_k(TOP_KS), vocab);
    }
}

/// Logits just below zero (`f = y - k` rounds to 1: the top of octave -1), some rows topped by
/// one of them; the candidates' path and the radix fallback.
#[test]
fn verify_equals_the_reference_when_logits_straddle_zero() {
    for backend in devices("verify_equals_the_reference_when_logits_straddle_zero") {
        let mut rng = rng("verify straddling zero");
        for (vocab, sequences) in [(20_000usize, 16usize), (248_320, 8)] {
            let batch = batches::straddling_zero(&mut rng, vocab, sequences, 3);
            check(
                backend,
                &format!("straddling zero V={vocab} B={sequences}"),
                &batch,
                vocab,
            );
            check(
                backend,
                &format!("top-k straddling zero V={vocab} B={sequences}"),
                &batch.with_top_k(TOP_KS),
                vocab,
            );
        }
    }
}

/// A `verify` launch of one batch captured into a CUDA graph, with the device buffers it reads.
struct Captured {
    graph: Graph,
    _inputs: (DeviceVec<f32>, DeviceVec<u32>, Option<DeviceVec<f32>>),
}

/// Uploads `batch`'s logits and drafts, runs `verify` once outside the capture (compiles and
/// loads the module), then captures it once through `Backend::capture`, which records this
/// thread's launches on a stream of its own. (Capturing the backend's shared stream itself
/// swallowed or broke what the other test threads queued on it meanwhile: their uploads failed
/// with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, their kernels never ran, thirty-first session.)
/// The workspace holds `batch` already.
fn capture(
    backend: &Backend,
    ws: &mut VerifyWorkspace,
    batch: &Batch,
    kind: DraftKind,
) -> Captured {
    let target = backend.upload(&batch.target).expect("upload");
    let tokens = backend.upload(&batch.tokens).expect("upload");
    let draft = batch
        .draft_logits_for(kind)
        .map(|d| backend.upload(d).expect("upload"));
    verify::verify(backend, ws, &target, &tokens, draft.as_ref()).expect("warm-up");
    backend.synchronize().expect("warm-up");
    let graph = backend
        .capture(|| verify::verify(backend, ws, &target, &tokens, draft.as_ref()))
        .expect("captured verify");
    Captured {
        graph,
        _inputs: (target, tokens, draft),
    }
}

/// Replays the graph on fresh statistics and checks outcomes and statistics against the CPU
/// reference on `batch` (what the workspace holds now); returns the reference's run.
fn replay_equals_the_reference(
    captured: &Captured,
    ws: &mut VerifyWorkspace,
    batch: &Batch,
    vocab: usize,
    kind: DraftKind,
    what: &str,
) -> Run {
    ws.reset_stats().expect("reset statistics");
    captured.graph.launch().expect("graph launch");
    let got = Run {
        outcomes: ws.outcomes().expect("outcomes"),
        stats: ws.stats().expect("stats"),
    };
    let want = on_backend(&Backend::Cpu, batch, vocab, kind);
    assert_same(what, batch, vocab, &got, &want);
    want
}

/// The launches are captured once into a CUDA graph and replayed; new controls and positions
/// (same shapes) are uploaded between replays without capturing again. With top-k on the graph
/// holds `verify_topk`, which then reports sequences with top-k off as errors, never tokens;
/// with it off, the histogram passes.
#[test]
fn verify_replays_from_a_cuda_graph() {
    let Some(backend) = cuda("verify_replays_from_a_cuda_graph") else {
        return;
    };
    let mut rng = rng("verify graph");
    let vocab = 248_320;
    for kind in KINDS {
        for (top_k, path) in [(50, Path::TopK), (0, Path::Histogram)] {
            let params = SamplingParams {
                top_k,
                ..batches::all_controls()
            };
            let mut batch = batches::model_like(&mut rng, vocab, 4, 3, &params);
            let mut ws = VerifyWorkspace::new(backend, batch.capacity(vocab)).expect("workspace");
            ws.set_batch(&batch.sequences(), kind).expect("set_batch");
            assert_eq!(ws.batch().expect("batch").path, path, "top-k {top_k}");
            let captured = capture(backend, &mut ws, &batch, kind);
            for replay in 0..2 {
                if replay == 1 {
                    for (s, position) in batch.positions.iter_mut().enumerate() {
                        *position += 1000 + s as u64;
                    }
                    for p in &mut batch.params {
                        p.seed = p.seed.wrapping_mul(31).wrapping_add(7);
                        p.top_p = 0.8;
                    }
                    ws.set_batch(&batch.sequences(), kind).expect("set_batch");
                }
                let what = format!("graph replay {replay} {kind:?} {path:?}");
                let want =
                    replay_equals_the_reference(&captured, &mut ws, &batch, vocab, kind, &what);
                println!("{what}: equal, accepted {:?}", want.stats.accepted);
            }
            if path == Path::TopK {
                for p in &mut batch.params {
                    p.top_k = 0;
                }
                ws.set_batch(&batch.sequences(), kind).expect("set_batch");
                captured.graph.launch().expect("graph launch");
                let err = ws.outcomes().expect_err("top-k off under a top-k graph");
                assert!(
                    err.to_string().contains("capture them again"),
                    "unexpected error: {err}"
                );
                println!("top-k graph {kind:?}: then {err}");
            }
        }
    }
}

/// A graph captured for a batch of greedy sequences (one launch of `verify_greedy`) replays
/// correctly for new greedy controls, and reports an error, never a token, for sampling
/// sequences uploaded since.
#[test]
fn a_greedy_graph_serves_greedy_batches_and_reports_others() {
    let Some(backend) = cuda("a_greedy_graph_serves_greedy_batches_and_reports_others") else {
        return;
    };
    let mut rng = rng("verify greedy graph");
    let vocab = 248_320;
    let greedy = SamplingParams {
        temperature: 0.0,
        ..batches::all_controls()
    };
    let mut batch = batches::model_like(&mut rng, vocab, 6, 2, &greedy);
    let kind = DraftKind::PointMass;
    let mut ws = VerifyWorkspace::new(backend, batch.capacity(vocab)).expect("workspace");
    ws.set_batch(&batch.sequences(), kind).expect("set_batch");
    assert_eq!(
        ws.batch().expect("batch").path,
        Path::Greedy,
        "the batch is greedy"
    );
    let captured = capture(backend, &mut ws, &batch, kind);
    for replay in 0..2 {
        if replay == 1 {
            // a strong bias moves some argmaxes (the same number of entries: the capacity)
            for (s, p) in batch.params.iter_mut().enumerate() {
                p.logit_bias[0] = (s as u32 * 7, 40.0);
            }
            ws.set_batch(&batch.sequences(), kind).expect("set_batch");
        }
        let what = format!("greedy graph replay {replay}");
        replay_equals_the_reference(&captured, &mut ws, &batch, vocab, kind, &what);
    }
    for p in &mut batch.params {
        p.temperature = 0.7;
    }
    ws.set_batch(&batch.sequences(), kind).expect("set_batch");
    captured.graph.launch().expect("graph launch");
    let err = ws
        .outcomes()
        .expect_err("sampling sequences under a greedy graph");
    assert!(
        err.to_string().contains("capture them again"),
        "unexpected error: {err}"
    );
    println!("greedy graph: 2 replays equal, then {err}");
}

/// Statistics add up over launches until reset; buffers of another backend are errors.
#[test]
fn verify_statistics_accumulate_and_foreign_buffers_are_errors() {
    for backend in devices("verify_statistics_accumulate_and_foreign_buffers_are_errors") {
        let mut rng = rng("verify statistics");
        let vocab = 20_000; // the bias of all_controls() reaches token 19999
        let batch = batches::model_like(&mut rng, vocab, 6, 3, &batches::all_controls());
        let mut ws = VerifyWorkspace::new(backend, batch.capacity(vocab)).expect("workspace");
        ws.set_batch(&batch.sequences(), DraftKind::PointMass)
            .expect("set_batch");
        let target = backend.upload(&batch.target).expect("upload");
        let tokens = backend.upload(&batch.tokens).expect("upload");
        for _ in 0..3 {
            verify::verify(backend, &mut ws, &target, &tokens, None).expect("verify");
        }
        let once = on_backend(&Backend::Cpu, &batch, vocab, DraftKind::PointMass).stats;
        let three = ws.stats().expect("stats");
        let tripled = |counts: &[u64]| counts.iter().map(|c| 3 * c).collect::<Vec<u64>>();
        assert!(once.drafted.iter().any(|&d| d > 0), "the batch drafts");
        assert_eq!(
            three.accepted,
            tripled(&once.accepted),
            "accepted counts over three launches"
        );
        assert_eq!(
            three.drafted,
            tripled(&once.drafted),
            "drafted counts over three launches"
        );
        ws.reset_stats().expect("reset");
        assert!(ws.stats().expect("stats").drafted.iter().all(|&d| d == 0));

        let host_target = Backend::Cpu.upload(&batch.target).expect("host");
        let err = verify::verify(backend, &mut ws, &host_target, &tokens, None).unwrap_err();
        assert!(matches!(err, Error::BackendMismatch { .. }), "{err}");
        let short = backend.upload(&batch.target[..vocab]).expect("upload");
        let err = verify::verify(backend, &mut ws, &short, &tokens, None).unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{err}");
    }
}
