//! [`NcclLanes`]: a [`CommFactory`] whose lanes are NCCL communicators, each created on the
//! thread that connects it (cudarc's communicator is `!Send`).

use crate::{Collective, CommError, CommFactory, CommResult};

use super::id::agree_ids;
use super::{Liveness, NcclComm, NcclUniqueId};

/// One NCCL unique id per lane, agreed by every rank; [`CommFactory::connect`] creates lane
/// `i`'s communicator from id `i` on the calling thread, on GPU `device`.
pub struct NcclLanes {
    ids: Vec<NcclUniqueId>,
    connected: std::sync::Mutex<Vec<bool>>,
    rank: usize,
    size: usize,
    device: usize,
    /// Shared by every lane's communicator: an abort or a failed wait on one fails them all.
    live: std::sync::Arc<Liveness>,
}

impl NcclLanes {
    /// `lanes` lanes agreed over `boot` (e.g. MPI or threads; collective over it: every rank
    /// gets the same ids, or every rank the error), this rank on GPU `device`.
    pub fn from_collective<C: Collective>(
        boot: &C,
        device: usize,
        lanes: usize,
    ) -> CommResult<Self> {
        if lanes == 0 {
            return Err(CommError::InvalidArgument(
                "a factory needs at least one lane".into(),
            ));
        }
        let ids = agree_ids(boot, lanes)?;
        Ok(Self {
            ids,
            connected: std::sync::Mutex::new(vec![false; lanes]),
            rank: boot.rank(),
            size: boot.size(),
            device,
            live: Default::default(),
        })
    }
}

impl CommFactory for NcclLanes {
    type Comm = NcclComm;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn lanes(&self) -> usize {
        self.ids.len()
    }

    fn connect(&self, lane: usize) -> CommResult<NcclComm> {
        let id = *self.ids.get(lane).ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "lane {lane} of a factory of {} lanes",
                self.ids.len()
            ))
        })?;
        {
            let mut connected = self.connected.lock().unwrap_or_else(|p| p.into_inner());
            if std::mem::replace(&mut connected[lane], true) {
                return Err(CommError::InvalidArgument(format!(
                    "lane {lane} is already connected"
                )));
            }
        }
        Ok(NcclComm::from_id(&id, self.rank, self.size, self.device)?
            .with_liveness(self.live.clone()))
    }

    /// Fails every lane of this rank: a lane waiting on a collective aborts its communicator
    /// (`ncclCommAbort`) within a poll and returns the error; later calls fail at once. Peers
    /// in other processes meet it as NCCL's asynchronous error or their own watchdog timeout.
    fn abort(&self, reason: &str) {
        self.live.fail(reason);
    }
}
