//! CPU reference of the `verify` family: logits processing, plain sampling, and greedy and
//! sampling (Leviathan et al. 2023) verification of drafted tokens. The definition the GPU
//! kernels must reproduce.
//!
//! Processing, the same for target rows, draft rows and plain sampling, in this order:
//! 1. logit bias (added),
//! 2. temperature (divides; 0 = greedy: the argmax of the biased logits),
//! 3. softmax,
//! 4. top-k (the k most probable; ties to the lower token id),
//! 5. top-p (the smallest most-probable prefix whose mass reaches p),
//! 6. min-p (tokens with probability >= min_p * the largest),
//! 7. renormalisation.
//!
//! Random draws come from a counter-based generator keyed on (sequence seed, position, stream),
//! so a sequence's tokens do not depend on the batch it runs in. Sampling from a distribution `w`
//! (unnormalised is fine) is the exponential race `argmax_i w_i / E_i`, `E_i = -ln u_i` with
//! `u_i` keyed on the token id too: order-free, so a parallel kernel can reproduce it.

/// Per-sequence sampling controls.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 for greedy; > 0 divides the logits.
    pub temperature: f32,
    /// Keep the k most probable tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest prefix of mass >= top_p; 1 = off.
    pub top_p: f32,
    /// Keep tokens with probability >= min_p * the largest; 0 = off.
    pub min_p: f32,
    /// Added to the logits of the given token ids before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// The sequence's seed.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

/// Why a sequence's row cannot be sampled or verified (a per-sequence status, never a token).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RowError {
    /// NaN or +Inf in a logit row (-Inf is a masked token).
    #[error("row {row}: logit of token {token} is {value}")]
    NonFiniteLogit {
        /// Row within the sequence's rows.
        row: usize,
        /// Token id.
        token: usize,
        /// The value.
        value: f32,
    },
    /// A control out of its domain.
    #[error("{0}")]
    BadParameter(String),
    /// Every token was removed (all -Inf, or the filters left nothing).
    #[error("row {row}: no token left to sample")]
    EmptySupport {
        /// Row within the sequence's rows.
        row: usize,
    },
    /// A draft or bias token id outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// A uniform in (0, 1) from (seed, position, stream, token): SplitMix64's finaliser over the
/// mixed counter, 53 random bits.
pub fn uniform(seed: u64, position: u64, stream: u64, token: u64) -> f64 {
    let mut z = seed
        ^ position.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03)
        ^ token.wrapping_mul(0x8cb9_2ba7_2f3d_8dd7);
    for _ in 0..2 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Streams of the generator: acceptance tests and token draws never share a number.
const STREAM_ACCEPT: u64 = 0;
const STREAM_TOKEN: u64 = 1;

fn check_params(params: &SamplingParams, vocab: usize) -> Result<(), RowError> {
    let bad = |what: String| Err(RowError::BadParameter(what));
    if params.temperature.is_nan() || params.temperature < 0.0 || params.temperature.is_infinite() {
        return bad(format!(
            "temperature {} must be >= 0 (0 = greedy)",
            params.temperature
        ));
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        return bad(format!("top_p {} must be in (0, 1]", params.top_p));
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        return bad(format!("min_p {} must be in [0, 1]", params.min_p));
    }
    for &(token, bias) in &params.logit_bias {
        if token as usize >= vocab {
            return Err(RowError::TokenOutOfRange { token, vocab });
        }
        if bias.is_nan() || bias == f32::INFINITY {
            return bad(format!("logit_bias of token {token} is {bias}"));
        }
    }
    Ok(())
}

/// The biased logits of one row, after checking it.
fn biased(logits: &[f32], params: &SamplingParams, row: usize) -> Result<Vec<f64>, RowError> {
    if let Some((token, &value)) = logits
        .iter()
        .enumerate()
        .find(|(_, v)| v.is_nan() || **v == f32::INFINITY)
    {
        return Err(RowError::NonFiniteLogit { row, token, value });
    }
    let mut out: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    for &(token, bias) in &params.logit_bias {
        out[token as usize] += f64::from(bias);
    }
    if out.iter().all(|v| *v == f64::NEG_INFINITY) {
        return Err(RowError::EmptySupport { row });
    }
    Ok(out)
}

