//! The storage and residency stage: each bucket's persistent storage (this rank's runtime shard
//! and, unless the runtime format is f32, the fp32 master of its piece) and where the bucket
//! stands in a step, as FSDP2 names it: `Sharded` (only the shard), `Gathering` (an all-gather
//! queued ahead of use), `Unsharded` (parameters materialised for one pass, as views into the
//! decoded bucket). The transitions are [`BucketStorage::start_gather`] (→ `Gathering`),
//! [`Materialiser::install`] after the gather completes (→ `Unsharded`) and
//! [`BucketStorage::release`] (→ `Sharded`).

use std::sync::Arc;

use burn_backend::Backend;

use super::Counters;
use crate::config::{CopyMode, Precision};
use crate::lanes::{Reply, ShardPart, StageUnits, Worker};
use crate::storage::{
    bucket_views, device_gather, device_part, device_views, BucketCodec, ComputeBuf, MasterBuf,
    Member, SendUnits, ShardBuf,
};
use crate::units::{Elems, Gathered};
use crate::HsdpError;

/// A gathered bucket: each parameter's tensor — a view into the decoded buffer (zero-copy
/// mode) or a copy of its part of it (FSDP2-style). The views keep the buffer alive.
pub(super) struct Resident<B: Backend> {
    /// The parameters, in bucket order.
    pub params: Vec<B::FloatTensorPrimitive>,
    /// Bytes of the compute buffer.
    pub bytes: u64,
}

/// Where a bucket stands in a step.
pub(super) enum Residency<B: Backend> {
    /// Only this rank's runtime shard is held.
    Sharded,
    /// An all-gather of every shard is queued on the communication lanes (its result, on its
    /// way).
    Gathering(Reply<Gathered>),
    /// The parameters are materialised.
    Unsharded(Resident<B>),
}

/// One bucket's storage on this rank.
pub(super) struct BucketStorage<B: Backend> {
    /// This rank's runtime shard (`1/S` of the bucket, in the runtime format), persistent.
    pub shard: ShardBuf,
    /// The fp32 master of this rank's piece, apart from the shard unless the runtime format is
    /// f32 with host masters (then the piece's runtime elements are the master).
    pub master: Option<MasterBuf<B>>,
    /// Where the bucket stands.
    pub residency: Residency<B>,
}

