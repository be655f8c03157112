//! Reading a module's parameters without changing it: their paths, shapes and frozen flags
//! (lazy parameters are not drawn), and their values bucket by bucket.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use sshsdp_plan::{module_type, DType, ParamSpec, RoleRule};

use super::buffers::{buffer_specs, BufferSpec};
use super::paths::{visit_at, NamedParam, VisitAt};
use crate::error::HsdpError;

/// Collects each float parameter's path, shape and values, in module order.
struct Collector {
    params: Vec<NamedParam>,
    error: Option<String>,
}

impl<B: burn::tensor::backend::Backend> VisitAt<B> for Collector {
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        match tensor.into_data().convert::<f32>().into_vec::<f32>() {
            Ok(values) => self.params.push(NamedParam {
                path: path.to_string(),
                shape,
                values,
            }),
            Err(e) => {
                self.error.get_or_insert(format!("reading {path}: {e:?}"));
            }
        }
    }
}

/// Every float parameter of `module`, in module order, keyed by the paths [`crate::shard()`] plans by.
/// Useful to compare or export weights.
pub fn named_params<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
) -> Result<Vec<NamedParam>, HsdpError> {
    let mut collector = Collector {
        params: Vec::new(),
        error: None,
    };
    visit_at(module, &mut collector);
    match collector.error {
        Some(e) => Err(HsdpError::Unsupported(e)),
        None => Ok(collector.params),
    }
}

/// Collects each float parameter's path and shape (in module order) without initialising it.
struct ShapeCollector {
    specs: Vec<ParamSpec>,
}

impl<B: burn::tensor::backend::Backend> VisitAt<B> for ShapeCollector {
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
        self.visit_float_in(path, "", param);
    }

    /// The role from the module's type first (a burn-nn `Embedding`'s table is element-wise
    /// whatever it is called), its path second ([`RoleRule::role_in`]).
    fn visit_float_in<const D: usize>(
        &mut self,
        path: &str,
        container: &str,
        param: &Param<Tensor<B, D>>,
    ) {
        let order = self.specs.len() as u64;
        let shape = param.lazy_shape().to_vec();
        let role = RoleRule::default().role_in(path, &shape, module_type(container));
        self.specs.push(
            ParamSpec::new(path, shape, DType::F32)
                .with_role(role)
                .with_order(order)
                .with_frozen(is_frozen(param)),
        );
    }
}

/// Whether `param` is frozen (`require_grad` false on a backend that computes gradients), read
/// without initialising a lazy parameter (on a clone: the parameter itself is untouched).
fn is_frozen<B: burn::tensor::backend::Backend, const D: usize>(
    param: &Param<Tensor<B, D>>,
) -> bool {
    B::ad_enabled(&param.lazy_device()) && !without_drawing(param.clone()).is_require_grad()
}

/// `param` initialised: as it is if it is, else with a [`placeholder`] through Burn's load
/// path, which gives it its gradient setting without running its initialiser.
pub(crate) fn without_drawing<B: burn::tensor::backend::Backend, const D: usize>(
    param: Param<Tensor<B, D>>,
) -> Param<Tensor<B, D>> {
    if param.is_initialized() {
        return param;
    }
    let (id, device) = (param.id, param.lazy_device());
    param.transform_for_load(placeholder::<B, D>(&device, false), id)
}

/// A one-element stand-in for a parameter's value: what a parameter holds between the moment
/// its value is read into a bucket and the moment it becomes a handle into the runtime.
pub(crate) fn placeholder<B: burn::tensor::backend::Backend, const D: usize>(
    device: &B::Device,
    require_grad: bool,
) -> Tensor<B, D> {
    Tensor::<B, D>::zeros([1; D], device).set_require_grad(require_grad)
}

/// Every float parameter's module path and shape, in module order, without initialising any
/// (Burn's lazy parameters report their shapes): what [`crate::shard`] plans from. Module buffers
/// (BatchNorm's running statistics) are not parameters and are left out.
pub fn param_shapes<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
) -> Vec<(String, Vec<usize>)> {
    param_specs(module, &buffer_specs(module))
        .into_iter()
        .map(|s| (s.path, s.shape))
        .collect()
}

/// Every float parameter's module path and optimizer role as [`crate::shard`] plans it (the
/// holding module's type first, the path second: `RoleRule::role_in`), in module order, without
/// initialising any: which parameters Muon steps and which go to the element-wise optimizer.
pub fn param_roles<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
) -> Vec<(String, sshsdp_plan::Role)> {
    param_specs(module, &buffer_specs(module))
        .into_iter()
        .map(|s| (s.path, s.role))
        .collect()
}

/// Every float parameter's spec (path, lazy shape, module order; buffers left out, see
/// `model/buffers.rs`), without initialising any.
pub(crate) fn param_specs<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
    buffers: &[BufferSpec],
) -> Vec<ParamSpec> {
    let mut shapes = ShapeCollector { specs: Vec::new() };
    visit_at(module, &mut shapes);
    let mut specs = shapes.specs;
    specs.retain(|s| !buffers.iter().any(|b| b.path == s.path));
    for (order, spec) in specs.iter_mut().enumerate() {
        spec.order = Some(order as u64);
    }
    specs
}
