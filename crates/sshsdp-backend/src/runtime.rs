//! The per-rank runtime: bucket storage, residency, gradient reduction and the update hook.
//!
//! Storage per bucket: this rank's *runtime shard* (persistent, `1/S` of the bucket, in the
//! plan's runtime format: see [`crate::storage`]), the gathered bucket while resident (a 1-D
//! tensor of `B` that parameters are views of), a full-bucket f32 gradient buffer while backward
//! fills it, and the reduced gradient of this rank's *piece* (its update shard). In the f32
//! runtime format the fp32 master weights *are* the piece's runtime elements, updated in place;
//! in bf16 the piece's fp32 master weights are kept apart and the bf16 piece is re-derived from
//! them after each update.
//!
//! Where parameters sit in a bucket's fp32 element space (masters, gradients) and in its runtime
//! units is the plan's layout ([`sshsdp_plan::Bucket`]); the bucket's [`BucketCodec`] encodes
//! and decodes by it: linear for f32/bf16, banded for MXFP8 (whose gathered bytes are kept while
//! resident, since forward and backward decode different planes).
//!
//! Errors inside ops (a failed gather during forward or backward) cannot be returned through
//! Burn's op signatures: the runtime records the failure, hands out zeros from then on (no
//! further collectives, so no hang), and the next [`Runtime::update`] returns the error.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn_backend::distributed::DistributedParamId;

use burn_backend::{read_sync, Backend, Shape, TensorData};
use sshsdp_plan::{Part, Plan};

use crate::codec::{BucketCodec, Phase};
use crate::comm::MeshComm;
use crate::config::{CopyMode, HsdpConfig, NonFinitePolicy};
use crate::error::HsdpError;
use crate::storage::Elems;
use crate::tensor::{HsdpFloat, ParamHandle};
use crate::views::{bucket_views, with_f32_values, Member};
use crate::worker::{Reply, Worker};

/// Bytes moved and copied since the last [`Runtime::take_counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes received by bucket all-gathers (forward and backward).
    pub gathered_bytes: u64,
    /// Bytes of full-bucket gradients entering reductions.
    pub reduced_bytes: u64,
    /// Parameter bytes copied outside collectives and re-derivation (0 on the zero-copy path).
    pub param_bytes_copied: u64,
    /// Gradient bytes copied from autodiff's tensors into bucket gradient buffers.
    pub grad_bytes_copied: u64,
    /// Bucket gathers.
    pub gathers: u64,
    /// Of those, gathers queued ahead of use (prefetched in the previous step's order).
    pub prefetched: u64,
    /// Gathers during backward (buckets released after forward and needed again).
    pub backward_gathers: u64,
    /// Most bytes of gathered (compute-dtype) buckets held at once.
    pub peak_resident_bytes: u64,
    /// Bytes of compute-dtype (f32) parameters produced by widening (bf16) or decoding (MXFP8)
    /// gathered buckets; 0 for f32 runtime parameters.
    pub decoded_bytes: u64,
    /// Updates skipped because the gradient was not finite ([`NonFinitePolicy::SkipStep`]).
    pub skipped_steps: u64,
}

/// Re-registers a parameter's autodiff leaf in a fresh graph, given the parameter's primitive:
/// how the runtime keeps leaves that a backward consumed usable by the next forward (see
/// [`crate::ShardableBackend::leaf_rearm`]).
pub type LeafRearm<B> = Arc<dyn Fn(HsdpFloat<B>) + Send + Sync>;

/// One bucket's piece on this rank during an update.
pub struct Piece<'a> {
    /// The bucket.
    pub bucket: usize,
    /// Position of the piece's first element in the bucket's element space (the plan's update
    /// views of the piece say where parameters sit in it).
    pub start: usize,
    /// fp32 master weights of the piece (padding elements included), updated in place.
    pub master: &'a mut [f32],
    /// World-averaged gradient of the piece.
    pub grad: &'a [f32],
}

/// The collectives an optimizer may run during an update, over the *update group*: the ranks
/// whose pieces make up a bucket (the world when hierarchical, the shard group under HSDP, this
/// rank alone under DDP).
pub struct UpdateGroup<'a> {
    worker: &'a Worker,
    piece: usize,
    grad_norm: f64,
}

