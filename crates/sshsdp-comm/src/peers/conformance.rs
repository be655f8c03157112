//! The conformance suite of [`PeerExchange`] executors, as plain functions over any memory
//! ([`PeerMemory`]: host memory in this crate's tests, CubeCL device buffers in the backend's):
//! every [`PeerOp`] on f32, bf16 and (moves only) byte units, with ragged counts, offsets
//! inside a buffer and the in-place variants, checked bit for bit against the rule every engine
//! of this crate follows (sums accumulated in `f32` in rank order, rounded once); and the fault
//! cases (a rank that never arrives, fails or panics mid-call), bounded.

use std::time::{Duration, Instant};

use half::bf16;

use super::{PeerExchange, PeerOp};
use crate::{CommError, CommResult, ElementKind};

/// Where a collective's buffers are: a send and a receive buffer apart, or one buffer in place
/// (NCCL's layout, see [`PeerOp::plan`]), each at a unit offset.
pub enum Spans<'a, B> {
    /// Separate send and receive buffers.
    Apart {
        /// The send buffer and the unit its data starts at.
        send: (&'a B, usize),
        /// The receive buffer and the unit its data starts at.
        recv: (&'a B, usize),
    },
    /// One buffer holding the larger extent from the unit given: all-gather's receive (the
    /// send is chunk `rank` of it), reduce-scatter's send (the receive is chunk `rank`), or the
    /// one buffer of all-reduce and broadcast.
    InPlace(&'a B, usize),
}

/// One rank's memory under test: buffers, and the executor that runs a [`PeerOp`] on them.
pub trait PeerMemory {
    /// A buffer of this memory.
    type Buffer;
    /// A new buffer holding `bytes`.
    fn buffer(&self, bytes: &[u8]) -> CommResult<Self::Buffer>;
    /// Every byte of `buffer`.
    fn read(&self, buffer: &Self::Buffer) -> CommResult<Vec<u8>>;
    /// Runs `op` on `count` units of `kind` over `peers` between `spans`; returns once done.
    fn collective(
        &self,
        peers: &dyn PeerExchange,
        op: PeerOp,
        kind: ElementKind,
        count: usize,
        spans: Spans<'_, Self::Buffer>,
    ) -> CommResult<()>;
}

/// The outcome of one case.
pub type Outcome = Result<(), String>;

/// Byte value of every unit the suite leaves alone.
const SENTINEL: u8 = 0xA5;

/// Units of margin after each region (checked unchanged).
const TAIL: usize = 3;

/// Runs every case on this rank; returns each case's name and outcome.
pub fn run_all<M: PeerMemory>(mem: &M, peers: &dyn PeerExchange) -> Vec<(String, Outcome)> {
    let (rank, size) = (peers.peer_rank(), peers.peer_size());
    let root = size - 1;
    let mut outcomes = Vec::new();
    for which in 0..5 {
        for kind in [ElementKind::F32, ElementKind::Bf16, ElementKind::U8] {
            for count in [0, 1, 37] {
                let sends = ragged(size, count);
                let send = sends[rank].clone();
                let recv: Vec<usize> = sends.iter().map(|s| s[rank]).collect();
                let op = match which {
                    0 => PeerOp::AllGather,
                    1 => PeerOp::ReduceScatter,
                    2 => PeerOp::AllReduce,
                    3 => PeerOp::Broadcast { root },
                    _ => PeerOp::AllToAllV {
                        send: &send,
                        recv: &recv,
                    },
                };
                if op.sums() && kind == ElementKind::U8 {
                    continue;
                }
                let all_to_all = matches!(op, PeerOp::AllToAllV { .. });
                for (in_place, offset) in [(false, 0), (false, 3), (true, 3)] {
                    if in_place && all_to_all {
                        continue;
                    }
                    let name = format!(
                        "{} {kind:?} × {count}{}, {} at unit {offset}",
                        op.name(),
                        if all_to_all { " (ragged)" } else { "" },
                        if in_place { "in place" } else { "apart" }
                    );
                    let case = Case {
                        op,
                        kind,
                        count,
                        in_place,
                        offset,
                    };
                    outcomes.push((name, case.run(mem, peers)));
                }
            }
        }
    }
    outcomes
}

/// The all-to-all-v cases' counts: rank `q` sends rank `p` `count · ((q + 2p) mod 3)` units, so
/// chunks are ragged and some are empty (all of them for `count` 0).
fn ragged(size: usize, count: usize) -> Vec<Vec<usize>> {
    (0..size)
        .map(|q| (0..size).map(|p| count * ((q + 2 * p) % 3)).collect())
        .collect()
}

/// One case of [`run_all`].
struct Case<'a> {
    op: PeerOp<'a>,
    kind: ElementKind,
    count: usize,
    in_place: bool,
    offset: usize,
}

impl Case<'_> {
    fn run<M: PeerMemory>(&self, mem: &M, peers: &dyn PeerExchange) -> Outcome {
        let (rank, size) = (peers.peer_rank(), peers.peer_size());
        let (send_len, recv_len) = self.op.extents(size, self.count);
        let unit = self.kind.bytes();
        let mine = values(self.kind, rank, send_len);
        let expected = self.expected(rank, size);
        let err = |e: CommError| format!("rank {rank}: {e}");
        // (buffer's bytes before, where the receive region starts in bytes)
        let (before, recv_at, read) = if self.in_place {
            let full = send_len.max(recv_len);
            let mut bytes = framed(self.offset, full, unit);
            let mine_at = match self.op {
                PeerOp::AllGather => self.offset + rank * self.count,
                _ => self.offset,
            };
            write_units(&mut bytes, mine_at * unit, &mine);
            let recv_at = match self.op {
                PeerOp::ReduceScatter => self.offset + rank * self.count,
                _ => self.offset,
            };
            let buffer = mem.buffer(&bytes).map_err(err)?;
            let spans = Spans::InPlace(&buffer, self.offset);
            mem.collective(peers, self.op, self.kind, self.count, spans)
                .map_err(err)?;
            (bytes, recv_at, mem.read(&buffer).map_err(err)?)
        } else {
            let mut send_bytes = framed(self.offset, send_len, unit);
            write_units(&mut send_bytes, self.offset * unit, &mine);
            let recv_bytes = framed(self.offset, recv_len, unit);
            let send = mem.buffer(&send_bytes).map_err(err)?;
            let recv = mem.buffer(&recv_bytes).map_err(err)?;
            let spans = Spans::Apart {
                send: (&send, self.offset),
                recv: (&recv, self.offset),
            };
            mem.collective(peers, self.op, self.kind, self.count, spans)
                .map_err(err)?;
            if mem.read(&send).map_err(err)? != send_bytes {
                return Err(format!("rank {rank}: the send buffer changed"));
            }
            (recv_bytes, self.offset, mem.read(&recv).map_err(err)?)
        };
        let mut want = before;
        let region = recv_at * unit..(recv_at + recv_len) * unit;
        write_units(&mut want, region.start, &expected);
        if read.len() != want.len() {
            return Err(format!(
                "rank {rank}: {} bytes read back, {} expected",
                read.len(),
                want.len()
            ));
        }
        let in_region = |i: usize| region.contains(&i);
        // In place, only the receive region and the margins are specified.
        let specified = |i: usize| {
            !self.in_place
                || in_region(i)
                || i < self.offset * unit
                || i >= want.len() - TAIL * unit
        };
        match (0..want.len()).find(|&i| specified(i) && read[i] != want[i]) {
            None => Ok(()),
            Some(i) => Err(format!(
                "rank {rank}: byte {i} is {:#04x}, expected {:#04x} ({})",
                read[i],
                want[i],
                if in_region(i) {
                    "received data"
                } else {
                    "outside the receive region"
                }
            )),
        }
    }

    /// The receive region's bytes rank `rank` must hold.
    fn expected(&self, rank: usize, size: usize) -> Vec<u8> {
        let count = self.count;
        let unit = self.kind.bytes();
        let (send_len, _) = self.op.extents(size, count);
        let all: Vec<Vec<u8>> = (0..size).map(|q| values(self.kind, q, send_len)).collect();
        let units = |q: usize, from: usize| all[q][from * unit..(from + count) * unit].to_vec();
        match self.op {
            PeerOp::AllGather => (0..size).flat_map(|q| units(q, 0)).collect(),
            PeerOp::Broadcast { root } => units(root, 0),
            PeerOp::ReduceScatter => {
                sum_units(self.kind, (0..size).map(|q| units(q, rank * count)))
            }
            PeerOp::AllReduce => sum_units(self.kind, (0..size).map(|q| units(q, 0))),
            PeerOp::AllToAllV { .. } => {
                let sends = ragged(size, count);
                (0..size)
                    .flat_map(|q| {
                        let from: usize = sends[q][..rank].iter().sum();
                        let len = sends[q][rank];
                        let all = values(self.kind, q, sends[q].iter().sum());
                        all[from * unit..(from + len) * unit].to_vec()
                    })
                    .collect()
            }
        }
    }
}

