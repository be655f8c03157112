//! The two-plane 32×32 tiled MXFP8 quantise / dequantise kernels (lab, feature
//! `experimental`: the runtime stores square blocks, `square.rs`) against the CPU reference
//! `sshsdp-mx`, bit for bit.
#![cfg(feature = "experimental")]
use crate::common::*;
use half::bf16;
use sshsdp_kernels::{dequantize_tiled, quantize_tiled, InputDType, Plane, ScaleRule};
use sshsdp_mx::{decode_tiled, encode_tiled, tiled_bytes, ElemFormat, MxShape};

const RULES: [ScaleRule; 2] = [ScaleRule::Rceil, ScaleRule::Floor];
const SENTINEL: u32 = 0xDEAD_BEEF;

/// Quantises `x` on the device at a word offset inside a sentinel-filled buffer and checks
/// the bytes against `encode_tiled` and the untouched surroundings.
fn check_quantize(c: &Client, x: &[f32], rows: usize, cols: usize, what: &str) {
    let shape = MxShape::new(rows, cols);
    let nbytes = tiled_bytes(rows, cols);
    for rule in RULES {
        let mut want = vec![0u8; nbytes];
        encode_tiled(x, shape, ElemFormat::E4M3, rule, &mut want).unwrap();
        let offset = 5;
        let total = offset + nbytes / 4 + 3;
        let out = upload_u32(c, &vec![SENTINEL; total]);
        let input = upload_f32(c, x);
        quantize_tiled(c, &input, InputDType::F32, rows, cols, rule, &out, offset).unwrap();
        let got = read_u32(c, &out);
        assert!(
            got[..offset].iter().all(|&w| w == SENTINEL),
            "{what}: words before the offset changed"
        );
        assert!(
            got[offset + nbytes / 4..].iter().all(|&w| w == SENTINEL),
            "{what}: words after the layout changed"
        );
        let got = words_to_bytes(&got[offset..offset + nbytes / 4]);
        if let Some(i) = (0..nbytes).find(|&i| got[i] != want[i]) {
            panic!(
                "{what} {rows}x{cols} {rule:?}: byte {i} (tile {}, offset {}) is {:#04x}, CPU {:#04x}",
                i / 2112,
                i % 2112,
                got[i],
                want[i]
            );
        }

        // bf16 input of the same values (rounded to bf16 first)
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut want_b = vec![0u8; nbytes];
        encode_tiled(&xb, shape, ElemFormat::E4M3, rule, &mut want_b).unwrap();
        let mut halves: Vec<u16> = xb.iter().map(|v| v.to_bits()).collect();
        if halves.len() % 2 == 1 {
            halves.push(0);
        }
        let words: Vec<u32> = halves
            .chunks(2)
            .map(|p| p[0] as u32 | (p[1] as u32) << 16)
            .collect();
        let input_b = upload_u32(c, &words);
        let out_b = c.empty(nbytes);
        quantize_tiled(c, &input_b, InputDType::Bf16, rows, cols, rule, &out_b, 0).unwrap();
        let got_b = words_to_bytes(&read_u32(c, &out_b));
        assert!(
            got_b == want_b,
            "{what} {rows}x{cols} {rule:?}: bf16 input differs from the CPU"
        );
    }
}

/// Dequantises both planes of `bytes` on the device and compares the `f32` bits with
/// `decode_tiled`.
fn check_dequantize(c: &Client, bytes: &[u8], rows: usize, cols: usize, what: &str) {
    let shape = MxShape::new(rows, cols);
    let offset = 3;
    let mut words = vec![SENTINEL; offset];
    words.extend(bytes_to_words(bytes));
    let src = upload_u32(c, &words);
    for plane in [Plane::Row, Plane::Col] {
        let mut want = vec![0f32; rows * cols];
        decode_tiled(bytes, shape, ElemFormat::E4M3, plane, &mut want).unwrap();
        let out = c.empty(rows * cols * 4);
        dequantize_tiled(c, &src, offset, rows, cols, plane, &out).unwrap();
        let got = read_u32(c, &out);
        for (i, (&g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w.to_bits(),
                "{what} {rows}x{cols} {plane:?}: element ({}, {}) is {:#010x} ({}), CPU {:#010x} ({})",
                i / cols,
                i % cols,
                g,
                f32::from_bits(g),
                w.to_bits(),
                w
            );
        }
    }
}

type Client = cubecl::client::ComputeClient<R>;

const SHAPES: [(usize, usize); 9] = [
    (1, 1),
    (32, 32),
    (33, 70),
    (7, 1),
    (1, 100),
    (64, 96),
    (100, 257),
    (31, 33),
    (96, 64),
];

#[test]
fn quantize_random_matches_cpu() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0001);
    for (rows, cols) in SHAPES {
        let x = rng.vec(rows * cols, |r| r.wide(12));
        check_quantize(&c, &x, rows, cols, "random");
    }
}

