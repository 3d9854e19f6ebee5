//! Weight layouts the tensor-core GEMM kernels consume (`gemm_*_mma_*` on mma.sync, `gemm_*_wmma_*`
//! on WMMA: [`TensorCore`] picks by the target), made once at load time.
//!
//! Tiles are 16 weight rows. Inside each 64-wide K group lane `(g, t) = (lane / 4, lane % 4)` of
//! the warp owns tile rows `g` and `g + 8` at K columns `64 * group + [16t, 16t + 16)`: one NVFP4
//! block per row. MMA `j` of the group consumes the four columns `16t + 4j .. 16t + 4j + 3` of
//! both rows, in the register order of `mma.m16n8k16`'s A fragment: registers 0/2 hold row `g`
//! (columns `4j, 4j+1` / `4j+2, 4j+3`), registers 1/3 row `g + 8`. X is read with the same K
//! permutation, so each lane's X for a group is one contiguous 32-byte run.
//!
//! - NVFP4: per (tile, group, lane) one `u32` word per MMA, the 4-bit codes of its 8 values with
//!   their bits spread so that the kernel gets register `r`'s bf16 pair with few instructions (see
//!   [`code_bits`]: registers 0, 1, 2 are one mask of the word rotated by 0, 4 and 10 bits, register
//!   3 takes two rotations), and one `u16` with the two rows' block scales, re-encoded as unsigned
//!   e5m3 (exponent offset 10, no subnormals): exact for every non-zero e4m3 scale. A zero scale
//!   zeroes its block's nibbles and a negative one flips their signs, so the kernel never sees
//!   either.
//! - BF16: per (tile, group, MMA, lane) four `u32` registers of two bf16 each: a group is four
//!   runs of 32 lanes x 16 bytes, so each of a warp's four loads reads 512 contiguous bytes (with
//!   the lane's 64 bytes together, each load used half of every 32-byte sector it fetched and the
//!   L2 served every sector twice).
//!
//! [`RowOrder::GateUp`] stores a `[gate; up]` weight (rows `0..I` gate, `I..2I` up) so tile
//! rows 0..7 are gate rows `8 * tile ..` and 8..15 the matching up rows: the lane holding gate
//! row `i` also holds up row `i`, which is what the fused `silu(gate) * up` epilogue needs.
//! Rows past the end (padding to a whole tile) and columns past K are zero.

use crate::error::{Error, Result};
use crate::formats::nvfp4::{BLOCK, E4M3_ONE, Nvfp4Matrix, e2m1_decode, e4m3_decode};
use crate::target::TargetFacts;
use half::bf16;

/// The bf16 tensor-core instruction of a target, which decides the weight layout and the
/// kernels of the `gemm` and `moe` families; chosen from the target's `instructions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorCore {
    /// `mma.sync.m16n8k16` (NVIDIA): [`Nvfp4Fragments`] / [`Bf16Fragments`], kernels `*_mma_*`.
    MmaSync,
    /// `v_wmma_f32_16x16x16_bf16` (AMD RDNA 3.5): [`WmmaNvfp4Fragments`] /
    /// [`WmmaBf16Fragments`], kernels `*_wmma_*`.
    Wmma,
}

impl TensorCore {
    /// The instruction `target`'s tensor-core kernels are written for: mma.sync where the target
    /// has it, else WMMA.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the target when it has neither (no tensor-core kernels).
    pub fn for_target(target: &TargetFacts) -> Result<Self> {
        if target.instructions.mma_sync_bf16 {
            Ok(Self::MmaSync)
        } else if target.instructions.wmma_bf16 {
            Ok(Self::Wmma)
        } else {
            Err(Error::invalid(
                format!("target {}", target.name),
                "has neither mma.sync nor WMMA bf16 (kernels/targets.toml instructions): the gemm \
                 and moe families have no tensor-core kernels for it",
            ))
        }
    }
}

/// Weight rows per tile (the MMA's M dimension).
pub const TILE_ROWS: usize = 16;
/// K columns per group (four MMAs of 16).
pub const GROUP_COLS: usize = 64;
const LANES: usize = 32;

