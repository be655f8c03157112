//! Module paths: the names of the modules a visitor or mapper has entered, joined by dots
//! (`blocks.0.attn.query.weight`), the key every rank plans, checkpoints and exports by.
//! [`visit_at`] and [`map_at`] walk a module's float tensors with their paths, so a walker
//! states only what it does at each one.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// A float parameter of a module, keyed by its path.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedParam {
    /// Module path, e.g. `blocks.0.attn.query.weight`.
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, row-major, as f32.
    pub values: Vec<f32>,
}

/// Walks module paths as a visitor or mapper enters and leaves modules.
#[derive(Default)]
struct PathTracker {
    stack: Vec<String>,
}

impl PathTracker {
    fn enter(&mut self, name: &str) {
        self.stack.push(name.to_string());
    }

    fn exit(&mut self) {
        self.stack.pop();
    }

    fn path(&self) -> String {
        self.stack.join(".")
    }
}

/// What a visit does at each float tensor (parameter or buffer), given its path.
pub(crate) trait VisitAt<B: Backend> {
    /// Visits `param` at `path`.
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>);
}

/// What a map does at each float tensor (parameter or buffer), given its path.
pub(crate) trait MapAt<B: Backend> {
    /// Maps `param` at `path`.
    fn map_float_at<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>>;
}

/// A [`VisitAt`] or [`MapAt`] with the path tracked for it.
struct Pathed<'a, W> {
    paths: PathTracker,
    walker: &'a mut W,
}

impl<B: Backend, W: VisitAt<B>> ModuleVisitor<B> for Pathed<'_, W> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.paths.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.paths.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.walker.visit_float_at(&self.paths.path(), param);
    }
}

impl<B: Backend, W: MapAt<B>> ModuleMapper<B> for Pathed<'_, W> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.paths.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.paths.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        self.walker.map_float_at(&self.paths.path(), param)
    }
}

/// Visits every float tensor of `module`, in module order, with its path.
pub(crate) fn visit_at<B: Backend, M: Module<B>>(module: &M, walker: &mut impl VisitAt<B>) {
    module.visit(&mut Pathed {
        paths: PathTracker::default(),
        walker,
    });
}

/// Maps every float tensor of `module`, in module order, with its path.
pub(crate) fn map_at<B: Backend, M: Module<B>>(module: M, walker: &mut impl MapAt<B>) -> M {
    module.map(&mut Pathed {
        paths: PathTracker::default(),
        walker,
    })
}
