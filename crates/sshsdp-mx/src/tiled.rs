//! The tiled bucket layout: 32x32 tiles in row-major tile order, each holding both planes.

use crate::block::{decode_run, encode_block_spec, with_spec};
use crate::format::{ElemFormat, ScaleRule, Spec};
use crate::input::MxInput;
use crate::plane::block_mut;
use crate::scale::SCALE_ZERO_BLOCK;
use crate::shape::{check_len, MxShape};
use crate::simd::dispatch;
use crate::tile::{encode_tile_cols, load_tile, TileF32};
use crate::{MxError, BLOCK, TILE, TILE_BYTES};

/// Offset in a tile of the row-wise data (32x32 bytes, tile row-major).
pub const TILE_ROW_DATA: usize = 0;
/// Offset in a tile of the row-wise scales (32 bytes, one per tile row).
pub const TILE_ROW_SCALES: usize = TILE * TILE;
/// Offset in a tile of the column-wise data (32x32 bytes, tile column-major: `c * 32 + r`).
pub const TILE_COL_DATA: usize = TILE_ROW_SCALES + TILE;
/// Offset in a tile of the column-wise scales (32 bytes, one per tile column).
pub const TILE_COL_SCALES: usize = TILE_COL_DATA + TILE * TILE;

const _: () = assert!(TILE_COL_SCALES + TILE == TILE_BYTES);

/// Which plane of a tile to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Plane {
    /// The row-wise plane (blocks along rows).
    #[default]
    Row,
    /// The column-wise plane (blocks along columns).
    Col,
}

/// Checks `t0 <= t1 <= n_tiles`.
fn check_range(shape: MxShape, t0: usize, t1: usize) -> Result<(), MxError> {
    let n_tiles = shape.n_tiles();
    if t0 <= t1 && t1 <= n_tiles {
        Ok(())
    } else {
        Err(MxError::TileRange { t0, t1, n_tiles })
    }
}

/// Encodes the whole tensor into the tiled layout (`out` is [`MxShape::tiled_bytes`] long).
pub fn encode_tiled<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    out: &mut [u8],
) -> Result<(), MxError> {
    shape.validate()?;
    encode_tiled_range(src, shape, fmt, rule, 0, shape.n_tiles(), out)
}

/// Encodes only the tiles `[t0, t1)` (row-major tile order) into `out`, which is
/// `(t1 - t0) * TILE_BYTES` long; `src` is still the whole `rows * cols` tensor. The whole
/// layout is the concatenation of any partition into ranges.
pub fn encode_tiled_range<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    t0: usize,
    t1: usize,
    out: &mut [u8],
) -> Result<(), MxError> {
    shape.validate()?;
    check_len("src", shape.len(), src.len())?;
    check_range(shape, t0, t1)?;
    check_len("out", (t1 - t0) * TILE_BYTES, out.len())?;
    dispatch!(with_spec!(fmt, S => encode_tiles_impl::<T, S>(src, shape, rule, t0, out)));
    Ok(())
}

/// Tile kernel (lengths already checked): encodes `out.len() / TILE_BYTES` tiles from `t0`.
#[inline(always)]
fn encode_tiles_impl<T: MxInput, S: Spec>(
    src: &[T],
    shape: MxShape,
    rule: ScaleRule,
    t0: usize,
    out: &mut [u8],
) {
    let (rows, cols, tcols) = (shape.rows, shape.cols, shape.tile_cols());
    let mut a: TileF32 = [[0f32; TILE]; TILE];
    for (i, tile) in out.chunks_exact_mut(TILE_BYTES).enumerate() {
        let t = t0 + i;
        let (r0, c0) = ((t / tcols) * TILE, (t % tcols) * TILE);
        let (h, w) = (TILE.min(rows - r0), TILE.min(cols - c0));
        load_tile(src, cols, (r0, h), (c0, w), &mut a);
        let (row_part, col_part) = tile.split_at_mut(TILE_COL_DATA);
        let (rdata, rscales) = row_part.split_at_mut(TILE_ROW_SCALES);
        let (cdata, cscales) = col_part.split_at_mut(TILE * TILE);
        for ((ar, d), s) in a.iter().zip(rdata.chunks_exact_mut(BLOCK)).zip(rscales) {
            *s = encode_block_spec::<f32, S>(ar, rule, block_mut(d));
        }
        // padding columns (c >= w) of the column part: zero blocks with the zero scale
        cdata[w * TILE..].fill(0);
        cscales[w..].fill(SCALE_ZERO_BLOCK);
        encode_tile_cols::<S>(&a, w, rule, cdata, TILE, cscales, 1);
    }
}

/// Decodes the whole tiled layout (one plane of it) into a row-major `rows * cols` tensor.
pub fn decode_tiled(
    src: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    plane: Plane,
    out: &mut [f32],
) -> Result<(), MxError> {
    shape.validate()?;
    decode_tiled_range(src, shape, fmt, plane, 0, shape.n_tiles(), out)
}

/// Decodes the tiles `[t0, t1)` (`src` is `(t1 - t0) * TILE_BYTES` long) into their
/// positions of the row-major `rows * cols` tensor `out`; other positions are untouched.
pub fn decode_tiled_range(
    src: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    plane: Plane,
    t0: usize,
    t1: usize,
    out: &mut [f32],
) -> Result<(), MxError> {
    shape.validate()?;
    check_len("out", shape.len(), out.len())?;
    check_range(shape, t0, t1)?;
    check_len("src", (t1 - t0) * TILE_BYTES, src.len())?;
    dispatch!(decode_tiles_impl(src, shape, fmt, plane, t0, out, 0));
    Ok(())
}

/// Tile decode (lengths already checked). `out` holds the tensor rows from `out_row0` on.
#[inline(always)]
pub(crate) fn decode_tiles_impl(
    src: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    plane: Plane,
    t0: usize,
    out: &mut [f32],
    out_row0: usize,
) {
    let (rows, cols, tcols) = (shape.rows, shape.cols, shape.tile_cols());
    let lut = fmt.lut();
    let mut t = [[0f32; TILE]; TILE];
    for (i, tile) in src.chunks_exact(TILE_BYTES).enumerate() {
        let ti = t0 + i;
        let (r0, c0) = ((ti / tcols) * TILE, (ti % tcols) * TILE);
        let (h, w) = (TILE.min(rows - r0), TILE.min(cols - c0));
        let orow = |r: usize| (r0 + r - out_row0) * cols + c0;
        match plane {
            Plane::Row => {
                for r in 0..h {
                    let d = &tile[TILE_ROW_DATA + r * TILE..][..w];
                    let o = &mut out[orow(r)..][..w];
                    decode_run(d, tile[TILE_ROW_SCALES + r], lut, o);
                }
            }
            Plane::Col => {
                for (c, tc) in t.iter_mut().enumerate().take(w) {
                    let d = &tile[TILE_COL_DATA + c * TILE..][..TILE];
                    decode_run(d, tile[TILE_COL_SCALES + c], lut, tc);
                }
                for r in 0..h {
                    let o = &mut out[orow(r)..][..w];
                    for (c, v) in o.iter_mut().enumerate() {
                        *v = t[c][r];
                    }
                }
            }
        }
    }
}
