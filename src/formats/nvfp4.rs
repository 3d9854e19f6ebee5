//! NVFP4: E2M1 values in 16-element blocks, one E4M3 scale per block, one f32 global scale per
//! tensor. Encode/decode of both element formats, ModelOpt block quantisation, nibble packing
//! (low nibble = even element), and [`Nvfp4Matrix`], the one in-memory form, loaded from ModelOpt
//! or compressed-tensors checkpoints.
//!
//! The GPU twin of the decoders is `kernels/templates/common/nvfp4.cuh`.

use crate::error::{Error, Result};
use crate::formats::safetensors::Checkpoint;
use safetensors::Dtype;

/// Elements per NVFP4 block (one E4M3 scale each).
pub const BLOCK: usize = 16;

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Largest finite E4M3 (float8_e4m3fn) magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The E4M3 byte of 1.0, the scale ModelOpt gives an all-zero block.
pub const E4M3_ONE: u8 = 0x38;

/// The 16 E2M1 values by nibble: 0x0..0x7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; 0x8..0xF negated.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Decodes an E2M1 nibble (the low 4 bits of `nibble`).
pub fn e2m1_decode(nibble: u8) -> f32 {
    E2M1_VALUES[(nibble & 0xf) as usize]
}

/// Encodes `value` as the nearest E2M1 nibble, ties to the even mantissa, saturating at ±6.
/// The sign is kept, also for values that round to zero (-0.0 -> 0x8). NaN encodes as +0;
/// callers reject non-finite input before quantising.
pub fn e2m1_encode(value: f32) -> u8 {
    let magnitude = value.abs();
    // Thresholds are the midpoints between neighbours; `<=` where the lower neighbour has the
    // even mantissa (0, 1, 2, 4), `<` where the upper one has (1, 2, 4 above 0.5, 1.5, 3).
    let code = if magnitude.is_nan() || magnitude <= 0.25 {
        0
    } else if magnitude < 0.75 {
        1
    } else if magnitude <= 1.25 {
        2
    } else if magnitude < 1.75 {
        3
    } else if magnitude <= 2.5 {
        4
    } else if magnitude < 3.5 {
        5
    } else if magnitude <= 5.0 {
        6
    } else {
        7
    };
    if value.is_sign_negative() && !value.is_nan() {
        code | 8
    } else {
        code
    }
}

/// Decodes an E4M3 (float8_e4m3fn) byte: bias 7, no infinities, S.1111.111 is NaN,
/// exponent 0 is subnormal (m * 2^-9).
pub fn e4m3_decode(byte: u8) -> f32 {
    let exponent = (byte >> 3) & 0xf;
    let mantissa = byte & 7;
    let magnitude = if exponent == 0xf && mantissa == 7 {
        f32::NAN
    } else if exponent == 0 {
        mantissa as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits(((exponent as u32 + 120) << 23) | ((mantissa as u32) << 20))
    };
    if byte & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Encodes `value` as E4M3, round to nearest even, saturating to ±448 (ModelOpt clamps scales to
/// the finite range). NaN encodes as 0x7F.
pub fn e4m3_encode(value: f32) -> u8 {
    if value.is_nan() {
        return 0x7f;
    }
    let sign = if value.is_sign_negative() { 0x80 } else { 0 };
    let magnitude = value.abs();
    let code = if magnitude >= E4M3_MAX {
        0x7e
    } else if magnitude < 1.0 / 64.0 {
        // subnormal range: multiples of 2^-9 (exact scaling by a power of two), 8 * 2^-9 = 2^-6
        // carries into the smallest normal, whose code is 8
        (magnitude * 512.0).round_ties_even() as u8
    } else {
        let bits = magnitude.to_bits();
        let exponent = (bits >> 23) as i32 - 127;
        let mantissa = bits & 0x7f_ffff;
        let rounded = (mantissa + 0x7_ffff + ((mantissa >> 20) & 1)) >> 20; // 0..=8, 8 carries
        let code = (((exponent + 7) as u32) << 3) + rounded;
        code.min(0x7e) as u8
    };
    sign | code
}

/// Half the gap between the E2M1 neighbours around `magnitude` (in units of the block scale):
/// the largest rounding error quantisation may make there. Above 6 (saturation) it is the top
/// interval's half step, 1.
pub fn e2m1_half_step(magnitude: f32) -> f32 {
    if magnitude < 2.0 {
        0.25
    } else if magnitude < 4.0 {
        0.5
    } else {
        1.0
    }
}

/// ModelOpt's per-tensor scale for a tensor whose largest magnitude is `amax`:
/// `amax / (6 * 448)`, and 1.0 for an all-zero tensor (so every block scale stays finite).
/// The same rule gives `input_scale` from an activation amax.
pub fn modelopt_global_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / (E2M1_MAX * E4M3_MAX)
    } else {
        1.0
    }
}

