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

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use sshsdp::backend::{init_seeded, named_params, shard, Hsdp, HsdpConfig};
use sshsdp::comm::threads::{ThreadComm, ThreadsConfig, ThreadsWorld, TrafficBytes};
use sshsdp::comm::Collective;
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::{newton_schulz, ns_flops, MuonConfig, MuonExchange, NsPrecision, ShardedMuon};
use sshsdp::plan::projection::{Purpose, StepTraffic, TrafficOptions};
use sshsdp::plan::{Mesh, Role, RoleRule, RuntimeFormat, Sharding};

mod common;
use common::{cpu_ticks, median, others_share, LIVE, PEAK};

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

/// One decoder layer's parameters (pre-norm attention projections and MLP).
#[derive(Module, Debug)]
struct Layer<B: Backend> {
    ln_attn: LayerNorm<B>,
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    proj: Linear<B>,
    ln_mlp: LayerNorm<B>,
    fc_in: Linear<B>,
    fc_out: Linear<B>,
}

/// GPT-small's parameter shapes with `layers` layers (no position embedding, untied head).
#[derive(Module, Debug)]
struct GptShapes<B: Backend> {
    embed: Embedding<B>,
    layers: Vec<Layer<B>>,
    ln_final: LayerNorm<B>,
    lm_head: Linear<B>,
}

impl<B: Backend> GptShapes<B> {
    fn new(layers: usize, device: &B::Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        let norm = || LayerNormConfig::new(D).init(device);
        Self {
            embed: EmbeddingConfig::new(VOCAB, D).init(device),
            layers: (0..layers)
                .map(|_| Layer {
                    ln_attn: norm(),
                    query: linear(D, D),
                    key: linear(D, D),
                    value: linear(D, D),
                    proj: linear(D, D),
                    ln_mlp: norm(),
                    fc_in: linear(D, MLP),
                    fc_out: linear(MLP, D),
                })
                .collect(),
            ln_final: norm(),
            lm_head: linear(D, VOCAB),
        }
    }

    /// A cheap synthetic loss that gives every parameter a gradient: mean squared logit.
    fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let mut x = self.embed.forward(tokens);
        for l in &self.layers {
            let h = l.ln_attn.forward(x.clone());
            let mix =
                l.query.forward(h.clone()).tanh() * l.key.forward(h.clone()) + l.value.forward(h);
            x = x + l.proj.forward(mix);
            let h = l.ln_mlp.forward(x.clone());
            x = x + l.fc_out.forward(gelu(l.fc_in.forward(h)));
        }
        self.lm_head
            .forward(self.ln_final.forward(x))
            .powi_scalar(2)
            .mean()
    }
}

fn tokens(step: usize, rank: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = (0..TOKENS)
        .map(|i| ((i + 31 * step + 977 * rank) * 2_654_435_761 % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [1, TOKENS]), device)
}

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

/// One optimizer phase's numbers on one rank.
struct RankPhase {
    times: Vec<f64>,
    /// Bytes the engine moved for this rank in each timed step (forward, backward, update).
    traffic: Vec<TrafficBytes>,
    /// Newton–Schulz calls and FLOPs per step (from `ns_stats` deltas over the timed steps).
    ns_calls: f64,
    ns_flops: f64,
    exchanged: u64,
    /// Heap peak of the process during the phase, above the world's baseline (rank 0 only).
    peak: usize,
}

/// One configuration's numbers.
#[derive(Clone)]
struct Row {
    /// Median over steps of the slowest rank's step time.
    secs: f64,
    /// Summed over ranks, per step.
    ns_calls: f64,
    ns_flops: f64,
    /// Measured NS FLOPs, max over mean across ranks.
    ns_balance: f64,
    /// Planned NS load (`plan.owner_load()`), max over mean across pieces.
    plan_balance: f64,
    exchanged: u64,
    peak: usize,
    /// Per rank: bytes the engine moved in one training step.
    traffic: Vec<TrafficBytes>,
    /// Bytes of the plan's split Muon matrices (f32).
    split_bytes: u64,
    /// The projection's bytes of Muon's exchange in the whole update group, per step: (owner
    /// all-to-all, all-reduce).
    projected: (f64, f64),
}

fn max_over_mean(v: &[f64]) -> f64 {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    if mean > 0.0 {
        v.iter().copied().fold(0.0, f64::max) / mean
    } else {
        1.0
    }
}

