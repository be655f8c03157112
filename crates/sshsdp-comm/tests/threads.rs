//! The conformance suite on the threads engine at several world sizes, and its failure paths.

use std::time::{Duration, Instant};

use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::{conformance, Collective, CommError, ReduceOp};

fn config(timeout_ms: u64) -> ThreadsConfig {
    ThreadsConfig {
        timeout: Duration::from_millis(timeout_ms),
    }
}

#[test]
fn conformance_suite_passes_at_world_1_to_4() {
    for size in 1..=4 {
        let results =
            ThreadsWorld::run(size, config(30_000), |comm| conformance::run_all(&comm)).unwrap();
        for (rank, result) in results.into_iter().enumerate() {
            for (name, outcome) in result.expect("no rank panics") {
                assert_eq!(outcome, Ok(()), "world {size} rank {rank}: {name}");
            }
        }
    }
}

/// The threads engine moves host memory only: a runtime over it stages device buffers.
#[test]
fn host_engines_offer_no_device_collectives() {
    let results = ThreadsWorld::run(2, config(30_000), |comm| {
        let split = comm.split(0, comm.rank()).unwrap();
        (comm.device().is_none(), split.device().is_none())
    })
    .unwrap();
    for r in results {
        assert_eq!(r.unwrap(), (true, true));
    }
}

#[test]
fn hierarchical_paths_on_2x2_1x4_4x1() {
    for (r, s) in [(2, 2), (1, 4), (4, 1)] {
        let results = ThreadsWorld::run(4, config(30_000), |comm| {
            conformance::hierarchical_paths(&comm, r, s)
        })
        .unwrap();
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result.unwrap(), Ok(()), "{r}x{s} rank {rank}");
        }
    }
}

#[test]
fn a_panicking_rank_fails_the_others_quickly() {
    let start = Instant::now();
    let results = ThreadsWorld::run(4, config(60_000), |comm| {
        let mut buf = vec![1f32; 8];
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        if comm.rank() == 2 {
            panic!("rank 2 fails mid-step");
        }
        comm.all_reduce(&mut buf, ReduceOp::Sum)
    })
    .unwrap();
    // The failure is seen at once (dropping the communicator while unwinding), not after the
    // 60 s timeout.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 2 {
            assert!(r.is_err(), "rank 2 panicked");
        } else {
            let err = r.unwrap().unwrap_err();
            assert!(
                matches!(&err, CommError::PeerFailed(m) if m.contains("rank 2 panicked")),
                "{err}"
            );
        }
    }
}

#[test]
fn a_silent_rank_makes_the_others_time_out() {
    let start = Instant::now();
    let results = ThreadsWorld::run(3, config(300), |comm| {
        if comm.rank() == 0 {
            // Stays alive but never joins the collective.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        comm.barrier()
    })
    .unwrap();
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    let errors: Vec<CommError> = results
        .into_iter()
        .skip(1)
        .map(|r| r.unwrap().unwrap_err())
        .collect();
    // One rank times out naming rank 0; the other sees the group fail (or times out too).
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, CommError::Timeout { missing, .. } if missing.contains(&0))),
        "{errors:?}"
    );
    assert!(errors
        .iter()
        .all(|e| matches!(e, CommError::Timeout { .. } | CommError::PeerFailed(_))));
}

#[test]
fn a_rank_that_drops_out_fails_the_others() {
    let results = ThreadsWorld::run(2, config(60_000), |comm| {
        if comm.rank() == 1 {
            drop(comm);
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
        comm.barrier()
    })
    .unwrap();
    let err = results.into_iter().next().unwrap().unwrap().unwrap_err();
    assert!(
        matches!(&err, CommError::PeerFailed(m) if m.contains("rank 1 dropped")),
        "{err}"
    );
}

#[test]
fn mismatched_calls_are_errors_on_every_rank() {
    let results = ThreadsWorld::run(2, config(5_000), |comm| {
        if comm.rank() == 0 {
            comm.all_reduce(&mut [0f32; 4], ReduceOp::Sum)
        } else {
            comm.all_reduce(&mut [0f32; 5], ReduceOp::Sum)
        }
    })
    .unwrap();
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert!(
            matches!(err, CommError::Mismatch(_) | CommError::PeerFailed(_)),
            "{err}"
        );
    }
    let results = ThreadsWorld::run(2, config(5_000), |comm| {
        if comm.rank() == 0 {
            comm.broadcast(&mut [0u8; 4], 0)
        } else {
            comm.all_gather_in_place(&mut [0u8; 4])
        }
    })
    .unwrap();
    assert!(results.into_iter().all(|r| r.unwrap().is_err()));
}

