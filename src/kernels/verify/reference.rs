//! CPU reference of the `verify` family: logits processing, plain sampling, and greedy and
//! sampling (Leviathan et al. 2023) verification of drafted tokens. The definition the GPU
//! kernels reproduce bit for bit: every value below is an exact function of the logits and the
//! controls, built from correctly rounded IEEE operations (add, multiply, divide, and fused
//! multiply-add where written; no libm approximations, no contraction a compiler chooses) and
//! exact integer sums, so any summation order gives the same result.
//!
//! Processing, the same for target rows, draft rows and plain sampling, in this order:
//! 1. logit bias: `z = x + b` in f32, the entries applied in list order (a token listed twice
//!    gets both, in order); `-0.0` becomes `+0.0`;
//! 2. temperature: 0 = greedy, the argmax of `z` (ties to the lower token id); otherwise the
//!    token weights below;
//! 3. top-k: the first k tokens of the order;
//! 4. top-p: the shortest prefix of the top-k tokens whose weight reaches
//!    `ceil(top_p * weight of the top-k tokens)` (renormalised after top-k, as Hugging Face and
//!    vLLM do);
//! 5. min-p: the tokens whose weight is at least `min_p` times the largest weight (a prefix, as
//!    the weight never decreases along the order);
//! 6. the kept tokens are the shortest of the three prefixes; their probabilities are their
//!    weights over the kept weight.
//!
//! **Order**: token i comes before token j when `z_i > z_j`, or `z_i == z_j` and `i < j`.
//!
//! **Weights** (temperature T > 0): `c = log2(e) / T` (f32), `y = clamp(z * c, -2^30, 2^30)` (f32),
//! `k = floor(y)`, `f = y - k` (f32, in `[0, 1]`: it rounds to 1 when `-2^-25 <= y < 0`),
//! `P = min(2, p(f))` where `p` is the degree-8 Taylor polynomial of `2^f` evaluated by Horner
//! with correctly rounded f32 fused multiply-adds (positive coefficients, so `P` never decreases
//! as `z` grows), `M = P * 2^23` (an integer in `[2^23, 2^24]`). With `K` the largest `k` of the
//! row, the weight is the integer `w = M * 2^(40 - (K - k))` when `K - k <= 40`, else 0 (a token
//! below `2^-40` of the most probable one is never drawn); a `-inf` logit has weight 0.
//! Weights and their sums are `u128`, so sums do not depend on the order they are taken in.
//!
//! **Draws**: a sample is the inverse CDF in the order above: with `u = uniform(seed, position,
//! stream, 0)` and total weight `S`, the target is `t = min(S - 1, floor(u * f64(S)))` and the token
//! is the first whose running weight exceeds `t`. `f64(x)` of a `u128` is
//! `f64(x >> 64) * 2^64 + f64(x mod 2^64)`, each step rounded to nearest.
//!
//! **Verification** at draft position i (`at = position + i`, `u = uniform(seed, at, ACCEPT, 0)`):
//! a point-mass draft x is accepted when `u * f64(S_p) < f64(w_p(x))`; a sampled draft when
//! `w_q(x) > 0` and `u * (f64(w_q(x)) * f64(S_p)) < f64(w_p(x)) * f64(S_q)`, with `w(x)` the kept
//! weight (0 when x is not kept). On rejection the correction is drawn from
//! `normalize(max(0, p - q))`: for a point mass that is p without x (the target row's inverse CDF
//! with x's weight skipped); for sampled drafts the residual per token is
//! `round((f64(w_p) * (1 / f64(S_p)) - f64(w_q) * (1 / f64(S_q))) * 2^62)` when positive, drawn
//! by inverse CDF in token-id order. A residual with no weight draws from p. The bonus token is
//! drawn from the last target row at `position + n`.

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
    /// NaN or +Inf in a logit row (-Inf is a masked token), or a logit that the bias made +Inf or
    /// NaN (+Inf, then a -Inf entry).
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

/// Tokens whose octave (`floor(y)`) is more than this many below the row's largest get weight 0.
pub const MASS_OCTAVES: i32 = 40;

