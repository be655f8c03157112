//! The projection (`sshsdp::plan::projection`) against real runs: a small GPT trained on the
//! threads engine at world 2 and 4, flat and on 2×2 meshes (hierarchical, HSDP, DDP), f32, bf16
//! and MXFP8, with and without resharding after forward, and with distributed Muon. The bytes
//! the projection predicts from the plan must equal the runtime's counters of every step
//! exactly.

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{init_seeded, shard, Hsdp, HsdpConfig};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::ShardedStep;
use sshsdp::optim::{MuonConfig, ShardedMuon};
use sshsdp::plan::projection::{MuonExchange, Purpose, StepTraffic, TrafficOptions};
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

type B = Autodiff<Hsdp<NdArray<f32>>>;

const STEPS: usize = 3;
const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 32,
    layers: 2,
    heads: 2,
    seq: 8,
};

fn tokens(rows: usize, offset: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = (0..rows * (CONFIG.seq + 1))
        .map(|i| ((i + offset * 31) * 7 % CONFIG.vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, CONFIG.seq + 1]), device)
}

/// Trains `STEPS` steps over `mesh` and checks every step's counters (and, with Muon, the
/// bytes of its owner exchange, summed over the ranks) against the projection of the plan.
fn check(mesh: Mesh, sharding: Sharding, format: RuntimeFormat, reshard: bool, muon: bool) {
    let device = Default::default();
    let init: Gpt<B> = init_seeded(&device, 7, |d| CONFIG.init(d));
    let world = mesh.world_size();
    let label = format!("{mesh} {sharding:?} {format:?} reshard={reshard} muon={muon}");
    let ranks = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(mesh)
            .with_sharding(sharding)
            .with_format(format)
            .with_reshard_after_forward(reshard)
            .with_bucket_elements(6_000);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let options = TrafficOptions {
            reshard_after_forward: reshard,
            muon_exchange: muon.then_some(MuonExchange::OwnerAllToAll),
        };
        let projected = StepTraffic::of(runtime.plan(), options);
        let exchange: f64 = projected
            .collectives
            .iter()
            .filter(|c| c.purpose == Purpose::MuonExchange)
            .map(|c| c.group_bytes())
            .sum();
        let mut moved = (0u64, 0u64);
        assert!(
            runtime.plan().buckets().len() >= 3,
            "{label}: too few buckets"
        );
        let mut adamw = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let mut muon_optim =
            ShardedMuon::new(MuonConfig::new().init(), AdamWConfig::new().build(), device);
        for step in 0..STEPS {
            runtime.take_counters();
            let loss = model.loss(tokens(2, step * world + rank, &device));
            let _ = loss.backward();
            model = if muon {
                muon_optim.step(1e-3, model, &runtime).unwrap()
            } else {
                adamw.step(1e-3, model, &runtime).unwrap()
            };
            let c = runtime.take_counters();
            assert_eq!(
                c.gathered_bytes,
                projected.gathered_bytes(),
                "{label} rank {rank} step {step}: gathered bytes"
            );
            assert_eq!(
                c.reduced_bytes,
                projected.reduced_bytes(),
                "{label} rank {rank} step {step}: reduced bytes"
            );
            if muon {
                let last = muon_optim.last_step();
                moved.0 += 4 * last.sent_elements;
                moved.1 += 4 * last.received_elements;
            }
        }
        (moved, exchange)
    })
    .unwrap();
    let ranks: Vec<((u64, u64), f64)> = ranks.into_iter().map(|r| r.unwrap()).collect();
    if muon {
        // What every rank sent (and received) in the owner exchange, over the steps: the
        // projection's two all-to-alls (of one update group; HSDP's replicas each run theirs),
        // exactly.
        let groups = match sharding {
            Sharding::Hsdp => mesh.replicas(),
            _ => 1,
        };
        let projected = groups as f64 * ranks[0].1;
        let sent: u64 = ranks.iter().map(|r| r.0 .0).sum();
        let received: u64 = ranks.iter().map(|r| r.0 .1).sum();
        assert_eq!(sent, received, "{label}");
        assert_eq!(
            sent as f64,
            STEPS as f64 * projected,
            "{label}: Muon exchange bytes"
        );
        assert!(sent > 0, "{label}: some matrices are split");
    }
}

#[test]
fn flat_world_2_and_4() {
    let f32 = RuntimeFormat::F32;
    let hier = Sharding::Hierarchical;
    check(Mesh::flat(2).unwrap(), hier, f32, false, false);
    check(
        Mesh::flat(4).unwrap(),
        hier,
        RuntimeFormat::Bf16,
        false,
        false,
    );
    check(Mesh::flat(2).unwrap(), Sharding::Ddp, f32, false, false);
}

#[test]
fn meshes_2x2_hierarchical_and_hsdp() {
    check(
        Mesh::new(2, 2).unwrap(),
        Sharding::Hierarchical,
        RuntimeFormat::Bf16,
        false,
        false,
    );
    check(
        Mesh::new(2, 2).unwrap(),
        Sharding::Hsdp,
        RuntimeFormat::F32,
        false,
        false,
    );
}

#[test]
fn resharding_after_forward() {
    check(
        Mesh::flat(4).unwrap(),
        Sharding::Hierarchical,
        RuntimeFormat::F32,
        true,
        false,
    );
}

#[test]
fn muon_exchange() {
    let f32 = RuntimeFormat::F32;
    for world in [2, 4] {
        check(
            Mesh::flat(world).unwrap(),
            Sharding::Hierarchical,
            f32,
            false,
            true,
        );
    }
    check(Mesh::new(2, 2).unwrap(), Sharding::Hsdp, f32, false, true);
}

/// Square-block MXFP8 (tiles cut at tile edges, bf16 fallbacks): the plan's layout is the
/// runtime's, so the projection is exact here too — at world 2 and 4 with and without
/// resharding (backward gathers the same one copy again), 2×2 hierarchical meshes whose runtime
/// shards hold two pieces, HSDP, and Muon's exchange of the matrices the tile cuts split.
#[test]
fn mxfp8_exactly() {
    let (mx, hier) = (RuntimeFormat::Mxfp8, Sharding::Hierarchical);
    for world in [2, 4] {
        for reshard in [false, true] {
            check(Mesh::flat(world).unwrap(), hier, mx, reshard, false);
        }
    }
    for reshard in [false, true] {
        check(Mesh::new(2, 2).unwrap(), hier, mx, reshard, false);
    }
    check(Mesh::new(2, 2).unwrap(), Sharding::Hsdp, mx, true, false);
    check(Mesh::flat(4).unwrap(), hier, mx, false, true);
}
