//! The rendezvous behind the threads engine: ranks meet in a slot keyed by the call's sequence
//! number, publish their buffers, move data directly between each other's buffers, and leave
//! together.
//!
//! Matching by sequence number (not by arrival order) lets several collectives be in flight at
//! once — an asynchronous all-gather on a helper thread next to a synchronous call — as long as
//! every rank issues them in the same order.
//!
//! Safety protocol for the raw buffer addresses published in a slot: a rank only reads or writes
//! a peer's buffer after *all* ranks have arrived, and no rank returns from the call until every
//! rank that passed arrival has departed (departure is done by a guard, so it also happens when a
//! thread unwinds). Once the group has failed no arrival can complete, so a rank leaving on a
//! timeout or failure has had its buffers read by no one.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub(crate) use crate::call::CallDesc as OpDesc;
use crate::{CommError, CommResult};

/// Addresses of a rank's send and receive buffers (0 when unused).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RawBufs {
    pub send: usize,
    pub recv: usize,
    /// The rank's [`super::Traffic`] counters (0 for calls without data).
    pub traffic: usize,
}

type Payload = Arc<dyn Any + Send + Sync>;

struct Slot {
    desc: OpDesc,
    bufs: Vec<RawBufs>,
    present: Vec<bool>,
    arrived: usize,
    middle: usize,
    departed: usize,
    colors: Vec<(usize, usize)>,
    payload: Option<Payload>,
    /// What each rank published besides its raw buffers (device buffer descriptions).
    posts: Vec<Option<Payload>>,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    failure: Option<String>,
    /// Per finished call: the group's failure when its last rank departed, and how many ranks
    /// have yet to read it ([`Group::depart_checked`]).
    finished: HashMap<u64, (Option<String>, usize)>,
}

/// Every group of one world — the world's and all split from it, directly or not. Failing the
/// family (a rank panicked, or a rank aborted after a local error) fails each of its groups, so
/// every rank's call on any communicator of the world returns an error at once instead of
/// waiting for its timeout.
#[derive(Default)]
pub(crate) struct Family {
    groups: Mutex<Vec<Weak<Group>>>,
    failure: Mutex<Option<String>>,
}

impl Family {
    /// Fails every group of the family, now and any made later.
    pub fn fail(&self, reason: String) {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(reason.clone());
        let groups = self
            .groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for group in groups.iter().filter_map(Weak::upgrade) {
            group.fail(reason.clone());
        }
    }
}

/// Shared state of one communicator's ranks.
pub(crate) struct Group {
    size: usize,
    timeout: Duration,
    family: Arc<Family>,
    state: Mutex<State>,
    cv: Condvar,
}

/// Everything a rank learns at arrival: all ranks' buffers and the split payload if any.
pub(crate) struct Arrival {
    pub bufs: Vec<RawBufs>,
    pub payload: Option<Payload>,
    /// Every rank's post ([`Group::arrive_posting`]), in rank order.
    pub posts: Vec<Option<Payload>>,
}

/// Builds the payload of a split from every rank's `(color, key)` (new groups join `family`);
/// run by the last arriver.
pub(crate) type SplitBuilder = fn(&[(usize, usize)], Duration, &Arc<Family>) -> Payload;

impl Group {
    /// A group of `size` ranks in `family` (failed from the start if the family has failed).
    pub fn new(size: usize, timeout: Duration, family: &Arc<Family>) -> Arc<Self> {
        let group = Arc::new(Self {
            size,
            timeout,
            family: family.clone(),
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let mut groups = family.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|g| g.strong_count() > 0);
        groups.push(Arc::downgrade(&group));
        drop(groups);
        if let Some(reason) = family
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            group.fail(reason);
        }
        group
    }

