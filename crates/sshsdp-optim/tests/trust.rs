//! Three failure modes that break trust in a training step, each pinned by a test:
//!
//! * a replica that lags behind (and runs an unrelated backward, whose clean-up locks every
//!   autodiff graph of the process) must not deadlock a rank that is inside its own backward
//!   waiting for a re-gather — under HSDP and DDP, with and without resharding after forward;
//! * gradient accumulation over micro-batches without refreshing the module's leaves must not
//!   silently drop the second micro-batch;
//! * a non-finite gradient on one rank must be detected on every rank together: `step` fails
//!   (the default) or skips the update on every rank, never applying NaN.

use crate::common;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::SgdConfig;
use burn::tensor::Tensor;
use common::{batches, rows, seeded, TinyLm};
use sshsdp_backend::{
    named_params, refresh_leaves, shard, Hsdp, HsdpConfig, HsdpError, NamedParam, NonFinitePolicy,
    Views,
};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::ShardedOptimizer;
use sshsdp_optim::ShardedStep;
use sshsdp_plan::{Mesh, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

/// The initial model (the same on every call: see [`seeded`]).
fn model() -> TinyLm<B> {
    seeded(11)
}

fn threads(timeout: Duration) -> ThreadsConfig {
    ThreadsConfig { timeout }
}

/// Three steps on a 2×2 mesh where replica 1 (ranks 2 and 3) sleeps before step 1 and runs a
/// throwaway backward of its own; every rank must finish every step well within the timeout.
fn lagging_replica(sharding: Sharding, reshard: bool) {
    let init = model();
    let timeout = Duration::from_secs(10);
    let start = Instant::now();
    let results = ThreadsWorld::run(4, threads(timeout), |comm| -> Result<(), HsdpError> {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::new(2, 2).unwrap())
            .with_sharding(sharding)
            .with_bucket_elements(1500)
            .with_reshard_after_forward(reshard);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device)?;
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        for (step, batch) in batches(3, 8).iter().enumerate() {
            if step == 1 && rank >= 2 {
                std::thread::sleep(Duration::from_millis(300));
                // An unrelated backward: Burn cleans up after it by locking every graph of the
                // process in turn, including those of ranks inside their own backward.
                let x = Tensor::<B, 1>::ones([4], &device).require_grad();
                let _ = x.sum().backward();
            }
            let loss = model.loss(rows::<B>(batch, rank * 2, 2, &device));
            let _ = loss.backward();
            model = sgd.step(0.05, model, &runtime)?;
        }
        Ok(())
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let outcome = r.unwrap_or_else(|_| panic!("rank {rank} panicked"));
        if let Err(e) = outcome {
            panic!("{sharding:?} reshard={reshard}: rank {rank} failed: {e}");
        }
    }
    assert!(start.elapsed() < timeout, "took {:?}", start.elapsed());
}

const LAG_RUNS: usize = 20;

#[test]
fn a_lagging_replica_never_deadlocks_hsdp_with_reshard() {
    (0..LAG_RUNS).for_each(|_| lagging_replica(Sharding::Hsdp, true));
}

#[test]
fn a_lagging_replica_never_deadlocks_hsdp_without_reshard() {
    (0..LAG_RUNS).for_each(|_| lagging_replica(Sharding::Hsdp, false));
}

#[test]
fn a_lagging_replica_never_deadlocks_ddp_with_reshard() {
    (0..LAG_RUNS).for_each(|_| lagging_replica(Sharding::Ddp, true));
}

#[test]
fn a_lagging_replica_never_deadlocks_ddp_without_reshard() {
    (0..LAG_RUNS).for_each(|_| lagging_replica(Sharding::Ddp, false));
}

#[test]
fn a_lagging_replica_never_deadlocks_hierarchical_with_reshard() {
    (0..LAG_RUNS / 4).for_each(|_| lagging_replica(Sharding::Hierarchical, true));
}