#[test]
fn reductions_are_bitwise_identical_on_every_rank() {
    let results = ThreadsWorld::run(3, config(30_000), |comm| {
        let mut buf: Vec<f32> = (0..10_001)
            .map(|i| ((i * 7919 + comm.rank() * 104_729) as f32).sin() * 1e3)
            .collect();
        comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
        buf
    })
    .unwrap();
    let first = results[0].as_ref().unwrap();
    for r in &results[1..] {
        let r = r.as_ref().unwrap();
        assert!(first.iter().zip(r).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn an_empty_world_is_an_error() {
    assert!(matches!(
        ThreadsWorld::create(0, ThreadsConfig::default()),
        Err(CommError::InvalidArgument(_))
    ));
}

#[test]
fn a_panic_or_an_abort_fails_every_communicator_of_the_world() {
    // A rank that panics while its communicators live elsewhere (as a runtime's lanes do):
    // the others' calls on a communicator split from the world fail at once.
    for abort in [false, true] {
        let start = Instant::now();
        let results = ThreadsWorld::run(3, config(60_000), |comm| {
            let rank = comm.rank();
            let lane = comm.split(0, rank).unwrap();
            let handle = comm.abort_handle().expect("the threads engine can abort");
            std::mem::forget(comm); // kept alive, as a runtime would
            if rank == 1 {
                // Its lane stays alive too (dropping it would fail the lane's group by itself).
                std::mem::forget(lane);
                if abort {
                    handle("rank 1 gave up");
                    return Err(CommError::PeerFailed("aborted".into()));
                }
                panic!("rank 1 fails");
            }
            let mut buf = [1f32];
            lane.all_reduce(&mut buf, ReduceOp::Sum)
        })
        .unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(results[1].is_err(), !abort, "rank 1 panicked");
        for rank in [0, 2] {
            let outcome = results[rank].as_ref().expect("no panic");
            let err = outcome.as_ref().expect_err("the lane failed");
            assert!(err.to_string().contains("rank 1"), "rank {rank}: {err}");
        }
    }
}

#[test]
fn calls_with_different_tags_are_errors_on_every_rank() {
    for size in [1, 2, 3] {
        let results = ThreadsWorld::run(size, config(30_000), |comm| {
            conformance::mismatched_tags(&comm)
        })
        .unwrap();
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap()
                .unwrap_or_else(|e| panic!("world {size}, rank {rank}: {e}"));
        }
    }
}

#[test]
fn all_to_all_v_counts_that_disagree_are_errors_on_every_rank() {
    for size in [1, 2, 3] {
        let results = ThreadsWorld::run(size, config(30_000), |comm| {
            conformance::mismatched_counts(&comm)
        })
        .unwrap();
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap()
                .unwrap_or_else(|e| panic!("world {size}, rank {rank}: {e}"));
        }
    }
}

#[test]
fn an_abort_is_an_error_on_every_rank_long_before_the_timeout() {
    let results = ThreadsWorld::run(4, config(60_000), |comm| {
        conformance::abort_fails_every_rank(&comm)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let took = r.unwrap().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(took.as_secs_f64() < 1.0, "rank {rank} took {took:?}");
    }
}

/// The engine's byte counts: an all-gather receives the peers' chunks, an all-reduce moves
/// `2·n·(W−1)/W` each way, an all-to-all-v moves each off-diagonal chunk once (sent by its
/// source, received by its destination), and a split communicator counts for its world rank.
#[test]
fn traffic_counts_the_bytes_each_rank_moves() {
    use sshsdp_comm::threads::TrafficBytes;
    let world = 4;
    let results = ThreadsWorld::run(world, config(30_000), |comm| {
        let (rank, size) = (comm.rank(), comm.size());
        let step = |f: &dyn Fn()| {
            let before = comm.traffic();
            f();
            comm.barrier().unwrap();
            let after = comm.traffic();
            TrafficBytes {
                sent: after.sent - before.sent,
                received: after.received - before.received,
            }
        };
        let gather = step(&|| {
            let mut buf = vec![1f32; 8 * size];
            comm.all_gather_in_place(&mut buf).unwrap();
        });
        let reduce = step(&|| {
            let mut buf = vec![1f32; 400];
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        });
        // Rank a sends a + b elements (bf16) to rank b.
        let a2a = step(&|| {
            let sc: Vec<usize> = (0..size).map(|b| rank + b).collect();
            let rc: Vec<usize> = (0..size).map(|a| a + rank).collect();
            let send = vec![half::bf16::ONE; sc.iter().sum()];
            let mut recv = vec![half::bf16::ZERO; rc.iter().sum()];
            comm.all_to_all_v(&send, &sc, &mut recv, &rc).unwrap();
        });
        let sub = comm.split(rank % 2, rank).unwrap();
        let split = step(&|| {
            let mut buf = vec![0u8; 10];
            sub.broadcast(&mut buf, 0).unwrap();
        });
        (rank, gather, reduce, a2a, split)
    })
    .unwrap();
    for r in results {
        let (rank, gather, reduce, a2a, split) = r.unwrap();
        let peers = (world - 1) as u64;
        assert_eq!(
            gather,
            TrafficBytes {
                sent: peers * 32,
                received: peers * 32
            }
        );
        let ring = 2 * 1600 * peers / world as u64;
        assert_eq!(
            reduce,
            TrafficBytes {
                sent: ring,
                received: ring
            }
        );
        let off: u64 = (0..world)
            .filter(|&q| q != rank)
            .map(|q| 2 * (rank + q) as u64)
            .sum();
        assert_eq!(
            a2a,
            TrafficBytes {
                sent: off,
                received: off
            },
            "rank {rank}"
        );
        // Halves {0, 2} and {1, 3}: the root (new rank 0) sends 10 bytes, the other receives.
        let root = rank < 2;
        assert_eq!(
            split,
            TrafficBytes {
                sent: if root { 10 } else { 0 },
                received: if root { 0 } else { 10 }
            }
        );
    }
}
