//! [`Bucket`]: one communication group's parameters on this rank, the counterpart of PyTorch
//! FSDP2's `FSDPParamGroup`. It owns everything per bucket — the codec (the plan's layout of
//! the bucket), the runtime shard, the fp32 master of this rank's piece, where the bucket
//! stands in a step (its residency) and its gradients in flight — and the stage operations are
//! its methods:
//!
//! | stage | methods | module |
//! |---|---|---|
//! | unshard | [`Bucket::start_gather`] → [`Bucket::install`] → [`Bucket::release`] | [`unshard`] |
//! | gradient | [`Bucket::accumulate`] → [`Bucket::reduce`] → [`Bucket::collect`] → [`Bucket::take_grad`] | [`grads`] |
//! | update | [`Bucket::take_master`] / [`Bucket::restore_master`] (the step's pieces) | here |
//! | re-derive | [`Bucket::rederive`] → [`Bucket::finish_rebuild`] | [`rederive`] |
//!
//! What every bucket's operations share — the device, the formats, the lanes, the traffic
//! counter — is the runtime's [`BucketContext`]; the runtime (`FSDPState`'s counterpart) keeps
//! the schedule, prefetch, failure and counters, and calls these methods once per stage.
//! Where the bytes live is the storage seam's business (`storage/`: [`ShardBuf`], [`F32Buf`]):
//! a bucket asks its buffers to move, and the move charges the traffic it makes.

pub(super) mod grads;
pub(super) mod rederive;
pub(super) mod unshard;

use std::ops::Range;
use std::sync::Arc;

use burn_backend::Backend;
use sshsdp_plan::Sharding;

use crate::config::{CopyMode, Placement, Precision};
use crate::error::HsdpError;
use crate::lanes::Worker;
use crate::runtime_units::Elems;
use crate::storage::{upload_shard, BucketCodec, F32Buf, ShardBuf, TakenMaster};
use crate::timeline::Timeline;
use crate::traffic::Traffic;
use grads::BucketGrads;
use unshard::Residency;

/// What every bucket's stage operations need from the runtime, decided once at `shard`.
pub(crate) struct BucketContext<B: Backend> {
    /// The device parameters are gathered on.
    pub device: B::Device,
    /// Views into the bucket, or copies (the FSDP2-style baseline).
    pub copy_mode: CopyMode,
    /// The dtype parameters compute in.
    pub compute: Precision,
    /// The dtype gradients are reduced in.
    pub reduce: Precision,
    /// Where fp32 masters live between steps.
    pub masters: Placement,
    /// Where gradients are accumulated.
    pub grads: Placement,
    /// Whether the engine gathers and reduces device memory itself (NCCL on `B`'s GPU, or ranks
    /// of this process sharing `B`'s device); otherwise device buffers are staged.
    pub engine_on_device: bool,
    /// How the mesh shards buckets.
    pub sharding: Sharding,
    /// Whether this rank is the whole world: a reduction is the identity (the world-1 fast
    /// path: no reduction job). (A gather copies nothing wherever `runtime_shards` is 1.)
    pub alone: bool,
    /// Runtime shards per bucket (the shard group's size).
    pub runtime_shards: usize,
    /// Replicas of the mesh (the replica group's size).
    pub replicas: usize,
    /// Pieces per runtime shard (replicas when hierarchical, else 1).
    pub pieces_per_shard: usize,
    /// This rank's piece: its index among all pieces, and its slot in its runtime shard.
    pub piece: usize,
    /// See `piece`.
    pub piece_in_shard: usize,
    /// The communication lanes.
    pub worker: Worker,
    /// The step timeline.
    pub timeline: Arc<Timeline>,
    /// Host↔device bytes, charged where they move.
    pub traffic: Arc<Traffic>,
}

/// One bucket on this rank (see the module docs).
pub(crate) struct Bucket<B: Backend> {
    /// Its index in the plan.
    index: usize,
    /// Plan indices of its parameters (its members, in order).
    params: Range<usize>,
    /// The plan's layout of the bucket, with its encode and decode.
    codec: BucketCodec,
    /// This rank's runtime shard (`1/S` of the bucket, in the runtime format), persistent.
    shard: ShardBuf,
    /// The fp32 master of this rank's piece, apart from the shard unless the runtime format is
    /// f32 with host masters (then the piece's runtime elements are the master). `None` too
    /// while an update step holds it.
    master: Option<F32Buf<B>>,
    /// Where the bucket stands in a step.
    residency: Residency<B>,
    /// Its gradients in flight.
    grads: BucketGrads<B>,
}

/// This rank's buckets as registration makes them, one at a time in plan order, before the
/// runtime starts: each bucket's fp32 runtime shard is encoded (and its master split off) as it
/// arrives, so registration holds one bucket's fp32 shard at a time.
pub(crate) struct NewBuckets<B: Backend> {
    device: B::Device,
    masters: Placement,
    /// Whether masters are kept apart from the runtime shards (see [`Bucket`]'s `master`).
    separate_masters: bool,
    piece_in_shard: usize,
    first_piece: usize,
    traffic: Arc<Traffic>,
    buckets: Vec<Bucket<B>>,
}