/// An NVFP4 matrix `[rows, cols]` (row-major, `cols % 16 == 0`):
/// `value(r, c) = e2m1(packed) * e4m3(scales[r, c / 16]) * global_scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Matrix {
    /// Rows (output features, N).
    pub rows: usize,
    /// Columns (input features, K); a multiple of 16.
    pub cols: usize,
    /// `rows * cols / 2` bytes, row-major; byte i holds element 2i in its low nibble.
    pub packed: Vec<u8>,
    /// `rows * cols / 16` E4M3 bytes, row-major `[rows, cols / 16]`.
    pub scales: Vec<u8>,
    /// Per-tensor multiplier (ModelOpt `weight_scale_2`; 1 / compressed-tensors
    /// `weight_global_scale`).
    pub global_scale: f32,
    /// Activation scale for W4A4 (ModelOpt `input_scale`; 1 / `input_global_scale`), if stored.
    pub input_scale: Option<f32>,
}

/// A borrowed NVFP4 matrix: what the CPU references read.
#[derive(Debug, Clone, Copy)]
pub struct Nvfp4View<'a> {
    /// Rows (N).
    pub rows: usize,
    /// Columns (K), a multiple of 16.
    pub cols: usize,
    /// Packed nibbles, `rows * cols / 2` bytes.
    pub packed: &'a [u8],
    /// E4M3 block scales, `rows * cols / 16` bytes.
    pub scales: &'a [u8],
    /// Per-tensor multiplier.
    pub global_scale: f32,
}

impl Nvfp4View<'_> {
    /// The dequantised value at (`row`, `col`), computed as the kernels do:
    /// `e2m1 * (e4m3_scale * global_scale)` in f32.
    ///
    /// # Panics
    /// When `row >= rows` or `col >= cols` (or the buffers are shorter than the shape says).
    pub fn value(&self, row: usize, col: usize) -> f32 {
        let i = row * self.cols + col;
        let byte = self.packed[i / 2];
        let nibble = if i % 2 == 0 { byte & 0xf } else { byte >> 4 };
        e2m1_decode(nibble) * self.block_scale(row, col / BLOCK)
    }

    /// The full multiplier of block `block` of row `row`: `e4m3(scale) * global_scale`.
    ///
    /// # Panics
    /// When `row >= rows` or `block >= cols / 16`.
    pub fn block_scale(&self, row: usize, block: usize) -> f32 {
        e4m3_decode(self.scales[row * (self.cols / BLOCK) + block]) * self.global_scale
    }
}

/// Packs E2M1 nibbles two per byte, element 2i in the low nibble. `nibbles.len()` must be even.
pub fn pack_nibbles(nibbles: &[u8]) -> Vec<u8> {
    nibbles
        .chunks_exact(2)
        .map(|p| (p[0] & 0xf) | (p[1] << 4))
        .collect()
}

/// Unpacks bytes into nibbles, low nibble first.
pub fn unpack_nibbles(packed: &[u8]) -> Vec<u8> {
    packed.iter().flat_map(|b| [b & 0xf, b >> 4]).collect()
}

