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
pub enum PeerOp<'a> {
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
    /// All-to-all with per-rank counts (MPI's `alltoallv` with packed displacements): this
    /// rank's send buffer holds `send[0]` units for rank 0, then `send[1]` for rank 1, …; its
    /// receive buffer gets `recv[q]` units from each rank `q`, in rank order. What rank `a` sends
    /// rank `b` must be what `b` expects from `a` (the engine checks every pair on every rank).
    /// The `count` of the call is not used (pass 0); never in place.
    AllToAllV {
        /// Units for each rank, in rank order.
        send: &'a [usize],
        /// Units from each rank, in rank order.
        recv: &'a [usize],
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

impl PeerOp<'_> {
    /// The operation's name in call descriptions and errors.
    pub fn name(self) -> &'static str {
        match self {
            PeerOp::AllGather => "all_gather (peers)",
            PeerOp::ReduceScatter => "reduce_scatter (peers)",
            PeerOp::AllReduce => "all_reduce (peers)",
            PeerOp::Broadcast { .. } => "broadcast (peers)",
            PeerOp::AllToAllV { .. } => "all_to_all_v (peers)",
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
            PeerOp::AllToAllV { send, recv } => (send.iter().sum(), recv.iter().sum()),
        }
    }

    /// Where the send and receive data start (units) in one buffer used in place whose larger
    /// extent starts at unit `at` (see [`PeerOp::plan`]).
    pub fn in_place_offsets(self, rank: usize, count: usize, at: usize) -> (usize, usize) {
        match self {
            PeerOp::AllGather => (at + rank * count, at),
            PeerOp::ReduceScatter => (at, at + rank * count),
            PeerOp::AllReduce | PeerOp::Broadcast { .. } | PeerOp::AllToAllV { .. } => (at, at),
        }
    }

    /// Rank `rank`'s plan among `size` ranks. `in_place`: the send buffer lies inside the
    /// receive buffer as NCCL defines it (all-gather: at chunk `rank` of the receive buffer;
    /// reduce-scatter: the receive buffer is chunk `rank` of the send buffer; all-reduce and
    /// broadcast: one buffer), so a move from this rank's own send buffer to the same place is
    /// skipped, and an all-reduce writes only once every rank has read. An all-to-all-v is
    /// planned from every rank's counts ([`all_to_all_v_plan`], which [`PeerCall::plan`] calls
    /// with the counts the engine exchanged).
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
            PeerOp::AllToAllV { .. } => {
                return Err(CommError::InvalidArgument(
                    "all_to_all_v (peers) is planned from every rank's counts, at arrival".into(),
                ))
            }
        };
        let transfers = if count == 0 { Vec::new() } else { transfers };
        Ok(PeerPlan {
            transfers,
            write_after_all_read: in_place && self == PeerOp::AllReduce,
        })
    }
}

