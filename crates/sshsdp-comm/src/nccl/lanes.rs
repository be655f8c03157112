//! [`NcclLanes`]: a [`CommFactory`] whose lanes are NCCL communicators, each created on the
//! thread that connects it (cudarc's communicator is `!Send`).

use crate::{Collective, CommError, CommFactory, CommResult, ReduceOp};

use super::id::agree_ids;
use super::{Liveness, NcclComm, NcclUniqueId};

/// NCCL's variable choosing when communicators connect their peers: `0` in
/// `ncclCommInitRank` (and `ncclCommSplit`), anything else (NCCL's default since 2.22) at the
/// first collective that needs each connection.
pub const RUNTIME_CONNECT_ENV: &str = "NCCL_RUNTIME_CONNECT";

/// CUDA's variable for the number of hardware queues streams map to (8 by default).
const ONE_QUEUE_ENV: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// Whether this process's environment has NCCL connect peers at init
/// ([`RUNTIME_CONNECT_ENV`]` = 0`), which [`NcclLanes`] requires.
pub fn connects_at_init() -> bool {
    std::env::var(RUNTIME_CONNECT_ENV).is_ok_and(|v| v.trim() == "0")
}

/// Every rank of `boot` checks [`connects_at_init`]; if any rank does not, every rank returns
/// the same error (collective over `boot`, one small all-reduce).
///
/// Why the lanes need it, and what it costs: a rank's lanes are threads whose communicators
/// share one GPU, and every enqueue holds that GPU's enqueue lock (`enqueue.rs`; NCCL's
/// documentation asks for one issuing thread at a time per device, since any CUDA call may
/// synchronise the device behind a blocked NCCL kernel). A lazily connected communicator
/// connects inside its first collective of each kind, under the lock, waiting for the peer's
/// matching call, while the peer's other lane may hold *its* lock waiting for this rank's
/// other lane, which waits for our lock: a cycle. Connecting at init takes every connection
/// outside any lock. The price is NCCL's memory for every connection up front (lazy connect
/// allocates only what the collectives used need); `nccl_memory` (sshsdp-comm example) and
/// the GPU script report it. The variable is read from the caller's environment, never set
/// here: `setenv` in a library of a threaded process is undefined behaviour with glibc, and
/// NCCL reads it once, at its first initialisation. Export it in the launch (or set it first
/// thing in `main`, before any thread starts, as the examples do).
///
/// It also refuses `CUDA_DEVICE_MAX_CONNECTIONS=1` (which some training stacks export): the
/// lanes' argument for issuing in an order that may differ between ranks is that the GPU runs
/// both lanes' kernels at once (`sshsdp-backend/src/lanes/mod.rs`, "Two lanes on one GPU"),
/// and one hardware queue would put one lane's kernel behind the other's, waiting for a peer
/// that issued them the other way round.
///
/// A rank without NCCL is reported first (every rank gets that error, as from [`agree_ids`]):
/// the variables do not matter there.
fn check_connect_at_init<C: Collective>(boot: &C) -> CommResult<()> {
    let one_queue = std::env::var(ONE_QUEUE_ENV).is_ok_and(|v| v.trim() == "1");
    let local = super::probe();
    let mut counts = [
        f32::from(local.is_err()),
        f32::from(!connects_at_init()),
        f32::from(one_queue),
    ];
    boot.all_reduce(&mut counts, ReduceOp::Sum)?;
    launch_verdict(counts, local, std::env::var(RUNTIME_CONNECT_ENV).ok())
}

