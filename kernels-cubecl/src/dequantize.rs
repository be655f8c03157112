//! MXFP8 dequantisation of one plane (row-wise or column-wise) of the tiled bucket layout
//! into a row-major `f32` `[rows, cols]` tensor. Bit-identical to `sshsdp_mx::decode_tiled`
//! (NaN bits included, as an x86 CPU produces them).
//!
//! One cube (32 x 8 units) per tile at a time: the plane's 264 words are staged in shared
//! memory, then each unit decodes four elements of one tile column (one float product for
//! most scales, the exact integer decoder for the extreme ones) and writes them with
//! coalesced row-major stores.

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::Plane;

use crate::common::tile_grid;
use crate::e4m3::{byte_of, decode_byte};
use crate::error::{check_size, checked_shape, to_u32, KernelError};
use crate::layout::{COL_DATA_W, ROW_DATA_W, TILE_WORDS};

/// The dequantise kernel: tiles `CUBE_POS, CUBE_POS + CUBE_COUNT, ...` of `n_tiles`; the
/// output holds `f32` bits.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequantize_tiled_kernel(
    src: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    tile_cols: u32,
    n_tiles: u32,
    word_offset: u32,
    #[comptime] col_plane: bool,
) {
    // 256 data words then 8 scale words of the chosen plane
    let mut plane = SharedMemory::<u32>::new(264usize);
    let x = UNIT_POS_X;
    let y = UNIT_POS_Y;
    let u = UNIT_POS;
    let mut t = CUBE_POS as u32;
    let stride = CUBE_COUNT as u32;
    let plane_w = comptime![if col_plane { COL_DATA_W } else { ROW_DATA_W }];
    while t < n_tiles {
        let base = word_offset + t * TILE_WORDS + plane_w;
        plane[u as usize] = src[(base + u) as usize];
        if u < 8 {
            plane[(256 + u) as usize] = src[(base + 256 + u) as usize];
        }
        sync_cube();
        let r0 = (t / tile_cols) * 32;
        let c0 = (t % tile_cols) * 32;
        for i in 0..4u32 {
            let r = y + 8 * i;
            if r0 + r < rows && c0 + x < cols {
                // (block, position in block)
                let mut blk = r;
                let mut pos = x;
                if col_plane {
                    blk = x;
                    pos = r;
                }
                let byte_idx = blk * 32 + pos;
                let b = byte_of(plane[(byte_idx / 4) as usize], byte_idx % 4);
                let s = byte_of(plane[(256 + blk / 4) as usize], blk % 4);
                out[((r0 + r) * cols + c0 + x) as usize] = decode_byte(b, s);
            }
        }
        sync_cube();
        t += stride;
    }
}

/// Decodes `plane` of the tiled layout stored in `src` from word `word_offset` on into the
/// row-major `f32` tensor `out` (`rows * cols` values). Output bits equal
/// `sshsdp_mx::decode_tiled`'s.
pub fn dequantize_tiled<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    word_offset: usize,
    rows: usize,
    cols: usize,
    plane: Plane,
    out: &Handle,
) -> Result<(), KernelError> {
    let Some(shape) = checked_shape(rows, cols)? else {
        return Ok(());
    };
    let src_words = word_offset + shape.tiled_bytes() / 4;
    check_size("src", src, src_words as u64 * 4)?;
    check_size("out", out, shape.len() as u64 * 4)?;
    to_u32("src words", src_words as u64)?;
    to_u32("rows * cols", shape.len() as u64)?;
    let n_tiles = shape.n_tiles() as u32;
    let (count, dim) = tile_grid(n_tiles);
    // SAFETY: lengths are the handles' sizes in words; indices stay below `src_words` and
    // `rows * cols`, both checked above.
    unsafe {
        dequantize_tiled_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(src.clone(), src.size_in_used() as usize / 4),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            rows as u32,
            cols as u32,
            shape.tile_cols() as u32,
            n_tiles,
            word_offset as u32,
            plane == Plane::Col,
        );
    }
    Ok(())
}