/// Two steps of two micro-batches each on two ranks, refreshing the module's leaves after each
/// micro-batch or not, from `init`; returns rank 0's final weights.
fn accumulate(init: &TinyLm<B>, refresh: bool, reshard: bool) -> Vec<NamedParam> {
    let results = ThreadsWorld::run(2, threads(Duration::from_secs(30)), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap())
            .with_bucket_elements(1500)
            .with_reshard_after_forward(reshard);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        for batch in &batches(2, 8) {
            for micro in 0..2 {
                let loss = model.loss(rows::<B>(batch, rank * 4 + micro * 2, 2, &device)) / 2.0;
                let _ = loss.backward();
                if refresh {
                    model = refresh_leaves(model);
                }
            }
            model = sgd.step(0.5, model, &runtime).unwrap();
        }
        named_params(&model).unwrap()
    })
    .unwrap();
    results.into_iter().next().unwrap().expect("rank 0")
}

#[test]
fn accumulation_without_refreshing_leaves_loses_no_micro_batch() {
    // One initial model for both runs: what differs between them is only the refreshing.
    let init = model();
    let initial = named_params(&init).unwrap();
    for reshard in [false, true] {
        let refreshed = accumulate(&init, true, reshard);
        let plain = accumulate(&init, false, reshard);
        assert_eq!(
            named_params(&init).unwrap(),
            initial,
            "the runs left init alone"
        );
        assert_ne!(refreshed, initial, "the steps changed the weights");
        for (a, b) in plain.iter().zip(&refreshed) {
            let diff = a
                .values
                .iter()
                .zip(&b.values)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                a.values == b.values,
                "{} (reshard={reshard}): off by {diff}",
                a.path
            );
        }
    }
}

/// Three steps on two ranks with clipping; at step 1 rank 1's loss is multiplied by `poison`.
/// Returns each rank's step outcomes, its weights after step 0 and at the end, and its
/// skipped-step count.
type Poisoned = (
    Vec<Result<(), HsdpError>>,
    Vec<NamedParam>,
    Vec<NamedParam>,
    u64,
);

fn poisoned(policy: NonFinitePolicy, poison: f32) -> Vec<Poisoned> {
    let init = model();
    ThreadsWorld::run(2, threads(Duration::from_secs(30)), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap())
            .with_bucket_elements(1500)
            .with_non_finite_policy(policy);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device)
            .with_grad_clipping(1.0);
        let mut outcomes = Vec::new();
        let mut after_first = Vec::new();
        for (step, batch) in batches(3, 4).iter().enumerate() {
            let mut loss = model.loss(rows::<B>(batch, rank * 2, 2, &device));
            if step == 1 && rank == 1 {
                loss = loss * poison;
            }
            let _ = loss.backward();
            // The module is handed back on success; keep the sharded one on failure (its
            // parameters live in the runtime, which the failed step left untouched).
            let keep = model.clone();
            match sgd.step(0.05, model, &runtime) {
                Ok(m) => {
                    model = m;
                    outcomes.push(Ok(()));
                }
                Err(e) => {
                    model = keep;
                    outcomes.push(Err(e));
                }
            }
            if step == 0 {
                after_first = named_params(&model).unwrap();
            }
        }
        let skipped = runtime.take_counters().skipped_steps;
        (
            outcomes,
            after_first,
            named_params(&model).unwrap(),
            skipped,
        )
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("no rank panicked"))
    .collect()
}

fn all_finite(params: &[NamedParam]) -> bool {
    params
        .iter()
        .all(|p| p.values.iter().all(|v| v.is_finite()))
}

