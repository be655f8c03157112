//! The lab kernels' device checks (feature `experimental`): the two-plane 32×32 tiled
//! quantise/dequantise, the MXFP8 matmul and the `f32` GEMM, one Newton–Schulz step. No
//! training path calls these kernels; the checks keep them honest while they stay in the crate.

use cubecl::prelude::*;
use sshsdp_mx::{decode_tiled, par::encode_tiled_par, tiled_bytes, ElemFormat, MxShape};

use super::{row, Check, Rng};
use crate::{
    dequantize_tiled, gemm, mx_matmul, ns_step, quantize_tiled, InputDType, MatRef, NsPrecision,
    NsWorkspace, Plane, ScaleRule, NS_COEFFICIENTS,
};

/// The two-plane 32×32 tiled kernels (`quantize_tiled`, `dequantize_tiled`: the operands of
/// `mx_matmul`) against `sshsdp_mx::{encode_tiled, decode_tiled}`, then their throughput
/// against the device copy's `copy_gbs`.
pub(super) fn tiled<R: Runtime>(
    ck: &mut Check<R>,
    rng: &mut Rng,
    (rows, cols): (usize, usize),
    copy_gbs: f64,
) {
    let c = ck.client.clone();
    let x = rng.wide(rows * cols, 10);
    let shape = MxShape::new(rows, cols);
    let nbytes = tiled_bytes(rows, cols);
    let input = ck.upload(&x);
    let out = c.empty(nbytes);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
        quantize_tiled(&c, &input, InputDType::F32, rows, cols, rule, &out, 0).unwrap();
        let got = ck.read_bytes(&out);
        let mut want = vec![0u8; nbytes];
        encode_tiled_par(&x, shape, ElemFormat::E4M3, rule, &mut want, threads).unwrap();
        let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        ck.verdict(
            &format!("quantize {rule:?}"),
            bad == 0 && got.len() == nbytes,
            format!("{rows}x{cols}: {bad} of {nbytes} bytes differ from sshsdp-mx"),
        );
    }
    // dequantise: sample rows of both planes against decode_tiled of the same bytes
    let bytes = ck.read_bytes(&out);
    let deq = c.empty(rows * cols * 4);
    for plane in [Plane::Row, Plane::Col] {
        dequantize_tiled(&c, &out, 0, rows, cols, plane, &deq).unwrap();
        let got = ck.read_f32(&deq);
        let mut want = vec![0f32; rows * cols];
        decode_tiled(&bytes, shape, ElemFormat::E4M3, plane, &mut want).unwrap();
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        ck.verdict(
            &format!("dequantize {plane:?}"),
            bad == 0,
            format!("{rows}x{cols}: {bad} values differ from sshsdp-mx"),
        );
    }
    // throughput
    let t_q = ck.time(|| {
        quantize_tiled(
            &c,
            &input,
            InputDType::F32,
            rows,
            cols,
            ScaleRule::Rceil,
            &out,
            0,
        )
        .unwrap()
    });
    let q_gbs = ((rows * cols * 4 + nbytes) as f64) / t_q / 1e9;
    row(
        "quantize f32->tiled",
        &format!("{rows}x{cols}"),
        t_q,
        format!("{q_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy (target >= 70%)", 100.0 * q_gbs / copy_gbs),
    );
    let t_d = ck.time(|| dequantize_tiled(&c, &out, 0, rows, cols, Plane::Row, &deq).unwrap());
    let d_gbs = ((rows * cols * 4 + nbytes / 2) as f64) / t_d / 1e9;
    row(
        "dequantize row plane",
        &format!("{rows}x{cols}"),
        t_d,
        format!("{d_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy", 100.0 * d_gbs / copy_gbs),
    );
}

/// `max |got - want| / (|A|·|B|ᵀ)` over sampled outputs of an NT product of row-major data.
#[allow(clippy::too_many_arguments)]
fn sampled_nt_error(
    got: &[f32],
    a: &[f32],
    b: &[f32],
    n: usize,
    k: usize,
    samples: &[(usize, usize)],
) -> f64 {
    samples
        .iter()
        .map(|&(i, j)| {
            let (mut s, mut sa) = (0f64, 0f64);
            for l in 0..k {
                let p = a[i * k + l] as f64 * b[j * k + l] as f64;
                s += p;
                sa += p.abs();
            }
            (got[i * n + j] as f64 - s).abs() / sa.max(1e-30)
        })
        .fold(0.0, f64::max)
}

