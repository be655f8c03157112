//! The per-rank runtime, composed of stages with named state (after PyTorch FSDP2's
//! `FSDPParamGroup`), each in its own module:
//!
//! | stage | module | state | transitions |
//! |---|---|---|---|
//! | gather | [`gather`] → [`schedule`], [`residency`] | `Schedule` (order of use, pass), `BucketStorage` (runtime shard, fp32 master), `Residency` | `Sharded → Gathering → Unsharded(pass) → Sharded` · prefetch next · release |
//! | gradient | [`backward`] → [`grad_sync`] | `GradSync` (full-bucket gradients, pending counts, reductions) | accumulate · reduce · collect |
//! | update | [`update`] (with [`pieces`], [`step_agreement`]) | masters and reduced pieces | norm · step |
//! | re-derive | [`rederive`] | runtime shards | encode · rebuild |
//!
//! Also: [`handles`] (parameter handles' ids, leaves and retention, [`retention`]), [`world`]
//! (world collectives outside the step), [`counters`].
//!
//! This module composes them: [`Runtime::view`] (an op meets a parameter handle) makes the
//! bucket resident through the schedule and residency stages, autodiff's hooks drive gradient
//! sync, and [`Runtime::update_pieces`] runs the update stage. Where parameters sit in a
//! bucket's fp32 element space and runtime units is the plan's layout
//! ([`sshsdp_plan::Bucket`]), encoded and decoded by each bucket's [`BucketCodec`].
//!
//! Every stage's state lives in one [`State`] behind one mutex: an op, a gradient hook and an
//! update never interleave within a rank. Collectives run on the communication lanes
//! (`lanes/`); the model thread only queues them and waits for replies.
//!
//! Errors inside ops (a failed gather during forward or backward) cannot be returned through
//! Burn's op signatures: the runtime records the failure (and aborts the engine's
//! communicators, so every rank's calls fail at once), hands out zeros from then on while still
//! queuing the collectives its peers expect (which fail at once: the ranks stay in step, no
//! peer waits for a skipped call), and the next [`Runtime::update_pieces`] returns the error.

mod backward;
mod counters;
mod gather;
mod grad_sync;
mod handles;
mod pieces;
mod rederive;
mod residency;
mod retention;
mod schedule;
mod step_agreement;
mod update;
mod world;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn_backend::distributed::DistributedParamId;
use burn_backend::{read_sync, Backend};
use sshsdp_plan::Plan;

pub use counters::Counters;
pub use pieces::{Piece, PieceValues, UpdateGroup, Views};

use crate::config::{HsdpConfig, NonFinitePolicy, Placement};
use crate::error::HsdpError;
use crate::lanes::comm::LaneFactory;
use crate::lanes::{DeviceEngine, Worker};
use crate::storage::{BucketCodec, MasterBuf};
use crate::tensor::LeafRearm;
use crate::timeline::{Span, Timeline};
use grad_sync::GradSync;
use residency::{BucketStorage, Materialiser};
use retention::Retention;
use schedule::Schedule;

/// Every stage's mutable state.
pub(crate) struct State<B: Backend> {
    storage: Vec<BucketStorage<B>>,
    schedule: Schedule,
    grads: GradSync<B>,
    /// Bytes of the gathered buckets held now.
    resident_bytes: u64,
    failure: Option<String>,
    counters: Counters,
    /// The global gradient norm of the last update.
    last_grad_norm: Option<f64>,
}

impl<B: Backend> State<B> {
    /// Releases bucket `b`'s materialised parameters.
    fn release(&mut self, b: usize) {
        self.resident_bytes -= self.storage[b].release();
    }
}