/// The greedy token of a row: argmax of the biased logits, ties to the lower id.
///
/// # Errors
/// [`RowError`] for a bad row or bad controls.
pub fn greedy_token(logits: &[f32], params: &SamplingParams, row: usize) -> Result<u32, RowError> {
    check_params(params, logits.len())?;
    let values = biased(logits, params, row)?;
    Ok(argmax(&values) as u32)
}

fn argmax(values: &[f64]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// The processed distribution of a row (steps 1-7 of the module docs); for temperature 0, the
/// point mass on the greedy token.
///
/// # Errors
/// [`RowError`] for a bad row, bad controls, or an empty support.
pub fn processed(
    logits: &[f32],
    params: &SamplingParams,
    row: usize,
) -> Result<Vec<f64>, RowError> {
    check_params(params, logits.len())?;
    let values = biased(logits, params, row)?;
    let vocab = values.len();
    if params.temperature == 0.0 {
        let mut p = vec![0.0; vocab];
        p[argmax(&values)] = 1.0;
        return Ok(p);
    }
    let t = f64::from(params.temperature);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut p: Vec<f64> = values.iter().map(|v| ((v - max) / t).exp()).collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= total);
    // tokens by descending probability, ties to the lower id
    let mut order: Vec<usize> = (0..vocab).filter(|&i| p[i] > 0.0).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        let keep = order
            .iter()
            .position(|&i| {
                mass += p[i];
                mass >= f64::from(params.top_p)
            })
            .map_or(order.len(), |last| last + 1);
        order.truncate(keep);
    }
    if params.min_p > 0.0 {
        let floor = f64::from(params.min_p) * order.first().map_or(0.0, |&i| p[i]);
        order.retain(|&i| p[i] >= floor);
    }
    if order.is_empty() {
        return Err(RowError::EmptySupport { row });
    }
    let kept: f64 = order.iter().map(|&i| p[i]).sum();
    let mut out = vec![0.0; vocab];
    for &i in &order {
        out[i] = p[i] / kept;
    }
    Ok(out)
}

/// The exponential race over `weights` (>= 0, not all zero): `argmax_i w_i / E_i` with
/// `E_i = -ln u(seed, position, stream, i)`; picks token i with probability w_i / sum(w).
fn race(weights: &[f64], seed: u64, position: u64, stream: u64) -> u32 {
    let mut best = (f64::NEG_INFINITY, 0usize);
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            let score = w / -uniform(seed, position, stream, i as u64).ln();
            if score > best.0 {
                best = (score, i);
            }
        }
    }
    best.1 as u32
}

/// Plain (non-speculative) sampling of the token at `position`.
///
/// # Errors
/// As [`processed`].
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> Result<u32, RowError> {
    if params.temperature == 0.0 {
        return greedy_token(logits, params, 0);
    }
    let p = processed(logits, params, 0)?;
    Ok(race(&p, params.seed, position, STREAM_TOKEN))
}

/// How a sequence's drafts were proposed.
#[derive(Debug, Clone, PartialEq)]
pub enum Drafts<'a> {
    /// A greedy drafter: each draft token has probability 1 under q.
    PointMass(&'a [u32]),
    /// Draft tokens with the drafter's logit rows (processed here with the same controls).
    Sampled {
        /// The drafted tokens.
        tokens: &'a [u32],
        /// `[tokens.len()][V]` draft logits, row-major.
        logits: &'a [f32],
    },
}

impl Drafts<'_> {
    fn tokens(&self) -> &[u32] {
        match self {
            Drafts::PointMass(t) => t,
            Drafts::Sampled { tokens, .. } => tokens,
        }
    }
}

/// The outcome for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// Drafts accepted (0..=n).
    pub accepted: usize,
    /// The tokens to append: the accepted drafts, then the correction (on a rejection) or the
    /// bonus token (all accepted): `accepted + 1` tokens.
    pub emitted: Vec<u32>,
}

