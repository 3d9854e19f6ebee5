//! CPU reference of the `gdn` family (Gated DeltaNet linear attention,
//! ../shared/reference/qwen3_5_moe.md): the causal depthwise conv1d + SiLU with its state window,
//! the gates, the per-head L2 norms, the gated delta rule in its recurrent form and in its
//! chunked (WY / UT transform) form, and the gated RMSNorm. f64 inside, f32 at the interfaces.
//! Beside the chunked form, [`chunked_rounding_scale`]: how far the chunk kernels' bf16 operands
//! can move each of its results (the GPU tests' allowances follow from it).
//!
//! Layouts (row-major): q, k `[T][Hk][dk]`, v `[T][Hv][dv]`, g and beta `[T][Hv]`, state
//! `[Hv][dk][dv]`, outputs `[T][Hv][dv]`. Value head h reads key head `h / (Hv / Hk)`.

/// Head counts and sizes of one GDN layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    /// Key (and query) heads.
    pub key_heads: usize,
    /// Value heads (a multiple of `key_heads`).
    pub value_heads: usize,
    /// Key head dimension.
    pub dk: usize,
    /// Value head dimension.
    pub dv: usize,
}

impl GdnShape {
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        h / (self.value_heads / self.key_heads)
    }

    /// Elements of one sequence's recurrent state.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.dk * self.dv
    }
}

/// `x / (1 + e^-x)`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, stable for large |x|.
pub fn softplus(x: f64) -> f64 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Causal depthwise conv1d over `channels` (kernel `weight[c][0..kernel]`), then SiLU, for `t`
/// tokens of `x` (`[t][channels]`), starting from `state` (the last `kernel - 1` inputs before
/// them, `[kernel - 1][channels]`, zeros for a new sequence). Returns the outputs and updates
/// `state` to the last `kernel - 1` inputs.
pub fn conv1d_silu(
    x: &[f32],
    t: usize,
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
) -> Vec<f32> {
    let history = kernel - 1;
    let mut window: Vec<f32> = state.to_vec();
    window.extend_from_slice(&x[..t * channels]);
    let mut y = vec![0.0f32; t * channels];
    for step in 0..t {
        for c in 0..channels {
            let sum: f64 = (0..kernel)
                .map(|j| {
                    f64::from(weight[c * kernel + j]) * f64::from(window[(step + j) * channels + c])
                })
                .sum();
            y[step * channels + c] = silu(sum) as f32;
        }
    }
    state.copy_from_slice(&window[t * channels..(t + history) * channels]);
    y
}

/// Per-head gates of one token: `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`
/// (the log decay, <= 0). Returns `(g, beta)`.
pub fn gates(a: &[f32], b: &[f32], a_log: &[f32], dt_bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let g = a
        .iter()
        .zip(a_log)
        .zip(dt_bias)
        .map(|((a, al), dt)| {
            (-f64::from(*al).exp() * softplus(f64::from(*a) + f64::from(*dt))) as f32
        })
        .collect();
    let beta = b
        .iter()
        .map(|b| (1.0 / (1.0 + (-f64::from(*b)).exp())) as f32)
        .collect();
    (g, beta)
}

/// L2-normalises each head vector of `x` (`[..][dim]`): `x * rsqrt(sum(x^2) + 1e-6)`, then scales
/// by `scale` (1 / sqrt(dk) for q, 1 for k).
pub fn l2_normalize(x: &mut [f32], dim: usize, scale: f64) {
    for head in x.chunks_exact_mut(dim) {
        let norm: f64 = head.iter().map(|v| f64::from(*v).powi(2)).sum();
        let factor = scale / (norm + 1e-6).sqrt();
        head.iter_mut()
            .for_each(|v| *v = (f64::from(*v) * factor) as f32);
    }
}

/// The inputs of the gated delta rule for `t` tokens (q and k already normalised and scaled).
#[derive(Debug, Clone, Copy)]
pub struct DeltaInputs<'a> {
    /// Tokens.
    pub t: usize,
    /// `[t][Hk][dk]`.
    pub q: &'a [f32],
    /// `[t][Hk][dk]`.
    pub k: &'a [f32],
    /// `[t][Hv][dv]`.
    pub v: &'a [f32],
    /// Log decays `[t][Hv]`.
    pub g: &'a [f32],
    /// `[t][Hv]`.
    pub beta: &'a [f32],
}

