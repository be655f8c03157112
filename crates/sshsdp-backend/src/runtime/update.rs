//! The update stage: the reduced gradient pieces are collected, the global gradient norm is
//! measured on every rank alike (and a non-finite one stops the step everywhere), the
//! optimizer steps this rank's pieces, each piece's runtime bytes are re-derived from its fp32
//! master (bf16 cast or MXFP8 quantisation) and the runtime shards rebuilt across replicas.

use std::sync::Arc;

use burn_backend::{Backend, TensorMetadata};

use super::grad_sync::PieceGrad;
use super::step_agreement::{global_grad_norm, norm_message_len};
use super::{Runtime, State};
use crate::config::NonFinitePolicy;
use crate::lanes::{Reply, Worker};
use crate::storage::{
    download, encode_on_device, encode_units_on_device, read_device_units, upload, upload_shard,
    MasterBuf, ShardBuf,
};
use crate::timeline::{Timeline, Track};
use crate::units::{DeviceUnits, Elems};
use crate::HsdpError;

/// How an update hands this rank's pieces to its caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Views {
    /// Where the masters live ([`crate::Placement`]): [`PieceValues::Host`] slices or
    /// [`PieceValues::Device`] tensors, for optimizers that step either (as
    /// `sshsdp_optim::ShardedOptimizer` does).
    #[default]
    AsStored,
    /// Always [`PieceValues::Host`] slices: device masters are staged to the host before the
    /// step and back after it (counted in [`crate::Counters::staged_bytes`]), for code written
    /// over host slices (distributed Muon's exchange, checkpoints).
    Host,
}

/// A piece's fp32 master weights and world-averaged gradient, where they live.
pub enum PieceValues<'a, B: Backend> {
    /// Host memory.
    Host {
        /// Master elements (padding elements included), updated in place.
        master: &'a mut [f32],
        /// Their gradient (empty when handing out masters only).
        grad: &'a [f32],
    },
    /// Tensors on the decorated backend's device (1-D, the piece's element count).
    Device {
        /// Master elements; the optimizer replaces the tensor with the updated one.
        master: &'a mut B::FloatTensorPrimitive,
        /// Their gradient.
        grad: B::FloatTensorPrimitive,
    },
}

/// One bucket's piece on this rank during an update.
pub struct Piece<'a, B: Backend> {
    /// The bucket.
    pub bucket: usize,
    /// Position of the piece's first element in the bucket's element space (the plan's update
    /// views of the piece say where parameters sit in it).
    pub start: usize,
    /// The master and gradient values.
    pub values: PieceValues<'a, B>,
}

impl<B: Backend> Piece<'_, B> {
    /// Number of elements (padding included).
    pub fn len(&self) -> usize {
        match &self.values {
            PieceValues::Host { master, .. } => master.len(),
            PieceValues::Device { master, .. } => master.shape().num_elements(),
        }
    }

    /// Whether the piece has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host master and gradient slices; an error for device values (ask the update for
    /// [`Views::Host`] to get host slices in every placement).
    pub fn host(&mut self) -> Result<(&mut [f32], &[f32]), HsdpError> {
        match &mut self.values {
            PieceValues::Host { master, grad } => Ok((&mut **master, &**grad)),
            PieceValues::Device { .. } => Err(HsdpError::Failed(format!(
                "bucket {}'s piece is on the device: request host views (Views::Host)",
                self.bucket
            ))),
        }
    }
}

/// The collectives an optimizer may run during an update, over the *update group*: the ranks
/// whose pieces make up a bucket (the world when hierarchical, the shard group under HSDP, this
/// rank alone under DDP).
pub struct UpdateGroup<'a> {
    pub(super) worker: &'a Worker,
    pub(super) timeline: &'a Timeline,
    pub(super) piece: usize,
    /// The update-group rank holding each piece.
    pub(super) piece_ranks: Vec<usize>,
    pub(super) grad_norm: f64,
    /// Per parameter, whether it received a gradient on some rank in this step.
    pub(super) received: Vec<bool>,
}

