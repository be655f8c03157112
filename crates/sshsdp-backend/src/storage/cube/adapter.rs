//! The one answer to "are `B`'s float tensors CubeCL buffers?": the adapter between a decorated
//! backend's float primitive and burn-cubecl's [`CubeTensor`], for plain CubeCL backends
//! (`CubeBackend<R, …>`: the primitive *is* a `CubeTensor<R>`) and for burn-fusion over them
//! (`Fusion<CubeBackend<R, …>>`, what burn-wgpu's `Wgpu` and burn-cuda's `Cuda` are with Burn's
//! default features: the primitive is a `FusionTensor` in fusion's lazy stream).
//!
//! Every device job of `storage/cube` works on `CubeTensor<R>` and on raw CubeCL handles, runs
//! its Burn kernels on [`Inner<R>`] (the plain backend: no fusion stream in between), and meets
//! `B` only here, converting both ways:
//!
//! * [`from_cube`] wraps a buffer as `B`'s tensor. On fusion, without a copy: the `CubeTensor`
//!   becomes a `CubeFusionHandle` (burn-cubecl's `BackendIr::float_tensor_handle`: the cubecl
//!   `Handle` with its offsets, so a view in the middle of a bucket stays one), is registered with
//!   the fusion server (`register_tensor_handle`) and enters the model thread's stream as an `Init`
//!   operation that runs nothing (`NoOp`) — exactly what burn-fusion 0.21's own
//!   `Fusion::float_from_data` does with a freshly uploaded tensor (`burn-fusion/src/ops/tensor.rs`).
//! * [`to_cube`] gives the buffer of `B`'s tensor. On fusion it is `resolve_tensor_float`
//!   (`burn-fusion/src/client.rs`), which first drains the calling thread's whole lazy stream (so
//!   the buffer holds what the queued fused work writes, and raw CubeCL work issued next on this
//!   thread's CubeCL stream is ordered after it), then hands the handle out (kept in fusion's
//!   table while other clones of the tensor live). A drain cuts fusion's blocks: the runtime
//!   resolves once per bucket (a completed gradient bucket, a piece's master at the update), never
//!   once per gradient or per parameter.
//!
//! # Invariants the runtime keeps (and why fusion needs them)
//!
//! * **Register and resolve on the model thread only.** Fusion executes a stream's operations on
//!   the CubeCL stream of the thread that registered them (its server runs on a device thread,
//!   each task under the submitting thread's `StreamId`: cubecl-common 0.10,
//!   `device/handle/channel.rs`, `submit_inner`'s `current.executes`); raw CubeCL work issued by
//!   the model thread can reach its CubeCL stream *before* fused work registered earlier and not
//!   yet run.
//!   So raw work may read a buffer fusion writes only after a [`to_cube`] of it (a drain), and the
//!   lanes never touch fusion: they get `CubeTensor`s and handles.
//! * **A wrapped buffer is never rewritten.** An `Init`ed view is read whenever the fused kernel
//!   that reads it finally runs, possibly long after the runtime moved on. Every gather, decode
//!   and encode writes a *fresh* buffer (`codec.rs`, `gather.rs`, `reduce.rs` allocate their
//!   outputs), and an update replaces a shard rather than writing into it;
//!   `tests/wgpu_backend/fusion.rs` checks that operations queued on parameter views before an
//!   update read the values before it.
//! * **Drops are lazy.** A released bucket's views drop as `Drop` operations in the stream: its
//!   memory returns to CubeCL's pool when the stream executes past them, not at release. The
//!   resident-bytes counters say what the runtime holds; the device's own figures
//!   (`DeviceMemory`) lag by what the stream has not run yet.

use std::any::{Any, TypeId};

use burn_backend::Backend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};

/// The plain CubeCL backend on runtime `R`: where `storage/cube` runs Burn's kernels (casts,
/// fills, slices) directly on CubeCL buffers, whatever `B` wraps them in. Its float element only
/// names a default dtype: tensors carry their own.
pub(crate) type Inner<R> = CubeBackend<R, f32, i32, u32>;

/// burn-fusion's float tensor over CubeCL runtime `R`.
type Fused<R> = FusionTensor<FusionCubeRuntime<R>>;

/// How a backend's float tensors hold CubeCL buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CubeKind {
    /// `CubeBackend<R, …>`: the tensor is the buffer.
    Plain,
    /// `Fusion<CubeBackend<R, …>>`: the buffer sits in fusion's handle table.
    Fused,
}

/// How `B`'s float tensors hold `CubeTensor<R>`s (`None`: they do not).
pub(crate) fn cube_kind<B: Backend, R: CubeRuntime>() -> Option<CubeKind> {
    let id = TypeId::of::<B::FloatTensorPrimitive>();
    if id == TypeId::of::<CubeTensor<R>>() {
        Some(CubeKind::Plain)
    } else if id == TypeId::of::<Fused<R>>() {
        Some(CubeKind::Fused)
    } else {
        None
    }
}

