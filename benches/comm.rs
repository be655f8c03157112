//! Collective bandwidth of the threads engine: bus bandwidth (NCCL's busbw convention) of
//! all-gather, reduce-scatter and all-reduce for 1 MiB … 256 MiB at 2 and 4 ranks, next to one
//! memcpy of the same bytes measured in the same run. Run: `cargo bench --bench comm`.
//!
//! busbw: all-gather and reduce-scatter `algbw · (n−1)/n`, all-reduce `algbw · 2(n−1)/n`, with
//! `algbw = buffer bytes / time`. Target (issue #3): threads all-gather ≥ 0.8 × memcpy.
//!
//! On a machine where one thread already saturates memory bandwidth, N ranks copying at once
//! share it, so busbw / single-thread memcpy is at most about 1/N for *any* shared-memory
//! all-gather. The `vs ideal` column therefore also compares the all-gather with its lower
//! bound measured in the same run: N threads that each memcpy the (N−1)/N of the buffer they
//! receive, concurrently — what a zero-overhead engine would take.
//! The MPI engine has its own bandwidth example (`mpi_bandwidth`, run under `mpirun`).

use std::hint::black_box;
use std::time::Instant;

use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::{Collective, ReduceOp};

const MIB: usize = 1 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn reps(bytes: usize) -> usize {
    (512 * MIB / bytes).clamp(3, 20)
}

/// Seconds of one `copy_from_slice` of `bytes`.
fn memcpy_secs(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    median(
        (0..reps(bytes))
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Seconds for `ranks` threads to each copy `bytes` at once (slowest thread, median of reps).
fn parallel_copy_secs(ranks: usize, bytes: usize) -> f64 {
    let barrier = std::sync::Barrier::new(ranks);
    let times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|_| {
                s.spawn(|| {
                    let src = vec![1u8; bytes];
                    let mut dst = vec![2u8; bytes];
                    (0..reps(bytes))
                        .map(|_| {
                            barrier.wait();
                            let t = Instant::now();
                            dst.copy_from_slice(black_box(&src));
                            black_box(&mut dst);
                            t.elapsed().as_secs_f64()
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    median(
        (0..times[0].len())
            .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
            .collect(),
    )
}

#[derive(Clone, Copy)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// Median seconds of `op` on a buffer of `bytes` (f32) over `ranks` threads; rank 0's clock,
/// with a barrier before each rep.
fn collective_secs(op: Op, ranks: usize, bytes: usize) -> f64 {
    let n = bytes / 4;
    let times = ThreadsWorld::run(ranks, ThreadsConfig::default(), |comm| {
        let mut buf = vec![1f32; n];
        let mut out = vec![2f32; n / ranks];
        let mut times = Vec::new();
        for _ in 0..reps(bytes) {
            comm.barrier().unwrap();
            let t = Instant::now();
            match op {
                Op::AllGather => comm.all_gather_in_place(&mut buf).unwrap(),
                Op::ReduceScatter => comm.reduce_scatter(&buf, &mut out, ReduceOp::Sum).unwrap(),
                Op::AllReduce => comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap(),
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times
    })
    .unwrap();
    median(times.into_iter().next().unwrap().unwrap())
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("threads engine, {cores} cores; GB/s = 1e9 bytes/s; ratio = busbw / memcpy");
    println!(
        "{:>5} {:>6} {:>8} | {:>10} {:>6} {:>8} | {:>10} {:>6} | {:>10} {:>6}",
        "ranks",
        "MiB",
        "memcpy",
        "all_gather",
        "ratio",
        "vs ideal",
        "reduce_sc",
        "ratio",
        "all_reduce",
        "ratio"
    );
    for ranks in [2, 4] {
        for mib in [1, 4, 16, 64, 256] {
            let bytes = mib * MIB;
            let copy = bytes as f64 / memcpy_secs(bytes) / 1e9;
            let f = (ranks - 1) as f64 / ranks as f64;
            let busbw =
                |op, factor: f64| bytes as f64 / collective_secs(op, ranks, bytes) / 1e9 * factor;
            let ag_secs = collective_secs(Op::AllGather, ranks, bytes);
            let ag = bytes as f64 / ag_secs / 1e9 * f;
            let ideal = parallel_copy_secs(ranks, bytes / ranks * (ranks - 1)) / ag_secs;
            let rs = busbw(Op::ReduceScatter, f);
            let ar = busbw(Op::AllReduce, 2.0 * f);
            println!(
                "{:>5} {:>6} {:>8.2} | {:>10.2} {:>6.2} {:>8.2} | {:>10.2} {:>6.2} | {:>10.2} {:>6.2}",
                ranks,
                mib,
                copy,
                ag,
                ag / copy,
                ideal,
                rs,
                rs / copy,
                ar,
                ar / copy
            );
        }
    }
}
