//! The backends a module can be sharded on: `Hsdp<B>` (inference, no gradients) and
//! `Autodiff<Hsdp<B>>` (training).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use std::sync::Arc;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use burn_backend::distributed::DistributedParamId;
use burn_backend::tensor::FloatTensor;
use burn_backend::BackendTypes;

use crate::backend::Hsdp;
use crate::tensor::{HsdpFloat, LeafRearm};

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

    /// Whether `tensor`'s gradient reaches the runtime: it is marked with
    /// [`Self::mark_distributed`], or this backend computes no gradients.
    fn hands_gradient_over(tensor: &FloatTensor<Self>) -> bool;

    /// How to register the autodiff leaf `tensor` (a marked parameter) again after a backward
    /// consumed it: Burn drops a graph's nodes, leaves included, once backward has run through
    /// them, so without this a second backward over the same module (gradient accumulation)
    /// would never see the parameter. `None` for backends without autodiff.
    fn leaf_rearm(
        tensor: &FloatTensor<Self>,
        id: DistributedParamId,
    ) -> Option<LeafRearm<Self::Inner>>;
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

    fn hands_gradient_over(_tensor: &FloatTensor<Self>) -> bool {
        true
    }

    fn leaf_rearm(_tensor: &FloatTensor<Self>, _id: DistributedParamId) -> Option<LeafRearm<B>> {
        None
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

    fn hands_gradient_over(tensor: &FloatTensor<Self>) -> bool {
        <Self as AutodiffBackend>::is_distributed(tensor)
    }

    fn leaf_rearm(tensor: &FloatTensor<Self>, id: DistributedParamId) -> Option<LeafRearm<B>> {
        // The leaf's identity is its node and reference count; the primitive is handed in at
        // re-arm time, so the runtime holding this closure holds no handle to itself.
        let (node, rc) = (tensor.node.clone(), tensor.rc.clone());
        Some(Arc::new(move |primitive: HsdpFloat<B>| {
            let mut leaf = <Self as AutodiffBackend>::from_inner(primitive);
            leaf.node = node.clone();
            leaf.rc = rc.clone();
            // A new root step for the same node id: the next forward's ops find the leaf in a
            // graph again, exactly as after `require_grad` + `set_distributed`.
            let _ = leaf.grad_distributed(id);
        }))
    }
}
