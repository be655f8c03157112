//! E4M3 elements and E8M0 scales as bit operations on `u32` (no fp8 types, no denormal
//! behaviour of the device involved), so the results equal the CPU reference `sshsdp-mx` bit
//! for bit on every runtime, WGSL included: exact integer encode/decode, plus a float encoder
//! ([`encode_e4m3_fast`](fn@encode_e4m3_fast)) used only for the scales where it is provably exact.
//!
//! Also the `bf16` rounding ([`round_bf16()`]) of [`crate::narrow_bf16`] and of the exchange
//! kernels' bf16 stores (and of the lab's bf16-storage Newton–Schulz iteration).
//!
//! Bytes travel in `u32` words, four per word, little endian (byte `i` of a buffer is bits
//! `8·(i % 4)..` of word `i / 4`), which is the byte layout of `sshsdp-mx`'s buffers.

// The expand modules `#[cube]` generates for public functions have no docs (every item
// written here has).
#![allow(missing_docs)]

use cubecl::prelude::*;

/// Bits of `f32` with the sign cleared at or above which a value is ±inf or NaN.
pub const F32_INF_BITS: u32 = 0x7F80_0000;
/// E8M0 scale byte meaning NaN (a block holding NaN or ±inf).
pub const SCALE_NAN: u32 = 0xFF;
/// E4M3 byte written for every element of a NaN block.
pub const E4M3_NAN: u32 = 0x7F;
/// Largest finite E4M3 byte (448).
pub const E4M3_MAX: u32 = 0x7E;
/// Bits of the quiet NaN the decoders write (what `f32::NAN` is on the CPU).
pub const F32_QNAN: u32 = 0x7FC0_0000;

/// E8M0 scale byte of a block whose largest magnitude has the `f32` bits `amax_bits` (sign
/// cleared), for E4M3 (`emax = 8`): RCEIL `2^ceil(log2(amax / 448))` when `rceil`, else FLOOR
/// `2^(floor(log2(amax)) - 8)`, clamped to `0..=254`; NaN/inf give [`SCALE_NAN`], zero gives 0.
#[cube]
pub fn scale_byte(amax_bits: u32, #[comptime] rceil: bool) -> u32 {
    let e = (amax_bits >> 23) as i32;
    let mut up = 0i32;
    if rceil {
        // 448 = 1.75 · 2^8: round up when the mantissa exceeds 0.75.
        if (amax_bits & 0x7F_FFFF) > 0x60_0000 {
            up = 1;
        }
    }
    let mut byte = e - 8 + up;
    if e == 0 {
        byte = 0;
    }
    let mut out = min(max(byte, 0i32), 254i32) as u32;
    if amax_bits >= F32_INF_BITS {
        out = SCALE_NAN;
    }
    out
}

/// Encodes the finite `f32` with bits `x_bits` times `2^(127 - s)` (`s` a finite scale byte)
/// to an E4M3 byte: round to nearest even, saturating to ±448, keeping the sign of zero.
/// Exact integer arithmetic: the scaled value is formed as a normalised significand and an
/// unbounded exponent, so `f32` subnormal inputs and products need no device support.
#[cube]
pub fn encode_e4m3(x_bits: u32, s: u32) -> u32 {
    let sign = (x_bits >> 24) & 0x80;
    let ax = x_bits & 0x7FFF_FFFF;
    let ex = ax >> 23;
    let mx = ax & 0x7F_FFFF;
    // |x| · 2^(127 - s) = mm · 2^(p - 23), with bit 23 of mm set.
    let mut mm = mx | 0x80_0000;
    let mut p = ex as i32 - s as i32;
    if ex == 0 {
        // f32 subnormal: normalise (mx < 2^23, so lz >= 9; mx == 0 gives mm == 0).
        let lz = mx.leading_zeros();
        mm = mx << (min(lz, 31u32) - 8);
        p = 9i32 - lz as i32 - s as i32;
    }
    // beyond 448: saturate
    let mut code = 0x7Eu32; // E4M3_MAX
    if p < 8 || (p == 8 && (mm & 0x7F_FFFF) <= 0x60_0000) {
        if p >= -6 {
            // normal E4M3: round the f32 bits to 3 mantissa bits, then rebias 127 -> 7
            let ab = (((p + 127) as u32) << 23) | (mm & 0x7F_FFFF);
            code = ((ab + 0x7_FFFF + ((ab >> 20) & 1)) >> 20) - 960;
        } else {
            // subnormal E4M3 (spacing 2^-9): value / 2^-9 = mm · 2^(p - 14), rounded to even
            let sh = min(14i32 - p, 25i32) as u32;
            let q = mm >> sh;
            let rem = mm & ((1u32 << sh) - 1);
            let half = 1u32 << (sh - 1);
            code = q;
            if rem > half || (rem == half && (q & 1) == 1) {
                code = q + 1;
            }
        }
    }
    if ax == 0 {
        code = 0;
    }
    code | sign
}

