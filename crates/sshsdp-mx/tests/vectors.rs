//! Bit-exact check against the independent vectors of `tests/data/gen_vectors.py`
//! (numpy + ml_dtypes): block scales, element bytes and decoded values for both element
//! formats and both scale rules, plus the row/column planes and the tiled layout of small
//! tensors.

use half::bf16;
use serde::Deserialize;
use sshsdp_mx::{
    decode_block, decode_cols, decode_rows, decode_tiled, encode_block, encode_cols, encode_rows,
    encode_tiled, ElemFormat, MxShape, Plane, ScaleRule, BLOCK,
};
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct Doc {
    nan_byte: BTreeMap<String, u8>,
    blocks: Vec<BlockCase>,
    tensors: Vec<TensorCase>,
}

#[derive(Deserialize)]
struct BlockCase {
    name: String,
    kind: String,
    x: String,
    r: BTreeMap<String, BlockResult>,
}

#[derive(Deserialize)]
struct BlockResult {
    s: u8,
    q: String,
    d: String,
}

#[derive(Deserialize)]
struct TensorCase {
    rows: usize,
    cols: usize,
    fmt: String,
    rule: String,
    kind: String,
    x: String,
    row_data: String,
    row_scales: String,
    col_data: String,
    col_scales: String,
    tiled: String,
}

fn load() -> Doc {
    let text = include_str!("data/vectors.json");
    serde_json::from_str(text).expect("vectors.json parses")
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex_f32(s: &str) -> Vec<f32> {
    (0..s.len())
        .step_by(8)
        .map(|i| f32::from_bits(u32::from_str_radix(&s[i..i + 8], 16).unwrap()))
        .collect()
}

fn fmt_of(s: &str) -> ElemFormat {
    match s {
        "e4m3" => ElemFormat::E4M3,
        "e5m2" => ElemFormat::E5M2,
        _ => panic!("unknown format {s}"),
    }
}

fn rule_of(s: &str) -> ScaleRule {
    match s {
        "rceil" => ScaleRule::Rceil,
        "floor" => ScaleRule::Floor,
        _ => panic!("unknown rule {s}"),
    }
}

fn same_f32(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter()
        .map(|v| {
            assert_eq!(v.to_bits() & 0xFFFF, 0, "bf16 case holds bf16 values");
            bf16::from_bits((v.to_bits() >> 16) as u16)
        })
        .collect()
}

#[test]
fn nan_bytes_match() {
    let doc = load();
    assert_eq!(doc.nan_byte["e4m3"], ElemFormat::E4M3.nan_byte());
    assert_eq!(doc.nan_byte["e5m2"], ElemFormat::E5M2.nan_byte());
}

#[test]
fn blocks_bit_exact() {
    let doc = load();
    assert!(doc.blocks.len() > 150);
    let mut checked = 0;
    for case in &doc.blocks {
        let x: [f32; BLOCK] = hex_f32(&case.x).try_into().unwrap();
        for (key, want) in &case.r {
            let (f, r) = key.split_once('_').unwrap();
            let (fmt, rule) = (fmt_of(f), rule_of(r));
            let mut q = [0u8; BLOCK];
            let s = match case.kind.as_str() {
                "f32" => encode_block(&x, fmt, rule, &mut q),
                "bf16" => {
                    let xb: [bf16; BLOCK] = to_bf16(&x).try_into().unwrap();
                    let s = encode_block(&xb, fmt, rule, &mut q);
                    // the bf16 path must agree with the f32 path on the same values
                    let mut q2 = [0u8; BLOCK];
                    assert_eq!(encode_block(&x, fmt, rule, &mut q2), s);
                    assert_eq!(q, q2);
                    s
                }
                k => panic!("unknown kind {k}"),
            };
            assert_eq!(s, want.s, "{} {key}: scale", case.name);
            assert_eq!(
                q.to_vec(),
                hex_bytes(&want.q),
                "{} {key}: elements",
                case.name
            );
            let mut d = [0f32; BLOCK];
            decode_block(&q, s, fmt, &mut d);
            let wd = hex_f32(&want.d);
            for i in 0..BLOCK {
                assert!(
                    same_f32(d[i], wd[i]),
                    "{} {key}: decode[{i}] = {} want {}",
                    case.name,
                    d[i],
                    wd[i]
                );
            }
            checked += 1;
        }
    }
    println!("checked {checked} block encodings");
}

#[test]
fn tensors_bit_exact() {
    let doc = load();
    for case in &doc.tensors {
        let shape = MxShape::new(case.rows, case.cols);
        let (fmt, rule) = (fmt_of(&case.fmt), rule_of(&case.rule));
        let x = hex_f32(&case.x);
        let xb = to_bf16_if(&case.kind, &x);
        let mut rd = vec![0xAAu8; shape.row_data_bytes()];
        let mut rs = vec![0xAAu8; shape.row_scale_bytes()];
        let mut cd = vec![0xAAu8; shape.col_data_bytes()];
        let mut cs = vec![0xAAu8; shape.col_scale_bytes()];
        let mut tl = vec![0xAAu8; shape.tiled_bytes()];
        match &xb {
            Some(xb) => {
                encode_rows(xb, shape, fmt, rule, &mut rd, &mut rs).unwrap();
                encode_cols(xb, shape, fmt, rule, &mut cd, &mut cs).unwrap();
                encode_tiled(xb, shape, fmt, rule, &mut tl).unwrap();
            }
            None => {
                encode_rows(&x, shape, fmt, rule, &mut rd, &mut rs).unwrap();
                encode_cols(&x, shape, fmt, rule, &mut cd, &mut cs).unwrap();
                encode_tiled(&x, shape, fmt, rule, &mut tl).unwrap();
            }
        }
        let tag = format!("{}x{} {} {}", case.rows, case.cols, case.fmt, case.rule);
        assert_eq!(rd, hex_bytes(&case.row_data), "{tag}: row data");
        assert_eq!(rs, hex_bytes(&case.row_scales), "{tag}: row scales");
        assert_eq!(cd, hex_bytes(&case.col_data), "{tag}: col data");
        assert_eq!(cs, hex_bytes(&case.col_scales), "{tag}: col scales");
        assert_eq!(tl, hex_bytes(&case.tiled), "{tag}: tiled");

        // the three layouts decode to the same tensor
        let mut a = vec![0f32; shape.len()];
        let mut b = vec![0f32; shape.len()];
        let mut c = vec![0f32; shape.len()];
        decode_rows(&rd, &rs, shape, fmt, &mut a).unwrap();
        decode_cols(&cd, &cs, shape, fmt, &mut b).unwrap();
        decode_tiled(&tl, shape, fmt, Plane::Row, &mut c).unwrap();
        for i in 0..shape.len() {
            assert!(same_f32(a[i], c[i]), "{tag}: tiled row decode [{i}]");
        }
        decode_tiled(&tl, shape, fmt, Plane::Col, &mut c).unwrap();
        for i in 0..shape.len() {
            assert!(same_f32(b[i], c[i]), "{tag}: tiled col decode [{i}]");
        }
    }
}

fn to_bf16_if(kind: &str, x: &[f32]) -> Option<Vec<bf16>> {
    (kind == "bf16").then(|| to_bf16(x))
}