/// How weight rows map onto tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Tile `i` holds rows `16i .. 16i + 15`.
    Plain,
    /// A `[gate; up]` weight of `2I` rows: tile `i` holds gate rows `8i .. 8i + 7` then up rows
    /// `I + 8i .. I + 8i + 7`.
    GateUp,
}

impl RowOrder {
    /// Tiles needed for `rows` weight rows.
    pub fn tiles(self, rows: usize) -> usize {
        match self {
            RowOrder::Plain => rows.div_ceil(TILE_ROWS),
            RowOrder::GateUp => (rows / 2).div_ceil(TILE_ROWS / 2),
        }
    }

    /// The weight row at `tile_row` (0..16) of `tile`, or `None` for padding.
    pub fn source_row(self, rows: usize, tile: usize, tile_row: usize) -> Option<usize> {
        let row = match self {
            RowOrder::Plain => tile * TILE_ROWS + tile_row,
            RowOrder::GateUp => {
                let half = rows / 2;
                let i = tile * 8 + tile_row % 8;
                if i >= half {
                    return None;
                }
                if tile_row < 8 { i } else { half + i }
            }
        };
        (row < rows).then_some(row)
    }

    /// The (tile, tile row) holding weight row `row`: the inverse of [`RowOrder::source_row`].
    pub fn locate(self, rows: usize, row: usize) -> (usize, usize) {
        match self {
            RowOrder::Plain => (row / TILE_ROWS, row % TILE_ROWS),
            RowOrder::GateUp => {
                let half = rows / 2;
                let (i, upper) = if row < half {
                    (row, 0)
                } else {
                    (row - half, 8)
                };
                (i / 8, i % 8 + upper)
            }
        }
    }

    fn check(self, what: &str, rows: usize) -> Result<()> {
        if self == RowOrder::GateUp && rows % 2 != 0 {
            return Err(Error::invalid(
                what,
                format!("a [gate; up] weight needs an even row count, has {rows}"),
            ));
        }
        Ok(())
    }
}

/// Which 16-row tiles and 64-wide K groups cover a `[rows, cols]` weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileGrid {
    /// Weight rows (N).
    pub rows: usize,
    /// K.
    pub cols: usize,
    /// Row-to-tile mapping.
    pub row_order: RowOrder,
    /// 16-row tiles.
    pub n_tiles: usize,
    /// 64-wide K groups (the last one padded with zeros).
    pub k_groups: usize,
}

impl TileGrid {
    /// The grid of a `[rows, cols]` weight.
    ///
    /// # Errors
    /// [`Error::Invalid`] (naming `what`) for a `[gate; up]` order with an odd row count.
    pub fn new(what: &str, rows: usize, cols: usize, row_order: RowOrder) -> Result<Self> {
        row_order.check(what, rows)?;
        Ok(Self {
            rows,
            cols,
            row_order,
            n_tiles: row_order.tiles(rows),
            k_groups: cols.div_ceil(GROUP_COLS),
        })
    }

    /// The grid of a row-major bf16 weight, after checking `values` against the shape.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `values` has the wrong length, K is not a positive multiple of
    /// 16, or a `[gate; up]` order has an odd row count.
    pub fn for_bf16(
        values: &[bf16],
        rows: usize,
        cols: usize,
        row_order: RowOrder,
    ) -> Result<Self> {
        if values.len() != rows * cols || cols == 0 || cols % BLOCK != 0 {
            return Err(Error::invalid(
                "bf16 weight",
                format!(
                    "{} values for [{rows}, {cols}] (K must be a positive multiple of 16)",
                    values.len()
                ),
            ));
        }
        Self::new("bf16 weight", rows, cols, row_order)
    }

    /// Index of (tile, group, lane) in the `[n_tiles][k_groups][32]` order every layout uses.
    pub fn lane_index(&self, tile: usize, group: usize, lane: usize) -> usize {
        (tile * self.k_groups + group) * LANES + lane
    }
}

