//! The moves of collectives between buffers of one device (ranks that share it exchange device
//! buffers without NCCL: `sshsdp_comm::peers`): a copy of a run of units at any byte offsets,
//! and a sum of several runs accumulated in `f32` in the order given and rounded once, as every
//! engine of the project reduces.
//!
//! * [`copy_units`]: bytes `src_byte..src_byte + n` of one buffer into `dst_byte..` of another;
//!   each invocation owns one destination word and keeps the bytes of it outside the run, so
//!   runs may start and end anywhere (bf16 half-words, MXFP8 bytes);
//! * [`accumulate_units`]: an `f32` accumulator set to (first run) or incremented by a run of
//!   f32 or bf16 values;
//! * [`store_units`]: the accumulator rounded to f32 or bf16 (ties to even, NaN quieted, as
//!   `half::bf16::from_f32`) into a run of a buffer, the rest of its words kept.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::common::grid;
use crate::e4m3::round_bf16;
use crate::error::{check_size, to_u32, KernelError};

/// The element type of a summed run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SumDType {
    /// `f32`, 4 bytes.
    F32,
    /// `bf16`, 2 bytes, little-endian.
    Bf16,
}

impl SumDType {
    fn bytes(self) -> usize {
        match self {
            SumDType::F32 => 4,
            SumDType::Bf16 => 2,
        }
    }
}

/// Copy kernel: invocation `w` writes word `first + w` of `dst` (byte `b` of it is byte
/// `src_byte + (4·word + b − dst_byte)` of `src` inside the run, its own old value outside).
#[cube(launch_unchecked)]
fn copy_units_kernel(
    src: &Array<u32>,
    dst: &mut Array<u32>,
    src_byte: u32,
    dst_byte: u32,
    n: u32,
    first: u32,
    words: u32,
) {
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    let end = dst_byte + n;
    while w < words {
        let word = first + w;
        let start = word * 4;
        if start >= dst_byte && start + 4 <= end && (src_byte % 4) == (dst_byte % 4) {
            // A whole word of the run, the source aligned alike: one word read.
            dst[word as usize] = src[((src_byte + start - dst_byte) / 4) as usize];
        } else {
            let mut out = dst[word as usize];
            for b in 0..4u32 {
                let pos = start + b;
                if pos >= dst_byte && pos < end {
                    let s = src_byte + pos - dst_byte;
                    let byte = (src[(s / 4) as usize] >> ((s % 4) * 8)) & 0xFFu32;
                    out = (out & !(0xFFu32 << (b * 8))) | (byte << (b * 8));
                }
            }
            dst[word as usize] = out;
        }
        w += stride;
    }
}

/// Copies bytes `src_byte..src_byte + n` of `src` into `dst_byte..dst_byte + n` of `dst` (other
/// bytes of `dst` untouched). `src` and `dst` are different buffers.
pub fn copy_units<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    src_byte: usize,
    dst: &Handle,
    dst_byte: usize,
    n: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    check_size("src", src, (src_byte + n) as u64)?;
    check_size("dst", dst, (dst_byte + n) as u64)?;
    to_u32("src end", (src_byte + n) as u64)?;
    to_u32("dst end", (dst_byte + n).next_multiple_of(4) as u64)?;
    let first = dst_byte / 4;
    let words = (dst_byte + n).div_ceil(4) - first;
    let (count, dim) = grid(words);
    // SAFETY: every index is below the checked extents (a buffer's last word may be partly
    // used: buffers are whole words).
    unsafe {
        copy_units_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            words_arg(src),
            words_arg(dst),
            src_byte as u32,
            dst_byte as u32,
            n as u32,
            first as u32,
            words as u32,
        );
    }
    Ok(())
}

/// Accumulate kernel: `acc[i] (=|+=) value i` of the run (f32 word `at + i`, or bf16 half-word
/// `at + i`).
#[cube(launch_unchecked)]
fn accumulate_kernel(
    src: &Array<u32>,
    acc: &mut Array<f32>,
    n: u32,
    at: u32,
    #[comptime] bf16: bool,
    #[comptime] first: bool,
) {
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < n {
        let h = at + i;
        // (`h` indexes half-words for bf16, words for f32: each branch reads its own.)
        let bits = if bf16 {
            let word = src[(h / 2) as usize];
            let half = select(h % 2 == 0, word & 0xFFFFu32, word >> 16);
            let x = half << 16;
            // A signalling NaN widens quiet, as `half::bf16::to_f32` does.
            let quiet = select((x & 0x7FFF_FFFFu32) > 0x7F80_0000u32, 0x0040_0000u32, 0u32);
            x | quiet
        } else {
            src[h as usize]
        };
        let v = f32::reinterpret(bits);
        if first {
            acc[i as usize] = v;
        } else {
            acc[i as usize] += v;
        }
        i += stride;
    }
}