impl UpdateGroup<'_> {
    /// Element-wise sum of `buf` over the update group (every rank calls it, in the same order).
    pub fn all_reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, HsdpError> {
        let reply = self.worker.all_reduce(buf);
        Ok(self
            .timeline
            .span(Track::Model, "wait optimizer all-reduce", None, || {
                reply.wait()
            })?)
    }

    /// Sends `send[p]` to the holder of piece `p` and returns, per piece `p`, the
    /// `recv_counts[p]` elements its holder sent this rank (one all-to-all-v over the update
    /// group; every rank calls it in the same order, and what piece `a` sends piece `b` must be
    /// what `b` expects from `a`, or it is an error on every rank). Chunks may be empty; only
    /// non-empty chunks between different ranks cross the network.
    pub fn exchange(
        &self,
        send: Vec<Vec<f32>>,
        recv_counts: &[usize],
    ) -> Result<Vec<Vec<f32>>, HsdpError> {
        let (recv, ranges) = self.exchange_flat(send, recv_counts)?;
        Ok(ranges.into_iter().map(|r| recv[r].to_vec()).collect())
    }

    /// [`Self::exchange`] without splitting what arrives: one buffer and, per piece `p`, the
    /// range of it that piece `p`'s holder sent (no second copy of the received elements).
    pub fn exchange_flat(
        &self,
        send: Vec<Vec<f32>>,
        recv_counts: &[usize],
    ) -> Result<(Vec<f32>, Vec<std::ops::Range<usize>>), HsdpError> {
        let pieces = self.piece_ranks.len();
        if send.len() != pieces || recv_counts.len() != pieces {
            return Err(HsdpError::Failed(format!(
                "exchange: {} chunks to send and {} counts for {pieces} pieces",
                send.len(),
                recv_counts.len()
            )));
        }
        // Pieces in update-group rank order.
        let mut by_rank = vec![0; pieces];
        for (p, &r) in self.piece_ranks.iter().enumerate() {
            by_rank[r] = p;
        }
        let send_counts: Vec<usize> = by_rank.iter().map(|&p| send[p].len()).collect();
        let rank_recv: Vec<usize> = by_rank.iter().map(|&p| recv_counts[p]).collect();
        let mut flat = Vec::with_capacity(send_counts.iter().sum());
        for &p in &by_rank {
            flat.extend_from_slice(&send[p]);
        }
        drop(send);
        let reply = self.worker.all_to_all_v(flat, send_counts, rank_recv);
        let recv = self
            .timeline
            .span(Track::Model, "wait optimizer all-to-all", None, || {
                reply.wait()
            })?;
        let mut ranges = vec![0..0; pieces];
        let mut at = 0;
        for &p in &by_rank {
            ranges[p] = at..at + recv_counts[p];
            at += recv_counts[p];
        }
        Ok((recv, ranges))
    }

    /// Number of pieces in the update group (one per rank of it).
    pub fn pieces(&self) -> usize {
        self.piece_ranks.len()
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

    /// Whether parameter `param` (its index in the plan) received a gradient in this step, on
    /// any rank and in any backward since the last update (the same answer on every rank).
    /// One that did not — frozen (`require_grad` false), or unused by every rank's graph — is
    /// not stepped and its optimizer state is left alone, as Burn's optimizers skip a
    /// parameter without a gradient. False for every parameter when handing out masters only.
    pub fn received_gradient(&self, param: usize) -> bool {
        self.received.get(param).copied().unwrap_or(false)
    }
}

