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
