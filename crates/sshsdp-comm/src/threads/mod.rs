//! The in-process engine: N ranks as threads of one process sharing memory.
//!
//! Data moves straight from one rank's buffer into another's (one copy per received byte, no
//! staging); reductions read every rank's chunk and accumulate in `f32` in rank order, so all
//! ranks get bitwise equal results. A rank that panics (in [`ThreadsWorld::run`], or while it
//! holds a communicator) or aborts ([`Collective::abort_handle`]) fails every communicator of
//! the world at once — the world's and all split from it; a rank that drops a communicator fails
//! that communicator's group; a rank that stops calling makes the others time out after
//! [`ThreadsConfig::timeout`]. Either way the others get an error, never a hang.
//!
//! Asynchronous calls ([`Collective::start_all_gather`], [`Collective::start_reduce_scatter`])
//! run on a helper thread while the caller goes on.

mod outcomes;
mod peers;
mod rendezvous;
mod traffic;

pub use outcomes::RankFailure;
use traffic::moved;
pub use traffic::{Traffic, TrafficBytes};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rendezvous::{Arrival, CallGuard, Family, Group, OpDesc, RawBufs};

use crate::collective::{check_chunks, check_counts, check_root, counts_mismatch, equal_chunks};
use crate::{
    AbortHandle, CallTag, Collective, CommError, CommResult, Element, Pending, ReduceOp, Reducible,
};

/// Settings of a threads world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadsConfig {
    /// How long a rank waits for its peers to arrive at a collective before the group fails.
    pub timeout: Duration,
}

impl Default for ThreadsConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
        }
    }
}

/// Creates worlds of in-process ranks.
pub struct ThreadsWorld;

impl ThreadsWorld {
    /// One communicator per rank of a new world of `size` ranks; move each to its thread.
    pub fn create(size: usize, config: ThreadsConfig) -> CommResult<Vec<ThreadComm>> {
        if size == 0 {
            return Err(CommError::InvalidArgument(
                "a world needs at least one rank".into(),
            ));
        }
        let group = Group::new(size, config.timeout, &Arc::new(Family::default()));
        Ok((0..size)
            .map(|rank| ThreadComm::new(group.clone(), rank, Arc::default()))
            .collect())
    }

    /// Runs `f` on `size` ranks, each on its own thread, and returns each rank's outcome in
    /// rank order (`Err` holds a panic's payload). A rank that panics fails every communicator
    /// of the world at once, including those its runtime still holds, so the others' calls
    /// return errors instead of waiting for the timeout.
    pub fn run<R, F>(
        size: usize,
        config: ThreadsConfig,
        f: F,
    ) -> CommResult<Vec<std::thread::Result<R>>>
    where
        R: Send,
        F: Fn(ThreadComm) -> R + Sync,
    {
        let comms = Self::create(size, config)?;
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let f = &f;
                    let (rank, family) = (comm.rank(), comm.group.family().clone());
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let outcome =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                            if outcome.is_err() {
                                family.fail(format!("rank {rank} panicked"));
                            }
                            outcome
                        })
                        .expect("spawn rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(Err))
                .collect()
        }))
    }
}

/// One rank's communicator in a threads world.
pub struct ThreadComm {
    group: Arc<Group>,
    rank: usize,
    /// This world rank's bytes moved, shared with the communicators split from this one.
    traffic: Arc<Traffic>,
    seq: AtomicU64,
    /// The label of the calls made now (see [`Collective::set_tag`]).
    tag: Mutex<CallTag>,
}