/// One rank's sharded parameters.
pub struct Runtime<B: Backend> {
    plan: Plan,
    piece_in_shard: usize,
    world_rank: usize,
    codecs: Vec<BucketCodec>,
    materialiser: Materialiser<B>,
    /// Whether the engine gathers and reduces device memory itself (NCCL on the same GPU as
    /// `B`'s CUDA device: `storage/cube/gather.rs`, `storage/cube/reduce.rs`); otherwise device buffers are
    /// staged through the host.
    engine_on_device: bool,
    non_finite: NonFinitePolicy,
    /// Where gradients are accumulated.
    grad_placement: Placement,
    /// The communicators' factory, to abort every rank's collectives after a local failure.
    lanes: Arc<dyn LaneFactory>,
    state: Mutex<State<B>>,
    worker: Worker,
    timeline: Arc<Timeline>,
    ids: OnceLock<Vec<DistributedParamId>>,
    /// Per parameter, how to re-register its current autodiff leaf (`None` without autodiff or
    /// gradient). Kept apart from `state`: re-registering takes Burn's graph locks.
    leaves: Mutex<Vec<Option<LeafRearm<B>>>>,
    /// Live parameter handles: the warning about forwards without backward.
    retention: Retention,
}

impl<B: Backend> Runtime<B> {
    /// The runtime of `plan` on this rank. `shard_of(plan, b, codec)` returns this rank's
    /// runtime shard of bucket `b` as fp32 elements; it is called once per bucket in plan
    /// order and each shard is encoded (and its master split off) before the next is asked
    /// for, so registration holds one bucket's fp32 shard at a time. The communication lanes
    /// connect their communicators from `lanes`, each on its own thread.
    pub(crate) fn new(
        plan: Plan,
        device: B::Device,
        lanes: Arc<dyn LaneFactory>,
        codecs: Vec<BucketCodec>,
        mut shard_of: impl FnMut(&Plan, usize, &BucketCodec) -> Result<Vec<f32>, HsdpError>,
        config: &HsdpConfig,
    ) -> Result<Self, HsdpError> {
        let rank = lanes.world_rank();
        let piece_in_shard = plan.piece_of(rank)? % plan.pieces_per_shard();
        let first_piece = plan.runtime_shard_of(rank)? * plan.pieces_per_shard();
        // In f32 with host masters the runtime shard's piece is the master; otherwise the
        // master is kept apart, where the config places it.
        let separate_masters = plan.config().runtime_format != sshsdp_plan::RuntimeFormat::F32
            || config.masters != Placement::Host;
        let storage = codecs
            .iter()
            .enumerate()
            .map(|(b, codec)| {
                let shard = shard_of(&plan, b, codec)?;
                let pe = codec.piece_elems();
                let master = separate_masters.then(|| {
                    let values = shard[piece_in_shard * pe..(piece_in_shard + 1) * pe].to_vec();
                    MasterBuf::new(config.masters, values, &device)
                });
                Ok(BucketStorage::new(
                    codec.encode(first_piece, shard)?,
                    master,
                ))
            })
            .collect::<Result<Vec<_>, HsdpError>>()?;
        let timeline = Arc::new(Timeline::new(rank, config.trace));
        let mesh = (plan.mesh().replicas(), plan.mesh().shards());
        let worker = Worker::start(
            lanes.clone(),
            mesh,
            plan.config().sharding,
            rank,
            timeline.clone(),
        )?;
        // The FSDP2-style baseline copies parameters out of the bucket: it gathers on the host.
        let engine_on_device = config.copy_mode == crate::config::CopyMode::ZeroCopy
            && config.device_collectives
            && engine_on_device::<B>(&worker, &device)?;
        // Runtime shards on the device: where asked, or by default where the engine gathers
        // device memory and the masters (which each update encodes from) are there.
        let shards_on_device =
            config
                .shards
                .unwrap_or(if engine_on_device && config.masters == Placement::Device {
                    Placement::Device
                } else {
                    Placement::Host
                })
                == Placement::Device;
        let mut storage = storage;
        if shards_on_device {
            for bucket in &mut storage {
                if let crate::storage::ShardBuf::Host(shard) = &bucket.shard {
                    let units = crate::storage::upload_shard::<B>(&device, shard)?;
                    bucket.shard = crate::storage::ShardBuf::Device(units);
                }
            }
        }
        let leaves = Mutex::new(vec![None; plan.params().len()]);
        let retention = Retention::new(plan.params().len());
        let buckets = storage.len();
        let params = plan.params().len();
        Ok(Self {
            plan,
            piece_in_shard,
            world_rank: rank,
            codecs,
            materialiser: Materialiser {
                device,
                copy_mode: config.copy_mode,
                compute: config.precision.compute,
            },
            engine_on_device,
            non_finite: config.non_finite,
            grad_placement: config.grads,
            lanes,
            worker,
            timeline,
            leaves,
            retention,
            state: Mutex::new(State {
                storage,
                schedule: Schedule::new(config.reshard_after_forward),
                grads: GradSync::new(buckets, params, config.precision.reduce),
                resident_bytes: 0,
                failure: None,
                counters: Counters::default(),
                last_grad_norm: None,
            }),
            ids: OnceLock::new(),
        })
    }

