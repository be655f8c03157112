//! Sizes a cluster before having one: plans a Llama-7B- and a Llama-70B-class model at 8 → 1024
//! ranks and prints, per rank, the memory the plan holds and the time one step's collectives
//! take on the given links, for full sharding, HSDP and SS-HSDP's hierarchical sharding (shard
//! group = one node) with bf16 and MXFP8 runtime parameters.
//!
//! ```text
//! cargo run --release --example project_scaling -- [--link-gbps INTRA,INTER]
//!     [--latency-us INTRA,INTER] [--gpus-per-node 8] [--ranks 8,16,...,1024]
//!     [--model llama-7b,llama-70b] [--optim muon|adamw] [--reshard]
//!     [--bucket-elements 25000000]
//! ```
//!
//! Defaults: 3600 Gbit/s within a node (NVLink 4, 450 GB/s per direction per GPU) and 400 Gbit/s
//! across nodes (one 400G NIC per GPU), 3 µs and 10 µs per ring step, 8 GPUs per node, Muon on
//! matrices with AdamW on the rest. Pass the bandwidths your own links reach (e.g. NCCL's
//! `all_gather_perf` bus bandwidth, or `cargo bench --bench comm` / the MPI bandwidth example
//! for CPU clusters). The model (ring collectives, nothing overlapped, which group runs on which
//! link) is `sshsdp::plan::projection`; its byte counts equal the runtime's counters
//! (`tests/projection.rs`), its times are a projection.

use std::process::ExitCode;

use sshsdp::plan::presets::TransformerShape;
use sshsdp::plan::projection::{Links, MuonExchange, Purpose, StepTraffic, TrafficOptions};
use sshsdp::plan::{
    DType, Mesh, OptimizerFootprint, Plan, PlanConfig, RankMemory, RuntimeFormat, Sharding,
};

/// Command-line settings.
struct Args {
    links: Links,
    ranks: Vec<usize>,
    models: Vec<(&'static str, TransformerShape)>,
    muon: bool,
    reshard: bool,
    bucket_elements: u64,
}

fn pair(value: &str, flag: &str) -> Result<(f64, f64), String> {
    let (a, b) = value
        .split_once(',')
        .ok_or_else(|| format!("{flag} wants two numbers, INTRA,INTER (got `{value}`)"))?;
    let number = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("{flag}: `{x}` is not a positive number"))
    };
    Ok((number(a)?, number(b)?))
}

