//! Round trips and layout invariants of the row plane, column plane and tiled layout:
//! identity on representable inputs, agreement between layouts, zero padding, tile ranges,
//! parallel variants.

mod common;

use common::{gauss_vec, same, Rng, SHAPES};
use half::bf16;
use sshsdp_mx::par::{
    decode_rows_par, decode_tiled_par, encode_cols_par, encode_rows_par, encode_tiled_par,
};
use sshsdp_mx::{
    decode_cols, decode_rows, decode_tiled, decode_tiled_range, encode_cols, encode_rows,
    encode_tiled, encode_tiled_range, tiled_bytes, ElemFormat, MxInput, MxShape, Plane, ScaleRule,
    BLOCK, TILE, TILE_BYTES, TILE_COL_DATA, TILE_COL_SCALES, TILE_ROW_DATA, TILE_ROW_SCALES,
};

const FMTS: [ElemFormat; 2] = [ElemFormat::E4M3, ElemFormat::E5M2];
const RULES: [ScaleRule; 2] = [ScaleRule::Rceil, ScaleRule::Floor];

/// All three encodings of a tensor.
struct Encoded {
    rd: Vec<u8>,
    rs: Vec<u8>,
    cd: Vec<u8>,
    cs: Vec<u8>,
    tl: Vec<u8>,
}

fn encode_all<T: MxInput>(x: &[T], s: MxShape, f: ElemFormat, r: ScaleRule) -> Encoded {
    // poison the buffers: every byte must be written
    let mut e = Encoded {
        rd: vec![0xA5; s.row_data_bytes()],
        rs: vec![0xA5; s.row_scale_bytes()],
        cd: vec![0xA5; s.col_data_bytes()],
        cs: vec![0xA5; s.col_scale_bytes()],
        tl: vec![0xA5; s.tiled_bytes()],
    };
    encode_rows(x, s, f, r, &mut e.rd, &mut e.rs).unwrap();
    encode_cols(x, s, f, r, &mut e.cd, &mut e.cs).unwrap();
    encode_tiled(x, s, f, r, &mut e.tl).unwrap();
    e
}

/// Decodes (row plane, column plane, tiled row part, tiled column part).
fn decode_all(e: &Encoded, s: MxShape, f: ElemFormat) -> [Vec<f32>; 4] {
    let mut out: [Vec<f32>; 4] = std::array::from_fn(|_| vec![f32::NAN; s.len()]);
    decode_rows(&e.rd, &e.rs, s, f, &mut out[0]).unwrap();
    decode_cols(&e.cd, &e.cs, s, f, &mut out[1]).unwrap();
    decode_tiled(&e.tl, s, f, Plane::Row, &mut out[2]).unwrap();
    decode_tiled(&e.tl, s, f, Plane::Col, &mut out[3]).unwrap();
    out
}

#[test]
fn representable_inputs_round_trip_exactly() {
    let mut rng = Rng::new(1);
    for &(rows, cols) in SHAPES {
        let s = MxShape::new(rows, cols);
        for f in FMTS {
            for k in [-100, -7, 0, 20, 100] {
                let m = 2f32.powi(k);
                let x: Vec<f32> = (0..s.len()).map(|_| rng.representable(f) * m).collect();
                // RCEIL never picks a scale above the one the values were built with, and
                // any smaller scale keeps them representable: identity in every layout.
                let e = encode_all(&x, s, f, ScaleRule::Rceil);
                for (i, d) in decode_all(&e, s, f).iter().enumerate() {
                    assert!(same(d, &x), "{rows}x{cols} {f:?} k={k} layout {i}");
                }
                // bf16 input of the same values (E4M3/E5M2 values are bf16-exact)
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let eb = encode_all(&xb, s, f, ScaleRule::Rceil);
                assert_eq!((&eb.rd, &eb.cd, &eb.tl), (&e.rd, &e.cd, &e.tl));
            }
        }
    }
}

