//! The bf16 runs of the runtime layout (`narrow_bf16`, `widen_bf16`: production, called by the
//! backend's device codec) against `half`'s conversions, bit for bit, at any offset inside
//! sentinel-filled buffers.
use crate::common::*;
use half::bf16;
use sshsdp_kernels::{narrow_bf16, widen_bf16};

const SENTINEL: u32 = 0xDEAD_BEEF;

#[test]
fn bf16_runs_widen_exactly_at_any_half_word_offset() {
    let c = client();
    let mut rng = Rng::new(11);
    // Specials included: ±0, ±inf, NaNs with payloads, subnormals.
    let mut halves: Vec<u16> = vec![0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFA3, 0x0001];
    halves.extend((0..300).map(|_| (rng.next_u64() >> 48) as u16));
    for src_half in [0usize, 1, 5] {
        for n in [1usize, 2, 7, halves.len()] {
            let mut stored = vec![0x1234u16; src_half];
            stored.extend_from_slice(&halves[..n]);
            if stored.len() % 2 == 1 {
                stored.push(0x5678);
            }
            let words: Vec<u32> = stored
                .chunks(2)
                .map(|p| p[0] as u32 | (p[1] as u32) << 16)
                .collect();
            let src = upload_u32(&c, &words);
            let dst = 3;
            let out = upload_u32(&c, &vec![SENTINEL; dst + n + 2]);
            widen_bf16(&c, &src, 2 * src_half, n, &out, dst).unwrap();
            let got = read_u32(&c, &out);
            let what = format!("offset {src_half}, {n} values");
            assert!(got[..dst].iter().all(|&w| w == SENTINEL), "{what}: before");
            assert!(
                got[dst + n..].iter().all(|&w| w == SENTINEL),
                "{what}: after"
            );
            for (i, &h) in halves[..n].iter().enumerate() {
                let want = bf16::from_bits(h).to_f32().to_bits();
                assert_eq!(got[dst + i], want, "{what}: value {i} ({h:#06x})");
            }
        }
    }
    assert!(widen_bf16(&c, &upload_u32(&c, &[0]), 1, 1, &upload_u32(&c, &[0]), 0).is_err());
}

#[test]
fn f32_runs_narrow_to_bf16_like_half_at_any_offset() {
    let c = client();
    let mut rng = Rng::new(12);
    // Specials: ±0, ±inf, NaNs with payloads (signalling too), subnormals, ties both ways,
    // the largest finite f32 (rounds to inf) and values just below a carry into the exponent.
    let mut bits: Vec<u32> = vec![
        0x0000_0000,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0xFFC1_2345,
        0x0000_0001,
        0x3F80_8000,
        0x3F81_8000,
        0x7F7F_FFFF,
        0x3FFF_FFFF,
    ];
    bits.extend((0..300).map(|_| (rng.next_u64() >> 32) as u32));
    let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    for src_at in [0usize, 1, 6] {
        for n in [1usize, 2, 7, values.len() - src_at] {
            let src = upload_f32(&c, &values);
            let dst_word = 2;
            let words = n.div_ceil(2);
            let out = upload_u32(&c, &vec![SENTINEL; dst_word + words + 2]);
            narrow_bf16(&c, &src, src_at, n, &out, 4 * dst_word).unwrap();
            let got = words_to_bytes(&read_u32(&c, &out));
            let what = format!("offset {src_at}, {n} values");
            let sentinel = SENTINEL.to_le_bytes();
            for w in (0..dst_word).chain(dst_word + words..dst_word + words + 2) {
                assert_eq!(
                    got[4 * w..4 * w + 4],
                    sentinel,
                    "{what}: word {w} untouched"
                );
            }
            let mut want = Vec::new();
            for &v in &values[src_at..src_at + n] {
                want.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
            }
            want.resize(4 * words, 0);
            assert_eq!(
                got[4 * dst_word..4 * (dst_word + words)],
                want[..],
                "{what}"
            );
        }
    }
    let (src, out) = (upload_f32(&c, &[1.0; 4]), upload_u32(&c, &[0; 4]));
    assert!(narrow_bf16(&c, &src, 0, 2, &out, 2).is_err(), "not a word");
    assert!(
        narrow_bf16(&c, &src, 3, 2, &out, 0).is_err(),
        "past the source"
    );
    assert!(
        narrow_bf16(&c, &src, 0, 4, &out, 12).is_err(),
        "past the output"
    );
}
