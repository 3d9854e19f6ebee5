//! Batches for the `verify` tests (the CPU emulation in tests/verify.rs and the GPU module
//! tests/gpu/verify.rs): random ragged ones with every control, model-like ones, one of every bad
//! value; running one on a backend; comparing two runs with a diagnostic message.

#![allow(dead_code)] // each test binary uses its own subset

use fp4spec::backend::Backend;
use fp4spec::kernels::verify::{
    self, AcceptanceStats, Capacity, DraftKind, RowError, SamplingParams, Sequence, Verified,
    VerifyWorkspace,
};
use fp4spec::rng::SplitMix64;

/// Sequences with their rows: target rows of every sequence in order, then the drafts.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub params: Vec<SamplingParams>,
    pub positions: Vec<u64>,
    pub drafts: Vec<usize>,
    /// `[sum(n + 1)][vocab]`.
    pub target: Vec<f32>,
    /// `[sum(n)]`.
    pub tokens: Vec<u32>,
    /// `[sum(n)][vocab]`.
    pub draft_logits: Vec<f32>,
}

impl Batch {
    pub fn sequences(&self) -> Vec<Sequence<'_>> {
        self.params
            .iter()
            .zip(&self.positions)
            .zip(&self.drafts)
            .map(|((params, &position), &drafts)| Sequence {
                params,
                position,
                drafts,
            })
            .collect()
    }

    /// The smallest capacity that holds the batch.
    pub fn capacity(&self, vocab: usize) -> Capacity {
        Capacity {
            vocab,
            max_sequences: self.params.len().max(1),
            max_drafts: self.drafts.iter().copied().max().unwrap_or(0).max(1),
            max_bias_entries: self
                .params
                .iter()
                .map(|p| p.logit_bias.len())
                .sum::<usize>()
                .max(1),
        }
    }

    /// Its sequences at temperature 0, without those whose controls the host then rejects: a
    /// batch the greedy kernel serves alone (with point-mass drafts).
    pub fn greedy_sequences(&self, vocab: usize) -> Batch {
        let mut out = Batch::default();
        let (mut row, mut draft) = (0, 0);
        for (s, params) in self.params.iter().enumerate() {
            let n = self.drafts[s];
            let greedy = SamplingParams {
                temperature: 0.0,
                ..params.clone()
            };
            if verify::reference::check_params(&greedy, vocab).is_ok() {
                let rows: Vec<Vec<f32>> = (row..=row + n)
                    .map(|r| self.target[r * vocab..(r + 1) * vocab].to_vec())
                    .collect();
                let drafts: Vec<(u32, Vec<f32>)> = (draft..draft + n)
                    .map(|d| {
                        let logits = self.draft_logits[d * vocab..(d + 1) * vocab].to_vec();
                        (self.tokens[d], logits)
                    })
                    .collect();
                out.push(greedy, self.positions[s], &rows, &drafts);
            }
            row += n + 1;
            draft += n;
        }
        out
    }

    /// The same sequences with top-k `ks[s % ks.len()]` for sequence s: with every k at most the
    /// target's `top_k_max`, a batch `verify_topk` serves.
    pub fn with_top_k(&self, ks: &[usize]) -> Batch {
        let mut out = self.clone();
        for (s, params) in out.params.iter_mut().enumerate() {
            params.top_k = ks[s % ks.len()];
        }
        out
    }

    pub fn draft_logits_for(&self, kind: DraftKind) -> Option<&[f32]> {
        (kind == DraftKind::Sampled).then_some(self.draft_logits.as_slice())
    }

    /// Appends one sequence.
    fn push(
        &mut self,
        params: SamplingParams,
        position: u64,
        rows: &[Vec<f32>],
        drafts: &[(u32, Vec<f32>)],
    ) {
        assert_eq!(rows.len(), drafts.len() + 1);
        for row in rows {
            self.target.extend_from_slice(row);
        }
        for (token, row) in drafts {
            self.tokens.push(*token);
            self.draft_logits.extend_from_slice(row);
        }
        self.params.push(params);
        self.positions.push(position);
        self.drafts.push(drafts.len());
    }
}