/// Runs `body(value head, key head, state of that head in f64)` for every value head and writes
/// each head's state back to `state` (`[Hv][dk][dv]`, f32).
fn per_head_state(
    shape: GdnShape,
    state: &mut [f32],
    mut body: impl FnMut(usize, usize, &mut [f64]),
) {
    let size = shape.dk * shape.dv;
    for (h, head) in state
        .chunks_exact_mut(size)
        .enumerate()
        .take(shape.value_heads)
    {
        let mut s: Vec<f64> = head.iter().map(|v| f64::from(*v)).collect();
        body(h, shape.key_head(h), &mut s);
        for (dst, src) in head.iter_mut().zip(&s) {
            *dst = *src as f32;
        }
    }
}

/// The recurrent form, token by token: `S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q`.
/// Updates `state` (`[Hv][dk][dv]`) and returns `[t][Hv][dv]`.
pub fn recurrent(shape: GdnShape, input: DeltaInputs<'_>, state: &mut [f32]) -> Vec<f32> {
    let GdnShape {
        key_heads,
        value_heads,
        dk,
        dv,
    } = shape;
    let mut out = vec![0.0f32; input.t * value_heads * dv];
    per_head_state(shape, state, |h, kh, s| {
        for step in 0..input.t {
            let q = &input.q[(step * key_heads + kh) * dk..][..dk];
            let k = &input.k[(step * key_heads + kh) * dk..][..dk];
            let v = &input.v[(step * value_heads + h) * dv..][..dv];
            let decay = f64::from(input.g[step * value_heads + h]).exp();
            let beta = f64::from(input.beta[step * value_heads + h]);
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..dv {
                let sk: f64 = (0..dk).map(|i| s[i * dv + j] * f64::from(k[i])).sum();
                let u = beta * (f64::from(v[j]) - sk);
                for i in 0..dk {
                    s[i * dv + j] += f64::from(k[i]) * u;
                }
            }
            for j in 0..dv {
                let o: f64 = (0..dk).map(|i| s[i * dv + j] * f64::from(q[i])).sum();
                out[(step * value_heads + h) * dv + j] = o as f32;
            }
        }
    });
    out
}

