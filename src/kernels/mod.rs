//! The fused activation ops the example models call: GELU and the softmax over the last
//! dimension, each with its own backward, as a Burn backend extension ([`FusedOps`]).
//!
//! Burn's autodiff records softmax as five ops (max, sub, exp, sum, div) and differentiates
//! each; burn-flex computes GELU with a scalar libm `erff` per element, forward and backward.
//! On burn-flex these were about a quarter of `train_gpt`'s step (docs/BENCHMARKS.md). Here a
//! backend with its own kernels ([`FusedOps::FUSED`]: burn-flex, through `Hsdp<Flex>` and
//! `Autodiff<…>`) runs one vectorised pass for each forward and each backward
//! ([`host`]); every other backend records exactly Burn's own ops, so its numerics do not
//! change.
//!
//! Use [`gelu`] and [`softmax`] in a model generic over `B: FusedOps`; every backend this
//! workspace trains on implements it.

pub mod host;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};
use burn_flex::{Flex, FlexTensor, Layout};
use sshsdp_backend::{Hsdp, HsdpFloat};

/// GELU and the last-dimension softmax with their backwards, as ops of the backend.
///
/// The defaults are Burn's own ops; a backend with faster kernels overrides them and sets
/// [`FusedOps::FUSED`], which makes `Autodiff` record one node per op (differentiated by the
/// `*_backward` methods) instead of Burn's composite.
pub trait FusedOps: Backend {
    /// Whether this backend has its own kernels for these ops (then `Autodiff` records them as
    /// single nodes); `false` keeps Burn's ops and their gradients exactly.
    const FUSED: bool = false;

    /// GELU (exact, erf form).
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::gelu(x)
    }

    /// `grad · gelu'(x)`.
    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::gelu_backward(x, grad)
    }

    /// Softmax over the last dimension.
    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let last = x.shape().num_dims() - 1;
        <Self as ActivationOps<Self>>::softmax(x, last)
    }

    /// The softmax's input gradient from its output `y` and output gradient `grad`:
    /// `y · (grad − Σ_last grad·y)`.
    fn fused_softmax_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        softmax_backward_composite::<Self>(y, grad)
    }
}

/// [`FusedOps::fused_softmax_backward`] from `B`'s element-wise ops and a sum.
fn softmax_backward_composite<B: Backend>(
    y: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let last = y.shape().num_dims() - 1;
    let weighted = B::float_mul(grad, y.clone());
    let total = B::float_sum_dim(weighted.clone(), last);
    B::float_sub(weighted, B::float_mul(y, total))
}

/// GELU of `x` through the backend's [`FusedOps`].
pub fn gelu<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_gelu(
        x.into_primitive().tensor(),
    )))
}

/// Softmax of `x` over its last dimension through the backend's [`FusedOps`].
pub fn softmax<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_softmax(
        x.into_primitive().tensor(),
    )))
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    const FUSED: bool = B::FUSED;

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if !B::FUSED {
            return Self::gelu(x);
        }

        /// Backward of the fused GELU: keeps the input.
        #[derive(Debug)]
        struct GeluBackward;

        impl<B: FusedOps> Backward<B, 1> for GeluBackward {
            type State = NodeId;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state);
                if let Some(parent) = parent {
                    grads.register::<B>(parent.id, B::fused_gelu_backward(x, grad));
                }
            }
        }

        match GeluBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, B::fused_gelu(x.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_gelu(x.primitive)),
        }
    }

    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if !B::FUSED {
            let last = x.shape().num_dims() - 1;
            return <Self as ActivationOps<Self>>::softmax(x, last);
        }

        /// Backward of the fused softmax: keeps the output.
        #[derive(Debug)]
        struct SoftmaxBackward;

        impl<B: FusedOps> Backward<B, 1> for SoftmaxBackward {
            type State = FloatTensor<B>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                if let Some(parent) = parent {
                    grads.register::<B>(parent.id, B::fused_softmax_backward(ops.state, grad));
                }
            }
        }

        match SoftmaxBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::fused_softmax(x.primitive);
                prep.finish(y.clone(), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_softmax(x.primitive)),
        }
    }
}

/// `Hsdp<B>` runs `B`'s kernels (a parameter resolves to its view first).
impl<B: FusedOps> FusedOps for Hsdp<B> {
    const FUSED: bool = B::FUSED;

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        HsdpFloat::Local(B::fused_gelu(x.resolve()))
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        HsdpFloat::Local(B::fused_gelu_backward(x.resolve(), grad.resolve()))
    }

    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        HsdpFloat::Local(B::fused_softmax(x.resolve()))
    }

    fn fused_softmax_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        HsdpFloat::Local(B::fused_softmax_backward(y.resolve(), grad.resolve()))
    }
}

