//! The decorator's runtime behaviour: copies and traffic per mode, per-rank memory, gradient
//! accumulation, failures and mismatched models.

use crate::common;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, SgdConfig};
use common::{batches, rows, TinyLm};
use sshsdp_backend::{
    chrome_trace, named_params, refresh_leaves, shard, with_burn_rng, CopyMode, Hsdp, HsdpConfig,
    HsdpError, Placement, Track,
};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::ShardedStep;
use sshsdp_optim::{MuonConfig, MuonExchange, ShardedMuon, ShardedOptimizer};
use sshsdp_plan::{Mesh, RuntimeFormat, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

fn model() -> TinyLm<B> {
    with_burn_rng(|| {
        let m = TinyLm::new(&Default::default());
        named_params(&m).unwrap();
        m
    })
}

fn threads(timeout_ms: u64) -> ThreadsConfig {
    ThreadsConfig {
        timeout: Duration::from_millis(timeout_ms),
    }
}

/// Bytes of all of `model`'s parameters (f32).
fn param_bytes(model: &TinyLm<B>) -> u64 {
    named_params(model)
        .unwrap()
        .iter()
        .map(|p| 4 * p.values.len() as u64)
        .sum()
}

/// Per-rank (losses, counters of the second step, shard bytes) of 2 steps in `mode`.
fn run(
    world: usize,
    mode: CopyMode,
    init: &TinyLm<B>,
) -> Vec<(Vec<f32>, sshsdp_backend::Counters, u64)> {
    run_in(world, mode, RuntimeFormat::F32, init)
        .into_iter()
        .map(|(l, c, s, _)| (l, c, s))
        .collect()
}

/// [`run`] in runtime `format`; also returns the master bytes.
fn run_in(
    world: usize,
    mode: CopyMode,
    format: RuntimeFormat,
    init: &TinyLm<B>,
) -> Vec<(Vec<f32>, sshsdp_backend::Counters, u64, u64)> {
    ThreadsWorld::run(world, threads(30_000), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(world).unwrap())
            .with_bucket_elements(1500)
            .with_format(format)
            .with_copy_mode(mode);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let mut losses = Vec::new();
        let mut counters = Default::default();
        for batch in batches(2, 8) {
            runtime.take_counters();
            let local = 8 / world;
            let loss = model.loss(rows::<B>(&batch, rank * local, local, &device));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            model = sgd.step(0.05, model, &runtime).unwrap();
            counters = runtime.take_counters();
        }
        (
            losses,
            counters,
            runtime.shard_bytes(),
            runtime.master_bytes(),
        )
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn zero_copy_moves_parameters_only_in_collectives() {
    let init = model();
    let param_bytes = param_bytes(&init);
    for world in [1, 2, 4] {
        let zero = run(world, CopyMode::ZeroCopy, &init);
        let fsdp2 = run(world, CopyMode::Fsdp2Style, &init);
        for ((l0, c0, _), (l1, c1, _)) in zero.iter().zip(&fsdp2) {
            assert_eq!(l0, l1, "both data paths compute the same");
            assert_eq!(
                c0.param_bytes_copied, 0,
                "world {world}: zero-copy copied {c0:?}"
            );
            // Every bucket is gathered in forward (and again in backward when released): the
            // FSDP2 path copies each gathered parameter out, plus its shard in.
            assert!(
                c1.param_bytes_copied >= param_bytes + param_bytes / world as u64,
                "world {world}: FSDP2-style copied {} of {param_bytes} parameter bytes",
                c1.param_bytes_copied
            );
            assert_eq!(c0.gathered_bytes, c1.gathered_bytes);
            // From the second step on, every bucket is gathered ahead of use (the first at the
            // end of the step before).
            assert!(c0.gathers > 1, "several buckets: {c0:?}");
            assert_eq!(c0.prefetched, c0.gathers, "world {world}: {c0:?}");
            if world > 1 {
                assert!(c0.gathered_bytes >= param_bytes * (world as u64 - 1) / world as u64);
            }
            assert!(c0.reduced_bytes >= param_bytes);
        }
    }
}

#[test]
fn bf16_runtime_halves_storage_and_gathers_and_keeps_fp32_masters() {
    let init = model();
    let param_bytes = param_bytes(&init);
    for world in [2, 4] {
        let f32_run = run_in(world, CopyMode::ZeroCopy, RuntimeFormat::F32, &init);
        let bf16_run = run_in(world, CopyMode::ZeroCopy, RuntimeFormat::Bf16, &init);
        for ((l32, c32, s32, m32), (l16, c16, s16, m16)) in f32_run.iter().zip(&bf16_run) {
            assert_eq!(*m32, 0, "f32 runtime shards are the masters");
            assert_eq!(c16.param_bytes_copied, 0, "world {world}: {c16:?}");
            assert_eq!(c16.gathers, c32.gathers);
            // Half the bytes per element; alignment padding is planned in bytes, so a bf16
            // bucket holds a few more padding elements: within 10 % of half.
            let half = |x: u64, y: u64| (0.45..=0.55).contains(&(x as f64 / y as f64));
            assert!(
                half(c16.gathered_bytes, c32.gathered_bytes),
                "{c16:?} vs {c32:?}"
            );
            assert!(half(*s16, *s32), "world {world}: shards {s16} vs {s32}");
            // Each gathered bucket is widened to f32 once for compute.
            assert!(c16.decoded_bytes >= param_bytes, "{c16:?}");
            assert_eq!(c32.decoded_bytes, 0);
            // fp32 masters of this rank's piece: 1/world of the model plus padding.
            assert!(
                *m16 >= param_bytes / world as u64 && *m16 <= *s16 * 2 + 64,
                "{m16}"
            );
            // First step identical (same initial values rounded to bf16 vs exact): close.
            assert!(
                (l16[0] - l32[0]).abs() < 0.02 * l32[0],
                "{l16:?} vs {l32:?}"
            );
        }
    }
}

#[test]
fn per_rank_storage_is_total_over_n_plus_padding() {
    let init = model();
    let param_bytes = param_bytes(&init);
    for world in [1, 2, 4] {
        let ranks = run(world, CopyMode::ZeroCopy, &init);
        let plan = sshsdp_plan::Plan::build(
            named_params(&init)
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    sshsdp_plan::ParamSpec::new(p.path, p.shape, sshsdp_plan::DType::F32)
                        .with_order(i as u64)
                }),
            Mesh::flat(world).unwrap(),
            HsdpConfig::new(Mesh::flat(world).unwrap())
                .with_bucket_elements(1500)
                .plan,
        )
        .unwrap();
        let padding = plan.stats().padding_bytes;
        for (_, _, shard) in &ranks {
            assert!(*shard >= param_bytes / world as u64);
            assert!(
                *shard <= param_bytes / world as u64 + padding,
                "world {world}: {shard} bytes > {} + padding {padding}",
                param_bytes / world as u64
            );
        }
        let total: u64 = ranks.iter().map(|r| r.2).sum();
        assert_eq!(total, param_bytes + padding);
    }
}

