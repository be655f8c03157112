//! The per-rank runtime: PyTorch FSDP2's `FSDPState` to the buckets' `FSDPParamGroup`. Each
//! [`Bucket`] (`bucket/`) owns one communication group's storage and runs its stage operations
//! (unshard, gradient, re-derive); the runtime drives them in order and keeps what spans
//! buckets:
//!
//! | concern | module | state |
//! |---|---|---|
//! | gather | [`gather`] → [`schedule`] | `Schedule` (order of use, pass), prefetch, resident bytes |
//! | gradient | [`backward`] | per-parameter "received a gradient" bits |
//! | update | [`update`] (with [`pieces`], [`step_agreement`]) | the open [`UpdateStep`] |
//!
//! Also: [`param_handles`] (parameter handles' ids, leaves and retention, [`retention`]), [`world`]
//! (world collectives outside the step), the failure, the counters. Collectives are stateless
//! and run on the communication lanes (`lanes/`, like FSDP2's `_fsdp_collectives.py`); the model
//! thread only queues them and waits for replies.
//!
//! Every stage's state lives in one [`State`] behind one mutex: an op, a gradient hook and the
//! runtime's side of an update never interleave within a rank. An update step does not hold it
//! while the optimizer runs: [`Runtime::begin_update`] moves the pieces out, the caller steps
//! them, [`UpdateStep::commit`] moves them back.
//!
//! Errors inside ops (a failed gather during forward or backward) cannot be returned through
//! Burn's op signatures: the runtime records the failure (and aborts the engine's
//! communicators, so every rank's calls fail at once), hands out zeros from then on while still
//! queuing the collectives its peers expect (which fail at once: the ranks stay in step, no
//! peer waits for a skipped call), and the next update returns the error.

mod backward;
pub(crate) mod bucket;
mod gather;
mod group_exchange;
mod param_handles;
mod pieces;
mod retention;
mod schedule;
mod step_agreement;
mod update;
mod world;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn_backend::distributed::DistributedParamId;
use burn_backend::{read_sync, Backend};
use sshsdp_plan::Plan;

pub use pieces::{Piece, UpdateGroup, Views};
pub use update::{StepOutcome, UpdateStep, Verdict};

use crate::config::{HsdpConfig, NonFinitePolicy, Placement};
use crate::counters::Counters;
use crate::error::HsdpError;
use crate::lanes::comm::LaneFactory;
use crate::lanes::{DeviceEngine, Worker};
use crate::tensor::LeafRearm;
use crate::timeline::{Span, Timeline};
use bucket::{Bucket, BucketContext, NewBuckets};
use retention::Retention;
use schedule::Schedule;

/// Every stage's mutable state.
pub(crate) struct State<B: Backend> {
    buckets: Vec<Bucket<B>>,
    schedule: Schedule,
    /// Per parameter, whether a backward since the last update expected a gradient for it on
    /// this rank (frozen parameters and those a step's graph did not use never do).
    received: Vec<bool>,
    /// Bytes of the gathered buckets held now.
    resident_bytes: u64,
    failure: Option<String>,
    counters: Counters,
    /// The global gradient norm of the last update.
    last_grad_norm: Option<f64>,
    /// Whether an update step holds the pieces now.
    updating: bool,
}

impl<B: Backend> State<B> {
    /// Releases bucket `b`'s materialised parameters.
    fn release(&mut self, b: usize) {
        self.resident_bytes -= self.buckets[b].release();
    }
}

/// One rank's sharded parameters.
pub struct Runtime<B: Backend> {
    plan: Plan,
    world_rank: usize,
    /// What the buckets' operations share (device, formats, lanes, traffic).
    ctx: BucketContext<B>,
    non_finite: NonFinitePolicy,
    /// The communicators' factory, to abort every rank's collectives after a local failure.
    lanes: Arc<dyn LaneFactory>,
    state: Mutex<State<B>>,
    ids: OnceLock<Vec<DistributedParamId>>,
    /// Per parameter, how to re-register its current autodiff leaf (`None` without autodiff or
    /// gradient). Kept apart from `state`: re-registering takes Burn's graph locks.
    leaves: Mutex<Vec<Option<LeafRearm<B>>>>,
    /// Live parameter handles: the warning about forwards without backward.
    retention: Retention,
}

