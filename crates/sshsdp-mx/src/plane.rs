//! Row-wise and column-wise planes: encode and decode of whole tensors (and the column
//! ranges the parallel encoders split on).

use crate::block::{decode_run, encode_block_spec, load, with_spec};
use crate::format::{ElemFormat, ScaleRule, Spec};
use crate::input::MxInput;
use crate::shape::{check_len, MxShape};
use crate::simd::dispatch;
use crate::tile::{encode_tile_cols, load_tile, TileF32};
use crate::{MxError, Plane, BLOCK, TILE};

/// Encodes the row-wise plane (blocks of 32 along each row, for the forward GEMM).
///
/// `src` is `rows * cols` row-major; `data` is `rows * cols_p` bytes (row-major, padding
/// columns are 0); `scales` is `rows * cols_p / 32` bytes (row-major, one per block).
pub fn encode_rows<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), MxError> {
    check_plane(shape, Plane::Row, src.len(), data.len(), scales.len())?;
    dispatch!(with_spec!(fmt, S => encode_rows_impl::<T, S>(src, shape.cols, rule, data, scales)));
    Ok(())
}

/// Validates the buffers of a row- or column-plane operation: `src` elements of the tensor,
/// `data` and `scales` bytes of the plane.
pub(crate) fn check_plane(
    shape: MxShape,
    plane: Plane,
    src: usize,
    data: usize,
    scales: usize,
) -> Result<(), MxError> {
    shape.validate()?;
    check_len("src", shape.len(), src)?;
    let (want_data, want_scales) = match plane {
        Plane::Row => (shape.row_data_bytes(), shape.row_scale_bytes()),
        Plane::Col => (shape.col_data_bytes(), shape.col_scale_bytes()),
    };
    check_len("data", want_data, data)?;
    check_len("scales", want_scales, scales)
}

/// Row-plane kernel over whole rows (lengths already checked).
#[inline(always)]
pub(crate) fn encode_rows_impl<T: MxInput, S: Spec>(
    src: &[T],
    cols: usize,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
) {
    if cols == 0 {
        return;
    }
    let cols_p = crate::shape::round_up32(cols);
    let nb = cols_p / BLOCK;
    let mut f = [0f32; BLOCK];
    for ((row, drow), srow) in src
        .chunks_exact(cols)
        .zip(data.chunks_exact_mut(cols_p))
        .zip(scales.chunks_exact_mut(nb))
    {
        for (b, (dblk, s)) in drow.chunks_exact_mut(BLOCK).zip(srow).enumerate() {
            let lo = b * BLOCK;
            // full blocks are read in place (no stack round trip); the tail is zero-padded
            *s = match <&[T; BLOCK]>::try_from(&row[lo..cols.min(lo + BLOCK)]) {
                Ok(x) => encode_block_spec::<T, S>(x, rule, block_mut(dblk)),
                Err(_) => {
                    load(&row[lo..], &mut f);
                    encode_block_spec::<f32, S>(&f, rule, block_mut(dblk))
                }
            };
        }
    }
}

/// Views an exactly-32-byte chunk as an array.
#[inline(always)]
pub(crate) fn block_mut(c: &mut [u8]) -> &mut [u8; BLOCK] {
    c.try_into().expect("chunk of exactly BLOCK bytes")
}

/// Encodes the column-wise plane (blocks of 32 along each column, stored transposed, for
/// the backward GEMM).
///
/// `data` is `cols * rows_p` bytes with element `(r, c)` at `c * rows_p + r` (padding rows
/// are 0); `scales` is `cols * rows_p / 32` bytes with block `(c, rb)` at
/// `c * rows_p / 32 + rb`.
pub fn encode_cols<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), MxError> {
    check_plane(shape, Plane::Col, src.len(), data.len(), scales.len())?;
    dispatch!(
        with_spec!(fmt, S => encode_cols_range::<T, S>(src, shape, rule, 0, shape.cols, data, scales))
    );
    Ok(())
}

