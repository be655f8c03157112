//! What keeps an MPI job's ranks in step when something goes wrong: the call check before every
//! collective, the shared failure state behind [`crate::Collective::abort_handle`], and the
//! watchdog that ends a job whose collective never completes.
//!
//! * **Call check** ([`MpiOptions::check_calls`], on by default): before each collective every
//!   rank contributes its call — operation, element type, count, root, reduction and
//!   [`crate::CallTag`] — and whether it has failed, in one `MPI_Allreduce` of 17 `i64`s with `MPI_MAX`
//!   (each field is sent as `x` and `−x`, so one maximum gives both the largest and the
//!   smallest value). Ranks whose calls differ all get [`CommError::Mismatch`]; if any rank has
//!   failed, all get [`CommError::PeerFailed`] in the same call, and no data moves. This is
//!   the error-flag protocol: a *soft* fault (an error or a caught panic on a rank that goes on
//!   calling) is an error on every rank at the next collective. It costs one small all-reduce
//!   per collective (measured by `examples/mpi_conformance.rs`).
//! * **Watchdog** ([`MpiOptions::watchdog`], 10 minutes by default): a thread of the process
//!   notes when each collective starts; one that has not returned within the limit means a
//!   peer died, hangs or stopped calling (a *hard* fault, which Open MPI without its
//!   fault-tolerance extension cannot report to the survivors), and the watchdog prints what
//!   was pending and calls `MPI_Abort`, so `mpirun` ends the whole job with a non-zero status
//!   instead of hanging.
//!
//! One [`Guard`] serves a session's world communicator and every communicator split from it.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;

use super::raw::check;
use crate::call::{CallDesc, WORD_NAMES};
use crate::{CommError, CommResult};

/// Settings of an MPI session, equal on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpiOptions {
    /// Check before every collective that all ranks make the same call and share failures
    /// (see the module documentation). Off: a mismatch is undefined behaviour of the MPI job
    /// and a failed rank's peers wait for the watchdog.
    pub check_calls: bool,
    /// How long one collective may take before the watchdog ends the job with `MPI_Abort`;
    /// `None` for no watchdog.
    pub watchdog: Option<Duration>,
}

impl Default for MpiOptions {
    fn default() -> Self {
        Self {
            check_calls: true,
            watchdog: Some(Duration::from_secs(600)),
        }
    }
}

/// The exit status of a job the watchdog ends.
pub const WATCHDOG_EXIT_CODE: c_int = 124;

/// The state a session's communicators share.
pub(super) struct Guard {
    world_rank: usize,
    options: MpiOptions,
    failure: Mutex<Option<String>>,
    watch: Arc<Watch>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// Communicators of the session not yet freed.
    live: Mutex<usize>,
    freed: Condvar,
}

/// A communicator's registration with its session; dropping it (after the communicator is
/// freed) lets the session finalise MPI once none is left.
pub(super) struct Live(Arc<Guard>);

impl Live {
    /// The session's guard.
    pub fn guard(&self) -> &Arc<Guard> {
        &self.0
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = self.0.live.lock().unwrap_or_else(|p| p.into_inner());
        *live -= 1;
        self.0.freed.notify_all();
    }
}

/// Collectives in flight, for the watchdog.
#[derive(Default)]
struct Watch {
    inflight: Mutex<HashMap<u64, (Instant, String)>>,
    next: AtomicU64,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// A collective in flight; dropping it tells the watchdog it returned.
pub(super) struct InFlight {
    watch: Option<Arc<Watch>>,
    id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(w) = &self.watch {
            w.inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.id);
        }
    }
}

impl Guard {
    /// A session's guard; starts the watchdog thread if the options ask for one.
    pub fn new(world_rank: usize, options: MpiOptions) -> CommResult<Arc<Self>> {
        let guard = Arc::new(Self {
            world_rank,
            options,
            failure: Mutex::new(None),
            watch: Arc::new(Watch::default()),
            watchdog: Mutex::new(None),
            live: Mutex::new(0),
            freed: Condvar::new(),
        });
        if let Some(limit) = options.watchdog {
            let watch = Arc::downgrade(&guard.watch);
            let thread = std::thread::Builder::new()
                .name(format!("mpi-watchdog-{world_rank}"))
                .spawn(move || watchdog(watch, world_rank, limit))
                .map_err(|e| CommError::Engine(format!("starting the MPI watchdog: {e}")))?;
            *guard.watchdog.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        }
        Ok(guard)
    }

    /// Registers a communicator of the session (see [`Live`]).
    pub fn register(self: &Arc<Self>) -> Live {
        *self.live.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Live(self.clone())
    }