/// Hands this rank's pieces to `step` as `views` — those with a gradient, or every bucket's
/// with empty gradients (as host slices) when `all_buckets` (checkpoints reading or writing
/// masters) — then re-derives and rebuilds the runtime shards and ends the step.
pub(super) fn run<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    all_buckets: bool,
    views: Views,
    step: impl FnOnce(&mut [Piece<'_, B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
) -> Result<(), HsdpError> {
    if let Some((b, pending)) = st.grads.waiting() {
        let failure = format!(
            "bucket {b} is still waiting for {pending} gradients: finish backward before stepping"
        );
        rt.record_failure(st, failure);
    }
    for b in 0..st.storage.len() {
        match st.grads.collect(b, &rt.timeline, &rt.materialiser.device) {
            Ok((up, down)) => {
                let c = &mut st.counters;
                c.staged_bytes += up + down;
                c.uploaded_bytes += up;
                c.downloaded_bytes += down;
                c.grad_bytes_copied += down;
            }
            Err(e) => rt.record_failure(st, e),
        }
    }
    if let Some(f) = st.failure.clone() {
        // The update's first collective is still made (it fails at once: see `worker::run`), so
        // that peers that have not met the failure yet meet it here and return from this same
        // call: the gradient norm, or the verdict when there is no norm (all buckets). Only the
        // first: peers stop at it too, so a second would wait for them in vain.
        if all_buckets {
            let _ = rt.gather_world(st, "step verdict", vec![1]);
        } else {
            let _ = rt
                .worker
                .gather_world_bytes("gradient norm", vec![0; norm_message_len(rt)])
                .wait();
        }
        return Err(HsdpError::Failed(f));
    }
    let grads: Vec<(usize, PieceGrad<B>)> = (0..st.storage.len())
        .map(|b| {
            let g = if all_buckets {
                PieceGrad::Host(Vec::new())
            } else {
                st.grads.take_piece(b)
            };
            (b, g)
        })
        .filter(|(_, g)| all_buckets || !g.is_empty())
        .collect();
    let (grad_norm, received) = if all_buckets {
        (0.0, Vec::new())
    } else {
        let (norm, received) = global_grad_norm(rt, st, &grads)?;
        st.last_grad_norm = Some(norm);
        if !norm.is_finite() {
            // Every rank measured the same norm: every rank drops this step's gradients and
            // applies nothing, so masters and runtime shards stay as they were.
            drop(grads);
            rt.end_step(st)?;
            return match rt.non_finite {
                NonFinitePolicy::Error => Err(HsdpError::NonFiniteGradient { norm }),
                NonFinitePolicy::SkipStep => {
                    st.counters.skipped_steps += 1;
                    Ok(())
                }
            };
        }
        (norm, received)
    };
    let piece = rt.plan.piece_of(rt.world_rank)?;
    let device = &rt.materialiser.device;
    // Device masters the caller wants as host slices: staged to the host for the step.
    let host_views = all_buckets || views == Views::Host;
    let mut staged: Vec<Option<Vec<f32>>> = vec![None; st.storage.len()];
    if host_views {
        for &(b, _) in &grads {
            if let Some(MasterBuf::Device(t)) = &st.storage[b].master {
                let t = t.clone();
                let values =
                    download::<B>(t).inspect_err(|e| rt.record_failure(st, e.to_string()))?;
                st.counters.staged_bytes += 4 * values.len() as u64;
                st.counters.downloaded_bytes += 4 * values.len() as u64;
                staged[b] = Some(values);
            }
        }
    }
    // Each gradient where its master is: on the host for host slices, on the device for
    // device masters.
    let grads: Vec<(usize, PieceGrad<B>)> = grads
        .into_iter()
        .map(|(b, g)| {
            let device_master = matches!(st.storage[b].master, Some(MasterBuf::Device(_)));
            let on_device = device_master && staged[b].is_none();
            match (g, on_device) {
                (PieceGrad::Device(t), false) => {
                    let values =
                        download::<B>(t).inspect_err(|e| rt.record_failure(st, e.to_string()))?;
                    st.counters.staged_bytes += 4 * values.len() as u64;
                    st.counters.downloaded_bytes += 4 * values.len() as u64;
                    Ok((b, PieceGrad::Host(values)))
                }
                (PieceGrad::Host(values), true) => {
                    st.counters.staged_bytes += 4 * values.len() as u64;
                    st.counters.uploaded_bytes += 4 * values.len() as u64;
                    Ok((b, PieceGrad::Device(upload::<B>(values, device))))
                }
                (g, _) => Ok((b, g)),
            }
        })
        .collect::<Result<_, HsdpError>>()?;
    let stepped = {
        let State { storage, .. } = &mut *st;
        let mut grads_iter = grads.iter().peekable();
        let mut pieces = Vec::with_capacity(grads.len());
        for ((b, bucket), staged) in storage.iter_mut().enumerate().zip(&mut staged) {
            let Some((_, grad)) = grads_iter.next_if(|(gb, _)| *gb == b) else {
                continue;
            };
            let values = match (&mut bucket.master, staged, grad) {
                (Some(MasterBuf::Device(master)), None, PieceGrad::Device(grad)) => {
                    PieceValues::Device {
                        master,
                        grad: grad.clone(),
                    }
                }
                (_, _, PieceGrad::Device(_)) => {
                    return Err(HsdpError::Failed(format!(
                        "bucket {b}: a device gradient for a host master"
                    )))
                }
                (_, Some(master), PieceGrad::Host(grad)) => PieceValues::Host { master, grad },
                (Some(MasterBuf::Host(master)), None, PieceGrad::Host(grad)) => {
                    PieceValues::Host { master, grad }
                }
                (Some(MasterBuf::Device(_)), None, PieceGrad::Host(_)) => {
                    return Err(HsdpError::Failed(format!(
                        "bucket {b}: a host gradient for a device master"
                    )))
                }
                (None, None, PieceGrad::Host(grad)) => {
                    // f32 with host masters: the piece's runtime elements, its place in the shard.
                    let pe = rt.codecs[b].piece_elems();
                    let range = rt.piece_in_shard * pe..(rt.piece_in_shard + 1) * pe;
                    let ShardBuf::Host(shard) = &mut bucket.shard else {
                        return Err(HsdpError::Failed(format!(
                            "bucket {b}: a device shard without a device master"
                        )));
                    };
                    let elements = Arc::make_mut(shard)
                        .as_f32_mut()
                        .ok_or_else(|| HsdpError::Failed("no fp32 master elements".into()))?;
                    PieceValues::Host {
                        master: &mut elements[range],
                        grad,
                    }
                }
            };
            pieces.push(Piece {
                bucket: b,
                start: piece * rt.codecs[b].piece_elems(),
                values,
            });
        }
        let group = UpdateGroup {
            worker: &rt.worker,
            timeline: &rt.timeline,
            piece,
            piece_ranks: piece_ranks(&rt.plan)?,
            grad_norm,
            received,
        };
        sshsdp_comm::faults::inject("sshsdp::update", rt.world_rank)
            .map_err(HsdpError::Failed)
            .and_then(|()| step(&mut pieces, &group))
    };
    // A failed step (one of its collectives failed, or the optimizer's own error) is recorded
    // first: that aborts the engine, so a peer of the update group still inside one of the
    // step's collectives fails at once instead of waiting for this rank.
    if let Err(e) = &stepped {
        rt.record_failure(st, e.to_string());
    }
    // Every rank learns whether every rank's step succeeded (one byte each, over the world), so
    // a failure in one update group (under HSDP each replica steps on its own) is an error on
    // every rank in this same call, and no rank goes on to re-derive and rebuild alone. Made
    // after a failure too: the engine fails it at once, carrying the failure to the ranks that
    // wait in it.
    let verdicts = rt.gather_world(st, "step verdict", vec![u8::from(stepped.is_err())]);
    let failed: Vec<usize> = match &verdicts {
        Ok(v) => v
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0)
            .map(|(r, _)| r)
            .collect(),
        Err(_) => Vec::new(),
    };
    stepped?;
    verdicts?;
    if !failed.is_empty() {
        let failure = format!("the optimizer step failed on ranks {failed:?}");
        rt.record_failure(st, failure.clone());
        return Err(HsdpError::Failed(failure));
    }
    // Re-derive each updated piece's runtime units and rebuild the shards across replicas.
    let mut rebuilds = Vec::new();
    for &(b, _) in &grads {
        match rederive_piece(rt, st, b, piece, staged[b].take()) {
            Ok(rebuild) => rebuilds.push((b, rebuild)),
            Err(e) => {
                // Recorded first: that aborts the engine, so peers already waiting in this
                // step's rebuilds fail at once instead of waiting for this rank.
                rt.record_failure(st, e.to_string());
                return Err(e);
            }
        }
    }
    for (b, rebuild) in rebuilds {
        match finish_rebuild(rt, st, b, rebuild) {
            Ok(shard) => st.storage[b].shard = shard,
            Err(e) => {
                rt.record_failure(st, e.to_string());
                return Err(e);
            }
        }
    }
    rt.end_step(st)
}

