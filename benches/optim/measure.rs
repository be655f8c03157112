//! The measurement: shards the parameter set over a threads-engine world and times each
//! optimizer phase's steps, with the bytes moved, Newton–Schulz work and heap peak per rank.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::optim::AdamWConfig;
use sshsdp::backend::{shard, HsdpConfig};
use sshsdp::comm::threads::{ThreadComm, ThreadsConfig, ThreadsWorld, TrafficBytes};
use sshsdp::comm::Collective;
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::{MuonConfig, MuonExchange, ShardedMuon};
use sshsdp::plan::projection::{Purpose, StepTraffic, TrafficOptions};
use sshsdp::plan::{Mesh, Role, RuntimeFormat, Sharding};

use crate::common::{median, LIVE, PEAK};
use crate::model::{tokens, GptShapes};
use crate::{B, BUCKET_ELEMENTS, LR, STEPS, WARMUP};
use sshsdp::optim::ShardedStep;

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
pub struct Row {
    /// Median over steps of the slowest rank's step time.
    pub secs: f64,
    /// Summed over ranks, per step.
    pub ns_calls: f64,
    pub ns_flops: f64,
    /// Measured NS FLOPs, max over mean across ranks.
    pub ns_balance: f64,
    /// Planned NS load (`plan.owner_load()`), max over mean across pieces.
    pub plan_balance: f64,
    pub exchanged: u64,
    pub peak: usize,
    /// Per rank: bytes the engine moved in one training step.
    pub traffic: Vec<TrafficBytes>,
    /// Bytes of the plan's split Muon matrices (f32).
    pub split_bytes: u64,
    /// The projection's bytes of Muon's exchange in the whole update group, per step: (owner
    /// all-to-all, all-reduce).
    pub projected: (f64, f64),
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
pub enum Phase {
    AdamW,
    Muon(MuonExchange),
}

/// Shards `init` over `world` ranks and times each of `phases` in turn on the same shards
/// (each optimizer built fresh, the previous one's state dropped).
pub fn run(init: &GptShapes<B>, world: usize, phases: &[Phase]) -> Vec<Row> {
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
