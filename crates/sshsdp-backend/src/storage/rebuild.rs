//! A runtime shard's rebuild after an update re-derived this rank's piece: the replica group's
//! pieces gathered into the shard, wherever the shard lives.

use std::sync::Arc;

use burn_backend::Backend;

use super::roles::ShardBuf;
use super::upload_shard;
use crate::error::HsdpError;
use crate::lanes::Reply;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::timeline::{Timeline, Track};
use crate::traffic::Traffic;

/// A runtime shard's rebuild on its way.
pub(crate) enum ShardRebuild {
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

impl ShardRebuild {
    /// Waits for the rebuild (timed as the model thread's wait on bucket `bucket`) and returns
    /// the shard (a staged one uploaded to `device`, charged to `traffic`).
    pub fn finish<B: Backend>(
        self,
        bucket: usize,
        device: &B::Device,
        timeline: &Timeline,
        traffic: &Traffic,
    ) -> Result<ShardBuf, HsdpError> {
        let name = "wait rebuild";
        let wait_host =
            |reply: Reply<Elems>| timeline.span(Track::Model, name, Some(bucket), || reply.wait());
        Ok(match self {
            ShardRebuild::Host(reply) => ShardBuf::Host(Arc::new(wait_host(reply)?)),
            ShardRebuild::Staged(reply) => {
                let shard = wait_host(reply)?;
                ShardBuf::Device(upload_shard::<B>(device, &shard, traffic)?)
            }
            ShardRebuild::Device(reply) => {
                ShardBuf::Device(timeline.span(Track::Model, name, Some(bucket), || reply.wait())?)
            }
            ShardRebuild::Done(units) => ShardBuf::Device(units),
        })
    }
}
