//! MXFP8 (E4M3, E8M0) quantisation of a row-major `[rows, cols]` run of a matrix into one of
//! the plan's band planes, and dequantisation back — the layout the runtime stores and gathers
//! (`sshsdp_plan::Bucket`), bit-identical to `sshsdp_mx::encode_rows` / `encode_cols` /
//! `decode_rows` / `decode_cols` (NaN bits included, as an x86 CPU produces them).
//!
//! Both planes are a sequence of blocks of 32 values, block `g` holding data bytes
//! `32g..32g + 32` and scale byte `g`: the row-wise plane's block `(r, cb)` is
//! `g = r · cols_p/32 + cb` (values `(r, 32cb + j)`), the column-wise plane's block `(c, rb)` is
//! `g = c · rows_p/32 + rb` (values `(32rb + j, c)`). The data and the scales each start at a
//! word offset of the output buffer.
//!
//! Quantisation runs one unit per scale *word* — four consecutive blocks — so no two units
//! write the same word (scales are single bytes, packed four to a word): the unit finds each
//! block's largest magnitude, its scale, and encodes its 8 data words. Dequantisation runs one
//! unit per output value. These are the straightforward forms; tiled variants that stage
//! coalesced loads in shared memory are the device issue's.

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::{MxShape, Plane, ScaleRule};

use crate::common::{grid, load_bits, InputDType};
use crate::e4m3::{byte_of, decode_byte, encode_word, scale_byte};
use crate::error::{check_size, checked_shape, to_u32, KernelError};

/// Where a plane's values come from or go to, and where the plane sits in its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlaneAt {
    /// Which plane.
    pub plane: Plane,
    /// Rows of the run (a band run: any count; the last band may be short).
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Element offset of the run's first value in the values buffer (row-major).
    pub values_offset: usize,
    /// Word offset of the plane's data in the plane buffer.
    pub data_word: usize,
    /// Word offset of the plane's scales in the plane buffer.
    pub scales_word: usize,
}

impl PlaneAt {
    /// Blocks of the plane, and blocks per row (row plane) or per column (column plane).
    fn blocks(&self) -> (usize, usize) {
        let shape = MxShape::new(self.rows, self.cols);
        match self.plane {
            Plane::Row => (self.rows * shape.cols_p() / 32, shape.cols_p() / 32),
            Plane::Col => (self.cols * shape.rows_p() / 32, shape.rows_p() / 32),
        }
    }

    /// Words of the data and of the scales (the scales' last word zero-padded).
    pub fn words(&self) -> (usize, usize) {
        let (blocks, _) = self.blocks();
        (blocks * 8, blocks.div_ceil(4))
    }
}

/// `f32` bits of the value at position `pos` along `line` (a row of the row plane, a column
/// of the column plane); zero past the end of the run (the plane's padding).
#[cube]
#[allow(clippy::too_many_arguments)]
fn value(
    input: &Array<u32>,
    rows: u32,
    cols: u32,
    line: u32,
    pos: u32,
    values_offset: u32,
    #[comptime] col_plane: bool,
    #[comptime] bf16: bool,
) -> u32 {
    let mut v = 0u32;
    if col_plane {
        if pos < rows {
            v = load_bits(input, values_offset + pos * cols + line, bf16);
        }
    } else if pos < cols {
        v = load_bits(input, values_offset + line * cols + pos, bf16);
    }
    v
}

/// Quantise kernel: scale words `i, i + stride, ...` of `scale_words`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_plane_kernel(
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    blocks: u32,
    per_line: u32,
    values_offset: u32,
    data_word: u32,
    scales_word: u32,
    #[comptime] col_plane: bool,
    #[comptime] rceil: bool,
    #[comptime] bf16: bool,
) {
    let scale_words = blocks.div_ceil(4);
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while w < scale_words {
        let mut packed = 0u32;
        for k in 0..4u32 {
            let g = w * 4 + k;
            if g < blocks {
                // the block's line (row or column) and its first position along the block
                let line = g / per_line;
                let first = (g % per_line) * 32;
                let mut amax = 0u32;
                for j in 0..32u32 {
                    let v = value(
                        input,
                        rows,
                        cols,
                        line,
                        first + j,
                        values_offset,
                        col_plane,
                        bf16,
                    );
                    amax = max(amax, v & 0x7FFF_FFFF);
                }
                let s = scale_byte(amax, rceil);
                packed |= s << (k * 8);
                for q in 0..8u32 {
                    let p = first + q * 4;
                    let v0 = value(input, rows, cols, line, p, values_offset, col_plane, bf16);
                    let v1 = value(
                        input,
                        rows,
                        cols,
                        line,
                        p + 1,
                        values_offset,
                        col_plane,
                        bf16,
                    );
                    let v2 = value(
                        input,
                        rows,
                        cols,
                        line,
                        p + 2,
                        values_offset,
                        col_plane,
                        bf16,
                    );
                    let v3 = value(
                        input,
                        rows,
                        cols,
                        line,
                        p + 3,
                        values_offset,
                        col_plane,
                        bf16,
                    );
                    out[(data_word + g * 8 + q) as usize] = encode_word(v0, v1, v2, v3, s);
                }
            }
        }
        out[(scales_word + w) as usize] = packed;
        w += stride;
    }
}

