//! Bucket all-gathers straight into device memory on `CubeBackend<CudaRuntime, …>` over an
//! engine that moves device memory itself (NCCL): the engine writes the gathered runtime units
//! into a CubeCL buffer, which the device codec then decodes in place (`cube_codec.rs`) — no
//! host copy of the bucket, where the host path (gather on the host, upload) moves it once per
//! gather and NCCL's own host path three times.
//!
//! # Ordering against CubeCL's streams
//! cubecl-cuda gives each host thread its own stream and tracks, for every buffer, the stream
//! and position of its last use. The model thread makes the send buffer (an upload of this
//! rank's part) and a fresh receive buffer on its stream and hands both to the shard lane. The
//! lane asks CubeCL for their device resources, which makes the lane's own CubeCL stream wait
//! for the model stream's work up to those buffers (including kernels still reading memory the
//! allocator recycled into them), and waits for that stream; only then does NCCL, on its own
//! stream, read and write them. The lane holds the resources until NCCL's bounded wait has
//! returned, so the allocation cannot be recycled under NCCL; the model thread decodes the
//! receive buffer only after the lane's reply. cubecl-cuda and cudarc both use the device's
//! primary context, so CubeCL's addresses are valid for NCCL.

use std::any::Any;
use std::ops::Range;

use burn_backend::Backend;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cubecl::Runtime;
use sshsdp_comm::{CommError, CommResult, ElementKind};

use crate::cube_codec::CubeUnits;
use crate::cube_views::is_cube;
use crate::storage::{padded_to_words, word_buffer_len, DeviceUnits, Elems};
use crate::worker::DeviceGatherJob;
use crate::HsdpError;

/// The CUDA ordinal of `device` if `B` is `CubeBackend<CudaRuntime, …>` (`None` otherwise).
pub(crate) fn cuda_ordinal<B: Backend>(device: &B::Device) -> Option<usize> {
    if !is_cube::<B, CudaRuntime>() {
        return None;
    }
    let any: &dyn Any = device;
    any.downcast_ref::<CudaDevice>().map(|d| d.index)
}

/// What this rank sends in an all-gather on device memory.
pub(crate) enum SendUnits<'a> {
    /// Units `range` of a host shard: uploaded first.
    Host(&'a Elems, Range<usize>),
    /// Units `range` of a CubeCL buffer (a device shard, or an updated piece for a rebuild):
    /// sent from where they are.
    Device(&'a DeviceUnits, Range<usize>),
}

/// The buffers of an all-gather of `send` into `full_len` units on `device` (a CUDA device of
/// a `CubeBackend`): the job for a lane (which hands back the receive buffer) and the bytes
/// uploaded (this rank's part of a host shard, or none).
pub(crate) fn gather_buffers<B: Backend>(
    device: &B::Device,
    send: SendUnits<'_>,
    full_len: usize,
) -> Result<(Box<dyn DeviceGatherJob>, u64), HsdpError> {
    let any: &dyn Any = device;
    let device: &CudaDevice = any.downcast_ref().expect("checked by cuda_ordinal");
    let client = CudaRuntime::client(device);
    let (send, count, kind, uploaded) = match send {
        SendUnits::Host(shard, part) => {
            let bytes = shard.le_bytes(part.clone());
            let uploaded = bytes.len() as u64;
            let send = client.create_from_slice(&padded_to_words(bytes));
            (send, part.len(), shard.zeros_like(0), uploaded)
        }
        SendUnits::Device(units, part) => {
            let cube: &CubeUnits<CudaRuntime> = units.buffer.downcast_ref().ok_or_else(|| {
                HsdpError::Failed("a device buffer of another runtime than CUDA".into())
            })?;
            let unit = units.kind.unit_bytes();
            let (start, end) = (unit * part.start as u64, unit * part.end as u64);
            // Relative to the handle's own offsets, if any.
            let size = cube.handle.size_in_used();
            let send = cube
                .handle
                .clone()
                .offset_start(start)
                .offset_end(size - end);
            (send, part.len(), units.kind.zeros_like(0), 0)
        }
    };
    let recv = client.empty(word_buffer_len(kind.unit_bytes() as usize * full_len));
    let job = CudaGatherJob {
        client,
        send,
        recv,
        kind: kind.kind(),
        count,
        full_len,
        empty: kind,
        resources: Vec::new(),
    };
    Ok((Box::new(job), uploaded))
}

/// Called on a lane's thread: the device addresses of `handles`, once the device work queued
/// before them on any CubeCL stream is done (see the module docs); their resources go into
/// `keep`, which pins the allocations until it is dropped.
pub(crate) fn ready_addresses(
    client: &ComputeClient<CudaRuntime>,
    handles: &[Handle],
    keep: &mut Vec<Box<dyn Send>>,
) -> CommResult<Vec<u64>> {
    let err = |e| CommError::Engine(format!("readying a CubeCL buffer for NCCL: {e:?}"));
    let mut addresses = Vec::with_capacity(handles.len());
    for handle in handles {
        // This thread's stream now waits for the streams that used the buffer last.
        let resource = client.get_resource(handle.clone()).map_err(err)?;
        addresses.push(resource.resource().ptr);
        keep.push(Box::new(resource));
    }
    // And this waits for that stream.
    cubecl::future::block_on(client.sync()).map_err(err)?;
    Ok(addresses)
}

/// A gather's CubeCL buffers on the way to the shard lane.
struct CudaGatherJob {
    client: ComputeClient<CudaRuntime>,
    send: Handle,
    recv: Handle,
    kind: ElementKind,
    count: usize,
    /// Units of the receive buffer.
    full_len: usize,
    /// An empty run of the units' type.
    empty: Elems,
    /// The device resources of both buffers once readied: they pin the allocations.
    resources: Vec<Box<dyn Send>>,
}

impl DeviceGatherJob for CudaGatherJob {
    fn kind(&self) -> ElementKind {
        self.kind
    }

    fn count(&self) -> usize {
        self.count
    }

    fn ready(&mut self) -> CommResult<(u64, u64)> {
        let handles = [self.send.clone(), self.recv.clone()];
        let addresses = ready_addresses(&self.client, &handles, &mut self.resources)?;
        Ok((addresses[0], addresses[1]))
    }

    fn into_units(self: Box<Self>) -> DeviceUnits {
        let job = *self;
        drop(job.resources);
        DeviceUnits {
            buffer: Box::new(CubeUnits::<CudaRuntime> {
                client: job.client,
                handle: job.recv,
            }),
            len: job.full_len,
            kind: job.empty,
            narrowed: None,
            uploaded: 0,
            downloaded: 0,
        }
    }
}
