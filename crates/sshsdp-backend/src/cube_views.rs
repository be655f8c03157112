//! Parameter views of a gathered bucket on CubeCL backends (`CubeBackend<R, …>` with the `wgpu`
//! or `cuda` feature): each parameter is a `CubeTensor` over the bucket's memory handle at the
//! parameter's byte offset — no kernel, no allocation.
//!
//! burn-cubecl's own `slice` keeps a view only when the bytes both before and after the slice
//! are multiples of the device's buffer-offset alignment (`memory.alignment`: the uniform-offset
//! alignment on wgpu, 512 B on CUDA) and copies otherwise, which for parameters of arbitrary
//! sizes means nearly always. A binding needs only an aligned *start* (and a length in whole
//! words), so the plan aligns every parameter's start to [`alignment`] (`shard` raises
//! `align_bytes` to it) and the views here are built from the handle directly. A member whose
//! start is not aligned (a plan made for another device) falls back to the generic path.

use std::any::{Any, TypeId};

use burn_backend::{Backend, Shape, Slice};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::Runtime;

use crate::views::{ComputeBuf, Member};

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

/// The CubeCL client of `device`, a device of `B` whose float tensors are `CubeTensor<R>`
/// (checked by the caller with [`is_cube`]).
pub(crate) fn client_of<B: Backend, R: CubeRuntime>(
    device: &B::Device,
) -> cubecl::prelude::ComputeClient<R> {
    let any: &dyn Any = device;
    let device: &<R as cubecl::Runtime>::Device = any.downcast_ref().expect("checked by is_cube");
    <R as cubecl::Runtime>::client(device)
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
    #[cfg(feature = "wgpu")]
    if TypeId::of::<R>() == TypeId::of::<cubecl::wgpu::WgpuRuntime>() {
        let mut client = client;
        // SAFETY: the stream exists (it is the calling thread's) and is used from other
        // threads only through this client, whose calls the device's server serialises.
        unsafe { client.set_stream(cubecl::stream_id::StreamId::current()) };
        return client;
    }
    client
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

/// Whether `B`'s float tensors are `CubeTensor<R>`.
pub(crate) fn is_cube<B: Backend, R: CubeRuntime>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<CubeTensor<R>>()
}

/// The buffer-offset alignment of `device` in bytes, if `B` is a CubeCL backend this build
/// supports (`None` otherwise: other backends place no constraint on views).
pub(crate) fn alignment<B: Backend>(device: &B::Device) -> Option<u64> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let probe = B::float_zeros([1].into(), device, burn_backend::FloatDType::F32);
            let any: Box<dyn Any> = Box::new(probe);
            let tensor = any.downcast::<CubeTensor<R>>().expect("the type was checked");
            return Some(tensor.client.properties().memory.alignment);
        }
    });
    None
}

/// The allocator's view of `device`'s memory, if `B` is a CubeCL backend this build supports.
pub(crate) fn memory_usage<B: Backend>(device: &B::Device) -> Option<crate::storage::DeviceMemory> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let any: &dyn Any = device;
            let device: &<R as Runtime>::Device = any.downcast_ref()?;
            let usage = R::client(device).memory_usage().ok()?;
            return Some(crate::storage::DeviceMemory {
                in_use: usage.bytes_in_use,
                reserved: usage.bytes_reserved,
                allocations: usage.number_allocs,
            });
        }
    });
    None
}

/// Views sharing one device buffer holding `full` (uploaded in its compute dtype) if `B` is a
/// CubeCL backend this build supports; otherwise `full` back.
pub(crate) fn views_if_cube<B: Backend>(
    full: ComputeBuf,
    members: &[Member],
    device: &B::Device,
) -> Result<Vec<B::FloatTensorPrimitive>, ComputeBuf> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            return Ok(views::<B, R>(full, members, device));
        }
    });
    Err(full)
}

fn views<B: Backend, R: CubeRuntime>(
    full: ComputeBuf,
    members: &[Member],
    device: &B::Device,
) -> Vec<B::FloatTensorPrimitive> {
    let bucket = B::float_from_data(full.into_data(), device);
    member_views::<B, R>(bucket, members)
}