/// The outcome of [`check_connect_at_init`] from the world's counts of ranks `[without NCCL,
/// without connect-at-init, with one hardware queue]`, this rank's probe and its
/// [`RUNTIME_CONNECT_ENV`] (for the message): the same error kind on every rank.
fn launch_verdict(
    counts: [f32; 3],
    local: CommResult<()>,
    connect: Option<String>,
) -> CommResult<()> {
    let [missing, lazy, one_queue] = counts;
    if missing > 0.0 {
        return Err(match local {
            Err(e) => e,
            Ok(()) => CommError::Unavailable(format!(
                "NCCL engine: unavailable on {missing} rank(s) of the bootstrap world"
            )),
        });
    }
    if one_queue > 0.0 {
        return Err(CommError::InvalidArgument(format!(
            "{one_queue} rank(s) run with {ONE_QUEUE_ENV}=1: the runtime's two NCCL lanes need \
             the GPU to run their kernels at once (one hardware queue can deadlock them); \
             unset it (docs/LAUNCH.md, \"Two lanes on one GPU\")"
        )));
    }
    if lazy > 0.0 {
        return Err(CommError::InvalidArgument(format!(
            "the runtime's NCCL lanes need peers connected at init: {lazy} rank(s) lack \
             {RUNTIME_CONNECT_ENV}=0 in their environment (it is {connect:?} here). Export it \
             in the launch command, e.g. `{RUNTIME_CONNECT_ENV}=0 torchrun ...`: with NCCL's \
             default lazy connect two lanes on one GPU can deadlock (docs/LAUNCH.md, \"NCCL's \
             memory and connections\")"
        )));
    }
    Ok(())
}

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
    /// `lanes` lanes agreed over `boot` (e.g. MPI, threads, or an [`NcclComm`] made from a
    /// launch rendezvous; collective over it: every rank gets the same ids, or every rank the
    /// error), this rank on GPU `device`. Every rank must have [`RUNTIME_CONNECT_ENV`]` = 0`
    /// (see [`connects_at_init`]).
    ///
    /// The lanes share a liveness that starts in the start-up phase (waits bounded by
    /// [`NCCL_STARTUP_TIMEOUT_ENV`](super::NCCL_STARTUP_TIMEOUT_ENV) too) until the runtime
    /// calls [`CommFactory::end_startup`] after its first step.
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
        check_connect_at_init(boot)?;
        let ids = agree_ids(boot, lanes)?;
        Ok(Self {
            ids,
            connected: std::sync::Mutex::new(vec![false; lanes]),
            rank: boot.rank(),
            size: boot.size(),
            device,
            live: std::sync::Arc::new(Liveness::starting()),
        })
    }

    /// Shares `live` with the lanes (for example the liveness of the [`NcclComm`] the ids were
    /// agreed over, so that an abort fails it too and its waits get the same start-up bound).
    pub fn with_liveness(mut self, live: std::sync::Arc<Liveness>) -> Self {
        self.live = live;
        self
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

    /// The first step is done: waits are bounded by the watchdog timeout alone from now on.
    fn end_startup(&self) {
        self.live.end_startup();
    }

    /// Fails every lane of this rank: a lane waiting on a collective aborts its communicator
    /// (`ncclCommAbort`) within a poll and returns the error; later calls fail at once. Peers
    /// in other processes meet it as NCCL's asynchronous error or their own watchdog timeout.
    fn abort(&self, reason: &str) {
        self.live.fail(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_verdict_names_what_to_change_and_reports_a_missing_nccl_first() {
        assert_eq!(launch_verdict([0.0; 3], Ok(()), Some("0".into())), Ok(()));
        // No NCCL on some rank: that, whatever the variables say.
        let gone = CommError::Unavailable("nccl: no GPU".into());
        assert_eq!(
            launch_verdict([1.0, 2.0, 1.0], Err(gone.clone()), None),
            Err(gone)
        );
        assert!(matches!(
            launch_verdict([1.0, 0.0, 0.0], Ok(()), None),
            Err(CommError::Unavailable(m)) if m.contains("1 rank(s)")
        ));
        // One hardware queue: refused, naming the variable.
        assert!(matches!(
            launch_verdict([0.0, 0.0, 2.0], Ok(()), Some("0".into())),
            Err(CommError::InvalidArgument(m)) if m.contains("CUDA_DEVICE_MAX_CONNECTIONS=1")
        ));
        // Lazy connect anywhere: refused on every rank, with what to export.
        for here in [None, Some("1".to_string())] {
            match launch_verdict([0.0, 1.0, 0.0], Ok(()), here) {
                Err(CommError::InvalidArgument(m)) => {
                    assert!(m.contains("NCCL_RUNTIME_CONNECT=0 torchrun"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[cfg(feature = "threads")]
    #[test]
    fn lanes_over_threads_report_a_missing_nccl_on_every_rank() {
        if super::super::is_available() {
            return;
        }
        let out = crate::threads::ThreadsWorld::run(
            3,
            crate::threads::ThreadsConfig::default(),
            |boot| NcclLanes::from_collective(&boot, boot.rank(), 3).map(|_| ()),
        )
        .unwrap();
        for r in out {
            assert!(matches!(r.unwrap(), Err(CommError::Unavailable(_))));
        }
    }
}
