//! Parameter views of a gathered bucket on CubeCL backends (`CubeBackend<R, …>` and fusion over
//! it, with the `wgpu` or `cuda` feature): each parameter is a `CubeTensor` over the bucket's
//! memory handle at the parameter's byte offset — no kernel, no allocation — handed to `B` by
//! the [`adapter`](super::adapter) (on fusion, registered as an `Init` of that handle).
//!
//! burn-cubecl's own `slice` keeps a view only when the bytes both before and after the slice
//! are multiples of the device's buffer-offset alignment (`memory.alignment`: the uniform-offset
//! alignment on wgpu, 512 B on CUDA) and copies otherwise, which for parameters of arbitrary
//! sizes means nearly always. A binding needs only an aligned *start* (and a length in whole
//! words), so the plan aligns every parameter's start to [`alignment`] (`shard` raises
//! `align_bytes` to it) and the views here are built from the handle directly. A member whose
//! start is not aligned (a plan made for another device) falls back to the generic path.

use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, Shape, Slice};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::adapter::{from_cube, Inner};
#[cfg(test)]
use super::alignment;
use super::{cube_device, for_each_runtime, is_cube};
use crate::storage::compute::{ComputeBuf, Member};

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
    let bucket = Inner::<R>::float_from_data(full.into_data(), cube_device::<B, R>(device));
    member_views::<B, R>(bucket, members)
}

/// `cube` (a contiguous 1-D float bucket, f32 or bf16) as one view of `B` per member, in the
/// bucket's dtype.
pub(crate) fn member_views<B: Backend, R: CubeRuntime>(
    cube: CubeTensor<R>,
    members: &[Member],
) -> Vec<B::FloatTensorPrimitive> {
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
                let flat = Inner::<R>::float_slice(cube.clone(), &[slice]);
                let view = Inner::<R>::float_reshape(flat, Shape::from(m.shape.clone()));
                return from_cube::<B, R>(view);
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
            from_cube::<B, R>(view)
        })
        .collect()
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn_backend::read_sync;
    use burn_cubecl::CubeBackend;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    use crate::config::Precision;

    type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
    /// burn-wgpu's `Wgpu` with Burn's default features.
    type Fused = burn_fusion::Fusion<Plain>;

    #[test]
    fn views_share_the_bucket_buffer_and_read_their_own_values() {
        views_share_one_allocation::<Plain>();
    }

    #[test]
    fn views_share_the_bucket_buffer_under_fusion() {
        views_share_one_allocation::<Fused>();
    }

    fn views_share_one_allocation<B: Backend<Device = WgpuDevice>>() {
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
        let client = crate::storage::cube::client_of::<B, WgpuRuntime>(&device);
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
                let meta = burn_backend::TensorMetadata::shape(&view);
                assert_eq!(meta.to_vec(), m.shape);
                assert_eq!(
                    burn_backend::TensorMetadata::dtype(&view),
                    precision.dtype().into()
                );
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
