//! Device storage on CubeCL backends (`CubeBackend<R, …>` and `Fusion<CubeBackend<R, …>>`, with
//! this crate's `wgpu` or `cuda` feature): everything that touches a CubeCL buffer, one module per
//! job.
//!
//! * `adapter.rs`: the decorated backend's float tensors to and from `CubeTensor`s (plain or
//!   through burn-fusion): the only place that knows which;
//! * `views.rs`: parameter views over a gathered bucket's device buffer (no kernel, no copy);
//! * `codec.rs`: the square-block MXFP8 and bf16 kernels of `sshsdp-kernels` run on a bucket's
//!   units (decode after a gather, encode of a piece after its update), and the lane's upload;
//! * `exchange.rs`: one rank's buffers of a device collective, run by NCCL (raw addresses) or
//!   by ranks of this process that share the device (CubeCL kernels): the device seam;
//! * `gather.rs`: all-gathers (and shard rebuilds) into device memory;
//! * `reduce.rs`: gradient reductions from device memory, by the engine or staged via the host;
//! * `shard.rs`: runtime shards held in device memory (read back, uploaded);
//! * `update_job.rs`: an optimizer's collectives over the update group on the device (the
//!   all-reduce in place, the all-to-all-v into a receive buffer).
//!
//! This module holds what they share: the runtimes this build supports ([`for_each_runtime`]),
//! the client of a device, stream ordering across threads, and buffer sizes.

use std::any::Any;

use burn_backend::Backend;
use burn_cubecl::CubeRuntime;
use cubecl::Runtime;

pub(crate) use crate::runtime_units::{padded_to_words, word_buffer_len};
use crate::storage::roles::DeviceMemory;

pub(crate) mod adapter;
pub(crate) mod codec;
#[cfg(all(test, feature = "wgpu"))]
mod codec_tests;
pub(crate) mod exchange;
#[cfg(all(test, feature = "wgpu"))]
mod exchange_tests;
pub(crate) mod gather;
pub(crate) mod reduce;
pub(crate) mod shard;
pub(crate) mod update_job;
pub(crate) mod views;

/// Calls `$body` with `$R` bound to each CubeCL runtime this build supports.
macro_rules! for_each_runtime {
    ($R:ident => $body:block) => {{
        #[cfg(feature = "wgpu")]
        {
            type $R = cubecl::wgpu::WgpuRuntime;
            $body
        }
        #[cfg(feature = "cuda")]
        {
            type $R = cubecl::cuda::CudaRuntime;
            $body
        }
    }};
}

pub(crate) use for_each_runtime;

/// `device`, a device of `B` whose float tensors hold `CubeTensor<R>`s (checked by the caller
/// with [`is_cube`]), as runtime `R`'s device (fusion over a CubeCL backend keeps its device type).
pub(crate) fn cube_device<B: Backend, R: CubeRuntime>(device: &B::Device) -> &R::Device {
    let any: &dyn Any = device;
    any.downcast_ref().expect("checked by is_cube")
}

/// The CubeCL client of `device`, a device of `B` whose float tensors hold `CubeTensor<R>`s
/// (checked by the caller with [`is_cube`]).
pub(crate) fn client_of<B: Backend, R: CubeRuntime>(
    device: &B::Device,
) -> cubecl::prelude::ComputeClient<R> {
    <R as cubecl::Runtime>::client(cube_device::<B, R>(device))
}

/// `client` for work a lane thread queues on behalf of the calling (model) thread.
///
/// On wgpu it is pinned to the calling thread's stream. CubeCL-wgpu's streams are queues of
/// tasks over one device queue, and a queued task holds the raw buffer, not the allocation: a
/// buffer allocated on a lane's stream, read by kernels queued on the model's stream and then
/// dropped returns to the lane stream's pool at once, and the lane's next upload into that
/// memory can reach the device queue before the model's kernels that read the old contents
/// (the MXFP8 decode of a gathered bucket, whose bytes are dropped right after the decode is
/// queued, read the next bucket's bytes: NaN losses with more than one bucket). One stream
/// orders every allocation, write and read. (On the device there is no concurrency to lose:
/// wgpu has one queue.) CUDA keeps the lanes' own streams: its multi-stream runtime waits on
/// events across streams and frees a shared buffer only once the other stream has passed it.
pub(crate) fn lane_client<R: CubeRuntime>(
    client: cubecl::prelude::ComputeClient<R>,
) -> cubecl::prelude::ComputeClient<R> {
    if is_wgpu::<R>() {
        let mut client = client;
        // SAFETY: the stream exists (it is the calling thread's) and is used from other
        // threads only through this client, whose calls the device's server serialises.
        unsafe { client.set_stream(cubecl::stream_id::StreamId::current()) };
        return client;
    }
    client
}

