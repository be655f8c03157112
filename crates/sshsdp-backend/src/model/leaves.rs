//! The autodiff leaves of parameter handles: a parameter that requires a gradient is a leaf
//! marked with its runtime id, so that autodiff hands its final gradient to the runtime, and
//! registered with the runtime, so that the leaf is armed again after each backward.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorPrimitive};

use super::paths::{visit_at, VisitAt};
use crate::backend_ext::ShardableBackend;
use crate::error::HsdpError;
use crate::tensor::HsdpFloat;

/// A fresh autodiff leaf around `primitive`; a parameter handle that requires a gradient is
/// marked so its gradient reaches the runtime.
pub(crate) fn leaf<B: ShardableBackend, const D: usize>(
    primitive: HsdpFloat<B::Inner>,
    require_grad: bool,
) -> Tensor<B, D> {
    let id = primitive.param().map(|h| h.runtime.id(h.index));
    let handle = primitive.param().cloned();
    let tensor = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(B::from_hsdp(primitive)));
    match (require_grad, id, handle) {
        (true, Some(id), Some(handle)) => {
            let tensor = B::mark_distributed(tensor.require_grad(), id);
            let rearm = match tensor.clone().into_primitive() {
                TensorPrimitive::Float(leaf) => B::leaf_rearm(&leaf, id),
                TensorPrimitive::QFloat(_) => None,
            };
            handle.runtime.set_leaf(handle.index, rearm);
            tensor
        }
        (true, _, _) => tensor.require_grad(),
        (false, _, _) => tensor,
    }
}

/// Gives every parameter a fresh autodiff leaf around the same storage.
///
/// Not needed in a training loop: Burn's autodiff consumes a graph's nodes, leaves included,
/// in backward, and the runtime registers the consumed parameter leaves again at the end of
/// every backward (see [`crate::ShardableBackend::leaf_rearm`]), so a module runs any number of
/// forward/backward passes — gradient accumulation included — as it is. Needed after making a
/// parameter trainable after `shard` (unfreezing it): its new leaf is registered with the
/// runtime only here ([`check_gradient_leaves`] finds one that is not).
pub fn refresh_leaves<B: ShardableBackend, M: Module<B>>(module: M) -> M {
    struct Refresher;
    impl<B: ShardableBackend> ModuleMapper<B> for Refresher {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            let primitive = B::to_hsdp(tensor.into_primitive().tensor());
            Param::from_mapped_value(id, leaf::<B, D>(primitive, require_grad), mapper)
        }
    }
    module.map(&mut Refresher)
}

/// Checks that every parameter of `module` that requires a gradient hands it to the runtime:
/// one made trainable after `shard` (unfrozen: `set_require_grad(true)` on a parameter that was
/// frozen at `shard`) has a new autodiff leaf the runtime never registered, so its gradients
/// would never be reduced nor stepped. The error names it and the fix ([`refresh_leaves`]).
/// Local; the sharded optimizers call it at every step. (Freezing after `shard` needs nothing:
/// the parameter simply receives no gradient.)
pub fn check_gradient_leaves<B: ShardableBackend, M: Module<B>>(
    module: &M,
) -> Result<(), HsdpError> {
    struct Checker {
        unregistered: Option<String>,
    }
    impl<B: ShardableBackend> VisitAt<B> for Checker {
        fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            let tensor = param.val();
            if self.unregistered.is_some() || !tensor.is_require_grad() {
                return;
            }
            let primitive = tensor.into_primitive().tensor();
            if B::hands_gradient_over(&primitive) {
                return;
            }
            if let HsdpFloat::Param(_) = B::to_hsdp(primitive) {
                self.unregistered = Some(path.to_string());
            }
        }
    }
    let mut checker = Checker { unregistered: None };
    visit_at(module, &mut checker);
    match checker.unregistered {
        None => Ok(()),
        Some(path) => Err(HsdpError::Unsupported(format!(
            "parameter `{path}` requires a gradient but its autodiff leaf is not registered \
             with the runtime (made trainable after `shard`?), so its gradients were never \
             reduced and it was not stepped: call `model = refresh_leaves(model)` after \
             changing `require_grad`"
        ))),
    }
}
