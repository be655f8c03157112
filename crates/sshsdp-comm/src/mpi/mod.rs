//! The MPI engine: one rank per process, over an rsmpi (`mpi` 0.8) communicator.
//!
//! # Starting MPI
//!
//! A process initialises MPI once, in an [`MpiSession`] that stays on the initialising thread:
//! [`MpiSession::world`] makes world communicators (duplicates of `MPI_COMM_WORLD`, so this
//! engine's traffic never matches the application's own messages, with the `MPI_ERRORS_RETURN`
//! handler, so failures of our calls come back as [`CommError::Engine`]). Sub-communicators
//! come from `MPI_Comm_split` with the same handler. Dropping the session waits for every
//! communicator to be freed and finalises MPI on the thread that initialised it. Launch with
//! `mpirun -n N <binary>`.
//!
//! # Failures
//!
//! Every collective first runs the session's *call check* (one small all-reduce: the ranks'
//! operations, counts and [`crate::CallTag`]s must agree, and a rank that failed — see
//! [`Collective::abort_handle`] — makes the call an error on every rank), and a watchdog
//! ends the job with `MPI_Abort` when a collective does not complete within its limit (a dead
//! or hung peer). Both are set by [`MpiOptions`]; see the `guard` module for what they cost.
//!
//! # Data movement and copies
//!
//! The collectives call MPI's C API (`mpi::ffi`) directly, because rsmpi 0.8's safe wrappers
//! have no `MPI_IN_PLACE`, ignore MPI's return codes, and panic (an `assert_eq!`) on bad sizes.
//! Every call validates lengths and roots first and returns [`CommError::InvalidArgument`].
//!
//! * [`Collective::all_gather_in_place`] and [`Collective::all_reduce`] (f32) pass
//!   `MPI_IN_PLACE`: the caller's buffer is the collective buffer, no staging copy.
//!   `MPI_IN_PLACE` is a macro in `mpi.h` that rsmpi does not export; its value is
//!   implementation-specific (`(void *) 1` in Open MPI, `(void *) -1` in MPICH and its
//!   derivatives), so it is chosen from `MPI_Get_library_version` at start-up. With an
//!   unrecognised library the engine falls back to copying this rank's input to a scratch
//!   buffer first (one copy of one chunk for all-gather, of the buffer for all-reduce).
//! * [`Collective::all_gather`], [`Collective::broadcast`]: straight `MPI_Allgather` /
//!   `MPI_Bcast` on the caller's buffers, no copy.
//! * `bf16` has no MPI datatype. Moves (all-gather, broadcast) send it as its `u16` bit
//!   pattern (`MPI_UINT16_T`; `half::bf16` is `#[repr(transparent)]` over `u16`), no copy.
//!   Reductions of `bf16` (and of any other non-`f32` [`Reducible`]) widen to an `f32` scratch
//!   buffer, reduce that in place with `MPI_SUM` on `MPI_FLOAT`, and round back once — the
//!   threads engine's arithmetic (accumulate in f32, round once), never a bf16 intermediate.
//!   That costs the conversion pass and moves 4 bytes per element instead of 2; a user-defined
//!   `MPI_Op` on `u16` would move 2 bytes but round after every pairwise step.
//! * [`ReduceOp::Avg`] is `MPI_SUM` then one multiplication by [`ReduceOp::scale`], so values
//!   are computed like the threads engine's (same scale factor, same single rounding).
//! * [`Collective::reduce_scatter`] is out of place by contract (`send` → `recv`) and picks
//!   its MPI call by the size of `send` and the number of ranks
//!   ([`ReduceScatterPolicy::measured`], equal on all ranks): below
//!   [`DEFAULT_ALLREDUCE_FROM_BYTES`] (32 MiB) it calls `MPI_Reduce_scatter` with equal
//!   counts, no copy; from there on, with more than two ranks, `MPI_Reduce_scatter_block`, no
//!   copy; with two ranks `MPI_Allreduce(send → scratch)` into a buffer the
//!   communicator keeps (so repeated calls do not page-fault a fresh allocation;
//!   [`MpiComm::release_scratch`] frees it) and copies this rank's chunk to `recv` — one copy
//!   of `recv.len()` elements, paid back by the faster algorithm. For `bf16` the all-reduce
//!   runs in place on the widened `f32` copy instead, no scratch.
//!   [`MpiComm::set_reduce_scatter_policy`] overrides the choice
//!   ([`ReduceScatterPolicy::always`]); split communicators inherit an override, otherwise
//!   they get the measured policy for their own size.
//!
//! Measured with `examples/mpi_bandwidth.rs` (Open MPI 4.1.4 `vader` shared memory, one VM
//! with 2 cores that other builds were using at the same time, so single numbers vary by
//! ±50%; `f32`; milliseconds for one reduce-scatter of a `send` of the size shown, slowest
//! rank, median of 5–20 repetitions):
//!
//! ```text
//! ranks  send MiB   Reduce_scatter_block   Reduce_scatter   Allreduce->scratch
//!   2       1              0.75                0.16              0.23
//!   2       4             16.60                5.68              6.35
//!   2      16             48.98               20.15             30.58
//!   2      32             71.71               73.99             51.50
//!   2      64            116.68              140.34             95.02
//!   2     256            472.00              595.25            337.09
//!   4       1              4.59                0.87              1.96
//!   4       4             15.84                7.36              8.72
//!   4      16             35.80               31.96             62.61
//!   4      64            298.71              361.50            244.69
//! ```
//!
//! A second run (2 ranks: 55.7 / 73.3 / 46.6 ms at 64 MiB, 231 / 284 / 172 ms at 256 MiB;
//! 4 ranks: 176.6 / 317.6 / 242.1 ms at 64 MiB, 528 / 1449 / 802 ms at 256 MiB; the first run
//! at 4 ranks, 256 MiB: 501 / 1554 / 766 ms) agrees: `MPI_Reduce_scatter` wins up to 16 MiB
//! by 1.1–5× over the block call; from 32 MiB the all-reduce path wins with two ranks by
//! 20–40%, while with four ranks (oversubscribed on two cores, so all-reduce's extra
//! arithmetic costs CPU the other ranks need) `MPI_Reduce_scatter_block` wins. The ring that
//! `MPI_Reduce_scatter` uses for small and medium messages is the slowest at 64 MiB and
//! above. The four-rank choice is the weakest: a third run had the all-reduce path ahead
//! (265 / 326 / 191 ms at 64 MiB, 923 / 1259 / 444 ms at 256 MiB); over the three runs the
//! medians favour the block call at 256 MiB (528 vs 766 ms) and are a tie at 64 MiB.
//! Re-measure on real hardware (more cores, other interconnects) with the example and
//! set the policy accordingly.
//!
//! # Asynchronous calls
//!
//! [`Collective::start_all_gather`] and [`Collective::start_reduce_scatter`] keep the trait's
//! synchronous defaults: the collective runs at the start call and [`crate::Pending::wait`]
//! returns at once. rsmpi's immediate collectives borrow their buffers for a `Scope`, which
//! cannot outlive the call that would return the owned `Pending`; driving `MPI_Iallgather` from
//! the raw API instead would need either a helper thread waiting on the request (and so
//! `MPI_THREAD_MULTIPLE`, which slows every Open MPI call) or a `Pending` variant that polls an
//! MPI request, which [`crate::Pending`] does not have. Overlap on MPI ranks therefore comes
//! from the training loop's ordering, not from this engine.
//!
//! # Bootstrapping other engines
//!
//! The NCCL engine's unique id (128 bytes) is created on rank 0 and sent to every rank with
//! `comm.broadcast::<u8>(&mut id, 0)`; no separate byte-broadcast helper is needed.
//!
//! # Limits
//!
//! MPI counts are C `int`s: a chunk (all-gather, reduce-scatter) or buffer (all-reduce,
//! broadcast, and `send` of the all-reduce reduce-scatter path) of more than `i32::MAX`
//! elements is an argument error; split such buckets. MPI cannot check that ranks call
//! the same collective with matching counts; a mismatch is undefined behaviour of the MPI job
//! (typically a truncation error or a hang) unless call checks are on (the default), which
//! report it as the threads engine does. [`MpiComm`] is `Send` but not `Sync`: one thread at
//! a time uses a communicator.
//!
//! [`split`]: Collective::split

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};

