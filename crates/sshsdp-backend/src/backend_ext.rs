//! The backends a module can be sharded on: `Hsdp<B>` (inference, no gradients) and
//! `Autodiff<Hsdp<B>>` (training).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use burn_backend::distributed::DistributedParamId;
use burn_backend::tensor::FloatTensor;
use burn_backend::BackendTypes;

use crate::tensor::HsdpFloat;
use crate::Hsdp;

/// A backend whose float primitive is (or wraps) `Hsdp`'s.
pub trait ShardableBackend: Backend {
    /// The backend `Hsdp` decorates.
    type Inner: Backend + BackendTypes<Device = Self::Device>;

    /// The `Hsdp` primitive inside a float tensor of this backend.
    fn to_hsdp(tensor: FloatTensor<Self>) -> HsdpFloat<Self::Inner>;

    /// A float tensor of this backend around an `Hsdp` primitive.
    fn from_hsdp(tensor: HsdpFloat<Self::Inner>) -> FloatTensor<Self>;

    /// Marks a parameter so its final gradient is handed to the runtime.
    fn mark_distributed<const D: usize>(
        tensor: Tensor<Self, D>,
        id: DistributedParamId,
    ) -> Tensor<Self, D>;
}

impl<B: Backend> ShardableBackend for Hsdp<B> {
    type Inner = B;

    fn to_hsdp(tensor: FloatTensor<Self>) -> HsdpFloat<B> {
        tensor
    }

    fn from_hsdp(tensor: HsdpFloat<B>) -> FloatTensor<Self> {
        tensor
    }

    fn mark_distributed<const D: usize>(
        tensor: Tensor<Self, D>,
        _id: DistributedParamId,
    ) -> Tensor<Self, D> {
        // Without autodiff there are no gradients to route.
        tensor
    }
}

impl<B: Backend, C: CheckpointStrategy> ShardableBackend for Autodiff<Hsdp<B>, C> {
    type Inner = B;

    fn to_hsdp(tensor: FloatTensor<Self>) -> HsdpFloat<B> {
        <Self as AutodiffBackend>::inner(tensor)
    }

    fn from_hsdp(tensor: HsdpFloat<B>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(tensor)
    }

    fn mark_distributed<const D: usize>(
        tensor: Tensor<Self, D>,
        id: DistributedParamId,
    ) -> Tensor<Self, D> {
        tensor.set_distributed(id)
    }
}