#[test]
fn floor_round_trips_when_blocks_reach_max() {
    // With a +-max element in every row block and column block (tile diagonals), FLOOR
    // picks the same scale as RCEIL.
    let mut rng = Rng::new(2);
    for f in FMTS {
        let s = MxShape::new(64, 96);
        let mut x: Vec<f32> = (0..s.len()).map(|_| rng.representable(f)).collect();
        for r in 0..s.rows {
            for c in 0..s.cols {
                if r % 32 == c % 32 {
                    x[r * s.cols + c] = if rng.below(2) == 0 { 1.0 } else { -1.0 } * f.max_normal();
                }
            }
        }
        let e = encode_all(&x, s, f, ScaleRule::Floor);
        for d in decode_all(&e, s, f) {
            assert!(same(&d, &x));
        }
    }
}

#[test]
fn layouts_agree_on_random_data() {
    let mut rng = Rng::new(3);
    for &(rows, cols) in SHAPES {
        let s = MxShape::new(rows, cols);
        for f in FMTS {
            for r in RULES {
                let sc = 10f64.powi(rng.below(20) as i32 - 10);
                let x = gauss_vec(&mut rng, s.len(), sc);
                let e = encode_all(&x, s, f, r);
                let [row, col, trow, tcol] = decode_all(&e, s, f);
                assert!(
                    same(&row, &trow),
                    "{rows}x{cols}: tiled row part == row plane"
                );
                assert!(
                    same(&col, &tcol),
                    "{rows}x{cols}: tiled col part == col plane"
                );
                check_tiled_structure(&e, s);
                check_padding(&e, s);
            }
        }
    }
}

/// The tiled layout holds exactly the row/column plane bytes of each tile.
fn check_tiled_structure(e: &Encoded, s: MxShape) {
    let (rows_p, cols_p) = (s.rows_p(), s.cols_p());
    for t in 0..s.n_tiles() {
        let tile = &e.tl[t * TILE_BYTES..(t + 1) * TILE_BYTES];
        let (r0, c0) = ((t / s.tile_cols()) * TILE, (t % s.tile_cols()) * TILE);
        for i in 0..TILE {
            for j in 0..TILE {
                let (r, c) = (r0 + i, c0 + j);
                let row_byte = if r < s.rows { e.rd[r * cols_p + c] } else { 0 };
                assert_eq!(tile[TILE_ROW_DATA + i * TILE + j], row_byte);
                let col_byte = if c < s.cols { e.cd[c * rows_p + r] } else { 0 };
                assert_eq!(tile[TILE_COL_DATA + j * TILE + i], col_byte);
            }
            let r = r0 + i;
            let rs = if r < s.rows {
                e.rs[r * (cols_p / BLOCK) + c0 / BLOCK]
            } else {
                0
            };
            assert_eq!(tile[TILE_ROW_SCALES + i], rs);
            let c = c0 + i;
            let cs = if c < s.cols {
                e.cs[c * (rows_p / BLOCK) + r0 / BLOCK]
            } else {
                0
            };
            assert_eq!(tile[TILE_COL_SCALES + i], cs);
        }
    }
}

/// Padded positions of the planes are zero bytes.
fn check_padding(e: &Encoded, s: MxShape) {
    for r in 0..s.rows {
        assert!(e.rd[r * s.cols_p() + s.cols..(r + 1) * s.cols_p()]
            .iter()
            .all(|&b| b == 0));
    }
    for c in 0..s.cols {
        assert!(e.cd[c * s.rows_p() + s.rows..(c + 1) * s.rows_p()]
            .iter()
            .all(|&b| b == 0));
    }
}

#[test]
fn tiled_whole_equals_concatenated_ranges() {
    let mut rng = Rng::new(4);
    for (rows, cols) in [(95, 33), (64, 130), (1, 1), (100, 100)] {
        let s = MxShape::new(rows, cols);
        assert_eq!(tiled_bytes(rows, cols), s.n_tiles() * TILE_BYTES);
        let x = gauss_vec(&mut rng, s.len(), 3.0);
        let mut whole = vec![0u8; s.tiled_bytes()];
        encode_tiled(&x, s, ElemFormat::E4M3, ScaleRule::Rceil, &mut whole).unwrap();
        let mut whole_dec = vec![0f32; s.len()];
        decode_tiled(&whole, s, ElemFormat::E4M3, Plane::Row, &mut whole_dec).unwrap();
        for _ in 0..5 {
            // random partition of [0, n_tiles) into ranges (empty ranges allowed)
            let n = s.n_tiles();
            let mut cuts: Vec<usize> = (0..rng.below(4)).map(|_| rng.below(n + 1)).collect();
            cuts.extend([0, n]);
            cuts.sort();
            let mut concat = Vec::new();
            let mut dec = vec![f32::NAN; s.len()];
            for w in cuts.windows(2) {
                let mut part = vec![0xEEu8; (w[1] - w[0]) * TILE_BYTES];
                let (f, r) = (ElemFormat::E4M3, ScaleRule::Rceil);
                encode_tiled_range(&x, s, f, r, w[0], w[1], &mut part).unwrap();
                decode_tiled_range(&part, s, f, Plane::Row, w[0], w[1], &mut dec).unwrap();
                concat.extend_from_slice(&part);
            }
            assert_eq!(concat, whole);
            assert!(same(&dec, &whole_dec));
        }
    }
}

