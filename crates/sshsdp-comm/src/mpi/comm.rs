//! [`MpiComm`]: one rank's MPI communicator, its state and settings (call checks,
//! reduce-scatter policy, scratch buffer), and the guard every collective runs under.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};

use super::guard::Live;
use super::raw::{check, engine};
use super::ReduceScatterPolicy;
use crate::call::CallDesc as Call;
use crate::{CallTag, CommResult};

// Named by doc links below.
#[cfg(doc)]
use crate::{mpi::MpiOptions, Collective};

/// One rank's communicator in an MPI job.
///
/// Field order matters: `comm` is freed (`MPI_Comm_free`) before `live` tells the session, so
/// MPI is never finalised under a live communicator.
pub struct MpiComm {
    pub(super) comm: SimpleCommunicator,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// `MPI_IN_PLACE` of the running MPI library, if recognised.
    pub(super) in_place: Option<*mut c_void>,
    /// How reduce-scatter runs.
    pub(super) rs_policy: ReduceScatterPolicy,
    /// The policy set by the caller, inherited by split communicators (otherwise each gets
    /// [`ReduceScatterPolicy::measured`] for its own size).
    pub(super) rs_override: Option<ReduceScatterPolicy>,
    /// Result buffer of the all-reduce reduce-scatter path, kept across calls (see
    /// [`MpiComm::release_scratch`]).
    pub(super) scratch: RefCell<Vec<f32>>,
    /// The label of the calls made now (see [`Collective::set_tag`]).
    pub(super) tag: Cell<CallTag>,
    /// Whether calls run the call check (see [`MpiOptions::check_calls`]).
    pub(super) check_calls: bool,
    pub(super) live: Live,
}

// SAFETY: MPI handles may be used from any thread once MPI runs at MPI_THREAD_MULTIPLE, which
// `MpiSession` checks before any communicator exists; the session's state is shared through an
// `Arc`; and `MpiComm` is not `Sync` (its scratch buffer is a `RefCell`), so one thread at a time
// uses a given communicator.
unsafe impl Send for MpiComm {}

impl MpiComm {
    pub(super) fn wrap(
        comm: SimpleCommunicator,
        in_place: Option<*mut c_void>,
        rs_override: Option<ReduceScatterPolicy>,
        check_calls: bool,
        live: Live,
    ) -> CommResult<Self> {
        // SAFETY: `comm` is a live intra-communicator owned by us; the error handler is a
        // predefined handle, valid between MPI_Init and MPI_Finalize (the Universe is alive).
        check("MPI_Comm_set_errhandler", unsafe {
            ffi::MPI_Comm_set_errhandler(comm.as_raw(), ffi::RSMPI_ERRORS_RETURN)
        })?;
        let rank = usize::try_from(comm.rank()).map_err(|_| engine("negative rank"))?;
        let size = usize::try_from(comm.size()).map_err(|_| engine("negative size"))?;
        Ok(Self {
            rank,
            size,
            comm,
            in_place,
            rs_policy: rs_override.unwrap_or(ReduceScatterPolicy::measured(size)),
            rs_override,
            scratch: RefCell::new(Vec::new()),
            tag: Cell::new(CallTag::NONE),
            check_calls,
            live,
        })
    }

    /// Turns the call check on or off for this communicator (and those split from it later);
    /// must be equal on all ranks. Off, a call costs one small all-reduce less, a mismatch is
    /// undefined behaviour of the MPI job, and a failed peer is found by the watchdog only.
    pub fn set_check_calls(&mut self, on: bool) {
        self.check_calls = on;
    }

    /// Whether calls on this communicator run the call check.
    pub fn checks_calls(&self) -> bool {
        self.check_calls
    }

    /// Runs collective `call` after the session's call check (see [`MpiOptions`]), watched by
    /// the watchdog; an engine error fails the session, so that every later call is an error on
    /// every rank rather than a mismatch.
    pub(super) fn guarded<R>(
        &self,
        call: Call,
        f: impl FnOnce() -> CommResult<R>,
    ) -> CommResult<R> {
        let guard = self.live.guard();
        let _watched = guard.enter(&call);
        guard.agree(self.raw(), self.check_calls, &call)?;
        let result = f();
        if let Err(e) = &result {
            guard.fail(&e.to_string());
        }
        result
    }

    /// The underlying rsmpi communicator, for calls this engine does not wrap. It has the
    /// `MPI_ERRORS_RETURN` handler, and rsmpi's safe calls ignore return codes: check results.
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// Whether in-place calls pass `MPI_IN_PLACE` (the MPI library was recognised) rather than
    /// staging this rank's input in a scratch buffer.
    pub fn uses_mpi_in_place(&self) -> bool {
        self.in_place.is_some()
    }

    /// How [`Collective::reduce_scatter`] picks its MPI call.
    pub fn reduce_scatter_policy(&self) -> ReduceScatterPolicy {
        self.rs_policy
    }

    /// Sets how [`Collective::reduce_scatter`] picks its MPI call; must be equal on all ranks.
    /// Communicators split afterwards inherit it.
    pub fn set_reduce_scatter_policy(&mut self, policy: ReduceScatterPolicy) {
        self.rs_policy = policy;
        self.rs_override = Some(policy);
    }

    /// Frees the scratch buffer of the all-reduce reduce-scatter path (it keeps the size of
    /// the largest `send` seen, so that repeated calls do not page-fault a fresh allocation).
    pub fn release_scratch(&self) {
        *self.scratch.borrow_mut() = Vec::new();
    }

    pub(super) fn raw(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }
}
