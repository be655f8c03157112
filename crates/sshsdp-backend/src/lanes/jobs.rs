//! What the lanes carry besides host runtime units: the device jobs that storage hands over
//! (made in `storage/cube/`, run on a lane's thread against its communicators) and the reply
//! to any request.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

use sshsdp_comm::{CommError, CommResult};
use sshsdp_plan::Sharding;

use super::comm::{DeviceBuffers, MeshComm};
use crate::runtime_units::{DeviceUnits, Elems};

/// What a rank sends in a bucket all-gather on host memory.
pub(crate) enum ShardPart {
    /// Units `range` of a host shard.
    Host(Arc<Elems>, Range<usize>),
    /// Units of a device shard, read back to the host on the shard lane first.
    // Made only on CubeCL backends (`storage/cube/shard.rs`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    Device(Box<dyn ReadUnits>),
}

/// Reads runtime units of a device buffer back to the host, on a lane (so the read overlaps the
/// model thread's compute, as the gather does).
pub(crate) trait ReadUnits: Send {
    /// The units, in host memory.
    fn read(self: Box<Self>) -> CommResult<Elems>;
}

/// The buffers of an all-gather on device memory (`storage/cube/gather.rs`), made by the model
/// thread and handed to a lane, which keeps them alive until the engine is done.
pub(crate) trait DeviceGatherJob: Send {
    /// Units each rank sends.
    fn count(&self) -> usize;
    /// Called on the lane's thread: the collective's buffers (the receive buffer allocated and
    /// a host part uploaded now, on the lane's stream).
    fn buffers(&mut self) -> CommResult<&mut dyn DeviceBuffers>;
    /// The receive buffer, once the engine is done with it.
    fn into_units(self: Box<Self>) -> DeviceUnits;
}

/// A gradient reduction of a full-bucket gradient held in device memory of the decorated
/// backend (`storage/cube/reduce.rs`): its two stages run on the two lanes in turn, as host reductions
/// do, either by the engine on device memory (NCCL) or staged through the host.
pub(crate) trait DeviceReduceJob: Send {
    /// Shard lane: the shard-group stage.
    fn within_shard_group(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()>;
    /// Replica lane: the replica stage.
    fn across_replicas(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()>;
    /// The world-averaged gradient piece, in device memory.
    fn into_piece(self: Box<Self>) -> DeviceUnits;
}

/// Uploads gathered host units into a device buffer of the decorated backend, on the shard
/// lane (the staged path of engines without device collectives: the upload overlaps the model
/// thread's compute, as the gather does).
pub(crate) trait StageUnits: Send {
    /// `units` in a new device buffer.
    fn stage(self: Box<Self>, units: Elems) -> DeviceUnits;
}

/// A reply on its way: runtime elements (gathers, rebuilds) or a gradient piece (reductions).
pub(crate) struct Reply<T = Vec<f32>>(pub(super) Receiver<CommResult<T>>);

impl<T> Reply<T> {
    /// A reply that is already the failure `e` (a collective that could not be queued: the
    /// caller records the failure, which aborts the peers' side of it).
    pub fn failed(e: CommError) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(Err(e));
        Reply(rx)
    }

    /// A reply that is already `value` (a collective with nothing to do: this rank alone).
    pub fn ready(value: T) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(Ok(value));
        Reply(rx)
    }

    /// Blocks until the collective is done.
    pub fn wait(self) -> CommResult<T> {
        self.0.recv().unwrap_or_else(|_| {
            Err(CommError::PeerFailed(
                "the communication thread stopped".into(),
            ))
        })
    }
}

/// What a rank sends in an update-group collective (an optimizer's exchange, e.g. Muon's split
/// matrices: the all-reduce and the all-to-all-v): one job type with a host form and a device
/// form, so the lanes carry one request per collective wherever its buffer lives.
pub(crate) enum UpdateBuffer {
    /// f32 elements in host memory, moved by the host collectives.
    Host(Vec<f32>),
    /// An f32 buffer in device memory, moved by the engine (NCCL, or ranks of this process
    /// sharing the device): `storage/cube/update_job.rs` (summed in place, or sent from it into
    /// a receive buffer allocated with the job).
    // Made only on CubeCL backends.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    Device(Box<dyn DeviceGatherJob>),
}

/// What an update-group collective gives back, where its buffer was: the sum, or what arrived.
pub(crate) enum UpdateReceived {
    /// The host elements.
    Host(Vec<f32>),
    /// The device buffer.
    // Made only on CubeCL backends.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    Device(DeviceUnits),
}