impl Nvfp4Matrix {
    /// Quantises a row-major f32 matrix the way NVIDIA ModelOpt does:
    /// `global_scale = amax / (6 * 448)` (1.0 for an all-zero matrix), block scale
    /// `e4m3(amax_block / (6 * global_scale))` with a zero scale replaced by 1.0, elements
    /// `e2m1(value / (block_scale * global_scale))`, ties to even.
    ///
    /// # Errors
    /// [`Error::Invalid`] (naming `name`) when `cols` is not a multiple of 16, `values.len()` is
    /// not `rows * cols`, or a value is NaN or infinite.
    pub fn quantize(name: &str, values: &[f32], rows: usize, cols: usize) -> Result<Self> {
        check_values(name, values, rows, cols)?;
        let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        Ok(Self::quantize_checked(
            values,
            rows,
            cols,
            modelopt_global_scale(amax),
        ))
    }

    /// Quantises with a given per-tensor scale (as W4A4 quantises activations with the
    /// checkpoint's `input_scale`): block scale `e4m3(amax_block / (6 * global_scale))`, a zero
    /// scale replaced by 1.0, elements `e2m1(value / (block_scale * global_scale))`, both
    /// saturating, ties to even.
    ///
    /// # Errors
    /// As [`Nvfp4Matrix::quantize`], and [`Error::Invalid`] for a global scale that is not
    /// positive and finite.
    pub fn quantize_with_global_scale(
        name: &str,
        values: &[f32],
        rows: usize,
        cols: usize,
        global_scale: f32,
    ) -> Result<Self> {
        check_values(name, values, rows, cols)?;
        checked_global(name, global_scale)?;
        Ok(Self::quantize_checked(values, rows, cols, global_scale))
    }

    /// The quantiser proper, on input [`check_values`] accepted.
    fn quantize_checked(values: &[f32], rows: usize, cols: usize, global_scale: f32) -> Self {
        let mut scales = Vec::with_capacity(values.len() / BLOCK);
        let mut nibbles = Vec::with_capacity(values.len());
        for block in values.chunks_exact(BLOCK) {
            let block_amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let mut code = e4m3_encode(block_amax / (E2M1_MAX * global_scale));
            if e4m3_decode(code) == 0.0 {
                code = E4M3_ONE;
            }
            let scale = e4m3_decode(code) * global_scale;
            scales.push(code);
            nibbles.extend(block.iter().map(|v| e2m1_encode(v / scale)));
        }
        Self {
            rows,
            cols,
            packed: pack_nibbles(&nibbles),
            scales,
            global_scale,
            input_scale: None,
        }
    }