/// One chunk of one value head in the WY / UT form (f64): the chunk's q, k, v, beta and
/// cumulative log decays gamma, and `W = T (beta * e^gamma * K)`, `U = T (beta * V)` with
/// `T = (I + A)^-1`, `A = strictly_lower(diag(beta) (K K^T * Gamma))`.
struct UtChunk {
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    beta: Vec<f64>,
    gamma: Vec<f64>,
    w: Vec<Vec<f64>>,
    u: Vec<Vec<f64>>,
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl UtChunk {
    /// Tokens `start .. start + len` of value head `h` (key head `kh`).
    fn new(
        shape: GdnShape,
        input: &DeltaInputs<'_>,
        h: usize,
        kh: usize,
        start: usize,
        len: usize,
    ) -> Self {
        let (key_heads, value_heads, dk, dv) =
            (shape.key_heads, shape.value_heads, shape.dk, shape.dv);
        let at = |x: &[f32], width: usize, heads: usize, head: usize, i: usize| -> Vec<f64> {
            x[((start + i) * heads + head) * width..][..width]
                .iter()
                .map(|v| f64::from(*v))
                .collect()
        };
        let q: Vec<Vec<f64>> = (0..len)
            .map(|i| at(input.q, dk, key_heads, kh, i))
            .collect();
        let k: Vec<Vec<f64>> = (0..len)
            .map(|i| at(input.k, dk, key_heads, kh, i))
            .collect();
        let v: Vec<Vec<f64>> = (0..len)
            .map(|i| at(input.v, dv, value_heads, h, i))
            .collect();
        let beta: Vec<f64> = (0..len)
            .map(|i| f64::from(input.beta[(start + i) * value_heads + h]))
            .collect();
        let gamma: Vec<f64> = (0..len)
            .scan(0.0f64, |acc, i| {
                *acc += f64::from(input.g[(start + i) * value_heads + h]);
                Some(*acc)
            })
            .collect();
        let mut chunk = Self {
            q,
            k,
            v,
            beta,
            gamma,
            w: Vec::new(),
            u: Vec::new(),
        };
        chunk.w = chunk.solve(
            (0..len)
                .map(|i| {
                    let f = chunk.beta[i] * chunk.gamma[i].exp();
                    chunk.k[i].iter().map(|x| f * x).collect()
                })
                .collect(),
        );
        chunk.u = chunk.solve(
            (0..len)
                .map(|i| chunk.v[i].iter().map(|x| chunk.beta[i] * x).collect())
                .collect(),
        );
        chunk
    }

    fn len(&self) -> usize {
        self.gamma.len()
    }

    /// `A[i][j]` (j < i).
    fn a(&self, i: usize, j: usize) -> f64 {
        self.beta[i] * dot(&self.k[i], &self.k[j]) * (self.gamma[i] - self.gamma[j]).exp()
    }

    /// `(I + A) X = B` by forward substitution.
    fn solve(&self, rhs: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        let mut x: Vec<Vec<f64>> = Vec::with_capacity(rhs.len());
        for (i, mut row) in rhs.into_iter().enumerate() {
            for (j, xj) in x.iter().enumerate() {
                let aij = self.a(i, j);
                row.iter_mut().zip(xj).for_each(|(r, xv)| *r -= aij * xv);
            }
            x.push(row);
        }
        x
    }

    /// `T = (I + A)^-1` (lower triangular), by rows.
    fn transform(&self) -> Vec<Vec<f64>> {
        let n = self.len();
        self.solve(
            (0..n)
                .map(|i| (0..n).map(|j| f64::from(u8::from(i == j))).collect())
                .collect(),
        )
    }

    /// `M[i][c] = (q_i . k_c) e^(gamma_i - gamma_c)` for c <= i.
    fn m(&self, i: usize, c: usize) -> f64 {
        dot(&self.q[i], &self.k[c]) * (self.gamma[i] - self.gamma[c]).exp()
    }

    /// `V' = U - W S` for a head's state `s` (`[dk][dv]`).
    fn v_new(&self, s: &[f64], dv: usize) -> Vec<Vec<f64>> {
        (0..self.len())
            .map(|i| {
                (0..dv)
                    .map(|j| {
                        self.u[i][j]
                            - self.w[i]
                                .iter()
                                .enumerate()
                                .map(|(d, w)| w * s[d * dv + j])
                                .sum::<f64>()
                    })
                    .collect()
            })
            .collect()
    }
}

/// The chunked (WY / UT transform) form, `chunk` tokens at a time: per chunk with cumulative log
/// decays gamma, `A = strictly_lower(diag(beta) (K K^T * Gamma))`, `T = (I + A)^-1` by forward
/// substitution, `W = T (beta * e^gamma * K)`, `U = T (beta * V)`; across chunks
/// `V' = U - W S`, `O = (Q * e^gamma) S + (Q K^T * Gamma, causal) V'`,
/// `S <- e^{gamma_last} S + (K * e^{gamma_last - gamma})^T V'`. Same results as [`recurrent`].
pub fn chunked(
    shape: GdnShape,
    input: DeltaInputs<'_>,
    state: &mut [f32],
    chunk: usize,
) -> Vec<f32> {
    let GdnShape {
        value_heads,
        dk,
        dv,
        ..
    } = shape;
    let mut out = vec![0.0f32; input.t * value_heads * dv];
    per_head_state(shape, state, |h, kh, s| {
        for start in (0..input.t).step_by(chunk.max(1)) {
            let len = chunk.min(input.t - start);
            let c = UtChunk::new(shape, &input, h, kh, start, len);
            let v_new = c.v_new(s, dv);
            for i in 0..len {
                for j in 0..dv {
                    let inter: f64 =
                        c.gamma[i].exp() * (0..dk).map(|d| c.q[i][d] * s[d * dv + j]).sum::<f64>();
                    let intra: f64 = (0..=i).map(|x| c.m(i, x) * v_new[x][j]).sum();
                    out[((start + i) * value_heads + h) * dv + j] = (inter + intra) as f32;
                }
            }
            let last = c.gamma[len - 1];
            for d in 0..dk {
                for j in 0..dv {
                    let update: f64 = (0..len)
                        .map(|x| c.k[x][d] * (last - c.gamma[x]).exp() * v_new[x][j])
                        .sum();
                    s[d * dv + j] = last.exp() * s[d * dv + j] + update;
                }
            }
        }
    });
    out
}

/// How far the chunk kernels' roundings can move [`chunked`]'s results, per element: the chunk
/// kernels (`gdn_chunk_prepare_*`, `gdn_chunk_state_*`) multiply bf16 operands with fp32
/// accumulation, and each rounding to bf16 perturbs its value `x` by `x * delta`, `|delta| <=
/// 2^-8`. To first order an output's error is a sum of such perturbations, each scaled by
/// what multiplies it, so with independent deltas of standard deviation `sigma` it has the
/// standard deviation `sigma * sqrt(sum of squared scaled terms)`. The square root is returned
/// (`out`, `[t][Hv][dv]`, and the final state, `[Hv][dk][dv]`), following the kernels'
/// roundings per chunk (q, k and v; `T diag(beta e^gamma)`, `T diag(beta)`; W, U and M; S as an
/// operand; `V' = U - W S` for `M V'` and `e^(gamma_last - gamma) V'` for the state update),
/// with the errors of W, U, V' and of the fp32 state carried into what uses them, chunk after
/// chunk. Left out, as second order: the error of T from the rounded k in `K K^T` (a few percent
/// of W's own rounding at these magnitudes) and fp32 accumulation (2^-24 relative per term).
///
/// The rounding of the outputs themselves (bf16, `|o| 2^-9`) is not included. The scale follows
/// the magnitudes of the terms, not of the result: a row that continues from a large state
/// carries the error of `Q S` and `W S` even where the output cancels to nearly zero.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundingScale {
    /// Per output, `[t][Hv][dv]`.
    pub out: Vec<f64>,
    /// Per element of the final state, `[Hv][dk][dv]`.
    pub state: Vec<f64>,
}

