//! Conformance and timing of the NCCL engine on the GPUs of one machine.
//!
//! ```text
//! cargo run --release -p sshsdp-comm --features nccl --example nccl_conformance -- [WORLD]
//! ```
//!
//! `WORLD` ranks (default: the number of visible GPUs) run as threads of this process, rank
//! `r` on GPU `r % GPUs`. Each rank runs the crate's conformance suite on the host-slice path,
//! then device-path checks (in-place and out-of-place all-gather, reduce-scatter, all-reduce,
//! broadcast on f32, bf16 and u8 device buffers, against values computed on the host), and
//! times all-gather, reduce-scatter and all-reduce on 64 MiB and 256 MiB device buffers next to
//! a device-to-device copy of the same bytes.
//!
//! Exit status: 0 when every check passes, 1 when one fails, 2 when the engine is unavailable
//! here (no libcuda, no GPU or no libnccl; see `sshsdp_comm::nccl` for the `libnccl.so`
//! symlink NCCL needs).

use std::process::ExitCode;
use std::time::Instant;

use half::bf16;
use sshsdp_comm::conformance::{self, Outcome};
use sshsdp_comm::nccl::{self, Bf16Bits, CudaSlice, DeviceElement, NcclComm};
use sshsdp_comm::{Collective, CommResult, ReduceOp};

mod faults;
use faults::fault_checks;

/// Test input `i` of rank `rank`: a small integer, exact in every element type.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 23) as f32
}

/// Conversions between test values and device elements.
trait TestElem: DeviceElement + std::fmt::Debug + PartialEq {
    const NAME: &'static str;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    /// Sum of ranks' values as the device computes it (`u8` wraps modulo 256).
    fn sum(values: impl Iterator<Item = f32>) -> Self;
    /// Whether `got` is close enough to `want` (float rounding of NCCL's own reductions).
    fn close(got: Self, want: f64) -> bool;
}

impl TestElem for f32 {
    const NAME: &'static str = "f32";
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn sum(values: impl Iterator<Item = f32>) -> Self {
        values.sum()
    }
    fn close(got: Self, want: f64) -> bool {
        (got as f64 - want).abs() <= 1e-6 * want.abs().max(1.0)
    }
}

impl TestElem for Bf16Bits {
    const NAME: &'static str = "bf16";
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x).into()
    }
    fn to_f64(self) -> f64 {
        bf16::from(self).to_f64()
    }
    fn sum(values: impl Iterator<Item = f32>) -> Self {
        Self::from_f32(values.sum())
    }
    fn close(got: Self, want: f64) -> bool {
        (got.to_f64() - want).abs() <= want.abs().max(1.0) / 64.0
    }
}

impl TestElem for u8 {
    const NAME: &'static str = "u8";
    fn from_f32(x: f32) -> Self {
        x as u8
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn sum(values: impl Iterator<Item = f32>) -> Self {
        values.fold(0u8, |a, x| a.wrapping_add(x as u8))
    }
    fn close(got: Self, want: f64) -> bool {
        got as f64 == want
    }
}

fn host<T: TestElem>(rank: usize, offset: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(value(rank, offset + i)))
        .collect()
}

fn upload<T: TestElem>(c: &NcclComm, v: &[T]) -> CommResult<CudaSlice<T>> {
    c.stream()
        .clone_htod(v)
        .map_err(|e| sshsdp_comm::CommError::Engine(format!("copy to device: {e}")))
}

fn zeros<T: TestElem>(c: &NcclComm, len: usize) -> CommResult<CudaSlice<T>> {
    c.stream()
        .alloc_zeros(len)
        .map_err(|e| sshsdp_comm::CommError::Engine(format!("device alloc: {e}")))
}