/// burn-flex: the [`host`] kernels for f32 tensors; Flex's own ops for other dtypes.
impl FusedOps for Flex {
    const FUSED: bool = true;

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            return Self::gelu(x);
        }
        let x = contiguous(x);
        map_f32(&x, host::gelu)
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 || grad.dtype() != DType::F32 || x.shape() != grad.shape() {
            return Self::gelu_backward(x, grad);
        }
        let (x, grad) = (contiguous(x), contiguous(grad));
        let grad = f32s(&grad);
        map_f32(&x, |x, out| host::gelu_backward(x, grad, out))
    }

    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let row = last_dim(&x);
        if x.dtype() != DType::F32 || row == 0 {
            let last = x.shape().num_dims() - 1;
            return <Self as ActivationOps<Self>>::softmax(x, last);
        }
        let x = contiguous(x);
        map_f32(&x, |x, out| host::softmax_rows(x, row, out))
    }

    fn fused_softmax_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let row = last_dim(&y);
        if y.dtype() != DType::F32 || grad.dtype() != DType::F32 || y.shape() != grad.shape() {
            return softmax_backward_composite::<Self>(y, grad);
        }
        if row == 0 {
            return y;
        }
        let (y, grad) = (contiguous(y), contiguous(grad));
        let grad = f32s(&grad);
        map_f32(&y, |y, out| host::softmax_rows_backward(y, grad, row, out))
    }
}

/// Length of the last dimension (0 for a rank-0 tensor).
fn last_dim(x: &FlexTensor) -> usize {
    x.shape().last().copied().unwrap_or(0)
}

/// `x`, made contiguous if it is a strided view.
fn contiguous(x: FlexTensor) -> FlexTensor {
    if x.as_slice::<f32>().is_some() {
        x
    } else {
        x.to_contiguous()
    }
}

/// The elements of a contiguous f32 tensor.
fn f32s(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>()
        .expect("made contiguous f32 by the caller")
}

/// A new f32 tensor of `x`'s shape whose elements `kernel` writes from `x`'s.
fn map_f32(x: &FlexTensor, kernel: impl FnOnce(&[f32], &mut [f32])) -> FlexTensor {
    let input = f32s(x);
    let mut out = vec![0.0f32; input.len()];
    kernel(input, &mut out);
    FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        Layout::contiguous(x.shape()),
        DType::F32,
    )
}

/// NdArray: Burn's ops (the workspace's test backend; its numerics are the reference).
impl FusedOps for burn::backend::NdArray {}

/// burn-wgpu's `Wgpu` (Burn's default features: fusion and autotune): Burn's ops, which fusion
/// merges.
#[cfg(feature = "wgpu")]
impl FusedOps for burn_wgpu::Wgpu {}

/// CubeCL's wgpu runtime without fusion (`--no-fusion`): Burn's ops.
#[cfg(feature = "wgpu")]
impl<F: burn_wgpu::FloatElement, I: burn_wgpu::IntElement, BT: burn_wgpu::BoolElement> FusedOps
    for burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, F, I, BT>
{
}

/// burn-cuda's `Cuda` (Burn's default features: fusion and autotune): Burn's ops.
#[cfg(feature = "cuda")]
impl FusedOps for burn_cuda::Cuda {}

