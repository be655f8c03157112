//! Float ops written by hand: they look at a parameter without gathering it. The generated
//! `float.rs` forwards these methods here (see `OVERRIDES` in `gen/forwarding.py`).

use burn_backend::tensor::Device;
use burn_backend::Backend;

use crate::tensor::HsdpFloat;

/// The device of a tensor; a parameter's is its runtime's.
pub fn float_device<B: Backend>(tensor: &HsdpFloat<B>) -> Device<B> {
    match tensor {
        HsdpFloat::Local(t) => B::float_device(t),
        HsdpFloat::Param(h) => h.runtime.device().clone(),
    }
}

/// Whether a tensor requires a gradient at this level (autodiff tracks parameters above it).
pub fn float_is_require_grad<B: Backend>(tensor: &HsdpFloat<B>) -> bool {
    match tensor {
        HsdpFloat::Local(t) => B::float_is_require_grad(t),
        HsdpFloat::Param(_) => false,
    }
}

/// Sets the gradient flag; a parameter handle stays a handle.
pub fn float_set_require_grad<B: Backend>(
    tensor: HsdpFloat<B>,
    require_grad: bool,
) -> HsdpFloat<B> {
    match tensor {
        HsdpFloat::Local(t) => HsdpFloat::Local(B::float_set_require_grad(t, require_grad)),
        param => param,
    }
}

/// Detaches a tensor; a parameter handle stays a handle.
pub fn float_detach<B: Backend>(tensor: HsdpFloat<B>) -> HsdpFloat<B> {
    match tensor {
        HsdpFloat::Local(t) => HsdpFloat::Local(B::float_detach(t)),
        param => param,
    }
}