/// `(ln 2)^n / n!` for n = 0..=8 as f32 bits: the Taylor polynomial of `2^f` (Horner, highest
/// first). The template holds the same bits.
pub const EXP2_COEFFICIENT_BITS: [u32; 9] = [
    0x3f80_0000,
    0x3f31_7218,
    0x3e75_fdf0,
    0x3d63_5847,
    0x3c1d_955b,
    0x3aae_c3ff,
    0x3921_8489,
    0x377f_e5fe,
    0x35b1_6011,
];

/// `log2(e)` in f32.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// Largest |y| kept; beyond it the weights saturate (a temperature so small that `|z| / T`
/// exceeds about 7e8 behaves as ties at the bound).
const Y_LIMIT: f32 = 1_073_741_824.0; // 2^30

/// Streams of the generator: acceptance tests and token draws never share a number.
pub const STREAM_ACCEPT: u64 = 0;
/// The stream of token draws (plain samples, corrections, bonus tokens).
pub const STREAM_TOKEN: u64 = 1;

/// 53 random bits from (seed, position, stream, token): SplitMix64's finaliser, twice, over the
/// mixed counter.
pub fn uniform_bits(seed: u64, position: u64, stream: u64, token: u64) -> u64 {
    let mut z = seed
        ^ position.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03)
        ^ token.wrapping_mul(0x8cb9_2ba7_2f3d_8dd7);
    for _ in 0..2 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    z >> 11
}

/// A uniform in (0, 1) from (seed, position, stream, token): `(uniform_bits + 0.5) / 2^53`.
pub fn uniform(seed: u64, position: u64, stream: u64, token: u64) -> f64 {
    (uniform_bits(seed, position, stream, token) as f64 + 0.5) / (1u64 << 53) as f64
}

/// `2^f` for f in [0, 1] as the integer mantissa `min(2, p(f)) * 2^23` (module docs): Horner
/// with correctly rounded fused multiply-adds (each step never decreases as f grows).
pub fn exp2_mantissa(f: f32) -> u32 {
    let mut p = f32::from_bits(EXP2_COEFFICIENT_BITS[8]);
    for &c in EXP2_COEFFICIENT_BITS[..8].iter().rev() {
        p = p.mul_add(f, f32::from_bits(c));
    }
    (p.min(2.0) * 8_388_608.0) as u32
}

/// The scale `c = log2(e) / T` of a temperature (f32 division).
pub fn log2_scale(temperature: f32) -> f32 {
    LOG2_E / temperature
}

/// The octave `k` and mantissa `M` of a finite biased logit under scale `c` (module docs).
pub fn octave_mantissa(z: f32, c: f32) -> (i32, u32) {
    let y = (z * c).clamp(-Y_LIMIT, Y_LIMIT);
    let k = y.floor();
    (k as i32, exp2_mantissa(y - k))
}

/// The weight of a token of octave `k` and mantissa `m` in a row whose largest octave is
/// `top_octave`.
pub fn weight(k: i32, m: u32, top_octave: i32) -> u128 {
    // i64: octaves clamp to +-2^30, so the difference can exceed an i32
    let below = i64::from(top_octave) - i64::from(k);
    if below > i64::from(MASS_OCTAVES) {
        0
    } else {
        u128::from(m) << (i64::from(MASS_OCTAVES) - below)
    }
}

/// `f64(x)` of a weight (module docs): `f64(hi) * 2^64 + f64(lo)`.
pub fn mass_to_f64(x: u128) -> f64 {
    ((x >> 64) as u64 as f64) * 18_446_744_073_709_551_616.0 + (x as u64 as f64)
}

/// The draw target in `[0, total)` for a uniform `u` (module docs). `total` must be positive.
pub fn draw_target(u: f64, total: u128) -> u128 {
    ((u * mass_to_f64(total)).floor() as u128).min(total - 1)
}