/// `bytes` uploaded by a lane thread into a new buffer of `client`, the upload's host copy
/// released.
///
/// cubecl-cuda keeps the host copy of every upload in its stream's pending-drop queue
/// (`cubecl-cuda` 0.10, `compute/command.rs`: `drop_queue.push(data)` after the copy is queued)
/// until a kernel launches on that stream (`execute_task` flushes the queue when its policy says)
/// or the client flushes (`server.rs`: `drop_queue.flush`, which waits for the previous flush's
/// fence and frees what it protected: one flush behind). A lane's stream launches no kernel, so
/// without a flush every upload of every step stays in host memory (the H200 call's +494 MiB
/// per step: 6 bytes per parameter uploaded on the lanes). Flushing after each upload keeps at
/// most the previous upload's copy alive. On wgpu the lanes queue on the model thread's stream
/// ([`lane_client`]), whose kernels release them: no flush there.
pub(crate) fn lane_upload<R: CubeRuntime>(
    client: &cubecl::prelude::ComputeClient<R>,
    bytes: &[u8],
) -> cubecl::server::Handle {
    let handle = client.create_from_slice(bytes);
    if !is_wgpu::<R>() {
        if let Err(e) = client.flush() {
            log::warn!("flushing a lane's stream after an upload: {e:?}");
        }
    }
    handle
}

/// Whether `R` is CubeCL's wgpu runtime.
#[cfg_attr(not(feature = "wgpu"), allow(clippy::extra_unused_type_parameters))]
fn is_wgpu<R: CubeRuntime>() -> bool {
    #[cfg(feature = "wgpu")]
    if std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::wgpu::WgpuRuntime>() {
        return true;
    }
    false
}

/// A mark of "now" in the calling thread's CubeCL stream: a fresh 4-byte allocation.
///
/// CubeCL stamps each allocation with its stream's cursor (the count of commands resolved on
/// it), and a thread that touches a buffer of another stream waits for that stream only if it
/// has not synchronised with it at or past the buffer's stamp (`cubecl-runtime`'s
/// `MultiStream::align_streams`). The stamp is the *allocation's*, not the last write's: a
/// buffer written by kernels queued after its allocation (an encode into a zeroed buffer, an
/// update) can look synchronised to another stream while those kernels are still queued. A
/// mark made on the producing thread once the writes are queued carries a stamp past them;
/// handing it to `get_resource` together with the buffer makes the other stream wait for the
/// writes. Such a wait covers everything the producing stream has queued at that moment; once
/// the other stream has synchronised past the mark, later reads of the buffer wait for
/// nothing. Keep the mark alive as long as the buffer may be read from another stream.
pub(crate) fn stream_mark<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
) -> cubecl::server::Handle {
    client.empty(4)
}

/// Whether `B`'s float tensors hold `CubeTensor<R>`s, plain or through fusion ([`adapter`]).
pub(crate) fn is_cube<B: Backend, R: CubeRuntime>() -> bool {
    adapter::cube_kind::<B, R>().is_some()
}

/// The buffer-offset alignment of `device` in bytes, if `B` is a CubeCL backend this build
/// supports (`None` otherwise: other backends place no constraint on views).
pub(crate) fn alignment<B: Backend>(device: &B::Device) -> Option<u64> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            return Some(client_of::<B, R>(device).properties().memory.alignment);
        }
    });
    None
}

/// The allocator's view of `device`'s memory, if `B` is a CubeCL backend this build supports.
pub(crate) fn memory_usage<B: Backend>(device: &B::Device) -> Option<DeviceMemory> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let any: &dyn Any = device;
            let device: &<R as Runtime>::Device = any.downcast_ref()?;
            let usage = R::client(device).memory_usage().ok()?;
            return Some(DeviceMemory {
                in_use: usage.bytes_in_use,
                reserved: usage.bytes_reserved,
                allocations: usage.number_allocs,
            });
        }
    });
    None
}

/// Whether `B` is a CubeCL backend this build supports.
pub(crate) fn is_cube_backend<B: Backend>() -> bool {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            return true;
        }
    });
    false
}

/// Launches `mark` on the calling thread's stream of `device`, if `B` is a CubeCL backend this
/// build supports (see [`crate::storage::launch_mark`]).
pub(crate) fn launch_mark<B: Backend>(device: &B::Device, mark: sshsdp_kernels::LaunchMark) {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let client = client_of::<B, R>(device);
            let scratch = client.empty(4);
            sshsdp_kernels::launch_mark::<R>(&client, &scratch, mark);
            return;
        }
    });
}