fn download<T: TestElem>(c: &NcclComm, d: &CudaSlice<T>) -> CommResult<Vec<T>> {
    let v = c
        .stream()
        .clone_dtoh(d)
        .map_err(|e| sshsdp_comm::CommError::Engine(format!("copy to host: {e}")))?;
    c.synchronize()?;
    Ok(v)
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// Expected reduction of element `offset + i` over all ranks.
fn want<T: TestElem>(size: usize, offset: usize, i: usize, op: ReduceOp) -> f64 {
    let sum = T::sum((0..size).map(|r| value(r, offset + i))).to_f64();
    match op {
        ReduceOp::Sum => sum,
        ReduceOp::Avg => sum / size as f64,
    }
}

fn check_reduced<T: TestElem>(
    what: &str,
    got: &[T],
    size: usize,
    offset: usize,
    op: ReduceOp,
) -> Outcome {
    for (i, &g) in got.iter().enumerate() {
        let w = want::<T>(size, offset, i, op);
        ensure!(T::close(g, w), "{what} {op:?} [{i}]: {g:?} != {w}");
    }
    Ok(())
}

const N: usize = (1 << 20) + 3;

fn dev_all_gather<T: TestElem>(c: &NcclComm) -> Outcome {
    let (rank, size) = (c.rank(), c.size());
    let e = |e: sshsdp_comm::CommError| e.to_string();
    let mut full = vec![T::from_f32(0.0); N * size];
    full[rank * N..(rank + 1) * N].copy_from_slice(&host::<T>(rank, 0, N));
    let mut buf = upload(c, &full).map_err(e)?;
    c.all_gather_in_place_dev(&mut buf).map_err(e)?;
    let got = download(c, &buf).map_err(e)?;
    let send = upload(c, &host::<T>(rank, 0, N)).map_err(e)?;
    let mut recv = zeros::<T>(c, N * size).map_err(e)?;
    c.all_gather_dev(&send, &mut recv).map_err(e)?;
    let out = download(c, &recv).map_err(e)?;
    for q in 0..size {
        let w = host::<T>(q, 0, N);
        ensure!(got[q * N..(q + 1) * N] == w[..], "in-place chunk {q} wrong");
        ensure!(
            out[q * N..(q + 1) * N] == w[..],
            "out-of-place chunk {q} wrong"
        );
    }
    Ok(())
}

/// The device path sums only (the runtime divides once afterwards; `ncclAvg` is not used:
/// docs/H200.md): `Sum` is checked, and `Avg` must be an argument error, never a launch.
fn ops<T: TestElem>() -> Vec<ReduceOp> {
    vec![ReduceOp::Sum]
}

fn dev_avg_is_refused<T: TestElem>(c: &NcclComm) -> Outcome {
    let e = |e: sshsdp_comm::CommError| e.to_string();
    let send = upload(c, &host::<T>(c.rank(), 0, N * c.size())).map_err(e)?;
    let mut recv = zeros::<T>(c, N).map_err(e)?;
    match c.reduce_scatter_dev(&send, &mut recv, ReduceOp::Avg) {
        Err(sshsdp_comm::CommError::InvalidArgument(_)) => {}
        other => {
            return Err(format!(
                "reduce_scatter_dev with Avg: {other:?}, not refused"
            ))
        }
    }
    let mut buf = upload(c, &host::<T>(c.rank(), 0, N)).map_err(e)?;
    match c.all_reduce_dev(&mut buf, ReduceOp::Avg) {
        Err(sshsdp_comm::CommError::InvalidArgument(_)) => Ok(()),
        other => Err(format!("all_reduce_dev with Avg: {other:?}, not refused")),
    }
}

fn dev_reduce_scatter<T: TestElem>(c: &NcclComm) -> Outcome {
    let (rank, size) = (c.rank(), c.size());
    let e = |e: sshsdp_comm::CommError| e.to_string();
    for op in ops::<T>() {
        let send = upload(c, &host::<T>(rank, 0, N * size)).map_err(e)?;
        let mut recv = zeros::<T>(c, N).map_err(e)?;
        c.reduce_scatter_dev(&send, &mut recv, op).map_err(e)?;
        let got = download(c, &recv).map_err(e)?;
        check_reduced("reduce_scatter_dev", &got, size, rank * N, op)?;
        let mut buf = upload(c, &host::<T>(rank, 0, N * size)).map_err(e)?;
        c.reduce_scatter_in_place_dev(&mut buf, op).map_err(e)?;
        let got = download(c, &buf).map_err(e)?;
        check_reduced(
            "reduce_scatter_in_place_dev",
            &got[rank * N..(rank + 1) * N],
            size,
            rank * N,
            op,
        )?;
    }
    Ok(())
}

fn dev_all_reduce<T: TestElem>(c: &NcclComm) -> Outcome {
    let e = |e: sshsdp_comm::CommError| e.to_string();
    for op in ops::<T>() {
        let mut buf = upload(c, &host::<T>(c.rank(), 0, N)).map_err(e)?;
        c.all_reduce_dev(&mut buf, op).map_err(e)?;
        let got = download(c, &buf).map_err(e)?;
        check_reduced("all_reduce_dev", &got, c.size(), 0, op)?;
    }
    Ok(())
}

fn dev_broadcast<T: TestElem>(c: &NcclComm) -> Outcome {
    let e = |e: sshsdp_comm::CommError| e.to_string();
    for root in 0..c.size() {
        let mut buf = upload(c, &host::<T>(c.rank(), 0, N)).map_err(e)?;
        c.broadcast_dev(&mut buf, root).map_err(e)?;
        let got = download(c, &buf).map_err(e)?;
        ensure!(got == host::<T>(root, 0, N), "broadcast_dev from {root}");
    }
    Ok(())
}

/// The raw-address path ([`Collective::device`], what the SS-HSDP runtime calls on CubeCL's
/// buffers): all-gather, reduce-scatter and all-reduce on addresses of cudarc buffers.
fn dev_raw<T: TestElem>(c: &NcclComm) -> Outcome {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let (rank, size) = (c.rank(), c.size());
    let e = |e: sshsdp_comm::CommError| e.to_string();
    let raw = Collective::device(c).ok_or("NcclComm offers no raw device collectives")?;
    ensure!(
        raw.device_ordinal() == c.device(),
        "raw path on GPU {}, communicator on GPU {}",
        raw.device_ordinal(),
        c.device()
    );
    let stream = c.stream().clone();
    // All-gather.
    let send = upload(c, &host::<T>(rank, 0, N)).map_err(e)?;
    let mut recv = zeros::<T>(c, N * size).map_err(e)?;
    c.synchronize().map_err(e)?;
    {
        let (s, _r) = send.device_ptr(&stream);
        let (d, _w) = recv.device_ptr_mut(&stream);
        // SAFETY: live cudarc allocations of N and N·size elements on the communicator's GPU,
        // their uploads and zeroing finished (synchronize above); distinct buffers.
        unsafe { raw.all_gather_raw(T::KIND, s, d, N) }.map_err(e)?;
    }
    let out = download(c, &recv).map_err(e)?;
    for q in 0..size {
        ensure!(
            out[q * N..(q + 1) * N] == host::<T>(q, 0, N)[..],
            "raw all-gather chunk {q} wrong"
        );
    }
    for op in ops::<T>() {
        // Reduce-scatter.
        let send = upload(c, &host::<T>(rank, 0, N * size)).map_err(e)?;
        let mut recv = zeros::<T>(c, N).map_err(e)?;
        c.synchronize().map_err(e)?;
        {
            let (s, _r) = send.device_ptr(&stream);
            let (d, _w) = recv.device_ptr_mut(&stream);
            // SAFETY: as above, N·size and N elements.
            unsafe { raw.reduce_scatter_raw(T::KIND, s, d, N, op) }.map_err(e)?;
        }
        let got = download(c, &recv).map_err(e)?;
        check_reduced("raw reduce-scatter", &got, size, rank * N, op)?;
        // All-reduce.
        let mut buf = upload(c, &host::<T>(rank, 0, N)).map_err(e)?;
        c.synchronize().map_err(e)?;
        {
            let (b, _w) = buf.device_ptr_mut(&stream);
            // SAFETY: as above, N elements, in place.
            unsafe { raw.all_reduce_raw(T::KIND, b, N, op) }.map_err(e)?;
        }
        let got = download(c, &buf).map_err(e)?;
        check_reduced("raw all-reduce", &got, size, 0, op)?;
    }
    Ok(())
}

fn device_checks_typed<T: TestElem>(c: &NcclComm, out: &mut Vec<(String, Outcome)>) {
    out.push((format!("raw-address {}", T::NAME), dev_raw::<T>(c)));
    out.push((
        format!("dev all_gather {}", T::NAME),
        dev_all_gather::<T>(c),
    ));
    out.push((
        format!("dev reduce_scatter {}", T::NAME),
        dev_reduce_scatter::<T>(c),
    ));
    out.push((
        format!("dev all_reduce {}", T::NAME),
        dev_all_reduce::<T>(c),
    ));
    out.push((format!("dev broadcast {}", T::NAME), dev_broadcast::<T>(c)));
    out.push((
        format!("dev Avg refused {}", T::NAME),
        dev_avg_is_refused::<T>(c),
    ));
}

/// One row of the timing table: operation, bytes, seconds per call.
struct Timing {
    op: &'static str,
    bytes: usize,
    secs: f64,
}

fn time_call(c: &NcclComm, iters: usize, mut f: impl FnMut() -> CommResult<()>) -> CommResult<f64> {
    for _ in 0..2 {
        f()?;
    }
    c.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    c.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn timings(c: &NcclComm) -> CommResult<Vec<Timing>> {
    let engine =
        |e: cudarc::driver::DriverError| sshsdp_comm::CommError::Engine(format!("CUDA: {e}"));
    let mut rows = Vec::new();
    for mib in [64usize, 256] {
        let bytes = mib << 20;
        let n = bytes / 4;
        let n = n - n % c.size();
        let s = c.stream();
        let mut buf = s.alloc_zeros::<f32>(n).map_err(engine)?;
        let mut other = s.alloc_zeros::<f32>(n).map_err(engine)?;
        let mut part = s.alloc_zeros::<f32>(n / c.size()).map_err(engine)?;
        let iters = 10;
        let secs = time_call(c, iters, || c.all_gather_in_place_dev(&mut buf))?;
        rows.push(Timing {
            op: "all_gather",
            bytes: n * 4,
            secs,
        });
        let secs = time_call(c, iters, || {
            c.reduce_scatter_dev(&buf, &mut part, ReduceOp::Sum)
        })?;
        rows.push(Timing {
            op: "reduce_scatter",
            bytes: n * 4,
            secs,
        });
        let secs = time_call(c, iters, || c.all_reduce_dev(&mut buf, ReduceOp::Sum))?;
        rows.push(Timing {
            op: "all_reduce",
            bytes: n * 4,
            secs,
        });
        let secs = time_call(c, iters, || s.memcpy_dtod(&buf, &mut other).map_err(engine))?;
        rows.push(Timing {
            op: "memcpy dtod",
            bytes: n * 4,
            secs,
        });
    }
    Ok(rows)
}

struct RankReport {
    checks: Vec<(String, Outcome)>,
    timings: CommResult<Vec<Timing>>,
}

/// Prints `checks` (and rank 0's timings) at once, so that they are on record before the fault
/// checks, which abort the communicator and may misbehave on a broken driver.
fn print_so_far(rank: usize, checks: &[(String, Outcome)], timings: &CommResult<Vec<Timing>>) {
    use std::io::Write;
    for (name, outcome) in checks {
        match outcome {
            Ok(()) => println!("rank {rank}: {name:<32} ok"),
            Err(why) => println!("rank {rank}: {name:<32} FAILED ({why})"),
        }
    }
    if rank == 0 {
        if let Ok(rows) = timings {
            for t in rows {
                println!(
                    "rank 0: {:<16} {:>6} MiB {:>10.3} ms {:>8.1} GB/s",
                    t.op,
                    t.bytes >> 20,
                    t.secs * 1e3,
                    t.bytes as f64 / t.secs / 1e9
                );
            }
        }
    }
    let _ = std::io::stdout().flush();
}

fn run_rank(c: NcclComm) -> RankReport {
    let mut checks: Vec<(String, Outcome)> = conformance::run_all(&c)
        .into_iter()
        .map(|(name, o)| (name.to_string(), o))
        .collect();
    device_checks_typed::<f32>(&c, &mut checks);
    device_checks_typed::<Bf16Bits>(&c, &mut checks);
    device_checks_typed::<u8>(&c, &mut checks);
    let timings = timings(&c);
    print_so_far(c.rank(), &checks, &timings);
    fault_checks(c, &mut checks);
    RankReport { checks, timings }
}

fn main() -> ExitCode {
    if let Err(e) = nccl::probe() {
        println!("nccl_conformance: the NCCL engine is unavailable here: {e}");
        println!("(exit status 2 = unavailable, distinct from 1 = a check failed)");
        return ExitCode::from(2);
    }
    let gpus = nccl::device_count().unwrap_or(1).max(1);
    let world = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => gpus,
        Some(Ok(w)) if w > 0 => w,
        Some(_) => {
            eprintln!("usage: nccl_conformance [WORLD_SIZE > 0]");
            return ExitCode::from(1);
        }
    };
    let version = nccl::nccl_version().unwrap_or(0);
    println!(
        "NCCL {}.{}.{} ({version}), {gpus} GPU(s), world of {world} rank(s)",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let devices: Vec<usize> = (0..world).map(|r| r % gpus).collect();
    let reports = match NcclComm::run_threads(&devices, run_rank) {
        Ok(r) => r,
        Err(e) => {
            println!("could not start the world: {e}");
            return ExitCode::from(1);
        }
    };

    let mut failed = false;
    let mut table: Vec<(String, Vec<String>)> = Vec::new();
    for (rank, report) in reports.iter().enumerate() {
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                println!("rank {rank}: {e}");
                failed = true;
                continue;
            }
        };
        for (name, outcome) in &report.checks {
            let idx = match table.iter().position(|(n, _)| n == name) {
                Some(i) => i,
                None => {
                    table.push((name.clone(), Vec::new()));
                    table.len() - 1
                }
            };
            if let Err(why) = outcome {
                table[idx].1.push(format!("rank {rank}: {why}"));
                failed = true;
            }
        }
    }
    println!("\n{:<32} result", "check");
    println!("{:-<32} ------", "");
    for (name, errs) in &table {
        match errs.first() {
            None => println!("{name:<32} ok"),
            Some(first) => println!("{name:<32} FAILED ({first})"),
        }
    }

    if let Some(Ok(r0)) = reports.first() {
        match &r0.timings {
            Ok(rows) => {
                println!("\ntimings on rank 0 (world of {world}; algbw = bytes / time)");
                println!(
                    "{:<16} {:>10} {:>12} {:>12}",
                    "op", "MiB", "time ms", "algbw GB/s"
                );
                for t in rows {
                    println!(
                        "{:<16} {:>10} {:>12.3} {:>12.1}",
                        t.op,
                        t.bytes >> 20,
                        t.secs * 1e3,
                        t.bytes as f64 / t.secs / 1e9
                    );
                }
            }
            Err(e) => {
                println!("timings failed: {e}");
                failed = true;
            }
        }
    }
    if failed {
        println!("\nnccl_conformance: FAILED");
        ExitCode::from(1)
    } else {
        println!("\nnccl_conformance: all checks passed");
        ExitCode::SUCCESS
    }
}
