//! Square-block MXFP8: one E8M0 scale per 32×32 tile, one copy of the elements.
//!
//! A weight is read by two GEMMs that contract over different dimensions (forward over its
//! rows, backward's data gradient over its columns). With 1×32 blocks each pass needs its own
//! plane ([`crate::encode_rows`], [`crate::encode_cols`]); one scale per 32×32 tile covers
//! every 1×32 and every 32×1 block inside the tile, so a single encoding serves both passes
//! (as TransformerEngine's 2-D block scaling, torchao's 32×32 weight scaling and DeepSeek-V3's
//! 128×128 weight blocks do). The price is a coarser scale: a tile's scale is the largest of
//! its 64 row and column blocks' scales.
//!
//! Layout of a `[rows, cols]` matrix (tiles over the matrix padded to multiples of 32, the
//! padding never stored):
//! - data: `rows × cols` bytes, row-major, element `(r, c)` at `r * cols + c`;
//! - scales: `tile_rows × tile_cols` bytes, tile `(r / 32, c / 32)` at
//!   `(r / 32) * tile_cols + c / 32`.
//!
//! So `rows · cols + ⌈rows/32⌉·⌈cols/32⌉` bytes in all (≈ 1 + 1/1024 per element). A
//! rectangle of a matrix whose origin lies on tile edges is itself a square-block matrix with
//! the same tiles: encoding it alone gives exactly the bytes the whole matrix's encoding has
//! there, which is what lets a shard's owner encode only its own tiles.
//!
//! The values are read from (and decoded into) row-major buffers with a row stride, so a
//! rectangle is encoded straight from a larger matrix and decoded straight into one.

use crate::block::{decode_run, with_spec};
use crate::format::{encode_elem, ElemFormat, ScaleRule, Spec};
use crate::input::MxInput;
use crate::scale::{block_scale, inv_scale, SCALE_NAN};
use crate::shape::check_len;
use crate::{MxError, MxShape, TILE};

impl MxShape {
    /// Bytes of the square-block data: `rows * cols`.
    pub const fn square_data_bytes(&self) -> usize {
        self.rows * self.cols
    }

    /// Bytes of the square-block scales: one per 32×32 tile of the padded matrix.
    pub const fn square_scale_bytes(&self) -> usize {
        self.n_tiles()
    }

    /// Bytes of the whole square-block encoding (data, then scales).
    pub const fn square_bytes(&self) -> usize {
        self.square_data_bytes() + self.square_scale_bytes()
    }
}

/// Checks that a row-major buffer of `len` values with row stride `stride` holds `shape`.
fn check_strided(
    what: &'static str,
    shape: MxShape,
    stride: usize,
    len: usize,
) -> Result<(), MxError> {
    shape.validate()?;
    if shape.is_empty() {
        return Ok(());
    }
    let needed = (shape.rows - 1)
        .checked_mul(stride)
        .and_then(|n| n.checked_add(shape.cols));
    match needed {
        Some(n) if stride >= shape.cols && len >= n => Ok(()),
        _ => Err(MxError::BufferLength {
            what,
            expected: needed.unwrap_or(usize::MAX).max(shape.cols),
            got: len,
        }),
    }
}

/// Encodes the `shape` matrix whose row `r` is `src[r * stride..][..cols]` into square-block
/// `data` (`rows * cols` bytes) and `scales` (one per tile), with `fmt` elements and the scale
/// `rule`. A tile holding NaN or ±inf gets the NaN scale and NaN in every element; an all-zero
/// tile the zero-block scale (as [`crate::encode_block`] does for one block).
pub fn encode_square<T: MxInput>(
    src: &[T],
    stride: usize,
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), MxError> {
    check_strided("src", shape, stride, src.len())?;
    check_len("data", shape.square_data_bytes(), data.len())?;
    check_len("scales", shape.square_scale_bytes(), scales.len())?;
    with_spec!(fmt, S => encode_tiles::<T, S>(src, stride, shape, rule, data, scales));
    Ok(())
}

