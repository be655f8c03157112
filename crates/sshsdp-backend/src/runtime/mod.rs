//! The per-rank runtime, composed of stages with named state (after PyTorch FSDP2's
//! `FSDPParamGroup`), each in its own module:
//!
//! | stage | module | state | transitions |
//! |---|---|---|---|
//! | storage + residency | [`residency`] | `BucketStorage` (runtime shard, fp32 master), `Residency` | `Sharded → Gathering → Unsharded(pass) → Sharded` |
//! | schedule | [`schedule`] | `Schedule` (order of use, pass) | gather · prefetch next · release |
//! | gradient sync | [`grad_sync`] | `GradSync` (full-bucket gradients, pending counts, reductions) | accumulate · reduce · collect |
//! | update | [`update`] | masters and reduced pieces | norm · step · re-derive · rebuild |
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

mod counters;
mod grad_sync;
mod residency;
mod retention;
mod schedule;
mod step_agreement;
mod update;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn_backend::distributed::DistributedParamId;
use burn_backend::{read_sync, Backend, Shape};
use sshsdp_plan::Plan;

pub use counters::Counters;
pub use update::{Piece, PieceValues, UpdateGroup, Views};

use crate::config::{HsdpConfig, NonFinitePolicy, Placement};
use crate::error::HsdpError;
use crate::lanes::comm::LaneFactory;
use crate::lanes::{Reply, Worker};
use crate::storage::{with_f32_values, BucketCodec, MasterBuf};
use crate::tensor::{HsdpFloat, LeafRearm, ParamHandle, ParamOwner};
use crate::timeline::{Span, Timeline, Track};
use crate::units::Gathered;
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
    /// `B`'s CUDA device: `cube_gather.rs`, `cube_reduce.rs`); otherwise device buffers are
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
            && engine_on_device::<B>(&worker, &device);
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

    /// Records the gradient-routing ids of the parameters (by plan index), once.
    pub(crate) fn set_ids(&self, ids: Vec<DistributedParamId>) {
        let _ = self.ids.set(ids);
    }

    /// The gradient-routing id of parameter `index`.
    pub(crate) fn id(&self, index: usize) -> DistributedParamId {
        self.ids.get().expect("ids are set at registration")[index]
    }

    /// Records how to re-register parameter `index`'s current autodiff leaf.
    pub(crate) fn set_leaf(&self, index: usize, rearm: Option<LeafRearm<B>>) {
        self.leaves.lock().unwrap_or_else(|p| p.into_inner())[index] = rearm;
    }

    /// After a backward that consumed the leaves of parameters `indices` (Burn removes a
    /// graph's nodes, leaves included, once it has run backward through them): registers each
    /// leaf again, so the module's parameters take part in the next backward as they are — a
    /// second micro-batch of gradient accumulation routes its gradients like the first.
    /// Called on the backward's thread after Burn released its graph locks.
    pub(crate) fn rearm_leaves(self: &Arc<Self>, indices: &[usize]) {
        let rearms: Vec<(usize, LeafRearm<B>)> = {
            let leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
            indices
                .iter()
                .filter_map(|&i| leaves[i].clone().map(|r| (i, r)))
                .collect()
        };
        for (index, rearm) in rearms {
            let p = &self.plan.params()[index];
            rearm(HsdpFloat::Param(ParamHandle::new(
                self.clone(),
                index,
                Shape::from(p.spec.shape.clone()),
            )));
        }
    }

    /// A [`ParamHandle`] to one of this runtime's parameters was made.
    pub(crate) fn handle_made(&self) {
        self.retention.acquire();
    }

    /// A [`ParamHandle`] was dropped.
    pub(crate) fn handle_dropped(&self) {
        self.retention.release();
    }

    /// Handles to this runtime's parameters alive now: the module's own, plus those autodiff
    /// graphs saved for backward. Forward passes without backward grow it (see
    /// [`Runtime::forwards_without_backward_warned`]).
    pub fn live_param_handles(&self) -> u64 {
        self.retention.live()
    }

    /// Whether the runtime warned that forward passes without backward are keeping autodiff
    /// graphs alive (more live parameter handles than 16 steps' worth, or 64 per parameter
    /// before the first backward).
    pub fn forwards_without_backward_warned(&self) -> bool {
        self.retention.warned()
    }

    /// The plan this runtime follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Parameter `index` as a tensor of `B`: a view into its gathered bucket.
    pub(crate) fn view(&self, index: usize) -> B::FloatTensorPrimitive {
        let p = &self.plan.params()[index];
        let shape = Shape::from(p.spec.shape.clone());
        let zeros = |shape| {
            B::float_zeros(
                shape,
                &self.materialiser.device,
                burn_backend::FloatDType::F32,
            )
        };
        let mut st = self.lock();
        let b = p.bucket;
        if !self.make_resident(&mut st, b) {
            return zeros(shape);
        }
        let k = index - self.plan.buckets()[b].params.start;
        st.storage[b].resident().expect("made resident").params[k].clone()
    }

    /// Gathers bucket `b` if it is not resident (waiting for its prefetch if one is in flight),
    /// then prefetches the bucket the schedule expects next; `false` after a failure.
    fn make_resident(&self, st: &mut State<B>, b: usize) -> bool {
        if st.storage[b].resident().is_some() {
            return true;
        }
        if let Err(e) = sshsdp_comm::faults::inject("sshsdp::gather", self.world_rank) {
            self.record_failure(st, e);
        }
        // After a failure the gather is still queued (it fails at once on every rank: see
        // `worker::run`) and the bucket is installed as zeros, so that this rank's later calls
        // are exactly its peers' (the same schedule, prefetches included): the ranks stay in
        // step until the update reports the failure.
        let reply = match st.storage[b].take_gather() {
            Some(reply) => {
                st.counters.prefetched += 1;
                reply
            }
            None => self.start_gather(st, b),
        };
        let zeros = |st: &State<B>| {
            let units = self.codecs[b].gathered_units();
            Gathered::Host(st.storage[b].shard.zeros_like(units))
        };
        let full = match self.wait(b, "wait gather", reply) {
            Ok(full) if st.failure.is_none() => full,
            Ok(_) => zeros(st),
            Err(e) => {
                self.record_failure(st, e.to_string());
                zeros(st)
            }
        };
        self.count_gather(st, &full);
        if !self.install(st, b, full) {
            return false;
        }
        if st.schedule.in_backward() {
            st.counters.backward_gathers += 1;
        }
        let buckets = st.storage.len();
        for other in st.schedule.gathered(b, buckets) {
            st.release(other);
        }
        self.prefetch_after(st, b);
        true
    }

    /// Queues the gather of the bucket the schedule expects after `b`, so it runs on the
    /// communication lane while `b` computes.
    fn prefetch_after(&self, st: &mut State<B>, b: usize) {
        let Some(next) = st.schedule.next_after(b) else {
            return;
        };
        if st.storage[next].is_sharded() {
            let reply = self.start_gather(st, next);
            st.storage[next].residency = residency::Residency::Gathering(reply);
        }
    }

    /// Queues the all-gather of bucket `b`'s runtime shards.
    fn start_gather(&self, st: &mut State<B>, b: usize) -> Reply<Gathered> {
        let State {
            storage, counters, ..
        } = st;
        let on_device = self.engine_on_device.then_some(&self.materialiser.device);
        storage[b].start_gather(
            b,
            &self.worker,
            &self.codecs[b],
            self.materialiser.copy_mode,
            on_device,
            self.materialiser.stager(),
            counters,
        )
    }

    /// Waits for `reply`, timed as the model thread's wait on bucket `b`.
    fn wait<T>(&self, b: usize, name: &'static str, reply: Reply<T>) -> sshsdp_comm::CommResult<T> {
        self.timeline
            .span(Track::Model, name, Some(b), || reply.wait())
    }

    /// Counts the bytes of a completed gather.
    fn count_gather(&self, st: &mut State<B>, full: &Gathered) {
        if self.plan.config().sharding == sshsdp_plan::Sharding::Ddp {
            // Replicated parameters are copied into a fresh tensor after each update.
            st.counters.param_bytes_copied += full.bytes();
        } else {
            st.counters.gathers += 1;
            // Every rank's part but our own.
            let shards = self.plan.runtime_shards() as u64;
            st.counters.gathered_bytes += full.bytes() - full.bytes() / shards;
        }
    }

    /// Materialises the gathered units `full` as bucket `b`'s parameters (→ `Unsharded`);
    /// `false` after recording a failure.
    fn install(&self, st: &mut State<B>, b: usize, full: Gathered) -> bool {
        let installed = self
            .materialiser
            .install(&self.codecs[b], full, &mut st.counters);
        let resident = match installed {
            Ok(resident) => resident,
            Err(e) => {
                self.record_failure(st, e.to_string());
                return false;
            }
        };
        st.release(b);
        st.resident_bytes += resident.bytes;
        st.counters.peak_resident_bytes = st.counters.peak_resident_bytes.max(st.resident_bytes);
        st.storage[b].residency = residency::Residency::Unsharded(resident);
        true
    }

    /// A backward pass starts; `indices` are the parameters that will receive a gradient.
    pub(crate) fn begin_backward(&self, indices: &[usize]) {
        self.retention.backward_started();
        let mut st = self.lock();
        st.grads
            .begin(indices.iter().map(|&i| (i, self.plan.params()[i].bucket)));
        st.schedule.set_backward(!indices.is_empty());
        if st.schedule.reshards() && st.failure.is_none() {
            // The last bucket of forward is the first of backward: it stays; prefetch the one
            // before it.
            if let Some(last) = st.schedule.last_forward() {
                if st.storage[last].resident().is_some() {
                    self.prefetch_after(&mut st, last);
                }
            }
        }
    }

    /// Parameter `index`'s final gradient: accumulate it into its bucket; reduce the bucket once
    /// every expected gradient has arrived.
    pub(crate) fn submit_gradient(&self, index: usize, grad: B::FloatTensorPrimitive) {
        let p = &self.plan.params()[index];
        let b = p.bucket;
        let k = index - self.plan.buckets()[b].params.start;
        let (mut st, complete) = if self.grad_placement == Placement::Device {
            let members = self.codecs[b].len();
            let mut st = self.lock();
            let complete = st.grads.accumulate_on_device(b, members, k, grad);
            (st, complete)
        } else {
            let accumulated = with_f32_values::<B, _>(grad, |values| {
                let mut st = self.lock();
                let complete = st.grads.accumulate(b, &self.codecs[b], k, values);
                st.counters.grad_bytes_copied += 4 * values.len() as u64;
                (st, complete)
            });
            match accumulated {
                Ok(((mut st, complete), downloaded)) => {
                    st.counters.downloaded_bytes += downloaded;
                    (st, complete)
                }
                Err(e) => {
                    let failure = format!("reading the gradient of {}: {e}", p.spec.path);
                    self.record_failure(&mut self.lock(), failure);
                    return;
                }
            }
        };
        if complete {
            if let Err(e) = sshsdp_comm::faults::inject("sshsdp::reduce", self.world_rank) {
                // The reduction is still queued (see `worker::run`): the ranks stay in step.
                self.record_failure(&mut st, e);
            }
            let how = (
                self.plan.config().sharding,
                self.plan.runtime_shards(),
                self.engine_on_device,
            );
            match st.grads.reduce(b, &self.codecs[b], &self.worker, how) {
                Ok(reduced) => {
                    st.counters.reduced_bytes += reduced.bytes;
                    st.counters.staged_bytes += reduced.staged;
                    st.counters.downloaded_bytes += reduced.staged;
                    st.counters.grad_bytes_copied += reduced.staged;
                }
                Err(e) => {
                    // Peers queue this bucket's reduction; theirs times out and fails the step.
                    self.record_failure(&mut st, format!("reading bucket {b}'s gradients: {e}"));
                }
            }
            if st.schedule.reshards() {
                // Every gradient of the bucket is in: backward needs its parameters no more.
                st.release(b);
            }
            if st.grads.complete() {
                st.schedule.set_backward(false);
            }
        }
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

    /// Every rank's `bytes` (all the same length), in rank order: an all-gather over the world
    /// on the replica lane, in program order with the runtime's other collectives.
    pub fn all_gather_world(&self, bytes: Vec<u8>) -> Result<Vec<u8>, HsdpError> {
        self.gather_world(&mut self.lock(), "world agreement", bytes)
    }

    /// World rank 0's `buf` on every rank (all pass the same length): a broadcast over the world
    /// on the replica lane, in program order with the runtime's other collectives; `stage`
    /// names it on the timeline. A failure is recorded.
    pub fn broadcast_world(
        &self,
        stage: &'static str,
        buf: Vec<f32>,
    ) -> Result<Vec<f32>, HsdpError> {
        let st = &mut self.lock();
        let reply = self.worker.broadcast_world(stage, buf);
        let received = self
            .timeline
            .span(Track::Model, "wait world broadcast", None, || reply.wait());
        self.settle_world(st, received)
    }

    /// [`Self::all_gather_world`] with the state held, labelled `stage`; a failure is recorded.
    fn gather_world(
        &self,
        st: &mut State<B>,
        stage: &'static str,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, HsdpError> {
        // Made after a failure too (it fails at once: see `worker::run`): the ranks stay in step.
        let reply = self.worker.gather_world_bytes(stage, bytes);
        let gathered = self
            .timeline
            .span(Track::Model, "wait world all-gather", None, || reply.wait());
        self.settle_world(st, gathered)
    }

    /// A world collective's outcome: its value, or the failure this rank recorded before it
    /// (the collective was still made, so the ranks stay in step), or its own error, recorded.
    fn settle_world<T>(
        &self,
        st: &mut State<B>,
        outcome: Result<T, sshsdp_comm::CommError>,
    ) -> Result<T, HsdpError> {
        match (outcome, &st.failure) {
            (Ok(value), None) => Ok(value),
            (Ok(_), Some(f)) => Err(HsdpError::Failed(f.clone())),
            (Err(e), _) => {
                self.record_failure(st, e.to_string());
                Err(e.into())
            }
        }
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

/// Whether `worker`'s engine can gather and reduce `B`'s device memory itself: it moves device
/// memory (NCCL), `B` is `CubeBackend<CudaRuntime, …>` and both are on the same GPU (elsewhere
/// device buffers are staged through the host; an engine on another GPU than `B`'s is staged
/// too, correct but slower).
fn engine_on_device<B: Backend>(worker: &Worker, device: &B::Device) -> bool {
    let ordinal = crate::storage::cuda_ordinal::<B>(device);
    ordinal.is_some() && ordinal == worker.device_ordinal()
}

impl<B: Backend> ParamOwner<B> for Runtime<B> {
    fn view(&self, index: usize) -> B::FloatTensorPrimitive {
        Runtime::view(self, index)
    }

    fn path(&self, index: usize) -> &str {
        &self.plan.params()[index].spec.path
    }

    fn compute_dtype(&self) -> burn_backend::DType {
        self.compute_precision().dtype().into()
    }

    fn device(&self) -> &B::Device {
        Runtime::device(self)
    }

    fn id(&self, index: usize) -> DistributedParamId {
        Runtime::id(self, index)
    }

    fn set_leaf(&self, index: usize, rearm: Option<LeafRearm<B>>) {
        Runtime::set_leaf(self, index, rearm)
    }

    fn handle_made(&self) {
        Runtime::handle_made(self)
    }

    fn handle_dropped(&self) {
        Runtime::handle_dropped(self)
    }
}
