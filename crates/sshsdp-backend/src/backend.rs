//! `Hsdp<B>`: the backend type, its associated types, and the `Backend` and
//! `DistributedBackend` implementations (the ops traits are in `ops/`).

use std::marker::PhantomData;

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedParams, ReduceOperation, TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData};
use cubecl::device::DeviceId;

use crate::registry;
use crate::tensor::HsdpFloat;

/// A Burn backend decorator: every op runs on `B` (with `B`'s own kernels), while parameters
/// registered with [`crate::shard`] live in packed, sharded bucket storage and are gathered on
/// first use. Use it as `Autodiff<Hsdp<B>>` for training.
pub struct Hsdp<B: Backend> {
    _inner: PhantomData<B>,
}

impl<B: Backend> Clone for Hsdp<B> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl<B: Backend> Default for Hsdp<B> {
    fn default() -> Self {
        Self {
            _inner: PhantomData,
        }
    }
}

impl<B: Backend> std::fmt::Debug for Hsdp<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hsdp<{}>", std::any::type_name::<B>())
    }
}

impl<B: Backend> BackendTypes for Hsdp<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = HsdpFloat<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Hsdp<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("hsdp<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        // Some backends (burn-cuda) panic when no driver is present; a machine without the
        // device simply has none.
        std::panic::catch_unwind(|| B::device_count(type_id)).unwrap_or(0)
    }
}

/// Autodiff calls these as gradients become final. `Hsdp<B>` implements them itself, without
/// asking `B` to be a `DistributedBackend`, so `Autodiff<Hsdp<NdArray>>` works.
impl<B: Backend> DistributedBackend for Hsdp<B> {
    fn start_communication_server(
        _devices: &[Self::Device],
        _config: burn_backend::distributed::DistributedConfig,
    ) {
    }

    fn close_communication_server(_device: &Self::Device) {}

    fn register_sync_parameters(_device: &Self::Device, params: Vec<DistributedParams>) {
        registry::begin_backward::<B>(&params);
    }

    fn submit_sync_collective(_device: &Self::Device) {
        // Called by Autodiff at the end of a backward with routed gradients, on its thread,
        // after Burn released its graph locks.
        registry::end_backward();
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        // SAFETY: Autodiff hands us a pointer to the gradient it just registered and does not
        // touch it until this call returns.
        let grad: &mut FloatTensor<Self> = unsafe { &mut *tensor.0 };
        registry::submit_gradient(grad, &params);
    }

    fn all_reduce(
        _tensor: FloatTensor<Self>,
        _op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        panic!(
            "Hsdp<B> does not take part in burn's own DDP all-reduce: shard the model with \
             sshsdp_backend::shard and let Hsdp reduce gradients"
        )
    }

    fn sync_collective(_device: &Self::Device) {}
}
