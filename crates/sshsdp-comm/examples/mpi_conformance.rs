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

use std::process::ExitCode;

use sshsdp_comm::mpi::{MpiComm, ReduceScatterAlgo, ReduceScatterPolicy};
use sshsdp_comm::{conformance, Collective, ReduceOp};

fn main() -> ExitCode {
    let mut comm = match MpiComm::init() {
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
