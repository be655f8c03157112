//! Failures: what one rank gets wrong — another model or config, a backward it skipped, an
//! error from its step closure, a whole bucket only it uses, a fault injected through
//! `sshsdp_comm::faults` at shard, gather, reduce or update — is an error on every rank, never a
//! hang, a panic or a success on some ranks (the threads engine's timeout is long: an error that
//! only a timeout produced says "timed out" and fails the test); and a non-finite gradient
//! fails the update on every rank (`NonFinitePolicy::Error`) or skips it
//! (`NonFinitePolicy::SkipStep`), never reaching the step closure and changing no parameter.

use std::time::Duration;

use burn::nn::LinearConfig;
use sshsdp_backend::{
    HsdpConfig, HsdpError, MixedPrecision, NonFinitePolicy, Placement, Precision,
};
use sshsdp_comm::threads::ThreadComm;
use sshsdp_comm::Collective;
use sshsdp_plan::{RuntimeFormat, Sharding};

use crate::common::models::{
    plain_branchy, plain_net, sharded_branchy, sharded_net, D, GLOBAL, WIDTH,
};
use crate::common::*;

/// The engine's timeout in failure tests: long enough that an error which only a timeout
/// produced is told apart by its message, short enough that a hang fails the test soon.
const FAIL_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `f` on `world` ranks with [`FAIL_TIMEOUT`] (shut out from the fail points).
fn failing_world<T: Send>(world: usize, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    let _guard = shared();
    run_world(world, FAIL_TIMEOUT, f)
}

/// Asserts that every rank got an error and that none of them was a timeout.
fn assert_every_rank_failed<T: std::fmt::Debug>(what: &str, outcomes: &[Result<T, HsdpError>]) {
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Ok(v) => panic!("{what}: rank {rank} succeeded: {v:?}"),
            Err(e) => assert!(
                !e.to_string().contains("timed out"),
                "{what}: rank {rank} waited for the timeout: {e}"
            ),
        }
    }
}

#[test]
fn different_models_on_different_ranks_are_rejected_on_every_rank() {
    let init = sharded_net(&plain_net(51));
    let outcomes = failing_world(3, |comm| {
        let mut model = init.clone();
        if comm.rank() == 2 {
            model.down = LinearConfig::new(D, 9).init(&Default::default());
        }
        let config = config(flat(3), Sharding::Hierarchical, RuntimeFormat::F32);
        sshsdp_backend::shard::<B, _, _>(model, config, comm, &Default::default()).map(|_| ())
    });
    assert_every_rank_failed("another head on rank 2", &outcomes);
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome.unwrap_err() {
            HsdpError::PlanMismatch { detail, .. } => {
                assert!(detail.contains("down.weight"), "rank {rank}: {detail}")
            }
            other => panic!("rank {rank}: {other}"),
        }
    }
}

#[test]
fn different_configs_on_different_ranks_are_rejected_on_every_rank() {
    let init = sharded_net(&plain_net(52));
    let differ: [(&str, &(dyn Fn(HsdpConfig) -> HsdpConfig + Sync)); 3] = [
        ("format", &|c| c.with_format(RuntimeFormat::Bf16)),
        ("bucket size", &|c| c.with_bucket_elements(300)),
        ("sharding", &|c| c.with_sharding(Sharding::Ddp)),
    ];
    for (what, change) in differ {
        let outcomes = failing_world(2, |comm| {
            let mut config = config(flat(2), Sharding::Hierarchical, RuntimeFormat::F32);
            if comm.rank() == 1 {
                config = change(config);
            }
            sshsdp_backend::shard::<B, _, _>(init.clone(), config, comm, &Default::default())
                .map(|_| ())
        });
        assert_every_rank_failed(what, &outcomes);
        for outcome in outcomes {
            let err = outcome.unwrap_err();
            assert!(
                matches!(err, HsdpError::PlanMismatch { .. }),
                "{what}: {err}"
            );
        }
    }
}

