//! The conformance suite: the same checks for every engine. Expected values are computed from
//! the inputs (which every rank can recompute for every peer), never taken from another engine.
//!
//! Run [`run_all`] on every rank of a world of any size; it returns one outcome per check.
//! Engines call it from their tests (threads) or from a binary launched under `mpirun`.

use half::bf16;

use crate::hierarchy::{self, MeshComms};
use crate::{CallTag, Collective, CommError, Element, ReduceOp, Reducible};

/// Outcome of one check on this rank.
pub type Outcome = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// Input element `i` of rank `rank`: a small integer, exact in f32 and bf16 and in their sums.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 23) as f32
}

fn data<T: FromF32>(rank: usize, offset: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(value(rank, offset + i)))
        .collect()
}

/// Conversion used to build inputs of every element type.
pub trait FromF32: Element {
    /// Converts an exact small integer.
    fn from_f32(x: f32) -> Self;
}

impl FromF32 for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl FromF32 for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl FromF32 for u8 {
    fn from_f32(x: f32) -> Self {
        x as u8
    }
}

/// The sum over ranks of element `i` (offset `offset`), scaled like `op`.
fn expected_reduce<T: Reducible + FromF32>(
    size: usize,
    offset: usize,
    i: usize,
    op: ReduceOp,
) -> T {
    let sum: f32 = (0..size).map(|r| value(r, offset + i)).sum();
    T::from_acc(sum * op.scale(size))
}

fn close<T: Reducible>(got: T, want: T) -> bool {
    let (g, w) = (got.to_acc(), want.to_acc());
    (g - w).abs() <= 1e-6 * w.abs().max(1.0) || got == want
}

const SIZES: [usize; 5] = [0, 1, 3, 1000, 1 << 20];

fn all_gather_typed<C: Collective, T: FromF32>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    for n in SIZES {
        let mut buf = vec![T::default(); n * size];
        buf[rank * n..(rank + 1) * n].copy_from_slice(&data::<T>(rank, 0, n));
        comm.all_gather_in_place(&mut buf)
            .map_err(|e| e.to_string())?;
        let mut out = vec![T::default(); n * size];
        comm.all_gather(&data::<T>(rank, 0, n), &mut out)
            .map_err(|e| e.to_string())?;
        for q in 0..size {
            let want = data::<T>(q, 0, n);
            ensure!(
                buf[q * n..(q + 1) * n] == want[..],
                "in-place all_gather n={n}: chunk {q} wrong"
            );
            ensure!(
                out[q * n..(q + 1) * n] == want[..],
                "all_gather n={n}: chunk {q} wrong"
            );
        }
    }
    Ok(())
}

/// All-gather of f32, bf16 and u8, in place and out of place, empty to 4 MiB chunks.
pub fn all_gather<C: Collective>(comm: &C) -> Outcome {
    all_gather_typed::<C, f32>(comm)?;
    all_gather_typed::<C, bf16>(comm)?;
    all_gather_typed::<C, u8>(comm)
}

fn reduce_scatter_typed<C: Collective, T: Reducible + FromF32>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    for n in SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let send = data::<T>(rank, 0, n * size);
            let mut recv = vec![T::default(); n];
            comm.reduce_scatter(&send, &mut recv, op)
                .map_err(|e| e.to_string())?;
            for (i, &got) in recv.iter().enumerate() {
                let want = expected_reduce::<T>(size, rank * n, i, op);
                ensure!(
                    close(got, want),
                    "reduce_scatter {op:?} n={n} [{i}]: {got:?} != {want:?}"
                );
            }
        }
    }
    Ok(())
}

/// Reduce-scatter (sum and average) of f32 and bf16.
pub fn reduce_scatter<C: Collective>(comm: &C) -> Outcome {
    reduce_scatter_typed::<C, f32>(comm)?;
    reduce_scatter_typed::<C, bf16>(comm)
}

fn all_reduce_typed<C: Collective, T: Reducible + FromF32>(comm: &C) -> Outcome {
    let rank = comm.rank();
    // Lengths below, at and off multiples of the world size.
    for n in [0, 1, 2, 5, 7, 1001, 1 << 20] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut buf = data::<T>(rank, 0, n);
            comm.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
            for (i, &got) in buf.iter().enumerate() {
                let want = expected_reduce::<T>(comm.size(), 0, i, op);
                ensure!(
                    close(got, want),
                    "all_reduce {op:?} n={n} [{i}]: {got:?} != {want:?}"
                );
            }
        }
    }
    Ok(())
}

/// All-reduce (sum and average) of f32 and bf16, including fewer elements than ranks.
pub fn all_reduce<C: Collective>(comm: &C) -> Outcome {
    all_reduce_typed::<C, f32>(comm)?;
    all_reduce_typed::<C, bf16>(comm)
}

