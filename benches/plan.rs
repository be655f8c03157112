//! Planner benchmark: plans a Llama-70B-class spec list (80 layers × 7 matrices, norms,
//! 128k × 8192 embedding and head) for 128, 1024 and 8192 ranks and prints planning time,
//! padding, splits and Newton–Schulz owner balance. Run: `cargo bench --bench plan`.
//!
//! Targets (issue #2): < 50 ms at 1024 ranks, padding < 1 %, owner load max/mean < 1.05 where
//! the model has enough matrices (the lower bound column shows what whole-matrix ownership can
//! reach at all: one matrix cannot be split between owners).

use std::hint::black_box;
use std::time::Instant;

use sshsdp::plan::presets::TransformerShape;
use sshsdp::plan::{DType, Mesh, Plan, PlanConfig, RuntimeFormat, Sharding};

fn median_ms(mut f: impl FnMut(), reps: usize) -> f64 {
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

fn main() {
    let specs = TransformerShape::llama_70b().specs(DType::Bf16);
    let params: u64 = specs.iter().map(|s| s.numel()).sum();
    println!(
        "Llama-70B-class spec list: {} parameters, {:.2}B elements",
        specs.len(),
        params as f64 / 1e9
    );
    println!(
        "{:>6} {:>6} {:>13} {:>7} {:>10} {:>9} {:>9} {:>12} {:>12} {:>9}",
        "ranks",
        "mesh",
        "mode",
        "format",
        "plan ms",
        "buckets",
        "padding",
        "split/local",
        "NS max/mean",
        "bound"
    );
    for (ranks, shards) in [(128, 8), (1024, 8), (8192, 8)] {
        for (mesh, sharding) in [
            (Mesh::flat(ranks).unwrap(), Sharding::Hierarchical),
            (
                Mesh::new(ranks / shards, shards).unwrap(),
                Sharding::Hierarchical,
            ),
            (Mesh::new(ranks / shards, shards).unwrap(), Sharding::Hsdp),
        ] {
            for format in [RuntimeFormat::Bf16, RuntimeFormat::Mxfp8] {
                let config = PlanConfig::default()
                    .with_sharding(sharding)
                    .with_format(format);
                let mut plan = None;
                let ms = median_ms(
                    || plan = Some(black_box(Plan::build(specs.clone(), mesh, config.clone()))),
                    5,
                );
                let plan = plan.unwrap().expect("70B plan builds");
                let s = plan.stats();
                println!(
                    "{:>6} {:>6} {:>13} {:>7} {:>10.2} {:>9} {:>8.3}% {:>12} {:>12.3} {:>9.3}",
                    ranks,
                    mesh.to_string(),
                    format!("{sharding:?}"),
                    format!("{format:?}"),
                    ms,
                    s.buckets,
                    s.padding_ratio() * 100.0,
                    format!("{}/{}", s.split_matrices, s.split_matrices_owned_locally),
                    s.owner_load_max_over_mean,
                    s.owner_load_lower_bound
                );
            }
        }
    }
    let plan = Plan::build(
        specs.clone(),
        Mesh::new(128, 8).unwrap(),
        PlanConfig::default().with_format(RuntimeFormat::Mxfp8),
    )
    .unwrap();
    let t = Instant::now();
    let memory = plan.memory();
    println!(
        "\nmemory accounting of 1024 ranks (128x8, hierarchical, MXFP8) took {:.1} ms:\n{memory}",
        t.elapsed().as_secs_f64() * 1e3
    );
}
