//! Sharded optimizers and their checkpoints.
//!
//! Distributed Muon equals single-device Muon: a small GPT trained with Muon on its matrices
//! and AdamW on the rest, sharded at world 1, 2, 4 and over 2×2 meshes, follows the same losses and
//! ends at the same weights as [`MuonWithElementwise`] on one device; each matrix is
//! orthogonalised exactly once per update group and step.
//!
//! Tolerance: gradients are averaged across ranks in another order than one device sums them
//! (last-bit differences), which Newton–Schulz's normalisation and 10 steps keep at the 1e-5
//! level: losses within 1e-4 relative, weights within 2e-4 absolute.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{init_seeded, named_params, param_roles, shard, Hsdp, HsdpConfig};
use sshsdp::checkpoint;
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedStep;
use sshsdp::optim::{MuonConfig, MuonExchange, MuonWithElementwise, ShardedMuon};
use sshsdp::plan::{Mesh, Role, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const STEPS: usize = 10;
const BATCH: usize = 8;
const LR: f64 = 2e-2;
const CONFIG: GptConfig = GptConfig {
    vocab: 32,
    d_model: 16,
    layers: 2,
    heads: 2,
    seq: 8,
};

type Weights = Vec<(String, Vec<f32>)>;

/// One rank's run: losses, final weights, Newton–Schulz calls, split matrices orthogonalised,
/// and off-rank elements (sent, received) of Muon's owner exchange.
type RankRun = (Vec<f32>, Weights, u64, u64, (u64, u64));

fn tokens(step: usize, first: usize, rows: usize) -> Tensor<B, 2, Int> {
    let w = CONFIG.seq + 1;
    let data: Vec<i64> = (first * w..(first + rows) * w)
        .map(|i| ((i * 7 + step * 13 + (i / w) * 3) % CONFIG.vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, w]), &Default::default())
}

fn muon() -> MuonConfig {
    MuonConfig::new().with_weight_decay(0.01)
}

fn weights(model: &Gpt<B>) -> Weights {
    named_params(model)
        .unwrap()
        .into_iter()
        .map(|p| (p.path, p.values))
        .collect()
}

fn single_device(init: &Gpt<B>, clip: Option<f64>) -> (Vec<f32>, Weights, u64) {
    let mut model = init.clone();
    let mut optim = MuonWithElementwise::<B, _>::new(muon().init(), AdamWConfig::new().build());
    if let Some(max_norm) = clip {
        optim = optim.with_grad_clipping(max_norm);
    }
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let loss = model.loss(tokens(step, 0, BATCH));
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, weights(&model), optim.muon().ns_calls())
}

fn sharded(
    init: &Gpt<B>,
    mesh: Mesh,
    sharding: Sharding,
    clip: Option<f64>,
) -> Vec<(Vec<f32>, Weights, u64, u64)> {
    sharded_with(init, mesh, sharding, clip, MuonExchange::default(), true)
        .into_iter()
        .map(|(losses, weights, calls, split, _)| (losses, weights, calls, split))
        .collect()
}

/// [`sharded`] with the split matrices exchanged by `exchange`; also returns each rank's
/// off-rank elements (sent, received) over the run.
fn sharded_with(
    init: &Gpt<B>,
    mesh: Mesh,
    sharding: Sharding,
    clip: Option<f64>,
    exchange: MuonExchange,
    megabatches: bool,
) -> Vec<RankRun> {
    let world = mesh.world_size();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        // Small buckets: pieces cut through matrices, so split matrices are exchanged.
        let config = HsdpConfig::new(mesh)
            .with_sharding(sharding)
            .with_bucket_elements(1500);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut optim = ShardedMuon::new(muon().init(), AdamWConfig::new().build(), device)
            .with_exchange(exchange)
            .with_megabatches(megabatches);
        if let Some(max_norm) = clip {
            optim = optim.with_grad_clipping(max_norm);
        }
        let local = BATCH / world;
        let mut losses = Vec::new();
        let (mut split, mut moved) = (0, (0, 0));
        for step in 0..STEPS {
            let loss = model.loss(tokens(step, rank * local, local));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            model = optim.step(LR, model, &runtime).unwrap();
            let last = optim.last_step();
            split += last.ns_split;
            moved.0 += last.sent_elements;
            moved.1 += last.received_elements;
        }
        (
            losses,
            weights(&model),
            optim.muon().ns_calls(),
            split,
            moved,
        )
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// Muon's matrices: the hidden layers' weights, not the embeddings (a burn-nn `Embedding`, the
/// positional one called `pos` too) nor the head.
fn matrices(init: &Gpt<B>) -> u64 {
    let roles = param_roles(init);
    assert!(roles
        .iter()
        .any(|(p, r)| p == "pos.weight" && *r == Role::Elementwise));
    roles.iter().filter(|(_, r)| *r == Role::Matrix).count() as u64
}

fn initial() -> Gpt<B> {
    init_seeded(&Default::default(), 11, |d| CONFIG.init(d))
}

fn assert_close(
    what: &str,
    ranks: &[(Vec<f32>, Weights, u64, u64)],
    losses: &[f32],
    weights: &Weights,
) {
    let world = ranks.len() as f32;
    for (step, &want) in losses.iter().enumerate() {
        let loss = ranks.iter().map(|r| r.0[step]).sum::<f32>() / world;
        assert!(
            (loss - want).abs() <= 1e-4 * want.abs(),
            "{what} step {step}: {loss} vs {want}"
        );
    }
    for (_, got_weights, _, _) in ranks {
        for ((path, got), (_, want)) in got_weights.iter().zip(weights) {
            let max = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max <= 2e-4, "{what} {path}: max diff {max}");
        }
    }
}

