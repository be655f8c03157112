//! The 1×32 band-plane kernels (lab, feature `experimental`: the runtime stores square blocks,
//! `square.rs`) against `sshsdp-mx`'s row-wise and column-wise planes, bit for bit: quantise
//! from `f32` and `bf16` at offsets inside sentinel-filled buffers, dequantise random and
//! special bytes.
#![cfg(feature = "experimental")]
use crate::common::*;
use half::bf16;
use sshsdp_kernels::{dequantize_plane, quantize_plane, InputDType, Plane, PlaneAt, ScaleRule};
use sshsdp_mx::{decode_cols, decode_rows, encode_cols, encode_rows, ElemFormat, MxShape};

const SENTINEL: u32 = 0xDEAD_BEEF;
const SHAPES: [(usize, usize); 7] = [
    (1, 1),
    (33, 7),
    (32, 32),
    (70, 96),
    (64, 65),
    (5, 200),
    (96, 40),
];

/// The CPU plane of `x` (`rows × cols`): (data, scales).
fn cpu_plane<T: sshsdp_mx::MxInput>(
    x: &[T],
    shape: MxShape,
    plane: Plane,
    rule: ScaleRule,
) -> (Vec<u8>, Vec<u8>) {
    let fmt = ElemFormat::E4M3;
    match plane {
        Plane::Row => {
            let mut d = vec![0u8; shape.row_data_bytes()];
            let mut s = vec![0u8; shape.row_scale_bytes()];
            encode_rows(x, shape, fmt, rule, &mut d, &mut s).unwrap();
            (d, s)
        }
        Plane::Col => {
            let mut d = vec![0u8; shape.col_data_bytes()];
            let mut s = vec![0u8; shape.col_scale_bytes()];
            encode_cols(x, shape, fmt, rule, &mut d, &mut s).unwrap();
            (d, s)
        }
    }
}

/// Quantises `x` on the device (values at an element offset; data and scales at word offsets,
/// scales first) and checks every byte, and that nothing around the plane changed.
fn check(
    c: &cubecl::prelude::ComputeClient<R>,
    x: &[f32],
    rows: usize,
    cols: usize,
    plane: Plane,
    rule: ScaleRule,
    bf: bool,
) {
    let shape = MxShape::new(rows, cols);
    let (want_d, want_s) = if bf {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        cpu_plane(&xb, shape, plane, rule)
    } else {
        cpu_plane(x, shape, plane, rule)
    };
    let values_offset = 6;
    let input = if bf {
        let mut halves: Vec<u16> = vec![0; values_offset];
        halves.extend(x.iter().map(|&v| bf16::from_f32(v).to_bits()));
        if halves.len() % 2 == 1 {
            halves.push(0);
        }
        let words: Vec<u32> = halves
            .chunks(2)
            .map(|p| p[0] as u32 | (p[1] as u32) << 16)
            .collect();
        upload_u32(c, &words)
    } else {
        let mut v = vec![0f32; values_offset];
        v.extend_from_slice(x);
        upload_f32(c, &v)
    };
    let probe = PlaneAt {
        plane,
        rows,
        cols,
        values_offset,
        data_word: 0,
        scales_word: 0,
    };
    let (data_words, scale_words) = probe.words();
    let at = PlaneAt {
        scales_word: 3,
        data_word: 3 + scale_words + 2,
        ..probe
    };
    let total = at.data_word + data_words + 4;
    let out = upload_u32(c, &vec![SENTINEL; total]);
    let dtype = if bf {
        InputDType::Bf16
    } else {
        InputDType::F32
    };
    quantize_plane(c, &input, dtype, rule, at, &out).unwrap();
    let got = read_u32(c, &out);
    let what = format!("{plane:?} {rows}x{cols} {rule:?} bf16={bf}");
    for (i, &w) in got.iter().enumerate() {
        let inside = (at.scales_word..at.scales_word + scale_words).contains(&i)
            || (at.data_word..at.data_word + data_words).contains(&i);
        if !inside {
            assert_eq!(w, SENTINEL, "{what}: word {i} outside the plane changed");
        }
    }
    let data = words_to_bytes(&got[at.data_word..at.data_word + data_words]);
    let scales = words_to_bytes(&got[at.scales_word..at.scales_word + scale_words]);
    if let Some(i) = (0..want_d.len()).find(|&i| data[i] != want_d[i]) {
        panic!(
            "{what}: data byte {i} is {:#04x}, CPU {:#04x}",
            data[i], want_d[i]
        );
    }
    assert_eq!(&scales[..want_s.len()], &want_s[..], "{what}: scales");
    assert!(
        scales[want_s.len()..].iter().all(|&b| b == 0),
        "{what}: scale padding"
    );

    // Dequantise the device's plane into a sentinel-filled output at an offset.
    let out_values = upload_u32(c, &vec![SENTINEL; values_offset + rows * cols + 3]);
    dequantize_plane(c, &out, at, &out_values).unwrap();
    let got = read_u32(c, &out_values);
    let mut want = vec![0f32; rows * cols];
    match plane {
        Plane::Row => decode_rows(&want_d, &want_s, shape, ElemFormat::E4M3, &mut want).unwrap(),
        Plane::Col => decode_cols(&want_d, &want_s, shape, ElemFormat::E4M3, &mut want).unwrap(),
    }
    assert!(
        got[..values_offset].iter().all(|&w| w == SENTINEL),
        "{what}: before the values"
    );
    assert!(
        got[values_offset + rows * cols..]
            .iter()
            .all(|&w| w == SENTINEL),
        "{what}: after"
    );
    for (i, w) in want.iter().enumerate() {
        assert_eq!(got[values_offset + i], w.to_bits(), "{what}: value {i}");
    }
}

