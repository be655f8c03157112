//! E8M0 block scales: derivation from `amax` (exact integer arithmetic on the f32 bits) and
//! conversion to `f32`.

use crate::format::{ElemFormat, ScaleRule, Spec};

/// The E8M0 byte meaning NaN.
pub const SCALE_NAN: u8 = 0xFF;
/// Largest finite E8M0 byte (2^127).
pub const SCALE_MAX: u8 = 0xFE;
/// The scale byte of an all-zero block (2^-127, the smallest E8M0 value).
pub const SCALE_ZERO_BLOCK: u8 = 0x00;

/// Scale byte for a block whose largest magnitude has the f32 bits `amax_bits` (sign
/// cleared). NaN or ±inf give [`SCALE_NAN`]; zero gives [`SCALE_ZERO_BLOCK`].
pub fn scale_byte(amax_bits: u32, fmt: ElemFormat, rule: ScaleRule) -> u8 {
    if amax_bits & 0x7FFF_FFFF >= 0x7F80_0000 {
        return SCALE_NAN;
    }
    scale_byte_finite(amax_bits & 0x7FFF_FFFF, fmt.emax() as u32, rule)
}

/// Scale byte for a finite `amax` given `emax` of the element format.
#[inline(always)]
pub(crate) fn scale_byte_finite(amax_bits: u32, emax: u32, rule: ScaleRule) -> u8 {
    // amax = 1.m * 2^(e - 127); a subnormal (or zero) amax clamps to byte 0 under both rules.
    let e = (amax_bits >> 23) as i32;
    let up = match rule {
        // max_elem = 1.75 * 2^emax, so ceil(log2(amax / max_elem)) = (e-127) - emax + [m > 0.75].
        ScaleRule::Rceil => ((amax_bits & 0x7F_FFFF) > 0x60_0000) as i32,
        ScaleRule::Floor => 0,
    };
    let byte = if e == 0 { 0 } else { e - emax as i32 + up };
    byte.clamp(0, SCALE_MAX as i32) as u8
}

/// Generic-over-format form of [`scale_byte_finite`].
#[inline(always)]
pub(crate) fn block_scale<S: Spec>(amax_bits: u32, rule: ScaleRule) -> u8 {
    scale_byte_finite(amax_bits, S::EMAX, rule)
}

/// Value of a scale byte: `2^(s - 127)`, NaN for `0xFF`.
#[inline]
pub fn scale_to_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000), // 2^-127 (f32 subnormal, exact)
        SCALE_NAN => f32::NAN,
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// Reciprocal of a finite scale byte: `2^(127 - s)` (exact).
#[inline(always)]
pub(crate) fn inv_scale(s: u8) -> f32 {
    if s == SCALE_MAX {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((SCALE_MAX as u32 - s as u32) << 23)
    }
}
