//! Optimizer step time for a GPT-small-shaped parameter set on the threads engine: the sharded
//! element-wise optimizer (`ShardedOptimizer` with AdamW on every element) against distributed
//! Muon (`ShardedMuon`: Muon on the matrices, AdamW on the embedding, the LM head and the 1-D
//! parameters), at world 1, 2 and 4, hierarchical sharding, f32 runtime parameters, 4M-element
//! buckets; and Muon's exchange of split matrices, the owner all-to-all against the earlier two
//! all-reduces, with the bytes the threads engine moved for each rank (`ThreadComm::traffic`).
//! Run: `cargo bench --bench optim` (`SSHSDP_BENCH_LAYERS=n` for `n` decoder layers, default 2).
//!
//! The parameter set has GPT-small's shapes — d_model 768, MLP 3072, a 50257-token embedding and
//! an untied LM head, LayerNorm vectors and biases — with a configurable number of layers (each:
//! four 768×768 attention projections, 768×3072 and 3072×768 MLP matrices, two LayerNorms).
//! Under the plan's role rule (`sshsdp_plan::RoleRule`) the `embed` and `lm_head` matrices are
//! element-wise, so Muon runs Newton–Schulz on the six matrices of each layer only.
//!
//! What is timed is the optimizer step alone (from a barrier to the step's return, the slowest
//! rank per step, median of a few steps after a warm-up); gradients come from one tiny forward
//! and backward on 8 tokens (mean of squared logits) before each step, outside the timing. The
//! step includes everything `update_pieces` does: the optimizer on this rank's fp32 pieces, for
//! Muon the exchange of split matrices, and the rebuild of the runtime shards.
//!
//! Also measured: Newton–Schulz alone (`sshsdp_optim::newton_schulz` on random 768×768 and
//! 768×3072 matrices, `NdArray<f32>`) and a Burn NdArray 768×3072 · 3072×768 matmul, the ceiling
//! (one thread, and one matmul per core at once; best of a few runs). NdArray runs a 2-D matmul
//! on one thread, so world 1 orthogonalises on one core, while world 4's four rank threads share
//! all cores.
//!
//! Both optimizers step the same shards, one after the other (AdamW's state dropped before
//! Muon's run). The 12-layer (full GPT-small) numbers are extrapolated from the measured layer
//! count: AdamW's time is proportional to the elements stepped; Muon's element-wise elements
//! cost AdamW's time per element and the rest of its step is per layer.
//!
//! Most of the wall time (about 4–6 minutes on 2 cores) is outside the timed steps: sharding and
//! the forward and backward before each step, whose gradient hand-off of the vocabulary-sized
//! embedding and head takes seconds on NdArray.

use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use sshsdp::backend::{init_seeded, Hsdp};
use sshsdp::optim::{ns_flops, MuonConfig, MuonExchange};

#[path = "../common/mod.rs"]
mod common;
mod exchange;
mod kernel_rates;
mod measure;
mod model;

use common::{cpu_ticks, others_share};
use exchange::exchange_table;
use kernel_rates::kernels;
use measure::{run, Phase, Row};
use model::{counts, GptShapes};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const D: usize = 768;
const MLP: usize = 3072;
const VOCAB: usize = 50257;
const FULL_LAYERS: usize = 12;
const DEFAULT_LAYERS: usize = 2;
/// Tokens of the synthetic batch `[1, TOKENS]`.
const TOKENS: usize = 8;
const WARMUP: usize = 1;
const STEPS: usize = 3;
const LR: f64 = 1e-3;
const WORLDS: [usize; 3] = [1, 2, 4];
/// Bucket target (elements): 4M cuts some Muon matrices at world 2 and 4 (with the default 25M
/// the pieces' edges fall inside the 38.6M-element embedding and head), so Muon's exchange of
/// split matrices has something to move.
const BUCKET_ELEMENTS: u64 = 4_000_000;
/// Matrices (Muon's) per layer.
const MATRICES_PER_LAYER: usize = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Opt {
    AdamW,
    Muon,
}

impl Opt {
    fn name(self) -> &'static str {
        match self {
            Opt::AdamW => "AdamW",
            Opt::Muon => "Muon+AdamW",
        }
    }
}