    /// The borrowed form the references take.
    pub fn view(&self) -> Nvfp4View<'_> {
        Nvfp4View {
            rows: self.rows,
            cols: self.cols,
            packed: &self.packed,
            scales: &self.scales,
            global_scale: self.global_scale,
        }
    }

    /// The whole matrix dequantised to f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let view = self.view();
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| view.value(r, c)))
            .collect()
    }

    /// The matrices' rows one after another, as one matrix: what engines do with linears that
    /// read the same input (an attention layer's q, k and v), so one GEMM streams them all.
    /// None unless every part has the same columns, the same global scale (bit for bit: one
    /// per-tensor multiplier must hold for every row, and re-expressing block scales against
    /// another would round them) and the same input scale; ModelOpt and `fp4spec quantize`
    /// give such linears one of each. None for no parts.
    pub fn stack_rows(parts: &[&Self]) -> Option<Self> {
        let first = parts.first()?;
        let same = |m: &&Self| {
            m.cols == first.cols
                && m.global_scale.to_bits() == first.global_scale.to_bits()
                && m.input_scale.map(f32::to_bits) == first.input_scale.map(f32::to_bits)
        };
        if !parts.iter().all(same) {
            return None;
        }
        Some(Self {
            rows: parts.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            packed: parts
                .iter()
                .flat_map(|m| m.packed.iter().copied())
                .collect(),
            scales: parts
                .iter()
                .flat_map(|m| m.scales.iter().copied())
                .collect(),
            global_scale: first.global_scale,
            input_scale: first.input_scale,
        })
    }

    /// Bytes the matrix occupies (packed nibbles + block scales + the global scale).
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.scales.len() + 4
    }

    /// Loads the linear `prefix` (e.g. `model.layers.0.mlp.down_proj`) in whichever NVFP4
    /// convention the checkpoint uses: ModelOpt (`weight`, `weight_scale`, `weight_scale_2`,
    /// optional `input_scale`) or compressed-tensors (`weight_packed`, `weight_scale`,
    /// `weight_global_scale`, optional `input_global_scale`, global scales inverted).
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when neither convention's tensors are complete,
    /// [`Error::Dtype`] / [`Error::Shape`] naming the tensor, [`Error::Invalid`] for a NaN block
    /// scale, a non-finite or non-positive global scale, or K not a multiple of 16.
    pub fn load(checkpoint: &Checkpoint, prefix: &str) -> Result<Self> {
        if checkpoint.contains(&format!("{prefix}.weight_packed")) {
            Self::load_compressed_tensors(checkpoint, prefix)
        } else {
            Self::load_modelopt(checkpoint, prefix)
        }
    }

    /// Loads a ModelOpt NVFP4 linear: `{prefix}.weight` U8 `[N, K/2]`, `.weight_scale` F8_E4M3
    /// `[N, K/16]`, `.weight_scale_2` F32 scalar, `.input_scale` F32 scalar (optional).
    ///
    /// # Errors
    /// As [`Nvfp4Matrix::load`].
    pub fn load_modelopt(checkpoint: &Checkpoint, prefix: &str) -> Result<Self> {
        let weight = format!("{prefix}.weight");
        let global = checkpoint.scalar_f32(&format!("{prefix}.weight_scale_2"))?;
        let input_name = format!("{prefix}.input_scale");
        let input_scale = if checkpoint.contains(&input_name) {
            Some(checked_global(
                &input_name,
                checkpoint.scalar_f32(&input_name)?,
            )?)
        } else {
            None
        };
        let global_scale = checked_global(&format!("{prefix}.weight_scale_2"), global)?;
        Self::load_parts(
            checkpoint,
            &weight,
            &format!("{prefix}.weight_scale"),
            global_scale,
            input_scale,
        )
    }

    /// Loads a compressed-tensors `nvfp4-pack-quantized` linear: `{prefix}.weight_packed`,
    /// `.weight_scale`, `.weight_global_scale` (= 6 * 448 / amax, inverted here) and optional
    /// `.input_global_scale`.
    ///
    /// # Errors
    /// As [`Nvfp4Matrix::load`].
    pub fn load_compressed_tensors(checkpoint: &Checkpoint, prefix: &str) -> Result<Self> {
        let global_name = format!("{prefix}.weight_global_scale");
        let inverted = checked_global(&global_name, checkpoint.scalar_f32(&global_name)?)?;
        let input_name = format!("{prefix}.input_global_scale");
        let input_scale = if checkpoint.contains(&input_name) {
            Some(1.0 / checked_global(&input_name, checkpoint.scalar_f32(&input_name)?)?)
        } else {
            None
        };
        Self::load_parts(
            checkpoint,
            &format!("{prefix}.weight_packed"),
            &format!("{prefix}.weight_scale"),
            1.0 / inverted,
            input_scale,
        )
    }

    /// Loads expert `expert` of a fused 3-D ModelOpt NVFP4 expert tensor `name` (`[E, N, K/2]`
    /// U8), with its per-expert scales `{name}_weight_scale` (F8_E4M3 `[E, N, K/16]`),
    /// `{name}_weight_scale_2` (F32 `[E]`) and optional `{name}_input_scale` (F32 `[E]`, or a
    /// scalar shared by all experts).
    ///
    /// # Errors
    /// As [`Nvfp4Matrix::load`]; [`Error::Invalid`] for an expert index out of range.
    pub fn load_fused_expert(checkpoint: &Checkpoint, name: &str, expert: usize) -> Result<Self> {
        let weight = checkpoint.tensor(name)?;
        weight.expect_dtype(&[Dtype::U8])?;
        let [experts, rows, half_cols] = weight.expect_rank::<3>()?;
        if expert >= experts {
            return Err(Error::invalid(
                format!("tensor `{name}`"),
                format!("expert {expert} asked of {experts}"),
            ));
        }
        let cols = half_cols * 2;
        check_cols(name, cols)?;
        let scale_name = format!("{name}_weight_scale");
        let scales = checkpoint.tensor(&scale_name)?;
        scales.expect_dtype(&[Dtype::F8_E4M3])?;
        scales.expect_shape(&[experts, rows, cols / BLOCK])?;
        let per_expert = |tensor_name: &str| -> Result<f32> {
            let t = checkpoint.tensor(tensor_name)?;
            t.expect_dtype(&[Dtype::F32])?;
            let values: Vec<f32> = t.to_f32()?;
            let value = match values.len() {
                1 => values[0],
                n if n == experts => values[expert],
                _ => {
                    return Err(Error::Shape {
                        tensor: tensor_name.to_string(),
                        file: t.file.to_path_buf(),
                        expected: format!("[{experts}] or a scalar"),
                        found: t.shape.to_vec(),
                    });
                }
            };
            checked_global(tensor_name, value)
        };
        let global_scale = per_expert(&format!("{name}_weight_scale_2"))?;
        let input_name = format!("{name}_input_scale");
        let input_scale = if checkpoint.contains(&input_name) {
            Some(per_expert(&input_name)?)
        } else {
            None
        };
        let (code_len, scale_len) = (rows * half_cols, rows * cols / BLOCK);
        let codes = &weight.data[expert * code_len..(expert + 1) * code_len];
        let block_scales = &scales.data[expert * scale_len..(expert + 1) * scale_len];
        if let Some(i) = block_scales.iter().position(|b| b & 0x7f == 0x7f) {
            return Err(Error::invalid(
                format!("tensor `{scale_name}` in {}", scales.file.display()),
                format!(
                    "block scale [{expert}, {}, {}] is NaN",
                    i / (cols / BLOCK),
                    i % (cols / BLOCK)
                ),
            ));
        }
        Ok(Self {
            rows,
            cols,
            packed: codes.to_vec(),
            scales: block_scales.to_vec(),
            global_scale,
            input_scale,
        })
    }

    fn load_parts(
        checkpoint: &Checkpoint,
        weight_name: &str,
        scale_name: &str,
        global_scale: f32,
        input_scale: Option<f32>,
    ) -> Result<Self> {
        let weight = checkpoint.tensor(weight_name)?;
        weight.expect_dtype(&[Dtype::U8])?;
        let [rows, half_cols] = weight.expect_rank::<2>()?;
        let cols = half_cols * 2;
        check_cols(weight_name, cols)?;
        let scales = checkpoint.tensor(scale_name)?;
        scales.expect_dtype(&[Dtype::F8_E4M3])?;
        scales.expect_shape(&[rows, cols / BLOCK])?;
        if let Some(i) = scales.data.iter().position(|b| b & 0x7f == 0x7f) {
            return Err(Error::invalid(
                format!("tensor `{scale_name}` in {}", scales.file.display()),
                format!(
                    "block scale [{}, {}] is NaN (0x{:02x})",
                    i / (cols / BLOCK),
                    i % (cols / BLOCK),
                    scales.data[i]
                ),
            ));
        }
        Ok(Self {
            rows,
            cols,
            packed: weight.data.to_vec(),
            scales: scales.data.to_vec(),
            global_scale,
            input_scale,
        })
    }
}

/// Shape and finiteness checks shared by the quantisers.
fn check_values(name: &str, values: &[f32], rows: usize, cols: usize) -> Result<()> {
    check_cols(name, cols)?;
    if values.len() != rows * cols {
        return Err(Error::invalid(
            name,
            format!("{} values for a [{rows}, {cols}] matrix", values.len()),
        ));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::invalid(
            name,
            format!(
                "element [{}, {}] is {}; NVFP4 cannot hold it",
                i / cols,
                i % cols,
                values[i]
            ),
        ));
    }
    Ok(())
}

fn check_cols(name: &str, cols: usize) -> Result<()> {
    if cols % BLOCK != 0 || cols == 0 {
        return Err(Error::invalid(
            name,
            format!("K = {cols} is not a positive multiple of the NVFP4 block size {BLOCK}"),
        ));
    }
    Ok(())
}

fn checked_global(name: &str, value: f32) -> Result<f32> {
    if !value.is_finite() || value <= 0.0 {
        return Err(Error::invalid(
            name,
            format!("global scale {value} is not a positive finite number"),
        ));
    }
    Ok(value)
}