/// Decodes the E4M3 byte `b` times the E8M0 scale `2^(s - 127)` to `f32` bits, exactly
/// (products below `2^-126` become `f32` subnormals, beyond `f32::MAX` ±inf). NaN elements
/// give the NaN with the element's sign; a NaN scale gives [`F32_QNAN`] (the bits the CPU's
/// `lut[b] * scale` produces).
#[cube]
#[allow(clippy::manual_range_contains)]
pub fn decode_e4m3(b: u32, s: u32) -> u32 {
    let sign = (b & 0x80) << 24;
    let mag = b & 0x7F;
    let e = mag >> 3;
    let m = mag & 7;
    // value = im · 2^k
    let mut im = m | 8;
    let mut k = e as i32 - 10i32;
    if e == 0 {
        im = m;
        k = -9i32;
    }
    k += s as i32 - 127i32;
    let lb = 31i32 - min(im.leading_zeros(), 31u32) as i32;
    let exp = k + lb;
    // beyond the f32 range: inf
    let mut bits = 0x7F80_0000u32; // F32_INF_BITS
    if exp >= -126 && exp < 128 {
        bits = (((exp + 127) as u32) << 23) | ((im << (23 - lb) as u32) & 0x7F_FFFF);
    } else if exp < -126 {
        // k >= -136: im · 2^k is a multiple of 2^-149, an exact f32 subnormal
        bits = im << (k + 149) as u32;
    }
    if im == 0 {
        bits = 0;
    }
    bits |= sign;
    if s == SCALE_NAN {
        bits = F32_QNAN;
    }
    if mag == 0x7F {
        bits = F32_QNAN | sign;
    }
    bits
}

/// Smallest scale byte for which [`decode_e4m3_fast`](fn@decode_e4m3_fast) is exact on every device: from it on
/// every nonzero product is a normal `f32` (`2^-9 · 2^(s - 127) >= 2^-126`).
pub const FAST_DECODE_MIN: u32 = 10;
/// Largest scale byte for which [`decode_e4m3_fast`](fn@decode_e4m3_fast) is exact: every product is finite
/// (`448 · 2^(s - 127) < 2^128`).
pub const FAST_DECODE_MAX: u32 = 246;

/// [`decode_e4m3`](fn@decode_e4m3) with one float product (about half the operations), for scale bytes
/// `FAST_DECODE_MIN..=FAST_DECODE_MAX`; NaN elements as in [`decode_e4m3`](fn@decode_e4m3).
#[cube]
pub fn decode_e4m3_fast(b: u32, s: u32) -> u32 {
    let sign = (b & 0x80) << 24;
    let mag = b & 0x7F;
    // E4M3 value: normal ones rebias the exponent (7 -> 127), subnormal ones are m · 2^-9
    let mut v = f32::reinterpret((mag << 20) + (120u32 << 23));
    if mag < 8 {
        v = f32::cast_from(mag) * 0.001953125f32;
    }
    let mut bits = u32::reinterpret(v * f32::reinterpret(s << 23)) | sign;
    if mag == 0x7F {
        bits = F32_QNAN | sign;
    }
    bits
}