    /// The family of groups this one belongs to.
    pub fn family(&self) -> &Arc<Family> {
        &self.family
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state inconsistent (every update is
        // a single assignment or counter bump), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the group failed: every call not yet past arrival returns an error.
    pub fn fail(&self, reason: String) {
        let mut st = self.lock();
        st.failure.get_or_insert(reason);
        self.cv.notify_all();
    }

    /// Phase 1: publish this rank's buffers and wait (up to the timeout) for every rank.
    pub fn arrive(
        &self,
        seq: u64,
        rank: usize,
        desc: OpDesc,
        bufs: RawBufs,
        color: Option<(usize, usize, SplitBuilder)>,
    ) -> CommResult<Arrival> {
        self.arrive_inner(seq, rank, desc, bufs, color, None)
    }

    /// Phase 1 of a call whose data the caller moves itself: publish `post` (a description of
    /// this rank's buffers) and wait (up to the timeout) for every rank's.
    pub fn arrive_posting(
        &self,
        seq: u64,
        rank: usize,
        desc: OpDesc,
        traffic: usize,
        post: Payload,
    ) -> CommResult<Arrival> {
        let bufs = RawBufs {
            traffic,
            ..RawBufs::default()
        };
        self.arrive_inner(seq, rank, desc, bufs, None, Some(post))
    }

    fn arrive_inner(
        &self,
        seq: u64,
        rank: usize,
        desc: OpDesc,
        bufs: RawBufs,
        color: Option<(usize, usize, SplitBuilder)>,
        post: Option<Payload>,
    ) -> CommResult<Arrival> {
        let mut st = self.lock();
        if let Some(f) = &st.failure {
            return Err(CommError::PeerFailed(f.clone()));
        }
        let size = self.size;
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            desc,
            bufs: vec![RawBufs::default(); size],
            present: vec![false; size],
            arrived: 0,
            middle: 0,
            departed: 0,
            colors: vec![(0, 0); size],
            payload: None,
            posts: vec![None; size],
        });
        if slot.desc != desc {
            let msg = format!(
                "call #{seq}: rank {rank} called {desc} but another rank called {}",
                slot.desc
            );
            st.failure = Some(msg.clone());
            self.cv.notify_all();
            return Err(CommError::Mismatch(msg));
        }
        slot.bufs[rank] = bufs;
        slot.posts[rank] = post;
        slot.present[rank] = true;
        slot.arrived += 1;
        if let Some((c, k, _)) = color {
            slot.colors[rank] = (c, k);
        }
        if slot.arrived == size {
            if let Some((_, _, build)) = color {
                slot.payload = Some(build(&slot.colors, self.timeout, &self.family));
            }
            self.cv.notify_all();
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let slot = st.slots.get(&seq).expect("slot lives until all depart");
            if slot.arrived == size {
                return Ok(Arrival {
                    bufs: slot.bufs.clone(),
                    payload: slot.payload.clone(),
                    posts: slot.posts.clone(),
                });
            }
            if let Some(f) = &st.failure {
                return Err(CommError::PeerFailed(f.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..size).filter(|&r| !slot.present[r]).collect();
                st.failure = Some(format!(
                    "rank {rank} timed out in {} after {:?} waiting for ranks {missing:?}",
                    desc.name, self.timeout
                ));
                self.cv.notify_all();
                return Err(CommError::Timeout {
                    op: desc.name,
                    after: self.timeout,
                    missing,
                });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Phase 2 (all-reduce): wait until every rank finished its first data phase. All ranks are
    /// past arrival and run bounded code, so this needs no timeout.
    fn middle(&self, seq: u64, wait: bool) {
        let mut st = self.lock();
        let slot = st.slots.get_mut(&seq).expect("slot lives until all depart");
        slot.middle += 1;
        if slot.middle == self.size {
            self.cv.notify_all();
        }
        while wait && st.slots.get(&seq).is_some_and(|s| s.middle < self.size) {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Phase 3: leave, and wait until every rank has stopped touching this rank's buffers;
    /// returns the group's failure as it was when the last rank departed (a failure after the
    /// call is not its own).
    pub fn depart(&self, seq: u64) -> Option<String> {
        let mut st = self.lock();
        let slot = st.slots.get_mut(&seq).expect("slot lives until all depart");
        slot.departed += 1;
        if slot.departed == self.size {
            st.slots.remove(&seq);
            let failure = st.failure.clone();
            if self.size > 1 {
                st.finished.insert(seq, (failure.clone(), self.size - 1));
            }
            self.cv.notify_all();
            return failure;
        }
        self.cv.notify_all();
        while st.slots.contains_key(&seq) {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        let (failure, left) = st
            .finished
            .get_mut(&seq)
            .expect("recorded by the last rank");
        let failure = failure.clone();
        *left -= 1;
        if *left == 0 {
            st.finished.remove(&seq);
        }
        failure
    }
}

/// A rank's presence in a call after arrival. Dropping it departs, so a rank that unwinds
/// mid-call still releases its peers (and counts for a middle barrier it never reached).
pub(crate) struct CallGuard<'a> {
    group: &'a Group,
    seq: u64,
    pending_middle: bool,
    departed: bool,
}

impl<'a> CallGuard<'a> {
    /// Guards call `seq`; `has_middle` for calls with a middle barrier.
    pub fn new(group: &'a Group, seq: u64, has_middle: bool) -> Self {
        Self {
            group,
            seq,
            pending_middle: has_middle,
            departed: false,
        }
    }

    /// The group of the call.
    pub fn group(&self) -> &'a Group {
        self.group
    }

    /// Waits at the middle barrier.
    pub fn middle(&mut self) {
        self.pending_middle = false;
        self.group.middle(self.seq, true);
    }
}

impl CallGuard<'_> {
    /// Departs now (once); the group's failure when the last rank departed, if any.
    pub fn depart(&mut self) -> Option<String> {
        if self.pending_middle {
            self.pending_middle = false;
            self.group.middle(self.seq, false);
        }
        if self.departed {
            return None;
        }
        self.departed = true;
        self.group.depart(self.seq)
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        let _ = self.depart();
    }
}
