//! The square-block kernels (the plan's runtime layout of MXFP8 weights) against
//! `sshsdp-mx`'s `encode_square` / `decode_square`, bit for bit: rectangles read from and
//! written to strided buffers at offsets, sentinel-filled around them, from `f32` and `bf16`,
//! ordinary and special values.
use crate::common::*;
use half::bf16;
use sshsdp_kernels::{dequantize_square, quantize_square, InputDType, ScaleRule, SquareAt};
use sshsdp_mx::{decode_square, encode_square, ElemFormat, MxShape};

const SENTINEL: u32 = 0xDEAD_BEEF;

/// Quantises the `rows × cols` rectangle of `x` (rows of `stride` values, from `offset`) on the
/// device, checks every byte against the CPU and that nothing around it changed, then decodes
/// it into a strided sentinel-filled buffer and checks every value.
#[allow(clippy::too_many_arguments)]
fn check(
    c: &cubecl::prelude::ComputeClient<R>,
    x: &[f32],
    (offset, stride): (usize, usize),
    rows: usize,
    cols: usize,
    rule: ScaleRule,
    bf: bool,
) {
    let shape = MxShape::new(rows, cols);
    let fmt = ElemFormat::E4M3;
    let mut want_d = vec![0u8; shape.square_data_bytes()];
    let mut want_s = vec![0u8; shape.square_scale_bytes()];
    let input = if bf {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        encode_square(
            &xb[offset..],
            stride,
            shape,
            fmt,
            rule,
            &mut want_d,
            &mut want_s,
        )
        .unwrap();
        let mut halves: Vec<u16> = xb.iter().map(|v| v.to_bits()).collect();
        if halves.len() % 2 == 1 {
            halves.push(0);
        }
        let words: Vec<u32> = halves
            .chunks(2)
            .map(|p| p[0] as u32 | (p[1] as u32) << 16)
            .collect();
        upload_u32(c, &words)
    } else {
        encode_square(
            &x[offset..],
            stride,
            shape,
            fmt,
            rule,
            &mut want_d,
            &mut want_s,
        )
        .unwrap();
        upload_f32(c, x)
    };
    let probe = SquareAt {
        rows,
        cols,
        values_offset: offset,
        values_stride: stride,
        data_word: 0,
        scales_word: 0,
    };
    let (data_words, scale_words) = probe.words();
    let at = SquareAt {
        data_word: 2,
        scales_word: 2 + data_words + 1,
        ..probe
    };
    let total = at.scales_word + scale_words + 3;
    let out = upload_u32(c, &vec![SENTINEL; total]);
    let dtype = if bf {
        InputDType::Bf16
    } else {
        InputDType::F32
    };
    quantize_square(c, &input, dtype, rule, at, &out).unwrap();
    let got = read_u32(c, &out);
    let what = format!("{rows}x{cols} stride {stride} {rule:?} bf16={bf}");
    for (i, &w) in got.iter().enumerate() {
        let inside = (at.scales_word..at.scales_word + scale_words).contains(&i)
            || (at.data_word..at.data_word + data_words).contains(&i);
        if !inside {
            assert_eq!(
                w, SENTINEL,
                "{what}: word {i} outside the rectangle changed"
            );
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
    assert!(
        data[want_d.len()..].iter().all(|&b| b == 0),
        "{what}: data padding"
    );
    assert_eq!(&scales[..want_s.len()], &want_s[..], "{what}: scales");
    assert!(
        scales[want_s.len()..].iter().all(|&b| b == 0),
        "{what}: scale padding"
    );

    // Decode into a strided sentinel-filled buffer: the rectangle's places only.
    let (dst_offset, dst_stride) = (5, cols + 3);
    let extent = dst_offset + (rows - 1) * dst_stride + cols;
    let out_values = upload_u32(c, &vec![SENTINEL; extent + 4]);
    dequantize_square(
        c,
        &out,
        SquareAt {
            values_offset: dst_offset,
            values_stride: dst_stride,
            ..at
        },
        &out_values,
    )
    .unwrap();
    let got = read_u32(c, &out_values);
    let mut want = vec![f32::from_bits(SENTINEL); extent + 4];
    decode_square(
        &want_d,
        &want_s,
        shape,
        fmt,
        &mut want[dst_offset..],
        dst_stride,
    )
    .unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(got[i], w.to_bits(), "{what}: decoded value {i}");
    }
}

#[test]
fn square_blocks_match_the_cpu_bit_for_bit() {
    let c = client();
    let mut rng = Rng::new(21);
    for (rows, cols) in [
        (1, 1),
        (33, 7),
        (32, 32),
        (70, 96),
        (64, 65),
        (5, 200),
        (96, 40),
    ] {
        for (offset, extra) in [(0, 0), (6, 0), (3, 37)] {
            let stride = cols + extra;
            let x = rng.vec(offset + rows * stride, |r| r.wide(20));
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                for bf in [false, true] {
                    check(&c, &x, (offset, stride), rows, cols, rule, bf);
                }
            }
        }
    }
}

#[test]
fn square_blocks_keep_special_values() {
    let c = client();
    let (rows, cols) = (70, 66);
    let mut rng = Rng::new(5);
    let mut x = rng.vec(rows * cols, |r| r.normal());
    // a NaN and an infinity (two tiles), an all-zero tile, huge and subnormal magnitudes
    x[3] = f32::NAN;
    x[40 * cols + 50] = f32::INFINITY;
    for r in 32..64 {
        x[r * cols..r * cols + 32].iter_mut().for_each(|v| *v = 0.0);
    }
    x[5 * cols + 40] = f32::MAX;
    x[65 * cols + 1] = 1e-40;
    x[66 * cols + 2] = -0.0;
    check(&c, &x, (0, cols), rows, cols, ScaleRule::Rceil, false);
}

#[test]
fn square_block_errors_are_reported() {
    let c = client();
    let input = upload_f32(&c, &[0.0; 64]);
    let at = SquareAt {
        rows: 2,
        cols: 32,
        values_offset: 0,
        values_stride: 32,
        data_word: 0,
        scales_word: 0,
    };
    let big = upload_u32(&c, &[0; 64]);
    let (rule, f32s) = (ScaleRule::Rceil, InputDType::F32);
    // data overlapping the scales, too small an output, a stride shorter than a row, values
    // past the input
    assert!(quantize_square(&c, &input, f32s, rule, at, &big).is_err());
    let ok = SquareAt {
        scales_word: 16,
        ..at
    };
    assert!(quantize_square(&c, &input, f32s, rule, ok, &upload_u32(&c, &[0; 8])).is_err());
    let short = SquareAt {
        values_stride: 31,
        ..ok
    };
    assert!(quantize_square(&c, &input, f32s, rule, short, &big).is_err());
    let past = SquareAt {
        values_offset: 1,
        ..ok
    };
    assert!(quantize_square(&c, &input, f32s, rule, past, &big).is_err());
    assert!(quantize_square(&c, &input, f32s, rule, ok, &big).is_ok());
}
