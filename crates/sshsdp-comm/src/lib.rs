//! Collectives for SS-HSDP.
//!
//! * [`Collective`]: the trait every engine implements — `all_gather` (equal counts, in place
//!   into the caller's buffer), `reduce_scatter`, `all_reduce` (sum or average), `broadcast`,
//!   `barrier`, `split` into sub-communicators, and asynchronous starts returning [`Pending`];
//!   each call can carry a [`CallTag`] (step, bucket, stage) that engines check across ranks.
//! * Engines: `threads` (default feature; in-process ranks for tests and one-host training),
//!   `mpi` (feature; OpenMPI processes), `nccl` (feature; GPUs through cudarc).
//! * [`CommFactory`]: one communicator per thread that runs collectives, made on that thread
//!   (NCCL's cannot cross threads); [`SplitLanes`] for engines whose communicators can.
//! * [`hierarchy`]: the mesh's shard and replica groups and the two hierarchical gradient paths
//!   (HSDP and the project's default), plus the post-update replica all-gather.
//! * [`conformance`]: the test suite every engine must pass, as plain functions.
//! * [`launch`]: rank, world size, local GPU and rendezvous address from the launcher's
//!   variables (torchrun, Slurm, Open MPI, MPICH), and a TCP rendezvous for rank 0's bytes.

#![deny(missing_docs)]

mod call;
mod collective;
pub mod conformance;
pub mod device;
mod element;
mod error;
mod factory;
pub mod faults;
pub mod hierarchy;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod peers;
mod tag;
#[cfg(feature = "threads")]
pub mod threads;

pub use collective::{check_chunks, check_root, equal_chunks, AbortHandle, Collective, Pending};
pub use device::DeviceCollective;
pub use element::{Element, ElementKind, ReduceOp, Reducible};
pub use error::{CommError, CommResult};
pub use factory::{CommFactory, SplitLanes};
pub use tag::CallTag;