/// `offset` units, `len` units and [`TAIL`] units of sentinel bytes.
fn framed(offset: usize, len: usize, unit: usize) -> Vec<u8> {
    vec![SENTINEL; (offset + len + TAIL) * unit]
}

fn write_units(bytes: &mut [u8], at: usize, units: &[u8]) {
    bytes[at..at + units.len()].copy_from_slice(units);
}

/// Rank `rank`'s `len` units of `kind`, little-endian: values with rounding to spare (sums
/// round), distinct per rank and unit, finite.
fn values(kind: ElementKind, rank: usize, len: usize) -> Vec<u8> {
    let x = |i: usize| {
        let h = (rank as u64 * 0x9E37_79B9 + i as u64 * 0x85EB_CA6B + 0x1234_5678) % 200_003;
        (h as f32 - 100_001.0) / 9_973.7
    };
    match kind {
        ElementKind::F32 => (0..len).flat_map(|i| x(i).to_le_bytes()).collect(),
        ElementKind::Bf16 => (0..len)
            .flat_map(|i| bf16::from_f32(x(i)).to_le_bytes())
            .collect(),
        ElementKind::U8 => (0..len).map(|i| (rank * 31 + i * 7 + 1) as u8).collect(),
    }
}

/// The sum of `parts` (little-endian units of `kind`: f32 or bf16) accumulated in f32 in the
/// order given, rounded once: the reduction rule of every engine of this crate.
pub fn sum_units(kind: ElementKind, parts: impl Iterator<Item = Vec<u8>>) -> Vec<u8> {
    let widen = |bytes: &[u8]| -> Vec<f32> {
        match kind {
            ElementKind::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32())
                .collect(),
        }
    };
    let mut acc: Option<Vec<f32>> = None;
    for part in parts {
        let part = widen(&part);
        acc = Some(match acc {
            None => part,
            Some(mut acc) => {
                acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p);
                acc
            }
        });
    }
    let acc = acc.unwrap_or_default();
    match kind {
        ElementKind::F32 => acc.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => acc
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// The fault cases, one per fresh group (each leaves its group failed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The last rank never calls the collective.
    NeverArrives,
    /// The last rank arrives, then reports a failure instead of moving its data.
    FailsMidCall,
    /// The last rank arrives, then panics.
    PanicsMidCall,
}

