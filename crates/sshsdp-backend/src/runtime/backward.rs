//! Backward's entry points into the gradient stage: the parameters a backward will hand
//! gradients for ([`Runtime::begin_backward`]) and each final gradient as autodiff hands it
//! over ([`Runtime::submit_gradient`]), accumulated into its bucket and reduced once complete.

use burn_backend::Backend;

use super::Runtime;
use crate::config::Placement;
use crate::storage::with_f32_values;

impl<B: Backend> Runtime<B> {
    /// A backward pass starts; `indices` are the parameters that will receive a gradient.
    pub(crate) fn begin_backward(&self, indices: &[usize]) {
        self.retention.backward_started();
        let mut st = self.lock();
        st.grads
            .begin(indices.iter().map(|&i| (i, self.plan.params()[i].bucket)));
        st.schedule.set_backward(!indices.is_empty());
        if st.schedule.reshards() && st.failure.is_none() {
            // The last bucket of forward is the first of backward: it stays; prefetch the one
            // before it.
            if let Some(last) = st.schedule.last_forward() {
                if st.storage[last].resident().is_some() {
                    self.prefetch_after(&mut st, last);
                }
            }
        }
    }

    /// Parameter `index`'s final gradient: accumulate it into its bucket; reduce the bucket once
    /// every expected gradient has arrived.
    pub(crate) fn submit_gradient(&self, index: usize, grad: B::FloatTensorPrimitive) {
        let p = &self.plan.params()[index];
        let b = p.bucket;
        let k = index - self.plan.buckets()[b].params.start;
        let (mut st, complete) = if self.grad_placement == Placement::Device {
            let members = self.codecs[b].len();
            let mut st = self.lock();
            let complete = st.grads.accumulate_on_device(b, members, k, grad);
            (st, complete)
        } else {
            let accumulated = with_f32_values::<B, _>(grad, |values| {
                let mut st = self.lock();
                let complete = st.grads.accumulate(b, &self.codecs[b], k, values);
                st.counters.grad_bytes_copied += 4 * values.len() as u64;
                (st, complete)
            });
            match accumulated {
                Ok(((mut st, complete), downloaded)) => {
                    st.counters.downloaded_bytes += downloaded;
                    (st, complete)
                }
                Err(e) => {
                    let failure = format!("reading the gradient of {}: {e}", p.spec.path);
                    self.record_failure(&mut self.lock(), failure);
                    return;
                }
            }
        };
        if complete {
            if let Err(e) = sshsdp_comm::faults::inject("sshsdp::reduce", self.world_rank) {
                // The reduction is still queued (see `worker::run`): the ranks stay in step.
                self.record_failure(&mut st, e);
            }
            let how = (
                self.plan.config().sharding,
                self.plan.runtime_shards(),
                self.engine_on_device,
            );
            match st.grads.reduce(b, &self.codecs[b], &self.worker, how) {
                Ok(reduced) => {
                    st.counters.reduced_bytes += reduced.bytes;
                    st.counters.staged_bytes += reduced.staged;
                    st.counters.downloaded_bytes += reduced.staged;
                    st.counters.grad_bytes_copied += reduced.staged;
                }
                Err(e) => {
                    // Peers queue this bucket's reduction; theirs times out and fails the step.
                    self.record_failure(&mut st, format!("reading bucket {b}'s gradients: {e}"));
                }
            }
            if st.schedule.reshards() {
                // Every gradient of the bucket is in: backward needs its parameters no more.
                st.release(b);
            }
            if st.grads.complete() {
                st.schedule.set_backward(false);
            }
        }
    }
}