/// Where the bits of an E2M1 code (mantissa, low exponent, high exponent, sign) sit in MMA word
/// `j` for the element at (`upper` = row g + 8, column `c` of the lane's 16-column block).
///
/// Columns 4j, 4j + 1 go to A register 0 (row g) or 1 (row g + 8), 4j + 2, 4j + 3 to 2 or 3; a
/// register's even column is its low bf16, the odd one its high bf16 (16 bits up). The kernel
/// makes bf16 of `e2m1 * 2^-126` by placing a code's sign at bit 15 and its other three bits at
/// 8..6 (the exponent's two low bits and the mantissa's top bit, `common/mma.cuh`), so register
/// `r` is the word rotated left under one mask: register 0 not rotated, 1 by 4 bits, 2 by 10. No
/// fourth rotation of that pattern fits the 8 bits left over, so register 3 takes its mantissas
/// from the word rotated by 6 and its signs and exponents from it rotated by 14: 9 instructions
/// per word, where shifts within 16-bit halves took 11 (register 3 then needed three; the NVFP4
/// decode is most of the MoE and GEMM kernels' inner-loop instructions).
pub fn code_bits(upper: bool, c: usize) -> [u32; 4] {
    const TARGET: [u32; 4] = [6, 7, 8, 15];
    const ROTATION: [u32; 4] = [0, 4, 10, 6];
    const REGISTER_3_REST_ROTATION: u32 = 14;
    let register = 2 * ((c % 4) / 2) + usize::from(upper);
    let half = 16 * (c % 2) as u32;
    TARGET.map(|bit| {
        let rotation = if register == 3 && bit != 6 {
            REGISTER_3_REST_ROTATION
        } else {
            ROTATION[register]
        };
        (bit + half + 32 - rotation) % 32
    })
}

/// `code`'s 4 bits placed in a word at `bits` (see [`code_bits`]).
fn place_code(code: u8, bits: [u32; 4]) -> u32 {
    bits.iter().enumerate().fold(0, |word, (i, &bit)| {
        word | (u32::from(code >> i) & 1) << bit
    })
}

/// The code whose bits sit in `word` at `bits` (the inverse of [`place_code`]).
fn take_code(word: u32, bits: [u32; 4]) -> u8 {
    bits.iter()
        .enumerate()
        .fold(0, |code, (i, &bit)| code | (((word >> bit) & 1) as u8) << i)
}

/// Encodes a positive e4m3 scale value exactly as unsigned e5m3 (exponent offset 10).
fn scale_to_e5m3(value: f32) -> u8 {
    let bits = value.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32 - 127; // -9 ..= 8 for e4m3 values
    let fraction = (bits >> 20) & 7;
    (((exponent + 10) as u32) << 3 | fraction) as u8
}

/// Decodes the kernel's e5m3 scale byte (the inverse of the load-time encoding).
pub fn e5m3_decode(byte: u8) -> f32 {
    let exponent = (byte >> 3) as i32 - 10;
    (1.0 + (byte & 7) as f32 / 8.0) * 2f32.powi(exponent)
}

/// An NVFP4 matrix in the tensor-core kernels' fragment order.
#[derive(Debug, Clone)]
pub struct Nvfp4Fragments {
    /// The tiles and K groups (K a multiple of 16).
    pub grid: TileGrid,
    /// `[n_tiles][k_groups][32 lanes][4 MMAs]` nibble words.
    pub words: Vec<u32>,
    /// `[n_tiles][k_groups][32 lanes]`: e5m3 scale of row g (low byte) and row g + 8.
    pub scales: Vec<u16>,
    /// The per-tensor multiplier of the source matrix.
    pub global_scale: f32,
}