/// Rank `rank`'s plan of an all-to-all-v whose rank `q` sends `sends[q][p]` units to each rank
/// `p` (every rank's counts, as the engine exchanged and checked them): from each rank in rank
/// order, a copy of its chunk for `rank` (after its chunks for lower ranks) to the end of what
/// lower ranks sent. Empty chunks move nothing.
pub fn all_to_all_v_plan(rank: usize, sends: &[Vec<usize>]) -> CommResult<PeerPlan> {
    let size = sends.len();
    if rank >= size || sends.iter().any(|s| s.len() != size) {
        return Err(CommError::InvalidArgument(format!(
            "all_to_all_v (peers): rank {rank} of {size} with counts for {:?} ranks",
            sends.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    let mut at = 0;
    let mut transfers = Vec::new();
    for (q, counts) in sends.iter().enumerate() {
        let len = counts[rank];
        if len > 0 {
            let from = counts[..rank].iter().sum();
            transfers.push(Transfer {
                at,
                len,
                sources: vec![(q, from)],
            });
        }
        at += len;
    }
    Ok(PeerPlan {
        transfers,
        write_after_all_read: false,
    })
}

/// Checks every rank's all-to-all-v counts (`sends[q]`, `recvs[q]`: what rank `q` sends to and
/// expects from each rank): each holds one count per rank, and what `a` sends `b` is what `b`
/// expects from `a`. Every rank checks the same counts, so every rank gets the same error.
pub fn check_all_to_all_v(sends: &[Vec<usize>], recvs: &[Vec<usize>]) -> CommResult<()> {
    let size = sends.len();
    for (q, (s, r)) in sends.iter().zip(recvs).enumerate() {
        if s.len() != size || r.len() != size {
            return Err(CommError::Mismatch(format!(
                "all_to_all_v (peers): rank {q} gave {} send and {} receive counts for {size} \
                 ranks",
                s.len(),
                r.len()
            )));
        }
    }
    for a in 0..size {
        for b in 0..size {
            if sends[a][b] != recvs[b][a] {
                return Err(CommError::Mismatch(format!(
                    "all_to_all_v (peers): rank {a} sends {} units to rank {b}, which expects {}",
                    sends[a][b], recvs[b][a]
                )));
            }
        }
    }
    Ok(())
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
    /// ranks calling a different operation, kind or count is an error on every rank (for
    /// [`PeerOp::AllToAllV`]: counts that disagree between sender and receiver, see
    /// [`check_all_to_all_v`]).
    fn exchange(
        &self,
        op: PeerOp<'_>,
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
    rank: usize,
    posts: Vec<PeerPost>,
    /// Every rank's send counts of an all-to-all-v (empty for the other operations).
    sends: Vec<Vec<usize>>,
    presence: Option<Box<dyn PeerPresence + 'a>>,
}

impl<'a> PeerCall<'a> {
    /// Rank `rank`'s call with every rank's `posts` (rank order), present through `presence`.
    pub fn new(rank: usize, posts: Vec<PeerPost>, presence: Box<dyn PeerPresence + 'a>) -> Self {
        Self {
            rank,
            posts,
            sends: Vec::new(),
            presence: Some(presence),
        }
    }

    /// The same call of an all-to-all-v whose ranks send `sends[q][p]` units (checked with
    /// [`check_all_to_all_v`]).
    pub fn with_sends(mut self, sends: Vec<Vec<usize>>) -> Self {
        self.sends = sends;
        self
    }

    /// This rank's plan of `op` on `count` units ([`PeerOp::plan`]; an all-to-all-v from every
    /// rank's counts, [`all_to_all_v_plan`]).
    pub fn plan(&self, op: PeerOp<'_>, count: usize, in_place: bool) -> CommResult<PeerPlan> {
        match op {
            PeerOp::AllToAllV { .. } if in_place => Err(CommError::InvalidArgument(
                "all_to_all_v (peers) in place".into(),
            )),
            PeerOp::AllToAllV { .. } => all_to_all_v_plan(self.rank, &self.sends),
            _ => op.plan(self.rank, self.posts.len(), count, in_place),
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

    #[test]
    fn all_to_all_v_plans_read_each_chunk_once_in_rank_order() {
        // Rank q sends rank p `(q + 2p) % 3` units (zeros included).
        let size = 3;
        let sends: Vec<Vec<usize>> = (0..size)
            .map(|q| (0..size).map(|p| (q + 2 * p) % 3).collect())
            .collect();
        let recvs: Vec<Vec<usize>> = (0..size)
            .map(|p| (0..size).map(|q| sends[q][p]).collect())
            .collect();
        check_all_to_all_v(&sends, &recvs).unwrap();
        for rank in 0..size {
            let plan = all_to_all_v_plan(rank, &sends).unwrap();
            let mut at = 0;
            let mut expected = Vec::new();
            for (q, counts) in sends.iter().enumerate() {
                let len = counts[rank];
                if len > 0 {
                    let from = counts[..rank].iter().sum();
                    expected.push(Transfer {
                        at,
                        len,
                        sources: vec![(q, from)],
                    });
                }
                at += len;
            }
            assert_eq!(plan.transfers, expected);
            assert!(!plan.write_after_all_read);
        }
        let mut wrong = recvs.clone();
        wrong[1][0] += 1;
        assert!(matches!(
            check_all_to_all_v(&sends, &wrong),
            Err(CommError::Mismatch(_))
        ));
        assert!(all_to_all_v_plan(0, &[vec![1], vec![1, 1]]).is_err());
    }
}
