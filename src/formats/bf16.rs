//! Rounding to bf16 from f64, for the CPU references that model a kernel's bf16 rounding.
//!
//! `half` 2.7's `bf16::from_f64` drops the low 32 bits of the f64 mantissa before it rounds, so
//! a value less than 2^-20 (relative) above a rounding midpoint rounds the wrong way (about one
//! value in 4000 at random). A reference that models a kernel's f32 -> bf16 round to nearest
//! even then disagrees with a correct kernel by one bf16 ulp, which a cancelling sum can turn
//! into an error far above the bf16 rounding of the result (seen in the MoE block tests).

use half::bf16;

/// `value` rounded to the nearest bf16, ties to even (IEEE 754 round to nearest even), for
/// finite results; infinities and NaN as `half` converts them. Exact: the f32 conversion lands
/// within one bf16 step of the answer, and the neighbours are compared in f64, where every bf16
/// value is exact.
pub fn round_f64(value: f64) -> bf16 {
    let near = bf16::from_f32(value as f32);
    if !value.is_finite() || !near.is_finite() {
        return near;
    }
    let magnitude = value.abs();
    let near_bits = near.to_bits() & 0x7fff;
    let mut best = near_bits;
    let mut best_error = (f64::from(bf16::from_bits(near_bits).to_f32()) - magnitude).abs();
    let below = near_bits.checked_sub(1);
    let above = (near_bits < 0x7f7f).then_some(near_bits + 1);
    for candidate in [below, above].into_iter().flatten() {
        let error = (f64::from(bf16::from_bits(candidate).to_f32()) - magnitude).abs();
        if error < best_error || (error == best_error && candidate % 2 == 0) {
            best = candidate;
            best_error = error;
        }
    }
    let sign = if value.is_sign_negative() { 0x8000 } else { 0 };
    bf16::from_bits(best | sign)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_nearest_even_where_half_truncates() {
        // 8.8e-7 above the midpoint between -2.0625 and -2.078125: half 2.7 gives -2.0625
        assert_eq!(round_f64(-2.070_313_375_358_504_3).to_f32(), -2.078_125);
        assert_eq!(round_f64(2.070_313_375_358_504_3).to_f32(), 2.078_125);
        // exact midpoints go to the even neighbour
        assert_eq!(round_f64(2.070_312_5).to_f32(), 2.0625);
        assert_eq!(round_f64(2.054_687_5).to_f32(), 2.0625);
        // just below a midpoint, and values that are already bf16
        assert_eq!(round_f64(2.070_312_499_999).to_f32(), 2.0625);
        assert_eq!(round_f64(-0.5).to_f32(), -0.5);
        assert_eq!(round_f64(0.0).to_bits(), 0);
        // the smallest subnormal and half of it (a tie with zero, which is even)
        let tiny = f64::from(bf16::from_bits(1).to_f32());
        assert_eq!(round_f64(tiny).to_bits(), 1);
        assert_eq!(round_f64(tiny / 2.0).to_bits(), 0);
        assert_eq!(round_f64(tiny * 0.75).to_bits(), 1);
        assert!(round_f64(f64::INFINITY).is_infinite());
        assert!(round_f64(f64::NAN).is_nan());
    }

    #[test]
    fn agrees_with_the_f32_path_wherever_that_is_exact() {
        // values exactly representable in f32 have no double rounding through f32
        let mut rng = crate::rng::SplitMix64::new(7);
        for _ in 0..100_000 {
            let v = f64::from(rng.normal_vec(1, 3.0)[0]);
            assert_eq!(
                round_f64(v).to_bits(),
                bf16::from_f32(v as f32).to_bits(),
                "{v}"
            );
        }
    }
}