impl Nvfp4Fragments {
    /// Re-lays `matrix` out for the kernels.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a `[gate; up]` order with an odd row count or a NaN block scale.
    pub fn new(matrix: &Nvfp4Matrix, row_order: RowOrder) -> Result<Self> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        let grid = TileGrid::new("NVFP4 weight", rows, cols, row_order)?;
        let (n_tiles, k_groups) = (grid.n_tiles, grid.k_groups);
        let k_blocks = cols / BLOCK;
        let mut words = vec![0u32; n_tiles * k_groups * LANES * 4];
        let mut scales = vec![0u16; n_tiles * k_groups * LANES];
        for tile in 0..n_tiles {
            for group in 0..k_groups {
                for lane in 0..LANES {
                    let (g, t) = (lane / 4, lane % 4);
                    let block = group * 4 + t;
                    let index = grid.lane_index(tile, group, lane);
                    let mut scale_pair = 0u16;
                    for upper in [false, true] {
                        let source =
                            row_order.source_row(rows, tile, g + if upper { 8 } else { 0 });
                        let (nibbles, scale) = match source {
                            Some(row) if block < k_blocks => block_for_kernel(matrix, row, block)?,
                            _ => ([0u8; BLOCK], scale_to_e5m3(1.0)),
                        };
                        scale_pair |= u16::from(scale) << if upper { 8 } else { 0 };
                        for (c, nibble) in nibbles.iter().enumerate() {
                            let word = &mut words[index * 4 + c / 4];
                            *word |= place_code(*nibble, code_bits(upper, c));
                        }
                    }
                    scales[index] = scale_pair;
                }
            }
        }
        Ok(Self {
            grid,
            words,
            scales,
            global_scale: matrix.global_scale,
        })
    }

    /// The value the kernel computes with at (`row`, `col`) of the source matrix, decoded back
    /// from the fragments: `e2m1 * (e5m3_scale * global_scale)`, in the order of
    /// [`Nvfp4View::value`](crate::formats::nvfp4::Nvfp4View::value).
    pub fn value(&self, row: usize, col: usize) -> f32 {
        let (tile, tile_row) = self.grid.row_order.locate(self.grid.rows, row);
        let (group, t, c) = (col / GROUP_COLS, (col % GROUP_COLS) / BLOCK, col % BLOCK);
        let upper = tile_row >= 8;
        let index = self.grid.lane_index(tile, group, (tile_row % 8) * 4 + t);
        let word = self.words[index * 4 + c / 4];
        let nibble = take_code(word, code_bits(upper, c));
        let scale = (self.scales[index] >> if upper { 8 } else { 0 }) as u8;
        e2m1_decode(nibble) * (e5m3_decode(scale) * self.global_scale)
    }
}

/// The 16 E2M1 codes of block `block` of `row`, in column order.
fn block_nibbles(matrix: &Nvfp4Matrix, row: usize, block: usize) -> [u8; BLOCK] {
    let start = (row * matrix.cols + block * BLOCK) / 2;
    let mut nibbles = [0u8; BLOCK];
    for (i, pair) in matrix.packed[start..start + BLOCK / 2].iter().enumerate() {
        nibbles[2 * i] = pair & 0xf;
        nibbles[2 * i + 1] = pair >> 4;
    }
    nibbles
}

/// Block `block` of `row` normalised for the kernel: nibbles and e5m3 scale, with zero scales
/// turned into zero nibbles and negative scales into flipped nibble signs.
fn block_for_kernel(matrix: &Nvfp4Matrix, row: usize, block: usize) -> Result<([u8; BLOCK], u8)> {
    let k_blocks = matrix.cols / BLOCK;
    let scale_byte = matrix.scales[row * k_blocks + block];
    let scale = e4m3_decode(scale_byte);
    if scale.is_nan() {
        return Err(Error::invalid(
            "NVFP4 weight",
            format!("block scale [{row}, {block}] is NaN"),
        ));
    }
    let mut nibbles = block_nibbles(matrix, row, block);
    if scale == 0.0 {
        return Ok(([0u8; BLOCK], scale_to_e5m3(e4m3_decode(E4M3_ONE))));
    }
    if scale < 0.0 {
        for nibble in &mut nibbles {
            *nibble ^= 8;
        }
    }
    Ok((nibbles, scale_to_e5m3(scale.abs())))
}

/// A bf16 matrix in the tensor-core kernels' fragment order.
#[derive(Debug, Clone)]
pub struct Bf16Fragments {
    /// The tiles and K groups (K a multiple of 16).
    pub grid: TileGrid,
    /// `[n_tiles][k_groups][4 MMAs][32 lanes][4 registers]`, two bf16 per register (low half =
    /// even column); [`Bf16Fragments::word_index`] finds one.
    pub words: Vec<u32>,
}