#[test]
fn a_non_finite_gradient_fails_the_step_on_every_rank() {
    for poison in [f32::NAN, f32::INFINITY] {
        for (rank, (outcomes, _, last, skipped)) in poisoned(NonFinitePolicy::Error, poison)
            .into_iter()
            .enumerate()
        {
            assert!(outcomes[0].is_ok(), "rank {rank}: {:?}", outcomes[0]);
            match &outcomes[1] {
                Err(HsdpError::NonFiniteGradient { norm }) => assert!(!norm.is_finite()),
                other => panic!("rank {rank}, poison {poison}: step 1 gave {other:?}"),
            }
            // The ranks stay in step: the next step works everywhere.
            assert!(outcomes[2].is_ok(), "rank {rank}: {:?}", outcomes[2]);
            assert!(all_finite(&last), "rank {rank}: NaN reached the weights");
            assert_eq!(skipped, 0);
        }
    }
}

#[test]
fn skip_step_policy_skips_the_update_on_every_rank() {
    let runs = poisoned(NonFinitePolicy::SkipStep, f32::NAN);
    let finite = poisoned(NonFinitePolicy::SkipStep, 1.0);
    for (rank, (outcomes, after_first, last, skipped)) in runs.into_iter().enumerate() {
        assert!(
            outcomes.iter().all(Result::is_ok),
            "rank {rank}: {outcomes:?}"
        );
        assert_eq!(skipped, 1, "rank {rank}");
        assert!(all_finite(&last), "rank {rank}");
        // Step 1 changed nothing; step 2 moved on from the weights of step 0.
        assert_ne!(last, after_first, "rank {rank}: step 2 did not update");
        let (_, finite_first, _, finite_skipped) = &finite[rank];
        assert_eq!(&after_first, finite_first);
        assert_eq!(*finite_skipped, 0);
    }
}

#[test]
fn a_rank_failing_mid_step_makes_the_others_error_not_hang() {
    let init = model();
    let start = Instant::now();
    // A timeout far above the bound below: the others must learn of the panic, not time out.
    let results = ThreadsWorld::run(
        3,
        threads(Duration::from_secs(120)),
        |comm| -> Result<(), HsdpError> {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(Mesh::flat(3).unwrap()).with_bucket_elements(1500);
            let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device)?;
            let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
            for (step, batch) in batches(3, 6).iter().enumerate() {
                let loss = model.loss(rows::<B>(batch, rank * 2, 2, &device));
                if rank == 1 && step == 1 {
                    panic!("rank 1 fails in the middle of step 1");
                }
                let _ = loss.backward();
                model = sgd.step(0.05, model, &runtime)?;
            }
            Ok(())
        },
    )
    .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert!(results[1].is_err(), "rank 1 panicked");
    for rank in [0, 2] {
        let outcome = results[rank]
            .as_ref()
            .expect("no panic on the surviving ranks");
        let err = outcome.as_ref().unwrap_err();
        assert!(
            matches!(err, HsdpError::Failed(_) | HsdpError::Comm(_)),
            "rank {rank}: {err}"
        );
    }
}

/// How rank 1's optimizer step goes wrong in [`step_failure`].
#[derive(Clone, Copy, Debug)]
enum StepFault {
    /// An error of its own before any collective.
    Local,
    /// An error of its own after the first of two update-group collectives (its group peer is
    /// left waiting in the second).
    LocalMidExchange,
    /// A collective of another size than its group peer's (a mismatch in the engine).
    Mismatch,
}

/// One step on `mesh` where rank 1's optimizer step fails as `fault` while the others step
/// normally (two update-group all-reduces); returns each rank's outcome and time in the step.
fn step_failure(mesh: Mesh, fault: StepFault) -> Vec<(Result<(), HsdpError>, Duration)> {
    let init = model();
    let results = ThreadsWorld::run(
        mesh.world_size(),
        threads(Duration::from_secs(20)),
        |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(mesh)
                .with_sharding(Sharding::Hsdp)
                .with_bucket_elements(1500);
            let (model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
            let batch = &batches(1, 2 * mesh.world_size())[0];
            let _ = model
                .loss(rows::<B>(batch, rank * 2, 2, &device))
                .backward();
            let started = Instant::now();
            let outcome = runtime.update_pieces(Views::Host, |_, group| {
                let fail = || Err(HsdpError::Failed("rank 1's optimizer failed".into()));
                match (rank, fault) {
                    (1, StepFault::Local) => return fail(),
                    (1, StepFault::Mismatch) => group.all_reduce_sum(vec![1.0; 3])?,
                    _ => group.all_reduce_sum(vec![1.0; 2])?,
                };
                if let (1, StepFault::LocalMidExchange) = (rank, fault) {
                    return fail();
                }
                group.all_reduce_sum(vec![2.0; 2])?;
                Ok(())
            });
            (outcome, started.elapsed())
        },
    )
    .unwrap();
    results
        .into_iter()
        .map(|r| r.expect("no rank panicked"))
        .collect()
}