/// [`RoundingScale`] of [`chunked`] on these inputs from `state` (`[Hv][dk][dv]`, an exact fp32
/// start: the kernels load it and replay pending tokens in fp32), `chunk` tokens per chunk.
pub fn chunked_rounding_scale(
    shape: GdnShape,
    input: DeltaInputs<'_>,
    state: &[f32],
    chunk: usize,
) -> RoundingScale {
    let GdnShape {
        value_heads,
        dk,
        dv,
        ..
    } = shape;
    let size = dk * dv;
    let mut out = vec![0.0f64; input.t * value_heads * dv];
    let mut state_scale = vec![0.0f64; value_heads * size];
    for h in 0..value_heads {
        let kh = shape.key_head(h);
        let mut s: Vec<f64> = state[h * size..(h + 1) * size]
            .iter()
            .map(|v| f64::from(*v))
            .collect();
        // the variance (in units of sigma^2) of the fp32 state's error
        let mut vs = vec![0.0f64; size];
        for start in (0..input.t).step_by(chunk.max(1)) {
            let len = chunk.min(input.t - start);
            let c = UtChunk::new(shape, &input, h, kh, start, len);
            let t = c.transform();
            let sq = |x: f64| x * x;
            // W = T_w K and U = T_u V: their own rounding, T_w's or T_u's, and k's or v's
            let var_rows = |product: &[Vec<f64>], factor: &dyn Fn(usize) -> f64, x: &[Vec<f64>]| {
                (0..len)
                    .map(|i| {
                        (0..x[0].len())
                            .map(|d| {
                                sq(product[i][d])
                                    + 2.0
                                        * (0..=i)
                                            .map(|e| sq(t[i][e] * factor(e) * x[e][d]))
                                            .sum::<f64>()
                            })
                            .collect::<Vec<f64>>()
                    })
                    .collect::<Vec<_>>()
            };
            let var_w = var_rows(&c.w, &|e| c.beta[e] * c.gamma[e].exp(), &c.k);
            let var_u = var_rows(&c.u, &|e| c.beta[e], &c.v);
            // S as the bf16 operand: its rounding plus the state's error so far
            let var_s_op: Vec<f64> = s.iter().zip(&vs).map(|(x, v)| sq(*x) + v).collect();
            let v_new = c.v_new(&s, dv);
            // V' = U - W S before its rounding
            let var_vp: Vec<Vec<f64>> = (0..len)
                .map(|i| {
                    (0..dv)
                        .map(|j| {
                            var_u[i][j]
                                + (0..dk)
                                    .map(|d| {
                                        var_w[i][d] * sq(s[d * dv + j])
                                            + sq(c.w[i][d]) * var_s_op[d * dv + j]
                                    })
                                    .sum::<f64>()
                        })
                        .collect()
                })
                .collect();
            // M = (Q K^T * Gamma): its rounding, q's and k's
            let var_m = |i: usize, x: usize| {
                let decay = sq((c.gamma[i] - c.gamma[x]).exp());
                sq(c.m(i, x))
                    + 2.0 * decay * (0..dk).map(|d| sq(c.q[i][d] * c.k[x][d])).sum::<f64>()
            };
            for i in 0..len {
                let m: Vec<(f64, f64)> = (0..=i).map(|x| (c.m(i, x), var_m(i, x))).collect();
                let head = sq(c.gamma[i].exp());
                for j in 0..dv {
                    // e^gamma Q S: q's rounding and S's as an operand
                    let inter: f64 = head
                        * (0..dk)
                            .map(|d| sq(c.q[i][d]) * (sq(s[d * dv + j]) + var_s_op[d * dv + j]))
                            .sum::<f64>();
                    // M V': M's error, V's error and its rounding
                    let intra: f64 = m
                        .iter()
                        .enumerate()
                        .map(|(x, (mv, var))| {
                            var * sq(v_new[x][j]) + sq(*mv) * (var_vp[x][j] + sq(v_new[x][j]))
                        })
                        .sum();
                    out[((start + i) * value_heads + h) * dv + j] = (inter + intra).sqrt();
                }
            }
            // S = e^gamma_last S + K^T (e^(gamma_last - gamma) V'): k's rounding, the rounding of
            // the scaled V' and V's error
            let last = c.gamma[len - 1];
            for d in 0..dk {
                for j in 0..dv {
                    let mut update = 0.0;
                    let mut var = 0.0;
                    for x in 0..len {
                        let tail = (last - c.gamma[x]).exp();
                        update += c.k[x][d] * tail * v_new[x][j];
                        var += sq(tail * c.k[x][d]) * (2.0 * sq(v_new[x][j]) + var_vp[x][j]);
                    }
                    let at = d * dv + j;
                    s[at] = last.exp() * s[at] + update;
                    vs[at] = sq(last.exp()) * vs[at] + var;
                }
            }
        }
        for (dst, v) in state_scale[h * size..(h + 1) * size].iter_mut().zip(&vs) {
            *dst = v.sqrt();
        }
    }
    RoundingScale {
        out,
        state: state_scale,
    }
}