fn encode_tiles<T: MxInput, S: Spec>(
    src: &[T],
    stride: usize,
    shape: MxShape,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
) {
    let cols = shape.cols;
    for tr in 0..shape.tile_rows() {
        let rows = tr * TILE..(tr * TILE + TILE).min(shape.rows);
        for tc in 0..shape.tile_cols() {
            let (c0, c1) = (tc * TILE, (tc * TILE + TILE).min(cols));
            let mut amax = 0u32;
            for r in rows.clone() {
                for v in &src[r * stride + c0..r * stride + c1] {
                    amax = amax.max(v.to_f32().to_bits() & 0x7FFF_FFFF);
                }
            }
            let tile = tr * shape.tile_cols() + tc;
            if amax >= 0x7F80_0000 {
                scales[tile] = SCALE_NAN;
                for r in rows.clone() {
                    data[r * cols + c0..r * cols + c1].fill(S::NAN);
                }
                continue;
            }
            let s = block_scale::<S>(amax, rule);
            scales[tile] = s;
            let inv = inv_scale(s);
            for r in rows.clone() {
                let out = &mut data[r * cols + c0..r * cols + c1];
                for (o, v) in out.iter_mut().zip(&src[r * stride + c0..r * stride + c1]) {
                    *o = encode_elem::<S>(v.to_f32(), inv);
                }
            }
        }
    }
}