/// rsmpi's MPI environment handle, re-exported: one per process; dropping it finalises MPI.
pub use mpi::environment::Universe;

mod guard;
mod policy;
mod raw;
mod session;

pub use guard::{MpiOptions, WATCHDOG_EXIT_CODE};
pub use policy::{ReduceScatterAlgo, ReduceScatterPolicy, DEFAULT_ALLREDUCE_FROM_BYTES};
pub use session::MpiSession;

use guard::Live;

use crate::call::CallDesc as Call;
use raw::*;

use crate::collective::{check_chunks, check_counts, check_root, equal_chunks};
use crate::{
    AbortHandle, CallTag, Collective, CommError, CommResult, Element, ReduceOp, Reducible,
};

/// One rank's communicator in an MPI job.
///
/// Field order matters: `comm` is freed (`MPI_Comm_free`) before `live` tells the session, so
/// MPI is never finalised under a live communicator.
pub struct MpiComm {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// `MPI_IN_PLACE` of the running MPI library, if recognised.
    in_place: Option<*mut c_void>,
    /// How reduce-scatter runs.
    rs_policy: ReduceScatterPolicy,
    /// The policy set by the caller, inherited by split communicators (otherwise each gets
    /// [`ReduceScatterPolicy::measured`] for its own size).
    rs_override: Option<ReduceScatterPolicy>,
    /// Result buffer of the all-reduce reduce-scatter path, kept across calls (see
    /// [`MpiComm::release_scratch`]).
    scratch: RefCell<Vec<f32>>,
    /// The label of the calls made now (see [`Collective::set_tag`]).
    tag: Cell<CallTag>,
    /// Whether calls run the call check (see [`MpiOptions::check_calls`]).
    check_calls: bool,
    live: Live,
}