/// Controls with each of temperature, top-k, top-p, min-p and bias on or off.
pub fn random_params(rng: &mut SplitMix64, vocab: usize, greedy: bool) -> SamplingParams {
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
            let token = pick(vocab as u64) as u32;
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

/// A logit row of one of four shapes: broad, narrow, nearly flat, bf16-rounded (many ties);
/// sometimes with a masked token.
pub fn random_row(rng: &mut SplitMix64, vocab: usize) -> Vec<f32> {
    let shape = rng.next_u64() % 4;
    let spread = [4.0, 1.0, 0.02, 8.0][shape as usize];
    let mut row = rng.normal_vec(vocab, spread);
    if shape == 3 {
        for v in &mut row {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
    if rng.next_u64() % 3 == 0 {
        row[(rng.next_u64() % vocab as u64) as usize] = f32::NEG_INFINITY;
    }
    row
}

/// `sequences` sequences of 0..=max_drafts drafts with random controls; each sequence's drafts
/// agree with its rows' argmax for a random while, then are random; draft rows are the target
/// rows with every third logit raised.
pub fn random(rng: &mut SplitMix64, vocab: usize, sequences: usize, max_drafts: usize) -> Batch {
    let mut b = Batch::default();
    for _ in 0..sequences {
        let greedy = rng.next_u64() % 4 == 0;
        let params = random_params(rng, vocab, greedy);
        let n = (rng.next_u64() % (max_drafts as u64 + 1)) as usize;
        let agree = rng.next_u64() as usize % (n + 1);
        let rows: Vec<Vec<f32>> = (0..=n).map(|_| random_row(rng, vocab)).collect();
        let drafts: Vec<(u32, Vec<f32>)> = (0..n)
            .map(|j| {
                let best = verify::reference::greedy_token(&rows[j], &SamplingParams::default(), j)
                    .unwrap_or(0);
                let token = if j < agree {
                    best
                } else {
                    (rng.next_u64() % vocab as u64) as u32
                };
                let mut draft_row = rows[j].clone();
                for v in draft_row.iter_mut().step_by(3) {
                    *v += 0.5;
                }
                (token, draft_row)
            })
            .collect();
        let position = rng.next_u64() % 1_000_000;
        b.push(params, position, &rows, &drafts);
    }
    b
}

/// Rows whose 64 strongest tokens, nearly equal, lie together at `start..start + 64` (one block's
/// chunk), over a unit normal bulk; top-k 50 and no other control, so every one of the top 50
/// weighs in every draw; drafts among them.
pub fn clustered_top(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    drafts: usize,
    start: usize,
) -> Batch {
    let mut b = Batch::default();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 50,
        ..SamplingParams::default()
    };
    for s in 0..sequences {
        let rows: Vec<Vec<f32>> = (0..=drafts)
            .map(|_| {
                let mut row = rng.normal_vec(vocab, 1.0);
                for (t, v) in rng.normal_vec(64, 0.05).into_iter().enumerate() {
                    row[start + t] = 10.0 + v;
                }
                row
            })
            .collect();
        let draft_rows: Vec<(u32, Vec<f32>)> = (0..drafts)
            .map(|j| {
                let token = (start as u64 + rng.next_u64() % 64) as u32;
                let mut draft_row = rows[j].clone();
                draft_row[token as usize] += 0.5;
                (token, draft_row)
            })
            .collect();
        let params = SamplingParams {
            seed: 77 + s as u64,
            ..params.clone()
        };
        b.push(params, 10 * s as u64, &rows, &draft_rows);
    }
    b
}

/// Rows shaped like a language model's (a broad bulk and eight strong candidates), `drafts`
/// drafts per sequence, mostly the target's favourite, all sequences with `params` (own seeds).
pub fn model_like(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    drafts: usize,
    params: &SamplingParams,
) -> Batch {
    let mut b = Batch::default();
    for s in 0..sequences {
        let rows: Vec<Vec<f32>> = (0..=drafts)
            .map(|_| {
                let mut row = rng.normal_vec(vocab, 2.0);
                for k in 0..8 {
                    let t = (rng.next_u64() % vocab as u64) as usize;
                    row[t] = 12.0 - k as f32;
                }
                row
            })
            .collect();
        let draft_rows: Vec<(u32, Vec<f32>)> = (0..drafts)
            .map(|j| {
                let best = verify::reference::greedy_token(&rows[j], params, j).expect("row");
                let token = if rng.next_u64() % 4 == 0 {
                    (rng.next_u64() % vocab as u64) as u32
                } else {
                    best
                };
                let mut draft_row = rows[j].clone();
                for v in draft_row.iter_mut().step_by(5) {
                    *v += 1.0;
                }
                (token, draft_row)
            })
            .collect();
        let params = SamplingParams {
            seed: 1000 + s as u64 + rng.next_u64() % 1000,
            ..params.clone()
        };
        b.push(params, 100 * s as u64, &rows, &draft_rows);
    }
    b
}

/// Rows of N(0, 1) logits with one token at 30 in the last quarter of the vocabulary, a low
/// temperature (0.1 or 0.3) and random other controls: the spike is hundreds of octaves of weight
/// above most of the row.
pub fn spiked(rng: &mut SplitMix64, vocab: usize, sequences: usize, drafts: usize) -> Batch {
    let mut b = Batch::default();
    for s in 0..sequences {
        let mut params = random_params(rng, vocab, false);
        params.temperature = if s % 2 == 0 { 0.1 } else { 0.3 };
        let rows: Vec<Vec<f32>> = (0..=drafts)
            .map(|_| {
                let mut row = rng.normal_vec(vocab, 1.0);
                let at = vocab - 1 - (rng.next_u64() % (vocab as u64 / 4)) as usize;
                row[at] = 30.0;
                row
            })
            .collect();
        let draft_rows: Vec<(u32, Vec<f32>)> = (0..drafts)
            .map(|j| {
                let best = verify::reference::greedy_token(&rows[j], &SamplingParams::default(), j)
                    .expect("row");
                (best, rows[j].clone())
            })
            .collect();
        b.push(params, 50 * s as u64, &rows, &draft_rows);
    }
    b
}

/// Rows of N(0, 1) logits with three tokens at 8 in the last sixteenth of the vocabulary, drafts a
/// token of the first half (its draft row: that token at 8, the target's three at 0), temperature
/// 1 or 0.7 and no other control: every draft is almost surely rejected and the residual's
/// weight lies in the row's last chunks, so the residual draw must find a chunk far from the
/// first.
pub fn residual_at_the_end(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    drafts: usize,
) -> Batch {
    let mut b = Batch::default();
    for s in 0..sequences {
        let params = SamplingParams {
            temperature: if s % 2 == 0 { 1.0 } else { 0.7 },
            seed: rng.next_u64(),
            ..SamplingParams::default()
        };
        let mut high = Vec::new();
        let rows: Vec<Vec<f32>> = (0..=drafts)
            .map(|_| {
                let mut row = rng.normal_vec(vocab, 1.0);
                let ids: Vec<usize> = (0..3)
                    .map(|_| vocab - 1 - (rng.next_u64() % (vocab as u64 / 16)) as usize)
                    .collect();
                ids.iter().for_each(|&at| row[at] = 8.0);
                high.push(ids);
                row
            })
            .collect();
        let draft_rows: Vec<(u32, Vec<f32>)> = (0..drafts)
            .map(|j| {
                let token = (rng.next_u64() % (vocab as u64 / 2)) as u32;
                let mut row = rows[j].clone();
                high[j].iter().for_each(|&at| row[at] = 0.0);
                row[token as usize] = 8.0;
                (token, row)
            })
            .collect();
        b.push(params, 70 * s as u64, &rows, &draft_rows);
    }
    b
}

/// Logits just below zero, whose `y = z * log2(e) / T` lies in `[-2^-25, 0)` at every
/// temperature used here: `f = y - k` rounds to 1 there, the heaviest weight of octave -1 (the
/// kernels once filed these tokens in a bucket of the octave above). Every fourth token of a
/// broad, narrow or nearly flat row becomes one of them, zero, or a tiny positive logit (in
/// rows with no logit above zero, one of them is the top token). Controls keep such tokens in
/// play (temperature 0.05 to 1.3, top-k off or above them, top-p and min-p loose or cutting
/// among them); drafts are random tokens, draft rows the target rows with every third logit
/// raised.
pub fn straddling_zero(
    rng: &mut SplitMix64,
    vocab: usize,
    sequences: usize,
    max_drafts: usize,
) -> Batch {
    // the first six lie below zero
    const NEAR_ZERO: [f32; 8] = [-1e-12, -1e-10, -2e-10, -3e-10, -1e-20, -1e-40, 0.0, 1e-12];
    let mut b = Batch::default();
    for _ in 0..sequences {
        let mut pick = |n: u64| rng.next_u64() % n;
        let params = SamplingParams {
            temperature: [1.0, 0.7, 1.3, 0.05][pick(4) as usize],
            top_k: [0, vocab / 2, vocab][pick(3) as usize],
            top_p: [1.0, 0.9, 0.5][pick(3) as usize],
            min_p: [0.0, 0.05, 0.99][pick(3) as usize],
            logit_bias: Vec::new(),
            seed: pick(u64::MAX),
        };
        let n = (rng.next_u64() % (max_drafts as u64 + 1)) as usize;
        let rows: Vec<Vec<f32>> = (0..=n)
            .map(|_| {
                let shape = rng.next_u64() % 4;
                let mut row = rng.normal_vec(vocab, [1.0, 0.01, 0.0001, 0.01][shape as usize]);
                // shape 3: no logit above zero, so the row's top token is one of them
                let (near, negate) = if shape == 3 { (6, true) } else { (8, false) };
                if negate {
                    row.iter_mut().for_each(|v| *v = -v.abs());
                }
                for v in row.iter_mut().step_by(4) {
                    *v = NEAR_ZERO[(rng.next_u64() % near) as usize];
                }
                row
            })
            .collect();
        let drafts: Vec<(u32, Vec<f32>)> = (0..n)
            .map(|j| {
                let token = (rng.next_u64() % vocab as u64) as u32;
                let mut draft_row = rows[j].clone();
                for v in draft_row.iter_mut().skip(1).step_by(3) {
                    *v += 0.001;
                }
                (token, draft_row)
            })
            .collect();
        let position = rng.next_u64() % 1_000_000;
        b.push(params, position, &rows, &drafts);
    }
    b
}

/// A logit the bias makes NaN (3e38, biased by 3e38 to +inf, then by -inf): a bad value at that
/// token, for a greedy sequence, a sampling one with top-k and one without (one draft each).
pub fn nan_after_bias(vocab: usize) -> Batch {
    let mut batch = Batch::default();
    for (s, (temperature, top_k)) in [(0.0, 0usize), (0.8, 20), (0.8, 0)].into_iter().enumerate() {
        let mut row: Vec<f32> = (0..vocab).map(|i| (i % 13) as f32 * 0.5).collect();
        row[5] = 3e38;
        let params = SamplingParams {
            temperature,
            top_k,
            logit_bias: vec![(5, 3e38), (5, f32::NEG_INFINITY)],
            seed: 11 + s as u64,
            ..SamplingParams::default()
        };
        let drafts = [(3u32, row.clone())];
        batch.push(params, 1 + s as u64, &[row.clone(), row], &drafts);
    }
    batch
}

/// Rows whose octaves clamp at both ends (temperature 1e-8: y = z * log2(e) / T is clamped to
/// +-2^30), so a token's distance below the top overflows 32 bits: it must weigh nothing. Each
/// sequence (one draft, the banned token) has two finite logits, 10 and 9, the second biased by
/// -100; top-k 5 or off.
pub fn clamped_octaves(vocab: usize) -> Batch {
    let mut batch = Batch::default();
    for (s, top_k) in [5usize, 0, 2].into_iter().enumerate() {
        let mut row = vec![f32::NEG_INFINITY; vocab];
        row[7] = 10.0;
        row[100] = 9.0;
        let params = SamplingParams {
            temperature: 1e-8,
            top_k,
            logit_bias: vec![(100, -100.0)],
            seed: 7 + s as u64,
            ..SamplingParams::default()
        };
        let drafts = [(100u32, row.clone())];
        batch.push(params, 1 + s as u64, &[row.clone(), row], &drafts);
    }
    batch
}

/// Rows whose cut and draw buckets hold far more tokens than the candidate space, three
/// sequences (two drafts each) per shape: nearly flat rows (N(0, 0.001)), exactly flat rows
/// (ties broken by id only), bf16 plateaus (N(0, 0.05) rounded); each shape with top-p 0.5,
/// top-k 100000, and top-p 0.9 with min-p 0.99. Draft rows are the target rows with every
/// seventh logit raised by 0.001. The finish resolves them by radix rounds over the row.
pub fn flat_rows(rng: &mut SplitMix64, vocab: usize) -> Batch {
    let mut batch = Batch::default();
    let shapes: [fn(&mut SplitMix64, usize) -> Vec<f32>; 3] = [
        |rng, v| rng.normal_vec(v, 0.001),
        |_, v| vec![0.25; v],
        |rng, v| {
            rng.normal_vec(v, 0.05)
                .into_iter()
                .map(|x| half::bf16::from_f32(x).to_f32())
                .collect()
        },
    ];
    for (s, shape) in shapes.into_iter().enumerate() {
        for (top_p, top_k, min_p) in [(0.5, 0, 0.0), (1.0, 100_000, 0.0), (0.9, 0, 0.99)] {
            let rows: Vec<Vec<f32>> = (0..3).map(|_| shape(rng, vocab)).collect();
            batch.target.extend(rows.iter().flatten());
            for row in &rows[..2] {
                batch.tokens.push((rng.next_u64() % vocab as u64) as u32);
                let mut draft_row = row.clone();
                draft_row.iter_mut().step_by(7).for_each(|v| *v += 0.001);
                batch.draft_logits.extend_from_slice(&draft_row);
            }
            batch.params.push(SamplingParams {
                top_p,
                top_k,
                min_p,
                seed: rng.next_u64(),
                ..SamplingParams::default()
            });
            batch.positions.push(s as u64 * 17);
            batch.drafts.push(2);
        }
    }
    batch
}

/// Every control on, at values a chat deployment uses.
pub fn all_controls() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.05,
        logit_bias: vec![
            (3, 2.0),
            (17, -1.5),
            (99, f32::NEG_INFINITY),
            (1234, 0.5),
            (1234, 0.25),
            (19_999, 1.0),
            (5, -0.5),
            (77, 3.0),
        ],
        seed: 0,
    }
}