/// Rank 1's optimizer step fails on its own or in a collective, on a flat mesh and under HSDP
/// (where each replica's update group steps on its own and the others wait at the step's
/// world-wide verdict): every rank gets an error at once, not after the timeout.
#[test]
fn a_step_failing_on_one_rank_is_an_error_on_every_rank_at_once() {
    for mesh in [Mesh::flat(3).unwrap(), Mesh::new(2, 2).unwrap()] {
        for fault in [
            StepFault::Local,
            StepFault::LocalMidExchange,
            StepFault::Mismatch,
        ] {
            for (rank, (outcome, took)) in step_failure(mesh, fault).into_iter().enumerate() {
                let err = outcome.expect_err("every rank fails");
                assert!(
                    took < Duration::from_secs(1),
                    "{mesh} {fault:?}: rank {rank} took {took:?}: {err}"
                );
                // A local error names its rank everywhere; a mismatch names the two calls.
                let named = match fault {
                    StepFault::Mismatch => "called all_reduce(F32 × 3",
                    _ => "rank 1",
                };
                assert!(
                    err.to_string().contains(named) || rank == 1,
                    "{mesh} {fault:?}: rank {rank}: {err}"
                );
            }
        }
    }
}

/// What one training step and then `passes` of one kind leave behind on one rank: (warned, live
/// parameter handles after the passes, live handles right after `shard`).
fn after_passes(kind: &'static str, passes: usize) -> (bool, u64, u64) {
    let init = model();
    ThreadsWorld::run(1, threads(Duration::from_secs(30)), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(1).unwrap()).with_bucket_elements(1500);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let at_start = runtime.live_param_handles();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let batch = &batches(1, 2)[0];
        let _ = model.loss(rows::<B>(batch, 0, 2, &device)).backward();
        model = sgd.step(0.01, model, &runtime).unwrap();
        for _ in 0..passes {
            match kind {
                "forward" => {
                    let _ = model.loss(rows::<B>(batch, 0, 2, &device));
                }
                "valid" => {
                    let _ = model
                        .valid()
                        .loss(rows::<Hsdp<Inner>>(batch, 0, 2, &device));
                }
                "train" => {
                    let _ = model.loss(rows::<B>(batch, 0, 2, &device)).backward();
                    model = sgd.step(0.01, model, &runtime).unwrap();
                }
                _ => unreachable!(),
            }
        }
        (
            runtime.forwards_without_backward_warned(),
            runtime.live_param_handles(),
            at_start,
        )
    })
    .unwrap()
    .into_iter()
    .next()
    .unwrap()
    .expect("rank 0")
}

#[test]
fn forwards_without_backward_are_reported_and_training_or_valid_is_not() {
    // Each forward keeps its graph (and the parameters it saved) until a backward: the runtime
    // sees its handles pile up and warns.
    let (warned, live, start) = after_passes("forward", 50);
    assert!(
        warned,
        "50 forwards without backward: {start} → {live} handles, no warning"
    );
    assert!(live > 10 * start, "{start} → {live}");
    // Training steps keep one step's worth; evaluation on `valid()` keeps nothing.
    for kind in ["train", "valid"] {
        let (warned, live, start) = after_passes(kind, 200);
        assert!(!warned, "{kind}: warned with {start} → {live} handles");
        assert!(live <= 2 * start, "{kind}: {start} → {live} handles");
    }
}
