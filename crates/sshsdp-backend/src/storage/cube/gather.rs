//! Bucket all-gathers straight into device memory on CubeCL backends, over an engine that moves
//! device memory (NCCL, or ranks of this process sharing the device: `exchange.rs`): the engine
//! writes the gathered runtime units into a CubeCL buffer, which the device codec then decodes
//! in place (`codec.rs`) — no host copy of the bucket, where the host path (gather on the host,
//! upload) moves it once per gather and NCCL's own host path three times. The same job serves
//! the rebuild of a runtime shard from the replica group's pieces (hierarchical sharding).
//!
//! # Ordering against CubeCL's streams (NCCL; the peers engine's is in `exchange.rs`)
//! cubecl-cuda gives each host thread its own stream and stamps every allocation with its
//! stream's position; a thread touching another stream's buffer waits for that stream only if
//! it has not synchronised with it past the buffer's stamp (see
//! [`stream_mark`](super::stream_mark)). NCCL runs on its own stream, outside that
//! scheme, so a lane readies the buffers first (`exchange.rs`'s `ready_addresses`): `get_resource` on each makes
//! the lane's CubeCL stream wait for the streams that own them where needed, and a host wait on
//! the lane's stream makes that wait complete before NCCL is called.
//!
//! What a gather waits for, and why that is enough:
//! * **The send buffer.** A device shard was written by the last update's encode on the model
//!   stream; its [`CubeUnits::written`] mark, made once that encode was queued, goes into the
//!   ready call, so the lane waits for the encode. A host shard's part is uploaded by the lane
//!   itself (its own stream: ordered).
//! * **The receive buffer** is allocated by the lane on its own stream, so it makes the lane
//!   wait for nothing.
//!
//! So the lane waits for the model stream at most once per update (the first gather after it;
//! the wait covers what the model stream had queued then), and the prefetched gather of bucket
//! k+1 no longer waits for bucket k's forward, which the model thread queued before the lane
//! took the job: gathers overlap compute. The model thread decodes the receive buffer after
//! the lane's reply (NCCL's wait returned); touching it, the model stream waits for the lane's
//! stream (the allocation), and CubeCL keeps a buffer used on two streams alive until both are
//! done with it. The lane holds the resources until NCCL's bounded wait has returned, so no
//! allocation is recycled under NCCL. cubecl-cuda and cudarc both use the device's primary
//! context, so CubeCL's addresses are valid for NCCL.

use burn_backend::Backend;
use burn_cubecl::CubeRuntime;
use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use sshsdp_comm::{CommResult, ElementKind};

use super::codec::CubeUnits;
use super::exchange::{CubeBuffers, Span};
use super::{
    client_of, for_each_runtime, is_cube, lane_client, lane_upload, padded_to_words,
    word_buffer_len,
};
use crate::error::HsdpError;
use crate::lanes::comm::DeviceBuffers;
use crate::lanes::DeviceGatherJob;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::storage::roles::SendUnits;
use crate::traffic::{Purpose, Traffic};
use std::sync::Arc;

/// The CUDA ordinal of `device` if `B` is `CubeBackend<CudaRuntime, …>` or fusion over it (`None`
/// otherwise).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_ordinal<B: Backend>(device: &B::Device) -> Option<usize> {
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    if !is_cube::<B, CudaRuntime>() {
        return None;
    }
    let any: &dyn std::any::Any = device;
    any.downcast_ref::<CudaDevice>().map(|d| d.index)
}

/// The buffers of an all-gather of `send` into `full_len` units on `device` (a device of a
/// CubeCL backend this build supports): the job for a lane (which allocates the receive buffer,
/// uploads a host part, and hands back the receive buffer) and the bytes it will upload (this
/// rank's part of a host shard, or none).
pub(crate) fn gather_buffers<B: Backend>(
    device: &B::Device,
    send: SendUnits<'_>,
    full_len: usize,
    traffic: &Arc<Traffic>,
) -> Result<Box<dyn DeviceGatherJob>, HsdpError> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            return gather_job::<B, R>(device, send, full_len, traffic);
        }
    });
    let _ = (device, send, full_len, traffic);
    Err(HsdpError::Unsupported(
        "all-gathers on device memory need a CubeCL backend (this crate's `wgpu` or `cuda` \
         feature)"
            .into(),
    ))
}

