//! The unshard stage: where a bucket stands in a step, as FSDP2 names it — `Sharded` (only the
//! shard), `Gathering` (an all-gather queued ahead of use), `Unsharded` (parameters materialised
//! for one pass, as views into the decoded bucket) — and its transitions,
//! [`Bucket::start_gather`] (→ `Gathering`), [`Bucket::install`] once the gather completed
//! (→ `Unsharded`) and [`Bucket::release`] (→ `Sharded`).

use burn_backend::Backend;

use super::{Bucket, BucketContext};
use crate::config::{CopyMode, Precision};
use crate::counters::Counters;
use crate::error::HsdpError;
use crate::lanes::Reply;
use crate::runtime_units::{Elems, Gathered};
use crate::storage::{
    bucket_views, device_gather, device_views, member_copies, stager, ComputeBuf, Member,
};

/// A gathered bucket: each parameter's tensor — a view into the decoded buffer (zero-copy
/// mode) or a copy of its part of it (FSDP2-style). The views keep the buffer alive.
pub(crate) struct Resident<B: Backend> {
    /// The parameters, in bucket order.
    pub params: Vec<B::FloatTensorPrimitive>,
    /// Bytes of the compute buffer.
    pub bytes: u64,
}

/// Where a bucket stands in a step.
pub(crate) enum Residency<B: Backend> {
    /// Only this rank's runtime shard is held.
    Sharded,
    /// An all-gather of every shard is queued on the communication lanes (its result, on its
    /// way).
    Gathering(Reply<Gathered>),
    /// The parameters are materialised.
    Unsharded(Resident<B>),
}

impl<B: Backend> Bucket<B> {
    /// The materialised parameters, if any.
    pub fn resident(&self) -> Option<&Resident<B>> {
        match &self.residency {
            Residency::Unsharded(r) => Some(r),
            _ => None,
        }
    }

    /// Whether only the shard is held (no gather queued, nothing materialised).
    pub fn is_sharded(&self) -> bool {
        matches!(self.residency, Residency::Sharded)
    }

    /// Drops the materialised parameters (their views go, and the buffer with them once no op
    /// holds one); returns the bytes freed. A queued gather stays queued.
    pub fn release(&mut self) -> u64 {
        match std::mem::replace(&mut self.residency, Residency::Sharded) {
            Residency::Unsharded(r) => r.bytes,
            other => {
                self.residency = other;
                0
            }
        }
    }

    /// Takes a queued gather out (→ `Sharded`).
    pub fn take_gather(&mut self) -> Option<Reply<Gathered>> {
        match std::mem::replace(&mut self.residency, Residency::Sharded) {
            Residency::Gathering(reply) => Some(reply),
            other => {
                self.residency = other;
                None
            }
        }
    }

    /// Records `reply` as this bucket's prefetch (→ `Gathering`).
    pub fn set_gathering(&mut self, reply: Reply<Gathered>) {
        self.residency = Residency::Gathering(reply);
    }

    /// Zeros in the shape of a gathered bucket (what a rank installs after a failure, so that
    /// it stays in step with its peers).
    pub fn zeros_gathered(&self) -> Gathered {
        Gathered::Host(self.shard.zeros_like(self.codec.gathered_units()))
    }

    /// Queues the all-gather of every rank's shard of this bucket (the result is returned, not
    /// stored: the caller waits for it or records it as a prefetch): into device memory where
    /// the engine moves device memory (zero-copy only: `storage/cube/gather.rs`), else into host
    /// memory, uploaded on the lane where parameters are views of a device buffer.
    pub fn start_gather(&self, ctx: &BucketContext<B>, counters: &mut Counters) -> Reply<Gathered> {
        // The whole shard (one or more pieces).
        let range = 0..self.shard.len();
        let units = self.codec.gathered_units();
        let zero_copy = ctx.copy_mode == CopyMode::ZeroCopy;
        if ctx.engine_on_device && zero_copy {
            // A shard group of one rank (world 1, DDP, one shard per replica group): the shard
            // is the whole bucket, and its buffer the gathered bucket.
            if ctx.runtime_shards == 1 && range.len() == units {
                if let Some(gathered) = self.shard.alone_gathered() {
                    return Reply::ready(Gathered::Device(gathered));
                }
            }
            let send = self.shard.send_units(range);
            return match device_gather::<B>(&ctx.device, send, units, &ctx.traffic) {
                Ok(job) => ctx.worker.gather_on_device(self.index, job),
                Err(e) => Reply::failed(sshsdp_comm::CommError::Engine(e.to_string())),
            };
        }
        // Gather straight into a fresh buffer that then becomes the tensor's storage: the
        // collective writes every byte (our own shard included), nothing is copied around it
        // (the FSDP2-style baseline copies its shard in; a device shard's part is read back on
        // the lane: zero-copy only, `HsdpConfig::validate`).
        let (source, copied) = match self.shard.gather_part(range, !zero_copy, &ctx.traffic) {
            Ok(part) => part,
            Err(e) => return Reply::failed(e),
        };
        counters.param_bytes_copied += copied;
        // Where parameters are views of a CubeCL buffer, the lane uploads the gathered units.
        let stage = zero_copy
            .then(|| stager::<B>(&ctx.device, ctx.compute, &ctx.traffic))
            .flatten();
        ctx.worker.gather(self.index, source, units, stage)
    }