/// A runtime shard's rebuild after its piece was re-derived.
enum Rebuild {
    /// A host shard, rebuilt by the host collectives.
    Host(Reply<Elems>),
    /// A device shard rebuilt by the host collectives (the engine moves host memory), uploaded
    /// once rebuilt.
    Staged(Reply<Elems>),
    /// A device shard rebuilt by the engine on device memory.
    // Made only on `CubeBackend<CudaRuntime>` over NCCL.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Reply<DeviceUnits>),
    /// A device shard that is one piece: the re-derived piece is the shard.
    Done(ShardBuf),
}

/// The rebuilt shard of bucket `b`.
fn finish_rebuild<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    rebuild: Rebuild,
) -> Result<ShardBuf, HsdpError> {
    Ok(match rebuild {
        Rebuild::Host(reply) => ShardBuf::Host(Arc::new(rt.wait(b, "wait rebuild", reply)?)),
        Rebuild::Staged(reply) => {
            let shard = rt.wait(b, "wait rebuild", reply)?;
            let units = upload_shard::<B>(&rt.materialiser.device, &shard)?;
            st.counters.staged_bytes += units.uploaded;
            st.counters.uploaded_bytes += units.uploaded;
            ShardBuf::Device(units)
        }
        Rebuild::Device(reply) => ShardBuf::Device(rt.wait(b, "wait rebuild", reply)?),
        Rebuild::Done(shard) => shard,
    })
}