impl Bf16Fragments {
    /// Re-lays a row-major `[rows, cols]` bf16 matrix out for the kernels.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `values` has the wrong length, K is not a positive multiple of
    /// 16, or a `[gate; up]` order has an odd row count.
    pub fn new(values: &[bf16], rows: usize, cols: usize, row_order: RowOrder) -> Result<Self> {
        let grid = TileGrid::for_bf16(values, rows, cols, row_order)?;
        let (n_tiles, k_groups) = (grid.n_tiles, grid.k_groups);
        let mut words = vec![0u32; n_tiles * k_groups * LANES * 16];
        let at = |row: Option<usize>, col: usize| -> u32 {
            match row {
                Some(r) if col < cols => u32::from(values[r * cols + col].to_bits()),
                _ => 0,
            }
        };
        for tile in 0..n_tiles {
            for group in 0..k_groups {
                for lane in 0..LANES {
                    let (g, t) = (lane / 4, lane % 4);
                    let top = row_order.source_row(rows, tile, g);
                    let bottom = row_order.source_row(rows, tile, g + 8);
                    let index = grid.lane_index(tile, group, lane);
                    for j in 0..4 {
                        let col = group * GROUP_COLS + 16 * t + 4 * j;
                        let registers =
                            [(top, col), (bottom, col), (top, col + 2), (bottom, col + 2)];
                        for (r, (row, c)) in registers.into_iter().enumerate() {
                            words[Self::word_index(index, j, r)] =
                                at(row, c) | at(row, c + 1) << 16;
                        }
                    }
                }
            }
        }
        Ok(Self { grid, words })
    }

    /// Where register `register` (0..4) of MMA `mma` (0..4) of lane entry `index`
    /// ([`TileGrid::lane_index`]) is in [`Bf16Fragments::words`].
    pub fn word_index(index: usize, mma: usize, register: usize) -> usize {
        ((index / LANES * 4 + mma) * LANES + index % LANES) * 4 + register
    }
}

/// An NVFP4 matrix in the order of the W4A4 kernels (`gemm_nvfp4_nvfp4_mma_*`, block-scaled FP4
/// MMA m16n8k64): per (tile, 64-wide group, lane `(g, t)`) one `u32x4` of e2m1 codes: rows `g`
/// and `g + 8` at K `8t .. 8t + 7`, then both at `32 + 8t ..`, each register the source's own
/// packed bytes (element i at bits 4i); per (tile, group, tile row) one `u32` of the row's four
/// ue4m3 block scales of the group. Negative scales become positive with the block's nibble signs
/// flipped (ue4m3 has no sign); K must be a multiple of 64.
#[derive(Debug, Clone)]
pub struct W4a4Fragments {
    /// The tiles and K groups (K a multiple of 64).
    pub grid: TileGrid,
    /// `[n_tiles][k_groups][32 lanes][4 registers]`.
    pub words: Vec<u32>,
    /// `[n_tiles][k_groups][16 tile rows]`, four ue4m3 bytes each (byte i = block i of the group).
    pub scales: Vec<u32>,
    /// The per-tensor weight scale (`weight_scale_2`).
    pub global_scale: f32,
}