/// Dequantise kernel: output values `i, i + stride, ...` of `rows * cols`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequantize_plane_kernel(
    src: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    per_line: u32,
    values_offset: u32,
    data_word: u32,
    scales_word: u32,
    #[comptime] col_plane: bool,
) {
    let n = rows * cols;
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < n {
        let r = i / cols;
        let c = i % cols;
        let mut g = r * per_line + c / 32;
        let mut pos = c % 32;
        if col_plane {
            g = c * per_line + r / 32;
            pos = r % 32;
        }
        // Word arithmetic: a byte offset `g * 32 + pos` would overflow u32 for planes of 4 GiB
        // or more, while their word offsets (checked to fit u32 at launch) do not.
        let b = byte_of(src[(data_word + g * 8 + pos / 4) as usize], pos % 4);
        let s = byte_of(src[(scales_word + g / 4) as usize], g % 4);
        out[(values_offset + i) as usize] = decode_byte(b, s);
        i += stride;
    }
}

/// Checks the shape and the plane's place; returns `(blocks, per_line, data + scale words)`.
fn check_plane(at: &PlaneAt, buffer: &Handle, what: &'static str) -> Result<(), KernelError> {
    let (data, scales) = at.words();
    let end = (at.data_word + data).max(at.scales_word + scales);
    check_size(what, buffer, end as u64 * 4)?;
    to_u32("plane words", end as u64)?;
    let data_end = at.data_word + data;
    let scales_end = at.scales_word + scales;
    if at.data_word < scales_end && at.scales_word < data_end {
        return Err(KernelError::Shape(format!(
            "the plane's data (words {}..{data_end}) and scales (words {}..{scales_end}) overlap",
            at.data_word, at.scales_word
        )));
    }
    Ok(())
}

/// Quantises the `[rows, cols]` run at `at.values_offset` of `input` (`f32` or `bf16`) into
/// `at.plane` with scale rule `rule`, writing the data at word `at.data_word` and the scales
/// at word `at.scales_word` of `out` (the last scale word zero-padded; other words untouched).
/// Output bits equal `sshsdp_mx::encode_rows` / `encode_cols`.
pub fn quantize_plane<R: Runtime>(
    client: &ComputeClient<R>,
    input: &Handle,
    dtype: InputDType,
    rule: ScaleRule,
    at: PlaneAt,
    out: &Handle,
) -> Result<(), KernelError> {
    let Some(shape) = checked_shape(at.rows, at.cols)? else {
        return Ok(());
    };
    let elem_bytes = match dtype {
        InputDType::F32 => 4,
        InputDType::Bf16 => 2,
    };
    check_size(
        "input",
        input,
        ((at.values_offset + shape.len()) * elem_bytes) as u64,
    )?;
    to_u32(
        "values_offset + rows * cols",
        (at.values_offset + shape.len()) as u64,
    )?;
    check_plane(&at, out, "out")?;
    let (blocks, per_line) = at.blocks();
    let (count, dim) = grid(blocks.div_ceil(4));
    // SAFETY: lengths are the handles' sizes in words (a bf16 input's last word may be half
    // used); every index the kernel forms is below the checked input and plane extents.
    unsafe {
        quantize_plane_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(input.clone(), (input.size_in_used() as usize).div_ceil(4)),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            at.rows as u32,
            at.cols as u32,
            blocks as u32,
            per_line as u32,
            at.values_offset as u32,
            at.data_word as u32,
            at.scales_word as u32,
            at.plane == Plane::Col,
            rule == ScaleRule::Rceil,
            dtype == InputDType::Bf16,
        );
    }
    Ok(())
}

/// Decodes `at.plane` stored in `src` (data at word `at.data_word`, scales at word
/// `at.scales_word`) into the row-major `f32` values of `out` from element `at.values_offset`
/// on (`rows * cols` values; other values untouched). Output bits equal
/// `sshsdp_mx::decode_rows` / `decode_cols`.
pub fn dequantize_plane<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    at: PlaneAt,
    out: &Handle,
) -> Result<(), KernelError> {
    let Some(shape) = checked_shape(at.rows, at.cols)? else {
        return Ok(());
    };
    check_plane(&at, src, "src")?;
    check_size("out", out, ((at.values_offset + shape.len()) * 4) as u64)?;
    to_u32(
        "values_offset + rows * cols",
        (at.values_offset + shape.len()) as u64,
    )?;
    let (_, per_line) = at.blocks();
    let (count, dim) = grid(shape.len());
    // SAFETY: lengths are the handles' sizes in words; indices stay below the checked plane
    // and output extents.
    unsafe {
        dequantize_plane_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(src.clone(), src.size_in_used() as usize / 4),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            at.rows as u32,
            at.cols as u32,
            per_line as u32,
            at.values_offset as u32,
            at.data_word as u32,
            at.scales_word as u32,
            at.plane == Plane::Col,
        );
    }
    Ok(())
}
