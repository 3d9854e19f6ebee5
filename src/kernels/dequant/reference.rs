//! CPU reference of the `dequant` family.

use crate::formats::nvfp4::Nvfp4View;
use half::bf16;

/// `out[r, c] = bf16(e2m1 * (e4m3_scale * global_scale))`, row-major, rounded once to bf16
/// (exactly what `dequant_nvfp4_bf16` computes).
pub fn dequant_nvfp4_bf16(w: Nvfp4View<'_>) -> Vec<bf16> {
    (0..w.rows)
        .flat_map(|r| (0..w.cols).map(move |c| bf16::from_f32(w.value(r, c))))
        .collect()
}