impl UpdateGroup<'_> {
    /// Element-wise sum of `buf` over the update group (every rank calls it, in the same order).
    pub fn all_reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, HsdpError> {
        Ok(self.worker.all_reduce(buf).wait()?)
    }

    /// This rank's piece index (what the plan's `ns_owner` refers to).
    pub fn piece(&self) -> usize {
        self.piece
    }

    /// The L2 norm of the whole model's world-averaged gradient (every piece of the update
    /// group, summed in f64; the same on every rank). Always finite here: a non-finite gradient
    /// never reaches an optimizer (see [`NonFinitePolicy`]). 0 when handing out masters only.
    pub fn grad_norm(&self) -> f64 {
        self.grad_norm
    }
}

/// A gathered bucket: each parameter's tensor — a view into the gathered buffer (zero-copy
/// mode) or a copy of its part of it (FSDP2-style). The views keep the buffer alive.
struct Resident<B: Backend> {
    params: Vec<B::FloatTensorPrimitive>,
    /// Bytes of the compute buffer and of the kept runtime units.
    bytes: u64,
    /// The pass the parameters were decoded for.
    phase: Phase,
    /// The gathered runtime units, kept when the other pass decodes other values (MXFP8).
    gathered: Option<Elems>,
}

struct BucketState<B: Backend> {
    shard: Arc<Elems>,
    /// fp32 master weights of this rank's piece when the runtime format is not f32.
    master: Option<Vec<f32>>,
    resident: Option<Resident<B>>,
    /// A gather queued ahead of use, and the sections it moves.
    prefetch: Option<(Reply<Elems>, Part)>,
    grad_full: Vec<f32>,
    pending: usize,
    reductions: Vec<Reply>,
    grad_piece: Vec<f32>,
}

struct State<B: Backend> {
    buckets: Vec<BucketState<B>>,
    /// Buckets in the order this step's forward first used them.
    order: Vec<usize>,
    /// That order from the previous step: it drives prefetch in forward.
    recorded: Vec<usize>,
    /// Whether a backward pass is running (between its start and its last gradient).
    in_backward: bool,
    /// Bytes of the gathered buckets held now.
    resident_bytes: u64,
    failure: Option<String>,
    counters: Counters,
    /// The global gradient norm of the last update.
    last_grad_norm: Option<f64>,
}

impl<B: Backend> State<B> {
    /// Drops bucket `b`'s gathered parameters (if held): its views go, and the buffer with
    /// them once no op holds one.
    fn release(&mut self, b: usize) {
        if let Some(r) = self.buckets[b].resident.take() {
            self.resident_bytes -= r.bytes;
        }
    }
}

/// One rank's sharded parameters.
pub struct Runtime<B: Backend> {
    plan: Plan,
    device: B::Device,
    piece_in_shard: usize,
    world_rank: usize,
    codecs: Vec<BucketCodec>,
    copy_mode: CopyMode,
    reshard_after_forward: bool,
    non_finite: NonFinitePolicy,
    state: Mutex<State<B>>,
    worker: Worker,
    ids: OnceLock<Vec<DistributedParamId>>,
    /// Per parameter, how to re-register its current autodiff leaf (`None` without autodiff or
    /// gradient). Kept apart from `state`: re-registering takes Burn's graph locks.
    leaves: Mutex<Vec<Option<LeafRearm<B>>>>,
}

