//! [`PeerExchange`] on the threads engine: the call's rendezvous (arrival with every rank's
//! post, the middle barrier as the all-read barrier, departure) is the engine's own, so posts
//! are matched by call sequence, checked across ranks (operation, element type, count, root,
//! tag; an all-to-all-v's counts between every pair), bounded by the group's timeout and failed
//! with the group.

use std::sync::Arc;

use super::rendezvous::{Arrival, CallGuard, OpDesc};
use super::traffic::moved;
use super::ThreadComm;
use crate::peers::{check_all_to_all_v, PeerCall, PeerExchange, PeerOp, PeerPost, PeerPresence};
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
        op: PeerOp<'_>,
        kind: ElementKind,
        count: usize,
        post: PeerPost,
    ) -> CommResult<PeerCall<'_>> {
        // An all-to-all-v's counts travel with its post, so every rank checks every pair.
        let (count, post) = match op {
            PeerOp::AllToAllV { send, recv } => {
                let counted = Counted {
                    send: send.to_vec(),
                    recv: recv.to_vec(),
                    post,
                };
                (0, Arc::new(counted) as PeerPost)
            }
            _ => (count, post),
        };
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
        let presence = Box::new(ThreadsPresence { guard });
        let call = match op {
            PeerOp::AllToAllV { .. } => {
                let counted: Vec<&Counted> = posts
                    .iter()
                    .map(|p| p.downcast_ref::<Counted>())
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        CommError::Mismatch("a rank posted no all_to_all_v counts".into())
                    })?;
                let sends: Vec<Vec<usize>> = counted.iter().map(|c| c.send.clone()).collect();
                let recvs: Vec<Vec<usize>> = counted.iter().map(|c| c.recv.clone()).collect();
                check_all_to_all_v(&sends, &recvs)?;
                let posts = counted.iter().map(|c| c.post.clone()).collect();
                PeerCall::new(self.rank, posts, presence).with_sends(sends)
            }
            _ => PeerCall::new(self.rank, posts, presence),
        };
        // Traffic as the engine counts its own calls: what this rank reads of its peers'.
        let unit = kind.bytes();
        let plan = call.plan(op, count, false)?;
        for transfer in &plan.transfers {
            for &(q, _) in &transfer.sources {
                moved(&bufs, self.rank, q, transfer.len * unit);
            }
        }
        Ok(call)
    }
}

/// An all-to-all-v rank's post with its counts.
struct Counted {
    send: Vec<usize>,
    recv: Vec<usize>,
    post: PeerPost,
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
