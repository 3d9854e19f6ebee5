//! How a kernel's output is judged against its CPU reference.

use half::bf16;

/// How far a bf16 result is from an unrounded reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    /// ||got - want|| / ||want|| (L2 over all elements).
    pub relative_l2: f64,
    /// Largest |got - want|.
    pub max_abs: f64,
    /// Index of the element that breaks the per-element bound worst (ratio of its error to its
    /// allowance), and that ratio; <= 1 everywhere means the check passed.
    pub worst: (usize, f64),
    /// Elements that are NaN or infinite while the reference is finite, or differ from a
    /// non-finite reference (anything but NaN for NaN, or the same infinity).
    pub non_finite: usize,
}

impl Agreement {
    /// Whether every element is within its bound and no element is non-finite.
    pub fn passed(&self) -> bool {
        self.non_finite == 0 && self.worst.1 <= 1.0
    }
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rel L2 {:.2e}, max |err| {:.3e}, worst element {} at {:.2} of its bound, {} non-finite",
            self.relative_l2, self.max_abs, self.worst.0, self.worst.1, self.non_finite
        )
    }
}

/// Compares a bf16 output with an unrounded reference: each element may differ by bf16's
/// rounding (2^-8 relative, twice the half ulp to cover the accumulation order) plus
/// `2e-3 * rms(want)` for fp32 accumulation over long dot products.
pub fn compare_bf16(got: &[bf16], want: &[f32]) -> Agreement {
    compare_bf16_with_slack(got, want, &[])
}

/// [`compare_bf16`] with `slack[i]` added to element i's allowance (a reference's own model of
/// where a correct kernel may legitimately differ more; empty: none).
///
/// # Panics
/// If the lengths differ (`slack` may also be empty).
pub fn compare_bf16_with_slack(got: &[bf16], want: &[f32], slack: &[f64]) -> Agreement {
    assert_eq!(got.len(), want.len(), "compare_bf16: lengths differ");
    assert!(
        slack.is_empty() || slack.len() == want.len(),
        "compare_bf16: slack of another length"
    );
    // over the finite elements: one infinity in the reference would make every allowance
    // infinite and pass anything
    let rms = (want
        .iter()
        .filter(|w| w.is_finite())
        .map(|w| (*w as f64).powi(2))
        .sum::<f64>()
        / want.len().max(1) as f64)
        .sqrt();
    let (mut diff2, mut want2, mut max_abs, mut worst, mut non_finite) =
        (0.0, 0.0, 0.0f64, (0, 0.0f64), 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), *w as f64);
        if !w.is_finite() {
            if !(g == w || g.is_nan() && w.is_nan()) {
                non_finite += 1;
            }
            continue;
        }
        if !g.is_finite() {
            non_finite += 1;
            continue;
        }
        let err = (g - w).abs();
        let allowance =
            w.abs() / 128.0 + 2e-3 * rms + slack.get(i).copied().unwrap_or(0.0) + f64::MIN_POSITIVE;
        diff2 += err * err;
        want2 += w * w;
        max_abs = max_abs.max(err);
        if err / allowance > worst.1 {
            worst = (i, err / allowance);
        }
    }
    Agreement {
        relative_l2: (diff2 / want2.max(f64::MIN_POSITIVE)).sqrt(),
        max_abs,
        worst,
        non_finite,
    }
}

/// The largest |got - want| over the elements, and that relative to the largest |want|, for fp32
/// outputs against a reference: NaN where any element of either is NaN (or both are the same
/// infinity), infinite where only one is, so a bound on either figure fails on a non-finite
/// output rather than passing it over.
///
/// # Panics
/// If the lengths differ.
pub fn max_difference(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "max_difference: lengths differ");
    // f64::max drops a NaN; this keeps it
    let nan_max = |m: f64, d: f64| if d.is_nan() || d > m { d } else { m };
    let largest = got
        .iter()
        .zip(want)
        .map(|(g, w)| f64::from(*g) - f64::from(*w))
        .fold(0.0, |m, d| nan_max(m, d.abs()));
    let scale = want.iter().fold(0.0, |m, w| nan_max(m, f64::from(w.abs())));
    (largest, largest / scale.max(1e-30))
}
