//! The 32-value block kernels: encode (amax pass, scale, element loop) and decode.

use crate::format::{encode_elem, ElemFormat, ScaleRule, Spec};
use crate::input::MxInput;
use crate::scale::{block_scale, inv_scale, scale_to_f32, SCALE_NAN};
use crate::BLOCK;

/// Loads up to 32 inputs into a zero-padded `f32` block.
#[inline(always)]
pub(crate) fn load<T: MxInput>(src: &[T], dst: &mut [f32; BLOCK]) {
    if src.len() == BLOCK {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    } else {
        dst.fill(0.0);
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

/// Encodes one block of 32 `f32` into element bytes; returns the scale byte.
///
/// A block holding NaN or ±inf gets the NaN scale and NaN in every element.
#[inline(always)]
pub(crate) fn encode_block_spec<T: MxInput, S: Spec>(
    x: &[T; BLOCK],
    rule: ScaleRule,
    out: &mut [u8; BLOCK],
) -> u8 {
    let mut amax = 0u32;
    for &v in x {
        amax = amax.max(v.to_f32().to_bits() & 0x7FFF_FFFF);
    }
    if amax >= 0x7F80_0000 {
        *out = [S::NAN; BLOCK];
        return SCALE_NAN;
    }
    let s = block_scale::<S>(amax, rule);
    let inv = inv_scale(s);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = encode_elem::<S>(v.to_f32(), inv);
    }
    s
}

/// Encodes one block of 32 values (`f32` or `bf16`) into 32 element bytes and returns the
/// E8M0 scale byte. This is the reference semantics of every layout in the crate.
pub fn encode_block<T: MxInput>(
    x: &[T; BLOCK],
    fmt: ElemFormat,
    rule: ScaleRule,
    out: &mut [u8; BLOCK],
) -> u8 {
    let mut f = [0f32; BLOCK];
    load(x, &mut f);
    match fmt {
        ElemFormat::E4M3 => encode_block_spec::<f32, crate::format::E4m3>(&f, rule, out),
        ElemFormat::E5M2 => encode_block_spec::<f32, crate::format::E5m2>(&f, rule, out),
    }
}

/// Decodes 32 element bytes with their scale byte into `f32` (exact, except that a product
/// beyond the f32 range becomes ±inf). A NaN scale gives NaN everywhere.
pub fn decode_block(data: &[u8; BLOCK], scale: u8, fmt: ElemFormat, out: &mut [f32; BLOCK]) {
    decode_run(data, scale, fmt.lut(), out);
}

/// Decodes a run of up to 32 bytes sharing one scale.
#[inline(always)]
pub(crate) fn decode_run(data: &[u8], scale: u8, lut: &[f32; 256], out: &mut [f32]) {
    let s = scale_to_f32(scale);
    for (o, &b) in out.iter_mut().zip(data) {
        *o = lut[b as usize] * s;
    }
}

/// Dispatches a closure over the format's compile-time spec so the inner loops see constants.
macro_rules! with_spec {
    ($fmt:expr, $S:ident => $body:expr) => {
        match $fmt {
            $crate::format::ElemFormat::E4M3 => {
                type $S = $crate::format::E4m3;
                $body
            }
            $crate::format::ElemFormat::E5M2 => {
                type $S = $crate::format::E5m2;
                $body
            }
        }
    };
}
pub(crate) use with_spec;