/// `ceil(top_p * mass)`, exactly (top_p is a dyadic rational).
pub fn top_p_need(top_p: f32, mass: u128) -> u128 {
    let bits = top_p.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    let (mantissa, power) = if exponent == 0 {
        (bits & 0x7f_ffff, -149)
    } else {
        ((bits & 0x7f_ffff) | 0x80_0000, exponent - 150)
    };
    let product = u128::from(mantissa) * mass;
    if power >= 0 {
        return product << power;
    }
    let shift = (-power) as u32;
    if shift >= 128 {
        return u128::from(product > 0);
    }
    let quotient = product >> shift;
    quotient + u128::from(product & ((1u128 << shift) - 1) != 0)
}

/// Whether a token of mantissa `m`, `below` octaves under the top, passes min-p against the
/// largest mantissa `top_mantissa`: `m * 2^-below >= min_p * top_mantissa`, exact in f64.
pub fn passes_min_p(m: u32, below: i32, min_p: f32, top_mantissa: u32) -> bool {
    f64::from(m) * pow2(-below) >= f64::from(min_p) * f64::from(top_mantissa)
}

/// `2^e` for e in the normal f64 range.
fn pow2(e: i32) -> f64 {
    f64::from_bits(((1023 + e) as u64) << 52)
}

/// Checks the controls of one sequence against a vocabulary of `vocab` tokens.
///
/// # Errors
/// [`RowError::BadParameter`] for a control out of its domain (a temperature below 0, NaN,
/// infinite, or so small that `log2(e) / T` overflows; top_p outside (0, 1]; min_p outside
/// [0, 1]; a bias that is NaN or +Inf), [`RowError::TokenOutOfRange`] for a bias token outside
/// the vocabulary.
pub fn check_params(params: &SamplingParams, vocab: usize) -> Result<(), RowError> {
    let bad = |what: String| Err(RowError::BadParameter(what));
    if params.temperature.is_nan() || params.temperature < 0.0 || params.temperature.is_infinite() {
        return bad(format!(
            "temperature {} must be >= 0 (0 = greedy)",
            params.temperature
        ));
    }
    if params.temperature > 0.0 && !log2_scale(params.temperature).is_finite() {
        return bad(format!(
            "temperature {} is too small to divide by; use 0 for greedy",
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

/// The biased logits of one row (step 1), after checking it: the first token whose logit is NaN
/// or +Inf, or whose biased logit is +Inf or NaN, is an error; so is a row of only -Inf.
fn biased(logits: &[f32], params: &SamplingParams, row: usize) -> Result<Vec<f32>, RowError> {
    let mut z = logits.to_vec();
    for &(token, bias) in &params.logit_bias {
        z[token as usize] += bias;
    }
    let bad = |i: usize| {
        logits[i].is_nan() || logits[i] == f32::INFINITY || z[i] == f32::INFINITY || z[i].is_nan()
    };
    if let Some(token) = (0..z.len()).find(|&i| bad(i)) {
        let value = if logits[token].is_nan() || logits[token] == f32::INFINITY {
            logits[token]
        } else {
            z[token]
        };
        return Err(RowError::NonFiniteLogit { row, token, value });
    }
    if z.iter().all(|v| *v == f32::NEG_INFINITY) {
        return Err(RowError::EmptySupport { row });
    }
    for v in &mut z {
        *v += 0.0; // -0.0 + 0.0 == +0.0: equal logits, equal keys
    }
    Ok(z)
}

/// The greedy token of a row: argmax of the biased logits, ties to the lower id.
///
/// # Errors
/// [`RowError`] for a bad row or bad controls.
pub fn greedy_token(logits: &[f32], params: &SamplingParams, row: usize) -> Result<u32, RowError> {
    check_params(params, logits.len())?;
    let z = biased(logits, params, row)?;
    Ok(argmax(&z) as u32)
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// One processed row (temperature > 0): every token's weight, the kept prefix of the order and
/// its running weights.
#[derive(Debug, Clone)]
pub struct Weighted {
    /// Weight of every token (before filtering).
    pub weights: Vec<u128>,
    /// Tokens of positive weight, in the order.
    pub order: Vec<u32>,
    /// `prefix[i]`: weight of the first i tokens of `order`.
    pub prefix: Vec<u128>,
    /// How many tokens of `order` are kept.
    pub kept: usize,
}

impl Weighted {
    /// The kept weight S.
    pub fn mass(&self) -> u128 {
        self.prefix[self.kept]
    }

    /// Position of `token` in the order, if it has positive weight.
    fn position(&self, token: u32) -> Option<usize> {
        self.order.iter().position(|&t| t == token)
    }

    /// The kept weight of `token` (0 when filtered out) and the kept weight before it.
    pub fn kept_weight(&self, token: u32) -> (u128, u128) {
        match self.position(token) {
            Some(at) if at < self.kept => (self.weights[token as usize], self.prefix[at]),
            _ => (0, 0),
        }
    }

    /// The kept token whose running weight first exceeds `t` (`t < mass()`).
    pub fn at_mass(&self, t: u128) -> u32 {
        let after = self.prefix[1..=self.kept].partition_point(|&p| p <= t);
        self.order[after]
    }

    /// A plain draw with uniform `u`.
    fn draw(&self, u: f64) -> u32 {
        self.at_mass(draw_target(u, self.mass()))
    }
}

/// Steps 1-6 for temperature > 0.
///
/// # Errors
/// As [`processed`].
pub fn weigh(logits: &[f32], params: &SamplingParams, row: usize) -> Result<Weighted, RowError> {
    check_params(params, logits.len())?;
    let z = biased(logits, params, row)?;
    let c = log2_scale(params.temperature);
    let parts: Vec<Option<(i32, u32)>> = z
        .iter()
        .map(|&v| (v > f32::NEG_INFINITY).then(|| octave_mantissa(v, c)))
        .collect();
    let top = argmax(&z);
    let (top_octave, top_mantissa) = parts[top].expect("the argmax is finite");
    let weights: Vec<u128> = parts
        .iter()
        .map(|p| p.map_or(0, |(k, m)| weight(k, m, top_octave)))
        .collect();
    let mut order: Vec<u32> = (0..z.len() as u32)
        .filter(|&i| weights[i as usize] > 0)
        .collect();
    order.sort_unstable_by(|&a, &b| {
        z[b as usize]
            .partial_cmp(&z[a as usize])
            .expect("finite")
            .then(a.cmp(&b))
    });
    let mut prefix = Vec::with_capacity(order.len() + 1);
    prefix.push(0u128);
    for &t in &order {
        prefix.push(prefix[prefix.len() - 1] + weights[t as usize]);
    }
    let n = order.len();
    let by_k = if params.top_k > 0 {
        params.top_k.min(n)
    } else {
        n
    };
    let by_p = if params.top_p < 1.0 {
        let need = top_p_need(params.top_p, prefix[by_k]);
        prefix[1..=by_k].partition_point(|&p| p < need) + 1
    } else {
        n
    };
    let by_min_p = if params.min_p > 0.0 {
        order.partition_point(|&t| {
            let (k, m) = parts[t as usize].expect("positive weight");
            passes_min_p(m, top_octave - k, params.min_p, top_mantissa)
        })
    } else {
        n
    };
    let kept = by_k.min(by_p).min(by_min_p);
    if kept == 0 {
        return Err(RowError::EmptySupport { row });
    }
    Ok(Weighted {
        weights,
        order,
        prefix,
        kept,
    })
}

/// The processed distribution of a row (module docs: kept weights over the kept weight, in
/// f64); for temperature 0, the point mass on the greedy token.
///
/// # Errors
/// [`RowError`] for a bad row, bad controls, or an empty support.
pub fn processed(
    logits: &[f32],
    params: &SamplingParams,
    row: usize,
) -> Result<Vec<f64>, RowError> {
    if params.temperature == 0.0 {
        let best = greedy_token(logits, params, row)?;
        let mut p = vec![0.0; logits.len()];
        p[best as usize] = 1.0;
        return Ok(p);
    }
    let w = weigh(logits, params, row)?;
    let total = mass_to_f64(w.mass());
    let mut p = vec![0.0; logits.len()];
    for &t in &w.order[..w.kept] {
        p[t as usize] = mass_to_f64(w.weights[t as usize]) / total;
    }
    Ok(p)
}

/// Plain (non-speculative) sampling of the token at `position`.
///
/// # Errors
/// As [`processed`].
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> Result<u32, RowError> {
    if params.temperature == 0.0 {
        return greedy_token(logits, params, 0);
    }
    let w = weigh(logits, params, 0)?;
    Ok(w.draw(uniform(params.seed, position, STREAM_TOKEN, 0)))
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

/// The correction after rejecting a point-mass draft `x`: p without x.
fn point_mass_correction(p: &Weighted, x: u32, u: f64) -> u32 {
    let (w_x, before_x) = p.kept_weight(x);
    let rest = p.mass() - w_x;
    if rest == 0 {
        return p.draw(u);
    }
    let t = draw_target(u, rest);
    p.at_mass(if w_x > 0 && t >= before_x { t + w_x } else { t })
}

/// The residual of two rows with sampled drafts: `round((p - q) * 2^62)` where positive, by
/// token id.
pub fn residual(p: &Weighted, q: &Weighted) -> Vec<u64> {
    let kept = |w: &Weighted| {
        let mut v = vec![0u128; w.weights.len()];
        for &t in &w.order[..w.kept] {
            v[t as usize] = w.weights[t as usize];
        }
        v
    };
    let (wp, wq) = (kept(p), kept(q));
    let (inv_p, inv_q) = (1.0 / mass_to_f64(p.mass()), 1.0 / mass_to_f64(q.mass()));
    wp.iter()
        .zip(&wq)
        .map(|(&a, &b)| {
            let d = mass_to_f64(a) * inv_p - mass_to_f64(b) * inv_q;
            if d > 0.0 {
                (d * 4_611_686_018_427_387_904.0).round_ties_even() as u64 // 2^62
            } else {
                0
            }
        })
        .collect()
}

/// The correction after rejecting a sampled draft: inverse CDF of the residual by token id, or a
/// plain draw from p when the residual has no weight.
fn residual_correction(p: &Weighted, q: &Weighted, u: f64) -> u32 {
    let r = residual(p, q);
    let total: u64 = r.iter().sum();
    if total == 0 {
        return p.draw(u);
    }
    let t = ((u * total as f64).floor() as u64).min(total - 1);
    let mut running = 0u64;
    for (token, &v) in r.iter().enumerate() {
        running += v;
        if running > t {
            return token as u32;
        }
    }
    unreachable!("the running residual reaches its total")
}

/// Verifies one sequence's `n` drafts against its `n + 1` target rows (`target`, row-major
/// `[n + 1][V]`), the first of which decides the token at `position`. Greedy (temperature 0):
/// accept while the draft is the target's argmax. Sampling: accept draft x with probability
/// min(1, p(x) / q(x)) on the processed distributions, on rejection draw from
/// normalize(max(0, p - q)), and draw the bonus token from the last row (module docs).
///
/// Rows are examined in order and only as far as the outcome needs them: a bad row after the
/// first rejection is not an error.
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
        let u = uniform(params.seed, at, STREAM_ACCEPT, 0);
        let draw = uniform(params.seed, at, STREAM_TOKEN, 0);
        let p = weigh(row(i), params, i)?;
        let (w_p, _) = p.kept_weight(draft);
        let correction = match drafts {
            Drafts::PointMass(_) => (u * mass_to_f64(p.mass()) >= mass_to_f64(w_p))
                .then(|| point_mass_correction(&p, draft, draw)),
            Drafts::Sampled { logits, .. } => {
                let q = weigh(&logits[i * vocab..(i + 1) * vocab], params, i)?;
                let (w_q, _) = q.kept_weight(draft);
                let accept = w_q > 0
                    && u * (mass_to_f64(w_q) * mass_to_f64(p.mass()))
                        < mass_to_f64(w_p) * mass_to_f64(q.mass());
                (!accept).then(|| residual_correction(&p, &q, draw))
            }
        };
        match correction {
            None => emitted.push(draft),
            Some(token) => {
                emitted.push(token);
                return Ok(Verified {
                    accepted: i,
                    emitted,
                });
            }
        }
    }
    let p = weigh(row(n), params, n)?;
    emitted.push(p.draw(uniform(params.seed, position + n as u64, STREAM_TOKEN, 0)));
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
