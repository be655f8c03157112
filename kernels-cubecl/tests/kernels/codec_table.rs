//! The one-launch bucket codec ([`encode_table`], [`decode_table`]) against the per-entry
//! kernels ([`quantize_square`], [`narrow_bf16`], [`dequantize_square`], [`widen_bf16`]), bit for
//! bit, on a bucket-like table: rectangles of several shapes (not multiples of 32, one wider
//! than a scale word's four tiles), strided into one values buffer as a decode places them,
//! bf16 runs between them (one of odd length, one on a half-word for the decode), specials in
//! the values; words no entry reaches keep their sentinel.
use crate::common::*;
use sshsdp_kernels::{
    decode_table, dequantize_square, encode_table, narrow_bf16, quantize_square, widen_bf16,
    CodecEntry, CodecTable, DecodeTo, InputDType, KernelError, ScaleRule, SquareAt,
};

const SENTINEL: u32 = 0xDEAD_BEEF;

/// A matrix of the layout: rows, row stride, and its rectangles as (columns, first column).
type Matrix = (usize, usize, &'static [(usize, usize)]);

/// The entries of a bucket-like layout: `(entries, value elements, byte-buffer words)`.
/// `half_word_run` puts one bf16 run on a half-word (decode only). No two entries share a
/// value or a byte-buffer word (checked): entries launched together must not.
fn layout(half_word_run: bool) -> (Vec<CodecEntry>, usize, usize) {
    let mut entries = Vec::new();
    let mut word = 1; // word 0 stays untouched
    let mut value = 3;
    // A 70 x 200 matrix cut into two column rectangles, a 33 x 40 one and a 1 x 7 one, each
    // followed by a bf16 run (one of odd length).
    let matrices: [Matrix; 3] = [
        (70, 200, &[(96, 0), (104, 96)]),
        (33, 40, &[(40, 0)]),
        (1, 7, &[(7, 0)]),
    ];
    for (rows, stride, rectangles) in matrices {
        let matrix = value;
        value += rows * stride + 5;
        for &(cols, col0) in rectangles {
            let at = SquareAt {
                rows,
                cols,
                values_offset: matrix + col0,
                values_stride: stride,
                data_word: word,
                scales_word: 0,
            };
            let (data, scales) = at.words();
            let at = SquareAt {
                scales_word: word + data + 1,
                ..at
            };
            word = at.scales_word + scales + 2;
            entries.push(CodecEntry::Square(at));
            let n = if entries.len() == 3 { 37 } else { 64 };
            let half = half_word_run && entries.len() == 3;
            entries.push(CodecEntry::Bf16 {
                byte: 4 * word + if half { 2 } else { 0 },
                n,
                values: value,
            });
            word += (n + 1).div_ceil(2) + 1;
            value += n + 2;
        }
    }
    let (n, words) = (value + 4, word + 3);
    // Every value and word belongs to one entry at most.
    let (mut values_of, mut words_of) = (vec![0u8; n], vec![0u8; words]);
    for entry in &entries {
        let (values, bytes): (Vec<usize>, Vec<usize>) = match *entry {
            CodecEntry::Square(at) => {
                let (data, scales) = at.words();
                let values = (0..at.rows)
                    .flat_map(|r| {
                        (0..at.cols).map(move |c| at.values_offset + r * at.values_stride + c)
                    })
                    .collect();
                let words = (at.data_word..at.data_word + data)
                    .chain(at.scales_word..at.scales_word + scales)
                    .collect();
                (values, words)
            }
            CodecEntry::Bf16 { byte, n, values } => (
                (values..values + n).collect(),
                (byte / 4..(byte + 2 * n).div_ceil(4)).collect(),
            ),
        };
        for v in values {
            values_of[v] += 1;
        }
        for w in bytes {
            words_of[w] += 1;
        }
    }
    assert!(values_of.iter().all(|&k| k <= 1), "entries share values");
    assert!(words_of.iter().all(|&k| k <= 1), "entries share words");
    (entries, n, words)
}

/// Values with specials mixed in.
fn values(n: usize) -> Vec<f32> {
    let mut rng = Rng::new(11);
    let specials = [f32::NAN, f32::INFINITY, -0.0, f32::from_bits(1), f32::MAX];
    (0..n)
        .map(|i| {
            if i % 89 == 4 {
                specials[(i / 89) % specials.len()]
            } else {
                rng.wide(12)
            }
        })
        .collect()
}

#[test]
fn encode_table_equals_the_per_entry_kernels() {
    let c = client();
    let (entries, n, words) = layout(false);
    let input = upload_f32(&c, &values(n));
    for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
        let want = upload_u32(&c, &vec![SENTINEL; words]);
        for entry in &entries {
            match *entry {
                CodecEntry::Square(at) => {
                    quantize_square(&c, &input, InputDType::F32, rule, at, &want).unwrap()
                }
                CodecEntry::Bf16 { byte, n, values } => {
                    narrow_bf16(&c, &input, values, n, &want, byte).unwrap()
                }
            }
        }
        let got = upload_u32(&c, &vec![SENTINEL; words]);
        let table = CodecTable::new(&c, &entries).unwrap();
        assert_eq!(table.len(), entries.len());
        encode_table(&c, &table, rule, &input, &got).unwrap();
        let (got, want) = (read_u32(&c, &got), read_u32(&c, &want));
        assert!(got.contains(&SENTINEL), "some words are no entry's");
        if let Some(i) = (0..words).find(|&i| got[i] != want[i]) {
            panic!(
                "{rule:?}: word {i}: table {:#010x}, per entry {:#010x}",
                got[i], want[i]
            );
        }
    }
}