fn parse(args: &[String]) -> Result<Args, String> {
    let (mut intra, mut inter) = (3600.0, 400.0);
    let (mut lat_intra, mut lat_inter) = (3.0, 10.0);
    let mut gpus = 8usize;
    let mut ranks: Vec<usize> = (3..=10).map(|p| 1 << p).collect();
    let mut models = vec![
        ("Llama-7B", TransformerShape::llama_7b()),
        ("Llama-70B", TransformerShape::llama_70b()),
    ];
    let mut muon = true;
    let mut reshard = false;
    let mut bucket_elements = PlanConfig::default().bucket_elements;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--link-gbps" => (intra, inter) = pair(&value()?, flag)?,
            "--latency-us" => (lat_intra, lat_inter) = pair(&value()?, flag)?,
            "--gpus-per-node" => {
                gpus = value()?
                    .parse()
                    .ok()
                    .filter(|&g| g > 0)
                    .ok_or("--gpus-per-node wants a positive integer")?
            }
            "--ranks" => {
                ranks = value()?
                    .split(',')
                    .map(|r| r.trim().parse::<usize>().ok().filter(|&r| r > 0))
                    .collect::<Option<_>>()
                    .ok_or("--ranks wants positive integers, comma-separated")?
            }
            "--model" => {
                models = value()?
                    .split(',')
                    .map(|m| match m.trim() {
                        "gpt-small" => Ok(("GPT-small", TransformerShape::gpt_small())),
                        "llama-7b" => Ok(("Llama-7B", TransformerShape::llama_7b())),
                        "llama-70b" => Ok(("Llama-70B", TransformerShape::llama_70b())),
                        other => Err(format!(
                            "unknown model `{other}` (gpt-small, llama-7b, llama-70b)"
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--optim" => {
                muon = match value()?.as_str() {
                    "muon" => true,
                    "adamw" => false,
                    other => return Err(format!("unknown optimizer `{other}` (muon, adamw)")),
                }
            }
            "--reshard" => reshard = true,
            "--bucket-elements" => {
                bucket_elements = value()?
                    .parse()
                    .ok()
                    .filter(|&b| b > 0)
                    .ok_or("--bucket-elements wants a positive integer")?
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(Args {
        links: Links::from_gbps(gpus, intra, inter, lat_intra, lat_inter),
        ranks,
        models,
        muon,
        reshard,
        bucket_elements,
    })
}

/// The three layouts compared at `ranks`: (name, mesh, sharding).
fn layouts(ranks: usize, gpus: usize) -> Result<Vec<(&'static str, Mesh, Sharding)>, String> {
    let flat = Mesh::flat(ranks).map_err(|e| e.to_string())?;
    let mut out = vec![("full", flat, Sharding::Hierarchical)];
    if ranks > gpus {
        if ranks % gpus != 0 {
            return Err(format!("{ranks} ranks are not whole nodes of {gpus} GPUs"));
        }
        let nodes = Mesh::new(ranks / gpus, gpus).map_err(|e| e.to_string())?;
        out.push(("HSDP", nodes, Sharding::Hsdp));
        out.push(("SS-HSDP", nodes, Sharding::Hierarchical));
    }
    Ok(out)
}

/// One layout's plan in one format, projected.
struct Projected {
    memory: RankMemory,
    gather_s: f64,
    reduce_s: f64,
    rebuild_s: f64,
    muon_s: f64,
    gather_gb: f64,
    /// The plan's padding over its buffers (alignment, pieces padded to the largest).
    padding: f64,
}

fn project(
    args: &Args,
    shape: &TransformerShape,
    mesh: Mesh,
    sharding: Sharding,
    format: RuntimeFormat,
) -> Result<Projected, String> {
    let mut config = PlanConfig::default()
        .with_sharding(sharding)
        .with_format(format)
        .with_bucket_elements(args.bucket_elements);
    if !args.muon {
        config.optimizer = OptimizerFootprint {
            matrix_state_bytes: 8,
            elementwise_state_bytes: 8,
        };
    }
    let plan = Plan::build(shape.specs(DType::Bf16), mesh, config).map_err(|e| e.to_string())?;
    let options = TrafficOptions {
        reshard_after_forward: args.reshard,
        muon_exchange: args.muon.then_some(MuonExchange::OwnerAllToAll),
    };
    let traffic = StepTraffic::of(&plan, options);
    let t = traffic.time(mesh, &args.links);
    Ok(Projected {
        memory: plan.memory().max_rank().1,
        gather_s: t.forward_gather + t.backward_gather,
        reduce_s: t.gradient_reduction,
        rebuild_s: t.shard_rebuild,
        muon_s: t.muon_exchange,
        gather_gb: (traffic.wire_bytes(Purpose::ForwardGather)
            + traffic.wire_bytes(Purpose::BackwardGather))
            / 1e9,
        padding: plan.stats().padding_ratio(),
    })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(a) => a,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("error: {message}");
            }
            eprintln!(
                "usage: project_scaling [--link-gbps INTRA,INTER] [--latency-us INTRA,INTER] \
                 [--gpus-per-node G] [--ranks N,N,...] [--model llama-7b,llama-70b,gpt-small] \
                 [--optim muon|adamw] [--reshard] [--bucket-elements N]"
            );
            return if message.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
        }
    };
    let l = &args.links;
    println!(
        "Links: {:.0} Gbit/s per rank within a node ({} ranks), {:.0} Gbit/s across nodes; {:.0} µs \
         / {:.0} µs per ring step. Ring collectives, nothing overlapped; buckets of {} elements; \
         fp32 masters and gradients; {} optimizer state; {}.",
        l.intra_bytes_per_s * 8.0 / 1e9,
        l.ranks_per_node,
        l.inter_bytes_per_s * 8.0 / 1e9,
        l.intra_latency_s * 1e6,
        l.inter_latency_s * 1e6,
        args.bucket_elements,
        if args.muon {
            "Muon (4 B/element on matrices) + AdamW (8 B/element on the rest)"
        } else {
            "AdamW (8 B/element)"
        },
        if args.reshard {
            "buckets gathered again in backward (reshard after forward)"
        } else {
            "buckets gathered once per step (no reshard after forward)"
        },
    );
    println!(
        "Per rank, the most loaded rank. Pairs are bf16 / MXFP8 runtime parameters. full = one \
         shard group over all ranks; HSDP and SS-HSDP: shard group = one node (HSDP replicates \
         masters and optimizer state per node, SS-HSDP shards them over the world). gather = \
         bucket all-gathers; reduce = gradient reduce-scatter (+ replica reduce-scatter or \
         all-reduce); rebuild = SS-HSDP's replica all-gather of re-derived pieces; Muon = the \
         owner all-to-all exchange of split matrices (rows to their Newton–Schulz owner and \
         back; bf16 plan), not in the comm total."
    );
    for (name, shape) in &args.models {
        let params: u64 = shape.specs(DType::Bf16).iter().map(|s| s.numel()).sum();
        println!(
            "\n### {name} ({:.2}B parameters)\n\n| ranks | layout | runtime shard GiB \
             (MXFP8 ÷ bf16) | gathered peak GiB | fp32 master GiB | optimizer GiB | grad shard GiB | \
             total GiB | gather GB sent (MXFP8 ÷ bf16) | MXFP8 padding | gather s | reduce s | \
             rebuild s | comm s / step | Muon s |",
            params as f64 / 1e9
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for &ranks in &args.ranks {
            let layouts = match layouts(ranks, l.ranks_per_node) {
                Ok(v) => v,
                Err(e) => {
                    println!("| {ranks} | n/a: {e} ||||||||||||||");
                    continue;
                }
            };
            for (layout, mesh, sharding) in layouts {
                let bf = project(&args, shape, mesh, sharding, RuntimeFormat::Bf16);
                let mx = project(&args, shape, mesh, sharding, RuntimeFormat::Mxfp8);
                let (b, m) = match (bf, mx) {
                    (Ok(b), Ok(m)) => (b, m),
                    (Err(e), _) | (_, Err(e)) => {
                        println!("| {ranks} | {layout} | n/a: {e} |||||||||||||");
                        continue;
                    }
                };
                let comm = |p: &Projected| p.gather_s + p.reduce_s + p.rebuild_s;
                let ratio = |m: f64, b: f64| m / b.max(f64::MIN_POSITIVE);
                let (shard_b, shard_m) = (b.memory.runtime_shard, m.memory.runtime_shard);
                println!(
                    "| {ranks} | {layout} | {:.2} / {:.2} ({:.3}) | {:.2} / {:.2} | {:.2} | {:.2} \
                     | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} ({:.3}) | {:.2}% | {:.3} / {:.3} | \
                     {:.3} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} |",
                    gib(shard_b),
                    gib(shard_m),
                    ratio(shard_m as f64, shard_b as f64),
                    gib(b.memory.gathered_peak),
                    gib(m.memory.gathered_peak),
                    gib(b.memory.master),
                    gib(b.memory.optimizer_state),
                    gib(b.memory.gradient_shard),
                    gib(b.memory.total()),
                    gib(m.memory.total()),
                    b.gather_gb,
                    m.gather_gb,
                    ratio(m.gather_gb, b.gather_gb),
                    100.0 * m.padding,
                    b.gather_s,
                    m.gather_s,
                    b.reduce_s,
                    b.rebuild_s,
                    m.rebuild_s,
                    comm(&b),
                    comm(&m),
                    b.muon_s,
                );
            }
        }
    }
    ExitCode::SUCCESS
}