/// The gated RMSNorm after the recurrence, per head of `dim`: `w * rmsnorm(o) * silu(z)` with
/// a plain (not zero-centred) weight.
pub fn gated_rmsnorm(o: &[f32], z: &[f32], weight: &[f32], dim: usize, eps: f64) -> Vec<f32> {
    let mut y = Vec::with_capacity(o.len());
    for (head, gate) in o.chunks_exact(dim).zip(z.chunks_exact(dim)) {
        let mean: f64 = head.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean + eps).sqrt();
        for i in 0..dim {
            y.push(
                (f64::from(weight[i]) * f64::from(head[i]) * inv * silu(f64::from(gate[i]))) as f32,
            );
        }
    }
    y
}

// ---- the whole layer core from raw projections, and the speculative step ----
//
// What the GPU kernels compute per token from the raw projections (`in_proj_qkv`, `in_proj_a`,
// `in_proj_b`, `in_proj_z` rows): conv1d + SiLU over the qkv channels, the split into q, k, v,
// the L2 norms and the q scale, the gates, the gated delta rule, and (with z) the gated RMSNorm.
// The speculative step keeps the pre-verify state and records, per verified token, what a
// replay needs (the normalised k, the delta `u = beta (v - S^T k)` and the log decay g), so
// committing any accepted count is bookkeeping and the next step replays the accepted tokens
// with `S = e^g S + k u^T` (no reduction, no recompute of the prefix).

/// Per-layer parameters of the fused core, as f32.
#[derive(Debug, Clone, Copy)]
pub struct LayerParams<'a> {
    /// Depthwise conv weights `[conv_dim][kernel]` (`conv1d.weight` without its middle axis).
    pub conv_weight: &'a [f32],
    /// Conv kernel width (4 in Qwen3.5).
    pub kernel: usize,
    /// `A_log`, `[Hv]`.
    pub a_log: &'a [f32],
    /// `dt_bias`, `[Hv]`.
    pub dt_bias: &'a [f32],
    /// `norm.weight`, `[dv]`.
    pub norm_weight: &'a [f32],
    /// The gated RMSNorm's epsilon (`rms_norm_eps`).
    pub eps: f64,
}

impl GdnShape {
    /// Channels of the conv (q, k and v): `2 Hk dk + Hv dv`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.dk + self.value_heads * self.dv
    }
}