/// Column-plane kernel for the columns `[c0, c1)`; `data`/`scales` hold only those columns.
#[inline(always)]
pub(crate) fn encode_cols_range<T: MxInput, S: Spec>(
    src: &[T],
    shape: MxShape,
    rule: ScaleRule,
    c0: usize,
    c1: usize,
    data: &mut [u8],
    scales: &mut [u8],
) {
    let (rows, cols, rows_p) = (shape.rows, shape.cols, shape.rows_p());
    let nbr = rows_p / BLOCK;
    let mut t: TileF32 = [[0f32; TILE]; TILE];
    for rb in 0..nbr {
        let r0 = rb * BLOCK;
        let h = BLOCK.min(rows - r0);
        for ct in (c0..c1).step_by(BLOCK) {
            let w = BLOCK.min(c1 - ct);
            load_tile(src, cols, (r0, h), (ct, w), &mut t);
            let col = ct - c0;
            encode_tile_cols::<S>(
                &t,
                w,
                rule,
                &mut data[col * rows_p + r0..],
                rows_p,
                &mut scales[col * nbr + rb..],
                nbr,
            );
        }
    }
}

/// Decodes a row-wise plane into a row-major `rows * cols` `f32` tensor.
pub fn decode_rows(
    data: &[u8],
    scales: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    out: &mut [f32],
) -> Result<(), MxError> {
    check_plane(shape, Plane::Row, out.len(), data.len(), scales.len())?;
    dispatch!(decode_rows_impl(data, scales, shape.cols, fmt, out));
    Ok(())
}

/// Row-plane decode over whole rows (lengths already checked).
#[inline(always)]
pub(crate) fn decode_rows_impl(
    data: &[u8],
    scales: &[u8],
    cols: usize,
    fmt: ElemFormat,
    out: &mut [f32],
) {
    if cols == 0 {
        return;
    }
    let lut = fmt.lut();
    let cols_p = crate::shape::round_up32(cols);
    let nb = cols_p / BLOCK;
    for ((orow, drow), srow) in out
        .chunks_exact_mut(cols)
        .zip(data.chunks_exact(cols_p))
        .zip(scales.chunks_exact(nb))
    {
        for (b, (ochunk, &s)) in orow.chunks_mut(BLOCK).zip(srow).enumerate() {
            decode_run(&drow[b * BLOCK..], s, lut, ochunk);
        }
    }
}

/// Decodes a column-wise plane into a row-major `rows * cols` `f32` tensor.
pub fn decode_cols(
    data: &[u8],
    scales: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    out: &mut [f32],
) -> Result<(), MxError> {
    check_plane(shape, Plane::Col, out.len(), data.len(), scales.len())?;
    dispatch!(decode_cols_impl(data, scales, shape, fmt, out));
    Ok(())
}

/// Column-plane decode (lengths already checked).
#[inline(always)]
fn decode_cols_impl(data: &[u8], scales: &[u8], shape: MxShape, fmt: ElemFormat, out: &mut [f32]) {
    let (rows, cols, rows_p) = (shape.rows, shape.cols, shape.rows_p());
    let nbr = rows_p / BLOCK;
    let lut = fmt.lut();
    let mut t = [[0f32; BLOCK]; BLOCK];
    for rb in 0..nbr {
        let r0 = rb * BLOCK;
        let h = BLOCK.min(rows - r0);
        for ct in (0..cols).step_by(BLOCK) {
            let w = BLOCK.min(cols - ct);
            for (c, tc) in t.iter_mut().enumerate().take(w) {
                let col = ct + c;
                decode_run(
                    &data[col * rows_p + r0..][..BLOCK],
                    scales[col * nbr + rb],
                    lut,
                    tc,
                );
            }
            for r in 0..h {
                let orow = &mut out[(r0 + r) * cols + ct..][..w];
                for (c, o) in orow.iter_mut().enumerate() {
                    *o = t[c][r];
                }
            }
        }
    }
}
