//! The machine a table ran on: the matmul ceiling MFU is measured against, and the CPU, memory,
//! toolchain, date and load average the table's header reports.

use std::process::Command;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor};

use crate::Inner;

/// GFLOP/s of an NdArray f32 matmul `[m, k] · [k, n]`: (one thread, one matmul per core at once).
pub fn matmul_ceiling(m: usize, k: usize, n: usize, cores: usize) -> (f64, f64) {
    let device = Default::default();
    let a = Tensor::<Inner, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<Inner, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device);
    let flops = 2.0 * (m * k * n) as f64;
    let best = |runs: usize| {
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                let c = a.clone().matmul(b.clone());
                std::hint::black_box(c.into_data());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let one = flops / best(10) / 1e9;
    let slowest = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores).map(|_| s.spawn(|| best(5))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("matmul thread"))
            .fold(0.0, f64::max)
    });
    (one, cores as f64 * flops / slowest / 1e9)
}

pub fn first_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    text.lines().next().map(|l| l.trim().to_string())
}

pub fn proc_field(file: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
