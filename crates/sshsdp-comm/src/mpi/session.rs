//! [`MpiSession`]: MPI's lifetime in a process — initialised once, finalised on the thread
//! that initialised it, after every communicator is freed.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use mpi::environment::Universe;
use mpi::topology::Communicator;

use super::guard::{Guard, MpiOptions, WATCHDOG_EXIT_CODE};
use super::raw::in_place_sentinel;
use super::MpiComm;
use crate::{CommError, CommResult};

/// How long dropping a session waits for communicators still in use elsewhere (a runtime's
/// communication threads finishing) when the options set no watchdog.
const FINALIZE_WAIT: Duration = Duration::from_secs(60);

/// MPI in this process: made once, on the thread that will also finalise it (the type is
/// neither `Send` nor `Sync`, so it stays there), and the source of world communicators.
///
/// Communicators may move to other threads (a runtime's communication lanes) and outlive
/// nothing: dropping the session waits until every communicator made from it is freed, then
/// stops the watchdog and calls `MPI_Finalize` on this thread, as MPI requires of the thread
/// that initialised it. A communicator still alive after the wait (the watchdog's limit, or a
/// minute) cannot be freed safely any more: the session then ends the job with `MPI_Abort`
/// rather than finalise under it or hang.
///
/// ```no_run
/// use sshsdp_comm::mpi::MpiSession;
/// use sshsdp_comm::Collective;
///
/// let mpi = MpiSession::init().expect("MPI");
/// let world = mpi.world().expect("world communicator");
/// println!("rank {} of {}", world.rank(), world.size());
/// ```
pub struct MpiSession {
    // Field order: the guard (and with it the watchdog thread) goes before the universe,
    // whose drop finalises MPI.
    guard: Arc<Guard>,
    in_place: Option<*mut c_void>,
    universe: Universe,
    /// Keeps the session on its initialising thread.
    _here: PhantomData<*const ()>,
}

impl MpiSession {
    /// Initialises MPI (`MPI_THREAD_MULTIPLE`) with the default [`MpiOptions`].
    pub fn init() -> CommResult<Self> {
        Self::init_with(MpiOptions::default())
    }

    /// Initialises MPI (`MPI_THREAD_MULTIPLE`) with `options`, which must be equal on every
    /// rank. Fails with [`CommError::Unavailable`] if MPI is already initialised in this
    /// process (then pass that `Universe` to [`MpiSession::from_universe`]).
    pub fn init_with(options: MpiOptions) -> CommResult<Self> {
        let (universe, _) =
            mpi::initialize_with_threading(mpi::Threading::Multiple).ok_or_else(|| {
                CommError::Unavailable(
                    "MPI is already initialised in this process; pass its Universe to \
                     MpiSession::from_universe"
                        .into(),
                )
            })?;
        Self::from_universe(universe, options)
    }

    /// A session over a `Universe` this thread initialised, which the session now owns.
    pub fn from_universe(universe: Universe, options: MpiOptions) -> CommResult<Self> {
        // Communicators may move to another thread (the `Hsdp` runtime runs its collectives on
        // communication threads), which MPI allows only at MPI_THREAD_MULTIPLE.
        let level = mpi::environment::threading_support();
        if level != mpi::Threading::Multiple {
            return Err(CommError::Unavailable(format!(
                "MPI provides thread level {level:?}; MpiComm needs MPI_THREAD_MULTIPLE \
                 (initialise with mpi::initialize_with_threading(Threading::Multiple))"
            )));
        }
        let rank = usize::try_from(universe.world().rank())
            .map_err(|_| CommError::Engine("negative world rank".into()))?;
        let in_place = in_place_sentinel(&mpi::environment::library_version().unwrap_or_default());
        Ok(Self {
            guard: Guard::new(rank, options)?,
            in_place,
            universe,
            _here: PhantomData,
        })
    }

    /// A new world communicator: a duplicate of `MPI_COMM_WORLD` (so this engine's traffic
    /// never matches the application's own messages) with the `MPI_ERRORS_RETURN` handler.
    /// Collective over the world.
    pub fn world(&self) -> CommResult<MpiComm> {
        MpiComm::wrap(
            self.universe.world().duplicate(),
            self.in_place,
            None,
            self.guard.options().check_calls,
            self.guard.register(),
        )
    }

    /// The session's options.
    pub fn options(&self) -> MpiOptions {
        self.guard.options()
    }

    /// The MPI environment, for calls this engine does not wrap.
    pub fn universe(&self) -> &Universe {
        &self.universe
    }
}

impl Drop for MpiSession {
    fn drop(&mut self) {
        let limit = self.guard.options().watchdog.unwrap_or(FINALIZE_WAIT);
        let alive = self.guard.wait_freed(limit);
        if alive > 0 {
            eprintln!(
                "sshsdp MPI: {alive} communicator(s) still in use {limit:?} after the session \
                 ended; MPI cannot be finalised under them: ending the job with \
                 MPI_Abort({WATCHDOG_EXIT_CODE})"
            );
            // SAFETY: MPI is initialised (the universe is alive) at MPI_THREAD_MULTIPLE.
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, WATCHDOG_EXIT_CODE);
            }
            std::process::exit(WATCHDOG_EXIT_CODE);
        }
    }
}