impl W4a4Fragments {
    /// Re-lays `matrix` out for the W4A4 kernels.
    ///
    /// # Errors
    /// [`Error::Invalid`] when K is not a multiple of 64, for a NaN block scale, or a
    /// `[gate; up]` order with an odd row count.
    pub fn new(matrix: &Nvfp4Matrix, row_order: RowOrder) -> Result<Self> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        if cols % GROUP_COLS != 0 {
            return Err(Error::invalid(
                "W4A4 weight",
                format!("K = {cols} is not a multiple of {GROUP_COLS} (one block-scaled FP4 MMA)"),
            ));
        }
        let grid = TileGrid::new("W4A4 weight", rows, cols, row_order)?;
        let (n_tiles, k_groups) = (grid.n_tiles, grid.k_groups);
        let mut words = vec![0u32; n_tiles * k_groups * LANES * 4];
        let mut scales = vec![0u32; n_tiles * k_groups * TILE_ROWS];
        for tile in 0..n_tiles {
            for tile_row in 0..TILE_ROWS {
                let source = row_order.source_row(rows, tile, tile_row);
                for group in 0..k_groups {
                    let mut nibbles = [0u8; GROUP_COLS];
                    let mut scale_word = 0u32;
                    for b in 0..4 {
                        let (block_nibbles, scale) = match source {
                            Some(row) => signless_block(matrix, row, group * 4 + b)?,
                            None => ([0u8; BLOCK], E4M3_ONE),
                        };
                        nibbles[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&block_nibbles);
                        scale_word |= u32::from(scale) << (8 * b);
                    }
                    scales[(tile * k_groups + group) * TILE_ROWS + tile_row] = scale_word;
                    let (g, upper) = (tile_row % 8, tile_row >= 8);
                    for t in 0..4 {
                        let lane = g * 4 + t;
                        let index = grid.lane_index(tile, group, lane);
                        for half in 0..2 {
                            let start = 32 * half + 8 * t;
                            let word = (0..8)
                                .fold(0u32, |w, i| w | u32::from(nibbles[start + i]) << (4 * i));
                            words[index * 4 + 2 * half + usize::from(upper)] = word;
                        }
                    }
                }
            }
        }
        Ok(Self {
            grid,
            words,
            scales,
            global_scale: matrix.global_scale,
        })
    }
}

/// Block `block` of `row` with a non-negative scale: a negative e4m3 scale is made positive and
/// the block's nibble signs flipped (the value is unchanged).
fn signless_block(matrix: &Nvfp4Matrix, row: usize, block: usize) -> Result<([u8; BLOCK], u8)> {
    let k_blocks = matrix.cols / BLOCK;
    let scale = matrix.scales[row * k_blocks + block];
    if scale & 0x7f == 0x7f {
        return Err(Error::invalid(
            "W4A4 weight",
            format!("block scale [{row}, {block}] is NaN"),
        ));
    }
    let mut nibbles = block_nibbles(matrix, row, block);
    if scale & 0x80 != 0 {
        for nibble in &mut nibbles {
            *nibble ^= 8;
        }
    }
    Ok((nibbles, scale & 0x7f))
}

/// An NVFP4 matrix in the order of the gfx1151 WMMA kernels (`gemm_nvfp4_bf16_wmma_*`): per
/// (tile, 64-wide K group, tile row) the row's 32 bytes of nibbles for the group in the source's
/// packed order, and one `u32` of its four e4m3 block scales (byte i = block i), unchanged (the
/// kernel decodes them in f32, sign and zero included). Padding rows and columns are zero; a NaN
/// block scale is refused (as [`Nvfp4Fragments`] does).
#[derive(Debug, Clone)]
pub struct WmmaNvfp4Fragments {
    /// The tiles and K groups (K a multiple of 16).
    pub grid: TileGrid,
    /// `[n_tiles][k_groups][16 rows][8]`: 64 nibbles, element 2i in the low nibble of byte i.
    pub words: Vec<u32>,
    /// `[n_tiles][k_groups][16 rows]`: four e4m3 block scales.
    pub scales: Vec<u32>,
    /// The per-tensor multiplier (the kernels' alpha).
    pub global_scale: f32,
}

impl WmmaNvfp4Fragments {
    /// Re-lays `matrix` out for the WMMA kernels.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a `[gate; up]` order with an odd row count or a NaN block scale.
    pub fn new(matrix: &Nvfp4Matrix, row_order: RowOrder) -> Result<Self> {
        let grid = TileGrid::new("NVFP4 weight", matrix.rows, matrix.cols, row_order)?;
        let rows_total = grid.n_tiles * grid.k_groups * TILE_ROWS;
        let (mut words, mut scales) = (vec![0u32; rows_total * 8], vec![0u32; rows_total]);
        let (row_bytes, k_blocks) = (matrix.cols / 2, matrix.cols / BLOCK);
        for tile in 0..grid.n_tiles {
            for tile_row in 0..TILE_ROWS {
                let Some(row) = row_order.source_row(matrix.rows, tile, tile_row) else {
                    continue;
                };
                for group in 0..grid.k_groups {
                    let index = (tile * grid.k_groups + group) * TILE_ROWS + tile_row;
                    for block in (group * 4..group * 4 + 4).filter(|b| *b < k_blocks) {
                        let bytes = &matrix.packed
                            [row * row_bytes + block * 8..row * row_bytes + block * 8 + 8];
                        let j = block - group * 4;
                        let scale = matrix.scales[row * k_blocks + block];
                        if scale & 0x7f == 0x7f {
                            return Err(Error::invalid(
                                "NVFP4 weight",
                                format!("block scale [{row}, {block}] is NaN"),
                            ));
                        }
                        words[index * 8 + 2 * j] =
                            u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                        words[index * 8 + 2 * j + 1] =
                            u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
                        scales[index] |= u32::from(scale) << (8 * j);
                    }
                }
            }
        }
        Ok(Self {
            grid,
            words,
            scales,
            global_scale: matrix.global_scale,
        })
    }

