//! MXFP8 matmul `C = A · Bᵀ` (the forward GEMM `y = x Wᵀ`): `A` `[m, k]` and `B` `[n, k]` in
//! the tiled bucket layout (their row-wise planes: blocks along `k`), `C` row-major `f32`
//! `[m, n]`, `f32` accumulation.
//!
//! Neither CPUs nor Hopper have block-scaled MMA, so the operands are dequantised in the load
//! stage: each `K = 32` step reads one tile column of `A` and of `B` (two 32 x 32 tiles each
//! per 64 x 64 output block), decodes bytes through a 256-entry E4M3 table in shared memory
//! times the block's power-of-two scale, and runs the same register-blocked inner loop as
//! the `f32` GEMM ([`crate::gemm`]).

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::MxShape;

use crate::e4m3::{byte_of, decode_e4m3};
use crate::error::{check_size, product, to_u32, KernelError};
use crate::gemm::{block_fma, store_plain, BM, BN, SMEM_LD, UNITS};
use crate::layout::{ROW_SCALES_W, TILE_WORDS};

/// `f32` value of the E8M0 scale byte `s` (`2^(s - 127)`; 0xFF gives +inf, which turns the
/// block's NaN elements and everything else into NaN or ±inf as the CPU's NaN scale would).
#[cube]
fn scale_f32(s: u32) -> f32 {
    let mut bits = s << 23;
    if s == 0 {
        bits = 0x0040_0000;
    }
    f32::reinterpret(bits)
}

/// Loads tile column `kt` of tile rows `tr0, tr0 + 1` (row plane) into `dst[k][r]`
/// (`r < 64`), dequantised; tile rows at or beyond `tile_rows` load zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_mx(
    src: &Array<u32>,
    lut: &SharedMemory<f32>,
    dst: &mut SharedMemory<f32>,
    word_offset: u32,
    tr0: u32,
    kt: u32,
    k_tiles: u32,
    tile_rows: u32,
) {
    let u = UNIT_POS;
    for l in 0..2u32 {
        // word `wi` of tile `tr0 + l`: row `wi / 8`, columns `4 · (wi % 8)..`
        let tr = tr0 + l;
        let ri = u / 8;
        let k0 = (u % 8) * 4;
        let dst0 = k0 * SMEM_LD + l * 32 + ri;
        if tr < tile_rows {
            let base = word_offset + (tr * k_tiles + kt) * TILE_WORDS;
            let word = src[(base + u) as usize];
            let s = byte_of(src[(base + ROW_SCALES_W + ri / 4) as usize], ri % 4);
            let sf = scale_f32(s);
            #[unroll]
            for j in 0..4u32 {
                dst[(dst0 + j * SMEM_LD) as usize] = lut[byte_of(word, j) as usize] * sf;
            }
        } else {
            #[unroll]
            for j in 0..4u32 {
                dst[(dst0 + j * SMEM_LD) as usize] = 0.0;
            }
        }
    }
}

/// The MXFP8 matmul kernel (see the module docs).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn mx_matmul_kernel(
    a: &Array<u32>,
    b: &Array<u32>,
    c: &mut Array<f32>,
    m: u32,
    n: u32,
    k_tiles: u32,
    a_offset: u32,
    b_offset: u32,
) {
    let mut lut = SharedMemory::<f32>::new(256usize);
    let mut a_s = SharedMemory::<f32>::new(32 * 65usize);
    let mut b_s = SharedMemory::<f32>::new(32 * 65usize);
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16u32 {
        acc[i as usize] = 0.0;
    }
    // exact E4M3 values (scale byte 127 = 1.0)
    lut[UNIT_POS as usize] = f32::reinterpret(decode_e4m3(UNIT_POS, 127));
    sync_cube();
    let a_tile_rows = m.div_ceil(32);
    let b_tile_rows = n.div_ceil(32);
    let tr_a = CUBE_POS_Y * (BM / 32);
    let tr_b = CUBE_POS_X * (BN / 32);
    for kt in 0..k_tiles {
        load_mx(a, &lut, &mut a_s, a_offset, tr_a, kt, k_tiles, a_tile_rows);
        load_mx(b, &lut, &mut b_s, b_offset, tr_b, kt, k_tiles, b_tile_rows);
        sync_cube();
        block_fma(&a_s, &b_s, &mut acc, UNIT_POS_X, UNIT_POS_Y);
        sync_cube();
    }
    store_plain(&acc, c, m, n);
}

/// `C = A · Bᵀ` for MXFP8 operands in the tiled layout: `A` `[m, k]` at word `a_offset` of
/// `a`, `B` `[n, k]` at word `b_offset` of `b` (both as written by
/// [`crate::quantize_tiled`]), `C` row-major `f32` `[m, n]`. Equals the `f32` product of the
/// dequantised row planes up to summation order.
#[allow(clippy::too_many_arguments)]
pub fn mx_matmul<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    n: usize,
    k: usize,
    a: &Handle,
    a_offset: usize,
    b: &Handle,
    b_offset: usize,
    c: &Handle,
) -> Result<(), KernelError> {
    let (sa, sb) = (MxShape::new(m, k), MxShape::new(n, k));
    for s in [sa, sb] {
        s.validate()
            .map_err(|e| KernelError::Shape(e.to_string()))?;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let a_words = a_offset as u64 + (sa.tiled_bytes() / 4) as u64;
    let b_words = b_offset as u64 + (sb.tiled_bytes() / 4) as u64;
    to_u32("a words", a_words)?;
    to_u32("b words", b_words)?;
    let mn = to_u32("m * n", product("m * n", &[m, n])?)?;
    check_size("a", a, a_words * 4)?;
    check_size("b", b, b_words * 4)?;
    check_size("c", c, mn as u64 * 4)?;
    let len = |h: &Handle| h.size_in_used() as usize / 4;
    let count = CubeCount::Static((n as u32).div_ceil(BN), (m as u32).div_ceil(BM), 1);
    // SAFETY: tile indices stay inside the two tiled layouts and `m * n`, checked above.
    unsafe {
        mx_matmul_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_2d(UNITS, UNITS),
            ArrayArg::from_raw_parts(a.clone(), len(a)),
            ArrayArg::from_raw_parts(b.clone(), len(b)),
            ArrayArg::from_raw_parts(c.clone(), len(c)),
            m as u32,
            n as u32,
            sa.tile_cols() as u32,
            a_offset as u32,
            b_offset as u32,
        );
    }
    Ok(())
}