/// The collective a fault case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    /// [`PeerOp::AllGather`] of 5 units.
    AllGather,
    /// [`PeerOp::AllToAllV`] of ragged counts.
    AllToAllV,
}

/// Runs fault case `fault` on this rank of a fresh group: the last rank misbehaves (through
/// `mem` too, so its post is a real one), every rank runs `op` through `mem`, and every rank
/// that behaves must get an error within `bound`. Returns this rank's outcome (the misbehaving
/// rank panics for [`Fault::PanicsMidCall`]).
pub fn fault<M: PeerMemory>(
    mem: &M,
    peers: &dyn PeerExchange,
    fault: Fault,
    op: FaultOp,
    bound: Duration,
) -> Outcome {
    let (rank, size) = (peers.peer_rank(), peers.peer_size());
    let misbehaves = rank + 1 == size;
    if misbehaves && fault == Fault::NeverArrives {
        // Alive (its communicator held, so the engine cannot tell it has gone), never calling.
        std::thread::sleep(bound);
        return Ok(());
    }
    let count = 5;
    let sends = ragged(size, count);
    let (send_counts, recv_counts): (Vec<usize>, Vec<usize>) =
        (sends[rank].clone(), sends.iter().map(|s| s[rank]).collect());
    let peer_op = match op {
        FaultOp::AllGather => PeerOp::AllGather,
        FaultOp::AllToAllV => PeerOp::AllToAllV {
            send: &send_counts,
            recv: &recv_counts,
        },
    };
    let (send_len, recv_len) = peer_op.extents(size, count);
    let unit = ElementKind::F32.bytes();
    let send = mem
        .buffer(&values(ElementKind::F32, rank, send_len))
        .map_err(|e| e.to_string())?;
    let recv = mem
        .buffer(&framed(0, recv_len, unit))
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let spans = Spans::Apart {
        send: (&send, 0),
        recv: (&recv, 0),
    };
    let faulty = Faulty { peers, fault };
    let through: &dyn PeerExchange = if misbehaves { &faulty } else { peers };
    let r = mem.collective(through, peer_op, ElementKind::F32, count, spans);
    let took = started.elapsed();
    match r {
        Ok(()) => Err(format!("rank {rank}: {fault:?} went unnoticed")),
        Err(CommError::Mismatch(e)) => Err(format!("rank {rank}: a mismatch, not {fault:?}: {e}")),
        Err(_) if took > bound => Err(format!(
            "rank {rank}: {fault:?} noticed after {took:?}, over the bound {bound:?}"
        )),
        Err(_) => Ok(()),
    }
}

