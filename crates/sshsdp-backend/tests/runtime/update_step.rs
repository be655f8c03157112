//! The linear update (`begin_update` → step the pieces → `commit`): it gives what the closure
//! form gives, bitwise; the runtime's lock is not held while the caller steps; a skipped step
//! opens nothing; and a step that is not committed — abandoned with an error, or dropped —
//! applies nothing more and is an error on every rank (bounded: never the engine's timeout),
//! including a read of a parameter while the step holds the pieces.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sshsdp_backend::{HsdpError, NonFinitePolicy, PieceValues, Views};
use sshsdp_comm::threads::ThreadComm;
use sshsdp_comm::Collective;
use sshsdp_plan::{RuntimeFormat, Sharding};

use crate::common::models::{plain_net, sharded_net, GLOBAL};
use crate::common::*;

const LR: f32 = 0.25;
/// Long enough that an error only a timeout produced says "timed out" (and fails the test).
const FAIL_TIMEOUT: Duration = Duration::from_secs(10);

/// Shards [`plain_net`] on this rank in `format` and runs one forward and backward on its rows.
fn stepped_once(
    comm: ThreadComm,
    world: usize,
    format: RuntimeFormat,
) -> (crate::common::models::Net<B>, Runtime) {
    let rank = comm.rank();
    let config = config(flat(world), Sharding::Hierarchical, format);
    let (model, runtime) = shard_on(&sharded_net(&plain_net(71)), config, comm);
    let _ = model.loss(0, my_rows(rank, world, GLOBAL)).backward();
    (model, runtime)
}

/// The same SGD as [`sgd`], written against the open step's pieces.
fn sgd_pieces(runtime: &Runtime) -> Result<(), HsdpError> {
    let mut update = runtime.begin_update(Views::Host)?.expect("a finite step");
    for piece in update.pieces_mut() {
        let (master, grad) = piece.host()?;
        for (m, g) in master.iter_mut().zip(grad) {
            *m -= LR * g;
        }
    }
    update.commit().map(|_| ())
}

/// Waits (bounded) until `flag` is set: a rank that gave up its step waits for its peer's commit
/// to return before it calls anything collective again, so the peer's error can only come from
/// the abort the give-up made, not from meeting this rank's next call.
fn wait_for(flag: &AtomicBool) {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) && start.elapsed() < 2 * FAIL_TIMEOUT {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Asserts that `outcome` is an error that did not come from the engine's timeout.
fn assert_failed_fast<T: std::fmt::Debug>(what: &str, outcome: &Result<T, HsdpError>) {
    match outcome {
        Ok(v) => panic!("{what}: succeeded: {v:?}"),
        Err(e) => assert!(!e.to_string().contains("timed out"), "{what}: {e}"),
    }
}

#[test]
fn a_committed_step_equals_the_closure_form_bitwise() {
    for (world, format) in [
        (1, RuntimeFormat::F32),
        (2, RuntimeFormat::Mxfp8),
        (3, RuntimeFormat::Bf16),
    ] {
        let closure = on_ranks(world, |comm| {
            let (_model, runtime) = stepped_once(comm, world, format);
            sgd(&runtime, LR).unwrap();
            (gathered(&runtime), masters(&runtime))
        });
        let linear = on_ranks(world, |comm| {
            let (_model, runtime) = stepped_once(comm, world, format);
            sgd_pieces(&runtime).unwrap();
            (gathered(&runtime), masters(&runtime))
        });
        for (rank, (a, b)) in closure.iter().zip(&linear).enumerate() {
            let what = format!("world {world} {format:?} rank {rank}");
            assert_params(&what, &b.0, &a.0, 0.0, 0.0);
            let bits = |m: &[Master]| {
                m.iter()
                    .map(|&(p, i, v)| (p, i, v.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&b.1), bits(&a.1), "{what}: masters");
        }
    }
}

#[test]
fn the_runtime_is_not_locked_while_the_caller_steps() {
    on_ranks(2, |comm| {
        let (_model, runtime) = stepped_once(comm, 2, RuntimeFormat::Bf16);
        let mut update = runtime.begin_update(Views::AsStored).unwrap().unwrap();
        // Calls that take the runtime's state lock return while the step is open (with the lock
        // held across the step they would deadlock this thread).
        let norm = runtime.last_grad_norm();
        let _ = runtime.take_counters();
        assert!(norm.is_some_and(f64::is_finite));
        assert!(!update.pieces_mut().is_empty());
        assert_eq!(update.group().grad_norm(), norm);
        update.commit().unwrap();
    });
}

#[test]
fn pieces_carry_their_plan_index_and_their_masters_where_asked() {
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let (_model, runtime) = stepped_once(comm, 2, RuntimeFormat::Mxfp8);
        let plan = runtime.plan().clone();
        let mut update = runtime.begin_update(Views::AsStored).unwrap().unwrap();
        for piece in update.pieces_mut() {
            assert_eq!(piece.index, plan.piece_of(rank).unwrap());
            let views = plan.piece_views(piece.bucket, piece.index).unwrap();
            let last = views
                .iter()
                .map(|v| v.master_offset + v.len())
                .max()
                .unwrap_or(0);
            assert!(
                last as usize <= piece.len(),
                "the views lie inside the piece"
            );
            // Host masters (the default placement) are host values as stored.
            assert!(matches!(piece.values, PieceValues::Host { .. }));
        }
        update.commit().unwrap();
    });
}

