//! Bounded waits on NCCL work: what turns a dead or stuck peer into an error instead of a hang.
//!
//! NCCL kernels spin on the GPU until their peers' data arrives; a blocking
//! `cudaStreamSynchronize` behind one never returns if a peer died. So, as PyTorch's
//! ProcessGroupNCCL does, a wait here *polls*: the stream (`cuStreamQuery`), NCCL's
//! asynchronous error (`ncclCommGetAsyncError`: a peer's abort, a network failure), this
//! rank's [`Liveness`] (set by [`CommFactory::abort`](crate::CommFactory::abort) or an earlier
//! failure of any lane of the rank) and a watchdog deadline. Any of the last three aborts the
//! communicator (`ncclCommAbort`, which stops its kernels so the stream drains) and fails the
//! call; every later call on a communicator sharing the liveness then fails at once, so the
//! rank stays in step with peers that fail the same calls.
//!
//! The poll loop is [`wait_until`], apart from the CUDA calls so its rules are tested on any
//! machine.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::CommError;

/// Default watchdog timeout of an NCCL wait (PyTorch's ProcessGroupNCCL default too).
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment variable that overrides [`DEFAULT_NCCL_TIMEOUT`], in seconds (e.g. `30`).
pub const NCCL_TIMEOUT_ENV: &str = "SSHSDP_NCCL_TIMEOUT_S";

/// Default bound of a wait while a run is starting ([`Liveness::starting`]): the first
/// optimizer step, in which every rank compiles every kernel it will use (eight processes
/// compiling at once on one node can take many minutes).
pub const DEFAULT_NCCL_STARTUP_TIMEOUT: Duration = Duration::from_secs(1800);

/// The environment variable that overrides [`DEFAULT_NCCL_STARTUP_TIMEOUT`], in seconds.
pub const NCCL_STARTUP_TIMEOUT_ENV: &str = "SSHSDP_NCCL_STARTUP_TIMEOUT_S";

/// The watchdog timeout: [`NCCL_TIMEOUT_ENV`] if set to a positive number of seconds, else
/// [`DEFAULT_NCCL_TIMEOUT`]. A malformed value is an error, not silently the default.
pub fn timeout_from_env() -> Result<Duration, CommError> {
    seconds_from_env(NCCL_TIMEOUT_ENV, DEFAULT_NCCL_TIMEOUT)
}

/// The start-up bound: [`NCCL_STARTUP_TIMEOUT_ENV`] if set to a positive number of seconds,
/// else [`DEFAULT_NCCL_STARTUP_TIMEOUT`]; a malformed value is an error.
pub fn startup_timeout_from_env() -> Result<Duration, CommError> {
    seconds_from_env(NCCL_STARTUP_TIMEOUT_ENV, DEFAULT_NCCL_STARTUP_TIMEOUT)
}

pub(crate) fn seconds_from_env(var: &str, default: Duration) -> Result<Duration, CommError> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(secs) if secs > 0.0 && secs.is_finite() => Ok(Duration::from_secs_f64(secs)),
            _ => Err(CommError::InvalidArgument(format!(
                "{var}={s:?}: expected a positive number of seconds"
            ))),
        },
    }
}

/// Whether a rank's NCCL communicators may still be used: shared by every lane of a rank
/// (and the communicators split from them). The first failure's reason is kept.
///
/// It also says whether the run is still *starting*: then a wait is bounded by the larger of
/// the watchdog timeout and the start-up bound ([`NCCL_STARTUP_TIMEOUT_ENV`]), because peers
/// may be compiling kernels between collectives. [`Liveness::default`] is steady (a plain
/// communicator); [`Liveness::starting`] is what a runtime's lanes share until the runtime
/// calls [`Liveness::end_startup`] after its first optimizer step.
#[derive(Debug, Default)]
pub struct Liveness {
    failed: Mutex<Option<String>>,
    starting: std::sync::atomic::AtomicBool,
}