/// Broadcast from every root, of f32 and u8.
pub fn broadcast<C: Collective>(comm: &C) -> Outcome {
    for root in 0..comm.size() {
        for n in [0, 1, 4097] {
            let mut f = data::<f32>(comm.rank(), 0, n);
            comm.broadcast(&mut f, root).map_err(|e| e.to_string())?;
            ensure!(
                f == data::<f32>(root, 0, n),
                "broadcast f32 from {root} n={n}"
            );
            let mut b = data::<u8>(comm.rank(), 0, n);
            comm.broadcast(&mut b, root).map_err(|e| e.to_string())?;
            ensure!(
                b == data::<u8>(root, 0, n),
                "broadcast u8 from {root} n={n}"
            );
        }
    }
    comm.barrier().map_err(|e| e.to_string())
}

/// Bad arguments are errors on the rank that made them, not panics or hangs.
pub fn bad_arguments<C: Collective>(comm: &C) -> Outcome {
    let size = comm.size();
    if size > 1 {
        let mut odd = vec![0f32; size + 1];
        ensure!(
            matches!(
                comm.all_gather_in_place(&mut odd),
                Err(CommError::InvalidArgument(_))
            ),
            "all_gather of an uneven buffer must be an argument error"
        );
    }
    let mut recv = [0f32; 2];
    ensure!(
        matches!(
            comm.all_gather(&[1f32], &mut recv[..1 + usize::from(size == 1)]),
            Err(CommError::InvalidArgument(_))
        ),
        "all_gather into a wrong-size buffer must be an argument error"
    );
    ensure!(
        matches!(
            comm.reduce_scatter(&[1f32; 3], &mut [0f32; 2], ReduceOp::Sum),
            Err(CommError::InvalidArgument(_))
        ),
        "reduce_scatter with wrong sizes must be an argument error"
    );
    ensure!(
        matches!(
            comm.broadcast(&mut [0u8; 4], size),
            Err(CommError::InvalidArgument(_))
        ),
        "broadcast from a root outside the communicator must be an argument error"
    );
    comm.barrier().map_err(|e| e.to_string())
}

/// How many elements rank `a` sends rank `b` in the all-to-all-v checks: uneven, with empty
/// chunks (every third pair, and a rank's chunk to itself when `a` is odd).
fn a2a_count(a: usize, b: usize, scale: usize) -> usize {
    if (a + 2 * b) % 3 == 0 || (a == b && a % 2 == 1) {
        0
    } else {
        (1 + (a * 5 + b * 3) % 7) * scale
    }
}

fn all_to_all_v_typed<C: Collective, T: FromF32>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    for scale in [1, 1000] {
        let send_counts: Vec<usize> = (0..size).map(|b| a2a_count(rank, b, scale)).collect();
        let recv_counts: Vec<usize> = (0..size).map(|a| a2a_count(a, rank, scale)).collect();
        // Chunk for rank b starts at element offset b · 10⁶ of this rank's value stream.
        let send: Vec<T> = (0..size)
            .flat_map(|b| data::<T>(rank, b * 1_000_000, send_counts[b]))
            .collect();
        let mut recv = vec![T::default(); recv_counts.iter().sum()];
        comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
            .map_err(|e| e.to_string())?;
        let mut at = 0;
        for (a, &n) in recv_counts.iter().enumerate() {
            ensure!(
                recv[at..at + n] == data::<T>(a, rank * 1_000_000, n)[..],
                "all_to_all_v ({}, scale {scale}): chunk from rank {a} differs",
                std::any::type_name::<T>()
            );
            at += n;
        }
    }
    Ok(())
}

/// All-to-all with uneven and empty chunks in every element type, on the world and on split
/// halves; counts that do not add up to a buffer are an argument error.
pub fn all_to_all_v<C: Collective>(comm: &C) -> Outcome {
    all_to_all_v_typed::<C, f32>(comm)?;
    all_to_all_v_typed::<C, bf16>(comm)?;
    all_to_all_v_typed::<C, u8>(comm)?;
    let sub = comm
        .split(comm.rank() % 2, comm.rank())
        .map_err(|e| e.to_string())?;
    all_to_all_v_typed::<C, f32>(&sub)?;
    let size = comm.size();
    ensure!(
        matches!(
            comm.all_to_all_v(
                &vec![1f32; size + 1],
                &vec![1; size],
                &mut vec![0f32; size],
                &vec![1; size]
            ),
            Err(CommError::InvalidArgument(_))
        ),
        "all_to_all_v with counts that do not add up to the buffer must be an argument error"
    );
    comm.barrier().map_err(|e| e.to_string())
}

