//! Bucket all-gathers straight into device memory on `CubeBackend<CudaRuntime, …>` over an
//! engine that moves device memory itself (NCCL): the engine writes the gathered runtime units
//! into a CubeCL buffer, which the device codec then decodes in place (`codec.rs`) — no
//! host copy of the bucket, where the host path (gather on the host, upload) moves it once per
//! gather and NCCL's own host path three times.
//!
//! # Ordering against CubeCL's streams
//! cubecl-cuda gives each host thread its own stream and stamps every allocation with its
//! stream's position; a thread touching another stream's buffer waits for that stream only if
//! it has not synchronised with it past the buffer's stamp (see
//! [`stream_mark`](super::stream_mark)). NCCL runs on its own stream, outside that
//! scheme, so a lane readies the buffers first (`ready_addresses`): `get_resource` on each makes
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

use std::any::Any;

use burn_backend::Backend;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cubecl::Runtime;
use sshsdp_comm::{CommError, CommResult, ElementKind};

use super::codec::CubeUnits;
use super::{is_cube, lane_upload, padded_to_words, word_buffer_len};
use crate::lanes::DeviceGatherJob;
use crate::storage::buffers::SendUnits;
use crate::units::{DeviceUnits, Elems};
use crate::HsdpError;

/// The CUDA ordinal of `device` if `B` is `CubeBackend<CudaRuntime, …>` or fusion over it (`None`
/// otherwise).
pub(crate) fn cuda_ordinal<B: Backend>(device: &B::Device) -> Option<usize> {
    if !is_cube::<B, CudaRuntime>() {
        return None;
    }
    let any: &dyn Any = device;
    any.downcast_ref::<CudaDevice>().map(|d| d.index)
}

/// The buffers of an all-gather of `send` into `full_len` units on `device` (a CUDA device of
/// a `CubeBackend`): the job for a lane (which allocates the receive buffer, uploads a host
/// part, and hands back the receive buffer) and the bytes it will upload (this rank's part of
/// a host shard, or none).
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
            let bytes = padded_to_words(shard.le_bytes(part.clone()));
            let uploaded = bytes.len() as u64;
            (
                Outgoing::Upload(bytes),
                part.len(),
                shard.zeros_like(0),
                uploaded,
            )
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
            let written = cube.written.clone();
            (
                Outgoing::Device { send, written },
                part.len(),
                units.kind.zeros_like(0),
                0,
            )
        }
    };
    let job = CudaGatherJob {
        client,
        send,
        recv: None,
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

/// What a gather sends.
enum Outgoing {
    /// This rank's part of a host shard (whole words), uploaded by the lane.
    Upload(Vec<u8>),
    /// A range of a device buffer, and the mark of its last write (see the module docs).
    Device {
        send: Handle,
        written: Option<Handle>,
    },
}

/// A gather's CubeCL buffers on the way to the shard lane.
struct CudaGatherJob {
    client: ComputeClient<CudaRuntime>,
    send: Outgoing,
    /// The receive buffer, allocated by the lane in `ready`.
    recv: Option<Handle>,
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
        // On the lane's thread: both new buffers are the lane stream's own.
        let recv = self.client.empty(word_buffer_len(
            self.empty.unit_bytes() as usize * self.full_len,
        ));
        let mut handles = match &self.send {
            Outgoing::Upload(bytes) => vec![lane_upload(&self.client, bytes)],
            Outgoing::Device { send, written } => {
                let mut handles = vec![send.clone()];
                handles.extend(written.iter().cloned());
                handles
            }
        };
        handles.insert(1, recv.clone());
        self.recv = Some(recv);
        let addresses = ready_addresses(&self.client, &handles, &mut self.resources)?;
        Ok((addresses[0], addresses[1]))
    }

    fn into_units(self: Box<Self>) -> DeviceUnits {
        let job = *self;
        drop(job.resources);
        let recv = job
            .recv
            .expect("the lane readied the job before the engine wrote into it");
        DeviceUnits {
            buffer: Box::new(CubeUnits::<CudaRuntime>::new(job.client, recv)),
            len: job.full_len,
            kind: job.empty,
            narrowed: None,
            uploaded: 0,
            downloaded: 0,
        }
    }
}