/// Raw projection rows of `t` tokens.
#[derive(Debug, Clone, Copy)]
pub struct RawInputs<'a> {
    /// Tokens.
    pub t: usize,
    /// `in_proj_qkv` rows, `[t][conv_dim]` (q, k, v channels).
    pub qkv: &'a [f32],
    /// `in_proj_a` rows, `[t][Hv]`.
    pub a: &'a [f32],
    /// `in_proj_b` rows, `[t][Hv]`.
    pub b: &'a [f32],
    /// `in_proj_z` rows, `[t][Hv * dv]`: with them the outputs go through the gated RMSNorm,
    /// without them they are the raw recurrence outputs.
    pub z: Option<&'a [f32]>,
}

/// q (normalised and scaled), k (normalised), v, g and beta of `t` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct FrontEnd {
    /// `[t][Hk][dk]`.
    pub q: Vec<f32>,
    /// `[t][Hk][dk]`.
    pub k: Vec<f32>,
    /// `[t][Hv][dv]`.
    pub v: Vec<f32>,
    /// `[t][Hv]`.
    pub g: Vec<f32>,
    /// `[t][Hv]`.
    pub beta: Vec<f32>,
}

impl FrontEnd {
    /// The gated delta rule's inputs.
    pub fn inputs(&self, t: usize) -> DeltaInputs<'_> {
        DeltaInputs {
            t,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

/// Conv + SiLU from `window` (`[kernel - 1][conv_dim]`, updated), the split, the norms and the
/// gates of `raw.t` tokens.
pub fn front_end(
    shape: GdnShape,
    params: LayerParams<'_>,
    raw: RawInputs<'_>,
    window: &mut [f32],
) -> FrontEnd {
    let t = raw.t;
    let channels = shape.conv_dim();
    let mixed = conv1d_silu(
        raw.qkv,
        t,
        channels,
        params.conv_weight,
        params.kernel,
        window,
    );
    let key_width = shape.key_heads * shape.dk;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for row in mixed.chunks_exact(channels) {
        q.extend_from_slice(&row[..key_width]);
        k.extend_from_slice(&row[key_width..2 * key_width]);
        v.extend_from_slice(&row[2 * key_width..]);
    }
    l2_normalize(&mut q, shape.dk, 1.0 / (shape.dk as f64).sqrt());
    l2_normalize(&mut k, shape.dk, 1.0);
    let (mut g, mut beta) = (Vec::new(), Vec::new());
    let heads = shape.value_heads;
    for step in 0..t {
        let range = step * heads..(step + 1) * heads;
        let (gs, bs) = gates(
            &raw.a[range.clone()],
            &raw.b[range],
            params.a_log,
            params.dt_bias,
        );
        g.extend(gs);
        beta.extend(bs);
    }
    FrontEnd { q, k, v, g, beta }
}

/// The whole core for `raw.t` tokens of one sequence: [`front_end`], the gated delta rule
/// ([`chunked`] with `chunk`, else [`recurrent`]) from `state` (updated), and the gated RMSNorm
/// when `raw.z` is given. Returns `[t][Hv][dv]`.
pub fn layer_core(
    shape: GdnShape,
    params: LayerParams<'_>,
    raw: RawInputs<'_>,
    window: &mut [f32],
    state: &mut [f32],
    chunk: Option<usize>,
) -> Vec<f32> {
    let front = front_end(shape, params, raw, window);
    let o = match chunk {
        Some(c) => chunked(shape, front.inputs(raw.t), state, c),
        None => recurrent(shape, front.inputs(raw.t), state),
    };
    match raw.z {
        Some(z) => gated_rmsnorm(&o, z, params.norm_weight, shape.dv, params.eps),
        None => o,
    }
}

/// What a replay of one verified token needs: `S = e^g S + k u^T` per value head.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingToken {
    /// The normalised key, `[Hk][dk]`.
    pub k: Vec<f32>,
    /// `u = beta (v - (e^g S)^T k)`, `[Hv][dv]`.
    pub u: Vec<f32>,
    /// Log decays, `[Hv]`.
    pub g: Vec<f32>,
}

/// How a step treats its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepMode {
    /// Every token is final: the state after all of them is stored.
    Decode,
    /// The tokens are speculative: the state before them is kept (after replaying the pending
    /// tokens) and each token's replay data is recorded; [`SequenceCache::commit`] then accepts
    /// any prefix of them.
    Verify,
}