#[test]
fn band_planes_match_the_cpu_bit_for_bit() {
    let c = client();
    let mut rng = Rng::new(11);
    for (rows, cols) in SHAPES {
        let x = rng.vec(rows * cols, |r| r.wide(20));
        for plane in [Plane::Row, Plane::Col] {
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                for bf in [false, true] {
                    check(&c, &x, rows, cols, plane, rule, bf);
                }
            }
        }
    }
}

#[test]
fn band_planes_keep_special_values() {
    let c = client();
    let (rows, cols) = (40, 70);
    let mut rng = Rng::new(5);
    let mut x = rng.vec(rows * cols, |r| r.normal());
    // a NaN, an infinity, an all-zero block, huge and subnormal magnitudes
    x[3] = f32::NAN;
    x[100] = f32::INFINITY;
    x[200..232].iter_mut().for_each(|v| *v = 0.0);
    x[500] = f32::MAX;
    x[700] = 1e-40;
    x[900] = -0.0;
    for plane in [Plane::Row, Plane::Col] {
        check(&c, &x, rows, cols, plane, ScaleRule::Rceil, false);
    }
}

#[test]
fn band_plane_errors_are_reported() {
    let c = client();
    let input = upload_f32(&c, &[0.0; 64]);
    let out = upload_u32(&c, &[0; 4]);
    let at = PlaneAt {
        plane: Plane::Row,
        rows: 2,
        cols: 32,
        values_offset: 0,
        data_word: 0,
        scales_word: 0,
    };
    // too small an output, and data overlapping the scales
    assert!(quantize_plane(&c, &input, InputDType::F32, ScaleRule::Rceil, at, &out).is_err());
    let big = upload_u32(&c, &[0; 64]);
    assert!(quantize_plane(&c, &input, InputDType::F32, ScaleRule::Rceil, at, &big).is_err());
    let ok = PlaneAt {
        scales_word: 16,
        ..at
    };
    assert!(quantize_plane(&c, &input, InputDType::F32, ScaleRule::Rceil, ok, &big).is_ok());
}
