//! The kernel rates the step times are read against: Newton–Schulz alone and the NdArray matmul
//! ceiling, on one thread and on every core at once.

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use sshsdp::optim::{newton_schulz, NsPrecision};

use crate::{Inner, D, MLP};

/// Best seconds of `f` over `reps` runs after one warm-up (the least disturbed run: these are
/// ceilings and kernel rates, and the cores may be shared).
fn time_it(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn random(shape: [usize; 2]) -> Tensor<Inner, 2> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// Single-thread matmul and Newton–Schulz rates.
pub struct Kernels {
    /// GFLOP/s of one 768×3072 · 3072×768 matmul on one thread.
    pub matmul: f64,
    /// Aggregate GFLOP/s with one such matmul per core at once.
    pub matmul_all: f64,
    /// Seconds of Newton–Schulz on 768×768 and 768×3072 (one thread).
    pub ns_square: f64,
    pub ns_wide: f64,
}

pub fn kernels(ns_steps: usize, cores: usize) -> Kernels {
    let mm_flops = 2.0 * (D * D * MLP) as f64;
    let (a, b) = (random([D, MLP]), random([MLP, D]));
    let matmul_once = || {
        let c = a.clone().matmul(b.clone());
        std::hint::black_box(c.into_data());
    };
    let mm = time_it(10, matmul_once);
    let all = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores)
            .map(|_| s.spawn(|| time_it(5, matmul_once)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold(0.0, f64::max)
    });
    let ns = |shape: [usize; 2]| {
        let g = random(shape);
        time_it(5, || {
            let o = newton_schulz(g.clone(), ns_steps, NsPrecision::F32);
            std::hint::black_box(o.into_data());
        })
    };
    Kernels {
        matmul: mm_flops / mm / 1e9,
        matmul_all: cores as f64 * mm_flops / all / 1e9,
        ns_square: ns([D, D]),
        ns_wide: ns([D, MLP]),
    }
}