/// Re-derives the runtime units of piece `piece` of bucket `b` (this rank's slot of its shard)
/// from the updated master and queues the shard's rebuild: `staged` holds the master's values
/// when they were staged to the host for the step.
fn rederive_piece<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    piece: usize,
    staged: Option<Vec<f32>>,
) -> Result<Rebuild, HsdpError> {
    if st.storage[b].shard.on_device() {
        return rederive_device_piece(rt, st, b, piece, staged);
    }
    let device = &rt.materialiser.device;
    let State {
        storage, counters, ..
    } = &mut *st;
    let bucket = &mut storage[b];
    // Where the piece's new runtime units come from.
    let source = match (&mut bucket.master, staged) {
        (Some(MasterBuf::Device(t)), Some(values)) => {
            // Staged for host views: the updated values go back to the device.
            counters.staged_bytes += 4 * values.len() as u64;
            counters.uploaded_bytes += 4 * values.len() as u64;
            *t = upload::<B>(values.clone(), device);
            Rederive::Host(values)
        }
        (Some(MasterBuf::Device(t)), None) => {
            match encode_on_device::<B>(&rt.codecs[b], piece, t) {
                Some(bytes) => {
                    let bytes = bytes?;
                    counters.staged_bytes += bytes.len() as u64;
                    counters.downloaded_bytes += bytes.len() as u64;
                    Rederive::Encoded(bytes)
                }
                None => {
                    let values = download::<B>(t.clone())?;
                    counters.staged_bytes += 4 * values.len() as u64;
                    counters.downloaded_bytes += 4 * values.len() as u64;
                    Rederive::Host(values)
                }
            }
        }
        _ => Rederive::Stored,
    };
    let ShardBuf::Host(shard) = &mut bucket.shard else {
        unreachable!("device shards are re-derived by rederive_device_piece")
    };
    let units = Arc::make_mut(shard);
    let (codec, slot) = (&rt.codecs[b], rt.piece_in_shard);
    match (&bucket.master, &source) {
        (_, Rederive::Host(values)) => codec.rederive(units, slot, piece, values)?,
        (_, Rederive::Encoded(bytes)) => codec.store_piece(units, slot, bytes)?,
        (Some(MasterBuf::Host(master)), Rederive::Stored) => {
            codec.rederive(units, slot, piece, master)?
        }
        // f32 with host masters: the runtime elements were updated in place.
        (_, Rederive::Stored) => {}
    }
    let empty = Arc::new(units.zeros_like(0));
    let shard = std::mem::replace(shard, empty);
    let shard = Arc::try_unwrap(shard).unwrap_or_else(|shared| (*shared).clone());
    Ok(Rebuild::Host(rt.worker.rebuild(b, shard)))
}

