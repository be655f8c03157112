//! [`CommFactory`]: how a runtime gets one communicator per thread that runs collectives.
//!
//! A training runtime runs collectives on several threads at once (SS-HSDP's communication
//! lanes), each on a world communicator of its own so that their calls never pair with each
//! other's. Some engines' communicators cannot cross threads: NCCL's (through cudarc) is
//! `!Send`, tied to the CUDA context of the thread that made it. So a runtime is handed a
//! *factory*, which can cross threads, and each thread makes its own communicator with
//! [`CommFactory::connect`].
//!
//! * [`SplitLanes`]: for communicators that can cross threads (threads engine, MPI): the lanes
//!   are split from one communicator up front, on the calling thread, and handed out.
//! * `nccl::NcclLanes` (feature `nccl`): one NCCL unique id per lane, agreed over a bootstrap
//!   communicator; each lane's communicator is created on the thread that connects it.

use std::sync::Mutex;

use crate::{AbortHandle, Collective, CommError, CommResult};

/// Makes this rank's world communicators, one per *lane*, each on the thread that will use it.
///
/// Every rank's factory has the same lanes; connecting lane `i` is a collective call among the
/// ranks' lane-`i` connects only, so different lanes may be connected on different threads in
/// any order. Each lane is connected once.
pub trait CommFactory: Send + Sync + 'static {
    /// The communicator made.
    type Comm: Collective;

    /// This rank's index in the world.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn size(&self) -> usize;

    /// Number of lanes this factory makes.
    fn lanes(&self) -> usize;

    /// Lane `lane`'s world communicator, made on (and for) the calling thread.
    fn connect(&self, lane: usize) -> CommResult<Self::Comm>;

    /// Fails every lane's communicators on every rank (see [`Collective::abort_handle`]); does
    /// nothing where the engine has no such mechanism.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }

    /// Called once the runtime's first optimizer step is done (every rank has compiled its
    /// kernels): engines that bound waits more loosely while a run starts (NCCL's start-up
    /// bound) tighten them to their steady timeout. Nothing by default.
    fn end_startup(&self) {}
}

/// The lanes of a communicator that can cross threads: lane 0 is the communicator itself, the
/// others are split from it when the factory is made (collective calls, on the calling thread,
/// so every rank makes them in the same order).
pub struct SplitLanes<C> {
    rank: usize,
    size: usize,
    lanes: Mutex<Vec<Option<C>>>,
    abort: Option<AbortHandle>,
}

impl<C: Collective> SplitLanes<C> {
    /// `lanes` world communicators from `comm` (collective over `comm`).
    pub fn new(comm: C, lanes: usize) -> CommResult<Self> {
        if lanes == 0 {
            return Err(CommError::InvalidArgument(
                "a factory needs at least one lane".into(),
            ));
        }
        let (rank, size, abort) = (comm.rank(), comm.size(), comm.abort_handle());
        let mut made = Vec::with_capacity(lanes);
        for _ in 1..lanes {
            made.push(Some(comm.split(0, rank)?));
        }
        made.insert(0, Some(comm));
        Ok(Self {
            rank,
            size,
            lanes: Mutex::new(made),
            abort,
        })
    }
}

impl<C: Collective + Send + 'static> CommFactory for SplitLanes<C> {
    type Comm = C;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn lanes(&self) -> usize {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn connect(&self, lane: usize) -> CommResult<C> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let count = lanes.len();
        lanes
            .get_mut(lane)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!("lane {lane} of a factory of {count} lanes"))
            })?
            .take()
            .ok_or_else(|| CommError::InvalidArgument(format!("lane {lane} is already connected")))
    }

    fn abort(&self, reason: &str) {
        if let Some(abort) = &self.abort {
            abort(reason);
        }
    }
}

#[cfg(all(test, feature = "threads"))]
mod tests {
    use super::*;
    use crate::threads::{ThreadsConfig, ThreadsWorld};
    use crate::ReduceOp;

    #[test]
    fn split_lanes_are_independent_world_communicators() {
        let sums = ThreadsWorld::run(3, ThreadsConfig::default(), |comm| {
            let lanes = SplitLanes::new(comm, 2).unwrap();
            assert_eq!((lanes.size(), lanes.lanes()), (3, 2));
            let rank = lanes.rank();
            // Lane 1 on another thread, lane 0 here: each sums its own values.
            std::thread::scope(|s| {
                let other = s.spawn(|| {
                    let c = lanes.connect(1).unwrap();
                    let mut v = [10.0 * (c.rank() + 1) as f32];
                    c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    v[0]
                });
                let c = lanes.connect(0).unwrap();
                let mut v = [(c.rank() + 1) as f32];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert!(lanes.connect(0).is_err(), "connected twice");
                assert!(lanes.connect(2).is_err(), "no such lane");
                (rank, v[0], other.join().unwrap())
            })
        })
        .unwrap();
        for r in sums {
            let (_, lane0, lane1) = r.unwrap();
            assert_eq!((lane0, lane1), (6.0, 60.0));
        }
    }

    #[test]
    fn lanes_need_not_issue_in_the_same_order_on_every_rank() {
        // The runtime's two lanes issue their collectives in each lane's program order, but how
        // the lanes interleave differs between ranks (`sshsdp-backend/src/lanes/mod.rs`,
        // "Two lanes on one GPU"). Here rank 1 delays its lane 0, so its lane 1 issues first
        // while rank 0 issues lane 0 first: both lanes must still complete, with each lane's
        // own values, several times over.
        let out = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
            let lanes = SplitLanes::new(comm, 2).unwrap();
            let rank = lanes.rank();
            std::thread::scope(|s| {
                let lane = |id: usize| {
                    let lanes = &lanes;
                    move || {
                        let c = lanes.connect(id).unwrap();
                        let mut sums = Vec::new();
                        for round in 0..5 {
                            if rank == 1 && id == 0 {
                                std::thread::sleep(std::time::Duration::from_millis(20));
                            }
                            let mut v = [(100 * id + 10 * round + rank) as f32];
                            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                            sums.push(v[0]);
                        }
                        sums
                    }
                };
                let second = s.spawn(lane(1));
                let first = lane(0)();
                (first, second.join().unwrap())
            })
        })
        .unwrap();
        for r in out {
            let (lane0, lane1) = r.unwrap();
            let want = |id: usize| -> Vec<f32> {
                (0..5)
                    .map(|round| (2 * (100 * id + 10 * round) + 1) as f32)
                    .collect()
            };
            assert_eq!((lane0, lane1), (want(0), want(1)));
        }
    }
}
