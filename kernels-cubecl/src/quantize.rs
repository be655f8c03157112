//! MXFP8 (E4M3, E8M0) quantisation of a row-major `[rows, cols]` tensor into the tiled bucket
//! layout, written in place at a word offset of a `u32` buffer. Bit-identical to
//! `sshsdp_mx::encode_tiled`.
//!
//! One cube (32 x 8 units) encodes one 32x32 tile at a time: coalesced loads of the tile
//! into shared memory (zero padding outside the tensor); every unit takes the four values of
//! one row-data word and of one column-data word into registers and leaves their largest
//! magnitudes; 64 units reduce those to the 32 row and 32 column scales; every unit encodes
//! and writes its two words (coalesced), and 16 units the scale words. Three barriers per
//! tile.

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::ScaleRule;

use crate::common::{load_bits, tile_grid, InputDType};
use crate::e4m3::{encode_word, scale_byte};
use crate::error::{check_size, checked_shape, to_u32, KernelError};
use crate::layout::{COL_DATA_W, COL_SCALES_W, ROW_DATA_W, ROW_SCALES_W, TILE_WORDS};

/// Stride of the shared tile (33: conflict-free row and column walks).
const SMEM_STRIDE: u32 = 33;
/// Stride of the groups of 8 partial maxima (9: conflict-free reads).
const PART_STRIDE: u32 = 9;
/// Offset of the column partial maxima (32 groups of [`PART_STRIDE`]).
const PART_COLS: u32 = 32 * PART_STRIDE;

/// The quantise kernel: tiles `CUBE_POS, CUBE_POS + CUBE_COUNT, ...` of `n_tiles`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_tiled_kernel(
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    cols: u32,
    tile_cols: u32,
    n_tiles: u32,
    word_offset: u32,
    #[comptime] rceil: bool,
    #[comptime] bf16: bool,
) {
    let mut vals = SharedMemory::<u32>::new(32 * 33usize);
    let mut scales = SharedMemory::<u32>::new(64usize);
    // partial maxima: rows then columns, 32 groups of 8 with stride 9
    let mut part = SharedMemory::<u32>::new(2 * 288usize);
    let x = UNIT_POS_X;
    let y = UNIT_POS_Y;
    let u = UNIT_POS;
    let mut t = CUBE_POS as u32;
    let stride = CUBE_COUNT as u32;
    while t < n_tiles {
        let r0 = (t / tile_cols) * 32;
        let c0 = (t % tile_cols) * 32;
        // 1. load the tile (bits), zero outside the tensor
        for i in 0..4u32 {
            let r = y + 8 * i;
            let mut v = 0u32;
            if r0 + r < rows && c0 + x < cols {
                v = load_bits(input, (r0 + r) * cols + c0 + x, bf16);
            }
            vals[(r * SMEM_STRIDE + x) as usize] = v;
        }
        sync_cube();
        // 2. every unit takes the four values of its row word (row u / 8, columns
        //    4·(u % 8)..) and of its column word (column u / 8, rows 4·(u % 8)..) into
        //    registers and leaves their largest magnitudes (padded index: conflict-free reads)
        let a = u / 8;
        let b = (u % 8) * 4;
        let ri = (a * SMEM_STRIDE + b) as usize;
        let ci = (b * SMEM_STRIDE + a) as usize;
        let s33 = SMEM_STRIDE as usize;
        let r0v = vals[ri];
        let r1v = vals[ri + 1];
        let r2v = vals[ri + 2];
        let r3v = vals[ri + 3];
        let c0v = vals[ci];
        let c1v = vals[ci + s33];
        let c2v = vals[ci + 2 * s33];
        let c3v = vals[ci + 3 * s33];
        let pi = (a * PART_STRIDE + u % 8) as usize;
        part[pi] = max(
            max(r0v & 0x7FFF_FFFF, r1v & 0x7FFF_FFFF),
            max(r2v & 0x7FFF_FFFF, r3v & 0x7FFF_FFFF),
        );
        part[pi + PART_COLS as usize] = max(
            max(c0v & 0x7FFF_FFFF, c1v & 0x7FFF_FFFF),
            max(c2v & 0x7FFF_FFFF, c3v & 0x7FFF_FFFF),
        );
        sync_cube();
        // 3. scales: units 0..32 the rows, 32..64 the columns (8 partial maxima each)
        if u < 64 {
            let p0 = ((u % 32) * PART_STRIDE + (u / 32) * PART_COLS) as usize;
            let mut amax = 0u32;
            for i in 0..8usize {
                amax = max(amax, part[p0 + i]);
            }
            scales[u as usize] = scale_byte(amax, rceil);
        }
        sync_cube();
        // 4. data words from the registers
        let base = word_offset + t * TILE_WORDS;
        out[(base + ROW_DATA_W + u) as usize] = encode_word(r0v, r1v, r2v, r3v, scales[a as usize]);
        out[(base + COL_DATA_W + u) as usize] =
            encode_word(c0v, c1v, c2v, c3v, scales[(32 + a) as usize]);
        // 5. scale words: units 0..8 the row scales, 8..16 the column scales
        if u < 16 {
            let s0 = (u * 4) as usize;
            let w = scales[s0]
                | (scales[s0 + 1] << 8)
                | (scales[s0 + 2] << 16)
                | (scales[s0 + 3] << 24);
            let mut dst = base + ROW_SCALES_W + u;
            if u >= 8 {
                dst = base + COL_SCALES_W + u - 8;
            }
            out[dst as usize] = w;
        }
        // no barrier needed here: the next tile's stores to `vals` follow reads that all
        // happened before step 2's barrier, and `part`/`scales` are rewritten only after two
        // more barriers
        t += stride;
    }
}

