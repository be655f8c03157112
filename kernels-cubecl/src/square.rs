//! Square-block MXFP8 (one E8M0 scale per 32×32 tile, E4M3 elements) of a rectangle of a
//! row-major matrix, and its decode — the runtime layout of MXFP8 weights
//! (`sshsdp_plan::TileGrid`), bit-identical to `sshsdp_mx::encode_square` / `decode_square`
//! (NaN bits included, as an x86 CPU produces them).
//!
//! A rectangle of `rows × cols` values is read from (or written to) an `f32` buffer at
//! `values_offset` with row stride `values_stride`, so a piece's rectangle is encoded from its
//! contiguous master and decoded straight into its place of the whole matrix. Its data is
//! `rows · cols` bytes row-major from word `data_word`, its scales one byte per tile (tiles
//! row-major) from word `scales_word`.
//!
//! Quantisation is two launches on the client's stream: one cube of 32 × 8 units per scale
//! *word* (four tiles: amax over each tile, read in rows of 32 consecutive values and reduced in
//! shared memory; its scale bytes), then one unit per data word (four elements,
//! each encoded with its own tile's scale read back from the buffer: with `cols` not a multiple
//! of 4 a word spans rows and tiles). Dequantisation runs one unit per value.

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::ScaleRule;

use crate::common::{grid, load_bits, tile_grid, InputDType};
use crate::e4m3::{
    byte_of, decode_byte, encode_e4m3, encode_e4m3_fast, scale_byte, FAST_MIN_SCALE, SCALE_NAN,
};
use crate::error::{check_size, checked_shape, to_u32, KernelError};

/// Where a rectangle's values are and where its square-block bytes sit in their buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SquareAt {
    /// Rows of the rectangle.
    pub rows: usize,
    /// Columns of the rectangle.
    pub cols: usize,
    /// Element offset of its first value in the values buffer.
    pub values_offset: usize,
    /// Elements between the starts of consecutive rows in the values buffer (`>= cols`).
    pub values_stride: usize,
    /// Word offset of its data (`rows · cols` bytes) in the byte buffer.
    pub data_word: usize,
    /// Word offset of its scales (one byte per tile) in the byte buffer.
    pub scales_word: usize,
}

impl SquareAt {
    /// Tile rows and tile columns.
    fn tiles(&self) -> (usize, usize) {
        (self.rows.div_ceil(32), self.cols.div_ceil(32))
    }

    /// Words of the data and of the scales (each last word zero-padded).
    pub fn words(&self) -> (usize, usize) {
        let (tr, tc) = self.tiles();
        ((self.rows * self.cols).div_ceil(4), (tr * tc).div_ceil(4))
    }

    /// One past the last value it reads or writes in the values buffer.
    fn values_end(&self) -> usize {
        self.values_offset + (self.rows - 1) * self.values_stride + self.cols
    }
}

/// Encodes the value bits `v` with scale byte `s` (NaN scale: the NaN byte), as
/// `encode_word` does for each of its four values.
#[cube]
#[allow(clippy::manual_range_contains)]
fn encode_byte(v: u32, s: u32) -> u32 {
    // E4M3_NAN
    let mut b = 0x7Fu32;
    if s >= FAST_MIN_SCALE && s < 254 {
        b = encode_e4m3_fast(v, f32::reinterpret((254 - s) << 23));
    } else if s != SCALE_NAN {
        b = encode_e4m3(v, s);
    }
    b
}

/// Scales kernel: one cube of 32 × 8 units per scale word (four tiles; words
/// `CUBE_POS, CUBE_POS + CUBE_COUNT, ...`), each written by [`square_scale_word`].
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn square_scales_kernel(
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    values_offset: u32,
    values_stride: u32,
    scales_word: u32,
    #[comptime] rceil: bool,
    #[comptime] bf16: bool,
) {
    // Four tiles' partial maxima, 256 each.
    let mut partial = SharedMemory::<u32>::new(1024usize);
    let scale_words = (rows.div_ceil(32) * cols.div_ceil(32)).div_ceil(4);
    let mut w = CUBE_POS as u32;
    let stride = CUBE_COUNT as u32;
    while w < scale_words {
        let at = SquareArgs {
            rows,
            cols,
            values_offset,
            values_stride,
            data_word: 0u32,
            scales_word,
        };
        square_scale_word(input, out, &mut partial, at, w, rceil, bf16);
        w += stride;
    }
}

/// A rectangle's place as the kernels read it ([`SquareAt`] in 32-bit words and elements).
#[derive(CubeType, Clone, Copy)]
pub(crate) struct SquareArgs {
    /// Rows of the rectangle.
    pub rows: u32,
    /// Columns of the rectangle.
    pub cols: u32,
    /// Element offset of its first value.
    pub values_offset: u32,
    /// Elements between the starts of consecutive rows.
    pub values_stride: u32,
    /// Word offset of its data.
    pub data_word: u32,
    /// Word offset of its scales.
    pub scales_word: u32,
}

