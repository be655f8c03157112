//! Host storage's parameter views and reads: burn-ndarray tensors that share a gathered
//! bucket's allocation, and gradients read in place.
//!
//! burn-ndarray 0.21 copies on both `slice` and `reshape` (they return owned arrays), so for
//! `NdArray` the views are built directly as `ndarray` arrays sharing the bucket's allocation
//! (with the `ndarray` feature, on by default). They are copy-on-write: an op never writes
//! through a view into the bucket. Other host backends get the generic path of the seam
//! (`storage/mod.rs`).

use crate::traffic::{Purpose, Traffic};
use burn_backend::Backend;
#[cfg(feature = "ndarray")]
use {
    crate::storage::compute::Member,
    burn_ndarray::NdArrayTensor,
    ndarray::{s, ArcArray1, IxDyn},
    std::any::{Any, TypeId},
};

/// Runs `f` on `tensor`'s values as f32: in place when `B` is burn-ndarray and the tensor is a
/// contiguous f32 array (reading a gradient that Burn still holds would otherwise copy it one
/// element at a time, since the data is shared), else through `into_data` (a bf16 tensor is
/// widened on the host). The bytes read back from `B`'s memory (none when read in place) are
/// charged to `traffic`.
pub(crate) fn with_f32_values<B: Backend, R>(
    tensor: B::FloatTensorPrimitive,
    traffic: &Traffic,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<R, String> {
    #[cfg(feature = "ndarray")]
    if let Some(values) = f32_slice::<B>(&tensor) {
        return Ok(f(values));
    }
    let data = burn_backend::read_sync(B::float_into_data(tensor)).map_err(|e| format!("{e:?}"))?;
    traffic.download(data.bytes.len() as u64, Purpose::Data);
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    Ok(f(&values))
}

#[cfg(feature = "ndarray")]
/// The values of a contiguous f32 burn-ndarray tensor, borrowed.
fn f32_slice<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Option<&[f32]> {
    let any: &dyn Any = tensor;
    match any.downcast_ref::<NdArrayTensor>()? {
        NdArrayTensor::F32(storage) => storage.view().to_slice(),
        _ => None,
    }
}

#[cfg(feature = "ndarray")]
/// Views sharing `full`'s allocation (moved into an `ndarray` array) if `B`'s float tensors
/// are burn-ndarray's; otherwise `full` back.
pub(crate) fn views_if_ndarray<B: Backend>(
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
