//! Launching a multi-process job: who am I, where is rank 0, which GPU is mine, and one round
//! of agreement on some bytes (an NCCL unique id) over TCP.
//!
//! * [`LaunchEnv`]: rank, world size, local rank and rendezvous address from the variables of
//!   torchrun, Open MPI, MPICH/Intel MPI or Slurm's `srun` (rules in [`mod@env`]);
//!   [`node_local_rank`] and [`local_device`] pick this process's GPU.
//! * [`expand_nodelist`]: Slurm's hostlist syntax (`gpu[01-04]`), used for Slurm's master.
//! * [`TcpRendezvous`]: rank 0 serves, the others connect; every rank gets rank 0's bytes or
//!   an error, within a timeout, whoever fails (protocol in [`rendezvous`]).

pub mod env;
pub mod nodelist;
pub mod rendezvous;
mod server;
mod wire;

#[cfg(test)]
mod env_tests;
#[cfg(test)]
mod rendezvous_tests;

pub use env::{
    local_device, node_local_rank, node_local_rank_from, LaunchEnv, Launcher, MasterAddr,
};
pub use nodelist::expand_nodelist;
pub use rendezvous::TcpRendezvous;
