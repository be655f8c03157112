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
    let qt = transpose_bytes(&q);
    for c in 0..w {
        let col = &mut data[c * stride..][..TILE];
        if sc[c] == SCALE_NAN {
            col.fill(S::NAN);
        } else {
            col.copy_from_slice(&qt[c]);
        }
        scales[c * sstride] = sc[c];
    }
}

/// Transposes a 32x32 byte tile (`out[c][r] = q[r][c]`) as 16 8x8 transposes on `u64`
/// words; the four 8x8 blocks of a block row are processed side by side so the word
/// operations vectorise.
#[inline(always)]
fn transpose_bytes(q: &[[u8; TILE]; TILE]) -> [[u8; TILE]; TILE] {
    let mut out = [[0u8; TILE]; TILE];
    for rb in 0..4 {
        // x[i][cb]: bytes cb*8..cb*8+8 of row rb*8+i (little endian: byte j = column j)
        let mut x = [[0u64; 4]; 8];
        for (i, xi) in x.iter_mut().enumerate() {
            for (cb, w) in xi.iter_mut().enumerate() {
                let mut b = [0u8; 8];
                b.copy_from_slice(&q[rb * 8 + i][cb * 8..cb * 8 + 8]);
                *w = u64::from_le_bytes(b);
            }
        }
        swap_stage(&mut x, 1, 8, 0x00FF_00FF_00FF_00FF);
        swap_stage(&mut x, 2, 16, 0x0000_FFFF_0000_FFFF);
        swap_stage(&mut x, 4, 32, 0x0000_0000_FFFF_FFFF);
        // now x[j][cb] holds column cb*8+j, rows rb*8..rb*8+8
        for (j, xj) in x.iter().enumerate() {
            for (cb, w) in xj.iter().enumerate() {
                out[cb * 8 + j][rb * 8..rb * 8 + 8].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    out
}

/// One stage of the 8x8 byte transpose: swaps the off-diagonal `d x d` sub-blocks of every
/// `2d x 2d` block (rows `i` and `i + d`, bit shift `shift`, low-part mask `mask`).
#[inline(always)]
fn swap_stage(x: &mut [[u64; 4]; 8], d: usize, shift: u32, mask: u64) {
    for i in 0..8 {
        if i & d == 0 {
            let (lo, hi) = x.split_at_mut(i + d);
            for (a, b) in lo[i].iter_mut().zip(hi[0].iter_mut()) {
                let u = ((*a >> shift) ^ *b) & mask;
                *a ^= u << shift;
                *b ^= u;
            }
        }
    }
}
