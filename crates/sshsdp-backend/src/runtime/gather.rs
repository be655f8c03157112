//! Gathering: an op that meets a parameter handle asks [`Runtime::view`] for it; the bucket is
//! made resident through the schedule and residency stages (one all-gather on the shard lane,
//! the next bucket prefetched), and the parameter is a view into it.

use burn_backend::{Backend, Shape};

use super::{Runtime, State};
use crate::lanes::Reply;
use crate::runtime_units::Gathered;
use crate::timeline::Track;

impl<B: Backend> Runtime<B> {
    /// Parameter `index` as a tensor of `B`: a view into its gathered bucket.
    pub(crate) fn view(&self, index: usize) -> B::FloatTensorPrimitive {
        let p = &self.plan.params()[index];
        let shape = Shape::from(p.spec.shape.clone());
        let zeros = |shape| B::float_zeros(shape, &self.ctx.device, burn_backend::FloatDType::F32);
        let mut st = self.lock();
        let b = p.bucket;
        if st.updating {
            let failure = format!(
                "parameter `{}` was read while an update step held the pieces: commit the step \
                 first",
                p.spec.path
            );
            self.record_failure(&mut st, failure);
            return zeros(shape);
        }
        if !self.make_resident(&mut st, b) {
            return zeros(shape);
        }
        let bucket = &st.buckets[b];
        bucket.resident().expect("made resident").params[bucket.member(index)].clone()
    }

    /// Gathers bucket `b` if it is not resident (waiting for its prefetch if one is in flight),
    /// then prefetches the bucket the schedule expects next; `false` after a failure.
    pub(super) fn make_resident(&self, st: &mut State<B>, b: usize) -> bool {
        if st.buckets[b].resident().is_some() {
            return true;
        }
        if let Err(e) = sshsdp_comm::faults::inject("sshsdp::gather", self.world_rank) {
            self.record_failure(st, e);
        }
        // After a failure the gather is still queued (it fails at once on every rank: see
        // `worker::run`) and the bucket is installed as zeros, so that this rank's later calls
        // are exactly its peers' (the same schedule, prefetches included): the ranks stay in
        // step until the update reports the failure.
        let reply = match st.buckets[b].take_gather() {
            Some(reply) => {
                st.counters.prefetched += 1;
                reply
            }
            None => self.start_gather(st, b),
        };
        let zeros = |st: &State<B>| st.buckets[b].zeros_gathered();
        let full = match self.wait(b, "wait gather", reply) {
            Ok(full) if st.failure.is_none() => full,
            Ok(_) => zeros(st),
            Err(e) => {
                self.record_failure(st, e.to_string());
                zeros(st)
            }
        };
        self.count_gather(st, &full);
        if !self.install(st, b, full) {
            return false;
        }
        if st.schedule.in_backward() {
            st.counters.backward_gathers += 1;
        }
        let buckets = st.buckets.len();
        for other in st.schedule.gathered(b, buckets) {
            st.release(other);
        }
        self.prefetch_after(st, b);
        true
    }

    /// Queues the gather of the bucket the schedule expects after `b`, so it runs on the
    /// communication lane while `b` computes.
    pub(super) fn prefetch_after(&self, st: &mut State<B>, b: usize) {
        let Some(next) = st.schedule.next_after(b) else {
            return;
        };
        if st.buckets[next].is_sharded() {
            let reply = self.start_gather(st, next);
            st.buckets[next].set_gathering(reply);
        }
    }

    /// Queues the gather of the bucket the next forward needs first, at the end of a step, so
    /// that it overlaps what the host does until then (the update's tail, the data loader).
    /// Dropped unused by the next update's start ([`Self::drop_prefetches`]).
    pub(super) fn prefetch_first(&self, st: &mut State<B>) {
        let Some(first) = st.schedule.first_forward() else {
            return;
        };
        if st.failure.is_none() && st.buckets[first].is_sharded() {
            let reply = self.start_gather(st, first);
            st.buckets[first].set_gathering(reply);
        }
    }

    /// Completes and drops the gathers queued for a use that did not come (they ran on every
    /// rank): an update is about to change the shards they read.
    pub(super) fn drop_prefetches(&self, st: &mut State<B>) -> Result<(), crate::HsdpError> {
        for b in 0..st.buckets.len() {
            if let Some(reply) = st.buckets[b].take_gather() {
                if let Err(e) = self.wait(b, "wait unused prefetch", reply) {
                    self.record_failure(st, e.to_string());
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Waits for the gathers in flight and keeps their results (ready) for their use. (Not a
    /// wait of the step: not on the timeline.)
    pub(super) fn settle_prefetches(&self, st: &mut State<B>) {
        for b in 0..st.buckets.len() {
            if let Some(reply) = st.buckets[b].take_gather() {
                let settled = match reply.wait() {
                    Ok(gathered) => Reply::ready(gathered),
                    Err(e) => Reply::failed(e),
                };
                st.buckets[b].set_gathering(settled);
            }
        }
    }

    /// Queues the all-gather of bucket `b`'s runtime shards.
    pub(super) fn start_gather(&self, st: &mut State<B>, b: usize) -> Reply<Gathered> {
        let State {
            buckets, counters, ..
        } = st;
        buckets[b].start_gather(&self.ctx, counters)
    }

    /// Waits for `reply`, timed as the model thread's wait on bucket `b`.
    pub(super) fn wait<T>(
        &self,
        b: usize,
        name: &'static str,
        reply: Reply<T>,
    ) -> sshsdp_comm::CommResult<T> {
        self.ctx
            .timeline
            .span(Track::Model, name, Some(b), || reply.wait())
    }

    /// Counts the bytes of a completed gather.
    pub(super) fn count_gather(&self, st: &mut State<B>, full: &Gathered) {
        if self.plan.config().sharding == sshsdp_plan::Sharding::Ddp {
            // Replicated parameters are copied into a fresh tensor after each update.
            st.counters.param_bytes_copied += full.bytes();
        } else {
            st.counters.gathers += 1;
            // Every rank's part but our own.
            let shards = self.plan.runtime_shards() as u64;
            st.counters.gathered_bytes += full.bytes() - full.bytes() / shards;
        }
    }

    /// Materialises the gathered units `full` as bucket `b`'s parameters (→ `Unsharded`);
    /// `false` after recording a failure.
    pub(super) fn install(&self, st: &mut State<B>, b: usize, full: Gathered) -> bool {
        st.release(b);
        let State {
            buckets, counters, ..
        } = &mut *st;
        match buckets[b].install(&self.ctx, full, counters) {
            Ok(bytes) => {
                st.resident_bytes += bytes;
                st.counters.peak_resident_bytes =
                    st.counters.peak_resident_bytes.max(st.resident_bytes);
                true
            }
            Err(e) => {
                self.record_failure(st, e.to_string());
                false
            }
        }
    }
}