#[test]
fn distributed_muon_with_global_norm_clipping_equals_single_device() {
    let init = initial();
    // Muon's orthogonalisation and AdamW's normalisation are nearly scale-free: clipping shows
    // through momentum mixing steps of different scales, and needs a threshold well below the
    // norm (≈0.65 here) to move the losses.
    const MAX_NORM: f64 = 0.05;
    let (losses, weights, _) = single_device(&init, Some(MAX_NORM));
    let (unclipped, _, _) = single_device(&init, None);
    let moved = (losses[STEPS - 1] - unclipped[STEPS - 1]).abs();
    assert!(
        moved > 1e-3,
        "clipping is active: {losses:?} vs {unclipped:?}"
    );
    for world in [2, 4] {
        let ranks = sharded(
            &init,
            Mesh::flat(world).unwrap(),
            Sharding::Hierarchical,
            Some(MAX_NORM),
        );
        assert_close(&format!("clipped world {world}"), &ranks, &losses, &weights);
    }
}

#[test]
fn distributed_muon_equals_single_device_muon() {
    let init = initial();
    let (ref_losses, ref_weights, ref_calls) = single_device(&init, None);
    let matrices = matrices(&init);
    assert_eq!(ref_calls, matrices * STEPS as u64);
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0] - 0.2,
        "Muon learns: {ref_losses:?}"
    );
    for (mesh, sharding, copies) in [
        (Mesh::flat(1).unwrap(), Sharding::Hierarchical, 1),
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical, 1),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical, 1),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical, 1),
        // HSDP replicas step identical copies of each piece: once per replica.
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp, 2),
    ] {
        let ranks = sharded(&init, mesh, sharding, None);
        assert_close(
            &format!("{mesh} {sharding:?}"),
            &ranks,
            &ref_losses,
            &ref_weights,
        );
        let calls: u64 = ranks.iter().map(|r| r.2).sum();
        assert_eq!(
            calls,
            copies * matrices * STEPS as u64,
            "{mesh} {sharding:?}: each matrix orthogonalised once per update group"
        );
        if mesh.world_size() >= 4 {
            let split: u64 = ranks.iter().map(|r| r.3).sum();
            assert!(split > 0, "{mesh} {sharding:?}: some matrices are split");
        }
    }
}

/// The owner all-to-all moves each split matrix's rows to its owner and back instead of
/// all-reducing every split matrix twice: the same owner orthogonalises the same rows, so the
/// two exchanges train bit for bit alike; only off-owner rows cross between ranks.
#[test]
fn the_owner_exchange_trains_bitwise_like_the_all_reduce_exchange() {
    let init = initial();
    for (mesh, sharding) in [
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
    ] {
        let old = sharded_with(
            &init,
            mesh,
            sharding,
            Some(1.0),
            MuonExchange::AllReduce,
            true,
        );
        let new = sharded_with(
            &init,
            mesh,
            sharding,
            Some(1.0),
            MuonExchange::OwnerAllToAll,
            true,
        );
        let what = format!("{mesh} {sharding:?}");
        for (rank, (o, n)) in old.iter().zip(&new).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o.0), bits(&n.0), "{what} rank {rank}: losses");
            for ((path, a), (_, b)) in o.1.iter().zip(&n.1) {
                assert_eq!(bits(a), bits(b), "{what} rank {rank}: {path}");
            }
            assert_eq!(
                (o.2, o.3),
                (n.2, n.3),
                "{what} rank {rank}: Newton–Schulz calls"
            );
            assert_eq!(
                o.4,
                (0, 0),
                "the all-reduce exchange counts no owner traffic"
            );
        }
        let split: u64 = new.iter().map(|r| r.3).sum();
        let (sent, received) = new
            .iter()
            .fold((0, 0), |(s, r), n| (s + n.4 .0, r + n.4 .1));
        // What one rank sends another receives.
        assert_eq!(sent, received, "{what}");
        assert_eq!(split > 0, sent > 0, "{what}: split {split}, sent {sent}");
    }
}