/// Verifies one sequence's `n` drafts against its `n + 1` target rows (`target`, row-major
/// `[n + 1][V]`), the first of which decides the token at `position`. Greedy (temperature 0):
/// accept while the draft is the target's argmax. Sampling: accept draft x with probability
/// min(1, p(x) / q(x)) on the processed distributions, on rejection draw from
/// normalize(max(0, p - q)), and draw the bonus token from the last row.
///
/// # Errors
/// [`RowError`] for a bad row, bad controls, an empty support, a draft token outside the
/// vocabulary, or row counts that disagree with the drafts.
pub fn verify(
    target: &[f32],
    vocab: usize,
    drafts: &Drafts<'_>,
    params: &SamplingParams,
    position: u64,
) -> Result<Verified, RowError> {
    let tokens = drafts.tokens();
    let n = tokens.len();
    if vocab == 0 || target.len() != (n + 1) * vocab {
        return Err(RowError::BadParameter(format!(
            "{} target logits for {} rows of {vocab}",
            target.len(),
            n + 1
        )));
    }
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(RowError::TokenOutOfRange { token, vocab });
    }
    if let Drafts::Sampled { logits, .. } = drafts {
        if logits.len() != n * vocab {
            return Err(RowError::BadParameter(format!(
                "{} draft logits for {n} rows of {vocab}",
                logits.len()
            )));
        }
    }
    let row = |i: usize| &target[i * vocab..(i + 1) * vocab];
    let mut emitted = Vec::with_capacity(n + 1);
    if params.temperature == 0.0 {
        for (i, &draft) in tokens.iter().enumerate() {
            let best = greedy_token(row(i), params, i)?;
            if best != draft {
                emitted.push(best);
                return Ok(Verified {
                    accepted: i,
                    emitted,
                });
            }
            emitted.push(draft);
        }
        emitted.push(greedy_token(row(n), params, n)?);
        return Ok(Verified {
            accepted: n,
            emitted,
        });
    }
    for (i, &draft) in tokens.iter().enumerate() {
        let at = position + i as u64;
        let p = processed(row(i), params, i)?;
        let q = match drafts {
            Drafts::PointMass(_) => {
                let mut q = vec![0.0; vocab];
                q[draft as usize] = 1.0;
                q
            }
            Drafts::Sampled { logits, .. } => {
                processed(&logits[i * vocab..(i + 1) * vocab], params, i)?
            }
        };
        let x = draft as usize;
        let accept =
            q[x] > 0.0 && uniform(params.seed, at, STREAM_ACCEPT, 0) < (p[x] / q[x]).min(1.0);
        if accept {
            emitted.push(draft);
            continue;
        }
        let residual: Vec<f64> = p.iter().zip(&q).map(|(a, b)| (a - b).max(0.0)).collect();
        // p == q on the support leaves no residual mass; p itself is then the right law
        let from = if residual.iter().any(|r| *r > 0.0) {
            &residual
        } else {
            &p
        };
        emitted.push(race(from, params.seed, at, STREAM_TOKEN));
        return Ok(Verified {
            accepted: i,
            emitted,
        });
    }
    let p = processed(row(n), params, n)?;
    emitted.push(race(&p, params.seed, position + n as u64, STREAM_TOKEN));
    Ok(Verified {
        accepted: n,
        emitted,
    })
}

/// Drafted and accepted counts by draft position, summed over verified sequences.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AcceptanceStats {
    /// `drafted[i]`: sequences that had a draft at position i.
    pub drafted: Vec<u64>,
    /// `accepted[i]`: of those, how many were accepted.
    pub accepted: Vec<u64>,
}

impl AcceptanceStats {
    /// Adds one sequence's outcome with `n` drafts.
    pub fn record(&mut self, n: usize, outcome: &Verified) {
        if self.drafted.len() < n {
            self.drafted.resize(n, 0);
            self.accepted.resize(n, 0);
        }
        for i in 0..n {
            self.drafted[i] += 1;
            self.accepted[i] += u64::from(i < outcome.accepted);
        }
    }

    /// Acceptance rate at each draft position.
    pub fn rates(&self) -> Vec<f64> {
        self.drafted
            .iter()
            .zip(&self.accepted)
            .map(|(d, a)| if *d == 0 { 0.0 } else { *a as f64 / *d as f64 })
            .collect()
    }
}