/// [`rederive_piece`] for a device shard: the piece is encoded on the device from its device
/// master (uploaded first when staged for the step) and becomes the shard where the shard is one
/// piece; otherwise the replica group's pieces are gathered into the shard, by the engine on
/// device memory where it can, else through the host.
fn rederive_device_piece<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    piece: usize,
    staged: Option<Vec<f32>>,
) -> Result<Rebuild, HsdpError> {
    let device = &rt.materialiser.device;
    let State {
        storage, counters, ..
    } = &mut *st;
    let bucket = &mut storage[b];
    let Some(MasterBuf::Device(master)) = &mut bucket.master else {
        return Err(HsdpError::Failed(format!(
            "bucket {b}: a device shard without a device master"
        )));
    };
    if let Some(values) = staged {
        counters.staged_bytes += 4 * values.len() as u64;
        counters.uploaded_bytes += 4 * values.len() as u64;
        *master = upload::<B>(values, device);
    }
    let codec = &rt.codecs[b];
    let units = encode_units_on_device::<B>(codec, piece, master)?;
    if rt.plan.pieces_per_shard() == 1 {
        return Ok(Rebuild::Done(ShardBuf::Device(units)));
    }
    let shard_len = bucket.shard.len();
    #[cfg(feature = "cuda")]
    if rt.engine_on_device {
        use crate::storage::{gather_buffers, SendUnits};
        let send = SendUnits::Device(&units, 0..units.len);
        let (job, _) = gather_buffers::<B>(device, send, shard_len)?;
        return Ok(Rebuild::Device(rt.worker.rebuild_on_device(b, job)));
    }
    // Through the host: this rank's piece in its slot of a host shard, rebuilt by the host
    // collectives, uploaded once rebuilt (`finish_rebuild`).
    let piece_units = read_device_units(&units)?;
    counters.staged_bytes += piece_units.bytes();
    counters.downloaded_bytes += piece_units.bytes();
    let mut shard = piece_units.zeros_like(shard_len);
    shard.write_at(rt.piece_in_shard * piece_units.len(), &piece_units)?;
    Ok(Rebuild::Staged(rt.worker.rebuild(b, shard)))
}

/// Where a piece's new runtime units come from after its update.
enum Rederive {
    /// The master's values on the host (host masters, or device ones staged to the host):
    /// encoded by the host codec.
    Host(Vec<f32>),
    /// Encoded on the device from the device master and read back (runtime bytes).
    Encoded(Vec<u8>),
    /// The host master in storage, or (f32 format with host masters) nothing to do: the runtime
    /// elements are the masters, updated in place.
    Stored,
}

/// The update-group rank holding each piece of `plan`: the world rank when hierarchical, the
/// shard-group rank (the shard index) under HSDP, rank 0 under DDP.
fn piece_ranks(plan: &sshsdp_plan::Plan) -> Result<Vec<usize>, HsdpError> {
    (0..plan.pieces())
        .map(|p| match plan.config().sharding {
            sshsdp_plan::Sharding::Hierarchical => Ok(plan.ranks_of_piece(p)?[0]),
            sshsdp_plan::Sharding::Hsdp | sshsdp_plan::Sharding::Ddp => Ok(p),
        })
        .collect()
}