/// Every rank's outcome of [`fault`] (rank order; `Err` holds a panic), checked: each is `Ok`
/// but the misbehaving last rank's panic under [`Fault::PanicsMidCall`].
pub fn check_fault_outcomes(fault: Fault, outcomes: Vec<std::thread::Result<Outcome>>) -> Outcome {
    let size = outcomes.len();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("{fault:?}, world {size}: {e}")),
            Err(_) if fault == Fault::PanicsMidCall && rank + 1 == size => {}
            Err(_) => return Err(format!("{fault:?}, world {size}: rank {rank} panicked")),
        }
    }
    Ok(())
}

/// The misbehaving rank's exchange: arrives, then fails or panics.
struct Faulty<'a> {
    peers: &'a dyn PeerExchange,
    fault: Fault,
}

impl PeerExchange for Faulty<'_> {
    fn peer_rank(&self) -> usize {
        self.peers.peer_rank()
    }

    fn peer_size(&self) -> usize {
        self.peers.peer_size()
    }

    fn exchange(
        &self,
        op: PeerOp<'_>,
        kind: ElementKind,
        count: usize,
        post: super::PeerPost,
    ) -> CommResult<super::PeerCall<'_>> {
        let call = self.peers.exchange(op, kind, count, post)?;
        let rank = self.peer_rank();
        if self.fault == Fault::PanicsMidCall {
            panic!("rank {rank} panics on purpose in a peers collective");
        }
        let why = format!("rank {rank} failed on purpose in a peers collective");
        call.fail(why.clone());
        drop(call);
        Err(CommError::Engine(why))
    }
}
