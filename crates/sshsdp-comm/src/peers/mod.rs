//! [`PeerExchange`]: collectives between ranks of one process whose bytes this crate never
//! touches: each rank publishes a description of its buffers (device buffers of a tensor library,
//! as an opaque [`PeerPost`]), and once every rank has, each moves the data into its *own*
//! receive buffer itself, reading its peers' send buffers, by the plan [`PeerOp::plan`] gives it.
//!
//! This is how ranks that share one device exchange device buffers without NCCL (which refuses
//! two ranks on one GPU) and without staging through the host: the threads engine provides the
//! rendezvous ([`crate::threads::ThreadComm`]), the tensor library's kernels move the bytes
//! (`sshsdp-backend`'s `storage/cube/exchange.rs`). It is a test and single-device engine, not a
//! network: between devices and machines the engine is NCCL (or MPI on CPUs).
//!
//! # The protocol
//! 1. **Arrival.** A rank publishes its post once its buffers are *ready*: every write to its send
//!    buffer is complete where peers will read it (on a device: its stream synchronised after
//!    the writes). It waits, bounded by the engine's timeout, for every rank of the group; a
//!    rank that never arrives is a [`CommError::Timeout`] naming it, a rank that failed or
//!    panicked fails the group and every waiting rank gets the error at once.
//! 2. **Moves.** Each rank runs its plan's [`Transfer`]s: copies and rank-ordered sums from
//!    peers' send buffers into its own receive buffer. It writes nothing else, so a peer's
//!    failure cannot corrupt its result.
//! 3. **All read** ([`PeerCall::all_read`], only where [`PeerPlan::write_after_all_read`]: the
//!    in-place all-reduce, whose receive buffer peers also read). A rank's reads are *complete*
//!    (not merely queued) before it arrives here; it then writes its buffer.
//! 4. **Departure** ([`PeerCall::finish`], or dropping the call, also while unwinding). A rank's
//!    reads and writes are complete before it departs, and it returns only once every rank has
//!    departed: after the call, every buffer may be reused or freed (on a device, a freed buffer
//!    returns to its allocator's pool at once, and the next write into that memory must not
//!    overtake a peer's pending read). A failure of any rank during the call (reported with
//!    [`PeerCall::fail`]) is an error on every rank at its departure.

use std::any::Any;
use std::sync::Arc;

pub mod conformance;

use crate::{CommError, CommResult, ElementKind};

/// One rank's description of its buffers for one call, opaque to this crate.
pub type PeerPost = Arc<dyn Any + Send + Sync>;

/// The collectives a [`PeerExchange`] plans. Reductions sum (accumulated in `f32` in rank order,
/// rounded once, as every engine of this crate reduces); a caller that wants the average divides
/// once afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerOp {
    /// Every rank's `count` units, in rank order, into every rank's `size · count`.
    AllGather,
    /// Chunk `rank` (of `size` chunks of `count`) summed over ranks into every rank's `count`.
    ReduceScatter,
    /// `count` units summed over ranks into every rank's `count`.
    AllReduce,
    /// Rank `root`'s `count` units into every rank's `count`.
    Broadcast {
        /// The rank whose units every rank receives.
        root: usize,
    },
}

/// One move into this rank's receive buffer: `len` units at unit `at`, copied from one source
/// or summed (in the order given, which is rank order) over several. A source is `(rank, unit
/// offset into that rank's send buffer)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Where in the receive buffer (units).
    pub at: usize,
    /// Units moved.
    pub len: usize,
    /// The ranks read and where in their send buffers; more than one is a sum.
    pub sources: Vec<(usize, usize)>,
}

/// What one rank does in one call: its transfers, and whether it must wait until every rank has
/// finished reading before it writes (its receive buffer is a buffer peers read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerPlan {
    /// The moves into this rank's receive buffer.
    pub transfers: Vec<Transfer>,
    /// Read into scratch first, write after [`PeerCall::all_read`].
    pub write_after_all_read: bool,
}