    /// Materialises the gathered units `full` (every piece) as the bucket's parameters
    /// (→ `Unsharded`), decoded and handed out as one tensor per member; returns the bytes of
    /// the compute buffer.
    pub fn install(
        &mut self,
        ctx: &BucketContext<B>,
        full: Gathered,
        counters: &mut Counters,
    ) -> Result<u64, HsdpError> {
        let resident = self.materialise(ctx, full, counters)?;
        let bytes = resident.bytes;
        self.release();
        self.residency = Residency::Unsharded(resident);
        Ok(bytes)
    }

    fn materialise(
        &self,
        ctx: &BucketContext<B>,
        full: Gathered,
        counters: &mut Counters,
    ) -> Result<Resident<B>, HsdpError> {
        let codec = &self.codec;
        let members: Vec<Member> = (0..codec.len())
            .map(|k| Member {
                start: codec.compute_start(k),
                shape: codec.shape(k).to_vec(),
            })
            .collect();
        let full = match full {
            Gathered::Host(full) => full,
            Gathered::Device(units) => {
                // Gathered by the engine into device memory: decoded there (or used as it is).
                let params = device_views::<B>(codec, &units, &members, &ctx.device, ctx.compute)?;
                let compute_bytes = ctx.compute.bytes() * codec.compute_elems() as u64;
                let is_compute = match &units.kind {
                    // (Narrowed f32 units were rounded on the host: a decode too.)
                    Elems::F32(_) => ctx.compute == Precision::F32,
                    Elems::Bf16(_) => ctx.compute == Precision::Bf16,
                    Elems::U8(_) => false,
                };
                if !is_compute {
                    counters.decoded_bytes += compute_bytes;
                }
                return Ok(Resident {
                    params,
                    bytes: compute_bytes,
                });
            }
        };
        // A bf16 bucket computed in bf16 is its own compute buffer (the linear layout's units
        // are its elements): nothing to decode.
        let is_compute = matches!(full, Elems::Bf16(_)) && ctx.compute == Precision::Bf16;
        let compute = match full {
            Elems::Bf16(units) if is_compute => ComputeBuf::Bf16(units),
            full => {
                let decodes = !matches!(full, Elems::F32(_)) || ctx.compute != Precision::F32;
                let compute = ComputeBuf::new(codec.to_compute(full)?, ctx.compute);
                if decodes {
                    counters.decoded_bytes += compute.bytes();
                }
                compute
            }
        };
        if compute.len() != codec.compute_elems() {
            return Err(HsdpError::Failed(format!(
                "a gathered bucket of {} values where the layout has {}",
                compute.len(),
                codec.compute_elems()
            )));
        }
        let bytes = compute.bytes();
        let params = match ctx.copy_mode {
            // The compute buffer becomes the bucket's storage (a move, not a copy); each
            // parameter is a view into it.
            CopyMode::ZeroCopy => bucket_views::<B>(compute, &members, &ctx.device, &ctx.traffic),
            // Copy-out: each parameter gets a tensor of its own.
            CopyMode::Fsdp2Style => {
                let (params, copied) =
                    member_copies::<B>(&compute, &members, &ctx.device, &ctx.traffic);
                counters.param_bytes_copied += copied;
                params
            }
        };
        Ok(Resident { params, bytes })
    }
}