impl<B: Backend> Runtime<B> {
    /// The runtime of `plan` on this rank over `buckets` (registration's, on `device`); the
    /// communication lanes connect their communicators from `lanes`, each on its own thread.
    pub(crate) fn new(
        plan: Plan,
        device: B::Device,
        lanes: Arc<dyn LaneFactory>,
        buckets: NewBuckets<B>,
        config: &HsdpConfig,
    ) -> Result<Self, HsdpError> {
        let rank = lanes.world_rank();
        let (mut buckets, traffic) = buckets.finish();
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
        let ctx = BucketContext {
            device,
            copy_mode: config.copy_mode,
            compute: config.precision.compute,
            reduce: config.precision.reduce,
            masters: config.masters,
            grads: config.grads,
            engine_on_device,
            sharding: plan.config().sharding,
            alone: plan.mesh().world_size() == 1,
            runtime_shards: plan.runtime_shards(),
            replicas: plan.mesh().replicas(),
            pieces_per_shard: plan.pieces_per_shard(),
            piece: plan.piece_of(rank)?,
            piece_in_shard: plan.piece_of(rank)? % plan.pieces_per_shard(),
            worker,
            timeline,
            traffic,
        };
        // Runtime shards on the device: where asked, or by default where the engine gathers
        // device memory and the masters (which each update encodes from) are there.
        let default_shards = if engine_on_device && config.masters == Placement::Device {
            Placement::Device
        } else {
            Placement::Host
        };
        if config.shards.unwrap_or(default_shards) == Placement::Device {
            for bucket in &mut buckets {
                bucket.shard_to_device(&ctx)?;
            }
        }
        // Registration's moves are not a step's.
        ctx.traffic.take();
        let params = plan.params().len();
        Ok(Self {
            world_rank: rank,
            ctx,
            non_finite: config.non_finite,
            lanes,
            leaves: Mutex::new(vec![None; params]),
            retention: Retention::new(params),
            state: Mutex::new(State {
                buckets,
                schedule: Schedule::new(config.reshard_after_forward),
                received: vec![false; params],
                resident_bytes: 0,
                failure: None,
                counters: Counters::default(),
                last_grad_norm: None,
                updating: false,
            }),
            ids: OnceLock::new(),
            plan,
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
        self.ctx.compute
    }

    /// The plan this runtime follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Closes a step (applied or not): completes the gathers prefetched for a use that did not
    /// come, releases every gathered bucket (the next forward gathers the current values) and
    /// keeps this step's order of use for the next step's prefetch.
    fn end_step(&self, st: &mut State<B>) -> Result<(), HsdpError> {
        // A prefetch this step did not use still completed on every rank: drop its result.
        self.drop_prefetches(st)?;
        for b in 0..st.buckets.len() {
            st.release(b);
        }
        st.schedule.end_step();
        self.ctx.worker.end_step();
        Ok(())
    }

    /// The global gradient norm measured by the last update (`None` before the first).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.lock().last_grad_norm
    }

    /// The counters since the last call, reset to zero.
    pub fn take_counters(&self) -> Counters {
        let st = &mut *self.lock();
        // A gather prefetched at the end of the last step may still be moving bytes on a
        // lane: let it land, so that its bytes count in this call (the step that queued it)
        // and never in whichever call happens to follow it.
        self.settle_prefetches(st);
        let mut counters = std::mem::take(&mut st.counters);
        (counters.comm_wait_ns, counters.comm_busy_ns) = self.ctx.timeline.take_times();
        let moved = self.ctx.traffic.take();
        counters.uploaded_bytes = moved.uploaded;
        counters.downloaded_bytes = moved.downloaded;
        counters.staged_bytes = moved.staged;
        counters.host_reads = moved.reads;
        counters.host_syncs = moved.syncs;
        counters.collectives = self.ctx.worker.take_collective_calls();
        counters
    }

    /// The timeline's spans since the last call (empty unless `HsdpConfig::with_trace`).
    pub fn take_trace(&self) -> Vec<Span> {
        // As in `take_counters`: a prefetch in flight lands in this call.
        self.settle_prefetches(&mut self.lock());
        self.ctx.timeline.take_spans()
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
        self.lock().buckets.iter().any(|b| b.shard().on_device())
    }

    /// Bytes of this rank's persistent runtime shards, wherever they are
    /// ([`Self::shards_on_device`]).
    pub fn shard_bytes(&self) -> u64 {
        self.lock().buckets.iter().map(|b| b.shard().bytes()).sum()
    }

    /// Bytes of this rank's separate fp32 master pieces on the host (0 in the f32 runtime format
    /// with host masters, where the runtime shard holds them, and with device masters).
    pub fn master_bytes(&self) -> u64 {
        self.lock()
            .buckets
            .iter()
            .map(|b| b.master().map_or(0, |m| m.host_bytes()))
            .sum()
    }

    /// Bytes of this rank's fp32 master pieces on the device ([`Placement::Device`]).
    pub fn device_master_bytes(&self) -> u64 {
        self.lock()
            .buckets
            .iter()
            .map(|b| b.master().map_or(0, |m| m.device_bytes()))
            .sum()
    }

    /// The device parameters are gathered on.
    pub fn device(&self) -> &B::Device {
        &self.ctx.device
    }

    /// The memory of [`Self::device`] as its allocator reports it (CubeCL backends only).
    pub fn device_memory(&self) -> Option<crate::storage::DeviceMemory> {
        crate::storage::device_memory::<B>(&self.ctx.device)
    }

    /// Whether the engine gathers and reduces device memory itself (see `engine_on_device`).
    pub fn collectives_on_device(&self) -> bool {
        self.ctx.engine_on_device
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