impl PeerOp {
    /// The operation's name in call descriptions and errors.
    pub fn name(self) -> &'static str {
        match self {
            PeerOp::AllGather => "all_gather (peers)",
            PeerOp::ReduceScatter => "reduce_scatter (peers)",
            PeerOp::AllReduce => "all_reduce (peers)",
            PeerOp::Broadcast { .. } => "broadcast (peers)",
        }
    }

    /// Whether the operation sums.
    pub fn sums(self) -> bool {
        matches!(self, PeerOp::ReduceScatter | PeerOp::AllReduce)
    }

    /// Units of each rank's send and receive buffers for `count` over `size` ranks.
    pub fn extents(self, size: usize, count: usize) -> (usize, usize) {
        match self {
            PeerOp::AllGather => (count, size * count),
            PeerOp::ReduceScatter => (size * count, count),
            PeerOp::AllReduce | PeerOp::Broadcast { .. } => (count, count),
        }
    }

    /// Where the send and receive data start (units) in one buffer used in place whose larger
    /// extent starts at unit `at` (see [`PeerOp::plan`]).
    pub fn in_place_offsets(self, rank: usize, count: usize, at: usize) -> (usize, usize) {
        match self {
            PeerOp::AllGather => (at + rank * count, at),
            PeerOp::ReduceScatter => (at, at + rank * count),
            PeerOp::AllReduce | PeerOp::Broadcast { .. } => (at, at),
        }
    }

    /// Rank `rank`'s plan among `size` ranks. `in_place`: the send buffer lies inside the
    /// receive buffer as NCCL defines it (all-gather: at chunk `rank` of the receive buffer;
    /// reduce-scatter: the receive buffer is chunk `rank` of the send buffer; all-reduce and
    /// broadcast: one buffer), so a move from this rank's own send buffer to the same place is
    /// skipped, and an all-reduce writes only once every rank has read.
    pub fn plan(
        self,
        rank: usize,
        size: usize,
        count: usize,
        in_place: bool,
    ) -> CommResult<PeerPlan> {
        if rank >= size {
            return Err(CommError::InvalidArgument(format!(
                "{}: rank {rank} of {size}",
                self.name()
            )));
        }
        let all = |offset: usize| (0..size).map(|q| (q, offset)).collect::<Vec<_>>();
        let one = |at, source| Transfer {
            at,
            len: count,
            sources: vec![source],
        };
        let transfers = match self {
            PeerOp::AllGather => (0..size)
                .filter(|&q| !(in_place && q == rank))
                .map(|q| one(q * count, (q, 0)))
                .collect(),
            PeerOp::ReduceScatter => vec![Transfer {
                at: 0,
                len: count,
                sources: all(rank * count),
            }],
            PeerOp::AllReduce => vec![Transfer {
                at: 0,
                len: count,
                sources: all(0),
            }],
            PeerOp::Broadcast { root } => {
                crate::check_root("broadcast", root, size)?;
                if in_place && rank == root {
                    Vec::new()
                } else {
                    vec![one(0, (root, 0))]
                }
            }
        };
        let transfers = if count == 0 { Vec::new() } else { transfers };
        Ok(PeerPlan {
            transfers,
            write_after_all_read: in_place && self == PeerOp::AllReduce,
        })
    }
}

/// Collectives between ranks of one process that publish descriptions of their buffers and move
/// the data themselves (see the module docs). Offered by engines whose ranks share an address
/// space ([`crate::Collective::peers`]: the threads engine).
pub trait PeerExchange {
    /// This rank's index in the group.
    fn peer_rank(&self) -> usize;
    /// Number of ranks in the group.
    fn peer_size(&self) -> usize;
    /// Publishes `post` for `op` on `count` units of `kind` and waits (bounded) for every rank's;
    /// ranks calling a different operation, kind or count is an error on every rank.
    fn exchange(
        &self,
        op: PeerOp,
        kind: ElementKind,
        count: usize,
        post: PeerPost,
    ) -> CommResult<PeerCall<'_>>;
}

