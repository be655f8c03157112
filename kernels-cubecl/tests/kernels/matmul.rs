//! MXFP8 matmul and the strided `f32` GEMM against CPU products (lab, feature
//! `experimental`).
#![cfg(feature = "experimental")]
use crate::common::*;
use sshsdp_kernels::{gemm, mx_matmul, quantize_tiled, InputDType, MatRef, ScaleRule};
use sshsdp_mx::{decode_tiled, encode_tiled, tiled_bytes, ElemFormat, MxShape, Plane};

/// Checks `got` against the `f64` reference with a tolerance of `tol` times the sum of
/// absolute products of each output (the scale of its rounding error).
fn assert_close(got: &[f32], want: &[f64], scale: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * s.max(1e-30),
            "{what}: element {i}: {g} vs {w} (err {err:e}, scale {s:e})"
        );
    }
}

/// Row-major `|A| · |B|ᵀ` (error scale of each dot product).
fn abs_nt(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let aa: Vec<f32> = a.iter().map(|v| v.abs()).collect();
    let bb: Vec<f32> = b.iter().map(|v| v.abs()).collect();
    matmul_nt(&aa, &bb, m, n, k)
}

#[test]
fn mx_matmul_matches_dequantized_product() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0101);
    for (m, n, k) in [
        (1, 1, 1),
        (33, 70, 45),
        (64, 64, 64),
        (100, 37, 130),
        (128, 96, 256),
        (7, 129, 33),
    ] {
        for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
            let a = rng.vec(m * k, |r| r.wide(6));
            let b = rng.vec(n * k, |r| r.normal());
            // CPU: encode, decode the row planes, f64 product
            let mut ab = vec![0u8; tiled_bytes(m, k)];
            let mut bb = vec![0u8; tiled_bytes(n, k)];
            encode_tiled(&a, MxShape::new(m, k), ElemFormat::E4M3, rule, &mut ab).unwrap();
            encode_tiled(&b, MxShape::new(n, k), ElemFormat::E4M3, rule, &mut bb).unwrap();
            let mut ad = vec![0f32; m * k];
            let mut bd = vec![0f32; n * k];
            decode_tiled(
                &ab,
                MxShape::new(m, k),
                ElemFormat::E4M3,
                Plane::Row,
                &mut ad,
            )
            .unwrap();
            decode_tiled(
                &bb,
                MxShape::new(n, k),
                ElemFormat::E4M3,
                Plane::Row,
                &mut bd,
            )
            .unwrap();
            let want = matmul_nt(&ad, &bd, m, n, k);
            let scale = abs_nt(&ad, &bd, m, n, k);
            // device: quantise both into one bucket at offsets, then multiply
            let (wa, wb) = (tiled_bytes(m, k) / 4, tiled_bytes(n, k) / 4);
            let bucket = c.empty((7 + wa + wb) * 4);
            let (ha, hb) = (upload_f32(&c, &a), upload_f32(&c, &b));
            quantize_tiled(&c, &ha, InputDType::F32, m, k, rule, &bucket, 7).unwrap();
            quantize_tiled(&c, &hb, InputDType::F32, n, k, rule, &bucket, 7 + wa).unwrap();
            let out = c.empty(m * n * 4);
            mx_matmul(&c, m, n, k, &bucket, 7, &bucket, 7 + wa, &out).unwrap();
            let got = read_f32(&c, &out);
            assert_close(
                &got,
                &want,
                &scale,
                1e-5,
                &format!("mx {m}x{n}x{k} {rule:?}"),
            );
        }
    }
}

#[test]
fn gemm_all_layouts() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0102);
    for (m, n, k) in [(1, 1, 1), (33, 70, 45), (64, 64, 32), (65, 31, 97)] {
        let a = rng.vec(m * k, |r| r.normal()); // logical A [m, k]
        let b = rng.vec(n * k, |r| r.normal()); // logical Bᵀ [n, k]
        let d = rng.vec(m * n, |r| r.normal());
        let prod = matmul_nt(&a, &b, m, n, k);
        let scale = abs_nt(&a, &b, m, n, k);
        let (alpha, beta) = (0.75f32, -1.5f32);
        let want: Vec<f64> = prod
            .iter()
            .zip(&d)
            .map(|(p, &dv)| alpha as f64 * p + beta as f64 * dv as f64)
            .collect();
        let tol_scale: Vec<f64> = scale
            .iter()
            .zip(&d)
            .map(|(s, dv)| s + dv.abs() as f64)
            .collect();
        // stored layouts: A row-major [m,k] or its transpose [k,m]; B as [n,k] (NT) or [k,n]
        let a_t: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let b_kn: Vec<f32> = (0..k * n).map(|i| b[(i % n) * k + i / n]).collect();
        let (ha, hat, hb, hbkn, hd) = (
            upload_f32(&c, &a),
            upload_f32(&c, &a_t),
            upload_f32(&c, &b),
            upload_f32(&c, &b_kn),
            upload_f32(&c, &d),
        );
        for (ai, av) in [MatRef::row_major(&ha, k), MatRef::transposed(&hat, m)]
            .into_iter()
            .enumerate()
        {
            for (bi, bv) in [MatRef::transposed(&hb, k), MatRef::row_major(&hbkn, n)]
                .into_iter()
                .enumerate()
            {
                let out = c.empty(m * n * 4);
                gemm(&c, m, n, k, alpha, av.clone(), bv, beta, Some(&hd), &out).unwrap();
                assert_close(
                    &read_f32(&c, &out),
                    &want,
                    &tol_scale,
                    1e-5,
                    &format!("gemm {m}x{n}x{k} a{ai} b{bi}"),
                );
            }
        }
        // no D
        let out = c.empty(m * n * 4);
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
            &out,
        )
        .unwrap();
        assert_close(&read_f32(&c, &out), &prod, &scale, 1e-5, "gemm no D");
    }
}