/// Steps `model` `WARMUP + STEPS` times with `step`, each after a fresh forward and backward;
/// returns the timed steps' seconds (barrier to return) and the bytes the engine moved for this
/// rank in each timed step, forward and backward included (between barriers, so every peer is
/// done with this rank's buffers; nothing is in flight between steps).
fn timed_steps(
    model: &mut Option<GptShapes<B>>,
    sync: &ThreadComm,
    mut step: impl FnMut(GptShapes<B>) -> GptShapes<B>,
    mut after_warmup: impl FnMut(),
) -> (Vec<f64>, Vec<TrafficBytes>) {
    let device = Default::default();
    let rank = sync.rank();
    let (mut times, mut traffic) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + STEPS {
        if i == WARMUP {
            after_warmup();
        }
        sync.barrier().unwrap();
        let before = sync.traffic();
        let m = model.take().unwrap();
        let _ = m.loss(tokens(i, rank, &device)).backward();
        sync.barrier().unwrap();
        let t = Instant::now();
        *model = Some(step(m));
        let secs = t.elapsed().as_secs_f64();
        sync.barrier().unwrap();
        let after = sync.traffic();
        if i >= WARMUP {
            times.push(secs);
            traffic.push(TrafficBytes {
                sent: after.sent - before.sent,
                received: after.received - before.received,
            });
        }
    }
    (times, traffic)
}

/// Resets the peak to the live heap on rank 0 between barriers; returns the old peak above
/// `base`.
fn phase_peak(sync: &ThreadComm, base: usize) -> usize {
    sync.barrier().unwrap();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    if sync.rank() == 0 {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    sync.barrier().unwrap();
    peak
}

/// One optimizer phase of [`run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AdamW,
    Muon(MuonExchange),
}

