//! The square-block (32×32) MXFP8 kernels the runtime uses (`quantize_square`,
//! `dequantize_square`) against `sshsdp_mx::{encode_square, decode_square}`, then their
//! throughput against the device copy.

use cubecl::prelude::*;
use sshsdp_mx::{decode_square, encode_square, ElemFormat, MxShape};

use super::{row, Check, Rng};
use crate::{dequantize_square, quantize_square, InputDType, ScaleRule, SquareAt};

/// Where a `rows × cols` rectangle at element `offset` of rows `stride` apart goes: data from
/// word 0, scales after it.
fn place(rows: usize, cols: usize, offset: usize, stride: usize) -> SquareAt {
    let data_words = (rows * cols).div_ceil(4);
    SquareAt {
        rows,
        cols,
        values_offset: offset,
        values_stride: stride,
        data_word: 0,
        scales_word: data_words,
    }
}

/// Bit-exact checks of both kernels on one rectangle of `x` (both scale rules), the encoded
/// bytes returned for the throughput rows.
fn exact<R: Runtime>(ck: &mut Check<R>, x: &[f32], at: SquareAt) -> Vec<u8> {
    let c = ck.client.clone();
    let shape = MxShape::new(at.rows, at.cols);
    let (data_words, scale_words) = at.words();
    let input = ck.upload(x);
    let out = c.empty(4 * (data_words + scale_words));
    let name = format!("{}x{} (stride {})", at.rows, at.cols, at.values_stride);
    let mut bytes = Vec::new();
    for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
        quantize_square(&c, &input, InputDType::F32, rule, at, &out).unwrap();
        let got = ck.read_bytes(&out);
        let mut data = vec![0u8; shape.square_data_bytes()];
        let mut scales = vec![0u8; shape.square_scale_bytes()];
        let src = &x[at.values_offset..];
        encode_square(
            src,
            at.values_stride,
            shape,
            ElemFormat::E4M3,
            rule,
            &mut data,
            &mut scales,
        )
        .unwrap();
        let scales_at = 4 * at.scales_word;
        let bad = data.iter().zip(&got).filter(|(a, b)| a != b).count()
            + scales
                .iter()
                .zip(&got[scales_at..])
                .filter(|(a, b)| a != b)
                .count();
        ck.verdict(
            &format!("quantize_square {rule:?}"),
            bad == 0,
            format!("{name}: {bad} bytes differ from sshsdp-mx"),
        );
        bytes = got;
    }
    let deq = c.empty(4 * x.len());
    dequantize_square(&c, &out, at, &deq).unwrap();
    let got = ck.read_f32(&deq);
    let mut want = vec![0f32; x.len()];
    let (data, scales) = bytes.split_at(4 * at.scales_word);
    decode_square(
        &data[..shape.square_data_bytes()],
        &scales[..shape.square_scale_bytes()],
        shape,
        ElemFormat::E4M3,
        &mut want[at.values_offset..],
        at.values_stride,
    )
    .unwrap();
    // Only the rectangle's positions are written: compare those.
    let bad = (0..at.rows)
        .flat_map(|r| (0..at.cols).map(move |c| at.values_offset + r * at.values_stride + c))
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .count();
    ck.verdict(
        "dequantize_square",
        bad == 0,
        format!("{name}: {bad} values differ from sshsdp-mx"),
    );
    bytes
}

/// The square-block checks: a ragged strided rectangle, then the full `rows × cols` matrix
/// with throughput rows against the copy's `copy_gbs`.
pub(super) fn square<R: Runtime>(
    ck: &mut Check<R>,
    rng: &mut Rng,
    (rows, cols): (usize, usize),
    copy_gbs: f64,
) {
    // Ragged edges and a row stride: a piece's rectangle inside a larger parameter.
    let (r, c, stride, offset) = (77, 45, 64, 3);
    let x = rng.wide(offset + r * stride, 10);
    exact(ck, &x, place(r, c, offset, stride));

    let x = rng.wide(rows * cols, 10);
    let at = place(rows, cols, 0, cols);
    let bytes = exact(ck, &x, at).len();
    let client = ck.client.clone();
    let input = ck.upload(&x);
    let out = client.empty(bytes);
    let deq = client.empty(4 * rows * cols);
    let t_q = ck.time(|| {
        quantize_square(&client, &input, InputDType::F32, ScaleRule::Rceil, at, &out).unwrap()
    });
    let q_gbs = ((rows * cols * 4 + bytes) as f64) / t_q / 1e9;
    row(
        "quantize_square f32",
        &format!("{rows}x{cols}"),
        t_q,
        format!("{q_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy (target >= 70%)", 100.0 * q_gbs / copy_gbs),
    );
    let t_d = ck.time(|| dequantize_square(&client, &out, at, &deq).unwrap());
    let d_gbs = ((rows * cols * 4 + bytes) as f64) / t_d / 1e9;
    row(
        "dequantize_square",
        &format!("{rows}x{cols}"),
        t_d,
        format!("{d_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy", 100.0 * d_gbs / copy_gbs),
    );
}