/// Megabatches (same-shape matrices orthogonalised in one batched Newton–Schulz on their owner)
/// train like one matrix at a time: the batched matmuls only sum in another order.
#[test]
fn megabatches_train_like_one_matrix_at_a_time() {
    let init = initial();
    for (mesh, sharding) in [
        (Mesh::flat(1).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
    ] {
        let one = sharded_with(
            &init,
            mesh,
            sharding,
            None,
            MuonExchange::OwnerAllToAll,
            false,
        );
        let batched = sharded_with(
            &init,
            mesh,
            sharding,
            None,
            MuonExchange::OwnerAllToAll,
            true,
        );
        let what = format!("{mesh} {sharding:?}");
        for (rank, (a, b)) in one.iter().zip(&batched).enumerate() {
            for (s, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{what} rank {rank} step {s}: {x} vs {y}"
                );
            }
            for ((path, x), (_, y)) in a.1.iter().zip(&b.1) {
                let diff = x
                    .iter()
                    .zip(y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0f32, f32::max);
                assert!(diff <= 1e-5, "{what} rank {rank} {path}: {diff:e}");
            }
            assert_eq!(
                a.2, b.2,
                "{what}: the same Newton–Schulz calls, counted per matrix"
            );
        }
    }
}

/// Trains `steps` of the run on `mesh` (hierarchical), optionally loading a checkpoint first and
/// saving one at the end; returns each rank's losses and final weights.
fn segment(
    init: &Gpt<B>,
    mesh: Mesh,
    steps: std::ops::Range<usize>,
    load_from: Option<(&std::path::Path, bool)>,
    save_to: Option<&std::path::Path>,
) -> Vec<(Vec<f32>, Weights)> {
    let world = mesh.world_size();
    ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(mesh).with_bucket_elements(1500);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut optim = ShardedMuon::new(muon().init(), AdamWConfig::new().build(), device);
        if let Some((dir, with_state)) = load_from {
            let step = if with_state {
                checkpoint::load(dir, &runtime, &mut optim).unwrap()
            } else {
                checkpoint::load(dir, &runtime, &mut checkpoint::WeightsOnly).unwrap()
            };
            assert_eq!(step as usize, steps.start);
        }
        let local = BATCH / world;
        let mut losses = Vec::new();
        for step in steps.clone() {
            let loss = model.loss(tokens(step, rank * local, local));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            model = optim.step(LR, model, &runtime).unwrap();
        }
        if let Some(dir) = save_to {
            checkpoint::save(dir, &runtime, &optim, steps.end as u64).unwrap();
        }
        (losses, weights(&model))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Save at world 4, load at world 2 (re-sharding weights, AdamW state and Muon momentum):
/// training continues as the uninterrupted world-4 run.
#[test]
fn checkpoint_at_world_4_resumes_at_world_2() {
    let init = initial();
    let dir = scratch_dir("resume-4-to-2");
    let whole = segment(&init, Mesh::flat(4).unwrap(), 0..STEPS, None, None);
    let half = STEPS / 2;
    segment(&init, Mesh::flat(4).unwrap(), 0..half, None, Some(&dir));
    let resumed = segment(
        &init,
        Mesh::flat(2).unwrap(),
        half..STEPS,
        Some((&dir, true)),
        None,
    );
    let mean = |ranks: &[(Vec<f32>, Weights)], i: usize| {
        ranks.iter().map(|r| r.0[i]).sum::<f32>() / ranks.len() as f32
    };
    for i in 0..STEPS - half {
        let (got, want) = (mean(&resumed, i), mean(&whole, half + i));
        assert!(
            (got - want).abs() <= 1e-4 * want,
            "step {}: {got} vs {want}",
            half + i
        );
    }
    for ((path, got), (_, want)) in resumed[0].1.iter().zip(&whole[0].1) {
        let max = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max <= 2e-4, "{path}: max diff {max}");
    }
    // Without the optimizer state the run differs: the state really was restored.
    let cold = segment(
        &init,
        Mesh::flat(2).unwrap(),
        half..STEPS,
        Some((&dir, false)),
        None,
    );
    let moved = (mean(&cold, STEPS - half - 1) - mean(&whole, STEPS - 1)).abs();
    assert!(moved > 1e-3, "optimizer state matters: {moved}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint of another model is refused with the parameter named.
#[test]
fn checkpoint_of_another_model_is_refused() {
    let init = initial();
    let dir = scratch_dir("other-model");
    segment(&init, Mesh::flat(2).unwrap(), 0..1, None, Some(&dir));
    let other: Gpt<B> = GptConfig {
        d_model: 8,
        ..CONFIG
    }
    .init(&Default::default());
    let errors = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap()).with_bucket_elements(1500);
        let (_, runtime) = shard::<B, _, _>(other.clone(), config, comm, &device).unwrap();
        let mut optim =
            ShardedMuon::<Inner, _>::new(muon().init(), AdamWConfig::new().build(), device);
        checkpoint::load(&dir, &runtime, &mut optim)
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    for e in errors {
        let e = e.unwrap();
        assert!(e.contains("shape") && e.contains("embed.weight"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The element-wise driver (`ShardedOptimizer`, one AdamW state per bucket piece) saves through
/// `PieceStates`: save at world 4, resume at world 2 as the uninterrupted run; and the
/// checkpoint exports to an ordinary unsharded Burn module holding the trained weights.
#[test]
fn elementwise_checkpoint_resumes_and_exports_unsharded() {
    use sshsdp::optim::ShardedOptimizer;
    let init = initial();
    let dir = scratch_dir("adamw-4-to-2");
    let run = |mesh: Mesh, steps: std::ops::Range<usize>, load: bool, save: bool| {
        let world = mesh.world_size();
        ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(mesh).with_bucket_elements(1500);
            let (mut model, runtime) =
                shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
            let mut optim = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
            if load {
                let states = &mut checkpoint::PieceStates::new(&mut optim);
                assert_eq!(
                    checkpoint::load(&dir, &runtime, states).unwrap(),
                    steps.start as u64
                );
            }
            let local = BATCH / world;
            let mut losses = Vec::new();
            for step in steps.clone() {
                let loss = model.loss(tokens(step, rank * local, local));
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
                model = optim.step(LR, model, &runtime).unwrap();
            }
            if save {
                let states = checkpoint::PieceStates::new(&mut optim);
                checkpoint::save(&dir, &runtime, &states, steps.end as u64).unwrap();
            }
            (losses, weights(&model))
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let half = STEPS / 2;
    let whole = run(Mesh::flat(4).unwrap(), 0..STEPS, false, false);
    let first = run(Mesh::flat(4).unwrap(), 0..half, false, true);
    let resumed = run(Mesh::flat(2).unwrap(), half..STEPS, true, false);
    let mean = |ranks: &[(Vec<f32>, Weights)], i: usize| {
        ranks.iter().map(|r| r.0[i]).sum::<f32>() / ranks.len() as f32
    };
    for i in 0..STEPS - half {
        let (got, want) = (mean(&resumed, i), mean(&whole, half + i));
        assert!(
            (got - want).abs() <= 1e-4 * want,
            "step {}: {got} vs {want}",
            half + i
        );
    }
    // Export: the unsharded model carries exactly the weights the sharded run had at the save.
    let files = checkpoint::read_checkpoint(&dir).unwrap();
    let full = checkpoint::export_full(&files).unwrap();
    let plain = checkpoint::apply_full(CONFIG.init::<B>(&Default::default()), &full).unwrap();
    assert_eq!(weights(&plain), first[0].1);
    // A checkpoint of another optimizer is refused (weights alone load).
    let errors = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
        let config = HsdpConfig::new(Mesh::flat(2).unwrap()).with_bucket_elements(1500);
        let device = Default::default();
        let (_, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut muon =
            ShardedMuon::<Inner, _>::new(muon().init(), AdamWConfig::new().build(), device);
        checkpoint::load(&dir, &runtime, &mut checkpoint::WeightsOnly).unwrap();
        checkpoint::load(&dir, &runtime, &mut muon)
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    for e in errors {
        let e = e.unwrap();
        assert!(
            e.contains("ShardedOptimizer") && e.contains("WeightsOnly"),
            "{e}"
        );
    }
    // A module of another shape is refused.
    let other = GptConfig {
        layers: 1,
        ..CONFIG
    }
    .init::<B>(&Default::default());
    let err = checkpoint::apply_full(other, &full)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameters"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
