//! CPU reference of the `gdn` family (Gated DeltaNet linear attention,
//! ../shared/reference/qwen3_5_moe.md): the causal depthwise conv1d + SiLU with its state window,
//! the gates, the per-head L2 norms, the gated delta rule in its recurrent form and in its
//! chunked (WY / UT transform) form, and the gated RMSNorm. f64 inside, f32 at the interfaces.
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
        key_heads,
        value_heads,
        dk,
        dv,
    } = shape;
    let mut out = vec![0.0f32; input.t * value_heads * dv];
    per_head_state(shape, state, |h, kh, s| {
        for start in (0..input.t).step_by(chunk.max(1)) {
            let len = chunk.min(input.t - start);
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
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            // (I + A) X = B by forward substitution, A strictly lower
            let a = |i: usize, j: usize| beta[i] * dot(&k[i], &k[j]) * (gamma[i] - gamma[j]).exp();
            let solve = |rhs: Vec<Vec<f64>>| -> Vec<Vec<f64>> {
                let mut x: Vec<Vec<f64>> = Vec::with_capacity(len);
                for (i, mut row) in rhs.into_iter().enumerate() {
                    for (j, xj) in x.iter().enumerate() {
                        let aij = a(i, j);
                        row.iter_mut().zip(xj).for_each(|(r, xv)| *r -= aij * xv);
                    }
                    x.push(row);
                }
                x
            };
            let w = solve(
                (0..len)
                    .map(|i| k[i].iter().map(|x| beta[i] * gamma[i].exp() * x).collect())
                    .collect(),
            );
            let u = solve(
                (0..len)
                    .map(|i| v[i].iter().map(|x| beta[i] * x).collect())
                    .collect(),
            );
            // V' = U - W S
            let v_new: Vec<Vec<f64>> = (0..len)
                .map(|i| {
                    (0..dv)
                        .map(|j| u[i][j] - (0..dk).map(|d| w[i][d] * s[d * dv + j]).sum::<f64>())
                        .collect()
                })
                .collect();
            for i in 0..len {
                for j in 0..dv {
                    let inter: f64 =
                        gamma[i].exp() * (0..dk).map(|d| q[i][d] * s[d * dv + j]).sum::<f64>();
                    let intra: f64 = (0..=i)
                        .map(|c| dot(&q[i], &k[c]) * (gamma[i] - gamma[c]).exp() * v_new[c][j])
                        .sum();
                    out[((start + i) * value_heads + h) * dv + j] = (inter + intra) as f32;
                }
            }
            let last = gamma[len - 1];
            for d in 0..dk {
                for j in 0..dv {
                    let update: f64 = (0..len)
                        .map(|c| k[c][d] * (last - gamma[c]).exp() * v_new[c][j])
                        .sum();
                    s[d * dv + j] = last.exp() * s[d * dv + j] + update;
                }
            }
        }
    });
    out
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