impl ThreadComm {
    fn new(group: Arc<Group>, rank: usize, traffic: Arc<Traffic>) -> Self {
        Self {
            group,
            rank,
            traffic,
            seq: AtomicU64::new(0),
            tag: Mutex::new(CallTag::NONE),
        }
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn tag(&self) -> CallTag {
        *self.tag.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes this rank has moved to and from its peers so far, over every communicator of its
    /// world rank (see [`Traffic`]).
    pub fn traffic(&self) -> TrafficBytes {
        self.traffic.snapshot()
    }

    fn traffic_ptr(&self) -> usize {
        Arc::as_ptr(&self.traffic) as usize
    }

    /// This rank and its traffic counters, as the call helpers take them.
    fn me(&self) -> (usize, usize) {
        (self.rank, self.traffic_ptr())
    }

    /// The timeout this communicator's group uses.
    pub fn timeout(&self) -> Duration {
        self.group.timeout()
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group
                .family()
                .fail(format!("rank {} panicked", self.rank));
        } else {
            let why = format!("rank {} dropped its communicator", self.rank);
            self.group.fail(why);
        }
    }
}

/// In-place all-gather: chunk `rank` of the buffer at `base` is ours, the rest is filled.
fn gather_into<T: Element>(
    g: &Group,
    (rank, traffic): (usize, usize),
    (seq, desc): (u64, OpDesc),
    base: *mut T,
    chunk: usize,
) -> CommResult<()> {
    let mine = base.wrapping_add(rank * chunk);
    let bufs = RawBufs {
        send: mine as usize,
        recv: 0,
        traffic,
    };
    let Arrival { bufs: all, .. } = g.arrive(seq, rank, desc, bufs, None)?;
    let _guard = CallGuard::new(g, seq, false);
    for (q, peer) in all.iter().enumerate() {
        if q != rank && chunk > 0 {
            // SAFETY: every rank arrived with a chunk of `chunk` elements of type T (checked by
            // the descriptor match); peers keep their buffers alive and unmodified until all
            // ranks depart (guard). Our destination chunk q is disjoint from the chunk we publish.
            unsafe {
                std::ptr::copy_nonoverlapping(peer.send as *const T, base.add(q * chunk), chunk);
            }
            moved(&all, rank, q, chunk * size_of::<T>());
        }
    }
    Ok(())
}

fn gather_out<T: Element>(
    g: &Group,
    (rank, traffic): (usize, usize),
    (seq, desc): (u64, OpDesc),
    send: &[T],
    recv: &mut [T],
) -> CommResult<()> {
    let chunk = send.len();
    let bufs = RawBufs {
        send: send.as_ptr() as usize,
        recv: 0,
        traffic,
    };
    let Arrival { bufs: all, .. } = g.arrive(seq, rank, desc, bufs, None)?;
    let _guard = CallGuard::new(g, seq, false);
    for (q, peer) in all.iter().enumerate() {
        // SAFETY: as in `gather_into`; `recv` is ours alone and holds size · chunk elements.
        let src = unsafe { std::slice::from_raw_parts(peer.send as *const T, chunk) };
        recv[q * chunk..(q + 1) * chunk].copy_from_slice(src);
        moved(&all, rank, q, size_of_val(send));
    }
    Ok(())
}

/// Writes `dst[i] = scale · Σ_q src_q[i]` in rank order, accumulating in f32.
///
/// # Safety
/// Every pointer in `srcs` is valid for reads of `dst.len()` elements not written during the call.
unsafe fn reduce_chunk<T: Reducible>(srcs: &[*const T], dst: *mut T, len: usize, scale: f32) {
    const BLOCK: usize = 512;
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        for (q, &src) in srcs.iter().enumerate() {
            // SAFETY: caller guarantees `src` is readable for `len` elements.
            let s = unsafe { std::slice::from_raw_parts(src.add(start), n) };
            if q == 0 {
                acc[..n]
                    .iter_mut()
                    .zip(s)
                    .for_each(|(a, &x)| *a = x.to_acc());
            } else {
                acc[..n]
                    .iter_mut()
                    .zip(s)
                    .for_each(|(a, &x)| *a += x.to_acc());
            }
        }
        for (i, a) in acc[..n].iter().enumerate() {
            // SAFETY: `dst` is valid for `len` writes (caller).
            unsafe { dst.add(start + i).write(T::from_acc(a * scale)) };
        }
        start += n;
    }
}

fn reduce_scatter_impl<T: Reducible>(
    g: &Group,
    (rank, traffic): (usize, usize),
    (seq, d): (u64, OpDesc),
    send: &[T],
    recv: &mut [T],
    op: ReduceOp,
) -> CommResult<()> {
    let chunk = recv.len();
    let bufs = RawBufs {
        send: send.as_ptr() as usize,
        recv: 0,
        traffic,
    };
    let Arrival { bufs: all, .. } = g.arrive(seq, rank, d, bufs, None)?;
    let _guard = CallGuard::new(g, seq, false);
    let srcs: Vec<*const T> = all
        .iter()
        .map(|b| (b.send as *const T).wrapping_add(rank * chunk))
        .collect();
    // SAFETY: each peer published a send buffer of size · chunk elements that stays alive and
    // unmodified until all depart; `recv` is ours alone.
    unsafe { reduce_chunk(&srcs, recv.as_mut_ptr(), chunk, op.scale(g.size())) };
    (0..all.len()).for_each(|q| moved(&all, rank, q, size_of_val(recv)));
    Ok(())
}