/// Scale word `w` of the rectangle `at` (its tiles `4w..4w + 4`), by the whole cube of 32 × 8
/// units: unit (x, y) reads column x of each tile on rows y, y + 8, y + 16 and y + 24, so each
/// row of units reads 32 consecutive values; the cube then reduces each tile's 256 partial
/// maxima in `partial` (1024 words of shared memory), and one unit writes the word.
#[cube]
pub(crate) fn square_scale_word(
    input: &Array<u32>,
    out: &mut Array<u32>,
    partial: &mut SharedMemory<u32>,
    at: SquareArgs,
    w: u32,
    #[comptime] rceil: bool,
    #[comptime] bf16: bool,
) {
    let x = UNIT_POS_X;
    let y = UNIT_POS_Y;
    let u = UNIT_POS;
    let tile_cols = at.cols.div_ceil(32);
    let tiles = at.rows.div_ceil(32) * tile_cols;
    for k in 0..4u32 {
        let t = w * 4 + k;
        let mut amax = 0u32;
        if t < tiles {
            let r0 = (t / tile_cols) * 32;
            let c = (t % tile_cols) * 32 + x;
            if c < at.cols {
                for i in 0..4u32 {
                    let r = r0 + y + 8 * i;
                    if r < at.rows {
                        let v = load_bits(input, at.values_offset + r * at.values_stride + c, bf16);
                        amax = max(amax, v & 0x7FFF_FFFF);
                    }
                }
            }
        }
        partial[(k * 256 + u) as usize] = amax;
    }
    sync_cube();
    let mut half = 128u32;
    while half > 0 {
        if u < half {
            for k in 0..4u32 {
                let a = partial[(k * 256 + u) as usize];
                let b = partial[(k * 256 + u + half) as usize];
                partial[(k * 256 + u) as usize] = max(a, b);
            }
        }
        sync_cube();
        half /= 2;
    }
    if u == 0 {
        let mut packed = 0u32;
        for k in 0..4u32 {
            if w * 4 + k < tiles {
                packed |= scale_byte(partial[(k * 256) as usize], rceil) << (k * 8);
            }
        }
        out[(at.scales_word + w) as usize] = packed;
    }
    // The next word's partial maxima overwrite these only after unit 0 has read them.
    sync_cube();
}

/// Data kernel: data words `i, i + stride, ...`, each by [`square_data_word`].
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn square_data_kernel(
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    values_offset: u32,
    values_stride: u32,
    data_word: u32,
    scales_word: u32,
    #[comptime] bf16: bool,
) {
    let words = (rows * cols).div_ceil(4);
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while w < words {
        let at = SquareArgs {
            rows,
            cols,
            values_offset,
            values_stride,
            data_word,
            scales_word,
        };
        square_data_word(input, out, at, w, bf16);
        w += stride;
    }
}

/// Data word `w` of the rectangle `at`: four elements, each encoded with its own tile's scale
/// read back from `out` (with `cols` not a multiple of 4 a word spans rows and tiles).
#[cube]
pub(crate) fn square_data_word(
    input: &Array<u32>,
    out: &mut Array<u32>,
    at: SquareArgs,
    w: u32,
    #[comptime] bf16: bool,
) {
    let n = at.rows * at.cols;
    let tile_cols = at.cols.div_ceil(32);
    let mut packed = 0u32;
    for k in 0..4u32 {
        let i = w * 4 + k;
        if i < n {
            let r = i / at.cols;
            let c = i % at.cols;
            let t = (r / 32) * tile_cols + c / 32;
            let s = byte_of(out[(at.scales_word + t / 4) as usize], t % 4);
            let v = load_bits(input, at.values_offset + r * at.values_stride + c, bf16);
            packed |= encode_byte(v, s) << (k * 8);
        }
    }
    out[(at.data_word + w) as usize] = packed;
}

/// Dequantise kernel: values `i, i + stride, ...` of `rows * cols`, each by
/// [`dequantize_square_value`].
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequantize_square_kernel(
    src: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    values_offset: u32,
    values_stride: u32,
    data_word: u32,
    scales_word: u32,
) {
    let n = rows * cols;
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < n {
        let at = SquareArgs {
            rows,
            cols,
            values_offset,
            values_stride,
            data_word,
            scales_word,
        };
        dequantize_square_value(src, out, at, i);
        i += stride;
    }
}

/// Decodes value `i` (row-major) of the rectangle `at` in `src` into its place in `out`.
#[cube]
fn dequantize_square_value(src: &Array<u32>, out: &mut Array<u32>, at: SquareArgs, i: u32) {
    out[square_value_index(at, i) as usize] = square_value_bits(src, at, i);
}

/// Where value `i` (row-major) of the rectangle `at` sits in the values buffer.
#[cube]
pub(crate) fn square_value_index(at: SquareArgs, i: u32) -> u32 {
    at.values_offset + (i / at.cols) * at.values_stride + i % at.cols
}

/// The `f32` bits of value `i` (row-major) of the rectangle `at` decoded from `src`.
#[cube]
pub(crate) fn square_value_bits(src: &Array<u32>, at: SquareArgs, i: u32) -> u32 {
    let tile_cols = at.cols.div_ceil(32);
    let r = i / at.cols;
    let c = i % at.cols;
    let t = (r / 32) * tile_cols + c / 32;
    let b = byte_of(src[(at.data_word + i / 4) as usize], i % 4);
    let s = byte_of(src[(at.scales_word + t / 4) as usize], t % 4);
    decode_byte(b, s)
}

