//! The conformance suite on the MPI engine.
//!
//! ```text
//! cargo build -p sshsdp-comm --features mpi --example mpi_conformance
//! mpirun --allow-run-as-root --oversubscribe -n 4 target/debug/examples/mpi_conformance
//! ```
//!
//! Every rank runs [`sshsdp_comm::conformance::run_all`]; each check's failure count is summed
//! over ranks, rank 0 prints one line per check (with this rank's and rank 0's messages), and
//! every rank exits non-zero if any check failed on any rank.
//!
//! `SSHSDP_MPI_RS_ALGO=block|varcount|allreduce` forces one reduce-scatter algorithm for every
//! size (the default policy switches by size, and the suite's buffers are all small).
//!
//! Fault injection (one per launch: a fault fails the session), with a 2 s watchdog:
//! * `--fault tag`: ranks call the same all-reduce with different buckets in their tags; every
//!   rank must get a mismatch error. Exits 0 when all did.
//! * `--fault abort`: the last rank aborts (a soft fault); every rank's next all-reduce must be an
//!   error. Exits 0 when all were, printing each rank's time to the error.
//! * `--fault hang`: the last rank stops calling (sleeps); the others' all-reduce never
//!   completes, and the watchdog must end the job with `MPI_Abort` (mpirun exits non-zero).
//! * `--fault exit`: the last rank exits without finalising MPI (a hard fault); mpirun must end
//!   the job non-zero.
//!
//! The suite also prints the cost of the call check: small all-reduces per second with and
//! without it.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use sshsdp_comm::mpi::{MpiComm, MpiOptions, MpiSession, ReduceScatterAlgo, ReduceScatterPolicy};
use sshsdp_comm::{conformance, Collective, ReduceOp};

/// The watchdog's limit under fault injection.
const FAULT_WATCHDOG: Duration = Duration::from_secs(2);

fn fault() -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--fault")
        .and_then(|i| args.get(i + 1).cloned())
}

fn options() -> MpiOptions {
    match fault() {
        Some(_) => MpiOptions {
            watchdog: Some(FAULT_WATCHDOG),
            ..MpiOptions::default()
        },
        None => MpiOptions::default(),
    }
}

/// Runs fault `which`; true when this rank saw what it must.
fn inject(comm: &MpiComm, which: &str) -> bool {
    let (rank, size) = (comm.rank(), comm.size());
    let last = rank == size - 1;
    match which {
        "tag" => match conformance::mismatched_tags(comm) {
            Ok(()) => {
                println!("rank {rank}: mismatched tags: error as expected");
                true
            }
            Err(e) => {
                eprintln!("rank {rank}: mismatched tags: {e}");
                false
            }
        },
        "counts" => match conformance::mismatched_counts(comm) {
            Ok(()) => {
                println!("rank {rank}: all-to-all-v counts that disagree: error as expected");
                true
            }
            Err(e) => {
                eprintln!("rank {rank}: mismatched counts: {e}");
                false
            }
        },
        "abort" => match conformance::abort_fails_every_rank(comm) {
            Ok(took) => {
                println!(
                    "rank {rank}: abort on rank {}: error after {took:.1?}",
                    size - 1
                );
                true
            }
            Err(e) => {
                eprintln!("rank {rank}: abort: {e}");
                false
            }
        },
        "hang" | "exit" => {
            if last && which == "exit" {
                eprintln!("rank {rank}: exiting without MPI_Finalize (injected)");
                std::process::exit(3);
            }
            if last {
                eprintln!("rank {rank}: stops calling (injected)");
                std::thread::sleep(Duration::from_secs(3600));
            }
            let start = Instant::now();
            let mut buf = [1f32; 4];
            let r = comm.all_reduce(&mut buf, ReduceOp::Sum);
            eprintln!(
                "rank {rank}: the all-reduce returned {r:?} after {:.1?}; the job should have \
                 ended",
                start.elapsed()
            );
            false
        }
        other => {
            eprintln!("mpi_conformance: unknown fault {other:?} (tag, counts, abort, hang, exit)");
            false
        }
    }
}