impl Liveness {
    /// A liveness in the start-up phase (see the type).
    pub fn starting() -> Self {
        Self {
            failed: Mutex::new(None),
            starting: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Ends the start-up phase: later waits are bounded by the watchdog timeout alone.
    pub fn end_startup(&self) {
        self.starting
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// Whether the start-up phase is still on.
    pub fn is_starting(&self) -> bool {
        self.starting.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks the rank failed (the first reason wins).
    pub fn fail(&self, reason: &str) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.get_or_insert_with(|| reason.to_string());
    }

    /// The failure, if any.
    pub fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `Err` at once when the rank has failed: what every call checks before it enqueues.
    pub fn check(&self, op: &str) -> Result<(), CommError> {
        match self.failure() {
            Some(reason) => Err(CommError::PeerFailed(format!(
                "{op}: the communicator was aborted earlier ({reason})"
            ))),
            None => Ok(()),
        }
    }
}

/// One look at queued work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Everything queued has finished.
    Done,
    /// Still running.
    Pending,
    /// The engine reported an error (asynchronous NCCL error, CUDA error).
    Failed(String),
}

/// Why [`wait_until`] gave up; the caller aborts the communicator for each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitFailure {
    /// The engine reported an error.
    Engine(String),
    /// The rank's [`Liveness`] was failed while waiting (another lane, or an abort).
    Aborted(String),
    /// The watchdog deadline passed.
    TimedOut(Duration),
}

impl WaitFailure {
    /// The error a call reports, naming `op`.
    pub fn into_error(self, op: &'static str) -> CommError {
        match self {
            WaitFailure::Engine(e) => CommError::Engine(format!("{op}: {e}")),
            WaitFailure::Aborted(reason) => {
                CommError::PeerFailed(format!("{op}: aborted while waiting ({reason})"))
            }
            WaitFailure::TimedOut(after) => CommError::Timeout {
                op,
                after,
                // NCCL does not say which peer is missing.
                missing: Vec::new(),
            },
        }
    }
}

/// Polls `poll` until it reports [`Progress::Done`], or fails on an engine error, a failed
/// `live`, or after `limit`. Spins briefly (collectives of small buffers finish in
/// microseconds), then sleeps between polls with a back-off capped at [`MAX_POLL_SLEEP`], so a
/// completion is seen within tens of microseconds of happening (plus the OS timer's slack,
/// about 50 µs on Linux), at the cost of a lane thread waking every few tens of microseconds
/// while a long collective runs. (A host callback on the stream, `cuLaunchHostFunc`, would wake
/// the thread at completion, but it runs on CUDA's own thread, serialises with the stream's
/// other host work and may not call CUDA; polling a cap this low costs a few percent of one core
/// and keeps the waiter one loop.)
pub fn wait_until(
    poll: impl FnMut() -> Progress,
    live: &Liveness,
    limit: Duration,
) -> Result<(), WaitFailure> {
    wait_until_on(poll, live, limit, &mut SystemClock(Instant::now()))
}

/// The most a waiter sleeps between two polls.
pub const MAX_POLL_SLEEP: Duration = Duration::from_micros(20);

/// Polls before the waiter starts sleeping.
const SPINS: u32 = 64;

/// What a waiter reads the time from and sleeps on: the system's, or a test's.
pub trait Clock {
    /// Time since some fixed point.
    fn elapsed(&self) -> Duration;
    /// Sleeps `d`.
    fn sleep(&mut self, d: Duration);
    /// A pause between two spinning polls.
    fn spin(&mut self) {
        std::hint::spin_loop();
    }
}

/// The system clock, from the instant it was made.
struct SystemClock(Instant);

impl Clock for SystemClock {
    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    fn sleep(&mut self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// [`wait_until`] on `clock`.
pub fn wait_until_on(
    mut poll: impl FnMut() -> Progress,
    live: &Liveness,
    limit: Duration,
    clock: &mut impl Clock,
) -> Result<(), WaitFailure> {
    let start = clock.elapsed();
    let mut sleep = Duration::from_micros(2);
    let mut polls = 0u32;
    loop {
        match poll() {
            Progress::Done => return Ok(()),
            Progress::Failed(e) => return Err(WaitFailure::Engine(e)),
            Progress::Pending => {}
        }
        if let Some(reason) = live.failure() {
            return Err(WaitFailure::Aborted(reason));
        }
        let waited = clock.elapsed() - start;
        if waited >= limit {
            return Err(WaitFailure::TimedOut(waited));
        }
        polls += 1;
        if polls < SPINS {
            clock.spin();
        } else {
            clock.sleep(sleep.min(limit - waited));
            sleep = (sleep * 2).min(MAX_POLL_SLEEP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A clock that moves only when slept on (spins cost 50 ns each).
    #[derive(Default)]
    struct FakeClock {
        now: Duration,
        longest_sleep: Duration,
    }

    impl Clock for FakeClock {
        fn elapsed(&self) -> Duration {
            self.now
        }

        fn sleep(&mut self, d: Duration) {
            self.longest_sleep = self.longest_sleep.max(d);
            self.now += d;
        }

        fn spin(&mut self) {
            self.now += Duration::from_nanos(50);
        }
    }

    /// Whenever the work completes — during the spins, early in the back-off, or after
    /// seconds — the waiter sees it within one capped sleep, and never sleeps longer.
    #[test]
    fn completion_is_seen_within_the_capped_sleep_on_a_fake_clock() {
        for done_at_us in [1u64, 3, 40, 700, 5_000, 2_000_000] {
            let done_at = Duration::from_micros(done_at_us);
            let live = Liveness::default();
            let mut clock = FakeClock::default();
            let now = std::cell::Cell::new(Duration::ZERO);
            let mut seen_at = None;
            let r = wait_until_on(
                || {
                    let t = now.get();
                    if t >= done_at {
                        seen_at = Some(t);
                        Progress::Done
                    } else {
                        Progress::Pending
                    }
                },
                &live,
                Duration::from_secs(10),
                &mut ClockProbe {
                    clock: &mut clock,
                    now: &now,
                },
            );
            assert_eq!(r, Ok(()));
            let late = seen_at.expect("seen") - done_at;
            assert!(
                late <= MAX_POLL_SLEEP,
                "done at {done_at:?}, seen {late:?} late"
            );
            assert!(clock.longest_sleep <= MAX_POLL_SLEEP);
        }
    }

    /// A fake clock whose time the poll reads too.
    struct ClockProbe<'a> {
        clock: &'a mut FakeClock,
        now: &'a std::cell::Cell<Duration>,
    }

    impl Clock for ClockProbe<'_> {
        fn elapsed(&self) -> Duration {
            self.clock.elapsed()
        }

        fn sleep(&mut self, d: Duration) {
            self.clock.sleep(d);
            self.now.set(self.clock.now);
        }

        fn spin(&mut self) {
            self.clock.spin();
            self.now.set(self.clock.now);
        }
    }

    /// The limit is kept on the fake clock: a timeout after exactly the limit, the last sleep
    /// cut to end there.
    #[test]
    fn the_limit_holds_on_a_fake_clock() {
        let live = Liveness::default();
        let mut clock = FakeClock::default();
        let limit = Duration::from_micros(1_234);
        let r = wait_until_on(|| Progress::Pending, &live, limit, &mut clock);
        assert_eq!(r, Err(WaitFailure::TimedOut(limit)));
        assert_eq!(clock.now, limit);
    }

    #[test]
    fn finished_work_returns_ok() {
        let live = Liveness::default();
        let mut left = 200;
        let r = wait_until(
            || {
                left -= 1;
                if left == 0 {
                    Progress::Done
                } else {
                    Progress::Pending
                }
            },
            &live,
            Duration::from_secs(10),
        );
        assert_eq!(r, Ok(()));
        assert_eq!(left, 0, "polled until done, not beyond");
    }

    #[test]
    fn an_engine_error_fails_at_once() {
        let live = Liveness::default();
        let r = wait_until(
            || Progress::Failed("ncclRemoteError".into()),
            &live,
            Duration::from_secs(10),
        );
        assert_eq!(r, Err(WaitFailure::Engine("ncclRemoteError".into())));
    }

    #[test]
    fn stuck_work_times_out_near_the_limit() {
        let live = Liveness::default();
        let limit = Duration::from_millis(50);
        let start = Instant::now();
        let r = wait_until(|| Progress::Pending, &live, limit);
        let took = start.elapsed();
        assert!(matches!(r, Err(WaitFailure::TimedOut(after)) if after >= limit));
        assert!(took < limit + Duration::from_secs(2), "took {took:?}");
        let e = r.unwrap_err().into_error("all_gather");
        assert!(matches!(
            e,
            CommError::Timeout {
                op: "all_gather",
                ..
            }
        ));
    }

    #[test]
    fn an_abort_from_another_thread_ends_a_wait() {
        let live = Arc::new(Liveness::default());
        let other = live.clone();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.fail("rank 3 raised an error");
        });
        let r = wait_until(|| Progress::Pending, &live, Duration::from_secs(30));
        aborter.join().unwrap();
        assert_eq!(
            r,
            Err(WaitFailure::Aborted("rank 3 raised an error".into()))
        );
        // Later calls fail before they enqueue, with the first reason.
        live.fail("a second reason");
        let e = live.check("reduce_scatter").unwrap_err();
        assert!(matches!(&e, CommError::PeerFailed(m) if m.contains("rank 3 raised an error")));
    }

    #[test]
    fn start_up_ends_once_and_is_shared() {
        let live = Arc::new(Liveness::starting());
        let lane = live.clone();
        assert!(lane.is_starting());
        live.end_startup();
        assert!(!lane.is_starting());
        assert!(!Liveness::default().is_starting());
    }

    #[test]
    fn the_timeout_comes_from_the_environment_or_the_default() {
        // One test touches the variables, so no other test races it.
        std::env::remove_var(NCCL_TIMEOUT_ENV);
        std::env::remove_var(NCCL_STARTUP_TIMEOUT_ENV);
        assert_eq!(startup_timeout_from_env(), Ok(DEFAULT_NCCL_STARTUP_TIMEOUT));
        std::env::set_var(NCCL_STARTUP_TIMEOUT_ENV, "60");
        assert_eq!(startup_timeout_from_env(), Ok(Duration::from_secs(60)));
        std::env::set_var(NCCL_STARTUP_TIMEOUT_ENV, "later");
        assert!(startup_timeout_from_env().is_err());
        std::env::remove_var(NCCL_STARTUP_TIMEOUT_ENV);
        assert_eq!(timeout_from_env(), Ok(DEFAULT_NCCL_TIMEOUT));
        std::env::set_var(NCCL_TIMEOUT_ENV, "2.5");
        assert_eq!(timeout_from_env(), Ok(Duration::from_millis(2500)));
        for bad in ["0", "-1", "soon", "inf"] {
            std::env::set_var(NCCL_TIMEOUT_ENV, bad);
            assert!(timeout_from_env().is_err(), "{bad}");
        }
        std::env::remove_var(NCCL_TIMEOUT_ENV);
    }
}