/// Checks the rectangle's place (row stride, no overlap of its data and scales, 32-bit
/// indices) and returns the bytes of the byte buffer and the values of the values buffer it
/// reaches.
pub(crate) fn check_square_extents(at: &SquareAt) -> Result<(u64, u64), KernelError> {
    if at.values_stride < at.cols {
        return Err(KernelError::Shape(format!(
            "a row stride of {} is shorter than a row of {}",
            at.values_stride, at.cols
        )));
    }
    let (data, scales) = at.words();
    let (data_end, scales_end) = (at.data_word + data, at.scales_word + scales);
    to_u32("square words", data_end.max(scales_end) as u64)?;
    if at.data_word < scales_end && at.scales_word < data_end {
        return Err(KernelError::Shape(format!(
            "the rectangle's data (words {}..{data_end}) and scales (words {}..{scales_end}) \
             overlap",
            at.data_word, at.scales_word
        )));
    }
    let end = at.values_end();
    to_u32("values_offset + extent", end as u64)?;
    Ok((data_end.max(scales_end) as u64 * 4, end as u64))
}

/// Checks the rectangle's place in the byte buffer and in the values buffer of
/// `value_bytes`-byte values ([`check_square_extents`] and the buffers' sizes).
fn check_square(
    at: &SquareAt,
    bytes: &Handle,
    bytes_what: &'static str,
    values: &Handle,
    values_what: &'static str,
    value_bytes: usize,
) -> Result<(), KernelError> {
    let (bytes_end, values_end) = check_square_extents(at)?;
    check_size(bytes_what, bytes, bytes_end)?;
    check_size(values_what, values, values_end * value_bytes as u64)
}

/// Quantises the `rows × cols` rectangle of `input` (`f32` or `bf16`) at `at.values_offset`
/// (row stride `at.values_stride`) into square-block MXFP8 with scale rule `rule`: data at word
/// `at.data_word`, scales at word `at.scales_word` of `out` (each last word zero-padded; other
/// words untouched). Output bits equal `sshsdp_mx::encode_square`.
pub fn quantize_square<R: Runtime>(
    client: &ComputeClient<R>,
    input: &Handle,
    dtype: InputDType,
    rule: ScaleRule,
    at: SquareAt,
    out: &Handle,
) -> Result<(), KernelError> {
    if checked_shape(at.rows, at.cols)?.is_none() {
        return Ok(());
    }
    let value_bytes = match dtype {
        InputDType::F32 => 4,
        InputDType::Bf16 => 2,
    };
    check_square(&at, out, "out", input, "input", value_bytes)?;
    let (data_words, scale_words) = at.words();
    let input_words = (input.size_in_used() as usize).div_ceil(4);
    let out_words = out.size_in_used() as usize / 4;
    let bf16 = dtype == InputDType::Bf16;
    let (count, dim) = tile_grid(scale_words as u32);
    // SAFETY: lengths are the handles' sizes in words (a bf16 input's last word may be half
    // used); every index the kernels form is below the checked value and byte extents.
    unsafe {
        square_scales_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(input.clone(), input_words),
            ArrayArg::from_raw_parts(out.clone(), out_words),
            at.rows as u32,
            at.cols as u32,
            at.values_offset as u32,
            at.values_stride as u32,
            at.scales_word as u32,
            rule == ScaleRule::Rceil,
            bf16,
        );
    }
    let (count, dim) = grid(data_words);
    // SAFETY: as above; the scales this launch reads were written by the one before it on the
    // same stream.
    unsafe {
        square_data_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(input.clone(), input_words),
            ArrayArg::from_raw_parts(out.clone(), out_words),
            at.rows as u32,
            at.cols as u32,
            at.values_offset as u32,
            at.values_stride as u32,
            at.data_word as u32,
            at.scales_word as u32,
            bf16,
        );
    }
    Ok(())
}

/// Decodes the square-block rectangle stored in `src` (data at word `at.data_word`, scales at
/// word `at.scales_word`) into the `f32` values of `out` at `at.values_offset` with row stride
/// `at.values_stride` (other values untouched). Output bits equal `sshsdp_mx::decode_square`.
pub fn dequantize_square<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    at: SquareAt,
    out: &Handle,
) -> Result<(), KernelError> {
    let Some(shape) = checked_shape(at.rows, at.cols)? else {
        return Ok(());
    };
    check_square(&at, src, "src", out, "out", 4)?;
    let (count, dim) = grid(shape.len());
    // SAFETY: lengths are the handles' sizes in words; indices stay below the checked byte and
    // value extents.
    unsafe {
        dequantize_square_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(src.clone(), src.size_in_used() as usize / 4),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            at.rows as u32,
            at.cols as u32,
            at.values_offset as u32,
            at.values_stride as u32,
            at.data_word as u32,
            at.scales_word as u32,
        );
    }
    Ok(())
}