#[test]
fn gradient_accumulation_over_micro_batches_equals_one_batch() {
    let init = model();
    let results = ThreadsWorld::run(2, threads(30_000), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap()).with_bucket_elements(1500);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let batch = &batches(1, 8)[0];
        // Two micro-batches of 2 rows each on this rank (4 rows per rank, 8 in all).
        for micro in 0..2 {
            let loss = model.loss(rows::<B>(batch, rank * 4 + micro * 2, 2, &device)) / 2.0;
            let _ = loss.backward();
            model = refresh_leaves(model);
        }
        model = sgd.step(0.5, model, &runtime).unwrap();
        named_params(&model).unwrap()
    })
    .unwrap();
    let single = ThreadsWorld::run(1, threads(30_000), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(1).unwrap()).with_bucket_elements(1500);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let loss = model.loss(rows::<B>(&batches(1, 8)[0], 0, 8, &device));
        let _ = loss.backward();
        model = sgd.step(0.5, model, &runtime).unwrap();
        named_params(&model).unwrap()
    })
    .unwrap();
    let want = single[0].as_ref().unwrap();
    let got = results[0].as_ref().unwrap();
    let moved = want.iter().zip(named_params(&init).unwrap()).any(|(a, b)| {
        a.values
            .iter()
            .zip(&b.values)
            .any(|(x, y)| (x - y).abs() > 1e-4)
    });
    assert!(moved, "the step changed the weights");
    for (a, b) in got.iter().zip(want) {
        let path = &a.path;
        let max = a
            .values
            .iter()
            .zip(&b.values)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max < 1e-5, "{path}: {max}");
    }
}