    /// Records this rank's first failure and aborts every rank's collectives (where the engine
    /// can), so a local error is an error on every rank at once, not a wait for a timeout.
    fn record_failure(&self, st: &mut State<B>, failure: String) {
        if st.failure.is_none() {
            self.lanes
                .abort_all(&format!("rank {} failed: {failure}", self.world_rank));
            st.failure = Some(failure);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The dtype parameters compute in.
    pub(crate) fn compute_precision(&self) -> crate::config::Precision {
        self.materialiser.compute
    }

    /// The plan this runtime follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Runs the optimizer on this rank's pieces and rebuilds the runtime shards.
    ///
    /// `step(pieces, group)` updates each piece's fp32 master elements (handed as `views`) from its
    /// world-averaged gradient; `group` runs the optimizer's own collectives (the same on every
    /// rank, in the same order). Buckets that received no gradient are not among the pieces.
    /// Afterwards each piece's runtime elements are re-derived from its master (bf16, MXFP8),
    /// the runtime shards rebuilt, and every gathered bucket released, so the next forward
    /// gathers the new values.
    pub fn update_pieces(
        &self,
        views: Views,
        step: impl FnOnce(&mut [Piece<'_, B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        update::run(self, &mut self.lock(), false, views, step)
    }

    /// Hands every bucket's piece to `f` as host slices (gradients empty, pending gradients left
    /// alone; device masters staged), then
    /// re-derives and rebuilds the runtime shards as after an update: for checkpoints, which
    /// read or overwrite the fp32 masters.
    pub fn master_pieces(
        &self,
        f: impl FnOnce(&mut [Piece<'_, B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        update::run(self, &mut self.lock(), true, Views::Host, f)
    }

    /// Closes a step (applied or not): completes the gathers prefetched for a use that did not
    /// come, releases every gathered bucket (the next forward gathers the current values) and
    /// keeps this step's order of use for the next step's prefetch.
    fn end_step(&self, st: &mut State<B>) -> Result<(), HsdpError> {
        for b in 0..st.storage.len() {
            // A prefetch this step did not use still completed on every rank: drop its result.
            if let Some(reply) = st.storage[b].take_gather() {
                if let Err(e) = self.wait(b, "wait unused prefetch", reply) {
                    self.record_failure(st, e.to_string());
                    return Err(e.into());
                }
            }
            st.release(b);
        }
        st.schedule.end_step();
        self.worker.end_step();
        Ok(())
    }

    /// The global gradient norm measured by the last update (`None` before the first).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.lock().last_grad_norm
    }

    /// The counters since the last call, reset to zero.
    pub fn take_counters(&self) -> Counters {
        let mut counters = std::mem::take(&mut self.lock().counters);
        (counters.comm_wait_ns, counters.comm_busy_ns) = self.timeline.take_times();
        counters
    }

    /// The timeline's spans since the last call (empty unless `HsdpConfig::with_trace`).
    pub fn take_trace(&self) -> Vec<Span> {
        self.timeline.take_spans()
    }

    /// A copy of parameter `index`'s current values, gathered (for checks and export).
    pub fn param_values(&self, index: usize) -> Result<Vec<f32>, HsdpError> {
        let view = self.view(index);
        if let Some(f) = &self.lock().failure {
            return Err(HsdpError::Failed(f.clone()));
        }
        read_sync(B::float_into_data(view))
            .map_err(|e| HsdpError::Failed(format!("{e:?}")))?
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| HsdpError::Failed(format!("{e:?}")))
    }

    /// This rank's index in the world.
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// Whether this rank's runtime shards are in device memory (see
    /// [`HsdpConfig::with_shard_placement`]).
    pub fn shards_on_device(&self) -> bool {
        self.lock().storage.iter().any(|b| b.shard.on_device())
    }

    /// Bytes of this rank's persistent runtime shards, wherever they are
    /// ([`Self::shards_on_device`]).
    pub fn shard_bytes(&self) -> u64 {
        self.lock().storage.iter().map(|b| b.shard.bytes()).sum()
    }

    /// Bytes of this rank's separate fp32 master pieces on the host (0 in the f32 runtime format
    /// with host masters, where the runtime shard holds them, and with device masters).
    pub fn master_bytes(&self) -> u64 {
        self.lock()
            .storage
            .iter()
            .map(|b| b.master.as_ref().map_or(0, MasterBuf::host_bytes))
            .sum()
    }

    /// Bytes of this rank's fp32 master pieces on the device ([`Placement::Device`]).
    pub fn device_master_bytes(&self) -> u64 {
        self.lock()
            .storage
            .iter()
            .map(|b| b.master.as_ref().map_or(0, MasterBuf::device_bytes))
            .sum()
    }

    /// The device parameters are gathered on.
    pub fn device(&self) -> &B::Device {
        &self.materialiser.device
    }

    /// The memory of [`Self::device`] as its allocator reports it (CubeCL backends only).
    pub fn device_memory(&self) -> Option<crate::DeviceMemory> {
        crate::storage::device_memory::<B>(&self.materialiser.device)
    }

    /// Whether the engine gathers and reduces device memory itself (see `engine_on_device`).
    pub fn collectives_on_device(&self) -> bool {
        self.engine_on_device
    }
}

/// Whether `worker`'s engine can gather and reduce `B`'s device memory itself: NCCL on the GPU
/// of `B`'s device (`B` is `CubeBackend<CudaRuntime, …>` or fusion over it), or ranks of this
/// process that all hold `device` of the same CubeCL backend (the threads engine's peers
/// collectives; agreed by a world all-gather, so every rank decides alike). Elsewhere device
/// buffers are staged through the host (an engine on another GPU than `B`'s is staged too,
/// correct but slower).
fn engine_on_device<B: Backend>(worker: &Worker, device: &B::Device) -> Result<bool, HsdpError> {
    match worker.device_engine() {
        None => Ok(false),
        Some(DeviceEngine::Gpu(ordinal)) => {
            Ok(crate::storage::cuda_ordinal::<B>(device) == Some(ordinal))
        }
        Some(DeviceEngine::Peers) => {
            // Same backend type and device: the same CubeCL server, whose buffers every rank's
            // kernels may bind.
            let cube = crate::storage::is_cube_backend::<B>();
            let identity = format!("{}|{device:?}|{cube}", std::any::type_name::<B>());
            // FNV-1a: equal lengths for the all-gather, equal on every rank for equal inputs.
            let digest = identity.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let mine = digest.to_le_bytes().to_vec();
            let all = worker
                .gather_world_bytes("device identity", mine.clone())
                .wait()?;
            Ok(cube
                && all
                    .chunks(mine.len())
                    .all(|theirs| theirs == mine.as_slice()))
        }
    }
}