/// One sequence per bad value of the issue (and the edge cases around them), on a vocabulary of
/// 64: NaN / +inf in a row the outcome needs and in one it does not, a bias that overflows to
/// +inf, a masked row, a draft outside the vocabulary, each bad control, a bad draft row,
/// repeated bias entries and a ban.
pub fn bad_values(rng: &mut SplitMix64) -> (Batch, usize) {
    let vocab = 64;
    let sampling = SamplingParams::default();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let with = |edit: &dyn Fn(&mut Vec<f32>), rng: &mut SplitMix64| {
        let mut row = rng.normal_vec(vocab, 1.0);
        edit(&mut row);
        row
    };
    let certain = |row: &mut Vec<f32>| {
        row.fill(-50.0);
        row[1] = 50.0;
    };
    let nan = |row: &mut Vec<f32>| row[7] = f32::NAN;
    let inf = |row: &mut Vec<f32>| row[9] = f32::INFINITY;
    let masked = |row: &mut Vec<f32>| row.fill(f32::NEG_INFINITY);
    let huge = |row: &mut Vec<f32>| row[5] = 3.0e38;
    let none = |_: &mut Vec<f32>| {};
    let mut b = Batch::default();
    let mut position = 0;
    let mut add = |b: &mut Batch,
                   params: SamplingParams,
                   rows: Vec<Vec<f32>>,
                   drafts: Vec<(u32, Vec<f32>)>| {
        b.push(params, position, &rows, &drafts);
        position += 10;
    };
    // NaN in the row deciding the bonus token after an accepted certain draft: an error
    let rows = vec![with(&certain, rng), with(&nan, rng)];
    add(
        &mut b,
        sampling.clone(),
        rows.clone(),
        vec![(1, rows[0].clone())],
    );
    add(&mut b, greedy.clone(), rows, vec![(1, with(&none, rng))]);
    // +inf in the first row
    let rows = vec![with(&inf, rng), with(&none, rng)];
    add(&mut b, sampling.clone(), rows, vec![(1, with(&none, rng))]);
    // a NaN after a greedy rejection is never looked at
    let rows = vec![with(&certain, rng), with(&nan, rng)];
    add(&mut b, greedy.clone(), rows, vec![(2, with(&none, rng))]);
    // a bad draft row (sampled drafts only), reached at position 0
    let rows = vec![with(&certain, rng), with(&none, rng)];
    add(&mut b, sampling.clone(), rows, vec![(1, with(&nan, rng))]);
    // every token masked
    add(&mut b, sampling.clone(), vec![with(&masked, rng)], vec![]);
    add(&mut b, greedy.clone(), vec![with(&masked, rng)], vec![]);
    // a draft outside the vocabulary comes before everything else
    let rows = vec![with(&nan, rng), with(&none, rng)];
    add(
        &mut b,
        sampling.clone(),
        rows,
        vec![(vocab as u32, with(&none, rng))],
    );
    // bad controls
    let bad_controls = [
        SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.0e-40,
            ..SamplingParams::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            min_p: 1.5,
            ..SamplingParams::default()
        },
        SamplingParams {
            logit_bias: vec![(vocab as u32 + 5, 1.0)],
            ..SamplingParams::default()
        },
        SamplingParams {
            logit_bias: vec![(2, f32::NAN)],
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.0,
            top_p: 2.0,
            ..SamplingParams::default()
        },
    ];
    for params in bad_controls {
        let rows = vec![with(&none, rng), with(&none, rng)];
        add(&mut b, params, rows, vec![(3, with(&none, rng))]);
    }
    // a bias that overflows a logit to +inf
    let params = SamplingParams {
        logit_bias: vec![(5, 3.0e38)],
        ..SamplingParams::default()
    };
    add(&mut b, params, vec![with(&huge, rng)], vec![]);
    // the same token biased twice, a ban, min-p
    let params = SamplingParams {
        logit_bias: vec![(4, 1.0), (4, 2.5), (1, f32::NEG_INFINITY)],
        min_p: 0.1,
        ..SamplingParams::default()
    };
    let rows = vec![with(&none, rng), with(&none, rng)];
    add(&mut b, params, rows, vec![(4, with(&none, rng))]);
    // min-p 1 and top-k 1: one token left
    let params = SamplingParams {
        min_p: 1.0,
        top_k: 1,
        ..SamplingParams::default()
    };
    let rows = vec![with(&none, rng), with(&none, rng)];
    add(&mut b, params, rows, vec![(0, with(&none, rng))]);
    (b, vocab)
}

