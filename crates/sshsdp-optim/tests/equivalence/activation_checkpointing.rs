//! Activation checkpointing: `Autodiff<Hsdp<B>, BalancedCheckpointing>` (Burn recomputes
//! memory-bound ops in backward instead of keeping their outputs) trains exactly like
//! `Autodiff<Hsdp<B>>`, with and without reshard after forward (recomputation then re-gathers
//! released buckets), at world 1, 2 and on a 2×2 HSDP mesh.

use std::time::Duration;

use crate::common::{batches, rows, seeded, TinyLm};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use sshsdp_backend::{named_params, shard, Hsdp, HsdpConfig};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::ShardedOptimizer;
use sshsdp_optim::ShardedStep;
use sshsdp_plan::{Mesh, Sharding};

type Inner = NdArray<f32>;
type Plain = Autodiff<Hsdp<Inner>>;
type Recompute = Autodiff<Hsdp<Inner>, BalancedCheckpointing>;

/// Rank 0's losses and final weights (as bits) after 3 AdamW steps of the model seeded with 5,
/// and its bucket gathers over those steps,
/// on autodiff backend `$b` (a macro: the two backends differ only in their type).
macro_rules! train {
    ($b:ty, $mesh:expr, $sharding:expr, $reshard:expr) => {{
        type Ab = $b;
        let (mesh, sharding, reshard): (Mesh, Sharding, bool) = ($mesh, $sharding, $reshard);
        let init: TinyLm<Ab> = seeded(5);
        let world = mesh.world_size();
        let threads = ThreadsConfig {
            timeout: Duration::from_secs(30),
        };
        let mut ranks = ThreadsWorld::run(world, threads, |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(mesh)
                .with_sharding(sharding)
                .with_bucket_elements(1500)
                .with_reshard_after_forward(reshard);
            let (mut model, runtime) =
                shard::<Ab, _, _>(init.clone(), config, comm, &device).unwrap();
            let mut adamw = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
            let mut losses: Vec<u32> = Vec::new();
            runtime.take_counters();
            for batch in batches(3, 8) {
                let local = 8 / world;
                let loss = model.loss(rows::<Ab>(&batch, rank * local, local, &device));
                losses.push(loss.clone().into_scalar().to_bits());
                let _ = loss.backward();
                model = adamw.step(1e-2, model, &runtime).unwrap();
            }
            let weights: Vec<Vec<u32>> = named_params(&model)
                .unwrap()
                .into_iter()
                .map(|p| p.values.iter().map(|v| v.to_bits()).collect())
                .collect();
            (losses, weights, runtime.take_counters().gathers)
        })
        .unwrap();
        ranks.swap_remove(0).unwrap()
    }};
}

#[test]
fn balanced_checkpointing_trains_exactly_like_no_checkpointing() {
    let meshes = [
        (Mesh::flat(1).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
    ];
    for (mesh, sharding) in meshes {
        for reshard in [false, true] {
            let what = format!("{mesh:?} {sharding:?} reshard {reshard}");
            let plain = train!(Plain, mesh, sharding, reshard);
            let recompute = train!(Recompute, mesh, sharding, reshard);
            assert_eq!(plain.0, recompute.0, "losses, {what}");
            assert_eq!(plain.1, recompute.1, "weights, {what}");
            assert_ne!(plain.0[0], plain.0[2], "it trained, {what}");
            // Recomputation ran: after reshard it needs buckets released since forward again.
            if reshard {
                assert!(
                    recompute.2 > plain.2,
                    "{what}: {} vs {} gathers",
                    recompute.2,
                    plain.2
                );
            }
        }
    }
}