#[test]
fn parallel_variants_match_serial() {
    let mut rng = Rng::new(5);
    for &(rows, cols) in SHAPES.iter().chain(&[(130, 200)]) {
        let s = MxShape::new(rows, cols);
        let x = gauss_vec(&mut rng, s.len(), 1.0);
        let (f, r) = (ElemFormat::E5M2, ScaleRule::Floor);
        let e = encode_all(&x, s, f, r);
        let [row, _, trow, tcol] = decode_all(&e, s, f);
        for threads in [1, 2, 3, 7] {
            let mut rd = vec![0xA5; s.row_data_bytes()];
            let mut rs = vec![0xA5; s.row_scale_bytes()];
            encode_rows_par(&x, s, f, r, &mut rd, &mut rs, threads).unwrap();
            assert_eq!((&rd, &rs), (&e.rd, &e.rs));
            let mut cd = vec![0xA5; s.col_data_bytes()];
            let mut cs = vec![0xA5; s.col_scale_bytes()];
            encode_cols_par(&x, s, f, r, &mut cd, &mut cs, threads).unwrap();
            assert_eq!((&cd, &cs), (&e.cd, &e.cs));
            let mut tl = vec![0xA5; s.tiled_bytes()];
            encode_tiled_par(&x, s, f, r, &mut tl, threads).unwrap();
            assert_eq!(tl, e.tl);
            let mut out = vec![f32::NAN; s.len()];
            decode_rows_par(&rd, &rs, s, f, &mut out, threads).unwrap();
            assert!(same(&out, &row));
            decode_tiled_par(&tl, s, f, Plane::Row, &mut out, threads).unwrap();
            assert!(same(&out, &trow));
            decode_tiled_par(&tl, s, f, Plane::Col, &mut out, threads).unwrap();
            assert!(same(&out, &tcol));
        }
    }
}

#[test]
fn special_blocks_in_tensors() {
    // NaN/inf poison exactly the blocks that contain them; zero rows get scale 0.
    let s = MxShape::new(40, 70);
    let mut x = vec![1.5f32; s.len()];
    x[3 * 70 + 40] = f32::INFINITY; // row 3, block 1; column 40, block 0
    x.iter_mut().skip(10 * 70).take(70).for_each(|v| *v = 0.0);
    let (f, r) = (ElemFormat::E4M3, ScaleRule::Rceil);
    let e = encode_all(&x, s, f, r);
    let nb = s.cols_p() / BLOCK;
    assert_eq!(e.rs[3 * nb + 1], 0xFF);
    assert!(e.rd[3 * s.cols_p() + 32..3 * s.cols_p() + 64]
        .iter()
        .all(|&b| b == f.nan_byte()));
    assert_eq!(e.rs[3 * nb], 127 - 8); // 1.5 / 448 -> 2^-8
    assert!(e.rs[10 * nb..11 * nb].iter().all(|&b| b == 0));
    assert_eq!(e.cs[40 * 2], 0xFF);
    assert_ne!(e.cs[40 * 2 + 1], 0xFF);
    let [row, col, ..] = decode_all(&e, s, f);
    assert!(row[3 * 70 + 32..3 * 70 + 64].iter().all(|v| v.is_nan()));
    assert!(row[3 * 70..3 * 70 + 32].iter().all(|&v| v == 1.5));
    assert!((0..32).all(|r| col[r * 70 + 40].is_nan()));
    assert_eq!(col[33 * 70 + 40], 1.5);
    assert!(row[10 * 70..11 * 70].iter().all(|&v| v == 0.0));
}
