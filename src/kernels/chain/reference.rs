//! CPU reference of the `chain` family.

/// What one link writes: `values[index] = values[index - 1] + 1` (wrapping). `index` is at
/// least 1 and inside `values`.
pub fn link(values: &mut [u32], index: usize) {
    values[index] = values[index - 1].wrapping_add(1);
}
