//! The runtime's side of parameter handles: their ids for Burn's gradient hand-over, the
//! autodiff leaves re-armed after each backward, the count of live handles (retention), and
//! [`ParamOwner`], through which the tensor layer reaches the runtime.

use std::sync::Arc;

use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, Shape};

use super::Runtime;
use crate::tensor::{HsdpFloat, LeafRearm, ParamHandle, ParamOwner};

impl<B: Backend> Runtime<B> {
    /// Records the gradient-routing ids of the parameters (by plan index), once.
    pub(crate) fn set_ids(&self, ids: Vec<DistributedParamId>) {
        let _ = self.ids.set(ids);
    }

    /// The gradient-routing id of parameter `index`.
    pub(crate) fn id(&self, index: usize) -> DistributedParamId {
        self.ids.get().expect("ids are set at registration")[index]
    }

    /// Records how to re-register parameter `index`'s current autodiff leaf.
    pub(crate) fn set_leaf(&self, index: usize, rearm: Option<LeafRearm<B>>) {
        self.leaves.lock().unwrap_or_else(|p| p.into_inner())[index] = rearm;
    }

    /// After a backward that consumed the leaves of parameters `indices` (Burn removes a
    /// graph's nodes, leaves included, once it has run backward through them): registers each
    /// leaf again, so the module's parameters take part in the next backward as they are — a
    /// second micro-batch of gradient accumulation routes its gradients like the first.
    /// Called on the backward's thread after Burn released its graph locks.
    pub(crate) fn rearm_leaves(self: &Arc<Self>, indices: &[usize]) {
        let rearms: Vec<(usize, LeafRearm<B>)> = {
            let leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
            indices
                .iter()
                .filter_map(|&i| leaves[i].clone().map(|r| (i, r)))
                .collect()
        };
        for (index, rearm) in rearms {
            let p = &self.plan.params()[index];
            rearm(HsdpFloat::Param(ParamHandle::new(
                self.clone(),
                index,
                Shape::from(p.spec.shape.clone()),
            )));
        }
    }

    /// A [`ParamHandle`] to one of this runtime's parameters was made.
    pub(crate) fn handle_made(&self) {
        self.retention.acquire();
    }

    /// A [`ParamHandle`] was dropped.
    pub(crate) fn handle_dropped(&self) {
        self.retention.release();
    }

    /// Handles to this runtime's parameters alive now: the module's own, plus those autodiff
    /// graphs saved for backward. Forward passes without backward grow it (see
    /// [`Runtime::forwards_without_backward_warned`]).
    pub fn live_param_handles(&self) -> u64 {
        self.retention.live()
    }

    /// Whether the runtime warned that forward passes without backward are keeping autodiff
    /// graphs alive (more live parameter handles than 16 steps' worth, or 64 per parameter
    /// before the first backward).
    pub fn forwards_without_backward_warned(&self) -> bool {
        self.retention.warned()
    }
}

impl<B: Backend> ParamOwner<B> for Runtime<B> {
    fn view(&self, index: usize) -> B::FloatTensorPrimitive {
        Runtime::view(self, index)
    }

    fn path(&self, index: usize) -> &str {
        &self.plan.params()[index].spec.path
    }

    fn compute_dtype(&self) -> burn_backend::DType {
        self.compute_precision().dtype().into()
    }

    fn device(&self) -> &B::Device {
        Runtime::device(self)
    }

    fn id(&self, index: usize) -> DistributedParamId {
        Runtime::id(self, index)
    }

    fn set_leaf(&self, index: usize, rearm: Option<LeafRearm<B>>) {
        Runtime::set_leaf(self, index, rearm)
    }

    fn handle_made(&self) {
        Runtime::handle_made(self)
    }

    fn handle_dropped(&self) {
        Runtime::handle_dropped(self)
    }
}
