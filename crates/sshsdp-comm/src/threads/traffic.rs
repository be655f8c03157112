//! Traffic accounting of the threads engine: bytes each rank reads from its peers' buffers.

use std::sync::atomic::{AtomicU64, Ordering};

use super::rendezvous::RawBufs;

/// Bytes one rank moved to and from its peers, over every communicator of its world rank (the
/// world's and those split from it), counted by the engine where the data moves: each copy from
/// a peer's buffer counts as received by the reader and sent by the peer. A rank's copies within
/// its own buffers count for neither. Reductions count what each rank reads of its peers'
/// chunks (an all-reduce of `n` bytes over `W` ranks moves `2·n·(W−1)/W` each way, as a ring
/// would).
#[derive(Debug, Default)]
pub struct Traffic {
    sent: AtomicU64,
    received: AtomicU64,
}

/// A snapshot of [`Traffic`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficBytes {
    /// Bytes peers read from this rank's buffers.
    pub sent: u64,
    /// Bytes this rank read from its peers' buffers.
    pub received: u64,
}

/// Counts `bytes` read by rank `me` from rank `from`'s buffers (nothing when `from` is `me`).
pub(super) fn moved(all: &[RawBufs], me: usize, from: usize, bytes: usize) {
    if from == me || bytes == 0 {
        return;
    }
    // SAFETY: every rank published its communicator's `Traffic`, which that rank's communicator
    // (or its pending call) keeps alive until every rank has departed the call.
    let (mine, theirs) = unsafe {
        (
            &*(all[me].traffic as *const Traffic),
            &*(all[from].traffic as *const Traffic),
        )
    };
    mine.received.fetch_add(bytes as u64, Ordering::Relaxed);
    theirs.sent.fetch_add(bytes as u64, Ordering::Relaxed);
}

impl Traffic {
    /// The bytes counted so far.
    pub(super) fn snapshot(&self) -> TrafficBytes {
        TrafficBytes {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
        }
    }
}