/// One sequence's GDN cache with the kernels' semantics.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceCache {
    /// The recurrent state `[Hv][dk][dv]` after `position - pending.len()` tokens.
    pub state: Vec<f32>,
    /// Raw qkv inputs of the `kernel - 1` positions before `position`, `[kernel - 1][conv_dim]`.
    pub window: Vec<f32>,
    /// Tokens accepted but not yet folded into `state`, oldest first.
    pub pending: Vec<PendingToken>,
    /// Tokens the sequence has committed (the position of the next token).
    pub position: usize,
    /// The last verify step's tokens: raw qkv rows and replay data, until committed.
    verified: Vec<(Vec<f32>, PendingToken)>,
}

impl SequenceCache {
    /// A sequence at `position` with this state and conv window and nothing pending.
    pub fn new(state: Vec<f32>, window: Vec<f32>, position: usize) -> Self {
        Self {
            state,
            window,
            pending: Vec::new(),
            position,
            verified: Vec::new(),
        }
    }

    /// The last verify step's tokens not yet committed: raw qkv row and replay data each.
    pub fn verified(&self) -> &[(Vec<f32>, PendingToken)] {
        &self.verified
    }

    /// Folds the pending tokens into the state: `S = e^g S + k u^T`, oldest first.
    pub fn replay_pending(&mut self, shape: GdnShape) {
        let pending = std::mem::take(&mut self.pending);
        per_head_state(shape, &mut self.state, |h, kh, s| {
            for token in &pending {
                let decay = f64::from(token.g[h]).exp();
                let k = &token.k[kh * shape.dk..(kh + 1) * shape.dk];
                let u = &token.u[h * shape.dv..(h + 1) * shape.dv];
                for (i, ki) in k.iter().enumerate() {
                    for (j, uj) in u.iter().enumerate() {
                        let x = &mut s[i * shape.dv + j];
                        *x = decay * *x + f64::from(*ki) * f64::from(*uj);
                    }
                }
            }
        });
    }

    /// One step of `raw.t` tokens: replays the pending tokens, then runs the new ones
    /// token by token. `Decode` stores the state after them and advances the position;
    /// `Verify` keeps the state before them and records them for [`SequenceCache::commit`].
    /// Returns the outputs `[t][Hv][dv]` (gated-normalised when `raw.z` is given).
    pub fn step(
        &mut self,
        shape: GdnShape,
        params: LayerParams<'_>,
        raw: RawInputs<'_>,
        mode: StepMode,
    ) -> Vec<f32> {
        self.replay_pending(shape);
        let mut window = self.window.clone();
        let front = front_end(shape, params, raw, &mut window);
        let (hk, hv, dk, dv) = (shape.key_heads, shape.value_heads, shape.dk, shape.dv);
        let mut state = self.state.clone();
        let mut o = vec![0.0f32; raw.t * hv * dv];
        let mut tokens = Vec::with_capacity(raw.t);
        for step in 0..raw.t {
            let mut u = vec![0.0f32; hv * dv];
            per_head_state(shape, &mut state, |h, kh, s| {
                let q = &front.q[(step * hk + kh) * dk..][..dk];
                let k = &front.k[(step * hk + kh) * dk..][..dk];
                let v = &front.v[(step * hv + h) * dv..][..dv];
                let decay = f64::from(front.g[step * hv + h]).exp();
                let beta = f64::from(front.beta[step * hv + h]);
                s.iter_mut().for_each(|x| *x *= decay);
                for j in 0..dv {
                    let sk: f64 = (0..dk).map(|i| s[i * dv + j] * f64::from(k[i])).sum();
                    let uj = beta * (f64::from(v[j]) - sk);
                    u[h * dv + j] = uj as f32;
                    for i in 0..dk {
                        s[i * dv + j] += f64::from(k[i]) * uj;
                    }
                    let oj: f64 = (0..dk).map(|i| s[i * dv + j] * f64::from(q[i])).sum();
                    o[(step * hv + h) * dv + j] = oj as f32;
                }
            });
            let channels = shape.conv_dim();
            tokens.push((
                raw.qkv[step * channels..(step + 1) * channels].to_vec(),
                PendingToken {
                    k: front.k[step * hk * dk..(step + 1) * hk * dk].to_vec(),
                    u,
                    g: front.g[step * hv..(step + 1) * hv].to_vec(),
                },
            ));
        }
        match mode {
            StepMode::Decode => {
                self.state = state;
                self.window = window;
                self.position += raw.t;
                self.verified.clear();
            }
            StepMode::Verify => self.verified = tokens,
        }
        match raw.z {
            Some(z) => gated_rmsnorm(&o, z, params.norm_weight, dv, params.eps),
            None => o,
        }
    }

