//! Newton–Schulz (and the GEMMs under it) against `sshsdp-optim` on the CPU: lab kernels
//! (feature `experimental`).
#![cfg(feature = "experimental")]
use crate::common::*;
use sshsdp_kernels::{newton_schulz, ns_step, NsPrecision, NsWorkspace, NS_COEFFICIENTS};

#[test]
fn ns_step_matches_f64_reference() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0201);
    for (m, n) in [(1, 1), (16, 48), (33, 70), (64, 64), (40, 130)] {
        let x0 = rng.vec(m * n, |r| r.normal());
        // normalise like Muon so the step is in its working range
        let norm = x0.iter().map(|v| v * v).sum::<f32>().sqrt();
        let x: Vec<f32> = x0.iter().map(|v| v / norm).collect();
        // f64 reference
        let (a, b, cc) = NS_COEFFICIENTS;
        let (a, b, cc) = (a as f64, b as f64, cc as f64);
        let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mut gram = vec![0f64; m * m];
        for i in 0..m {
            for j in 0..m {
                gram[i * m + j] = (0..n).map(|l| xd[i * n + l] * xd[j * n + l]).sum();
            }
        }
        let mut bm = vec![0f64; m * m];
        for i in 0..m {
            for j in 0..m {
                let aa: f64 = (0..m).map(|l| gram[i * m + l] * gram[l * m + j]).sum();
                bm[i * m + j] = b * gram[i * m + j] + cc * aa;
            }
        }
        let want: Vec<f32> = (0..m * n)
            .map(|idx| {
                let (i, j) = (idx / n, idx % n);
                let bx: f64 = (0..m).map(|l| bm[i * m + l] * xd[l * n + j]).sum();
                (a * xd[idx] + bx) as f32
            })
            .collect();
        let hx = upload_f32(&c, &x);
        let out = c.empty(m * n * 4);
        let ws = NsWorkspace::new(&c, m, n, NsPrecision::F32).unwrap();
        ns_step(&c, &hx, m, n, NS_COEFFICIENTS, NsPrecision::F32, &ws, &out).unwrap();
        let got = read_f32(&c, &out);
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-5, "ns_step {m}x{n}: max |diff| {d:e}");
    }
}

#[test]
fn newton_schulz_matches_sshsdp_optim() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0202);
    for (rows, cols) in [(32, 48), (70, 33), (64, 64), (5, 1), (96, 40)] {
        let g = rng.vec(rows * cols, |r| r.normal() * 0.02);
        let want = values(sshsdp_optim::newton_schulz(
            tensor(&g, rows, cols),
            5,
            sshsdp_optim::NsPrecision::F32,
        ));
        let hg = upload_f32(&c, &g);
        let out = c.empty(rows * cols * 4);
        newton_schulz(&c, &hg, rows, cols, 5, NsPrecision::F32, &out).unwrap();
        let got = read_f32(&c, &out);
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-4, "newton_schulz {rows}x{cols}: max |diff| {d:e}");
    }
}

#[test]
fn newton_schulz_bf16_matches_sshsdp_optim_emulation() {
    // NdArray has no bf16 tensors: sshsdp-optim emulates bf16 by rounding every intermediate,
    // which is what the kernels do; differences come from summation order flipping roundings
    let c = client();
    let mut rng = Rng::new(0x5EED_0204);
    for (rows, cols) in [(32, 48), (70, 33), (64, 64)] {
        let g = rng.vec(rows * cols, |r| r.normal());
        let want = values(sshsdp_optim::newton_schulz(
            tensor(&g, rows, cols),
            5,
            sshsdp_optim::NsPrecision::Bf16,
        ));
        let hg = upload_f32(&c, &g);
        let out = c.empty(rows * cols * 4);
        newton_schulz(&c, &hg, rows, cols, 5, NsPrecision::Bf16, &out).unwrap();
        let got = read_f32(&c, &out);
        // every output is a bf16 value
        assert!(
            got.iter().all(|v| v.to_bits() & 0xFFFF == 0),
            "{rows}x{cols}: not bf16 values"
        );
        let d = max_abs_diff(&got, &want);
        let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
        assert!(
            d < 0.05 * want.iter().fold(0f32, |a, b| a.max(b.abs())),
            "newton_schulz bf16 {rows}x{cols}: max |diff| {d:e} (rms {rms:e})"
        );
        // and close to the f32 iteration
        let f32_want = values(sshsdp_optim::newton_schulz(
            tensor(&g, rows, cols),
            5,
            sshsdp_optim::NsPrecision::F32,
        ));
        let d32 = max_abs_diff(&got, &f32_want);
        assert!(d32 < 0.1, "bf16 vs f32 iteration {rows}x{cols}: {d32:e}");
    }
}

/// Sizes whose byte counts overflow (or do not fit 32-bit indexing) are errors before any
/// allocation or launch, never a wrapped size that a buffer check would accept (the lab's
/// kernels; `adamw.rs` has AdamW's, `square.rs` the codec's).
#[test]
fn huge_sizes_are_errors_not_wrapped_launches() {
    use sshsdp_kernels::{gemm, mx_matmul, KernelError, MatRef};
    let c = client();
    let small = c.empty(64);
    let huge = 1usize << 40;
    let too_large = |r: Result<(), KernelError>, what: &str| match r {
        Err(KernelError::TooLarge { .. }) | Err(KernelError::Shape(_)) => {}
        other => panic!("{what}: {other:?}"),
    };
    let a = MatRef::row_major(&small, huge);
    let b = MatRef::row_major(&small, huge);
    too_large(
        gemm(&c, huge, huge, huge, 1.0, a, b, 0.0, None, &small),
        "gemm 2^40",
    );
    let a = MatRef::row_major(&small, usize::MAX / 2);
    let b = MatRef::row_major(&small, 2);
    too_large(
        gemm(&c, 4, 2, usize::MAX / 2, 1.0, a, b, 0.0, None, &small),
        "gemm with an overflowing span",
    );
    too_large(
        mx_matmul(&c, huge, huge, 32, &small, 0, &small, 0, &small),
        "mx_matmul 2^40",
    );
    too_large(
        newton_schulz(&c, &small, huge, huge, 5, NsPrecision::F32, &small),
        "newton_schulz 2^40",
    );
    assert!(NsWorkspace::new(&c, 1 << 17, 1 << 17, NsPrecision::F32).is_err());
}
