//! Bus bandwidth of the MPI engine against raw rsmpi calls of the same size, plus the
//! reduce-scatter paths the engine chooses between and a memcpy reference.
//!
//! ```text
//! cargo build --release -p sshsdp-comm --features mpi --example mpi_bandwidth
//! mpirun --allow-run-as-root --oversubscribe -n 2 target/release/examples/mpi_bandwidth
//! ```
//!
//! Conventions (NCCL's): `bytes` is the full buffer (all-gather: the gathered `recv`;
//! reduce-scatter: `send`; all-reduce: the buffer), `algbw = bytes / time`, and
//! `busbw = algbw · (n−1)/n` for all-gather and reduce-scatter, `algbw · 2(n−1)/n` for
//! all-reduce. A time is the slowest rank's, the median over the repetitions, each repetition
//! after a barrier. Elements are `f32`. "raw" is rsmpi's safe API on the same communicator
//! (out of place: rsmpi has no `MPI_IN_PLACE`); "ours" is [`Collective`] (all-gather and
//! all-reduce in place). Optional arguments: sizes in MiB, or KiB with a `K` suffix
//! (default `1 4 16 64 256`).

use std::hint::black_box;
use std::time::Instant;

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::ffi;
use mpi::raw::AsRaw;
use sshsdp_comm::mpi::{MpiComm, MpiSession};
use sshsdp_comm::{Collective, ReduceOp};

const MIB: usize = 1 << 20;

/// Median over repetitions of the slowest rank's seconds for `f`, barrier before each.
fn time(comm: &MpiComm, bytes: usize, mut f: impl FnMut()) -> f64 {
    let reps = (256 * MIB / bytes.max(1)).clamp(5, 20);
    f(); // warm-up: page faults, connection set-up
    let mut local = Vec::with_capacity(reps);
    for _ in 0..reps {
        comm.barrier().expect("barrier");
        let t = Instant::now();
        f();
        local.push(t.elapsed().as_secs_f64());
    }
    let mut slowest = vec![0f64; reps];
    comm.communicator()
        .all_reduce_into(&local[..], &mut slowest[..], SystemOperation::max());
    slowest.sort_by(f64::total_cmp);
    slowest[reps / 2]
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let mpi = MpiSession::init().expect("MPI init");
    let comm = mpi.world().expect("MPI world");
    let (rank, n) = (comm.rank(), comm.size());
    let raw = comm.communicator();
    let sizes: Vec<usize> = {
        let args: Vec<usize> = std::env::args()
            .skip(1)
            .map(|a| match a.strip_suffix('K') {
                Some(kib) => kib.parse::<usize>().expect("size in KiB") << 10,
                None => a.parse::<usize>().expect("size in MiB") * MIB,
            })
            .collect();
        if args.is_empty() {
            [1, 4, 16, 64, 256].map(|m| m * MIB).to_vec()
        } else {
            args
        }
    };
    let bus_ag = (n - 1) as f64 / n as f64;
    let bus_ar = 2.0 * bus_ag;
    if rank == 0 {
        println!(
            "{n} ranks, f32, reduce_scatter policy {:?}",
            comm.reduce_scatter_policy()
        );
        println!(
            "{:<15} {:>8} {:>10} {:>12} {:>12} {:>7} {:>12}",
            "op", "MiB", "ours ms", "ours busbw", "raw busbw", "ratio", "memcpy GB/s"
        );
    }
    let mut rs_rows = Vec::new();
    for &bytes in &sizes {
        let mib = bytes as f64 / MIB as f64;
        let total = bytes / 4 / n * n; // f32 elements, a multiple of n
        let chunk = total / n;
        let bytes = total * 4;
        let src: Vec<f32> = (0..total).map(|i| (i % 251) as f32).collect();
        let mut dst = vec![0f32; total];
        let t_copy = time(&comm, bytes, || {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        });
        let memcpy = gbps(bytes, t_copy);

        // all_gather: ours in place, raw out of place (send = one chunk).
        let mut buf = src.clone();
        let t_ours = time(&comm, bytes, || {
            comm.all_gather_in_place(&mut buf).expect("all_gather")
        });
        let send = src[..chunk].to_vec();
        let t_raw = time(&comm, bytes, || {
            raw.all_gather_into(&send[..], &mut dst[..])
        });
        let mut rows = vec![("all_gather", t_ours, t_raw, bus_ag)];

        // reduce_scatter: ours (threshold path), raw MPI_Reduce_scatter_block; plus the paths.
        let mut recv = vec![0f32; chunk];
        let t_ours = time(&comm, bytes, || {
            comm.reduce_scatter(&src, &mut recv, ReduceOp::Sum)
                .expect("reduce_scatter")
        });
        let t_raw = time(&comm, bytes, || {
            raw.reduce_scatter_block_into(&src[..], &mut recv[..], SystemOperation::sum())
        });
        rows.push(("reduce_scatter", t_ours, t_raw, bus_ag));
        let counts = vec![i32::try_from(chunk).expect("chunk fits an int"); n];
        let t_rsv = time(&comm, bytes, || {
            // SAFETY: `src` holds n · chunk f32s, `recv` chunk f32s, `counts` n ints.
            unsafe {
                ffi::MPI_Reduce_scatter(
                    src.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    raw.as_raw(),
                );
            }
        });
        // All-reduce out of place into a scratch buffer kept across calls, then our chunk.
        let mut scratch = vec![0f32; total];
        let t_ar_path = time(&comm, bytes, || {
            raw.all_reduce_into(&src[..], &mut scratch[..], SystemOperation::sum());
            recv.copy_from_slice(&scratch[rank * chunk..(rank + 1) * chunk]);
        });
        drop(scratch);
        rs_rows.push((mib, t_raw, t_rsv, t_ar_path));

        // all_reduce: ours in place, raw out of place.
        let t_ours = time(&comm, bytes, || {
            comm.all_reduce(&mut buf, ReduceOp::Sum)
                .expect("all_reduce")
        });
        let t_raw = time(&comm, bytes, || {
            raw.all_reduce_into(&src[..], &mut dst[..], SystemOperation::sum())
        });
        rows.push(("all_reduce", t_ours, t_raw, bus_ar));

        if rank == 0 {
            for (op, ours, raw_t, factor) in rows {
                let (b_ours, b_raw) = (gbps(bytes, ours) * factor, gbps(bytes, raw_t) * factor);
                println!(
                    "{op:<15} {mib:>8.2} {:>10.2} {:>12.2} {:>12.2} {:>7.2} {:>12.2}",
                    ours * 1e3,
                    b_ours,
                    b_raw,
                    b_ours / b_raw,
                    memcpy
                );
            }
        }
    }
    if rank == 0 {
        println!();
        println!("reduce_scatter paths (ms; send size in MiB)");
        println!(
            "{:>8} {:>22} {:>20} {:>20}",
            "MiB", "Reduce_scatter_block", "Reduce_scatter", "Allreduce->scratch"
        );
        for (mib, block, rsv, ar) in rs_rows {
            println!(
                "{mib:>8.2} {:>22.2} {:>20.2} {:>20.2}",
                block * 1e3,
                rsv * 1e3,
                ar * 1e3
            );
        }
    }
}