#[test]
fn an_invalid_config_on_one_rank_is_an_error_on_every_rank() {
    let init = sharded_net(&plain_net(53));
    let outcomes = failing_world(3, |comm| {
        let rank = comm.rank();
        let mut config = config(flat(3), Sharding::Hierarchical, RuntimeFormat::F32);
        if rank == 1 {
            // Device shards need device masters (and a CubeCL backend).
            config = config.with_shard_placement(Placement::Device);
        }
        sshsdp_backend::shard::<B, _, _>(init.clone(), config, comm, &Default::default())
            .map(|_| ())
    });
    assert_every_rank_failed("device shards on rank 1", &outcomes);
    let own = outcomes[1].as_ref().unwrap_err().to_string();
    assert!(own.contains("master"), "rank 1 names its mistake: {own}");
}

#[test]
fn a_compute_dtype_the_backend_lacks_is_refused_on_every_rank() {
    // NdArray computes in f32 only: a bf16 compute policy is refused by `shard`, on every rank,
    // naming the dtype, before anything is gathered.
    let init = sharded_net(&plain_net(59));
    let outcomes = failing_world(2, |comm| {
        let config = config(flat(2), Sharding::Hierarchical, RuntimeFormat::Bf16)
            .with_mixed_precision(MixedPrecision::new(Precision::Bf16, Precision::F32));
        sshsdp_backend::shard::<B, _, _>(init.clone(), config, comm, &Default::default())
            .map(|_| ())
    });
    assert_every_rank_failed("bf16 compute on NdArray", &outcomes);
    let own = outcomes[0].as_ref().unwrap_err().to_string();
    assert!(own.contains("Bf16"), "{own}");
}

#[test]
fn a_rank_that_skips_backward_fails_the_update_on_every_rank() {
    // Rank 1 forwards but never runs backward, then steps: its update's gradient-norm
    // all-gather (replica lane) and rank 0's reductions (shard lane) never meet, so nothing
    // fails until the engine's timeout — the threads engine's documented last resort "for a rank
    // that stops calling without failing" (docs/FAILURES.md) — which then fails every rank.
    // A short timeout here; what is checked is that every rank returns an error.
    let init = sharded_net(&plain_net(54));
    let world = 2;
    let _guard = shared();
    let outcomes = run_world(world, Duration::from_secs(2), |comm| {
        let rank = comm.rank();
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32);
        let (model, runtime) = shard_on(&init, config, comm);
        let loss = model.loss(0, my_rows(rank, world, GLOBAL));
        if rank == 0 {
            let _ = loss.backward();
        }
        let stepped = sgd(&runtime, 0.5);
        (stepped, runtime.param_values("up.weight").map(|_| ()))
    });
    for (rank, (stepped, read)) in outcomes.iter().enumerate() {
        assert!(stepped.is_err(), "rank {rank} stepped: {stepped:?}");
        assert!(
            read.is_err(),
            "rank {rank}'s runtime stays failed: {read:?}"
        );
    }
}

#[test]
fn an_error_from_one_ranks_step_fails_the_update_on_every_rank() {
    let init = sharded_net(&plain_net(55));
    let world = 3;
    let outcomes = failing_world(world, |comm| {
        let rank = comm.rank();
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::Bf16);
        let (model, runtime) = shard_on(&init, config, comm);
        let _ = model.loss(0, my_rows(rank, world, GLOBAL)).backward();
        let stepped = runtime.update(|_, master, grad| {
            if rank == 1 {
                return Err(HsdpError::Failed("rank 1's optimizer gave up".into()));
            }
            master.iter_mut().zip(grad).for_each(|(m, g)| *m -= 0.5 * g);
            Ok(())
        });
        // The runtime stays failed: reading a parameter is an error too.
        (stepped, runtime.param_values("up.weight").map(|_| ()))
    });
    let (stepped, read): (Vec<_>, Vec<_>) = outcomes.into_iter().unzip();
    assert_every_rank_failed("update", &stepped);
    assert_every_rank_failed("param_values after the failure", &read);
    let own = stepped[1].as_ref().unwrap_err().to_string();
    assert!(
        own.contains("gave up"),
        "rank 1 reports its own error: {own}"
    );
    for rank in [0, 2] {
        // Rank 1's failure aborted every communicator, carrying its message.
        let theirs = stepped[rank].as_ref().unwrap_err().to_string();
        assert!(
            theirs.contains("rank 1") && theirs.contains("gave up"),
            "rank {rank} names rank 1's failure: {theirs}"
        );
    }
}

