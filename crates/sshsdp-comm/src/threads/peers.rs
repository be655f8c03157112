//! [`PeerExchange`] on the threads engine: the call's rendezvous (arrival with every rank's
//! post, the middle barrier as the all-read barrier, departure) is the engine's own, so posts
//! are matched by call sequence, checked across ranks (operation, element type, count, root,
//! tag), bounded by the group's timeout and failed with the group.

use super::rendezvous::{Arrival, CallGuard, OpDesc};
use super::traffic::moved;
use super::ThreadComm;
use crate::peers::{PeerCall, PeerExchange, PeerOp, PeerPost, PeerPresence};
use crate::{CommError, CommResult, ElementKind, ReduceOp};

impl PeerExchange for ThreadComm {
    fn peer_rank(&self) -> usize {
        self.rank
    }

    fn peer_size(&self) -> usize {
        self.group.size()
    }

    fn exchange(
        &self,
        op: PeerOp,
        kind: ElementKind,
        count: usize,
        post: PeerPost,
    ) -> CommResult<PeerCall<'_>> {
        let desc = OpDesc {
            name: op.name(),
            kind: Some(kind),
            count,
            root: match op {
                PeerOp::Broadcast { root } => root,
                _ => 0,
            },
            op: op.sums().then_some(ReduceOp::Sum),
            tag: self.tag(),
        };
        if let PeerOp::Broadcast { root } = op {
            crate::check_root("broadcast", root, self.group.size())?;
        }
        let seq = self.next_seq();
        let Arrival { bufs, posts, .. } =
            self.group
                .arrive_posting(seq, self.rank, desc, self.traffic_ptr(), post)?;
        // Every rank counts for the all-read barrier, reached or not (at departure), so ranks
        // that wait there never wait for one that skips it.
        let guard = CallGuard::new(&self.group, seq, true);
        let posts: Option<Vec<PeerPost>> = posts.into_iter().collect();
        let posts = posts.ok_or_else(|| CommError::PeerFailed("a rank posted nothing".into()))?;
        // Traffic as the engine counts its own calls: what this rank reads of its peers'.
        let unit = kind.bytes();
        let plan = op.plan(self.rank, self.group.size(), count, false)?;
        for transfer in &plan.transfers {
            for &(q, _) in &transfer.sources {
                moved(&bufs, self.rank, q, transfer.len * unit);
            }
        }
        Ok(PeerCall::new(posts, Box::new(ThreadsPresence { guard })))
    }
}

/// A rank's presence in a threads-engine peers call.
struct ThreadsPresence<'a> {
    guard: CallGuard<'a>,
}

impl PeerPresence for ThreadsPresence<'_> {
    fn all_read(&mut self) {
        self.guard.middle();
    }

    fn fail(&self, reason: String) {
        self.guard.group().family().fail(reason);
    }

    fn depart(mut self: Box<Self>) -> Option<String> {
        self.guard.depart()
    }
}