/// `mx_matmul` and the `f32` GEMM against the CPU on sampled outputs, then their TFLOP/s.
pub(super) fn matmul<R: Runtime>(
    ck: &mut Check<R>,
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
) {
    let c = ck.client.clone();
    let a = rng.wide(m * k, 4);
    let b = rng.wide(n * k, 4);
    let (ha, hb) = (ck.upload(&a), ck.upload(&b));
    let (wa, wb) = (tiled_bytes(m, k) / 4, tiled_bytes(n, k) / 4);
    let bucket = c.empty((wa + wb) * 4);
    quantize_tiled(&c, &ha, InputDType::F32, m, k, ScaleRule::Rceil, &bucket, 0).unwrap();
    quantize_tiled(
        &c,
        &hb,
        InputDType::F32,
        n,
        k,
        ScaleRule::Rceil,
        &bucket,
        wa,
    )
    .unwrap();
    let out = c.empty(m * n * 4);
    mx_matmul(&c, m, n, k, &bucket, 0, &bucket, wa, &out).unwrap();
    let got = ck.read_f32(&out);
    // reference: dequantised row planes (decoded on the CPU), sampled outputs in f64
    let bytes = ck.read_bytes(&bucket);
    let mut ad = vec![0f32; m * k];
    let mut bd = vec![0f32; n * k];
    decode_tiled(
        &bytes[..wa * 4],
        MxShape::new(m, k),
        ElemFormat::E4M3,
        Plane::Row,
        &mut ad,
    )
    .unwrap();
    decode_tiled(
        &bytes[wa * 4..],
        MxShape::new(n, k),
        ElemFormat::E4M3,
        Plane::Row,
        &mut bd,
    )
    .unwrap();
    let samples: Vec<(usize, usize)> = (0..512)
        .map(|_| (rng.next_u64() as usize % m, rng.next_u64() as usize % n))
        .collect();
    let err = sampled_nt_error(&got, &ad, &bd, n, k, &samples);
    ck.verdict(
        "mx_matmul vs CPU",
        err <= 1e-5,
        format!("{m}x{n}x{k}: max rel err {err:.2e} over 512 sampled outputs (tol 1e-5)"),
    );
    // f32 GEMM of the same shape (same kernel skeleton, f32 operands)
    let out32 = c.empty(m * n * 4);
    let gemm_nt = || {
        gemm(
            &c,
            m,
            n,
            k,
            1.0,
            MatRef::row_major(&ha, k),
            MatRef::transposed(&hb, k),
            0.0,
            None,
            &out32,
        )
        .unwrap()
    };
    gemm_nt();
    let got32 = ck.read_f32(&out32);
    let err32 = sampled_nt_error(&got32, &a, &b, n, k, &samples);
    ck.verdict(
        "gemm f32 vs CPU",
        err32 <= 1e-5,
        format!("{m}x{n}x{k}: max rel err {err32:.2e}"),
    );
    let flops = 2.0 * (m * n * k) as f64;
    let t32 = ck.time(gemm_nt);
    let t_mx = ck.time(|| mx_matmul(&c, m, n, k, &bucket, 0, &bucket, wa, &out).unwrap());
    row(
        "gemm f32 (reference)",
        &format!("{m}x{n}x{k}"),
        t32,
        format!("{:.2} TFLOP/s", flops / t32 / 1e12),
        String::new(),
    );
    row(
        "mx_matmul (deq. in load)",
        &format!("{m}x{n}x{k}"),
        t_mx,
        format!("{:.2} TFLOP/s", flops / t_mx / 1e12),
        format!("{:.2}x the f32 GEMM", t32 / t_mx),
    );
}

/// One Newton–Schulz step (`ns_step`) against an `f64` reference on sampled outputs, then its
/// rate.
pub(super) fn newton_schulz<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng, (m, n): (usize, usize)) {
    let c = ck.client.clone();
    let x0 = rng.wide(m * n, 0);
    let norm = x0.iter().map(|v| (v * v) as f64).sum::<f64>().sqrt() as f32;
    let x: Vec<f32> = x0.iter().map(|v| v / norm).collect();
    let hx = ck.upload(&x);
    let out = c.empty(m * n * 4);
    let ws = NsWorkspace::new(&c, m, n, NsPrecision::F32).unwrap();
    ns_step(&c, &hx, m, n, NS_COEFFICIENTS, NsPrecision::F32, &ws, &out).unwrap();
    let got = ck.read_f32(&out);
    // reference: Gram in f64, then sampled outputs
    let (a, b, cc) = NS_COEFFICIENTS;
    let mut gram = vec![0f64; m * m];
    for i in 0..m {
        for j in i..m {
            let s: f64 = (0..n)
                .map(|l| x[i * n + l] as f64 * x[j * n + l] as f64)
                .sum();
            gram[i * m + j] = s;
            gram[j * m + i] = s;
        }
    }
    let mut err = 0f64;
    for _ in 0..64 {
        let (i, j) = (rng.next_u64() as usize % m, rng.next_u64() as usize % n);
        let bm_row: Vec<f64> = (0..m)
            .map(|l| {
                let aa: f64 = (0..m).map(|q| gram[i * m + q] * gram[q * m + l]).sum();
                b as f64 * gram[i * m + l] + cc as f64 * aa
            })
            .collect();
        let want = a as f64 * x[i * n + j] as f64
            + (0..m).map(|l| bm_row[l] * x[l * n + j] as f64).sum::<f64>();
        err = err.max((got[i * n + j] as f64 - want).abs());
    }
    ck.verdict(
        "ns_step vs CPU",
        err <= 1e-4,
        format!("{m}x{n}: max abs err {err:.2e} over 64 sampled outputs (tol 1e-4)"),
    );
    let flops = (4 * m * m * n + 2 * m * m * m) as f64;
    let t =
        ck.time(|| ns_step(&c, &hx, m, n, NS_COEFFICIENTS, NsPrecision::F32, &ws, &out).unwrap());
    let bytes = (4 * (3 * m * n + 4 * m * m)) as f64;
    row(
        "ns_step (3 f32 GEMMs)",
        &format!("{m}x{n}"),
        t,
        format!("{:.2} TFLOP/s", flops / t / 1e12),
        format!("{:.1} GB/s", bytes / t / 1e9),
    );
}