#[test]
fn a_whole_bucket_only_one_rank_uses_is_a_mismatch_on_every_rank() {
    // One `Linear` per bucket: `odd`'s bucket is gathered (and reduced) on rank 0 only — the
    // documented limit (docs/YOUR_MODEL.md): a collective mismatch, not a hang.
    let init = sharded_branchy(&plain_branchy(56));
    let world = 2;
    let layer = (WIDTH * WIDTH + WIDTH) as u64;
    let outcomes = failing_world(world, |comm| {
        let rank = comm.rank();
        let config = HsdpConfig::new(flat(world)).with_bucket_elements(layer);
        let (model, runtime) = shard_on(&init, config, comm);
        let _ = model
            .loss(0, rank * 2..rank * 2 + 2, rank == 0, 0.0)
            .backward();
        sgd(&runtime, 0.5)
    });
    assert_every_rank_failed("odd layer on rank 0 only", &outcomes);
    for (rank, outcome) in outcomes.iter().enumerate() {
        // The threads engine compares the calls' tags: rank 0's gather of `odd`'s bucket met
        // rank 1's gather of the next one.
        let err = outcome.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("but another rank called"),
            "rank {rank}: {err}"
        );
    }
}

/// One rank's outcomes of a step with a poisoned gradient and a clean step after it.
#[derive(Debug)]
struct Poisoned {
    first: Result<(), HsdpError>,
    norm: Option<f64>,
    after_first: Vec<sshsdp_backend::NamedParam>,
    second: Result<(), HsdpError>,
    after_second: Vec<sshsdp_backend::NamedParam>,
    steps_called: usize,
    skipped: u64,
}

/// A step in which rank 1's `Branchy` input is `poison` (NaN) or its loss is multiplied by
/// `scale` (infinity), then a clean step; with `policy`.
fn poisoned(policy: NonFinitePolicy, poison: f32, scale: f32) -> Vec<Poisoned> {
    let init = sharded_branchy(&plain_branchy(57));
    let world = 2;
    failing_world(world, |comm| {
        let rank = comm.rank();
        let config = HsdpConfig::new(flat(world)).with_non_finite_policy(policy);
        let (model, runtime) = shard_on(&init, config, comm);
        let steps_called = std::cell::Cell::new(0);
        let step = |runtime: &Runtime| {
            runtime.update(|_, master, grad| {
                steps_called.set(steps_called.get() + 1);
                master.iter_mut().zip(grad).for_each(|(m, g)| *m -= 0.5 * g);
                Ok(())
            })
        };
        let rows = rank * 2..rank * 2 + 2;
        let (p, s) = if rank == 1 {
            (poison, scale)
        } else {
            (0.0, 1.0)
        };
        let _ = (model.loss(0, rows.clone(), true, p) * s).backward();
        let first = step(&runtime);
        let norm = runtime.last_grad_norm();
        let called_first = steps_called.get();
        let after_first = gathered(&runtime);
        let _ = model.loss(1, rows, true, 0.0).backward();
        let second = step(&runtime);
        Poisoned {
            first,
            norm,
            after_first,
            second,
            after_second: gathered(&runtime),
            steps_called: called_first,
            skipped: runtime.take_counters().skipped_steps,
        }
    })
}

/// Checks that the poisoned step changed nothing and the clean one after it stepped as plain
/// Burn would from the initial values (the poisoned gradients were dropped, not carried on).
fn check_poisoned(what: &str, ranks: &[Poisoned]) {
    let init = plain_branchy(57);
    let start = sshsdp_backend::named_params(&init).unwrap();
    let loss = (init.loss(1, 0..2, true, 0.0) + init.loss(1, 2..4, true, 0.0)) / 2.0;
    let plain = plain_sgd(&init, loss, 0.5);
    for (rank, r) in ranks.iter().enumerate() {
        let what = format!("{what} rank {rank}");
        assert!(
            !r.norm.expect("measured").is_finite(),
            "{what}: {:?}",
            r.norm
        );
        assert_eq!(
            r.steps_called, 0,
            "{what}: the step closure saw the poisoned gradient"
        );
        assert_params(&what, &r.after_first, &start, 0.0, 0.0);
        assert!(
            r.second.is_ok(),
            "{what}: the next step works: {:?}",
            r.second
        );
        assert_params(&what, &r.after_second, &plain.after, 1e-6, 1e-8);
    }
}

