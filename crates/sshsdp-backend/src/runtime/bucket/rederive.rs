//! Re-deriving runtime units after an update: the piece's bytes encoded from its updated fp32
//! master (bf16 cast or square-block MXFP8, on the host or by the device kernels) into this
//! rank's slot of the runtime shard, and the shard rebuilt across the replicas. Where the bytes
//! move is the seam's (`F32Buf::encode_piece_into`, `ShardRebuild`); which rebuild is a
//! stage decision made here.

use burn_backend::Backend;

use super::{Bucket, BucketContext};
use crate::error::HsdpError;
use crate::runtime_units::Elems;
use crate::storage::{
    device_gather, encode_units_on_device, read_device_units, SendUnits, ShardRebuild, TakenMaster,
};

impl<B: Backend> Bucket<B> {
    /// Re-derives the runtime units of this rank's piece from its updated `master` (as the
    /// update step left it), puts the master back home and queues the shard's rebuild.
    pub fn rederive(
        &mut self,
        ctx: &BucketContext<B>,
        master: TakenMaster<B>,
    ) -> Result<ShardRebuild, HsdpError> {
        let Some(mut units) = self.shard.take_host_units() else {
            self.restore_master(master, ctx)?;
            return self.rederive_on_device(ctx);
        };
        let units = match master {
            // f32 with host masters: the step updated the runtime elements themselves.
            TakenMaster::InShard { elements, .. } => Elems::F32(elements),
            TakenMaster::Apart(master) => {
                let at = (ctx.piece_in_shard, ctx.piece);
                let encoded = master.encode_piece_into(&self.codec, &mut units, at, &ctx.traffic);
                self.restore_master(TakenMaster::Apart(master), ctx)?;
                encoded?;
                units
            }
        };
        Ok(ShardRebuild::Host(ctx.worker.rebuild(self.index, units)))
    }

    /// [`Self::rederive`] for a device shard: the piece is encoded on the device from its device
    /// master and becomes the shard where the shard is one piece; otherwise the replica group's
    /// pieces are gathered into the shard, by the engine on device memory where it can, else
    /// through the host.
    fn rederive_on_device(&mut self, ctx: &BucketContext<B>) -> Result<ShardRebuild, HsdpError> {
        let Some(master) = self.master.as_ref().and_then(|m| m.device_tensor()) else {
            return Err(HsdpError::Failed(format!(
                "bucket {}: a device shard without a device master",
                self.index
            )));
        };
        let units = encode_units_on_device::<B>(&self.codec, ctx.piece, master)?;
        if ctx.pieces_per_shard == 1 {
            return Ok(ShardRebuild::Done(units));
        }
        let shard_len = self.shard.len();
        if ctx.engine_on_device {
            let send = SendUnits::Device(&units, 0..units.len);
            let job = device_gather::<B>(&ctx.device, send, shard_len, &ctx.traffic)?;
            let reply = ctx.worker.rebuild_on_device(self.index, job);
            return Ok(ShardRebuild::Device(reply));
        }
        // Through the host: this rank's piece in its slot of a host shard, rebuilt by the host
        // collectives, uploaded once rebuilt (`ShardRebuild::finish`).
        let piece_units = read_device_units(&units, &ctx.traffic)?;
        let mut shard = piece_units.zeros_like(shard_len);
        shard.write_at(ctx.piece_in_shard * piece_units.len(), &piece_units)?;
        Ok(ShardRebuild::Staged(ctx.worker.rebuild(self.index, shard)))
    }

    /// Waits for `rebuild` and makes its result the runtime shard.
    pub fn finish_rebuild(
        &mut self,
        ctx: &BucketContext<B>,
        rebuild: ShardRebuild,
    ) -> Result<(), HsdpError> {
        self.shard = rebuild.finish::<B>(self.index, &ctx.device, &ctx.timeline, &ctx.traffic)?;
        Ok(())
    }
}