/// Quantises the row-major `[rows, cols]` tensor in `input` (`f32` or `bf16`, see
/// [`InputDType`]) to MXFP8 E4M3 with scale rule `rule`, writing the tiled layout
/// (`sshsdp_mx::tiled_bytes(rows, cols)` bytes) into `out` from word `word_offset` on.
/// Other words of `out` are untouched. Output bits equal `sshsdp_mx::encode_tiled`'s.
#[allow(clippy::too_many_arguments)]
pub fn quantize_tiled<R: Runtime>(
    client: &ComputeClient<R>,
    input: &Handle,
    dtype: InputDType,
    rows: usize,
    cols: usize,
    rule: ScaleRule,
    out: &Handle,
    word_offset: usize,
) -> Result<(), KernelError> {
    let Some(shape) = checked_shape(rows, cols)? else {
        return Ok(());
    };
    let elem_bytes = match dtype {
        InputDType::F32 => 4,
        InputDType::Bf16 => 2,
    };
    let out_words = shape.tiled_bytes() / 4;
    check_size("input", input, (shape.len() * elem_bytes) as u64)?;
    check_size("out", out, (word_offset + out_words) as u64 * 4)?;
    to_u32("rows * cols", shape.len() as u64)?;
    to_u32(
        "word_offset + tiled words",
        (word_offset + out_words) as u64,
    )?;
    let n_tiles = shape.n_tiles() as u32;
    let (count, dim) = tile_grid(n_tiles);
    let out_len = out.size_in_used() as usize / 4;
    // SAFETY: lengths are the handles' sizes in words (a bf16 input's last word may be half
    // used); every index the kernel forms is below the input's words or
    // `word_offset + out_words`, both checked above.
    unsafe {
        quantize_tiled_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(input.clone(), (input.size_in_used() as usize).div_ceil(4)),
            ArrayArg::from_raw_parts(out.clone(), out_len),
            rows as u32,
            cols as u32,
            shape.tile_cols() as u32,
            n_tiles,
            word_offset as u32,
            rule == ScaleRule::Rceil,
            dtype == InputDType::Bf16,
        );
    }
    Ok(())
}
