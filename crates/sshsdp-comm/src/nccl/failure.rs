//! How an [`NcclComm`] waits and fails: the bounded [`NcclComm::synchronize`] under the
//! watchdog, the liveness shared with the rank's other lanes, and `ncclCommAbort`.

use std::sync::Arc;
use std::time::Duration;

use cudarc::nccl::result::NcclError;
use cudarc::nccl::{result, sys};

use super::watch::{wait_until, Liveness, Progress};
use super::{cuda_error, nccl_error, NcclComm};
use crate::CommResult;

impl NcclComm {
    /// Waits until everything enqueued on the stream (collectives included) has finished, and
    /// reports an asynchronous CUDA error if one was recorded.
    ///
    /// A bounded wait (see `watch.rs`): it polls the stream, NCCL's asynchronous error and this
    /// rank's liveness, and gives up after the watchdog timeout ([`NcclComm::timeout`]). On an
    /// error, an abort or a timeout the communicator is aborted (`ncclCommAbort`), the rank's
    /// other lanes fail their next call, and this call returns the error.
    pub fn synchronize(&self) -> CommResult<()> {
        const OP: &str = "synchronize";
        /// What a timeout names while the run starts (the bound that expired, and why it is
        /// long).
        const STARTING: &str = "synchronize (within the start-up bound \
            SSHSDP_NCCL_STARTUP_TIMEOUT_S, default 1800 s, which covers every rank compiling \
            its kernels in the first step)";
        const STEADY: &str = "synchronize (within the watchdog bound SSHSDP_NCCL_TIMEOUT_S, \
            default 600 s)";
        self.enter(OP)?;
        let (limit, named) = if self.live.is_starting() {
            (self.timeout.max(self.startup_timeout), STARTING)
        } else {
            (self.timeout, STEADY)
        };
        if let Err(failure) = wait_until(|| self.progress(), &self.live, limit) {
            let e = failure.into_error(named);
            self.abort_comm(&e.to_string());
            return Err(e);
        }
        self.context()
            .check_err()
            .map_err(|e| cuda_error("asynchronous CUDA error", e))
    }

    /// The watchdog timeout of [`NcclComm::synchronize`] (default
    /// [`DEFAULT_NCCL_TIMEOUT`](super::DEFAULT_NCCL_TIMEOUT), or
    /// [`NCCL_TIMEOUT_ENV`](super::NCCL_TIMEOUT_ENV) seconds).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the watchdog timeout of this communicator's waits.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Shares `live` with other communicators of this rank (e.g. its lanes): a failure or abort
    /// of one fails the next call of every other.
    pub fn with_liveness(mut self, live: Arc<Liveness>) -> Self {
        self.live = live;
        self
    }

    /// The liveness this communicator shares with the rank's others; [`Liveness::fail`] on it
    /// ends waits in progress with an error and fails later calls before they enqueue.
    pub fn liveness(&self) -> Arc<Liveness> {
        self.live.clone()
    }

    /// One look at the work queued on this communicator's stream.
    fn progress(&self) -> Progress {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.raw` is live (not aborted: `enter` checked the liveness, which an abort
        // sets first); `state` is a valid out-pointer. The symbol was checked by the probe.
        let got = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        if got != sys::ncclResult_t::ncclSuccess {
            return Progress::Failed(
                nccl_error("ncclCommGetAsyncError", NcclError(got), None).to_string(),
            );
        }
        if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress {
            return Progress::Failed(
                nccl_error("asynchronous NCCL error", NcclError(state), Some(self.raw)).to_string(),
            );
        }
        // SAFETY: the stream is live for as long as `self` holds it.
        match unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) } {
            cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS => Progress::Done,
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY => Progress::Pending,
            e => Progress::Failed(format!("cuStreamQuery: {e:?}")),
        }
    }

    /// Marks the rank failed and aborts this communicator (once): `ncclCommAbort` stops its
    /// kernels and frees it, so the stream drains and nothing waits on a dead peer.
    fn abort_comm(&self, reason: &str) {
        self.live.fail(reason);
        if !self.aborted.replace(true) {
            // SAFETY: `self.raw` is live and not used again (`aborted` is set; every call
            // checks the liveness, failed above, before touching it).
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }
}