/// Decodes square-block `data` and `scales` of the `shape` matrix into `dst`, row `r` at
/// `dst[r * stride..][..cols]` (other positions untouched). Exact, as [`crate::decode_block`].
pub fn decode_square(
    data: &[u8],
    scales: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    dst: &mut [f32],
    stride: usize,
) -> Result<(), MxError> {
    check_len("data", shape.square_data_bytes(), data.len())?;
    check_len("scales", shape.square_scale_bytes(), scales.len())?;
    check_strided("dst", shape, stride, dst.len())?;
    let (cols, lut) = (shape.cols, fmt.lut());
    for r in 0..shape.rows {
        let tiles = &scales[(r / TILE) * shape.tile_cols()..][..shape.tile_cols()];
        for (tc, &scale) in tiles.iter().enumerate() {
            let (c0, c1) = (tc * TILE, (tc * TILE + TILE).min(cols));
            decode_run(
                &data[r * cols + c0..r * cols + c1],
                scale,
                lut,
                &mut dst[r * stride + c0..r * stride + c1],
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode_block, scale_byte, BLOCK};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2654435761).rotate_left(13);
                // Magnitudes spread over several binades, both signs.
                (h as f32 / u32::MAX as f32 - 0.5) * (1 << (h % 7)) as f32
            })
            .collect()
    }

    fn encode(v: &[f32], shape: MxShape) -> (Vec<u8>, Vec<u8>) {
        let mut data = vec![0u8; shape.square_data_bytes()];
        let mut scales = vec![0u8; shape.square_scale_bytes()];
        encode_square(
            v,
            shape.cols,
            shape,
            ElemFormat::E4M3,
            ScaleRule::Rceil,
            &mut data,
            &mut scales,
        )
        .unwrap();
        (data, scales)
    }

    /// Each tile's scale is the scale of its amax, and each element is the block codec's
    /// element for that scale: a 1×32 block whose own amax equals its tile's encodes the same.
    #[test]
    fn a_tile_is_one_block_scaled_by_its_largest_value() {
        for (rows, cols) in [(32, 32), (70, 96), (33, 1), (5, 200), (64, 65)] {
            let shape = MxShape::new(rows, cols);
            let v = values(shape.len(), rows as u32 * 31 + cols as u32);
            let (data, scales) = encode(&v, shape);
            for tr in 0..shape.tile_rows() {
                for tc in 0..shape.tile_cols() {
                    let (r0, c0) = (tr * TILE, tc * TILE);
                    let (r1, c1) = ((r0 + TILE).min(rows), (c0 + TILE).min(cols));
                    let amax = (r0..r1)
                        .flat_map(|r| (c0..c1).map(move |c| (r, c)))
                        .map(|(r, c)| v[r * cols + c].abs().to_bits())
                        .max()
                        .unwrap();
                    let s = scales[tr * shape.tile_cols() + tc];
                    assert_eq!(s, scale_byte(amax, ElemFormat::E4M3, ScaleRule::Rceil));
                    // A block holding the tile's amax has the tile's scale: its bytes agree.
                    let (r, _) = (r0..r1)
                        .flat_map(|r| (c0..c1).map(move |c| (r, c)))
                        .find(|&(r, c)| v[r * cols + c].abs().to_bits() == amax)
                        .unwrap();
                    let mut block = [0f32; BLOCK];
                    block[..c1 - c0].copy_from_slice(&v[r * cols + c0..r * cols + c1]);
                    let mut out = [0u8; BLOCK];
                    let bs = encode_block(&block, ElemFormat::E4M3, ScaleRule::Rceil, &mut out);
                    assert_eq!(bs, s);
                    assert_eq!(&out[..c1 - c0], &data[r * cols + c0..r * cols + c1]);
                }
            }
        }
    }

    #[test]
    fn a_rectangle_on_tile_edges_encodes_as_the_whole_matrix_does_there() {
        let shape = MxShape::new(100, 130);
        let v = values(shape.len(), 9);
        let (data, scales) = encode(&v, shape);
        let (r0, c0, rect) = (32, 64, MxShape::new(68, 66));
        let mut rd = vec![0u8; rect.square_data_bytes()];
        let mut rs = vec![0u8; rect.square_scale_bytes()];
        let src = &v[r0 * shape.cols + c0..];
        let (fmt, rule) = (ElemFormat::E4M3, ScaleRule::Rceil);
        encode_square(src, shape.cols, rect, fmt, rule, &mut rd, &mut rs).unwrap();
        for r in 0..rect.rows {
            let whole = &data[(r0 + r) * shape.cols + c0..][..rect.cols];
            assert_eq!(&rd[r * rect.cols..][..rect.cols], whole);
        }
        for tr in 0..rect.tile_rows() {
            for tc in 0..rect.tile_cols() {
                let whole = scales[(r0 / TILE + tr) * shape.tile_cols() + c0 / TILE + tc];
                assert_eq!(rs[tr * rect.tile_cols() + tc], whole);
            }
        }
        // Decoded into its place of a larger buffer (row stride), the rectangle is the whole
        // matrix's decode there, and nothing else is written.
        let mut whole = vec![0f32; shape.len()];
        decode_square(&data, &scales, shape, fmt, &mut whole, shape.cols).unwrap();
        let mut placed = vec![f32::MAX; shape.len()];
        let dst = &mut placed[r0 * shape.cols + c0..];
        decode_square(&rd, &rs, rect, fmt, dst, shape.cols).unwrap();
        for (i, (&p, &w)) in placed.iter().zip(&whole).enumerate() {
            let (r, c) = (i / shape.cols, i % shape.cols);
            let inside = (r0..r0 + rect.rows).contains(&r) && (c0..c0 + rect.cols).contains(&c);
            assert_eq!(p, if inside { w } else { f32::MAX }, "({r}, {c})");
        }
    }

    #[test]
    fn relative_error_is_bounded_by_the_tile_scale() {
        let shape = MxShape::new(64, 64);
        let v = values(shape.len(), 3);
        let (data, scales) = encode(&v, shape);
        let mut out = vec![0f32; shape.len()];
        decode_square(
            &data,
            &scales,
            shape,
            ElemFormat::E4M3,
            &mut out,
            shape.cols,
        )
        .unwrap();
        for (tile, &s) in scales.iter().enumerate() {
            let step = crate::scale_to_f32(s) * 2f32.powi(-9); // E4M3's smallest subnormal
            let (tr, tc) = (tile / 2, tile % 2);
            for r in tr * 32..tr * 32 + 32 {
                for c in tc * 32..tc * 32 + 32 {
                    let (x, y) = (v[r * 64 + c], out[r * 64 + c]);
                    assert!(
                        (x - y).abs() <= (x.abs() / 16.0).max(step / 2.0),
                        "{x} -> {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn nan_poisons_its_tile_only_and_bad_lengths_are_errors() {
        let shape = MxShape::new(40, 40);
        let mut v = values(shape.len(), 5);
        v[0] = f32::INFINITY;
        let (data, scales) = encode(&v, shape);
        assert_eq!(scales[0], SCALE_NAN);
        assert!(scales[1..].iter().all(|&s| s != SCALE_NAN));
        assert_eq!(data[0], ElemFormat::E4M3.nan_byte());
        assert_ne!(data[35], ElemFormat::E4M3.nan_byte());
        let (fmt, rule) = (ElemFormat::E4M3, ScaleRule::Rceil);
        let mut short = vec![0u8; shape.square_data_bytes() - 1];
        let mut s = vec![0u8; shape.square_scale_bytes()];
        assert!(encode_square(&v, 40, shape, fmt, rule, &mut short, &mut s).is_err());
        let mut d = vec![0u8; shape.square_data_bytes()];
        assert!(encode_square(&v[1..], 40, shape, fmt, rule, &mut d, &mut s).is_err());
        assert!(encode_square(&v, 39, shape, fmt, rule, &mut d, &mut s).is_err());
        let mut out = vec![0f32; shape.len() - 1];
        assert!(decode_square(&data, &scales, shape, fmt, &mut out, 40).is_err());
    }
}
