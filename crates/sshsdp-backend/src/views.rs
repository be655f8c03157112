//! Parameter views of a gathered bucket: each parameter's tensor shares the bucket's buffer.
//!
//! The generic path asks `B` for a slice and a reshape of the bucket tensor. burn-cubecl keeps a
//! slice as a view only at offsets aligned on both ends (and copies otherwise), so on CubeCL
//! backends the views are built from the bucket's memory handle (`cube_views.rs`, features
//! `wgpu`/`cuda`). burn-ndarray 0.21 copies on both (its `slice` and `reshape` return
//! owned arrays), so for `NdArray` the views are built directly as `ndarray` arrays sharing the
//! bucket's allocation (with the `ndarray` feature, on by default). Both paths hand out tensors
//! that are copy-on-write in their backend: an op never writes through a view into the bucket.

use burn_backend::{Backend, Shape, Slice, TensorData};
use half::{bf16, f16};

use crate::config::Precision;

/// A decoded bucket on the host, in the compute dtype: what its parameters are views of.
pub(crate) enum ComputeBuf {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values (rounded to nearest even from the decoded f32, exact for bf16 and MXFP8
    /// runtime parameters).
    Bf16(Vec<bf16>),
    /// f16 values (rounded to nearest even from the decoded f32).
    F16(Vec<f16>),
}

impl ComputeBuf {
    /// The decoded f32 values `values` in `precision`.
    pub fn new(values: Vec<f32>, precision: Precision) -> Self {
        match precision {
            Precision::F32 => ComputeBuf::F32(values),
            Precision::Bf16 => {
                ComputeBuf::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect())
            }
            Precision::F16 => ComputeBuf::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            ComputeBuf::F32(v) => v.len(),
            ComputeBuf::Bf16(v) => v.len(),
            ComputeBuf::F16(v) => v.len(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            ComputeBuf::F32(v) => 4 * v.len() as u64,
            ComputeBuf::Bf16(v) => 2 * v.len() as u64,
            ComputeBuf::F16(v) => 2 * v.len() as u64,
        }
    }

    /// The whole buffer as 1-D tensor data (moved, not copied).
    pub fn into_data(self) -> TensorData {
        let n = self.len();
        match self {
            ComputeBuf::F32(v) => TensorData::new(v, [n]),
            ComputeBuf::Bf16(v) => TensorData::new(v, [n]),
            ComputeBuf::F16(v) => TensorData::new(v, [n]),
        }
    }

    /// A copy of `member`'s values as tensor data of its shape.
    pub fn member_data(&self, member: &Member) -> TensorData {
        let range = member.start..member.end();
        match self {
            ComputeBuf::F32(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
            ComputeBuf::Bf16(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
            ComputeBuf::F16(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
        }
    }
}

/// One parameter's place in a bucket: first element and shape.
pub(crate) struct Member {
    /// Element offset in the bucket.
    pub start: usize,
    /// Shape of the parameter.
    pub shape: Vec<usize>,
}

impl Member {
    /// One past the member's last element.
    pub fn end(&self) -> usize {
        self.start + self.shape.iter().product::<usize>()
    }
}

/// The bucket buffer `full` as one tensor per member, each a view into it; also the bytes
/// uploaded into `B`'s memory (0 where `B` takes the host allocation itself: burn-ndarray).
pub(crate) fn bucket_views<B: Backend>(
    full: ComputeBuf,
    members: &[Member],
    device: &B::Device,
) -> (Vec<B::FloatTensorPrimitive>, u64) {
    let bytes = full.bytes();
    #[cfg(feature = "ndarray")]
    let full = match full {
        ComputeBuf::F32(values) => match ndarray_views::views_if_ndarray::<B>(values, members) {
            Ok(views) => return (views, 0),
            Err(values) => ComputeBuf::F32(values),
        },
        other => other,
    };
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    let full = match crate::cube_views::views_if_cube::<B>(full, members, device) {
        Ok(views) => return (views, bytes),
        Err(full) => full,
    };
    let bucket = B::float_from_data(full.into_data(), device);
    let views = members
        .iter()
        .map(|m| {
            let slice = Slice {
                start: m.start as isize,
                end: Some(m.end() as isize),
                step: 1,
            };
            let flat = B::float_slice(bucket.clone(), &[slice]);
            B::float_reshape(flat, Shape::from(m.shape.clone()))
        })
        .collect();
    (views, bytes)
}

/// Runs `f` on `tensor`'s values as f32: in place when `B` is burn-ndarray and the tensor is a
/// contiguous f32 array (reading a gradient that Burn still holds would otherwise copy it one
/// element at a time, since the data is shared), else through `into_data` (a bf16 tensor is
/// widened on the host). Also returns the bytes downloaded from `B`'s memory (0 when read in
/// place).
pub(crate) fn with_f32_values<B: Backend, R>(
    tensor: B::FloatTensorPrimitive,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<(R, u64), String> {
    #[cfg(feature = "ndarray")]
    if let Some(values) = ndarray_views::f32_slice::<B>(&tensor) {
        return Ok((f(values), 0));
    }
    let data = burn_backend::read_sync(B::float_into_data(tensor)).map_err(|e| format!("{e:?}"))?;
    let downloaded = data.bytes.len() as u64;
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    Ok((f(&values), downloaded))
}

#[cfg(feature = "ndarray")]
mod ndarray_views {
    use std::any::{Any, TypeId};

    use burn_backend::Backend;
    use burn_ndarray::NdArrayTensor;
    use ndarray::{s, ArcArray1, IxDyn};

    use super::Member;

    /// The values of a contiguous f32 burn-ndarray tensor, borrowed.
    pub(super) fn f32_slice<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Option<&[f32]> {
        let any: &dyn Any = tensor;
        match any.downcast_ref::<NdArrayTensor>()? {
            NdArrayTensor::F32(storage) => storage.view().to_slice(),
            _ => None,
        }
    }

    /// Views sharing `full`'s allocation (moved into an `ndarray` array) if `B`'s float tensors
    /// are burn-ndarray's; otherwise `full` back.
    pub(super) fn views_if_ndarray<B: Backend>(
        full: Vec<f32>,
        members: &[Member],
    ) -> Result<Vec<B::FloatTensorPrimitive>, Vec<f32>> {
        if TypeId::of::<B::FloatTensorPrimitive>() != TypeId::of::<NdArrayTensor>() {
            return Err(full);
        }
        let bucket = ArcArray1::from_vec(full);
        Ok(members
            .iter()
            .map(|m| {
                let flat = bucket.clone().slice_move(s![m.start..m.end()]);
                let view = flat
                    .into_shape_with_order(IxDyn(&m.shape))
                    .expect("a contiguous slice takes any shape of its length");
                let tensor: Box<dyn Any> = Box::new(NdArrayTensor::from(view));
                *tensor
                    .downcast::<B::FloatTensorPrimitive>()
                    .expect("the type was checked above")
            })
            .collect())
    }
}