#[test]
fn different_models_on_different_ranks_are_rejected_at_shard() {
    let results = ThreadsWorld::run(2, threads(10_000), |comm| {
        let device = Default::default();
        let mut m = model();
        if comm.rank() == 1 {
            m.blocks.pop();
        }
        shard::<B, _, _>(m, HsdpConfig::new(Mesh::flat(2).unwrap()), comm, &device).map(|_| ())
    })
    .unwrap();
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert!(matches!(err, HsdpError::PlanMismatch { .. }), "{err}");
        // The message names the first parameter one rank has and the other lacks.
        let text = err.to_string();
        assert!(
            text.contains("blocks.1.") && text.contains("missing"),
            "{text}"
        );
    }
}

#[test]
fn a_mesh_that_does_not_fit_the_world_is_an_error() {
    let mut comms = ThreadsWorld::create(1, threads(1_000)).unwrap();
    let err = shard::<B, _, _>(
        model(),
        HsdpConfig::new(Mesh::flat(2).unwrap()),
        comms.pop().unwrap(),
        &Default::default(),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(err, HsdpError::Plan(_)), "{err}");
}

/// Global-norm clipping sees the whole model's gradient whatever the sharding: the norm and the
/// clipped training are the same at world 1, 2 and 4 (and HSDP 2×2), and clipping changes
/// training when the norm exceeds the threshold.
#[test]
fn global_norm_clipping_is_the_same_at_every_world_size() {
    let init = model();
    let run = |mesh: Mesh, sharding: Sharding, max_norm: Option<f64>| {
        let world = mesh.world_size();
        ThreadsWorld::run(world, threads(30_000), |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(mesh)
                .with_sharding(sharding)
                .with_bucket_elements(1500);
            let (mut model, runtime) =
                shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
            let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
            if let Some(m) = max_norm {
                sgd = sgd.with_grad_clipping(m);
            }
            let (mut losses, mut norms) = (Vec::new(), Vec::new());
            for batch in batches(3, 8) {
                let local = 8 / world;
                let loss = model.loss(rows::<B>(&batch, rank * local, local, &device));
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
                model = sgd.step(0.5, model, &runtime).unwrap();
                norms.push(sgd.last_grad_norm().unwrap_or(0.0));
            }
            (losses, norms)
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let one = run(Mesh::flat(1).unwrap(), Sharding::Hierarchical, Some(0.1));
    let (base_losses, base_norms) = &one[0];
    assert!(base_norms[0] > 0.1, "the threshold clips: {base_norms:?}");
    let unclipped = run(Mesh::flat(1).unwrap(), Sharding::Hierarchical, None);
    assert!((unclipped[0].0[2] - base_losses[2]).abs() > 1e-3);
    for (mesh, sharding) in [
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
    ] {
        let ranks = run(mesh, sharding, Some(0.1));
        let world = ranks.len() as f32;
        for step in 0..3 {
            let loss = ranks.iter().map(|r| r.0[step]).sum::<f32>() / world;
            let want = base_losses[step];
            assert!(
                (loss - want).abs() <= 1e-4 * want,
                "{mesh} step {step}: {loss} vs {want}"
            );
            for (_, norms) in &ranks {
                let (got, want) = (norms[step], base_norms[step]);
                assert!(
                    (got - want).abs() <= 1e-4 * want,
                    "{mesh} norm {got} vs {want}"
                );
            }
        }
    }
}

/// Resharding after forward holds about two gathered buckets at a time instead of all of them,
/// and pays for it with backward gathers; the losses do not change.
#[test]
fn reshard_after_forward_bounds_gathered_memory() {
    let init = model();
    let run = |reshard: bool| {
        ThreadsWorld::run(2, threads(30_000), |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(Mesh::flat(2).unwrap())
                .with_bucket_elements(1500)
                .with_reshard_after_forward(reshard);
            let (mut model, runtime) =
                shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
            let buckets = runtime.plan().buckets().len();
            let largest = (0..buckets)
                .map(|b| runtime.plan().buffer_bytes(b))
                .max()
                .unwrap();
            let total: u64 = (0..buckets).map(|b| runtime.plan().buffer_bytes(b)).sum();
            let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
            let (mut losses, mut counters) = (Vec::new(), Default::default());
            for batch in batches(3, 8) {
                runtime.take_counters();
                let loss = model.loss(rows::<B>(&batch, rank * 4, 4, &device));
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
                model = sgd.step(0.05, model, &runtime).unwrap();
                counters = runtime.take_counters();
            }
            (losses, counters, buckets as u64, largest, total)
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let kept = run(false);
    let released = run(true);
    for ((l0, c0, buckets, largest, total), (l1, c1, ..)) in kept.iter().zip(&released) {
        assert_eq!(l0, l1, "the same training");
        assert!(*buckets > 3, "several buckets");
        assert_eq!(c0.peak_resident_bytes, *total, "{c0:?}");
        assert_eq!(c0.backward_gathers, 0);
        assert!(c1.peak_resident_bytes <= 2 * largest, "{c1:?}");
        // Every bucket but the last of forward is gathered again in backward.
        assert_eq!(c1.backward_gathers, buckets - 1, "{c1:?}");
        assert!(
            c1.gathered_bytes > c0.gathered_bytes * 3 / 2,
            "{c1:?} vs {c0:?}"
        );
        assert_eq!(c1.param_bytes_copied, 0);
    }
}

/// The step timeline: with tracing on, every gather, reduction and rebuild of a step appears as
/// a lane span and every wait of the model thread as a model span; the totals are counted
/// whether or not spans are recorded.
#[test]
fn the_step_timeline_records_every_collective_and_wait() {
    let init = model();
    let results = ThreadsWorld::run(2, threads(30_000), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap())
            .with_bucket_elements(1500)
            .with_trace(true);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let buckets = runtime.plan().buckets().len();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        runtime.take_trace();
        runtime.take_counters();
        let batch = &batches(1, 8)[0];
        let loss = model.loss(rows::<B>(batch, rank * 4, 4, &device));
        let _ = loss.backward();
        model = sgd.step(0.05, model, &runtime).unwrap();
        drop(model);
        (runtime.take_counters(), runtime.take_trace(), buckets)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let (counters, spans, buckets) = r.unwrap();
        assert!(counters.comm_busy_ns > 0 && counters.comm_wait_ns > 0);
        let count = |track: Track, name: &str| {
            spans
                .iter()
                .filter(|s| s.track == track && s.name == name && s.rank == rank)
                .count()
        };
        // Every bucket, and the next step's first, prefetched at the end of this one.
        assert_eq!(
            count(Track::ShardLane, "all-gather"),
            buckets + 1,
            "{spans:?}"
        );
        assert_eq!(count(Track::ShardLane, "reduce (shard group)"), buckets);
        assert_eq!(count(Track::ReplicaLane, "reduce (replicas)"), buckets);
        assert_eq!(count(Track::ReplicaLane, "rebuild"), buckets);
        assert_eq!(count(Track::ReplicaLane, "gradient norm"), 1);
        assert_eq!(count(Track::Model, "wait reduction"), buckets);
        // Every gather was waited for (directly or as a prefetch).
        assert_eq!(count(Track::Model, "wait gather"), buckets);
        let json = chrome_trace(&spans);
        assert!(json.contains("\"traceEvents\"") && json.contains("all-gather"));
    }
}

/// What a run with masters and gradients in given placements leaves on rank 0.
#[derive(Debug, PartialEq)]
struct PlacedRun {
    losses: Vec<f32>,
    weights: Vec<Vec<f32>>,
    staged_bytes: u64,
    /// Elements of Muon's split matrices exchanged, over the run (each all-reduce's length).
    exchanged: u64,
    host_master_bytes: u64,
    device_master_bytes: u64,
}

/// Three steps of two micro-batches each at world 2 with the fp32 masters in `masters` and the
/// gradients accumulated in `grads`: AdamW with clipping through `ShardedOptimizer`, or
/// distributed Muon exchanging split matrices by `muon` (both on device views where the
/// masters are on the device).
fn train_placed(
    format: RuntimeFormat,
    (masters, grads): (Placement, Placement),
    muon: Option<MuonExchange>,
    init: &TinyLm<B>,
) -> PlacedRun {
    let world = 2;
    let mut ranks = ThreadsWorld::run(world, threads(30_000), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(world).unwrap())
            .with_bucket_elements(1500)
            .with_format(format)
            .with_master_placement(masters)
            .with_grad_placement(grads);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let adamw = AdamWConfig::new().build();
        let mut elementwise = ShardedOptimizer::new(adamw.clone(), device).with_grad_clipping(0.5);
        let mut muon_opt = ShardedMuon::new(MuonConfig::new().init(), adamw, device)
            .with_exchange(muon.unwrap_or_default());
        let (mut losses, mut staged_bytes, mut exchanged) = (Vec::new(), 0, 0);
        for batch in batches(3, 8) {
            for micro in 0..2 {
                let first = rank * 4 + micro * 2;
                let loss = model.loss(rows::<B>(&batch, first, 2, &device));
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
            }
            model = match muon {
                Some(_) => muon_opt.step(0.02, model, &runtime).unwrap(),
                None => elementwise.step(0.02, model, &runtime).unwrap(),
            };
            staged_bytes += runtime.take_counters().staged_bytes;
            exchanged += muon_opt.last_step().exchanged_elements;
        }
        let weights = runtime
            .plan()
            .params()
            .iter()
            .map(|p| runtime.param_values(&p.spec.path).unwrap())
            .collect();
        PlacedRun {
            losses,
            weights,
            staged_bytes,
            exchanged,
            host_master_bytes: runtime.master_bytes(),
            device_master_bytes: runtime.device_master_bytes(),
        }
    })
    .unwrap();
    ranks.swap_remove(0).unwrap()
}

#[test]
fn device_masters_and_gradients_train_bitwise_like_host_ones() {
    use Placement::{Device, Host};
    let init = model();
    let param_bytes = param_bytes(&init);
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        for muon in [false, true] {
            // The all-reduce exchange: its staged bytes are the split matrices' size, exactly.
            let exchange = muon.then_some(MuonExchange::AllReduce);
            let host = train_placed(format, (Host, Host), exchange, &init);
            let masters = train_placed(format, (Device, Host), exchange, &init);
            let all = train_placed(format, (Device, Device), exchange, &init);
            let what = format!("{format:?}, muon {muon}");
            if muon {
                // The owner all-to-all-v on device views, staged through the host too (the
                // threads engine moves host memory): the same training, fewer bytes.
                let owner = Some(MuonExchange::OwnerAllToAll);
                let by_owner = train_placed(format, (Device, Host), owner, &init);
                assert_eq!(host.losses, by_owner.losses, "{what}");
                assert_eq!(host.weights, by_owner.weights, "{what}");
                let runtime_part = 3 * 2 * masters.device_master_bytes;
                assert!(by_owner.staged_bytes > runtime_part, "{what}");
                assert!(by_owner.staged_bytes < masters.staged_bytes, "{what}");
            }
            for run in [&masters, &all] {
                assert_eq!(host.losses, run.losses, "{what}");
                assert_eq!(host.weights, run.weights, "{what}");
            }
            assert!(host.losses[4] < host.losses[0], "{what}: {:?}", host.losses);
            // The masters moved to the device, all of them; staging is counted.
            assert_eq!(masters.host_master_bytes, 0, "{what}");
            assert_eq!(host.device_master_bytes, 0, "{what}");
            assert_eq!(host.staged_bytes, 0, "{what}");
            let on_device = masters.device_master_bytes;
            if format != RuntimeFormat::F32 {
                assert_eq!(on_device, host.host_master_bytes, "{what}");
            }
            assert!(on_device > 0, "{what}");
            // Device views (AdamW and Muon alike): each step uploads the gradient and reads the
            // master back once to re-derive; Muon's two all-reduces of split matrices per step
            // are staged through the host (NdArray's threads engine moves host memory).
            let exchange = 2 * 2 * 4 * masters.exchanged;
            assert_eq!(muon, masters.exchanged > 0, "{what}: matrices are split");
            assert_eq!(masters.exchanged, host.exchanged, "{what}");
            assert_eq!(masters.staged_bytes, 3 * 2 * on_device + exchange, "{what}");
            // Device gradients: every parameter's gradient read back once per micro-batch.
            assert_eq!(
                all.staged_bytes,
                masters.staged_bytes + 3 * 2 * param_bytes,
                "{what}"
            );
        }
    }
}

#[test]
fn all_gather_world_reaches_every_rank_of_a_2x2_mesh_in_rank_order() {
    let init = model();
    let ranks = ThreadsWorld::run(4, threads(30_000), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::new(2, 2).unwrap()).with_sharding(Sharding::Hsdp);
        let (_model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let rank = runtime.rank() as u8;
        runtime.all_gather_world(vec![rank, 10 + rank]).unwrap()
    })
    .unwrap();
    for r in ranks {
        assert_eq!(r.unwrap(), vec![0, 10, 1, 11, 2, 12, 3, 13]);
    }
}