#[test]
fn a_non_finite_gradient_fails_the_update_on_every_rank_and_applies_nothing() {
    for (poison, scale) in [(0.0, f32::INFINITY), (f32::NAN, 1.0)] {
        let ranks = poisoned(NonFinitePolicy::Error, poison, scale);
        let what = format!("Error policy, input + {poison}, loss × {scale}");
        for (rank, r) in ranks.iter().enumerate() {
            match &r.first {
                Err(HsdpError::NonFiniteGradient { norm }) => assert!(!norm.is_finite()),
                other => panic!("{what} rank {rank}: {other:?}"),
            }
            assert_eq!(r.skipped, 0, "{what}");
        }
        check_poisoned(&what, &ranks);
    }
}

#[test]
fn skip_step_skips_a_non_finite_gradient_on_every_rank_and_counts_it() {
    for (poison, scale) in [(0.0, f32::INFINITY), (f32::NAN, 1.0)] {
        let ranks = poisoned(NonFinitePolicy::SkipStep, poison, scale);
        let what = format!("SkipStep, input + {poison}, loss × {scale}");
        for (rank, r) in ranks.iter().enumerate() {
            assert!(r.first.is_ok(), "{what} rank {rank}: {:?}", r.first);
            assert_eq!(r.skipped, 1, "{what} rank {rank}");
        }
        check_poisoned(&what, &ranks);
    }
}

/// Where a rank's run with a fault at `point` on rank 1 ended: the stage whose call failed
/// (`"done"` if none) and its error.
fn with_fault(point: &'static str) -> Vec<(&'static str, String)> {
    let init = sharded_net(&plain_net(58));
    let world = 3;
    let _exclusive = exclusive();
    let scenario = fail::FailScenario::setup();
    fail::cfg(point, "return(1)").unwrap();
    let ended = run_world(world, FAIL_TIMEOUT, |comm| {
        let rank = comm.rank();
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::Mxfp8);
        let (model, runtime) =
            match sshsdp_backend::shard::<B, _, _>(init.clone(), config, comm, &Default::default())
            {
                Ok(sharded) => sharded,
                Err(e) => return ("shard", e.to_string()),
            };
        let _ = model.loss(0, my_rows(rank, world, GLOBAL)).backward();
        match sgd(&runtime, 0.5) {
            Ok(()) => ("done", String::new()),
            Err(e) => ("update", e.to_string()),
        }
    });
    scenario.teardown();
    ended
}

/// Checks that a fault at `point` on rank 1 ended every rank in `stage` with an error, none a
/// timeout, rank 1's naming the injected fault.
fn fault_reaches_every_rank(point: &'static str, stage: &str) {
    let ended = with_fault(point);
    for (rank, (at, error)) in ended.iter().enumerate() {
        assert_eq!(*at, stage, "{point}: rank {rank}: {error}");
        assert!(
            !error.contains("timed out"),
            "{point}: rank {rank} waited: {error}"
        );
    }
    assert!(
        ended[1].1.contains("injected fault"),
        "{point}: {}",
        ended[1].1
    );
}

#[test]
fn a_fault_in_shard_is_an_error_on_every_rank() {
    fault_reaches_every_rank("sshsdp::shard", "shard");
}

#[test]
fn a_fault_in_a_forward_gather_is_an_error_on_every_rank_at_the_update() {
    fault_reaches_every_rank("sshsdp::gather", "update");
}

#[test]
fn a_fault_in_a_backward_reduction_is_an_error_on_every_rank_at_the_update() {
    fault_reaches_every_rank("sshsdp::reduce", "update");
}

#[test]
fn a_fault_in_the_update_is_an_error_on_every_rank() {
    fault_reaches_every_rank("sshsdp::update", "update");
}