impl<B: Backend> NewBuckets<B> {
    /// None yet, for `plan` on world rank `rank`.
    pub fn new(
        plan: &sshsdp_plan::Plan,
        rank: usize,
        device: &B::Device,
        config: &crate::config::HsdpConfig,
    ) -> Result<Self, HsdpError> {
        // In f32 with host masters the runtime shard's piece is the master; otherwise the
        // master is kept apart, where the config places it.
        let separate_masters = plan.config().runtime_format != sshsdp_plan::RuntimeFormat::F32
            || config.masters != Placement::Host;
        Ok(Self {
            device: device.clone(),
            masters: config.masters,
            separate_masters,
            piece_in_shard: plan.piece_of(rank)? % plan.pieces_per_shard(),
            first_piece: plan.runtime_shard_of(rank)? * plan.pieces_per_shard(),
            traffic: Arc::default(),
            buckets: Vec::new(),
        })
    }

    /// Adds the next bucket (`codec`'s, holding parameters `params`) from this rank's runtime
    /// shard of it as fp32 elements.
    pub fn push(
        &mut self,
        params: Range<usize>,
        codec: BucketCodec,
        shard: Vec<f32>,
    ) -> Result<(), HsdpError> {
        let pe = codec.piece_elems();
        let master = self.separate_masters.then(|| {
            let slot = self.piece_in_shard * pe..(self.piece_in_shard + 1) * pe;
            F32Buf::new(
                self.masters,
                shard[slot].to_vec(),
                &self.device,
                &self.traffic,
            )
        });
        let shard = ShardBuf::Host(Arc::new(codec.encode(self.first_piece, shard)?));
        self.buckets.push(Bucket {
            index: self.buckets.len(),
            params,
            codec,
            shard,
            master,
            residency: Residency::Sharded,
            grads: BucketGrads::default(),
        });
        Ok(())
    }

    /// The buckets, and the traffic their registration made.
    pub fn finish(self) -> (Vec<Bucket<B>>, Arc<Traffic>) {
        (self.buckets, self.traffic)
    }
}

impl<B: Backend> Bucket<B> {
    /// The bucket's index in the plan.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Parameter `param`'s (plan index) position among the bucket's members.
    pub fn member(&self, param: usize) -> usize {
        param - self.params.start
    }

    /// The plan's layout of the bucket.
    pub fn codec(&self) -> &BucketCodec {
        &self.codec
    }

    /// Moves the runtime shard into device memory (at `shard`, where the placement says so).
    pub fn shard_to_device(&mut self, ctx: &BucketContext<B>) -> Result<(), HsdpError> {
        if let Some(units) = self.shard.take_host_units() {
            self.shard = ShardBuf::Device(upload_shard::<B>(&ctx.device, &units, &ctx.traffic)?);
        }
        Ok(())
    }

    /// The runtime shard.
    pub fn shard(&self) -> &ShardBuf {
        &self.shard
    }

    /// The separate fp32 master, if any (see the field).
    pub fn master(&self) -> Option<&F32Buf<B>> {
        self.master.as_ref()
    }

    /// The piece's fp32 master for an update step, taken out of the bucket, moved to `placement`
    /// (staged where it lives elsewhere): the separate master, or (f32 with host masters) the
    /// piece's elements of the runtime shard, which is taken out with it.
    pub fn take_master(
        &mut self,
        placement: Placement,
        ctx: &BucketContext<B>,
    ) -> Result<TakenMaster<B>, HsdpError> {
        if let Some(master) = self.master.take() {
            return Ok(TakenMaster::Apart(master.to(
                placement,
                &ctx.device,
                &ctx.traffic,
            )?));
        }
        let pe = self.codec.piece_elems();
        let slot = ctx.piece_in_shard * pe..(ctx.piece_in_shard + 1) * pe;
        match self.shard.take_host_units() {
            Some(Elems::F32(elements)) => Ok(TakenMaster::InShard { elements, slot }),
            other => {
                if let Some(units) = other {
                    self.shard = ShardBuf::Host(Arc::new(units));
                }
                Err(HsdpError::Failed(format!(
                    "bucket {}: no fp32 master elements (neither a separate master nor an f32 \
                     host shard)",
                    self.index
                )))
            }
        }
    }

    /// Puts a master taken by [`Self::take_master`] back (moved home: where the masters'
    /// placement keeps them).
    pub fn restore_master(
        &mut self,
        master: TakenMaster<B>,
        ctx: &BucketContext<B>,
    ) -> Result<(), HsdpError> {
        match master {
            TakenMaster::Apart(master) => {
                self.master = Some(master.to(ctx.masters, &ctx.device, &ctx.traffic)?)
            }
            TakenMaster::InShard { elements, .. } => {
                self.shard = ShardBuf::Host(Arc::new(Elems::F32(elements)))
            }
        }
        Ok(())
    }
}