#[test]
fn quantize_edge_cases_match_cpu() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0002);
    let (rows, cols) = (33, 70);
    let n = rows * cols;
    let cases: Vec<(&str, Vec<f32>)> = vec![
        ("zeros", vec![0.0; n]),
        ("negative zeros", vec![-0.0; n]),
        ("sparse NaN", {
            let mut x = rng.vec(n, |r| r.normal());
            x[5] = f32::NAN;
            x[43] = -f32::NAN;
            x[n - 1] = f32::NAN;
            x
        }),
        ("inf", {
            let mut x = rng.vec(n, |r| r.normal());
            x[100] = f32::INFINITY;
            x[1000] = f32::NEG_INFINITY;
            x
        }),
        ("f32 subnormals", rng.vec(n, |r| r.normal() * 1e-39)),
        ("tiny", rng.vec(n, |r| r.normal() * 1e-30)),
        // scale bytes below the float encoder's range (integer path), some subnormal inputs
        (
            "integer-path scales",
            rng.vec(n, |r| r.normal() * 2f32.powi(-112)),
        ),
        (
            "fast-path boundary",
            rng.vec(n, |r| r.wide(3) * 2f32.powi(-107)),
        ),
        ("e4m3 subnormal range", rng.vec(n, |r| r.wide(14))),
        ("huge", rng.vec(n, |r| r.normal() * 1e37)),
        (
            "near f32::MAX",
            rng.vec(n, |r| {
                f32::MAX * (1.0 - r.uniform() * 1e-3) * if r.uniform() < 0.5 { -1.0 } else { 1.0 }
            }),
        ),
        (
            "powers of two",
            rng.vec(n, |r| 2f32.powi((r.next_u64() % 60) as i32 - 30)),
        ),
        (
            "near 448 ratios",
            rng.vec(n, |r| 448.0 * (1.0 + (r.uniform() - 0.5) * 0.2)),
        ),
        ("ties", {
            // exact halfway points of E4M3 steps at scale 1 (amax 448 in every block)
            let mut x: Vec<f32> = (0..n)
                .map(|i| (i % 256) as f32 / 8.0 + 1.0 / 16.0)
                .collect();
            for r in 0..rows {
                x[r * cols] = 448.0;
                x[r * cols + 32] = 448.0;
                x[r * cols + 64] = 448.0;
            }
            x
        }),
        ("mixed blocks", {
            let mut x = rng.vec(n, |r| r.wide(30));
            for v in x.iter_mut().step_by(7) {
                *v = 0.0;
            }
            x[0] = f32::from_bits(1); // smallest subnormal
            x[2] = -f32::MIN_POSITIVE;
            x
        }),
        (
            "random bits",
            rng.vec(n, |r| f32::from_bits(r.next_u64() as u32)),
        ),
    ];
    for (what, x) in &cases {
        check_quantize(&c, x, rows, cols, what);
    }
}

#[test]
fn dequantize_matches_cpu() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0003);
    for (rows, cols) in SHAPES {
        let x = rng.vec(rows * cols, |r| r.wide(20));
        for rule in RULES {
            let mut bytes = vec![0u8; tiled_bytes(rows, cols)];
            encode_tiled(
                &x,
                MxShape::new(rows, cols),
                ElemFormat::E4M3,
                rule,
                &mut bytes,
            )
            .unwrap();
            check_dequantize(&c, &bytes, rows, cols, "encoded");
        }
    }
}

#[test]
fn dequantize_arbitrary_bytes_matches_cpu() {
    // every byte value as element and as scale: NaN elements (0x7F, 0xFF), NaN scale,
    // scale 0 (f32 subnormal products), large scales (overflow to inf)
    let c = client();
    let mut rng = Rng::new(0x5EED_0004);
    for (rows, cols) in [(64, 64), (33, 70)] {
        let bytes: Vec<u8> = (0..tiled_bytes(rows, cols))
            .map(|_| rng.next_u64() as u8)
            .collect();
        check_dequantize(&c, &bytes, rows, cols, "random bytes");
    }
}

#[test]
fn round_trip_on_device() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0005);
    let (rows, cols) = (70, 33);
    let x = rng.vec(rows * cols, |r| r.normal());
    let input = upload_f32(&c, &x);
    let packed = c.empty(tiled_bytes(rows, cols));
    quantize_tiled(
        &c,
        &input,
        InputDType::F32,
        rows,
        cols,
        ScaleRule::Rceil,
        &packed,
        0,
    )
    .unwrap();
    for plane in [Plane::Row, Plane::Col] {
        let out = c.empty(rows * cols * 4);
        dequantize_tiled(&c, &packed, 0, rows, cols, plane, &out).unwrap();
        for (g, w) in read_f32(&c, &out).iter().zip(&x) {
            // RCEIL: relative error at most 1/17 on normal E4M3 values
            assert!(
                (g - w).abs() <= w.abs() / 16.0 + 1e-2,
                "{plane:?}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn size_errors_are_reported() {
    let c = client();
    let input = upload_f32(&c, &[0.0; 10]);
    let out = c.empty(tiled_bytes(2, 5));
    // input too small for 3 x 5
    assert!(quantize_tiled(&c, &input, InputDType::F32, 3, 5, ScaleRule::Rceil, &out, 0).is_err());
    // output too small with an offset
    assert!(quantize_tiled(&c, &input, InputDType::F32, 2, 5, ScaleRule::Rceil, &out, 1).is_err());
    assert!(quantize_tiled(&c, &input, InputDType::F32, 2, 5, ScaleRule::Rceil, &out, 0).is_ok());
}