    /// Accepts the first `accepted` tokens of the last verify step (0..=its token count): they
    /// become pending, the position advances by `accepted`, and the conv window ends at the
    /// last accepted token. The state is not touched.
    ///
    /// # Panics
    /// When `accepted` exceeds the tokens of the last verify step (a caller's bug).
    pub fn commit(&mut self, accepted: usize) {
        assert!(
            accepted <= self.verified.len(),
            "commit {accepted} of {} verified tokens",
            self.verified.len()
        );
        let keep = self.window.len();
        let mut history = std::mem::take(&mut self.window);
        for (row, token) in self.verified.drain(..).take(accepted) {
            history.extend_from_slice(&row);
            self.pending.push(token);
        }
        self.window = history[history.len() - keep..].to_vec();
        self.position += accepted;
        self.verified.clear();
    }
}

/// bf16's unit roundoff: a rounding to bf16 moves a value by at most this fraction of it.
pub const BF16_UNIT_ROUNDOFF: f64 = 1.0 / 256.0;

/// How far the chunk kernels' prefill of `raw.t` tokens of one sequence may be from the
/// reference, per element: outputs `[t][Hv][dv]` (through the gated RMSNorm when `raw.z` is
/// given) and the state after them `[Hv][dk][dv]`, for the sequence `seq` (its pending tokens
/// replayed first, as the kernels do). Each element may differ by `sigmas` standard deviations of
/// [`chunked_rounding_scale`] (a rounding's relative error has a standard deviation of at most
/// `u / sqrt(3)`, u = 2^-8) plus the rounding of the result: bf16 outputs on both sides
/// (`u |o|`), fp32 states (`2^-20 |s|`). The gated outputs `y = w o / r silu(z)`,
/// `r = sqrt(mean(o^2) + eps)`, move by `w silu(z) / r (do - o (o . do) / (dv r^2))`, within
/// `|w silu(z)| / r (|do| + |o| rms(do) / r)` (Cauchy-Schwarz), plus y's own rounding.
pub fn chunked_allowance(
    shape: GdnShape,
    params: LayerParams<'_>,
    raw: RawInputs<'_>,
    seq: &SequenceCache,
    chunk: usize,
    sigmas: f64,
) -> (Vec<f64>, Vec<f64>) {
    let u = BF16_UNIT_ROUNDOFF;
    let sigma = sigmas * u / 3f64.sqrt();
    let mut seq = seq.clone();
    seq.replay_pending(shape);
    let mut window = seq.window.clone();
    let front = front_end(shape, params, raw, &mut window);
    let scale = chunked_rounding_scale(shape, front.inputs(raw.t), &seq.state, chunk);
    let mut state = seq.state.clone();
    let o = chunked(shape, front.inputs(raw.t), &mut state, chunk);
    let raw_allowed: Vec<f64> = o
        .iter()
        .zip(&scale.out)
        .map(|(o, s)| f64::from(o.abs()) * u + sigma * s)
        .collect();
    let out = match raw.z {
        None => raw_allowed,
        Some(z) => {
            let dim = shape.dv;
            let mut out = Vec::with_capacity(o.len());
            for ((head, allowed), gate) in o
                .chunks_exact(dim)
                .zip(raw_allowed.chunks_exact(dim))
                .zip(z.chunks_exact(dim))
            {
                let mean = head.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / dim as f64;
                let r = (mean + params.eps).sqrt();
                let rms_allowed = (allowed.iter().map(|x| x * x).sum::<f64>() / dim as f64).sqrt();
                for ((o, allowed), (w, z)) in head
                    .iter()
                    .zip(allowed)
                    .zip(params.norm_weight.iter().zip(gate))
                {
                    let factor = f64::from(*w) * silu(f64::from(*z));
                    let o = f64::from(*o);
                    let y = factor * o / r;
                    out.push(
                        factor.abs() / r * (allowed + o.abs() * rms_allowed / r) + y.abs() * u,
                    );
                }
            }
            out
        }
    };
    let state = state
        .iter()
        .zip(&scale.state)
        .map(|(s, e)| f64::from(s.abs()) * 2f64.powi(-20) + sigma * e)
        .collect();
    (out, state)
}
