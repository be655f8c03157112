//! Quantisation error of RCEIL: per-element bound in the normal range of each block and the
//! RMS relative error on Gaussian data.

mod common;

use common::{gauss_vec, Rng};
use sshsdp_mx::{decode_rows, encode_rows, scale_to_f32, ElemFormat, MxShape, ScaleRule, BLOCK};

/// Encodes row-wise and decodes; returns (decoded, per-element block scale).
fn round_trip(x: &[f32], s: MxShape, f: ElemFormat) -> (Vec<f32>, Vec<f32>) {
    let mut d = vec![0; s.row_data_bytes()];
    let mut sc = vec![0; s.row_scale_bytes()];
    encode_rows(x, s, f, ScaleRule::Rceil, &mut d, &mut sc).unwrap();
    let mut y = vec![0f32; s.len()];
    decode_rows(&d, &sc, s, f, &mut y).unwrap();
    let nb = s.cols_p() / BLOCK;
    let scales = (0..s.len())
        .map(|i| scale_to_f32(sc[(i / s.cols) * nb + (i % s.cols) / BLOCK]))
        .collect();
    (y, scales)
}

#[test]
fn per_element_bound_in_normal_range() {
    let mut rng = Rng::new(7);
    // (format, bound = half ulp relative to the smallest value rounding up to 1 + ulp/2)
    for (f, bound) in [
        (ElemFormat::E4M3, 1.0 / 17.0),
        (ElemFormat::E5M2, 1.0 / 9.0),
    ] {
        let s = MxShape::new(64, 256);
        let mut worst = 0f64;
        let mut n = 0usize;
        for k in [-30, -5, 0, 5, 30] {
            // Gaussian and log-uniform magnitudes
            let mut x = gauss_vec(&mut rng, s.len(), 10f64.powi(k));
            for v in x.iter_mut().step_by(2) {
                *v *= (2f64.powf(rng.uniform() * 24.0 - 12.0)) as f32;
            }
            let (y, sc) = round_trip(&x, s, f);
            for i in 0..s.len() {
                if (x[i] / sc[i]).abs() >= f.min_normal() {
                    let rel = ((y[i] as f64 - x[i] as f64) / x[i] as f64).abs();
                    worst = worst.max(rel);
                    n += 1;
                }
            }
        }
        println!("{f:?}: worst relative error {worst:.5} over {n} normal-range elements");
        assert!(worst <= bound + 1e-12, "{f:?}: {worst} > {bound}");
        assert!(
            worst > bound * 0.9,
            "{f:?}: the bound should be nearly reached"
        );
    }
}

#[test]
fn rms_relative_error_on_gaussian_data() {
    let mut rng = Rng::new(8);
    let s = MxShape::new(256, 512);
    let x = gauss_vec(&mut rng, s.len(), 1.0);
    let (y, _) = round_trip(&x, s, ElemFormat::E4M3);
    // RMS of the per-element relative error over elements not flushed into the tails
    // (|x| > 1e-3: excludes the handful whose relative error is dominated by subnormals),
    // and the norm-wise relative error.
    let (mut sum_rel2, mut n, mut err2, mut ref2) = (0f64, 0usize, 0f64, 0f64);
    for (&a, &b) in x.iter().zip(&y) {
        let (a, b) = (a as f64, b as f64);
        err2 += (a - b) * (a - b);
        ref2 += a * a;
        if a.abs() > 1e-3 {
            sum_rel2 += ((a - b) / a).powi(2);
            n += 1;
        }
    }
    let rms_rel = (sum_rel2 / n as f64).sqrt();
    let normwise = (err2 / ref2).sqrt();
    println!("E4M3 RCEIL Gaussian: RMS relative error {rms_rel:.4}, norm-wise {normwise:.4}");
    assert!(
        (0.02..0.04).contains(&rms_rel),
        "RMS relative error {rms_rel}"
    );
    assert!(
        (0.01..0.04).contains(&normwise),
        "norm-wise relative error {normwise}"
    );
}
