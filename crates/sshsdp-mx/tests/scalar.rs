//! Element and scale primitives: exhaustive element round trips, special values, scale
//! derivation at the rule boundaries.

use sshsdp_mx::{scale_byte, scale_to_f32, ElemFormat, ScaleRule, SCALE_NAN};

#[test]
fn every_element_byte_round_trips() {
    for fmt in [ElemFormat::E4M3, ElemFormat::E5M2] {
        for b in 0..=255u8 {
            let v = fmt.decode(b);
            if v.is_nan() {
                assert_eq!(fmt.encode(v), fmt.nan_byte());
            } else if v.is_infinite() {
                // satfinite: inf saturates to the largest finite value
                assert_eq!(fmt.encode(v), 0x7B | (b & 0x80), "{fmt:?} {b:#x}");
            } else {
                assert_eq!(fmt.encode(v), b, "{fmt:?} {b:#x} = {v}");
            }
        }
    }
}

#[test]
fn element_constants() {
    let e4 = ElemFormat::E4M3;
    assert_eq!(e4.decode(0x7E), 448.0);
    assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
    assert_eq!(e4.decode(0x01), 2f32.powi(-9));
    assert_eq!(e4.decode(0x08), 2f32.powi(-6));
    assert_eq!(e4.encode(1e9), 0x7E);
    assert_eq!(e4.encode(-1e9), 0xFE);
    assert_eq!(e4.encode(f32::INFINITY), 0x7E);
    assert_eq!(e4.encode(-0.0), 0x80);
    let e5 = ElemFormat::E5M2;
    assert_eq!(e5.decode(0x7B), 57344.0);
    assert_eq!(e5.decode(0x7C), f32::INFINITY);
    assert!(e5.decode(0x7D).is_nan());
    assert_eq!(e5.decode(0x01), 2f32.powi(-16));
    assert_eq!(e5.encode(60000.0), 0x7B);
    assert_eq!(e5.encode(f32::MAX), 0x7B);
    assert_eq!(e4.max_normal(), 448.0);
    assert_eq!(e5.min_normal(), 2f32.powi(-14));
}

#[test]
fn round_to_nearest_even_ties() {
    let e4 = ElemFormat::E4M3;
    assert_eq!(e4.encode(1.0625), e4.encode(1.0)); // tie -> even mantissa 000
    assert_eq!(e4.encode(1.1875), e4.encode(1.25)); // tie -> even mantissa 010
    assert_eq!(e4.encode(2f32.powi(-10)), 0x00); // tie between 0 and 2^-9
    assert_eq!(e4.encode(3.0 * 2f32.powi(-10)), 0x02);
    assert_eq!(e4.encode(15.0 * 2f32.powi(-10)), 0x08); // into the normal range
    assert_eq!(e4.encode(464.0), 0x7E); // would round to 480: saturates
    let e5 = ElemFormat::E5M2;
    assert_eq!(e5.encode(1.125), e5.encode(1.0));
    assert_eq!(e5.encode(1.375), e5.encode(1.5));
}

#[test]
fn scale_rules_at_boundaries() {
    let b = |v: f32, f, r| scale_byte(v.to_bits(), f, r);
    use ElemFormat::*;
    use ScaleRule::*;
    assert_eq!(b(448.0, E4M3, Rceil), 127);
    assert_eq!(b(f32::from_bits(448f32.to_bits() + 1), E4M3, Rceil), 128);
    assert_eq!(b(f32::from_bits(448f32.to_bits() - 1), E4M3, Rceil), 127);
    assert_eq!(b(256.0, E4M3, Rceil), 127);
    assert_eq!(b(255.9, E4M3, Rceil), 127);
    assert_eq!(b(224.0, E4M3, Rceil), 126);
    assert_eq!(b(511.0, E4M3, Floor), 127);
    assert_eq!(b(512.0, E4M3, Floor), 128);
    assert_eq!(b(57344.0, E5M2, Rceil), 127);
    assert_eq!(b(65535.0, E5M2, Floor), 127);
    assert_eq!(b(0.0, E4M3, Rceil), 0);
    assert_eq!(b(0.0, E5M2, Floor), 0);
    assert_eq!(b(1e-40, E4M3, Rceil), 0); // clamped to 2^-127
    assert_eq!(b(f32::MAX, E4M3, Rceil), 127 + 127 - 8 + 1);
    assert_eq!(b(f32::INFINITY, E4M3, Rceil), SCALE_NAN);
    assert_eq!(b(f32::NAN, E5M2, Floor), SCALE_NAN);
    // the sign bit is ignored
    assert_eq!(scale_byte((-448f32).to_bits(), E4M3, Rceil), 127);
}

#[test]
fn scale_values() {
    assert_eq!(scale_to_f32(127), 1.0);
    assert_eq!(scale_to_f32(0), 2f32.powi(-127));
    assert_eq!(scale_to_f32(254), 2f32.powi(127));
    assert!(scale_to_f32(255).is_nan());
}
