//! Collectives over the whole world outside the step (checkpoint agreements, buffer
//! broadcasts), queued on the replica lane in program order and settled like every other.

use burn_backend::Backend;

use super::{Runtime, State};
use crate::error::HsdpError;
use crate::timeline::Track;

impl<B: Backend> Runtime<B> {
    /// Every rank's `bytes` (all the same length), in rank order: an all-gather over the world
    /// on the replica lane, in program order with the runtime's other collectives.
    pub fn all_gather_world(&self, bytes: Vec<u8>) -> Result<Vec<u8>, HsdpError> {
        self.gather_world(&mut self.lock(), "world agreement", bytes)
    }

    /// World rank 0's `buf` on every rank (all pass the same length): a broadcast over the world
    /// on the replica lane, in program order with the runtime's other collectives; `stage`
    /// names it on the timeline. A failure is recorded.
    pub fn broadcast_world(
        &self,
        stage: &'static str,
        buf: Vec<f32>,
    ) -> Result<Vec<f32>, HsdpError> {
        let st = &mut self.lock();
        let reply = self.ctx.worker.broadcast_world(stage, buf);
        let received = self
            .ctx
            .timeline
            .span(Track::Model, "wait world broadcast", None, || reply.wait());
        self.settle_world(st, received)
    }

    /// [`Self::all_gather_world`] with the state held, labelled `stage`; a failure is recorded.
    pub(super) fn gather_world(
        &self,
        st: &mut State<B>,
        stage: &'static str,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, HsdpError> {
        // Made after a failure too (it fails at once: see `worker::run`): the ranks stay in step.
        let reply = self.ctx.worker.gather_world_bytes(stage, bytes);
        let gathered = self
            .ctx
            .timeline
            .span(Track::Model, "wait world all-gather", None, || reply.wait());
        self.settle_world(st, gathered)
    }

    /// A world collective's outcome: its value, or the failure this rank recorded before it
    /// (the collective was still made, so the ranks stay in step), or its own error, recorded.
    pub(super) fn settle_world<T>(
        &self,
        st: &mut State<B>,
        outcome: Result<T, sshsdp_comm::CommError>,
    ) -> Result<T, HsdpError> {
        match (outcome, &st.failure) {
            (Ok(value), None) => Ok(value),
            (Ok(_), Some(f)) => Err(HsdpError::Failed(f.clone())),
            (Err(e), _) => {
                self.record_failure(st, e.to_string());
                Err(e.into())
            }
        }
    }
}
