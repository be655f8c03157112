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
        let mut expected = vec![0; st.buckets.len()];
        for &i in indices {
            expected[self.plan.params()[i].bucket] += 1;
            st.received[i] = true;
        }
        for (bucket, expected) in st.buckets.iter_mut().zip(expected) {
            bucket.expect_gradients(expected);
        }
        st.schedule.set_backward(!indices.is_empty());
        if st.schedule.reshards() && st.failure.is_none() {
            // The last bucket of forward is the first of backward: it stays; prefetch the one
            // before it.
            if let Some(last) = st.schedule.last_forward() {
                if st.buckets[last].resident().is_some() {
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
        let (mut st, complete) = if self.ctx.grads == Placement::Device {
            let mut st = self.lock();
            let k = st.buckets[b].member(index);
            let complete = st.buckets[b].accumulate_on_device(k, grad);
            (st, complete)
        } else {
            let accumulated = with_f32_values::<B, _>(grad, &self.ctx.traffic, |values| {
                let mut st = self.lock();
                let k = st.buckets[b].member(index);
                let complete = st.buckets[b].accumulate(k, values);
                st.counters.grad_bytes_copied += 4 * values.len() as u64;
                (st, complete)
            });
            match accumulated {
                Ok((st, complete)) => (st, complete),
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
            match st.buckets[b].reduce(&self.ctx) {
                Ok((reduced, read_back)) => {
                    st.counters.reduced_bytes += reduced;
                    st.counters.grad_bytes_copied += read_back;
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
            if st.buckets.iter().all(|b| b.pending_gradients() == 0) {
                st.schedule.set_backward(false);
            }
        }
    }
}
