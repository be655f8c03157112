//! The plan's bf16 runs (MXFP8 fallbacks and the bf16 runtime format: little-endian bf16 values
//! in a byte buffer) to and from `f32` buffers:
//!
//! * [`widen_bf16`]: bf16 → f32, exact (bf16 is the top half of an f32), except that a
//!   signalling NaN is quieted (its quiet bit set), as `half::bf16::to_f32` does on the host;
//! * [`narrow_bf16`]: f32 → bf16, rounding to nearest with ties to even and quieting NaNs, as
//!   `half::bf16::from_f32` does on the host.
//!
//! So device and host encodes and decodes agree bit for bit.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::common::grid;
use crate::e4m3::round_bf16;
use crate::error::{check_size, to_u32, KernelError};

/// Widen kernel: value `i` of `n` is half-word `src_half + i` of `src`, each by
/// [`widen_bf16_value`].
#[cube(launch_unchecked)]
fn widen_bf16_kernel(src: &Array<u32>, out: &mut Array<u32>, n: u32, src_half: u32, dst: u32) {
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < n {
        widen_bf16_value(src, out, src_half, dst, i);
        i += stride;
    }
}

/// Widens value `i` of a run (half-word `src_half + i` of `src`) into `f32` value `dst + i` of
/// `out`.
#[cube]
fn widen_bf16_value(src: &Array<u32>, out: &mut Array<u32>, src_half: u32, dst: u32, i: u32) {
    out[(dst + i) as usize] = widen_bf16_bits(src, src_half + i);
}

/// The `f32` bits of the bf16 value at half-word `h` of `src`, a signalling NaN quieted.
#[cube]
pub(crate) fn widen_bf16_bits(src: &Array<u32>, h: u32) -> u32 {
    let word = src[(h / 2) as usize];
    let bits = if h % 2 == 0 {
        word & 0xFFFF
    } else {
        word >> 16
    };
    let x = bits << 16;
    let magnitude = x & 0x7FFF_FFFFu32;
    let quiet = select(magnitude > 0x7F80_0000u32, 0x0040_0000u32, 0u32);
    x | quiet
}

/// Widens the `n` bf16 values at byte `src_byte` of `src` (a multiple of 2) into the `f32`
/// values `dst..dst + n` of `out` (other values untouched).
pub fn widen_bf16<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    src_byte: usize,
    n: usize,
    out: &Handle,
    dst: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    if src_byte % 2 != 0 {
        return Err(KernelError::Shape(format!(
            "bf16 values start on an even byte, not {src_byte}"
        )));
    }
    check_size("src", src, (src_byte + 2 * n) as u64)?;
    check_size("out", out, ((dst + n) * 4) as u64)?;
    to_u32("dst + n", (dst + n) as u64)?;
    to_u32("src half-words", (src_byte / 2 + n) as u64)?;
    let (count, dim) = grid(n);
    // SAFETY: every index is below the checked extents (`src`'s last word may be half used).
    unsafe {
        widen_bf16_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(src.clone(), (src.size_in_used() as usize).div_ceil(4)),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            n as u32,
            (src_byte / 2) as u32,
            dst as u32,
        );
    }
    Ok(())
}

/// Narrow kernel: word `w` of `ceil(n / 2)`, each by [`narrow_bf16_word`].
#[cube(launch_unchecked)]
fn narrow_bf16_kernel(src: &Array<u32>, out: &mut Array<u32>, n: u32, src_at: u32, dst_word: u32) {
    let words = n.div_ceil(2);
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while w < words {
        narrow_bf16_word(src, out, n, src_at, dst_word, w);
        w += stride;
    }
}

/// Word `w` of a run of `n` bf16 values narrowed from the `f32` bits of `src` at `src_at`:
/// values `2w` (low half) and `2w + 1` (high half, zero past `n`), written to word
/// `dst_word + w` of `out`.
#[cube]
pub(crate) fn narrow_bf16_word(
    src: &Array<u32>,
    out: &mut Array<u32>,
    n: u32,
    src_at: u32,
    dst_word: u32,
    w: u32,
) {
    let i = 2 * w;
    let lo = u32::reinterpret(round_bf16(f32::reinterpret(src[(src_at + i) as usize]))) >> 16;
    let mut hi = 0u32;
    if i + 1 < n {
        let v = f32::reinterpret(src[(src_at + i + 1) as usize]);
        hi = u32::reinterpret(round_bf16(v)) & 0xFFFF_0000u32;
    }
    out[(dst_word + w) as usize] = lo | hi;
}

/// Narrows the `f32` values `src_at..src_at + n` of `src` to bf16, written little-endian from
/// byte `dst_byte` of `out` (a multiple of 4: whole words are written, an odd `n`'s last
/// half-word as zero; other words untouched).
pub fn narrow_bf16<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    src_at: usize,
    n: usize,
    out: &Handle,
    dst_byte: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    if dst_byte % 4 != 0 {
        return Err(KernelError::Shape(format!(
            "narrowed bf16 values start on a word, not byte {dst_byte}"
        )));
    }
    let words = n.div_ceil(2);
    check_size("src", src, ((src_at + n) * 4) as u64)?;
    check_size("out", out, (dst_byte + 4 * words) as u64)?;
    to_u32("src_at + n", (src_at + n) as u64)?;
    to_u32("dst words", (dst_byte / 4 + words) as u64)?;
    let (count, dim) = grid(words);
    // SAFETY: every index is below the checked extents.
    unsafe {
        narrow_bf16_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(src.clone(), src.size_in_used() as usize / 4),
            ArrayArg::from_raw_parts(out.clone(), out.size_in_used() as usize / 4),
            n as u32,
            src_at as u32,
            (dst_byte / 4) as u32,
        );
    }
    Ok(())
}