/// A rank's presence in a call of a [`PeerExchange`], between arrival and departure.
pub trait PeerPresence {
    /// Waits until every rank has called it (or departed): the all-read barrier.
    fn all_read(&mut self);
    /// Fails the call (and the engine's group) on every rank.
    fn fail(&self, reason: String);
    /// Departs and waits for every rank to depart; the group's failure, if any rank failed.
    fn depart(self: Box<Self>) -> Option<String>;
}

/// One rank's call of a [`PeerExchange`] after arrival: every rank's post, and the barriers of
/// the protocol. Dropping it departs (a rank that unwinds still releases its peers).
pub struct PeerCall<'a> {
    posts: Vec<PeerPost>,
    presence: Option<Box<dyn PeerPresence + 'a>>,
}

impl<'a> PeerCall<'a> {
    /// A call with every rank's `posts` (rank order), present through `presence`.
    pub fn new(posts: Vec<PeerPost>, presence: Box<dyn PeerPresence + 'a>) -> Self {
        Self {
            posts,
            presence: Some(presence),
        }
    }

    /// Every rank's post, in rank order.
    pub fn posts(&self) -> &[PeerPost] {
        &self.posts
    }

    /// Every rank's post as `T`, or a mismatch error (ranks posting different buffer types:
    /// ranks on different tensor libraries or runtimes).
    pub fn posts_as<T: Any + Send + Sync>(&self) -> CommResult<Vec<&T>> {
        self.posts
            .iter()
            .enumerate()
            .map(|(q, p)| {
                p.downcast_ref::<T>().ok_or_else(|| {
                    CommError::Mismatch(format!(
                        "rank {q} posted buffers of another kind than {}",
                        std::any::type_name::<T>()
                    ))
                })
            })
            .collect()
    }

    /// The all-read barrier: this rank's reads of peers' buffers are complete.
    pub fn all_read(&mut self) {
        if let Some(p) = &mut self.presence {
            p.all_read();
        }
    }

    /// Reports this rank's failure: every rank's call and the group fail.
    pub fn fail(&self, reason: impl Into<String>) {
        if let Some(p) = &self.presence {
            p.fail(reason.into());
        }
    }

    /// Departs once this rank's reads and writes are complete; returns when every rank has
    /// departed, with an error if any rank failed.
    pub fn finish(mut self) -> CommResult<()> {
        match self.presence.take().and_then(|p| p.depart()) {
            Some(reason) => Err(CommError::PeerFailed(reason)),
            None => Ok(()),
        }
    }
}

impl Drop for PeerCall<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.presence.take() {
            if std::thread::panicking() {
                p.fail("a rank panicked during a peers collective".into());
            }
            let _ = p.depart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_each_receive_buffer_once() {
        for size in 1..=4 {
            for rank in 0..size {
                for in_place in [false, true] {
                    let count = 3;
                    let ag = PeerOp::AllGather.plan(rank, size, count, in_place).unwrap();
                    let mut at: Vec<usize> = ag.transfers.iter().map(|t| t.at).collect();
                    if in_place {
                        at.push(rank * count);
                    }
                    at.sort();
                    assert_eq!(at, (0..size).map(|q| q * count).collect::<Vec<_>>());
                    let rs = PeerOp::ReduceScatter
                        .plan(rank, size, count, in_place)
                        .unwrap();
                    assert_eq!(rs.transfers.len(), 1);
                    assert_eq!(
                        rs.transfers[0].sources,
                        (0..size).map(|q| (q, rank * count)).collect::<Vec<_>>()
                    );
                    let ar = PeerOp::AllReduce.plan(rank, size, count, in_place).unwrap();
                    assert_eq!(ar.write_after_all_read, in_place);
                    let root = size - 1;
                    let bc = PeerOp::Broadcast { root }
                        .plan(rank, size, count, in_place)
                        .unwrap();
                    assert_eq!(bc.transfers.is_empty(), in_place && rank == root);
                }
            }
        }
        assert!(PeerOp::Broadcast { root: 2 }.plan(0, 2, 1, false).is_err());
        assert!(PeerOp::AllGather.plan(2, 2, 1, false).is_err());
    }
}
