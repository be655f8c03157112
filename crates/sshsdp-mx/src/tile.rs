//! 32x32 tile kernels shared by the column plane and the tiled layout: load a (zero-padded)
//! tile, encode its column blocks with a vertical amax pass and a row-order encode loop
//! (vectorised across columns), then a byte transpose.

use crate::block::load;
use crate::format::{encode_elem, Spec};
use crate::input::MxInput;
use crate::scale::{block_scale, inv_scale, SCALE_NAN};
use crate::TILE;

/// A tile of `f32`, row-major: `t[r][c]`.
pub(crate) type TileF32 = [[f32; TILE]; TILE];

/// Loads rows `r0..r0 + h` and columns `c0..c0 + w` of the row-major `src` (row stride
/// `cols`) into `t`, zero-padding the rest.
#[inline(always)]
pub(crate) fn load_tile<T: MxInput>(
    src: &[T],
    cols: usize,
    (r0, h): (usize, usize),
    (c0, w): (usize, usize),
    t: &mut TileF32,
) {
    for (r, tr) in t.iter_mut().enumerate() {
        if r < h {
            load(&src[(r0 + r) * cols + c0..][..w], tr);
        } else {
            *tr = [0.0; TILE];
        }
    }
}

/// Encodes the 32 column blocks of a tile. Column `c`'s 32 bytes go to
/// `data[c * stride..][..32]` (tile row order) and its scale to `scales[c * sstride]`, for
/// `c < w` only.
#[inline(always)]
pub(crate) fn encode_tile_cols<S: Spec>(
    t: &TileF32,
    w: usize,
    rule: crate::ScaleRule,
    data: &mut [u8],
    stride: usize,
    scales: &mut [u8],
    sstride: usize,
) {
    // vertical amax, vectorised across the 32 columns
    let mut amax = [0u32; TILE];
    for tr in t {
        for (m, v) in amax.iter_mut().zip(tr) {
            *m = (*m).max(v.to_bits() & 0x7FFF_FFFF);
        }
    }
    let mut inv = [1f32; TILE];
    let mut sc = [0u8; TILE];
    for c in 0..TILE {
        if amax[c] >= 0x7F80_0000 {
            sc[c] = SCALE_NAN;
        } else {
            sc[c] = block_scale::<S>(amax[c], rule);
            inv[c] = inv_scale(sc[c]);
        }
    }
    // encode in row order (NaN columns give garbage here and are overwritten below)
    let mut q = [[0u8; TILE]; TILE];
    for (qr, tr) in q.iter_mut().zip(t) {
        for ((o, &v), &i) in qr.iter_mut().zip(tr).zip(&inv) {
            *o = encode_elem::<S>(v, i);
        }
    }
    for c in 0..w {
        let col = &mut data[c * stride..][..TILE];
        if sc[c] == SCALE_NAN {
            col.fill(S::NAN);
        } else {
            for (o, qr) in col.iter_mut().zip(&q) {
                *o = qr[c];
            }
        }
        scales[c * sstride] = sc[c];
    }
}