/// Fault check (an engine may fail the communicator's world on it, as MPI does: run it last, on
/// a world of its own): rank 0 sends rank 1 one element more than rank 1 expects; every rank
/// gets [`CommError::Mismatch`] (or [`CommError::PeerFailed`] carrying it), with no data moved.
/// A world of one rank has nobody to disagree with.
pub fn mismatched_counts<C: Collective>(comm: &C) -> Outcome {
    let size = comm.size();
    if size < 2 {
        return Ok(());
    }
    let mut send_counts = vec![1usize; size];
    if comm.rank() == 0 {
        send_counts[1] = 2;
    }
    let send = vec![1f32; send_counts.iter().sum()];
    let mut recv = vec![0f32; size];
    match comm.all_to_all_v(&send, &send_counts, &mut recv, &vec![1; size]) {
        Err(CommError::Mismatch(m)) | Err(CommError::PeerFailed(m))
            if m.contains("rank 0 sends 2") =>
        {
            Ok(())
        }
        other => Err(format!(
            "all_to_all_v with disagreeing counts must be a mismatch naming them on every rank, \
             got {other:?}"
        )),
    }
}

/// Sub-communicators: split by parity, run collectives inside each half.
pub fn split<C: Collective>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    // Reverse order inside each color: the key decides the new rank.
    let sub = comm
        .split(rank % 2, size - rank)
        .map_err(|e| e.to_string())?;
    let members: Vec<usize> = (0..size).rev().filter(|r| r % 2 == rank % 2).collect();
    ensure!(
        sub.size() == members.len(),
        "split size {} != {}",
        sub.size(),
        members.len()
    );
    ensure!(
        members[sub.rank()] == rank,
        "split rank {} is not old rank {rank}",
        sub.rank()
    );
    let mut buf = vec![0f32; 3 * sub.size()];
    buf[sub.rank() * 3..sub.rank() * 3 + 3].copy_from_slice(&data::<f32>(rank, 0, 3));
    sub.all_gather_in_place(&mut buf)
        .map_err(|e| e.to_string())?;
    for (q, &old) in members.iter().enumerate() {
        ensure!(
            buf[q * 3..q * 3 + 3] == data::<f32>(old, 0, 3)[..],
            "split all_gather chunk {q}"
        );
    }
    let mut sum = vec![rank as f32];
    sub.all_reduce(&mut sum, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let want: usize = members.iter().sum();
    ensure!(
        sum[0] == want as f32,
        "split all_reduce {} != {want}",
        sum[0]
    );
    Ok(())
}

