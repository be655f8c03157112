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

/// rsmpi's MPI environment handle, re-exported: one per process; dropping it finalises MPI.
pub use mpi::environment::Universe;

mod collectives;
mod comm;
mod guard;
mod policy;
mod primitives;
mod raw;
mod session;

pub use comm::MpiComm;
pub use guard::{MpiOptions, WATCHDOG_EXIT_CODE};
pub use policy::{ReduceScatterAlgo, ReduceScatterPolicy, DEFAULT_ALLREDUCE_FROM_BYTES};
pub use session::MpiSession;

// Named by the links of the module docs above.
#[cfg(doc)]
use crate::{Collective, CommError, ReduceOp, Reducible};
