//! The bucket codec tables the runtime launches (`decode_table`, `encode_table`) against the
//! single-rectangle kernels, bit for bit, on a small bucket (two strided rectangles of one
//! matrix and a bf16 run), and the decode straight into 16-bit values against the f32 decode
//! converted by `half` (f16 everywhere; bf16 on CUDA, where the runtime decodes into it).

use cubecl::prelude::*;

use super::{Check, Rng};
use crate::{
    decode_table, dequantize_square, encode_table, narrow_bf16, quantize_square, widen_bf16,
    CodecEntry, CodecTable, DecodeTo, InputDType, ScaleRule, SquareAt,
};

/// The bucket: a 77 × 96 matrix cut into two column rectangles, and a run of 45 bf16 values.
fn entries() -> (Vec<CodecEntry>, usize, usize) {
    let square = |cols, col0, data_word, scales_word| {
        CodecEntry::Square(SquareAt {
            rows: 77,
            cols,
            values_offset: col0,
            values_stride: 96,
            data_word,
            scales_word,
        })
    };
    // Data 77·40 / 4 = 770 words, scales 3·2 tiles = 2 words; 77·56 / 4 = 1078 and 2.
    let entries = vec![
        square(40, 0, 0, 770),
        square(56, 40, 772, 1850),
        CodecEntry::Bf16 {
            byte: 4 * 1852,
            n: 45,
            values: 77 * 96,
        },
    ];
    (entries, 77 * 96 + 45, 1852 + 23)
}

/// The table rows of the device check (see the module docs).
pub(super) fn tables<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng) {
    let c = ck.client.clone();
    let (entries, n, words) = entries();
    let x = rng.wide(n, 10);
    let input = ck.upload(&x);
    let zeros = vec![0u8; 4 * words];
    let (by_entry, by_table) = (c.create_from_slice(&zeros), c.create_from_slice(&zeros));
    for entry in &entries {
        match *entry {
            CodecEntry::Square(at) => {
                quantize_square(&c, &input, InputDType::F32, ScaleRule::Rceil, at, &by_entry)
            }
            CodecEntry::Bf16 { byte, n, values } => {
                narrow_bf16(&c, &input, values, n, &by_entry, byte)
            }
        }
        .unwrap();
    }
    let table = CodecTable::new(&c, &entries).unwrap();
    encode_table(&c, &table, ScaleRule::Rceil, &input, &by_table).unwrap();
    let (want, got) = (ck.read_bytes(&by_entry), ck.read_bytes(&by_table));
    let bad = want.iter().zip(&got).filter(|(a, b)| a != b).count();
    ck.verdict(
        "encode_table",
        bad == 0,
        format!(
            "{bad} of {} bytes differ from the per-entry kernels",
            want.len()
        ),
    );
    let (wide, by_entry_values) = (c.empty(4 * n), c.empty(4 * n));
    for entry in &entries {
        match *entry {
            CodecEntry::Square(at) => dequantize_square(&c, &by_table, at, &by_entry_values),
            CodecEntry::Bf16 { byte, n, values } => {
                widen_bf16(&c, &by_table, byte, n, &by_entry_values, values)
            }
        }
        .unwrap();
    }
    decode_table(&c, &table, &by_table, &wide, DecodeTo::F32).unwrap();
    let (want, decoded) = (ck.read_f32(&by_entry_values), ck.read_f32(&wide));
    let bad = (0..n)
        .filter(|&i| want[i].to_bits() != decoded[i].to_bits())
        .count();
    ck.verdict(
        "decode_table f32",
        bad == 0,
        format!("{bad} of {n} values differ from the per-entry kernels"),
    );
    let cuda = R::name(&c).to_lowercase().contains("cuda");
    let mut targets = vec![(DecodeTo::F16, "decode_table f16")];
    if cuda {
        targets.push((DecodeTo::Bf16, "decode_table bf16"));
    }
    for (to, name) in targets {
        let narrow = c.empty(2 * n);
        decode_table(&c, &table, &by_table, &narrow, to).unwrap();
        let bytes = ck.read_bytes(&narrow);
        let bad = (0..n)
            .filter(|&i| {
                let got = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
                let (want, nan) = match to {
                    DecodeTo::Bf16 => {
                        let v = half::bf16::from_f32(decoded[i]);
                        (v.to_bits(), v.is_nan())
                    }
                    _ => {
                        let v = half::f16::from_f32(decoded[i]);
                        (v.to_bits(), v.is_nan())
                    }
                };
                // Any NaN for a NaN (exponent all ones, mantissa not zero); otherwise the bits.
                let infinity = if to == DecodeTo::Bf16 { 0x7F80 } else { 0x7C00 };
                if nan {
                    got & 0x7FFF <= infinity
                } else {
                    got != want
                }
            })
            .count();
        ck.verdict(
            name,
            bad == 0,
            format!("{bad} of {n} values differ from the f32 decode converted by `half`"),
        );
    }
}