impl<B: Backend> BucketStorage<B> {
    /// A sharded bucket.
    pub fn new(shard: Elems, master: Option<MasterBuf<B>>) -> Self {
        Self {
            shard: ShardBuf::Host(Arc::new(shard)),
            master,
            residency: Residency::Sharded,
        }
    }

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
        self.take_resident().map_or(0, |r| r.bytes)
    }

    /// Takes the materialised parameters out (→ `Sharded`).
    pub fn take_resident(&mut self) -> Option<Resident<B>> {
        match std::mem::replace(&mut self.residency, Residency::Sharded) {
            Residency::Unsharded(r) => Some(r),
            other => {
                self.residency = other;
                None
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

    /// Queues the all-gather of every rank's shard of bucket `bucket` (the result is
    /// returned, not stored: the caller waits for it or records it as a prefetch): into device
    /// memory of `on_device` where given (zero-copy only; the engine moves device memory, see
    /// `storage/cube/gather.rs`), else into host memory, uploaded on the lane by `stage` where given.
    #[allow(clippy::too_many_arguments)]
    pub fn start_gather(
        &self,
        bucket: usize,
        worker: &Worker,
        codec: &BucketCodec,
        copy_mode: CopyMode,
        on_device: Option<&B::Device>,
        stage: Option<Box<dyn StageUnits>>,
        counters: &mut Counters,
    ) -> Reply<Gathered> {
        // The whole shard (one or more pieces).
        let range = 0..self.shard.len();
        let units = codec.gathered_units();
        if let Some(device) = on_device {
            let send = match &self.shard {
                ShardBuf::Host(shard) => SendUnits::Host(shard, range),
                ShardBuf::Device(shard) => SendUnits::Device(shard, range),
            };
            return match device_gather::<B>(device, send, units) {
                Ok((job, uploaded)) => {
                    counters.uploaded_bytes += uploaded;
                    worker.gather_on_device(bucket, job)
                }
                Err(e) => Reply::failed(sshsdp_comm::CommError::Engine(e.to_string())),
            };
        }
        // Gather straight into a fresh buffer that then becomes the tensor's storage: the
        // collective writes every byte (our own shard included), nothing is copied around it.
        let source = match (&self.shard, copy_mode) {
            (ShardBuf::Host(shard), CopyMode::ZeroCopy) => ShardPart::Host(shard.clone(), range),
            (ShardBuf::Host(shard), CopyMode::Fsdp2Style) => {
                // Copy-in: the local shard is staged into the all-gather input.
                counters.param_bytes_copied += shard.bytes();
                ShardPart::Host(Arc::new((**shard).clone()), range)
            }
            // This rank's part, read back on the lane (zero-copy only: `HsdpConfig::validate`).
            (ShardBuf::Device(shard), _) => match device_part(shard, range) {
                Ok(source) => source,
                Err(e) => return Reply::failed(e),
            },
        };
        worker.gather(bucket, source, units, stage)
    }
}

/// Turns gathered runtime units into parameters of `B`.
pub(super) struct Materialiser<B: Backend> {
    /// The device parameters live on.
    pub device: B::Device,
    /// Views into the bucket, or copies (the FSDP2-style baseline).
    pub copy_mode: CopyMode,
    /// The dtype parameters compute in.
    pub compute: Precision,
}

impl<B: Backend> Materialiser<B> {
    /// What uploads a host gather's units on the lane, where parameters are views of a CubeCL
    /// buffer (`None` elsewhere: host backends, and the FSDP2-style baseline, which copies
    /// each parameter out on the host).
    pub fn stager(&self) -> Option<Box<dyn StageUnits>> {
        if self.copy_mode == CopyMode::ZeroCopy {
            return crate::storage::stager::<B>(&self.device, self.compute);
        }
        None
    }

    /// The gathered units `full` (every piece) decoded and handed out as one tensor per
    /// member.
    pub fn install(
        &self,
        codec: &BucketCodec,
        full: Gathered,
        counters: &mut Counters,
    ) -> Result<Resident<B>, HsdpError> {
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
                let params =
                    device_views::<B>(codec, &units, &members, &self.device, self.compute)?;
                let compute_bytes = self.compute.bytes() * codec.compute_elems() as u64;
                let is_compute = match &units.kind {
                    // (Narrowed f32 units were rounded on the host: a decode too.)
                    Elems::F32(_) => self.compute == Precision::F32,
                    Elems::Bf16(_) => self.compute == Precision::Bf16,
                    Elems::U8(_) => false,
                };
                if !is_compute {
                    counters.decoded_bytes += compute_bytes;
                }
                counters.uploaded_bytes += units.uploaded;
                counters.downloaded_bytes += units.downloaded;
                return Ok(Resident {
                    params,
                    bytes: compute_bytes,
                });
            }
        };
        // A bf16 bucket computed in bf16 is its own compute buffer (the linear layout's units
        // are its elements): nothing to decode.
        let is_compute = matches!(full, Elems::Bf16(_)) && self.compute == Precision::Bf16;
        let compute = match full {
            Elems::Bf16(units) if is_compute => ComputeBuf::Bf16(units),
            full => {
                let decodes = !matches!(full, Elems::F32(_)) || self.compute != Precision::F32;
                let compute = ComputeBuf::new(codec.to_compute(full)?, self.compute);
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
        let params = match self.copy_mode {
            CopyMode::ZeroCopy => {
                // The compute buffer becomes the bucket's storage (a move, not a copy); each
                // parameter is a view into it.
                let (views, uploaded) = bucket_views::<B>(compute, &members, &self.device);
                counters.uploaded_bytes += uploaded;
                views
            }
            CopyMode::Fsdp2Style => members
                .iter()
                // Copy-out: each parameter gets a tensor of its own.
                .map(|m| {
                    let data = compute.member_data(m);
                    counters.param_bytes_copied += data.bytes.len() as u64;
                    counters.uploaded_bytes += data.bytes.len() as u64;
                    B::float_from_data(data, &self.device)
                })
                .collect(),
        };
        Ok(Resident { params, bytes })
    }
}