/// Asynchronous all-gather and reduce-scatter with work done between start and wait.
pub fn asynchronous<C: Collective>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    let n = 1 << 16;
    let mut buf = vec![0f32; n * size];
    buf[rank * n..(rank + 1) * n].copy_from_slice(&data::<f32>(rank, 0, n));
    let gather = comm.start_all_gather(buf).map_err(|e| e.to_string())?;
    let rs = comm
        .start_reduce_scatter(data::<f32>(rank, 0, n * size), vec![0f32; n], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    // A synchronous call while both are in flight.
    let mut x = vec![1f32];
    comm.all_reduce(&mut x, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    ensure!(x[0] == size as f32, "all_reduce beside pending calls");
    let buf = gather.wait().map_err(|e| e.to_string())?;
    for q in 0..size {
        ensure!(
            buf[q * n..(q + 1) * n] == data::<f32>(q, 0, n)[..],
            "async all_gather chunk {q}"
        );
    }
    let (_, recv) = rs.wait().map_err(|e| e.to_string())?;
    for (i, &got) in recv.iter().enumerate() {
        ensure!(
            got == expected_reduce::<f32>(size, rank * n, i, ReduceOp::Sum),
            "async reduce_scatter [{i}]"
        );
    }
    Ok(())
}

/// The HSDP and hierarchical gradient paths and the runtime-shard gather on a
/// `replicas × shards` mesh of this world (skipped when the world does not factor so).
pub fn hierarchical_paths<C: Collective>(comm: &C, replicas: usize, shards: usize) -> Outcome {
    if replicas * shards != comm.size() {
        return Ok(());
    }
    let world = comm.split(0, comm.rank()).map_err(|e| e.to_string())?;
    let rank = world.rank();
    let size = world.size();
    let mesh = MeshComms::new(world, replicas, shards).map_err(|e| e.to_string())?;
    let (replica, shard) = mesh.coords();
    ensure!(
        rank == replica * shards + shard,
        "mesh coordinates of rank {rank}"
    );
    let piece = 5;
    let len = piece * size;
    let grad = data::<f32>(rank, 0, len);
    let want = |i: usize| expected_reduce::<f32>(size, 0, i, ReduceOp::Avg);

    let mut hsdp = vec![0f32; len / shards];
    hierarchy::reduce_gradients_hsdp(&mesh, &grad, &mut hsdp).map_err(|e| e.to_string())?;
    for (i, &got) in hsdp.iter().enumerate() {
        ensure!(
            close(got, want(shard * hsdp.len() + i)),
            "HSDP {replicas}x{shards} [{i}]: {got}"
        );
    }

    let mut scratch = vec![0f32; len / shards];
    let mut mine = vec![0f32; piece];
    hierarchy::reduce_gradients_hierarchical(&mesh, &grad, &mut scratch, &mut mine)
        .map_err(|e| e.to_string())?;
    let p = shard * replicas + replica;
    for (i, &got) in mine.iter().enumerate() {
        ensure!(
            close(got, want(p * piece + i)),
            "hierarchical {replicas}x{shards} piece {p} [{i}]: {got}"
        );
    }

    // Rebuild the runtime shard from the pieces of the replica group.
    let mut shard_buf = vec![0f32; piece * replicas];
    shard_buf[replica * piece..(replica + 1) * piece].copy_from_slice(&mine);
    hierarchy::gather_runtime_shard(&mesh, &mut shard_buf).map_err(|e| e.to_string())?;
    for (i, &got) in shard_buf.iter().enumerate() {
        ensure!(
            close(got, hsdp[i]),
            "runtime shard rebuild [{i}]: {got} != {}",
            hsdp[i]
        );
    }
    Ok(())
}

/// Fault check (fails the communicator's world: run it last, on a world of its own): ranks
/// making the same operation with different [`CallTag`]s (here: different buckets) all get an
/// error naming the difference ([`CommError::Mismatch`], or [`CommError::PeerFailed`] carrying
/// the mismatch where a peer found it first), with no data moved. A world of one rank has
/// nobody to differ from.
pub fn mismatched_tags<C: Collective>(comm: &C) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    comm.set_tag(CallTag::new(7, Some(rank % 2), "gather"));
    let mut buf = vec![1f32; 4];
    let result = comm.all_reduce(&mut buf, ReduceOp::Sum);
    match (size, result) {
        (1, Ok(())) => Ok(()),
        (_, Err(CommError::Mismatch(msg) | CommError::PeerFailed(msg))) => {
            ensure!(
                msg.contains("bucket"),
                "the mismatch does not name the bucket: {msg}"
            );
            ensure!(buf == [1f32; 4], "data moved despite the mismatch");
            Ok(())
        }
        (_, other) => Err(format!("expected a mismatch error, got {other:?}")),
    }
}

/// Fault check (fails the communicator's world: run it last, on a world of its own): the last
/// rank aborts through [`Collective::abort_handle`], then every rank calls an all-reduce, which
/// must be an error on every rank (not a hang). Returns how long this rank's call took.
pub fn abort_fails_every_rank<C: Collective>(comm: &C) -> Result<std::time::Duration, String> {
    let (rank, size) = (comm.rank(), comm.size());
    let Some(abort) = comm.abort_handle() else {
        return Err("the engine offers no abort handle".into());
    };
    if rank == size - 1 {
        abort("injected fault");
    }
    let start = std::time::Instant::now();
    let mut buf = vec![1f32; 4];
    match comm.all_reduce(&mut buf, ReduceOp::Sum) {
        Err(CommError::PeerFailed(_)) => Ok(start.elapsed()),
        other => Err(format!("expected a peer-failed error, got {other:?}")),
    }
}

/// Every check, in a fixed order (all ranks must run the same list), with its name.
pub fn run_all<C: Collective>(comm: &C) -> Vec<(&'static str, Outcome)> {
    let size = comm.size();
    let mut out: Vec<(&'static str, Outcome)> = vec![
        ("all_gather", all_gather(comm)),
        ("reduce_scatter", reduce_scatter(comm)),
        ("all_reduce", all_reduce(comm)),
        ("broadcast", broadcast(comm)),
        ("bad_arguments", bad_arguments(comm)),
        ("split", split(comm)),
        ("all_to_all_v", all_to_all_v(comm)),
        ("asynchronous", asynchronous(comm)),
    ];
    for (r, s, name) in [
        (1, size, "hierarchical 1xN"),
        (size, 1, "hierarchical Nx1"),
        (2, size / 2, "hierarchical 2xN/2"),
    ] {
        if r * s == size && s > 0 {
            out.push((name, hierarchical_paths(comm, r, s)));
        }
    }
    out
}