/// Shards `init` over `world` ranks and times each of `phases` in turn on the same shards
/// (each optimizer built fresh, the previous one's state dropped).
fn run(init: &GptShapes<B>, world: usize, phases: &[Phase]) -> Vec<Row> {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let config = ThreadsConfig {
        timeout: Duration::from_secs(600),
    };
    type RankResult = (Vec<RankPhase>, Vec<u128>, u64, (f64, f64));
    let ranks: Vec<RankResult> = ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        // Shares this rank's traffic counters with the runtime's communicators (split from
        // the same world rank).
        let sync = comm.split(0, rank).unwrap();
        let config = HsdpConfig::new(Mesh::flat(world).unwrap())
            .with_sharding(Sharding::Hierarchical)
            .with_format(RuntimeFormat::F32)
            .with_bucket_elements(BUCKET_ELEMENTS);
        let (model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let split_bytes: u64 = runtime
            .plan()
            .params()
            .iter()
            .filter(|p| p.spec.role == Role::Matrix && p.split)
            .map(|p| 4 * p.spec.numel())
            .sum();
        let mut model = Some(model);
        phase_peak(&sync, base);
        let mut out = Vec::new();
        for &phase in phases {
            let (times, traffic, ns, exchanged) = match phase {
                Phase::AdamW => {
                    let mut adamw = ShardedOptimizer::new(AdamWConfig::new().build(), device);
                    let step = |m| adamw.step(LR, m, &runtime).unwrap();
                    let (times, traffic) = timed_steps(&mut model, &sync, step, || {});
                    (times, traffic, Default::default(), 0)
                }
                Phase::Muon(exchange) => {
                    let mut muon = ShardedMuon::new(
                        MuonConfig::new().init(),
                        AdamWConfig::new().build(),
                        device,
                    )
                    .with_exchange(exchange);
                    let counters = muon.muon().clone();
                    let (times, traffic) = timed_steps(
                        &mut model,
                        &sync,
                        |m| muon.step(LR, m, &runtime).unwrap(),
                        || counters.reset_ns_stats(),
                    );
                    let last = muon.last_step();
                    (
                        times,
                        traffic,
                        muon.muon().ns_stats(),
                        last.exchanged_elements,
                    )
                }
            };
            out.push(RankPhase {
                times,
                traffic,
                ns_calls: ns.calls as f64 / STEPS as f64,
                ns_flops: ns.flops as f64 / STEPS as f64,
                exchanged,
                peak: phase_peak(&sync, base),
            });
        }
        let projected = |exchange| {
            let options = TrafficOptions {
                muon_exchange: Some(exchange),
                ..Default::default()
            };
            StepTraffic::of(runtime.plan(), options)
                .collectives
                .iter()
                .filter(|c| c.purpose == Purpose::MuonExchange)
                .map(|c| c.group_bytes())
                .sum::<f64>()
        };
        let projected = (
            projected(MuonExchange::OwnerAllToAll),
            projected(MuonExchange::AllReduce),
        );
        (
            out,
            runtime.plan().owner_load().to_vec(),
            split_bytes,
            projected,
        )
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect();
    let load: Vec<f64> = ranks[0].1.iter().map(|&l| l as f64).collect();
    (0..phases.len())
        .map(|phase| {
            let per: Vec<&RankPhase> = ranks.iter().map(|r| &r.0[phase]).collect();
            let step_times = (0..STEPS)
                .map(|i| per.iter().map(|p| p.times[i]).fold(0.0, f64::max))
                .collect();
            let per_rank: Vec<f64> = per.iter().map(|p| p.ns_flops).collect();
            Row {
                secs: median(step_times),
                ns_calls: per.iter().map(|p| p.ns_calls).sum(),
                ns_flops: per_rank.iter().sum(),
                ns_balance: max_over_mean(&per_rank),
                plan_balance: max_over_mean(&load),
                exchanged: per[0].exchanged,
                peak: per[0].peak,
                traffic: per.iter().map(|p| steady(&p.traffic)).collect(),
                split_bytes: ranks[0].2,
                projected: ranks[0].3,
            }
        })
        .collect()
}

/// A phase's bytes per step: every timed step moves the same (the same collectives of the same
/// sizes), which is checked.
fn steady(steps: &[TrafficBytes]) -> TrafficBytes {
    assert!(
        steps.windows(2).all(|w| w[0] == w[1]),
        "every step moves the same bytes: {steps:?}"
    );
    steps[0]
}

/// Muon's exchange of split matrices, old (two all-reduces) against new (owner all-to-all), at
/// each world: the bytes the engine moved for each rank in a training step above AdamW's step
/// on the same shards (which runs every other collective alike), and the optimizer-step time.
fn exchange_table(measured: &[(usize, [Row; 3])]) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!();
    println!(
        "Muon's exchange of split matrices (P: their f32 bytes; W: update-group size): bytes the \
         threads engine moved per step for each rank, above AdamW's step on the same shards; \
         group: all ranks' sent bytes; projected: `sshsdp::plan::projection`'s bytes for the \
         group; bound: 1.1 · 2·P·(W−1)/W for the whole group"
    );
    println!(
        "{:<6} {:<14} {:>9} {:>8} {:>22} {:>22} {:>12} {:>10} {:>10} {:>12} {:>8}",
        "world",
        "exchange",
        "step ms",
        "P MiB",
        "sent MiB per rank",
        "received MiB per rank",
        "group MiB",
        "projected",
        "/measured",
        "2P(W-1)/W",
        "≤ bound"
    );
    for (world, [adamw, new, old]) in measured {
        let w = *world as f64;
        let bound = 2.0 * new.split_bytes as f64 * (w - 1.0) / w;
        for (name, row, projected) in [
            ("all-reduce", old, old.projected.1),
            ("owner a2a", new, new.projected.0),
        ] {
            let above = |f: fn(&TrafficBytes) -> u64| -> Vec<u64> {
                row.traffic
                    .iter()
                    .zip(&adamw.traffic)
                    .map(|(m, a)| f(m) - f(a))
                    .collect()
            };
            let sent = above(|t| t.sent);
            let received = above(|t| t.received);
            let list = |v: &[u64]| {
                v.iter()
                    .map(|&b| format!("{:.2}", mib(b)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let group: u64 = sent.iter().sum();
            assert_eq!(
                group,
                received.iter().sum::<u64>(),
                "what is sent is received"
            );
            println!(
                "{:<6} {:<14} {:>9.1} {:>8.2} {:>22} {:>22} {:>12.2} {:>10.2} {:>10.4} {:>12.2} {:>8}",
                world,
                name,
                row.secs * 1e3,
                mib(row.split_bytes),
                list(&sent),
                list(&received),
                mib(group),
                projected / (1024.0 * 1024.0),
                projected / group as f64,
                bound / (1024.0 * 1024.0),
                if group as f64 <= 1.1 * bound {
                    "yes"
                } else {
                    "no"
                },
            );
        }
    }
}

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
struct Kernels {
    /// GFLOP/s of one 768×3072 · 3072×768 matmul on one thread.
    matmul: f64,
    /// Aggregate GFLOP/s with one such matmul per core at once.
    matmul_all: f64,
    /// Seconds of Newton–Schulz on 768×768 and 768×3072 (one thread).
    ns_square: f64,
    ns_wide: f64,
}

fn kernels(ns_steps: usize, cores: usize) -> Kernels {
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

/// Element counts of a parameter set.
#[derive(Default)]
struct Counts {
    /// Elements outside the layers (embedding, final norm, head): all element-wise.
    fixed: usize,
    /// Per layer: in Muon matrices, and element-wise (biases, LayerNorm vectors).
    layer_matrix: usize,
    layer_elementwise: usize,
    matrices: usize,
}

fn counts(init: &GptShapes<B>, layers: usize) -> Counts {
    let rule = RoleRule::default();
    let mut c = Counts::default();
    for p in named_params(init).unwrap() {
        let n = p.values.len();
        let role = rule.role_of(&p.path, &p.shape);
        match (p.path.starts_with("layers."), role) {
            (false, Role::Matrix) => panic!("{}: a matrix outside the layers", p.path),
            (false, Role::Elementwise) => c.fixed += n,
            (true, Role::Matrix) => {
                c.layer_matrix += n;
                c.matrices += 1;
            }
            (true, Role::Elementwise) => c.layer_elementwise += n,
        }
    }
    assert_eq!(
        c.matrices,
        MATRICES_PER_LAYER * layers,
        "role rule: six matrices a layer"
    );
    c.layer_matrix = c.layer_matrix.checked_div(layers).unwrap_or(0);
    c.layer_elementwise = c.layer_elementwise.checked_div(layers).unwrap_or(0);
    c
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