impl<B: Backend> Runtime<B> {
    pub(crate) fn new(
        plan: Plan,
        device: B::Device,
        comm: Box<dyn MeshComm>,
        codecs: Vec<BucketCodec>,
        shards: Vec<Vec<f32>>,
        config: &HsdpConfig,
    ) -> Result<Self, HsdpError> {
        let rank = comm.world_rank();
        let piece_in_shard = plan.piece_of(rank)? % plan.pieces_per_shard();
        let first_piece = plan.runtime_shard_of(rank)? * plan.pieces_per_shard();
        let format = plan.config().runtime_format;
        let buckets = shards
            .into_iter()
            .zip(&codecs)
            .map(|(shard, codec)| {
                let pe = codec.piece_elems();
                let master = (format != sshsdp_plan::RuntimeFormat::F32)
                    .then(|| shard[piece_in_shard * pe..(piece_in_shard + 1) * pe].to_vec());
                Ok((codec.encode(first_piece, shard)?, master))
            })
            .collect::<Result<Vec<_>, HsdpError>>()?
            .into_iter()
            .map(|(shard, master)| BucketState {
                shard: Arc::new(shard),
                master,
                resident: None,
                prefetch: None,
                grad_full: Vec::new(),
                pending: 0,
                reductions: Vec::new(),
                grad_piece: Vec::new(),
            })
            .collect();
        let worker = Worker::start(comm, plan.config().sharding, rank)?;
        let leaves = Mutex::new(vec![None; plan.params().len()]);
        Ok(Self {
            plan,
            device,
            piece_in_shard,
            world_rank: rank,
            codecs,
            copy_mode: config.copy_mode,
            reshard_after_forward: config.reshard_after_forward,
            non_finite: config.non_finite,
            worker,
            leaves,
            state: Mutex::new(State {
                buckets,
                order: Vec::new(),
                recorded: Vec::new(),
                in_backward: false,
                resident_bytes: 0,
                failure: None,
                counters: Counters::default(),
                last_grad_norm: None,
            }),
            ids: OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
            rearm(HsdpFloat::Param(ParamHandle {
                runtime: self.clone(),
                index,
                shape: Shape::from(p.spec.shape.clone()),
            }));
        }
    }

    /// The plan this runtime follows.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// fp32 elements of one piece of bucket `b`.
    fn piece_elems(&self, b: usize) -> usize {
        self.codecs[b].piece_elems()
    }

    /// The pass parameters are materialised for now.
    fn phase(st: &State<B>) -> Phase {
        if st.in_backward {
            Phase::Backward
        } else {
            Phase::Forward
        }
    }

    /// What a gather of bucket `b` for `phase` moves: with MXFP8 and resharding after forward
    /// (and one piece per runtime shard), only the plane that pass decodes — half the bytes;
    /// otherwise the whole shard, kept resident for both passes.
    fn sections(&self, b: usize, phase: Phase) -> Part {
        let per_pass = self.reshard_after_forward
            && self.codecs[b].has_planes()
            && self.plan.pieces_per_shard() == 1;
        if per_pass {
            phase.part()
        } else {
            Part::All
        }
    }

    /// Parameter `index` as a tensor of `B`: a view into its gathered bucket.
    pub(crate) fn view(&self, index: usize) -> B::FloatTensorPrimitive {
        let p = &self.plan.params()[index];
        let shape = Shape::from(p.spec.shape.clone());
        let mut st = self.lock();
        if !self.make_resident(&mut st, p.bucket) {
            return B::float_zeros(shape, &self.device, burn_backend::FloatDType::F32);
        }
        let b = p.bucket;
        let phase = Self::phase(&st);
        let stale = st.buckets[b]
            .resident
            .as_ref()
            .is_some_and(|r| r.phase != phase && self.codecs[b].has_planes());
        if stale {
            // MXFP8: the other pass's plane, decoded from the kept runtime bytes or gathered.
            let r = st.buckets[b].resident.take().expect("resident");
            st.resident_bytes -= r.bytes;
            let ok = match r.gathered {
                Some(gathered) => match self.install(&mut st, b, gathered, Part::All) {
                    Ok(()) => true,
                    Err(e) => {
                        st.failure = Some(e.to_string());
                        false
                    }
                },
                None => self.make_resident(&mut st, b),
            };
            if !ok {
                return B::float_zeros(shape, &self.device, burn_backend::FloatDType::F32);
            }
        }
        let k = index - self.plan.buckets()[b].params.start;
        st.buckets[b]
            .resident
            .as_ref()
            .expect("made resident")
            .params[k]
            .clone()
    }

    /// Gathers bucket `b` if it is not resident (waiting for its prefetch if one is in flight),
    /// then prefetches the bucket the previous step used next; `false` after a failure.
    fn make_resident(&self, st: &mut State<B>, b: usize) -> bool {
        if st.buckets[b].resident.is_some() {
            return true;
        }
        if st.failure.is_some() {
            return false;
        }
        let which = self.sections(b, Self::phase(st));
        let reply = match st.buckets[b].prefetch.take() {
            Some((reply, queued)) if queued == which => {
                st.counters.prefetched += 1;
                reply
            }
            Some((reply, _)) => {
                // Queued for the other pass (every rank queued it): complete it, gather again.
                if let Err(e) = reply.wait() {
                    st.failure = Some(e.to_string());
                    return false;
                }
                self.start_gather(st, b, which)
            }
            None => self.start_gather(st, b, which),
        };
        let full = match reply.wait() {
            Ok(full) => full,
            Err(e) => {
                st.failure = Some(e.to_string());
                return false;
            }
        };
        self.count_gather(st, &full);
        if let Err(e) = self.install(st, b, full, which) {
            st.failure = Some(e.to_string());
            return false;
        }
        if st.in_backward {
            st.counters.backward_gathers += 1;
            if self.reshard_after_forward {
                // Backward runs forward's order in reverse: buckets after `b` in it are done
                // (a late use gathers again).
                if let Some(pos) = st.order.iter().position(|&x| x == b) {
                    let later: Vec<usize> = st.order.drain(pos + 1..).collect();
                    later.iter().for_each(|&x| st.release(x));
                    st.order.extend(later);
                }
            }
        } else {
            if !st.order.contains(&b) {
                st.order.push(b);
            }
            if self.reshard_after_forward {
                // Forward moved on to `b`: every other gathered bucket is released (FSDP2's
                // reshard after forward); a later use gathers it again.
                for other in 0..st.buckets.len() {
                    if other != b {
                        st.release(other);
                    }
                }
            }
        }
        self.prefetch_after(st, b);
        true
    }

    /// Queues the gather of the bucket expected after `b` — in forward the one that followed it
    /// in the previous step's order, in backward the one before it in this step's forward
    /// order — so it runs on the communication thread while `b` computes. Every rank follows
    /// the same order, so every rank queues the same gathers.
    fn prefetch_after(&self, st: &mut State<B>, b: usize) {
        let next = if st.in_backward {
            match st.order.iter().position(|&x| x == b) {
                Some(pos) if pos > 0 => st.order[pos - 1],
                _ => return,
            }
        } else {
            let Some(pos) = st.recorded.iter().position(|&x| x == b) else {
                return;
            };
            let Some(&next) = st.recorded.get(pos + 1) else {
                return;
            };
            next
        };
        if st.buckets[next].resident.is_none() && st.buckets[next].prefetch.is_none() {
            let which = self.sections(next, Self::phase(st));
            let reply = self.start_gather(st, next, which);
            st.buckets[next].prefetch = Some((reply, which));
        }
    }

    /// Queues the all-gather of sections `which` of bucket `b`'s runtime shards.
    fn start_gather(&self, st: &mut State<B>, b: usize, which: Part) -> Reply<Elems> {
        // Gather straight into a fresh buffer that then becomes the tensor's storage: the
        // collective writes every byte (our own shard included), nothing is copied around it.
        let input = match self.copy_mode {
            CopyMode::ZeroCopy => st.buckets[b].shard.clone(),
            CopyMode::Fsdp2Style => {
                // Copy-in: the local shard is staged into the all-gather input.
                st.counters.param_bytes_copied += st.buckets[b].shard.bytes();
                Arc::new((*st.buckets[b].shard).clone())
            }
        };
        let codec = &self.codecs[b];
        // The whole shard (one or more pieces), or one pass's sections of its single piece.
        let part = match which {
            Part::All => 0..input.len(),
            _ => codec.part_range(which),
        };
        self.worker.gather(input, part, codec.gathered_units(which))
    }

    /// Counts the bytes of a completed gather.
    fn count_gather(&self, st: &mut State<B>, full: &Elems) {
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

    /// Makes the gathered runtime units `full` bucket `b`'s resident parameters, decoded for
    /// the current pass.
    fn install(
        &self,
        st: &mut State<B>,
        b: usize,
        full: Elems,
        which: Part,
    ) -> Result<(), HsdpError> {
        let codec = &self.codecs[b];
        let decodes = !matches!(full, Elems::F32(_));
        let phase = Self::phase(st);
        let (compute, gathered) = codec.to_compute(full, which, phase)?;
        if decodes {
            st.counters.decoded_bytes += 4 * compute.len() as u64;
        }
        let bytes = 4 * compute.len() as u64 + gathered.as_ref().map_or(0, Elems::bytes);
        let params = match self.copy_mode {
            CopyMode::ZeroCopy => {
                // The compute buffer becomes the bucket's storage (a move, not a copy); each
                // parameter is a view into it.
                let members: Vec<Member> = (0..codec.len())
                    .map(|k| Member {
                        start: codec.compute_start(k),
                        shape: codec.shape(k).to_vec(),
                    })
                    .collect();
                bucket_views::<B>(compute, &members, &self.device)
            }
            CopyMode::Fsdp2Style => (0..codec.len())
                // Copy-out: each parameter gets a tensor of its own.
                .map(|k| {
                    let start = codec.compute_start(k);
                    let numel = codec.shape(k).iter().product::<usize>();
                    let values = compute[start..start + numel].to_vec();
                    st.counters.param_bytes_copied += 4 * values.len() as u64;
                    let data = TensorData::new(values, codec.shape(k).to_vec());
                    B::float_from_data(data, &self.device)
                })
                .collect(),
        };
        st.release(b);
        st.buckets[b].resident = Some(Resident {
            params,
            bytes,
            phase,
            gathered,
        });
        st.resident_bytes += bytes;
        st.counters.peak_resident_bytes = st.counters.peak_resident_bytes.max(st.resident_bytes);
        Ok(())
    }

    /// A backward pass starts; `indices` are the parameters that will receive a gradient.
    pub(crate) fn begin_backward(&self, indices: &[usize]) {
        let mut st = self.lock();
        for b in st.buckets.iter_mut() {
            b.pending = 0;
        }
        for &i in indices {
            let b = self.plan.params()[i].bucket;
            st.buckets[b].pending += 1;
        }
        st.in_backward = !indices.is_empty();
        if self.reshard_after_forward && st.failure.is_none() {
            // The last bucket of forward is the first of backward: it stays; prefetch the one
            // before it.
            if let Some(&last) = st.order.last() {
                if st.buckets[last].resident.is_some() {
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
        let codec = &self.codecs[b];
        let k = index - self.plan.buckets()[b].params.start;
        let accumulated = with_f32_values::<B, _>(grad, |values| {
            let mut st = self.lock();
            let bucket = &mut st.buckets[b];
            if bucket.grad_full.is_empty() {
                bucket.grad_full = vec![0f32; codec.bucket_elems()];
            }
            codec.accumulate(k, values, &mut bucket.grad_full);
            st.counters.grad_bytes_copied += 4 * values.len() as u64;
            st
        });
        let mut st = match accumulated {
            Ok(st) => st,
            Err(e) => {
                self.lock().failure = Some(format!("reading the gradient of {}: {e}", p.spec.path));
                return;
            }
        };
        let bucket = &mut st.buckets[b];
        bucket.pending = bucket.pending.saturating_sub(1);
        let complete = bucket.pending == 0;
        if complete {
            self.reduce_bucket(&mut st, b);
            if self.reshard_after_forward {
                // Every gradient of the bucket is in: backward needs its parameters no more.
                st.release(b);
            }
            if st.buckets.iter().all(|b| b.pending == 0) {
                st.in_backward = false;
            }
        }
    }

    /// Queues the bucket's reduction on the communication thread; backward goes on.
    fn reduce_bucket(&self, st: &mut State<B>, b: usize) {
        let full = std::mem::take(&mut st.buckets[b].grad_full);
        st.counters.reduced_bytes += 4 * full.len() as u64;
        let reply = self.worker.reduce(full, self.piece_elems(b));
        st.buckets[b].reductions.push(reply);
    }

    /// Waits for bucket `b`'s queued reductions and adds them into its gradient piece.
    fn collect_reductions(st: &mut State<B>, b: usize) {
        for reply in std::mem::take(&mut st.buckets[b].reductions) {
            match reply.wait() {
                Ok(piece) => {
                    let acc = &mut st.buckets[b].grad_piece;
                    if acc.is_empty() {
                        *acc = piece;
                    } else {
                        acc.iter_mut().zip(&piece).for_each(|(a, g)| *a += g);
                    }
                }
                Err(e) => {
                    st.failure.get_or_insert(e.to_string());
                }
            }
        }
    }

    /// Runs the optimizer on this rank's pieces and rebuilds the runtime shards.
    ///
    /// `step(pieces, group)` updates each piece's fp32 master elements in place from its
    /// world-averaged gradient; `group` runs the optimizer's own collectives (the same on every
    /// rank, in the same order). Buckets that received no gradient are not among the pieces.
    /// Afterwards each piece's runtime elements are re-derived from its master (bf16), the
    /// runtime shards rebuilt, and every gathered bucket released, so the next forward gathers
    /// the new values.
    pub fn update_pieces(
        &self,
        step: impl FnOnce(&mut [Piece<'_>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        self.with_pieces(false, step)
    }

    /// Hands every bucket's piece to `f` (gradients empty, pending gradients left alone), then
    /// re-derives and rebuilds the runtime shards as after an update: for checkpoints, which
    /// read or overwrite the fp32 masters.
    pub fn master_pieces(
        &self,
        f: impl FnOnce(&mut [Piece<'_>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        self.with_pieces(true, f)
    }

    fn with_pieces(
        &self,
        all_buckets: bool,
        step: impl FnOnce(&mut [Piece<'_>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        let mut st = self.lock();
        if let Some(b) = st.buckets.iter().position(|b| b.pending > 0) {
            return Err(HsdpError::Failed(format!(
                "bucket {b} is still waiting for {} gradients: finish backward before stepping",
                st.buckets[b].pending
            )));
        }
        for b in 0..st.buckets.len() {
            Self::collect_reductions(&mut st, b);
        }
        if let Some(f) = &st.failure {
            return Err(HsdpError::Failed(f.clone()));
        }
        let grads: Vec<(usize, Vec<f32>)> = if all_buckets {
            (0..st.buckets.len()).map(|b| (b, Vec::new())).collect()
        } else {
            (0..st.buckets.len())
                .map(|b| (b, std::mem::take(&mut st.buckets[b].grad_piece)))
                .filter(|(_, g)| !g.is_empty())
                .collect()
        };
        let grad_norm = if all_buckets {
            0.0
        } else {
            let norm = self.global_grad_norm(&mut st, &grads)?;
            st.last_grad_norm = Some(norm);
            if !norm.is_finite() {
                // Every rank measured the same norm: every rank drops this step's gradients
                // and applies nothing, so masters and runtime shards stay as they were.
                drop(grads);
                self.end_step(&mut st)?;
                return match self.non_finite {
                    NonFinitePolicy::Error => Err(HsdpError::NonFiniteGradient { norm }),
                    NonFinitePolicy::SkipStep => {
                        st.counters.skipped_steps += 1;
                        Ok(())
                    }
                };
            }
            norm
        };
        let ranges: Vec<Range<usize>> = (0..st.buckets.len())
            .map(|b| {
                let pe = self.piece_elems(b);
                self.piece_in_shard * pe..(self.piece_in_shard + 1) * pe
            })
            .collect();
        // The piece's place in the bucket (`ranges` are places in this rank's runtime shard).
        let piece = self.plan.piece_of(self.world_rank)?;
        {
            let mut grads_iter = grads.iter().peekable();
            let mut pieces = Vec::with_capacity(grads.len());
            for (b, bucket) in st.buckets.iter_mut().enumerate() {
                let Some((_, grad)) = grads_iter.next_if(|(gb, _)| *gb == b) else {
                    continue;
                };
                let master: &mut [f32] = match &mut bucket.master {
                    Some(master) => master,
                    None => {
                        let shard = Arc::make_mut(&mut bucket.shard);
                        let elements = shard
                            .as_f32_mut()
                            .ok_or_else(|| HsdpError::Failed("no fp32 master elements".into()))?;
                        &mut elements[ranges[b].clone()]
                    }
                };
                pieces.push(Piece {
                    bucket: b,
                    start: piece * self.piece_elems(b),
                    master,
                    grad,
                });
            }
            let group = UpdateGroup {
                worker: &self.worker,
                piece,
                grad_norm,
            };
            step(&mut pieces, &group)?;
        }
        let mut rebuilds = Vec::new();
        for &(b, _) in &grads {
            let bucket = &mut st.buckets[b];
            let shard = Arc::make_mut(&mut bucket.shard);
            if let Some(master) = &bucket.master {
                self.codecs[b].rederive(shard, self.piece_in_shard, piece, master)?;
            }
            let empty = Arc::new(shard.zeros_like(0));
            let shard = std::mem::replace(&mut bucket.shard, empty);
            let shard = Arc::try_unwrap(shard).unwrap_or_else(|shared| (*shared).clone());
            rebuilds.push((b, self.worker.rebuild(shard)));
        }
        for (b, reply) in rebuilds {
            match reply.wait() {
                Ok(shard) => st.buckets[b].shard = Arc::new(shard),
                Err(e) => {
                    st.failure = Some(e.to_string());
                    return Err(e.into());
                }
            }
        }
        self.end_step(&mut st)
    }

    /// The L2 norm of the world-averaged gradient, from this rank's pieces `grads`: each rank's
    /// sum of squares in f64, all-gathered over the update group (whose pieces make up every
    /// bucket once) and summed in rank order, so every rank gets bitwise the same norm. NaN or
    /// infinite when any gradient element is (squares of finite f32 values cannot overflow f64).
    fn global_grad_norm(
        &self,
        st: &mut State<B>,
        grads: &[(usize, Vec<f32>)],
    ) -> Result<f64, HsdpError> {
        let local: f64 = grads
            .iter()
            .flat_map(|(_, g)| g.iter())
            .map(|&g| f64::from(g) * f64::from(g))
            .sum();
        let all = match self
            .worker
            .gather_bytes(local.to_le_bytes().to_vec())
            .wait()
        {
            Ok(all) => all,
            Err(e) => {
                st.failure = Some(e.to_string());
                return Err(e.into());
            }
        };
        let total: f64 = all
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .sum();
        Ok(total.sqrt())
    }

    /// Closes a step (applied or not): completes the gathers prefetched for a use that did not
    /// come, releases every gathered bucket (the next forward gathers the current values) and
    /// keeps this step's order of use for the next step's prefetch.
    fn end_step(&self, st: &mut State<B>) -> Result<(), HsdpError> {
        // A prefetch this step did not use still completed on every rank: drop its result.
        for b in 0..st.buckets.len() {
            if let Some((reply, _)) = st.buckets[b].prefetch.take() {
                if let Err(e) = reply.wait() {
                    st.failure = Some(e.to_string());
                    return Err(e.into());
                }
            }
            st.release(b);
        }
        st.recorded = std::mem::take(&mut st.order);
        st.in_backward = false;
        Ok(())
    }

    /// The global gradient norm measured by the last update (`None` before the first).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.lock().last_grad_norm
    }

    /// The counters since the last call, reset to zero.
    pub fn take_counters(&self) -> Counters {
        std::mem::take(&mut self.lock().counters)
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

    /// Bytes of this rank's persistent runtime shards.
    pub fn shard_bytes(&self) -> u64 {
        self.lock().buckets.iter().map(|b| b.shard.bytes()).sum()
    }

    /// Bytes of this rank's separate fp32 master pieces (0 in the f32 runtime format, where the
    /// runtime shard holds them).
    pub fn master_bytes(&self) -> u64 {
        self.lock()
            .buckets
            .iter()
            .map(|b| b.master.as_ref().map_or(0, |m| 4 * m.len() as u64))
            .sum()
    }
}

impl<B: Backend> Runtime<B> {
    /// The device parameters are gathered on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }
}
