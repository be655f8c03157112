//! The [`Collective`] trait every engine implements, and [`Pending`] for asynchronous calls.
//!
//! The trait is generic over element types (not object-safe): a training runtime is generic
//! over its engine, `C: Collective`, and sub-communicators have the engine's own type. Every
//! call is *collective*: all ranks of the communicator make the same calls in the same order
//! with matching arguments. Engines check what they can (the threads engine checks operation,
//! element type, counts, roots and [`CallTag`]s) and report a mismatch as an error on every
//! rank.

use std::sync::mpsc;

use crate::{CallTag, CommError, CommResult, DeviceCollective, Element, ReduceOp, Reducible};

/// Fails every communicator of a rank's world, on every rank: each call in progress or to come
/// returns an error. Called with the reason; can be called from any thread.
pub type AbortHandle = std::sync::Arc<dyn Fn(&str) + Send + Sync>;

/// A communicator: a group of ranks that run collectives together.
pub trait Collective: Sized {
    /// This rank's index in the communicator.
    fn rank(&self) -> usize;

    /// Number of ranks in the communicator.
    fn size(&self) -> usize;

    /// All-gather with equal counts, in place: `buf` holds `size` chunks of `buf.len() / size`
    /// elements; this rank's chunk `rank` is its input and the other chunks are filled from the
    /// peers. No staging copy: the bucket buffer is the collective buffer.
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()>;

    /// All-gather with equal counts: `recv` (`size · send.len()`) receives every rank's `send`
    /// in rank order.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()>;

    /// Reduce-scatter with equal counts: `send` holds `size` chunks of `recv.len()`; this rank
    /// receives the reduction of chunk `rank` over all ranks.
    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()>;

    /// All-reduce in place.
    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()>;

    /// All-to-all with per-peer counts (`MPI_Alltoallv`): `send` holds, in rank order,
    /// `send_counts[r]` elements for each rank `r`, and `recv` receives, in rank order,
    /// `recv_counts[r]` elements from each rank `r` (this rank's own chunk included). Chunks may
    /// be empty. Counts must agree pairwise — rank `a`'s `send_counts[b]` is rank `b`'s
    /// `recv_counts[a]` — or the call is [`CommError::Mismatch`] on every rank (engines check
    /// before moving data).
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()>;

    /// Broadcast `buf` from `root` to every rank, in place.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()>;

    /// Blocks until every rank has reached the barrier.
    fn barrier(&self) -> CommResult<()>;

    /// Labels the calls that follow on this communicator, until the next label, with `tag`.
    /// Engines that check tags (threads; MPI with call checks) report ranks whose calls carry
    /// different tags as [`CommError::Mismatch`] on every rank; others ignore them.
    fn set_tag(&self, tag: CallTag) {
        let _ = tag;
    }

    /// A handle that fails every communicator of this rank's world on every rank (the world's
    /// and all split from it), so that a local error on one rank is an error on all of them at
    /// once rather than a wait for a timeout. `None` where the engine has no such mechanism (its
    /// peers then fail by their own timeouts or watchdogs).
    fn abort_handle(&self) -> Option<AbortHandle> {
        None
    }

    /// The same communicator's collectives on device memory named by address, where the engine
    /// moves device memory itself (NCCL); `None` for host engines (threads, MPI), whose callers
    /// stage device buffers through the host.
    fn device(&self) -> Option<&dyn DeviceCollective> {
        None
    }

    /// The same communicator's collectives between ranks of this process that move each
    /// other's buffers themselves ([`PeerExchange`](crate::peers::PeerExchange): device buffers
    /// of ranks sharing one device), where the engine's ranks share an address space (threads);
    /// `None` elsewhere.
    fn peers(&self) -> Option<&dyn crate::peers::PeerExchange> {
        None
    }

    /// Splits into sub-communicators: ranks with the same `color` form one, ordered by `key`
    /// then by rank. Every rank gets the communicator of its own color.
    fn split(&self, color: usize, key: usize) -> CommResult<Self>;

    /// Starts an in-place all-gather of an owned buffer; [`Pending::wait`] returns it filled.
    ///
    /// Engines with asynchronous progress run it while the caller computes; the default runs
    /// it at once (documented by each engine).
    fn start_all_gather<T: Element>(&self, mut buf: Vec<T>) -> CommResult<Pending<Vec<T>>> {
        self.all_gather_in_place(&mut buf)?;
        Ok(Pending::ready(Ok(buf)))
    }

