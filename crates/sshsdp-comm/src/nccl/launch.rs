//! [`NcclComm::from_launch`]: a world communicator for a process started by `torchrun`, `srun`
//! or any launcher that sets PyTorch's variables, with no MPI: the NCCL id travels over the TCP
//! rendezvous of [`crate::launch`], and everything after it (the lanes' ids, the host scalars of
//! a training loop) over NCCL itself.

use std::sync::Arc;
use std::time::Duration;

use super::{device_count, probe, Liveness, NcclComm, NcclUniqueId};
use crate::launch::{local_device, LaunchEnv, TcpRendezvous};
use crate::{CommError, CommResult};

/// The environment variable bounding the rendezvous, in seconds (default
/// [`DEFAULT_RENDEZVOUS_TIMEOUT`]): how long rank 0 waits for every rank, and a rank for rank 0.
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "SSHSDP_RENDEZVOUS_TIMEOUT_S";

/// Default bound of the rendezvous (processes of one job may start minutes apart).
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);

impl NcclComm {
    /// This process's rank of the world its launcher started, on the GPU its local rank picks
    /// ([`local_device`]: `local_rank % visible GPUs`), joined through rank 0's TCP rendezvous
    /// at the launch's master address (`MASTER_ADDR`/`MASTER_PORT`, or Slurm's first node).
    ///
    /// Rank 0 makes the NCCL id and serves it; every rank gets it or, within the bound
    /// ([`RENDEZVOUS_TIMEOUT_ENV`]), the same kind of error: a rank that never arrives, a
    /// mismatched `WORLD_SIZE`, an unreachable master, a rank that died, or rank 0 without NCCL.
    /// A rank without NCCL (or without a GPU) fails before it joins, so the others report it as
    /// missing. The communicator starts in the start-up phase ([`Liveness::starting`]): share
    /// its [`NcclComm::liveness`] with the runtime's lanes (`NcclLanes::with_liveness`) so
    /// that the runtime ends that phase for both after its first step.
    pub fn from_launch(env: &LaunchEnv) -> CommResult<Self> {
        probe()?;
        let device = local_device(env.local_rank, device_count()?)?;
        let id = if env.world_size == 1 {
            NcclUniqueId::new()?
        } else {
            let master = env.master.clone().ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "launched by {} as rank {} of {} with no rendezvous address: export \
                     MASTER_ADDR and MASTER_PORT (rank 0's host and a free port)",
                    env.launcher, env.rank, env.world_size
                ))
            })?;
            let timeout =
                super::watch::seconds_from_env(RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT)?;
            let rendezvous = TcpRendezvous::new(master, env.rank, env.world_size, timeout)?;
            let bytes = rendezvous.agree(|| {
                NcclUniqueId::new()
                    .map(|id| id.as_bytes().to_vec())
                    .map_err(|e| format!("rank 0 could not make an NCCL id: {e}"))
            })?;
            NcclUniqueId::from_bytes(&bytes)?
        };
        Ok(Self::from_id(&id, env.rank, env.world_size, device)?
            .with_liveness(Arc::new(Liveness::starting())))
    }
}