// SAFETY: MPI handles may be used from any thread once MPI runs at MPI_THREAD_MULTIPLE, which
// `MpiSession` checks before any communicator exists; the session's state is shared through an
// `Arc`; and `MpiComm` is not `Sync` (its scratch buffer is a `RefCell`), so one thread at a time
// uses a given communicator.
unsafe impl Send for MpiComm {}

impl MpiComm {
    fn wrap(
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
    fn guarded<R>(&self, call: Call, f: impl FnOnce() -> CommResult<R>) -> CommResult<R> {
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

    fn raw(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }

    /// `MPI_Allgather` of `count` elements of datatype `dt` per rank from `send` into `recv`.
    ///
    /// # Safety
    /// `send` is `MPI_IN_PLACE` (then chunk `rank` of `recv` is the input) or holds `count`
    /// elements of `dt`; `recv` holds size · `count` elements of `dt` and does not overlap `send`.
    unsafe fn raw_all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dt: ffi::MPI_Datatype,
    ) -> CommResult<()> {
        // SAFETY: the caller's contract above.
        let code = unsafe { ffi::MPI_Allgather(send, count, dt, recv, count, dt, self.raw()) };
        check("MPI_Allgather", code)
    }

    /// `MPI_SUM` of `len` `f32`s at `buf`, in place (or through a scratch copy of the input if
    /// `MPI_IN_PLACE` is unknown).
    ///
    /// # Safety
    /// `buf` is valid for reads and writes of `len` `f32`s.
    unsafe fn sum_f32_in_place(&self, buf: *mut f32, len: usize) -> CommResult<()> {
        let count = mpi_count("all_reduce", len)?;
        let (dt, sum) = (f32_datatype(), sum_op());
        let code = match self.in_place {
            // SAFETY: caller guarantees `buf`; MPI_IN_PLACE makes it both input and output.
            Some(ip) => unsafe { ffi::MPI_Allreduce(ip, buf.cast(), count, dt, sum, self.raw()) },
            None => {
                // SAFETY: caller guarantees `buf` is readable for `len` f32s.
                let input = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
                // SAFETY: `input` and `buf` are disjoint buffers of `count` f32s.
                unsafe {
                    ffi::MPI_Allreduce(
                        input.as_ptr().cast(),
                        buf.cast(),
                        count,
                        dt,
                        sum,
                        self.raw(),
                    )
                }
            }
        };
        check("MPI_Allreduce", code)
    }

    /// Reduce-scatter (`MPI_SUM`) of `f32`s: `send` holds `size · recv.len()` (checked by the
    /// caller, as is that `send.len()` fits an MPI count).
    fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        let n = recv.len();
        let count = mpi_count("reduce_scatter", n)?;
        let (dt, sum) = (f32_datatype(), sum_op());
        let mine = self.rank * n..(self.rank + 1) * n;
        match self.rs_policy.algo(size_of_val(send)) {
            // SAFETY (both): `send` holds size · n f32s and `recv` n f32s (checked by the
            // caller); they are distinct borrows, so disjoint; `counts` holds size ints.
            ReduceScatterAlgo::Block => check("MPI_Reduce_scatter_block", unsafe {
                ffi::MPI_Reduce_scatter_block(
                    send.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    count,
                    dt,
                    sum,
                    self.raw(),
                )
            }),
            ReduceScatterAlgo::Varcount => {
                let counts = vec![count; self.size];
                check("MPI_Reduce_scatter", unsafe {
                    ffi::MPI_Reduce_scatter(
                        send.as_ptr().cast(),
                        recv.as_mut_ptr().cast(),
                        counts.as_ptr(),
                        dt,
                        sum,
                        self.raw(),
                    )
                })
            }
            ReduceScatterAlgo::AllReduce => {
                let mut scratch = self.scratch.borrow_mut();
                if scratch.len() < send.len() {
                    scratch.resize(send.len(), 0.0);
                }
                let total = mpi_count("reduce_scatter", send.len())?;
                // SAFETY: `send` and `scratch` are distinct buffers of at least `total` f32s.
                check("MPI_Allreduce", unsafe {
                    ffi::MPI_Allreduce(
                        send.as_ptr().cast(),
                        scratch.as_mut_ptr().cast(),
                        total,
                        dt,
                        sum,
                        self.raw(),
                    )
                })?;
                recv.copy_from_slice(&scratch[mine]);
                Ok(())
            }
        }
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        let n = equal_chunks("all_gather", buf.len(), self.size)?;
        let dt = datatype::<T>("all_gather")?;
        let count = mpi_count("all_gather", n)?;
        self.guarded(Call::data::<T>("all_gather", n, self.tag.get()), || {
            if n == 0 || self.size == 1 {
                return Ok(());
            }
            match self.in_place {
                // SAFETY: `buf` holds size · n elements of T, whose MPI datatype is `dt`
                // (checked by `datatype`); with MPI_IN_PLACE chunk `rank` is the input and the
                // rest is written.
                Some(ip) => unsafe { self.raw_all_gather(ip, buf.as_mut_ptr().cast(), count, dt) },
                None => {
                    let mine = buf[self.rank * n..(self.rank + 1) * n].to_vec();
                    // SAFETY: `mine` (n elements) and `buf` (size · n) are disjoint buffers of T.
                    unsafe {
                        self.raw_all_gather(
                            mine.as_ptr().cast(),
                            buf.as_mut_ptr().cast(),
                            count,
                            dt,
                        )
                    }
                }
            }
        })
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        check_chunks("all_gather", "recv", recv.len(), send.len(), self.size)?;
        let dt = datatype::<T>("all_gather")?;
        let count = mpi_count("all_gather", send.len())?;
        self.guarded(
            Call::data::<T>("all_gather", send.len(), self.tag.get()),
            || {
                if send.is_empty() {
                    return Ok(());
                }
                // SAFETY: `send` (n) and `recv` (size · n) are distinct borrows of T, datatype `dt`.
                unsafe {
                    self.raw_all_gather(send.as_ptr().cast(), recv.as_mut_ptr().cast(), count, dt)
                }
            },
        )
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        check_chunks("reduce_scatter", "send", send.len(), recv.len(), self.size)?;
        mpi_count("reduce_scatter", send.len())?;
        let call = Call::reduce::<T>("reduce_scatter", recv.len(), op, self.tag.get());
        self.guarded(call, || {
            if recv.is_empty() {
                return Ok(());
            }
            let scale = op.scale(self.size);
            if let (Some(send), Some(recv)) = (as_f32(send), as_f32_mut(recv)) {
                self.reduce_scatter_f32(send, recv)?;
                if op != ReduceOp::Sum {
                    recv.iter_mut().for_each(|x| *x *= scale);
                }
                return Ok(());
            }
            // Widen to f32, reduce, round once.
            let mut wide: Vec<f32> = send.iter().map(|x| x.to_acc()).collect();
            let n = recv.len();
            let all_reduce =
                self.rs_policy.algo(size_of_val(wide.as_slice())) == ReduceScatterAlgo::AllReduce;
            let out = if all_reduce {
                // The widened copy is ours: all-reduce it in place, no scratch buffer.
                // SAFETY: `wide` is an owned buffer of `wide.len()` f32s.
                unsafe { self.sum_f32_in_place(wide.as_mut_ptr(), wide.len())? };
                wide.drain(self.rank * n..(self.rank + 1) * n).collect()
            } else {
                let mut out = vec![0f32; n];
                self.reduce_scatter_f32(&wide, &mut out)?;
                out
            };
            recv.iter_mut()
                .zip(&out)
                .for_each(|(r, &s)| *r = T::from_acc(s * scale));
            Ok(())
        })
    }

    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        mpi_count("all_reduce", buf.len())?;
        self.guarded(
            Call::reduce::<T>("all_reduce", buf.len(), op, self.tag.get()),
            || {
                if buf.is_empty() {
                    return Ok(());
                }
                let scale = op.scale(self.size);
                if let Some(buf) = as_f32_mut(buf) {
                    // SAFETY: `buf` is an exclusive borrow of `buf.len()` f32s.
                    unsafe { self.sum_f32_in_place(buf.as_mut_ptr(), buf.len())? };
                    if op != ReduceOp::Sum {
                        buf.iter_mut().for_each(|x| *x *= scale);
                    }
                    return Ok(());
                }
                let mut wide: Vec<f32> = buf.iter().map(|x| x.to_acc()).collect();
                // SAFETY: `wide` is an owned buffer of `buf.len()` f32s.
                unsafe { self.sum_f32_in_place(wide.as_mut_ptr(), wide.len())? };
                buf.iter_mut()
                    .zip(&wide)
                    .for_each(|(b, &s)| *b = T::from_acc(s * scale));
                Ok(())
            },
        )
    }

    /// `MPI_Alltoallv` on the caller's buffers, no copy, after an `MPI_Alltoall` of the counts
    /// and an `MPI_Allgather` of each rank's first disagreement (if any), so that counts that
    /// disagree are the same [`CommError::Mismatch`] on every rank instead of a truncation.
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all_v";
        check_counts(OP, "send", send.len(), send_counts, self.size)?;
        check_counts(OP, "recv", recv.len(), recv_counts, self.size)?;
        let dt = datatype::<T>(OP)?;
        let ints = |counts: &[usize]| -> CommResult<(Vec<c_int>, Vec<c_int>)> {
            let counts = counts
                .iter()
                .map(|&c| mpi_count(OP, c))
                .collect::<CommResult<Vec<_>>>()?;
            let mut displs = Vec::with_capacity(counts.len());
            let mut at: c_int = 0;
            for &c in &counts {
                displs.push(at);
                at = at.checked_add(c).ok_or_else(|| {
                    CommError::InvalidArgument(format!("{OP}: more than MPI's int count in all"))
                })?;
            }
            Ok((counts, displs))
        };
        let (scounts, sdispls) = ints(send_counts)?;
        let (rcounts, rdispls) = ints(recv_counts)?;
        let int = i32_datatype();
        self.guarded(Call::data::<T>(OP, self.size, self.tag.get()), || {
            // What every peer will send us, against what we expect.
            let mut incoming = vec![0 as c_int; self.size];
            // SAFETY: `scounts` and `incoming` hold one int per rank.
            let code = unsafe {
                ffi::MPI_Alltoall(
                    scounts.as_ptr().cast(),
                    1,
                    int,
                    incoming.as_mut_ptr().cast(),
                    1,
                    int,
                    self.raw(),
                )
            };
            check("MPI_Alltoall", code)?;
            // (sender, receiver, sent, expected) of this rank's first disagreement, or -1s.
            let mine: [c_int; 4] = incoming
                .iter()
                .zip(&rcounts)
                .position(|(got, want)| got != want)
                .map_or([-1; 4], |a| {
                    [a as c_int, self.rank as c_int, incoming[a], rcounts[a]]
                });
            let mut all = vec![0 as c_int; 4 * self.size];
            // SAFETY: `mine` holds 4 ints, `all` 4 per rank.
            unsafe { self.raw_all_gather(mine.as_ptr().cast(), all.as_mut_ptr().cast(), 4, int) }?;
            if let Some(w) = all.chunks(4).find(|w| w[0] >= 0) {
                return Err(CommError::Mismatch(format!(
                    "{OP}: rank {} sends {} elements to rank {}, which expects {}",
                    w[0], w[2], w[1], w[3]
                )));
            }
            // SAFETY: `send` holds the sum of `scounts` elements of `dt` at `sdispls`, `recv` the
            // sum of `rcounts` at `rdispls` (checked above); distinct borrows; the counts agree
            // pairwise (checked with every rank).
            let code = unsafe {
                ffi::MPI_Alltoallv(
                    send.as_ptr().cast(),
                    scounts.as_ptr(),
                    sdispls.as_ptr(),
                    dt,
                    recv.as_mut_ptr().cast(),
                    rcounts.as_ptr(),
                    rdispls.as_ptr(),
                    dt,
                    self.raw(),
                )
            };
            check("MPI_Alltoallv", code)
        })
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        check_root("broadcast", root, self.size)?;
        let dt = datatype::<T>("broadcast")?;
        let count = mpi_count("broadcast", buf.len())?;
        let call = Call {
            root,
            ..Call::data::<T>("broadcast", buf.len(), self.tag.get())
        };
        self.guarded(call, || {
            if buf.is_empty() {
                return Ok(());
            }
            // `root < size`, and `size` came from a c_int.
            let root = root as c_int;
            // SAFETY: `buf` is an exclusive borrow of `count` elements of T, datatype `dt`.
            check("MPI_Bcast", unsafe {
                ffi::MPI_Bcast(buf.as_mut_ptr().cast(), count, dt, root, self.raw())
            })
        })
    }

    fn barrier(&self) -> CommResult<()> {
        self.guarded(Call::control("barrier", self.tag.get()), || {
            // SAFETY: `self.comm` is a live communicator.
            check("MPI_Barrier", unsafe { ffi::MPI_Barrier(self.raw()) })
        })
    }

    fn set_tag(&self, tag: CallTag) {
        self.tag.set(tag);
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        let guard = self.live.guard().clone();
        Some(std::sync::Arc::new(move |reason: &str| guard.fail(reason)))
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Self> {
        let color = c_int::try_from(color)
            .map_err(|_| CommError::InvalidArgument(format!("split: color {color} > i32::MAX")))?;
        let key = c_int::try_from(key)
            .map_err(|_| CommError::InvalidArgument(format!("split: key {key} > i32::MAX")))?;
        let comm = self.guarded(Call::control("split", self.tag.get()), || {
            self.comm
                .split_by_color_with_key(Color::with_value(color), key)
                .ok_or_else(|| engine("MPI_Comm_split returned no communicator"))
        })?;
        Self::wrap(
            comm,
            self.in_place,
            self.rs_override,
            self.check_calls,
            self.live.guard().register(),
        )
    }
}