/// Sets (`first`) or increments the `n` values of `acc` (an f32 buffer) by the `n` values of
/// `dtype` at byte `src_byte` of `src` (a multiple of the value's size).
pub fn accumulate_units<R: Runtime>(
    client: &ComputeClient<R>,
    src: &Handle,
    src_byte: usize,
    dtype: SumDType,
    n: usize,
    acc: &Handle,
    first: bool,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    let size = dtype.bytes();
    if src_byte % size != 0 {
        return Err(KernelError::Shape(format!(
            "{dtype:?} values start on a multiple of {size} bytes, not {src_byte}"
        )));
    }
    check_size("src", src, (src_byte + size * n) as u64)?;
    check_size("acc", acc, (4 * n) as u64)?;
    to_u32("src units", (src_byte / size + n) as u64)?;
    let (count, dim) = grid(n);
    // SAFETY: every index is below the checked extents.
    unsafe {
        accumulate_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            words_arg(src),
            ArrayArg::from_raw_parts(acc.clone(), acc.size_in_used() as usize / 4),
            n as u32,
            (src_byte / size) as u32,
            dtype == SumDType::Bf16,
            first,
        );
    }
    Ok(())
}

/// Store kernel: f32 — word `at + i` is `acc[i]`; bf16 — invocation `w` writes word
/// `first + w`, whose half-words inside the run are the rounded accumulator.
#[cube(launch_unchecked)]
fn store_kernel(
    acc: &Array<f32>,
    dst: &mut Array<u32>,
    n: u32,
    at: u32,
    first: u32,
    words: u32,
    #[comptime] bf16: bool,
) {
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    if bf16 {
        while w < words {
            let word = first + w;
            let mut out = dst[word as usize];
            let lo = word * 2;
            if lo >= at && lo < at + n {
                let v = u32::reinterpret(round_bf16(acc[(lo - at) as usize])) >> 16;
                out = (out & 0xFFFF_0000u32) | v;
            }
            let hi = lo + 1;
            if hi >= at && hi < at + n {
                let v = u32::reinterpret(round_bf16(acc[(hi - at) as usize])) & 0xFFFF_0000u32;
                out = (out & 0xFFFFu32) | v;
            }
            dst[word as usize] = out;
            w += stride;
        }
    } else {
        while w < n {
            dst[(at + w) as usize] = u32::reinterpret(acc[w as usize]);
            w += stride;
        }
    }
}

/// Writes the `n` accumulated values of `acc` as `dtype` from byte `dst_byte` of `dst` (a
/// multiple of the value's size; other bytes untouched).
pub fn store_units<R: Runtime>(
    client: &ComputeClient<R>,
    acc: &Handle,
    n: usize,
    dtype: SumDType,
    dst: &Handle,
    dst_byte: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    let size = dtype.bytes();
    if dst_byte % size != 0 {
        return Err(KernelError::Shape(format!(
            "{dtype:?} values start on a multiple of {size} bytes, not {dst_byte}"
        )));
    }
    check_size("acc", acc, (4 * n) as u64)?;
    check_size("dst", dst, (dst_byte + size * n) as u64)?;
    to_u32("dst units", (dst_byte / size + n + 1) as u64)?;
    let at = dst_byte / size;
    let (first, words) = match dtype {
        SumDType::F32 => (at, n),
        SumDType::Bf16 => (at / 2, (at + n).div_ceil(2) - at / 2),
    };
    let (count, dim) = grid(words);
    // SAFETY: every index is below the checked extents.
    unsafe {
        store_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            ArrayArg::from_raw_parts(acc.clone(), acc.size_in_used() as usize / 4),
            words_arg(dst),
            n as u32,
            at as u32,
            first as u32,
            words as u32,
            dtype == SumDType::Bf16,
        );
    }
    Ok(())
}

/// `handle` as an array of whole words (a buffer's last word may be partly used).
///
/// # Safety
/// The kernel indexes only words below the checked extents.
unsafe fn words_arg<R: Runtime>(handle: &Handle) -> ArrayArg<R> {
    // SAFETY: the caller's.
    unsafe {
        ArrayArg::from_raw_parts(handle.clone(), (handle.size_in_used() as usize).div_ceil(4))
    }
}