/// Small all-reduces per second on `comm` (timed over `calls` calls).
fn small_calls_per_second(comm: &MpiComm, calls: usize) -> f64 {
    let mut buf = [1f32; 4];
    let _ = comm.barrier();
    let start = Instant::now();
    for _ in 0..calls {
        let _ = comm.all_reduce(&mut buf, ReduceOp::Sum);
    }
    calls as f64 / start.elapsed().as_secs_f64()
}

fn main() -> ExitCode {
    let mpi = match MpiSession::init_with(options()) {
        Ok(mpi) => mpi,
        Err(e) => {
            eprintln!("mpi_conformance: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut comm = match mpi.world() {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("mpi_conformance: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(algo) = std::env::var("SSHSDP_MPI_RS_ALGO")
        .ok()
        .filter(|a| !a.is_empty())
    {
        let algo = match algo.as_str() {
            "block" => ReduceScatterAlgo::Block,
            "varcount" => ReduceScatterAlgo::Varcount,
            "allreduce" => ReduceScatterAlgo::AllReduce,
            other => {
                eprintln!("mpi_conformance: unknown SSHSDP_MPI_RS_ALGO {other:?}");
                return ExitCode::FAILURE;
            }
        };
        comm.set_reduce_scatter_policy(ReduceScatterPolicy::always(algo));
    }
    if let Some(which) = fault() {
        return if inject(&comm, &which) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let (rank, size) = (comm.rank(), comm.size());
    let results = conformance::run_all(&comm);

    // Failures per check, summed over ranks (f32 counts are exact far beyond any world size).
    let mut failures: Vec<f32> = results
        .iter()
        .map(|(_, outcome)| f32::from(u8::from(outcome.is_err())))
        .collect();
    if let Err(e) = comm.all_reduce(&mut failures, ReduceOp::Sum) {
        eprintln!("rank {rank}: gathering results failed: {e}");
        return ExitCode::FAILURE;
    }
    // Non-zero ranks report their own failures; rank 0 prints the table.
    for ((name, outcome), _) in results.iter().zip(&failures) {
        if let (Err(msg), true) = (outcome, rank != 0) {
            eprintln!("rank {rank}: {name}: {msg}");
        }
    }
    let _ = comm.barrier();
    if rank == 0 {
        println!(
            "MPI conformance, {size} rank(s), MPI_IN_PLACE: {}, {:?}",
            comm.uses_mpi_in_place(),
            comm.reduce_scatter_policy()
        );
        for ((name, outcome), &failed) in results.iter().zip(&failures) {
            match (failed as usize, outcome) {
                (0, _) => println!("  ok    {name}"),
                (n, Err(msg)) => println!("  FAIL  {name} on {n} rank(s); rank 0: {msg}"),
                (n, Ok(())) => println!("  FAIL  {name} on {n} rank(s) (not rank 0; see stderr)"),
            }
        }
    }
    // The call check's cost: the same small all-reduce with and without it.
    let checked = small_calls_per_second(&comm, 2000);
    let unchecked = match comm.split(0, rank) {
        Ok(mut fast) => {
            fast.set_check_calls(false);
            small_calls_per_second(&fast, 2000)
        }
        Err(e) => {
            eprintln!("rank {rank}: split: {e}");
            return ExitCode::FAILURE;
        }
    };
    if rank == 0 {
        println!(
            "call check: {checked:.0} small all-reduces/s with it, {unchecked:.0} without \
             ({:.1} µs per call)",
            1e6 / checked - 1e6 / unchecked
        );
    }
    let failed: f32 = failures.iter().sum();
    if rank == 0 {
        println!(
            "{} of {} checks failed",
            failures.iter().filter(|&&f| f > 0.0).count(),
            results.len()
        );
    }
    if failed > 0.0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