/// The CubeCL buffer of `tensor`, a float tensor of `B` (checked by the caller with
/// [`cube_kind`]). On fusion this drains the calling thread's fusion stream: call it on the
/// model thread, once per bucket.
pub(crate) fn to_cube<B: Backend, R: CubeRuntime>(
    tensor: B::FloatTensorPrimitive,
) -> CubeTensor<R> {
    let any: Box<dyn Any> = Box::new(tensor);
    match any.downcast::<CubeTensor<R>>() {
        Ok(cube) => *cube,
        Err(any) => {
            let fused = *any
                .downcast::<Fused<R>>()
                .expect("checked by cube_kind: B's float tensors are CubeCL's or fusion's");
            let client = fused.client.clone();
            client.resolve_tensor_float::<Inner<R>>(fused)
        }
    }
}

/// `tensor` as a float tensor of `B` (checked by the caller with [`cube_kind`]), sharing its
/// buffer and offsets: no kernel, no copy. On fusion it is registered in the calling thread's
/// stream: call it on the model thread.
pub(crate) fn from_cube<B: Backend, R: CubeRuntime>(
    tensor: CubeTensor<R>,
) -> B::FloatTensorPrimitive {
    let out: Box<dyn Any> = match cube_kind::<B, R>() {
        Some(CubeKind::Plain) => Box::new(tensor),
        Some(CubeKind::Fused) => Box::new(register::<R>(tensor)),
        None => unreachable!("checked by cube_kind: B's float tensors are CubeCL's or fusion's"),
    };
    *out.downcast::<B::FloatTensorPrimitive>()
        .expect("checked by cube_kind")
}

/// `tensor` registered with the fusion server of its device as an `Init` operation.
fn register<R: CubeRuntime>(tensor: CubeTensor<R>) -> Fused<R> {
    let client = get_client::<Inner<R>>(&tensor.device);
    let shape = tensor.meta.shape().clone();
    let dtype = tensor.dtype;
    let handle = <Inner<R> as BackendIr>::float_tensor_handle(tensor);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<Inner<R>>::new(),
        )
        .output()
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn_backend::ops::FloatTensorOps;
    use burn_backend::{read_sync, Shape, TensorData};
    use burn_fusion::Fusion;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    type Fb = Fusion<Inner<WgpuRuntime>>;

    #[test]
    fn kinds_are_told_apart() {
        assert_eq!(
            cube_kind::<Inner<WgpuRuntime>, WgpuRuntime>(),
            Some(CubeKind::Plain)
        );
        assert_eq!(cube_kind::<Fb, WgpuRuntime>(), Some(CubeKind::Fused));
        #[cfg(feature = "ndarray")]
        assert_eq!(cube_kind::<burn_ndarray::NdArray<f32>, WgpuRuntime>(), None);
    }

    #[test]
    fn a_view_in_the_middle_of_a_buffer_keeps_its_offset_through_fusion_and_back() {
        let device = WgpuDevice::default();
        let values: Vec<f32> = (0..1024).map(|i| i as f32).collect();
        let bucket =
            Inner::<WgpuRuntime>::float_from_data(TensorData::new(values, [1024]), &device);
        let align = bucket.client.properties().memory.alignment / 4;
        let (start, len) = (2 * align as usize, 40);
        let total = bucket.handle.size_in_used();
        let handle = bucket
            .handle
            .clone()
            .offset_start(4 * start as u64)
            .offset_end(total - 4 * (start + len) as u64);
        let offsets = (handle.offset_start, handle.offset_end);
        let view = CubeTensor::<WgpuRuntime>::new_contiguous(
            bucket.client.clone(),
            device.clone(),
            Shape::from([len]),
            handle,
            bucket.dtype,
        );
        let allocs = || bucket.client.memory_usage().unwrap().number_allocs;
        let before = allocs();
        let fused = from_cube::<Fb, WgpuRuntime>(view);
        // Resolved back, it is the same memory at the same offsets: no allocation, no kernel.
        let back = to_cube::<Fb, WgpuRuntime>(fused.clone());
        assert_eq!((back.handle.offset_start, back.handle.offset_end), offsets);
        assert_eq!(allocs(), before, "the round trip allocates nothing");
        let read = read_sync(Inner::<WgpuRuntime>::float_into_data(back)).unwrap();
        let expect: Vec<f32> = (start..start + len).map(|i| i as f32).collect();
        assert_eq!(read.into_vec::<f32>().unwrap(), expect);
        // Fused work on the view reads the view's own values.
        let doubled = Fb::float_add(fused.clone(), fused);
        let read = read_sync(Fb::float_into_data(doubled)).unwrap();
        let expect: Vec<f32> = expect.iter().map(|v| 2.0 * v).collect();
        assert_eq!(read.into_vec::<f32>().unwrap(), expect);
    }
}