impl Collective for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        let chunk = equal_chunks("all_gather", buf.len(), self.size())?;
        let call = (
            self.next_seq(),
            OpDesc::data::<T>("all_gather", chunk, self.tag()),
        );
        gather_into(&self.group, self.me(), call, buf.as_mut_ptr(), chunk)
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        check_chunks("all_gather", "recv", recv.len(), send.len(), self.size())?;
        let call = (
            self.next_seq(),
            OpDesc::data::<T>("all_gather", send.len(), self.tag()),
        );
        gather_out(&self.group, self.me(), call, send, recv)
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        check_chunks(
            "reduce_scatter",
            "send",
            send.len(),
            recv.len(),
            self.size(),
        )?;
        let call = (
            self.next_seq(),
            OpDesc::reduce::<T>("reduce_scatter", recv.len(), op, self.tag()),
        );
        reduce_scatter_impl(&self.group, self.me(), call, send, recv, op)
    }

    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        let (g, rank, seq, n) = (&*self.group, self.rank, self.next_seq(), buf.len());
        let base = buf.as_mut_ptr();
        let d = OpDesc::reduce::<T>("all_reduce", n, op, self.tag());
        let bufs = RawBufs {
            send: 0,
            recv: base as usize,
            traffic: self.traffic_ptr(),
        };
        let Arrival { bufs: all, .. } = g.arrive(seq, rank, d, bufs, None)?;
        let mut guard = CallGuard::new(g, seq, true);
        let chunk = n.div_ceil(g.size());
        let range = |q: usize| (q * chunk).min(n)..((q + 1) * chunk).min(n);
        let mine = range(rank);
        let srcs: Vec<*const T> = all
            .iter()
            .map(|b| (b.recv as *const T).wrapping_add(mine.start))
            .collect();
        // SAFETY: phase A: every rank reads chunk `rank` of every buffer and writes only chunk
        // `rank` of its own (reads of our own chunk happen block by block before the write of
        // that block). Buffers live until all depart.
        unsafe { reduce_chunk(&srcs, base.add(mine.start), mine.len(), op.scale(g.size())) };
        (0..all.len()).for_each(|q| moved(&all, rank, q, mine.len() * size_of::<T>()));
        guard.middle();
        for (q, peer) in all.iter().enumerate() {
            let r = range(q);
            if q != rank && !r.is_empty() {
                // SAFETY: phase B: chunk q of rank q is final (middle barrier) and no longer
                // written; we write chunk q of our own buffer, which nobody reads now.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (peer.recv as *const T).add(r.start),
                        base.add(r.start),
                        r.len(),
                    )
                };
                moved(&all, rank, q, r.len() * size_of::<T>());
            }
        }
        Ok(())
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all_v";
        let size = self.size();
        check_counts(OP, "send", send.len(), send_counts, size)?;
        check_counts(OP, "recv", recv.len(), recv_counts, size)?;
        let (g, rank, seq) = (&*self.group, self.rank, self.next_seq());
        // Published next to the send buffer (in the slot's `recv` address, unused here): this
        // rank's send counts then its receive counts, so every rank can check every pair and
        // find its chunk in each peer's buffer.
        let counts: Vec<usize> = send_counts.iter().chain(recv_counts).copied().collect();
        let d = OpDesc::data::<T>(OP, size, self.tag());
        let bufs = RawBufs {
            send: send.as_ptr() as usize,
            recv: counts.as_ptr() as usize,
            traffic: self.traffic_ptr(),
        };
        let Arrival { bufs: all, .. } = g.arrive(seq, rank, d, bufs, None)?;
        let _guard = CallGuard::new(g, seq, false);
        // SAFETY: every rank published `2 · size` counts that live, unmodified, until all depart.
        let peers: Vec<&[usize]> = all
            .iter()
            .map(|b| unsafe { std::slice::from_raw_parts(b.recv as *const usize, 2 * size) })
            .collect();
        let sends: Vec<&[usize]> = peers.iter().map(|c| &c[..size]).collect();
        let recvs: Vec<&[usize]> = peers.iter().map(|c| &c[size..]).collect();
        // Every rank checks every pair, so every rank reaches the same verdict.
        if let Some(msg) = counts_mismatch(OP, &sends, &recvs) {
            return Err(CommError::Mismatch(msg));
        }
        let mut at = 0;
        for (q, peer) in all.iter().enumerate() {
            let n = recv_counts[q];
            let offset: usize = sends[q][..rank].iter().sum();
            if n > 0 {
                // SAFETY: rank q's send buffer holds its counts' sum of T (checked on its side),
                // of which [offset, offset + n) is our chunk (n == sends[q][rank], checked above);
                // it stays alive and unmodified until all depart; `recv` is ours alone.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (peer.send as *const T).add(offset),
                        recv.as_mut_ptr().add(at),
                        n,
                    )
                };
                moved(&all, rank, q, n * size_of::<T>());
            }
            at += n;
        }
        Ok(())
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        check_root("broadcast", root, self.size())?;
        let (g, rank, seq) = (&*self.group, self.rank, self.next_seq());
        let base = buf.as_mut_ptr();
        let d = OpDesc {
            root,
            ..OpDesc::data::<T>("broadcast", buf.len(), self.tag())
        };
        let bufs = RawBufs {
            send: base as usize,
            recv: 0,
            traffic: self.traffic_ptr(),
        };
        let Arrival { bufs: all, .. } = g.arrive(seq, rank, d, bufs, None)?;
        let _guard = CallGuard::new(g, seq, false);
        if rank != root && !buf.is_empty() {
            // SAFETY: the root's buffer holds `len` elements of T and is not written until all
            // depart; ours is disjoint from it.
            unsafe { std::ptr::copy_nonoverlapping(all[root].send as *const T, base, buf.len()) };
            moved(&all, rank, root, size_of_val(buf));
        }
        Ok(())
    }

    fn barrier(&self) -> CommResult<()> {
        let d = OpDesc::control("barrier", self.tag());
        let seq = self.next_seq();
        self.group
            .arrive(seq, self.rank, d, RawBufs::default(), None)?;
        drop(CallGuard::new(&self.group, seq, false));
        Ok(())
    }

    fn peers(&self) -> Option<&dyn crate::peers::PeerExchange> {
        Some(self)
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        let family = self.group.family().clone();
        Some(Arc::new(move |reason: &str| {
            family.fail(reason.to_string())
        }))
    }

    fn set_tag(&self, tag: CallTag) {
        *self.tag.lock().unwrap_or_else(|p| p.into_inner()) = tag;
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Self> {
        let d = OpDesc::control("split", self.tag());
        let seq = self.next_seq();
        let arrival = self.group.arrive(
            seq,
            self.rank,
            d,
            RawBufs::default(),
            Some((color, key, build_split)),
        )?;
        let _guard = CallGuard::new(&self.group, seq, false);
        let split = arrival
            .payload
            .and_then(|p| p.downcast::<SplitGroups>().ok())
            .ok_or_else(|| CommError::PeerFailed("split result missing".into()))?;
        let (group, members) = &split.0[&color];
        let new_rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("every rank is a member of its color");
        Ok(ThreadComm::new(
            group.clone(),
            new_rank,
            self.traffic.clone(),
        ))
    }

    fn start_all_gather<T: Element>(&self, mut buf: Vec<T>) -> CommResult<Pending<Vec<T>>> {
        let chunk = equal_chunks("all_gather", buf.len(), self.size())?;
        let call = (
            self.next_seq(),
            OpDesc::data::<T>("all_gather", chunk, self.tag()),
        );
        let (group, rank, traffic) = (self.group.clone(), self.rank, self.traffic.clone());
        Ok(spawn_pending(move || {
            let me = (rank, Arc::as_ptr(&traffic) as usize);
            gather_into(&group, me, call, buf.as_mut_ptr(), chunk).map(|()| buf)
        }))
    }

    fn start_reduce_scatter<T: Reducible>(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<(Vec<T>, Vec<T>)>> {
        check_chunks(
            "reduce_scatter",
            "send",
            send.len(),
            recv.len(),
            self.size(),
        )?;
        let call = (
            self.next_seq(),
            OpDesc::reduce::<T>("reduce_scatter", recv.len(), op, self.tag()),
        );
        let (group, rank, traffic) = (self.group.clone(), self.rank, self.traffic.clone());
        Ok(spawn_pending(move || {
            let me = (rank, Arc::as_ptr(&traffic) as usize);
            reduce_scatter_impl(&group, me, call, &send, &mut recv, op).map(|()| (send, recv))
        }))
    }
}

fn spawn_pending<R: Send + 'static>(
    f: impl FnOnce() -> CommResult<R> + Send + 'static,
) -> Pending<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // The receiver may be gone if the caller dropped the handle; nothing to report then.
        let _ = tx.send(f());
    });
    Pending::from_channel(rx)
}

/// Result of a split: for each color, its new group and its members (old ranks, new order).
struct SplitGroups(std::collections::HashMap<usize, (Arc<Group>, Vec<usize>)>);

fn build_split(
    colors: &[(usize, usize)],
    timeout: Duration,
    family: &Arc<Family>,
) -> Arc<dyn std::any::Any + Send + Sync> {
    let mut by_color: std::collections::HashMap<usize, Vec<(usize, usize)>> = Default::default();
    for (rank, &(color, key)) in colors.iter().enumerate() {
        by_color.entry(color).or_default().push((key, rank));
    }
    let groups = by_color
        .into_iter()
        .map(|(color, mut members)| {
            members.sort_unstable();
            let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
            (color, (Group::new(ranks.len(), timeout, family), ranks))
        })
        .collect();
    Arc::new(SplitGroups(groups))
}