fn main() {
    let layers: usize = std::env::var("SSHSDP_BENCH_LAYERS")
        .ok()
        .map(|v| v.parse().expect("SSHSDP_BENCH_LAYERS: a number of layers"))
        .unwrap_or(DEFAULT_LAYERS);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ns_steps = MuonConfig::new().ns_steps;
    let wall = Instant::now();
    let ticks = cpu_ticks();

    // Newton–Schulz and matmul rates.
    let k = kernels(ns_steps, cores);
    let gf_square = ns_flops(D, D, ns_steps) as f64 / 1e9;
    let gf_wide = ns_flops(D, MLP, ns_steps) as f64 / 1e9;
    let ns_layer_gf = 4.0 * gf_square + 2.0 * gf_wide;
    let ns_layer_secs = 4.0 * k.ns_square + 2.0 * k.ns_wide;
    let ns_rate = ns_layer_gf / ns_layer_secs;
    println!(
        "Machine: {cores} cores. Burn NdArray f32 matmul {D}x{MLP}·{MLP}x{D}: {:.1} GFLOP/s on \
         one thread, {:.1} GFLOP/s with {cores} at once (best runs)",
        k.matmul, k.matmul_all
    );
    println!(
        "Newton–Schulz ({ns_steps} steps, f32, one thread, best runs): {D}x{D} {:.0} ms = \
         {:.1} GFLOP/s ({:.2} of matmul); {D}x{MLP} {:.0} ms = {:.1} GFLOP/s ({:.2}); a layer's \
         six matrices {:.1} GFLOP in {:.0} ms = {:.1} GFLOP/s ({:.2} of matmul)",
        k.ns_square * 1e3,
        gf_square / k.ns_square,
        gf_square / k.ns_square / k.matmul,
        k.ns_wide * 1e3,
        gf_wide / k.ns_wide,
        gf_wide / k.ns_wide / k.matmul,
        ns_layer_gf,
        ns_layer_secs * 1e3,
        ns_rate,
        ns_rate / k.matmul
    );

    let device = Default::default();
    let init = init_seeded(&device, 1, |d| GptShapes::<B>::new(layers, d));
    let c = counts(&init, layers);
    let elements = |l: usize| c.fixed + l * (c.layer_matrix + c.layer_elementwise);
    let elementwise = |l: usize| c.fixed + l * c.layer_elementwise;
    println!();
    println!(
        "GPT-small shapes, {layers} layers: {:.2}M parameters ({:.2}M in {} Muon matrices, \
         {:.2}M element-wise); threads engine, hierarchical, f32 runtime; median of {STEPS} \
         steps after {WARMUP} warm-up, slowest rank",
        elements(layers) as f64 / 1e6,
        (layers * c.layer_matrix) as f64 / 1e6,
        c.matrices,
        elementwise(layers) as f64 / 1e6,
    );
    println!(
        "{:<6} {:<11} {:>9} {:>7} {:>8} {:>9} {:>9} {:>11} {:>11} {:>9} {:>7} {:>9}",
        "world",
        "optimizer",
        "step ms",
        "/AdamW",
        "/world 1",
        "NS calls",
        "NS GFLOP",
        "NS 1-core",
        "exch Melem",
        "plan bal",
        "NS bal",
        "peak MiB"
    );
    let mut rows: Vec<(usize, Opt, Row)> = Vec::new();
    let mut exchanges = Vec::new();
    for world in WORLDS {
        let mut phases = vec![Phase::AdamW, Phase::Muon(MuonExchange::OwnerAllToAll)];
        if world > 1 {
            phases.push(Phase::Muon(MuonExchange::AllReduce));
        }
        let mut measured = run(&init, world, &phases).into_iter();
        let (adamw, muon) = (measured.next().unwrap(), measured.next().unwrap());
        if let Some(old) = measured.next() {
            exchanges.push((world, [adamw.clone(), muon.clone(), old]));
        }
        assert_eq!(
            muon.ns_calls as usize, c.matrices,
            "each matrix orthogonalised once per world and step"
        );
        for (opt, r) in [(Opt::AdamW, adamw), (Opt::Muon, muon)] {
            let base = |w: usize, o: Opt| {
                rows.iter()
                    .find(|(rw, ro, _)| *rw == w && *ro == o)
                    .map(|(_, _, b)| b.secs)
            };
            let ratio = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.2}", r.secs / b));
            let muon = opt == Opt::Muon;
            let multi = muon && world > 1;
            let show = |on: bool, v: String| if on { v } else { "-".into() };
            println!(
                "{:<6} {:<11} {:>9.1} {:>7} {:>8} {:>9} {:>9} {:>11} {:>11} {:>9} {:>7} {:>9.0}",
                world,
                opt.name(),
                r.secs * 1e3,
                ratio(if muon { base(world, Opt::AdamW) } else { None }),
                ratio(if world > 1 { base(1, opt) } else { None }),
                show(muon, format!("{:.0}", r.ns_calls)),
                show(muon, format!("{:.1}", r.ns_flops / 1e9)),
                // All ranks' Newton–Schulz work at the measured one-thread rate.
                show(muon, format!("{:.0} ms", r.ns_flops / 1e9 / ns_rate * 1e3)),
                show(multi, format!("{:.2}", r.exchanged as f64 / 1e6)),
                show(multi, format!("{:.3}", r.plan_balance)),
                show(multi, format!("{:.3}", r.ns_balance)),
                r.peak as f64 / (1024.0 * 1024.0),
            );
            rows.push((world, opt, r));
        }
    }
    println!(
        "NS calls and GFLOP per step summed over ranks; NS 1-core: that work at the one-thread \
         NS rate; exch: elements of split matrices in Muon's exchange (the owner all-to-all); \
         plan bal: max/mean of plan.owner_load() over pieces; NS bal: max/mean of NS FLOPs run \
         per rank; peak: process heap above the world's baseline during the phase, forward and \
         backward included (all ranks)"
    );
    exchange_table(&exchanges);

    if layers > 0 {
        // AdamW costs a fixed time per element; Muon's element-wise part runs at AdamW's rate
        // and the rest of its step is per layer.
        let at = |world: usize, opt: Opt| {
            rows.iter()
                .find(|(w, o, _)| *w == world && *o == opt)
                .map(|(_, _, r)| r.secs)
                .unwrap()
        };
        let full = |world: usize, opt: Opt| {
            let per_element = at(world, Opt::AdamW) / elements(layers) as f64;
            let fixed = per_element * c.fixed as f64;
            let per_layer = match opt {
                Opt::AdamW => per_element * (c.layer_matrix + c.layer_elementwise) as f64,
                Opt::Muon => {
                    let matrices = at(world, Opt::Muon) - per_element * elementwise(layers) as f64;
                    matrices / layers as f64 + per_element * c.layer_elementwise as f64
                }
            };
            (fixed, per_layer, fixed + FULL_LAYERS as f64 * per_layer)
        };
        println!();
        println!(
            "Full GPT-small ({FULL_LAYERS} layers, {:.2}M parameters) extrapolated from the \
             {layers}-layer runs: AdamW time ∝ elements; Muon = its element-wise elements at \
             AdamW's per-element time + the rest of its step per layer. NS {:.1} GFLOP a step.",
            elements(FULL_LAYERS) as f64 / 1e6,
            FULL_LAYERS as f64 * ns_layer_gf,
        );
        println!(
            "{:<6} {:<11} {:>9} {:>13} {:>10} {:>7} {:>8}",
            "world", "optimizer", "fixed ms", "per layer ms", "12L ms", "/AdamW", "/world 1"
        );
        for world in WORLDS {
            for opt in [Opt::AdamW, Opt::Muon] {
                let (fixed, per_layer, t) = full(world, opt);
                println!(
                    "{:<6} {:<11} {:>9.1} {:>13.1} {:>10.0} {:>7.2} {:>8.2}",
                    world,
                    opt.name(),
                    fixed * 1e3,
                    per_layer * 1e3,
                    t * 1e3,
                    t / full(world, Opt::AdamW).2,
                    t / full(1, opt).2
                );
            }
        }
    }
    println!();
    println!(
        "Bench wall time {:.0} s; {}",
        wall.elapsed().as_secs_f64(),
        others_share(ticks)
    );
}
