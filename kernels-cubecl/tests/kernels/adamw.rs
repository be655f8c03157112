//! The fused AdamW kernel against burn-optim's `AdamW` and the CPU reference (production wing:
//! built without `experimental`; the device optimizer step is to be built from it).
use crate::common::*;
use burn::optim::{AdamWConfig, SimpleOptimizer};
use sshsdp_kernels::{adamw_reference, adamw_step, AdamWParams, KernelError};

#[test]
fn adamw_matches_burn_and_reference() {
    let c = client();
    let mut rng = Rng::new(0x5EED_0203);
    let (rows, cols) = (37, 29); // 1073 elements, not a multiple of the cube size
    let len = rows * cols;
    let mut p = rng.vec(len, |r| r.normal());
    let (mut m, mut v) = (vec![0f32; len], vec![0f32; len]);
    let base = AdamWParams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    let optim = AdamWConfig::new()
        .with_beta_1(base.beta1)
        .with_beta_2(base.beta2)
        .with_epsilon(base.eps)
        .with_weight_decay(base.weight_decay)
        .build();
    let mut burn_p = tensor(&p, rows, cols);
    let mut burn_state = None;
    let (hp, hm, hv) = (upload_f32(&c, &p), upload_f32(&c, &m), upload_f32(&c, &v));
    for step in 1..=4 {
        let g = rng.vec(len, |r| r.wide(4));
        let params = AdamWParams { step, ..base };
        // device
        let hg = upload_f32(&c, &g);
        adamw_step(&c, &hp, &hg, &hm, &hv, len, &params).unwrap();
        // CPU reference (same formula, element by element)
        adamw_reference(&mut p, &g, &mut m, &mut v, &params);
        // burn-optim's AdamW
        let (np, ns) = optim.step(base.lr, burn_p, tensor(&g, rows, cols), burn_state);
        burn_p = np;
        burn_state = ns;
        let got = read_f32(&c, &hp);
        let burn_vals = values(burn_p.clone());
        for i in 0..len {
            let tol = 1e-6 * p[i].abs().max(1e-3);
            assert!(
                (got[i] - p[i]).abs() <= tol,
                "step {step} param {i}: device {} vs reference {}",
                got[i],
                p[i]
            );
            assert!(
                (burn_vals[i] - p[i]).abs() <= tol,
                "step {step} param {i}: burn {} vs reference {}",
                burn_vals[i],
                p[i]
            );
        }
        let (gm, gv) = (read_f32(&c, &hm), read_f32(&c, &hv));
        assert!(max_abs_diff(&gm, &m) <= 1e-6 * m.iter().fold(0f32, |a, b| a.max(b.abs())));
        assert!(max_abs_diff(&gv, &v) <= 1e-6 * v.iter().fold(0f32, |a, b| a.max(b.abs())));
    }
}

/// A size whose byte count overflows is an error before any allocation or launch, never a
/// wrapped size that a buffer check would accept.
#[test]
fn huge_sizes_are_errors_not_wrapped_launches() {
    let c = client();
    let small = c.empty(64);
    let params = AdamWParams::default();
    match adamw_step(&c, &small, &small, &small, &small, usize::MAX / 2, &params) {
        Err(KernelError::TooLarge { .. }) | Err(KernelError::Shape(_)) => {}
        other => panic!("adamw usize::MAX / 2: {other:?}"),
    }
}