    /// The value the kernel computes with at (`row`, `col`) of the source matrix:
    /// `e2m1 * (e4m3_scale * global_scale)`.
    pub fn value(&self, row: usize, col: usize) -> f32 {
        let (tile, tile_row) = self.grid.row_order.locate(self.grid.rows, row);
        let (group, c) = (col / GROUP_COLS, col % GROUP_COLS);
        let index = (tile * self.grid.k_groups + group) * TILE_ROWS + tile_row;
        let nibble = ((self.words[index * 8 + c / 8] >> (4 * (c % 8))) & 0xf) as u8;
        let scale = (self.scales[index] >> (8 * (c / BLOCK))) as u8;
        e2m1_decode(nibble) * (e4m3_decode(scale) * self.global_scale)
    }
}

/// A bf16 matrix in the order of the gfx1151 WMMA kernels (`gemm_bf16_bf16_wmma_*`): per (tile,
/// 64-wide K group, tile row) the row's 64 values, zero past the end.
#[derive(Debug, Clone)]
pub struct WmmaBf16Fragments {
    /// The tiles and K groups (K a multiple of 16).
    pub grid: TileGrid,
    /// `[n_tiles][k_groups][16 rows][64]` raw bf16 bits.
    pub values: Vec<u16>,
}

impl WmmaBf16Fragments {
    /// Re-lays a row-major `[rows, cols]` bf16 matrix out for the WMMA kernels.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `values` has the wrong length, K is not a positive multiple of
    /// 16, or a `[gate; up]` order has an odd row count.
    pub fn new(values: &[bf16], rows: usize, cols: usize, row_order: RowOrder) -> Result<Self> {
        let grid = TileGrid::for_bf16(values, rows, cols, row_order)?;
        let mut out = vec![0u16; grid.n_tiles * grid.k_groups * TILE_ROWS * GROUP_COLS];
        for tile in 0..grid.n_tiles {
            for tile_row in 0..TILE_ROWS {
                let Some(row) = row_order.source_row(rows, tile, tile_row) else {
                    continue;
                };
                for group in 0..grid.k_groups {
                    let start = (tile * grid.k_groups + group) * TILE_ROWS + tile_row;
                    let width = GROUP_COLS.min(cols - group * GROUP_COLS);
                    let source = &values[row * cols + group * GROUP_COLS..][..width];
                    for (slot, v) in out[start * GROUP_COLS..][..width].iter_mut().zip(source) {
                        *slot = v.to_bits();
                    }
                }
            }
        }
        Ok(Self { grid, values: out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 8 codes of each MMA word fill its 32 bits exactly once, and a code survives the trip.
    #[test]
    fn codes_fill_each_word_once() {
        for word in 0..4 {
            let mut used = 0u64;
            for upper in [false, true] {
                for c in 4 * word..4 * word + 4 {
                    let bits = code_bits(upper, c);
                    for bit in bits {
                        assert!(bit < 32 && used & (1 << bit) == 0, "bit {bit} twice");
                        used |= 1 << bit;
                    }
                    for code in 0..16u8 {
                        assert_eq!(take_code(place_code(code, bits), bits), code);
                    }
                }
            }
            assert_eq!(used, 0xffff_ffff);
        }
    }
}