/// CubeCL's CUDA runtime without fusion (`--no-fusion`): Burn's ops.
#[cfg(feature = "cuda")]
impl<F: burn_cubecl::FloatElement, I: burn_cubecl::IntElement, BT: burn_cubecl::BoolElement>
    FusedOps for burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, I, BT>
{
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::activation;
    use burn::tensor::Distribution;

    /// `Autodiff<Hsdp<B>>`: with this workspace's `distributed` feature of burn, Autodiff
    /// differentiates only distributed backends.
    type Ad<B> = Autodiff<Hsdp<B>>;

    /// `(f(x), d Σ f(x)·w / dx)` on `Autodiff<Hsdp<B>>`, `x` `[2, 3, 4, 37]` (a transposed view when `strided`).
    fn value_and_grad<B: FusedOps<FloatElem = f32>>(
        x: &Tensor<NdArray, 4>,
        w: &Tensor<NdArray, 4>,
        strided: bool,
        f: impl Fn(Tensor<Ad<B>, 4>) -> Tensor<Ad<B>, 4>,
    ) -> (Vec<f32>, Vec<f32>) {
        let device = Default::default();
        // Strided: the leaf is stored transposed and the op sees a transposed view of it.
        let leaf = if strided {
            x.clone().swap_dims(2, 3)
        } else {
            x.clone()
        };
        let x = Tensor::<Ad<B>, 4>::from_data(leaf.to_data(), &device).require_grad();
        let w = Tensor::<Ad<B>, 4>::from_data(w.to_data(), &device);
        let input = if strided {
            x.clone().swap_dims(2, 3)
        } else {
            x.clone()
        };
        let y = f(input);
        let grads = (y.clone() * w).sum().backward();
        let dx = x.grad(&grads).expect("x has a gradient");
        (
            y.into_data().to_vec().unwrap(),
            dx.into_data().to_vec().unwrap(),
        )
    }

    fn inputs() -> (Tensor<NdArray, 4>, Tensor<NdArray, 4>) {
        let device = Default::default();
        let shape = [2, 3, 4, 37];
        // Through the process's RNG lock, as every draw beside seeded tests must be.
        let (x, w) = sshsdp_backend::with_burn_rng(|| {
            let normal =
                |std| Tensor::<NdArray, 4>::random(shape, Distribution::Normal(0.0, std), &device);
            (normal(3.0), normal(1.0))
        });
        // Masked scores, as the causal bias makes them.
        let x = x.clone().mask_fill(x.clone().greater_elem(4.0), -1e4);
        (x, w)
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let tol = 2e-6 * (1.0 + w.abs());
            assert!((g - w).abs() <= tol, "{what}[{i}]: {g} vs Burn's {w}");
        }
    }

    #[test]
    fn flex_fused_ops_match_burns_ops_forward_and_backward() {
        let (x, w) = inputs();
        for strided in [false, true] {
            let fused = value_and_grad::<Flex>(&x, &w, strided, gelu);
            let burn = value_and_grad::<Flex>(&x, &w, strided, activation::gelu);
            assert_close(&fused.0, &burn.0, "gelu");
            assert_close(&fused.1, &burn.1, "gelu'");

            let fused = value_and_grad::<Flex>(&x, &w, strided, softmax);
            let burn = value_and_grad::<Flex>(&x, &w, strided, |x| activation::softmax(x, 3));
            assert_close(&fused.0, &burn.0, "softmax");
            assert_close(&fused.1, &burn.1, "softmax'");
        }
    }

    #[test]
    fn backends_without_kernels_record_burns_ops_bit_for_bit() {
        const { assert!(!<Ad<NdArray> as FusedOps>::FUSED) };
        const { assert!(<Ad<Hsdp<Flex>> as FusedOps>::FUSED) };
        let (x, w) = inputs();
        assert_eq!(
            value_and_grad::<NdArray>(&x, &w, false, gelu),
            value_and_grad::<NdArray>(&x, &w, false, activation::gelu)
        );
        assert_eq!(
            value_and_grad::<NdArray>(&x, &w, false, softmax),
            value_and_grad::<NdArray>(&x, &w, false, |x| activation::softmax(x, 3))
        );
    }

    #[test]
    fn the_decorator_runs_the_inner_kernels() {
        let (x, g) = inputs();
        let device = Default::default();
        let flex = |t: &Tensor<NdArray, 4>| Tensor::<Flex, 4>::from_data(t.to_data(), &device);
        let hsdp =
            |t: &Tensor<NdArray, 4>| Tensor::<Hsdp<Flex>, 4>::from_data(t.to_data(), &device);
        let prim_f = |t: &Tensor<NdArray, 4>| flex(t).into_primitive().tensor();
        let prim_h = |t: &Tensor<NdArray, 4>| hsdp(t).into_primitive().tensor();
        let out_f = |p: FloatTensor<Flex>| {
            Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(p)).into_data()
        };
        let out_h = |p: FloatTensor<Hsdp<Flex>>| {
            Tensor::<Hsdp<Flex>, 4>::from_primitive(TensorPrimitive::Float(p)).into_data()
        };
        assert_eq!(
            out_h(Hsdp::<Flex>::fused_gelu(prim_h(&x))),
            out_f(Flex::fused_gelu(prim_f(&x)))
        );
        assert_eq!(
            out_h(Hsdp::<Flex>::fused_gelu_backward(prim_h(&x), prim_h(&g))),
            out_f(Flex::fused_gelu_backward(prim_f(&x), prim_f(&g)))
        );
        assert_eq!(
            out_h(Hsdp::<Flex>::fused_softmax(prim_h(&x))),
            out_f(Flex::fused_softmax(prim_f(&x)))
        );
        assert_eq!(
            out_h(Hsdp::<Flex>::fused_softmax_backward(prim_h(&x), prim_h(&g))),
            out_f(Flex::fused_softmax_backward(prim_f(&x), prim_f(&g)))
        );
    }

    #[test]
    fn other_dtypes_fall_back_to_flexs_own_ops() {
        let device = Default::default();
        let x = sshsdp_backend::with_burn_rng(|| {
            Tensor::<Flex, 2>::random([4, 33], Distribution::Normal(0.0, 2.0), &device)
        })
        .cast(DType::BF16);
        let same = |a: Tensor<Flex, 2>, b: Tensor<Flex, 2>| {
            assert_eq!(a.dtype(), DType::BF16);
            assert_eq!(a.into_data(), b.into_data());
        };
        same(gelu(x.clone()), activation::gelu(x.clone()));
        same(softmax(x.clone()), activation::softmax(x, 1));
    }
}