#[test]
fn decode_table_equals_the_per_entry_kernels() {
    let c = client();
    for half_word_run in [false, true] {
        let (entries, n, words) = layout(half_word_run);
        // Encoded bytes to decode: the per-entry encode of some values (runs on words), read
        // back under the decode's layout.
        let (encode_entries, ..) = layout(false);
        let input = upload_f32(&c, &values(n));
        let bytes = upload_u32(&c, &vec![0x3C00_4100; words]);
        for entry in &encode_entries {
            match *entry {
                CodecEntry::Square(at) => {
                    quantize_square(&c, &input, InputDType::F32, ScaleRule::Rceil, at, &bytes)
                        .unwrap()
                }
                CodecEntry::Bf16 { byte, n, values } => {
                    narrow_bf16(&c, &input, values, n, &bytes, byte).unwrap()
                }
            }
        }
        let want = upload_u32(&c, &vec![SENTINEL; n]);
        for entry in &entries {
            match *entry {
                CodecEntry::Square(at) => dequantize_square(&c, &bytes, at, &want).unwrap(),
                CodecEntry::Bf16 { byte, n, values } => {
                    widen_bf16(&c, &bytes, byte, n, &want, values).unwrap()
                }
            }
        }
        let got = upload_u32(&c, &vec![SENTINEL; n]);
        let table = CodecTable::new(&c, &entries).unwrap();
        decode_table(&c, &table, &bytes, &got, DecodeTo::F32).unwrap();
        let (got, want) = (read_u32(&c, &got), read_u32(&c, &want));
        assert!(got.contains(&SENTINEL), "some values are no entry's");
        if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
            panic!(
                "half-word run {half_word_run}: value {i}: table {:#010x}, per entry {:#010x}",
                got[i], want[i]
            );
        }
    }
}

/// Decoding straight to f16 gives the f32 decode converted to f16 (round to nearest even, as
/// `half` and a cast kernel convert), value for value; values no entry reaches keep their
/// sentinel.
#[test]
fn decode_table_to_f16_is_the_f32_decode_converted() {
    use half::f16;
    let c = client();
    let (entries, n, words) = layout(false);
    let input = upload_f32(&c, &values(n));
    let bytes = upload_u32(&c, &vec![0; words]);
    let table = CodecTable::new(&c, &entries).unwrap();
    encode_table(&c, &table, ScaleRule::Rceil, &input, &bytes).unwrap();
    let wide = upload_u32(&c, &vec![SENTINEL; n]);
    decode_table(&c, &table, &bytes, &wide, DecodeTo::F32).unwrap();
    let sentinel = 0xBEEFu16;
    let halves = vec![sentinel; n + n % 2];
    let words16: Vec<u32> = halves
        .chunks(2)
        .map(|p| p[0] as u32 | (p[1] as u32) << 16)
        .collect();
    let narrow = upload_u32(&c, &words16);
    decode_table(&c, &table, &bytes, &narrow, DecodeTo::F16).unwrap();
    let wide = read_u32(&c, &wide);
    let narrow: Vec<u16> = read_u32(&c, &narrow)
        .iter()
        .flat_map(|w| [*w as u16, (*w >> 16) as u16])
        .collect();
    let mut checked = 0;
    for i in 0..n {
        if wide[i] == SENTINEL {
            assert_eq!(narrow[i], sentinel, "value {i}: no entry's, yet written");
            continue;
        }
        let want = f16::from_f32(f32::from_bits(wide[i]));
        let got = f16::from_bits(narrow[i]);
        if want.is_nan() {
            assert!(got.is_nan(), "value {i}: {got} for NaN");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "value {i}: {got} vs {want}");
        }
        checked += 1;
    }
    assert!(checked > n / 2, "{checked} of {n} values decoded");
}

#[test]
fn bad_tables_and_buffers_are_errors() {
    let c = client();
    let run = |byte| CodecEntry::Bf16 {
        byte,
        n: 4,
        values: 0,
    };
    assert!(matches!(
        CodecTable::new(&c, &[run(3)]),
        Err(KernelError::Shape(_))
    ));
    // A run on a half-word decodes, but does not encode.
    let table = CodecTable::new(&c, &[run(2)]).unwrap();
    let (values, bytes) = (upload_f32(&c, &[0.0; 4]), upload_u32(&c, &[0; 4]));
    assert!(matches!(
        encode_table(&c, &table, ScaleRule::Rceil, &values, &bytes),
        Err(KernelError::Shape(_))
    ));
    decode_table(&c, &table, &bytes, &values, DecodeTo::F32).unwrap();
    // Buffers smaller than the entries reach.
    let table = CodecTable::new(&c, &[run(8)]).unwrap();
    let small = upload_u32(&c, &[0; 2]);
    assert!(matches!(
        decode_table(&c, &table, &small, &values, DecodeTo::F32),
        Err(KernelError::BufferTooSmall { .. })
    ));
    assert!(matches!(
        encode_table(&c, &table, ScaleRule::Rceil, &values, &small),
        Err(KernelError::BufferTooSmall { .. })
    ));
    // A rectangle whose data overlaps its scales.
    let overlapping = SquareAt {
        rows: 32,
        cols: 32,
        values_offset: 0,
        values_stride: 32,
        data_word: 0,
        scales_word: 4,
    };
    assert!(matches!(
        CodecTable::new(&c, &[CodecEntry::Square(overlapping)]),
        Err(KernelError::Shape(_))
    ));
    // Empty tables launch nothing.
    let empty = CodecTable::new(&c, &[]).unwrap();
    assert!(empty.is_empty());
    decode_table(&c, &empty, &small, &values, DecodeTo::F32).unwrap();
    encode_table(&c, &empty, ScaleRule::Rceil, &values, &small).unwrap();
}
