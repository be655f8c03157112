//! Re-deriving runtime units after an update: the piece's bytes encoded from its updated fp32
//! master (bf16 cast or square-block MXFP8, on the host or by the device kernels) into this
//! rank's slot of the runtime shard, and the shard rebuilt across the replicas.

use std::sync::Arc;

use burn_backend::Backend;

use super::{Bucket, BucketContext, TakenMaster};
use crate::lanes::Reply;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::storage::{
    device_gather, download, encode_on_device, encode_units_on_device, read_device_units,
    upload_shard, F32Buf, SendUnits, ShardBuf,
};
use crate::timeline::Track;
use crate::traffic::Purpose;
use crate::HsdpError;

/// A runtime shard's rebuild after its piece was re-derived.
pub(crate) enum Rebuild {
    /// A host shard, rebuilt by the host collectives.
    Host(Reply<Elems>),
    /// A device shard rebuilt by the host collectives (the engine moves host memory), uploaded
    /// once rebuilt.
    Staged(Reply<Elems>),
    /// A device shard rebuilt by the engine on device memory.
    Device(Reply<DeviceUnits>),
    /// A device shard that is one piece: the re-derived piece is the shard.
    Done(DeviceUnits),
}

impl<B: Backend> Bucket<B> {
    /// Re-derives the runtime units of this rank's piece from its updated `master` (as the
    /// update step left it), puts the master back home and queues the shard's rebuild.
    pub fn rederive(
        &mut self,
        ctx: &BucketContext<B>,
        master: TakenMaster<B>,
    ) -> Result<Rebuild, HsdpError> {
        if self.shard.on_device() {
            self.restore_master(master, ctx)?;
            return self.rederive_on_device(ctx);
        }
        let (codec, slot, piece) = (&self.codec, ctx.piece_in_shard, ctx.piece);
        let mut shard = match std::mem::replace(
            &mut self.shard,
            ShardBuf::Host(Arc::new(Elems::F32(Vec::new()))),
        ) {
            ShardBuf::Host(shard) => Arc::try_unwrap(shard).unwrap_or_else(|s| (*s).clone()),
            ShardBuf::Device(_) => unreachable!("checked above"),
        };
        match &master {
            TakenMaster::Apart(F32Buf::Host(values)) => {
                codec.rederive(&mut shard, slot, piece, values)?
            }
            TakenMaster::Apart(F32Buf::Device(t)) => {
                match encode_on_device::<B>(codec, piece, t, &ctx.traffic) {
                    Some(bytes) => codec.store_piece(&mut shard, slot, &bytes?)?,
                    None => {
                        let values = download::<B>(t.clone(), &ctx.traffic, Purpose::Stage)?;
                        codec.rederive(&mut shard, slot, piece, &values)?
                    }
                }
            }
            // f32 with host masters: the step updated the runtime elements themselves.
            TakenMaster::InShard { .. } => {}
        }
        let shard = match master {
            TakenMaster::InShard { elements, .. } => Elems::F32(elements),
            master => {
                self.restore_master(master, ctx)?;
                shard
            }
        };
        Ok(Rebuild::Host(ctx.worker.rebuild(self.index, shard)))
    }

    /// [`Self::rederive`] for a device shard: the piece is encoded on the device from its device
    /// master and becomes the shard where the shard is one piece; otherwise the replica group's
    /// pieces are gathered into the shard, by the engine on device memory where it can, else
    /// through the host.
    fn rederive_on_device(&mut self, ctx: &BucketContext<B>) -> Result<Rebuild, HsdpError> {
        let Some(F32Buf::Device(master)) = &self.master else {
            return Err(HsdpError::Failed(format!(
                "bucket {}: a device shard without a device master",
                self.index
            )));
        };
        let units = encode_units_on_device::<B>(&self.codec, ctx.piece, master)?;
        if ctx.pieces_per_shard == 1 {
            return Ok(Rebuild::Done(units));
        }
        let shard_len = self.shard.len();
        if ctx.engine_on_device {
            let send = SendUnits::Device(&units, 0..units.len);
            let job = device_gather::<B>(&ctx.device, send, shard_len, &ctx.traffic)?;
            return Ok(Rebuild::Device(
                ctx.worker.rebuild_on_device(self.index, job),
            ));
        }
        // Through the host: this rank's piece in its slot of a host shard, rebuilt by the host
        // collectives, uploaded once rebuilt (`finish_rebuild`).
        let piece_units = read_device_units(&units, &ctx.traffic)?;
        let mut shard = piece_units.zeros_like(shard_len);
        shard.write_at(ctx.piece_in_shard * piece_units.len(), &piece_units)?;
        Ok(Rebuild::Staged(ctx.worker.rebuild(self.index, shard)))
    }

    /// Waits for `rebuild` and makes its result the runtime shard.
    pub fn finish_rebuild(
        &mut self,
        ctx: &BucketContext<B>,
        rebuild: Rebuild,
    ) -> Result<(), HsdpError> {
        let wait = |reply| {
            let name = "wait rebuild";
            ctx.timeline
                .span(Track::Model, name, Some(self.index), || Reply::wait(reply))
        };
        self.shard = match rebuild {
            Rebuild::Host(reply) => ShardBuf::Host(Arc::new(wait(reply)?)),
            Rebuild::Staged(reply) => {
                let shard = wait(reply)?;
                ShardBuf::Device(upload_shard::<B>(&ctx.device, &shard, &ctx.traffic)?)
            }
            Rebuild::Device(reply) => {
                let units =
                    ctx.timeline
                        .span(Track::Model, "wait rebuild", Some(self.index), || {
                            reply.wait()
                        })?;
                ShardBuf::Device(units)
            }
            Rebuild::Done(units) => ShardBuf::Device(units),
        };
        Ok(())
    }
}
