//! The ops traits of `Hsdp<B>`: generated forwarding to `B` (one file per Burn ops trait, as
//! burn-autodiff lays them out), the conversions it uses, and the few hand-written overrides.
//!
//! Regenerate with `python3 crates/sshsdp-backend/gen/forwarding.py` after a Burn upgrade.

mod activation;
mod bool;
mod float;
mod int;
mod module;
mod overrides;
mod qtensor;
mod transaction;

/// Everything the generated files refer to.
pub(crate) mod prelude {
    pub use super::convert::*;
    pub use crate::backend::Hsdp;
    pub use burn_backend::ops::*;
    pub use burn_backend::quantization::*;
    pub use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor, QuantizedTensor};
    pub use burn_backend::{
        Backend, BoolDType, Distribution, ExecutionError, FloatDType, IntDType, Scalar, Shape,
        Slice, TensorData, TensorPrimitive,
    };
    pub use core::future::Future;
    pub use std::ops::Range;
}

/// Conversions between `Hsdp<B>`'s primitives and `B`'s.
pub(crate) mod convert {
    use burn_backend::ops::{DeformConv2dBackward, TransactionPrimitive};
    use burn_backend::quantization::QuantizationParametersPrimitive;
    use burn_backend::{Backend, TensorPrimitive};

    use crate::backend::Hsdp;
    use crate::tensor::HsdpFloat;

    /// An argument: a parameter handle becomes a view of its gathered bucket.
    pub fn float_in<B: Backend>(t: HsdpFloat<B>) -> B::FloatTensorPrimitive {
        t.resolve()
    }

    /// A result: always a local tensor.
    pub fn float_out<B: Backend>(t: B::FloatTensorPrimitive) -> HsdpFloat<B> {
        HsdpFloat::Local(t)
    }

    pub fn primitive_in<B: Backend>(t: TensorPrimitive<Hsdp<B>>) -> TensorPrimitive<B> {
        match t {
            TensorPrimitive::Float(f) => TensorPrimitive::Float(float_in(f)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }

    pub fn primitive_out<B: Backend>(t: TensorPrimitive<B>) -> TensorPrimitive<Hsdp<B>> {
        match t {
            TensorPrimitive::Float(f) => TensorPrimitive::Float(float_out(f)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }

    pub fn qparams_in<B: Backend>(
        p: QuantizationParametersPrimitive<Hsdp<B>>,
    ) -> QuantizationParametersPrimitive<B> {
        QuantizationParametersPrimitive {
            scales: float_in(p.scales),
        }
    }

    pub fn transaction_in<B: Backend>(t: TransactionPrimitive<Hsdp<B>>) -> TransactionPrimitive<B> {
        TransactionPrimitive::new(
            t.read_floats.into_iter().map(float_in).collect(),
            t.read_qfloats,
            t.read_ints,
            t.read_bools,
        )
    }

    pub fn deform_conv2d_backward_out<B: Backend>(
        r: DeformConv2dBackward<B>,
    ) -> DeformConv2dBackward<Hsdp<B>> {
        DeformConv2dBackward {
            x_grad: float_out(r.x_grad),
            offset_grad: float_out(r.offset_grad),
            weight_grad: float_out(r.weight_grad),
            mask_grad: r.mask_grad.map(float_out),
            bias_grad: r.bias_grad.map(float_out),
        }
    }
}