    /// Waits up to `limit` until every communicator of the session is freed; returns how many
    /// are still alive.
    pub fn wait_freed(&self, limit: Duration) -> usize {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (live, _) = self
            .freed
            .wait_timeout_while(live, limit, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
        *live
    }

    /// The session's options.
    pub fn options(&self) -> MpiOptions {
        self.options
    }

    /// Marks this rank failed: its next collective on any communicator of the session tells
    /// the peers (with call checks), and fails.
    pub fn fail(&self, reason: &str) {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| reason.to_string());
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Notes `call` as started, for the watchdog.
    pub fn enter(&self, call: &CallDesc) -> InFlight {
        if self.options.watchdog.is_none() {
            return InFlight { watch: None, id: 0 };
        }
        let id = self.watch.next.fetch_add(1, Ordering::Relaxed);
        self.watch
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (Instant::now(), call.to_string()));
        InFlight {
            watch: Some(self.watch.clone()),
            id,
        }
    }

    /// The call check on communicator `comm`: every rank's call and failure state, agreed in
    /// one all-reduce. Without call checks (`checked` false), only this rank's own failure is
    /// reported.
    pub fn agree(&self, comm: ffi::MPI_Comm, checked: bool, call: &CallDesc) -> CommResult<()> {
        let local = self.failure();
        if !checked {
            return match local {
                Some(reason) => Err(CommError::PeerFailed(reason)),
                None => Ok(()),
            };
        }
        let words = call.words();
        let mut send = [0i64; 1 + 2 * WORD_NAMES.len()];
        // Which rank failed, plus one (0: none); the maximum names one failed rank.
        send[0] = local.as_ref().map_or(0, |_| {
            i64::try_from(self.world_rank).unwrap_or(i64::MAX - 1) + 1
        });
        for (i, &w) in words.iter().enumerate() {
            send[1 + i] = w;
            send[1 + WORD_NAMES.len() + i] = w.saturating_neg();
        }
        let mut recv = [0i64; 1 + 2 * WORD_NAMES.len()];
        // SAFETY: `send` and `recv` are distinct arrays of `send.len()` i64s, the datatype is
        // MPI's 64-bit integer, and `comm` is a live communicator of this session.
        check("MPI_Allreduce (call check)", unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len() as c_int,
                i64::equivalent_datatype().as_raw(),
                SystemOperation::max().as_raw(),
                comm,
            )
        })?;
        if let Some(reason) = local {
            return Err(CommError::PeerFailed(reason));
        }
        if recv[0] > 0 {
            let reason = format!("rank {} (of the world) failed", recv[0] - 1);
            self.fail(&reason);
            return Err(CommError::PeerFailed(reason));
        }
        let differ: Vec<&str> = (0..WORD_NAMES.len())
            .filter(|&i| recv[1 + i] != recv[1 + WORD_NAMES.len() + i].saturating_neg())
            .map(|i| WORD_NAMES[i])
            .collect();
        if differ.is_empty() {
            return Ok(());
        }
        let msg = format!(
            "rank {} called {}, and the ranks' calls differ in {}",
            self.world_rank,
            call,
            differ.join(", ")
        );
        self.fail(&msg);
        Err(CommError::Mismatch(msg))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        *self.watch.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.watch.wake.notify_all();
        if let Some(t) = self
            .watchdog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }
}

/// The watchdog's loop: wakes a few times per `limit`, and ends the job if a collective has
/// been in flight longer.
fn watchdog(watch: Weak<Watch>, world_rank: usize, limit: Duration) {
    let poll = (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        let Some(w) = watch.upgrade() else { return };
        let stop = w.stop.lock().unwrap_or_else(|p| p.into_inner());
        if *stop {
            return;
        }
        let (stop, _) = w
            .wake
            .wait_timeout(stop, poll)
            .unwrap_or_else(|p| p.into_inner());
        if *stop {
            return;
        }
        drop(stop);
        let now = Instant::now();
        let overdue: Vec<String> = w
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|(start, _)| now.duration_since(*start) > limit)
            .map(|(start, what)| format!("{what} for {:.1?}", now.duration_since(*start)))
            .collect();
        if !overdue.is_empty() {
            eprintln!(
                "sshsdp MPI watchdog: rank {world_rank}: collective(s) pending longer than \
                 {limit:?} (a peer died, hangs or stopped calling): {}; ending the job with \
                 MPI_Abort({WATCHDOG_EXIT_CODE})",
                overdue.join("; ")
            );
            // SAFETY: MPI is initialised (the guard lives only within a session) and runs at
            // MPI_THREAD_MULTIPLE, so any thread may call MPI_Abort.
            unsafe {
                ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, WATCHDOG_EXIT_CODE);
            }
            // MPI_Abort does not return on any known implementation; if it does, do not hang.
            std::process::exit(WATCHDOG_EXIT_CODE);
        }
    }
}