/// What one batch produced on a backend.
pub struct Run {
    pub outcomes: Vec<Result<Verified, RowError>>,
    pub stats: AcceptanceStats,
}

/// Runs `batch` on `backend` through the launch API (a fresh workspace).
pub fn on_backend(backend: &Backend, batch: &Batch, vocab: usize, kind: DraftKind) -> Run {
    let mut ws = VerifyWorkspace::new(backend, batch.capacity(vocab)).expect("workspace");
    ws.set_batch(&batch.sequences(), kind).expect("set_batch");
    let target = backend.upload(&batch.target).expect("upload target logits");
    let tokens = backend
        .upload(if batch.tokens.is_empty() {
            &[0u32][..]
        } else {
            &batch.tokens
        })
        .expect("upload draft tokens");
    let draft = batch
        .draft_logits_for(kind)
        .map(|d| backend.upload(d).expect("upload draft logits"));
    verify::verify(backend, &mut ws, &target, &tokens, draft.as_ref()).expect("verify");
    Run {
        outcomes: ws.outcomes().expect("outcomes"),
        stats: ws.stats().expect("stats"),
    }
}

/// What the reference computes for sequence `s` row by row: the kept tokens, the kept weight,
/// the top tokens; for a message when a run disagrees with it.
pub fn explain(batch: &Batch, vocab: usize, s: usize) -> String {
    let first: usize = batch.drafts[..s].iter().map(|n| n + 1).sum();
    let params = &batch.params[s];
    let mut out = String::new();
    for j in 0..=batch.drafts[s] {
        let row = &batch.target[(first + j) * vocab..(first + j + 1) * vocab];
        let line = if params.temperature == 0.0 {
            format!(
                "argmax {:?}",
                verify::reference::greedy_token(row, params, j)
            )
        } else {
            match verify::reference::weigh(row, params, j) {
                Ok(w) => format!(
                    "kept {} of {} (S = {}), first {:?}",
                    w.kept,
                    w.order.len(),
                    w.mass(),
                    &w.order[..w.kept.min(6)]
                ),
                Err(e) => format!("{e}"),
            }
        };
        let draft = (j < batch.drafts[s]).then(|| {
            let first_draft: usize = batch.drafts[..s].iter().sum();
            batch.tokens[first_draft + j]
        });
        out.push_str(&format!("\n    target row {j}: {line}; draft {draft:?}"));
    }
    out
}

/// Asserts two runs are equal, naming the first sequence that differs and what the reference
/// computes for it.
pub fn assert_same(what: &str, batch: &Batch, vocab: usize, got: &Run, want: &Run) {
    assert_eq!(
        got.outcomes.len(),
        want.outcomes.len(),
        "{what}: outcome count"
    );
    for (s, (g, w)) in got.outcomes.iter().zip(&want.outcomes).enumerate() {
        // Debug text: a NaN error value equals itself
        assert_eq!(
            format!("{g:?}"),
            format!("{w:?}"),
            "{what}: sequence {s} of {} (n = {}, position {}, {:?}): got (left) vs reference (right){}",
            got.outcomes.len(),
            batch.drafts[s],
            batch.positions[s],
            batch.params[s],
            explain(batch, vocab, s)
        );
    }
    assert_eq!(got.stats, want.stats, "{what}: acceptance statistics");
}
