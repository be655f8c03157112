//! The float primitive of `Hsdp<B>`: either a local tensor of `B` or a handle to a parameter
//! that lives in sharded bucket storage.
//!
//! A handle holds no data. An op that meets one asks the runtime for a view of the parameter in
//! its bucket's gathered buffer (gathering the bucket first if it is not resident), so autograd
//! can keep handles for backward without keeping gathered memory alive: backward re-gathers
//! what it needs.

use std::fmt;
use std::sync::Arc;

use burn_backend::{Backend, DType, Shape, TensorMetadata};

use burn_backend::distributed::DistributedParamId;

/// A float tensor of `Hsdp<B>`.
pub enum HsdpFloat<B: Backend> {
    /// An ordinary tensor of the inner backend (activations, gradients, anything computed).
    Local(B::FloatTensorPrimitive),
    /// A parameter in sharded bucket storage.
    Param(ParamHandle<B>),
}

/// Re-registers a parameter's current autodiff leaf for gradient hand-over (see
/// [`crate::ShardableBackend::leaf_rearm`]).
pub type LeafRearm<B> = Arc<dyn Fn(HsdpFloat<B>) + Send + Sync>;

/// What a parameter handle asks of the runtime that owns its parameter. The runtime
/// (`runtime/`) implements it; this layer, below the runtime, knows it only through this trait.
pub(crate) trait ParamOwner<B: Backend>: Send + Sync {
    /// Parameter `index` as a tensor of `B`: a view into its gathered bucket.
    fn view(&self, index: usize) -> B::FloatTensorPrimitive;
    /// Module path of parameter `index`.
    fn path(&self, index: usize) -> &str;
    /// The dtype parameters are viewed in.
    fn compute_dtype(&self) -> DType;
    /// The device parameters live on.
    fn device(&self) -> &B::Device;
    /// Parameter `index`'s id for Burn's gradient hand-over.
    fn id(&self, index: usize) -> DistributedParamId;
    /// Records how to re-register parameter `index`'s current autodiff leaf.
    fn set_leaf(&self, index: usize, rearm: Option<LeafRearm<B>>);
    /// A handle was made (counted while it lives: see `runtime/retention.rs`).
    fn handle_made(&self);
    /// A handle was dropped.
    fn handle_dropped(&self);
}

/// A parameter: its runtime and its index in the runtime's plan.
pub struct ParamHandle<B: Backend> {
    pub(crate) runtime: Arc<dyn ParamOwner<B>>,
    pub(crate) index: usize,
    pub(crate) shape: Shape,
}

impl<B: Backend> Clone for ParamHandle<B> {
    fn clone(&self) -> Self {
        Self::new(self.runtime.clone(), self.index, self.shape.clone())
    }
}

impl<B: Backend> Drop for ParamHandle<B> {
    fn drop(&mut self) {
        self.runtime.handle_dropped();
    }
}

impl<B: Backend> ParamHandle<B> {
    /// A handle to parameter `index` of `runtime` (counted while it lives: see
    /// `runtime::retention`).
    pub(crate) fn new(runtime: Arc<dyn ParamOwner<B>>, index: usize, shape: Shape) -> Self {
        runtime.handle_made();
        Self {
            runtime,
            index,
            shape,
        }
    }

    /// Module path of the parameter.
    pub fn path(&self) -> &str {
        self.runtime.path(self.index)
    }

    /// The parameter as a tensor of `B`: a view into its gathered bucket.
    pub fn resolve(&self) -> B::FloatTensorPrimitive {
        self.runtime.view(self.index)
    }
}

impl<B: Backend> HsdpFloat<B> {
    /// The inner backend's tensor (a view into the bucket for a parameter).
    pub fn resolve(self) -> B::FloatTensorPrimitive {
        match self {
            HsdpFloat::Local(t) => t,
            HsdpFloat::Param(h) => h.resolve(),
        }
    }

    /// The parameter handle, if this is one.
    pub fn param(&self) -> Option<&ParamHandle<B>> {
        match self {
            HsdpFloat::Param(h) => Some(h),
            HsdpFloat::Local(_) => None,
        }
    }
}

impl<B: Backend> Clone for HsdpFloat<B> {
    fn clone(&self) -> Self {
        match self {
            HsdpFloat::Local(t) => HsdpFloat::Local(t.clone()),
            HsdpFloat::Param(h) => HsdpFloat::Param(h.clone()),
        }
    }
}

impl<B: Backend> fmt::Debug for HsdpFloat<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HsdpFloat::Local(t) => f.debug_tuple("Local").field(t).finish(),
            HsdpFloat::Param(h) => f
                .debug_struct("Param")
                .field("path", &h.path())
                .field("shape", &h.shape)
                .finish(),
        }
    }
}

impl<B: Backend> TensorMetadata for HsdpFloat<B> {
    fn dtype(&self) -> DType {
        match self {
            HsdpFloat::Local(t) => t.dtype(),
            // Parameters are viewed in the mixed-precision policy's compute dtype.
            HsdpFloat::Param(h) => h.runtime.compute_dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            HsdpFloat::Local(t) => t.shape(),
            HsdpFloat::Param(h) => h.shape.clone(),
        }
    }
}