fn gather_job<B: Backend, R: CubeRuntime>(
    device: &B::Device,
    send: SendUnits<'_>,
    full_len: usize,
    traffic: &Arc<Traffic>,
) -> Result<Box<dyn DeviceGatherJob>, HsdpError> {
    // The lane queues through it (on wgpu, on the model thread's stream: `lane_client`).
    let client = lane_client(client_of::<B, R>(device));
    let (send, count, kind) = match send {
        SendUnits::Host(shard, part) => {
            let bytes = padded_to_words(shard.le_bytes(part.clone()));
            (Outgoing::Upload(bytes), part.len(), shard.zeros_like(0))
        }
        SendUnits::Device(units, part) => {
            let cube: &CubeUnits<R> = units.buffer.downcast_ref().ok_or_else(|| {
                HsdpError::Failed("a device buffer of another runtime than the backend's".into())
            })?;
            let unit = units.kind.unit_bytes();
            let send = Span {
                handle: cube.handle.clone(),
                byte: unit * part.start as u64,
            };
            let written = cube.written.clone();
            (
                Outgoing::Device { send, written },
                part.len(),
                units.kind.zeros_like(0),
            )
        }
    };
    let job = CubeGatherJob {
        client,
        send,
        buffers: None,
        recv: None,
        kind: kind.kind(),
        count,
        full_len,
        empty: kind,
        traffic: traffic.clone(),
    };
    Ok(Box::new(job))
}

/// What a gather sends.
enum Outgoing {
    /// This rank's part of a host shard (whole words), uploaded by the lane.
    Upload(Vec<u8>),
    /// A range of a device buffer, and the mark of its last write (see the module docs).
    Device { send: Span, written: Option<Handle> },
}

/// A gather's CubeCL buffers on the way to a lane.
struct CubeGatherJob<R: CubeRuntime> {
    client: ComputeClient<R>,
    send: Outgoing,
    /// The collective's buffers, made by the lane in `buffers`.
    buffers: Option<CubeBuffers<R>>,
    /// The receive buffer.
    recv: Option<Handle>,
    kind: ElementKind,
    count: usize,
    /// Units of the receive buffer.
    full_len: usize,
    /// An empty run of the units' type.
    empty: Elems,
    /// Charged with the upload of a host part.
    traffic: Arc<Traffic>,
}

impl<R: CubeRuntime> DeviceGatherJob for CubeGatherJob<R> {
    fn count(&self) -> usize {
        self.count
    }

    fn buffers(&mut self) -> CommResult<&mut dyn DeviceBuffers> {
        // On the lane's thread: both new buffers are the lane stream's own.
        let recv = self.client.empty(word_buffer_len(
            self.empty.unit_bytes() as usize * self.full_len,
        ));
        let (send, written) = match &self.send {
            Outgoing::Upload(bytes) => {
                self.traffic.upload(bytes.len() as u64, Purpose::Data);
                (Span::of(lane_upload(&self.client, bytes)), None)
            }
            Outgoing::Device { send, written } => (send.clone(), written.clone()),
        };
        self.recv = Some(recv.clone());
        let buffers = CubeBuffers::apart(self.client.clone(), self.kind, send, Span::of(recv))
            .after(written)
            .charging(&self.traffic);
        Ok(self.buffers.insert(buffers))
    }

    fn into_units(self: Box<Self>) -> DeviceUnits {
        let job = *self;
        drop(job.buffers);
        let recv = job
            .recv
            .expect("the lane made the buffers before the engine wrote into them");
        DeviceUnits {
            buffer: Box::new(CubeUnits::<R>::new(job.client, recv)),
            len: job.full_len,
            kind: job.empty,
            narrowed: None,
        }
    }
}