/// Decodes the E4M3 byte `b` with scale byte `s` to `f32` bits: [`decode_e4m3_fast`](fn@decode_e4m3_fast) where it is
/// exact, [`decode_e4m3`](fn@decode_e4m3) elsewhere.
#[cube]
#[allow(clippy::manual_range_contains)]
pub fn decode_byte(b: u32, s: u32) -> u32 {
    let fast = s >= FAST_DECODE_MIN && s <= FAST_DECODE_MAX;
    if fast {
        decode_e4m3_fast(b, s)
    } else {
        decode_e4m3(b, s)
    }
}

/// Smallest scale byte for which [`encode_e4m3_fast`](fn@encode_e4m3_fast) is exact on every device: below it an
/// `f32` subnormal input could encode to a nonzero byte, and devices may flush subnormals.
pub const FAST_MIN_SCALE: u32 = 12;

/// [`encode_e4m3`](fn@encode_e4m3) with float arithmetic (about a third of the operations), exact for scale
/// bytes `FAST_MIN_SCALE..254` with `inv = 2^(127 - s)`: the power-of-two product is exact
/// whenever it is a normal `f32`, smaller products encode to zero, and the subnormal E4M3
/// range is rounded by the `2^14` addition (correctly rounded in CUDA and WGSL alike) as on
/// the CPU.
#[cube]
pub fn encode_e4m3_fast(x_bits: u32, inv: f32) -> u32 {
    let sign = (x_bits >> 24) & 0x80;
    let a = min(f32::reinterpret(x_bits & 0x7FFF_FFFF) * inv, 448.0f32);
    let ab = u32::reinterpret(a);
    // normal E4M3 (wraps for a < 2^-6, where the subnormal result is selected)
    let norm = ((ab + 0x7_FFFF + ((ab >> 20) & 1)) >> 20) - 960;
    // subnormal E4M3: 2^14 + a rounds a to the spacing 2^-9; 0x4680_0000 = bits of 2^14
    let sub = u32::reinterpret(a + 16384.0f32) - 0x4680_0000;
    select(a < 0.015625f32, sub, norm) | sign
}

/// Encodes four values (`f32` bits) with the scale byte `s` into one little-endian word;
/// a NaN scale gives four NaN bytes. Uses the float encoder where it is exact. Lab: the
/// word-at-a-time quantisers of the tiled and 1×32 layouts (`experimental`) use it.
#[cfg(feature = "experimental")]
#[cube]
#[allow(clippy::manual_range_contains)]
pub fn encode_word(v0: u32, v1: u32, v2: u32, v3: u32, s: u32) -> u32 {
    // E4M3_NAN in every byte
    let mut w = 0x7F7F_7F7Fu32;
    if s >= FAST_MIN_SCALE && s < 254 {
        let inv = f32::reinterpret((254 - s) << 23);
        w = encode_e4m3_fast(v0, inv)
            | (encode_e4m3_fast(v1, inv) << 8)
            | (encode_e4m3_fast(v2, inv) << 16)
            | (encode_e4m3_fast(v3, inv) << 24);
    } else if s != SCALE_NAN {
        w = encode_e4m3(v0, s)
            | (encode_e4m3(v1, s) << 8)
            | (encode_e4m3(v2, s) << 16)
            | (encode_e4m3(v3, s) << 24);
    }
    w
}

/// Byte `i` (`0..4`) of a little-endian word.
#[cube]
pub fn byte_of(word: u32, i: u32) -> u32 {
    (word >> (i * 8)) & 0xFF
}

/// Rounds `v` to the nearest `bf16` value (ties to even), kept as `f32` (NaN stays NaN).
#[cube]
pub fn round_bf16(v: f32) -> f32 {
    let b = u32::reinterpret(v);
    let mut r = (b + 0x7FFFu32 + ((b >> 16) & 1u32)) & 0xFFFF_0000u32;
    if (b & 0x7FFF_FFFFu32) > 0x7F80_0000u32 {
        r = (b | 0x0040_0000u32) & 0xFFFF_0000u32;
    }
    f32::reinterpret(r)
}
