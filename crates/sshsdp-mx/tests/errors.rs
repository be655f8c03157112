//! Bad arguments return `MxError`, never panic.

use sshsdp_mx::par::{
    decode_rows_par, decode_tiled_par, encode_cols_par, encode_rows_par, encode_tiled_par,
};
use sshsdp_mx::{
    decode_cols, decode_rows, decode_tiled, decode_tiled_range, encode_cols, encode_rows,
    encode_tiled, encode_tiled_range, ElemFormat, MxError, MxShape, Plane, ScaleRule, TILE_BYTES,
};

const F: ElemFormat = ElemFormat::E4M3;
const R: ScaleRule = ScaleRule::Rceil;

fn is_len(r: Result<(), MxError>, what: &str) -> bool {
    matches!(r, Err(MxError::BufferLength { what: w, .. }) if w == what)
}

#[test]
fn plane_buffer_lengths() {
    let s = MxShape::new(33, 7); // rows_p 64, cols_p 32
    let x = vec![1.0f32; s.len()];
    let (mut rd, mut rs) = (vec![0; 33 * 32], vec![0; 33]);
    let (mut cd, mut cs) = (vec![0; 7 * 64], vec![0; 7 * 2]);
    assert!(encode_rows(&x, s, F, R, &mut rd, &mut rs).is_ok());
    assert!(encode_cols(&x, s, F, R, &mut cd, &mut cs).is_ok());
    assert!(is_len(
        encode_rows(&x[1..], s, F, R, &mut rd, &mut rs),
        "src"
    ));
    assert!(is_len(
        encode_rows(&x, s, F, R, &mut rd[1..], &mut rs),
        "data"
    ));
    assert!(is_len(
        encode_rows(&x, s, F, R, &mut rd, &mut rs[1..]),
        "scales"
    ));
    assert!(is_len(
        encode_cols(&x, s, F, R, &mut cd[1..], &mut cs),
        "data"
    ));
    assert!(is_len(
        encode_cols(&x, s, F, R, &mut cd, &mut [0; 8]),
        "scales"
    ));
    assert!(is_len(encode_cols(&x, s, F, R, &mut rd, &mut rs), "data"));
    let mut out = vec![0f32; s.len()];
    assert!(decode_rows(&rd, &rs, s, F, &mut out).is_ok());
    assert!(decode_cols(&cd, &cs, s, F, &mut out).is_ok());
    assert!(is_len(decode_rows(&rd, &rs, s, F, &mut out[1..]), "src"));
    assert!(is_len(decode_rows(&rd[2..], &rs, s, F, &mut out), "data"));
    assert!(is_len(decode_cols(&cd, &cs[1..], s, F, &mut out), "scales"));
    assert!(is_len(
        encode_rows_par(&x, s, F, R, &mut rd[1..], &mut rs, 2),
        "data"
    ));
    assert!(is_len(
        encode_cols_par(&x, s, F, R, &mut cd, &mut cs[1..], 2),
        "scales"
    ));
    assert!(is_len(
        decode_rows_par(&rd, &rs, s, F, &mut out[1..], 2),
        "src"
    ));
}

#[test]
fn tiled_buffer_lengths_and_ranges() {
    let s = MxShape::new(33, 40); // 2 x 2 tiles
    let x = vec![1.0f32; s.len()];
    let mut tl = vec![0u8; 4 * TILE_BYTES];
    assert!(encode_tiled(&x, s, F, R, &mut tl).is_ok());
    assert!(is_len(encode_tiled(&x, s, F, R, &mut tl[1..]), "out"));
    assert!(is_len(encode_tiled(&x[1..], s, F, R, &mut tl), "src"));
    assert!(is_len(
        encode_tiled_par(&x, s, F, R, &mut tl[1..], 3),
        "out"
    ));
    let mut part = vec![0u8; TILE_BYTES];
    assert!(encode_tiled_range(&x, s, F, R, 3, 4, &mut part).is_ok());
    assert!(is_len(
        encode_tiled_range(&x, s, F, R, 2, 4, &mut part),
        "out"
    ));
    assert_eq!(
        encode_tiled_range(&x, s, F, R, 4, 5, &mut part),
        Err(MxError::TileRange {
            t0: 4,
            t1: 5,
            n_tiles: 4
        })
    );
    assert!(matches!(
        encode_tiled_range(&x, s, F, R, 3, 2, &mut part),
        Err(MxError::TileRange { .. })
    ));
    let mut out = vec![0f32; s.len()];
    assert!(decode_tiled(&tl, s, F, Plane::Col, &mut out).is_ok());
    assert!(is_len(
        decode_tiled(&tl[..100], s, F, Plane::Row, &mut out),
        "src"
    ));
    assert!(is_len(
        decode_tiled(&tl, s, F, Plane::Row, &mut out[1..]),
        "out"
    ));
    assert!(is_len(
        decode_tiled_par(&tl, s, F, Plane::Row, &mut out[1..], 2),
        "out"
    ));
    assert!(matches!(
        decode_tiled_range(&part, s, F, Plane::Row, 4, 5, &mut out),
        Err(MxError::TileRange { .. })
    ));
    assert!(is_len(
        decode_tiled_range(&part, s, F, Plane::Row, 0, 2, &mut out),
        "src"
    ));
}

#[test]
fn oversized_shapes() {
    let s = MxShape::new(usize::MAX, 2);
    let mut b = [0u8; 0];
    let x: [f32; 0] = [];
    assert!(matches!(
        encode_rows(&x, s, F, R, &mut b, &mut []),
        Err(MxError::ShapeOverflow { .. })
    ));
    let s = MxShape::new(1 << 40, 1 << 40);
    assert!(matches!(
        encode_tiled(&x, s, F, R, &mut b),
        Err(MxError::ShapeOverflow { .. })
    ));
    assert!(s.validate().is_err());
    assert!(MxShape::new(0, 0).validate().is_ok());
}