/// `bucket` (a contiguous 1-D float `CubeTensor<R>` as `B`'s primitive, f32 or bf16) as one view
/// per member, in the bucket's dtype.
pub(crate) fn member_views<B: Backend, R: CubeRuntime>(
    bucket: B::FloatTensorPrimitive,
    members: &[Member],
) -> Vec<B::FloatTensorPrimitive> {
    let any: Box<dyn Any> = Box::new(bucket.clone());
    let cube = any
        .downcast::<CubeTensor<R>>()
        .expect("the type was checked");
    let align = cube.client.properties().memory.alignment;
    let total = cube.handle.size_in_used();
    let (dtype, elem) = (cube.dtype, cube.dtype.size() as u64);
    members
        .iter()
        .map(|m| {
            let (start, end) = (elem * m.start as u64, elem * m.end() as u64);
            if start % align != 0 {
                // Not a view the device can bind: Burn's slice (a copy) and reshape.
                let slice = Slice::new(m.start as isize, Some(m.end() as isize), 1);
                let flat = B::float_slice(bucket.clone(), &[slice]);
                return B::float_reshape(flat, Shape::from(m.shape.clone()));
            }
            let handle = cube
                .handle
                .clone()
                .offset_start(start)
                .offset_end(total - end);
            let view = CubeTensor::<R>::new_contiguous(
                cube.client.clone(),
                cube.device.clone(),
                Shape::from(m.shape.clone()),
                handle,
                dtype,
            );
            let any: Box<dyn Any> = Box::new(view);
            *any.downcast::<B::FloatTensorPrimitive>()
                .expect("the type was checked")
        })
        .collect()
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn_backend::ops::FloatTensorOps;
    use burn_backend::{read_sync, FloatDType};
    use burn_cubecl::CubeBackend;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    use crate::config::Precision;

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    #[test]
    fn views_share_the_bucket_buffer_and_read_their_own_values() {
        let device = WgpuDevice::default();
        let align = alignment::<B>(&device).expect("a CubeCL backend") as usize / 4;
        // Three parameters at aligned starts, with lengths that leave unaligned gaps after.
        let members = [
            Member {
                start: 0,
                shape: vec![3, 5],
            },
            Member {
                start: align.max(16),
                shape: vec![7],
            },
            Member {
                start: 3 * align.max(16),
                shape: vec![2, 2, 3],
            },
        ];
        let n = members[2].end() + 5;
        let client = {
            let probe = B::float_zeros([1].into(), &device, FloatDType::F32);
            probe.client.clone()
        };
        // An f32 bucket and an f16 one (2-byte elements: the members' byte offsets halve, and
        // stay aligned since the plan doubles the alignment for 16-bit compute).
        for precision in [Precision::F32, Precision::F16] {
            let members = members.iter().map(|m| Member {
                start: m.start * (4 / precision.bytes() as usize),
                shape: m.shape.clone(),
            });
            let members: Vec<Member> = members.collect();
            let full: Vec<f32> = (0..members[2].end() + 5)
                .map(|i| (i % n) as f32 * 0.5 - 3.0)
                .collect();
            let before = client.memory_usage().unwrap();
            let buf = ComputeBuf::new(full.clone(), precision);
            let views =
                views_if_cube::<B>(buf, &members, &device).unwrap_or_else(|_| panic!("cube views"));
            let after = client.memory_usage().unwrap();
            // One allocation: the bucket; every view shares it (a copy would allocate one more).
            assert_eq!(
                after.number_allocs,
                before.number_allocs + 1,
                "{precision:?}: {before:?} → {after:?}"
            );
            for (m, view) in members.iter().zip(views) {
                assert_eq!(view.meta.shape().to_vec(), m.shape);
                assert_eq!(view.dtype, precision.dtype().into());
                let values = read_sync(B::float_into_data(view))
                    .unwrap()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .unwrap();
                // Every value here is exact in f16.
                assert_eq!(values, full[m.start..m.end()], "{precision:?}");
            }
        }
    }
}