    /// Starts a reduce-scatter of owned buffers; [`Pending::wait`] returns `(send, recv)`.
    fn start_reduce_scatter<T: Reducible>(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<(Vec<T>, Vec<T>)>> {
        self.reduce_scatter(&send, &mut recv, op)?;
        Ok(Pending::ready(Ok((send, recv))))
    }
}

/// An asynchronous collective in flight; [`Pending::wait`] blocks until it completes and
/// returns its buffers.
#[must_use = "a pending collective must be waited for to get its buffers back"]
pub struct Pending<T> {
    inner: PendingInner<T>,
}

enum PendingInner<T> {
    Ready(CommResult<T>),
    Channel(mpsc::Receiver<CommResult<T>>),
}

impl<T> Pending<T> {
    /// An already completed operation.
    pub fn ready(result: CommResult<T>) -> Self {
        Self {
            inner: PendingInner::Ready(result),
        }
    }

    /// An operation whose result arrives on `rx`.
    pub fn from_channel(rx: mpsc::Receiver<CommResult<T>>) -> Self {
        Self {
            inner: PendingInner::Channel(rx),
        }
    }

    /// Blocks until the operation completes.
    pub fn wait(self) -> CommResult<T> {
        match self.inner {
            PendingInner::Ready(result) => result,
            PendingInner::Channel(rx) => rx.recv().unwrap_or_else(|_| {
                Err(CommError::PeerFailed(
                    "the thread running the collective stopped without a result".into(),
                ))
            }),
        }
    }
}

/// Checks an equal-count collective's buffers: `whole` (the gathered output or the scattered
/// input, named `what`) must hold `size` chunks of `part` elements.
pub fn check_chunks(
    op: &str,
    what: &str,
    whole: usize,
    part: usize,
    size: usize,
) -> CommResult<()> {
    if part.checked_mul(size) == Some(whole) {
        Ok(())
    } else {
        Err(CommError::InvalidArgument(format!(
            "{op}: {what} has {whole} elements, expected {size} ranks × {part}"
        )))
    }
}

/// Checks an all-to-all-v buffer: `counts` has one entry per rank and they add up to `len`
/// (the buffer named `what`).
pub fn check_counts(
    op: &str,
    what: &str,
    len: usize,
    counts: &[usize],
    size: usize,
) -> CommResult<()> {
    if counts.len() != size {
        return Err(CommError::InvalidArgument(format!(
            "{op}: {} {what} counts for a communicator of {size} ranks",
            counts.len()
        )));
    }
    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
    if total != Some(len) {
        return Err(CommError::InvalidArgument(format!(
            "{op}: {what} has {len} elements but its counts add up to {}",
            total.map_or("more than usize::MAX".to_string(), |t| t.to_string())
        )));
    }
    Ok(())
}

/// The first pair of ranks whose all-to-all-v counts disagree, as a message, given every
/// rank's send counts (`sends[a][b]`: what `a` sends `b`) and receive counts (`recvs[b][a]`:
/// what `b` expects from `a`).
pub fn counts_mismatch(op: &str, sends: &[&[usize]], recvs: &[&[usize]]) -> Option<String> {
    let size = sends.len();
    (0..size)
        .flat_map(|a| (0..size).map(move |b| (a, b)))
        .find(|&(a, b)| sends[a][b] != recvs[b][a])
        .map(|(a, b)| {
            format!(
                "{op}: rank {a} sends {} elements to rank {b}, which expects {}",
                sends[a][b], recvs[b][a]
            )
        })
}

/// Checks that `root` is a rank of a communicator of `size` ranks.
pub fn check_root(op: &str, root: usize, size: usize) -> CommResult<()> {
    if root < size {
        Ok(())
    } else {
        Err(CommError::InvalidArgument(format!(
            "{op}: root {root} outside a communicator of {size} ranks"
        )))
    }
}

/// Checks that `len` splits into `size` equal chunks; returns the chunk length.
pub fn equal_chunks(op: &str, len: usize, size: usize) -> CommResult<usize> {
    if len % size != 0 {
        return Err(CommError::InvalidArgument(format!(
            "{op}: buffer of {len} elements does not split into {size} equal chunks"
        )));
    }
    Ok(len / size)
}