#[test]
fn a_skipped_step_opens_nothing_and_changes_nothing() {
    let outcomes = on_ranks(2, |comm| {
        let rank = comm.rank();
        let config = config(flat(2), Sharding::Hierarchical, RuntimeFormat::F32)
            .with_non_finite_policy(NonFinitePolicy::SkipStep);
        let (model, runtime) = shard_on(&sharded_net(&plain_net(72)), config, comm);
        let before = gathered(&runtime);
        let _ = (model.loss(0, my_rows(rank, 2, GLOBAL)) * f32::INFINITY).backward();
        let opened = runtime.begin_update(Views::Host).unwrap().is_some();
        (
            opened,
            before,
            gathered(&runtime),
            runtime.take_counters().skipped_steps,
        )
    });
    for (rank, (opened, before, after, skipped)) in outcomes.iter().enumerate() {
        assert!(!opened, "rank {rank}: a non-finite step opened");
        assert_params(&format!("rank {rank}"), after, before, 0.0, 0.0);
        assert_eq!(*skipped, 1, "rank {rank}: skipped steps");
    }
}

#[test]
fn an_abandoned_step_is_an_error_on_every_rank() {
    let committed = AtomicBool::new(false);
    let outcomes = run_world(2, FAIL_TIMEOUT, |comm| {
        let _guard = shared();
        let rank = comm.rank();
        let (_model, runtime) = stepped_once(comm, 2, RuntimeFormat::Bf16);
        let update = runtime.begin_update(Views::Host).unwrap().unwrap();
        let outcome = match rank {
            0 => {
                let e = update.abandon(HsdpError::Failed("the optimizer gave up".into()));
                wait_for(&committed);
                Err(e)
            }
            _ => {
                let outcome = update.commit();
                committed.store(true, Ordering::Release);
                outcome
            }
        };
        (outcome, sgd(&runtime, LR))
    });
    for (rank, (step, next)) in outcomes.iter().enumerate() {
        assert_failed_fast(&format!("rank {rank}'s step"), step);
        assert_failed_fast(&format!("rank {rank}'s next step"), next);
    }
    let Err(e) = &outcomes[0].0 else {
        unreachable!()
    };
    assert!(
        e.to_string().contains("the optimizer gave up"),
        "rank 0 gets its error back: {e}"
    );
}

#[test]
fn a_step_dropped_without_commit_is_an_error_on_every_rank() {
    let committed = AtomicBool::new(false);
    let outcomes = run_world(2, FAIL_TIMEOUT, |comm| {
        let _guard = shared();
        let rank = comm.rank();
        let (_model, runtime) = stepped_once(comm, 2, RuntimeFormat::Mxfp8);
        let bytes = runtime.master_bytes();
        let update = runtime.begin_update(Views::Host).unwrap().unwrap();
        let outcome = match rank {
            0 => {
                drop(update);
                wait_for(&committed);
                Err(HsdpError::Failed("dropped".into()))
            }
            _ => {
                let outcome = update.commit();
                committed.store(true, Ordering::Release);
                outcome
            }
        };
        // The masters went back (no memory lost), and the runtime stays failed.
        (
            outcome,
            bytes == runtime.master_bytes(),
            sgd(&runtime, LR),
            runtime.param_values("up.weight"),
        )
    });
    for (rank, (step, kept, next, read)) in outcomes.iter().enumerate() {
        assert_failed_fast(&format!("rank {rank}'s step"), step);
        assert!(kept, "rank {rank}: the masters went back to the buckets");
        assert_failed_fast(&format!("rank {rank}'s next step"), next);
        assert_failed_fast(&format!("rank {rank}'s read"), read);
    }
}

#[test]
fn reading_a_parameter_while_a_step_is_open_is_an_error() {
    let outcomes = run_world(1, FAIL_TIMEOUT, |comm| {
        let _guard = shared();
        let (_model, runtime) = stepped_once(comm, 1, RuntimeFormat::F32);
        let update = runtime.begin_update(Views::Host).unwrap().unwrap();
        let read = runtime.param_values("up.weight");
        (read.map(|_| ()), update.commit())
    });
    let (read, commit) = &outcomes[0];
    assert_failed_fast("the read", read);
    assert!(
        read.as_ref()
            .unwrap_err()
            .to_string()
            .contains("update step"),
        "the error says why: {read:?}"
    );
    assert_failed_fast("the commit after it", commit);
}

/// A committed step prefetches the next forward's first bucket; masters rewritten before that
/// forward (`master_pieces`, what a checkpoint load does) drop the prefetch, so the forward
/// reads the new values, not the shards the prefetch gathered (checked by mutation: with the
/// prefetch kept, bucket 0 reads the stepped values).
#[test]
fn masters_rewritten_after_a_step_are_what_the_next_forward_reads() {
    for world in [1, 2] {
        let out = on_ranks(world, |comm| {
            let rank = comm.rank();
            let (model, runtime) = stepped_once(comm, world, RuntimeFormat::F32);
            sgd_pieces(&runtime).unwrap();
            // Every master element set to 0.5: each parameter must read 0.5 everywhere.
            runtime
                .master_pieces(|pieces, _| {
                    for p in pieces.iter_mut() {
                        p.host()?.0.iter_mut().for_each(|m| *m = 0.5);
                    }
                    Ok(())
                })
                .unwrap();
            let _ = model.loss(0, my_rows(rank, world, GLOBAL)).backward();
            gathered(&runtime)
        });
        for params in out {
            for p in params {
                assert!(
                    p.values.iter().all(|&v| v == 0.5),
                    "world {world}: {}",
                    p.path
                );
            }
        }
    }
}
