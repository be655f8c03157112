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

/// Walks module paths as a visitor or mapper enters and leaves modules, with the container
/// description of each level (Burn's `Struct:Embedding` for a field of an `Embedding`).
#[derive(Default)]
struct PathTracker {
    stack: Vec<String>,
    containers: Vec<String>,
}

impl PathTracker {
    fn enter(&mut self, name: &str, container: &str) {
        self.stack.push(name.to_string());
        self.containers.push(container.to_string());
    }

    fn exit(&mut self) {
        self.stack.pop();
        self.containers.pop();
    }

    /// The description of the module holding the current tensor (`""` at the root).
    fn container(&self) -> &str {
        self.containers.last().map_or("", String::as_str)
    }

    fn path(&self) -> String {
        self.stack.join(".")
    }
}

/// What a visit does at each float tensor (parameter or buffer), given its path.
pub(crate) trait VisitAt<B: Backend> {
    /// Visits `param` at `path`.
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>);

    /// Visits `param` at `path`, held by a module Burn describes as `container`
    /// (`Struct:Embedding`); by default as [`VisitAt::visit_float_at`].
    fn visit_float_in<const D: usize>(
        &mut self,
        path: &str,
        container: &str,
        param: &Param<Tensor<B, D>>,
    ) {
        let _ = container;
        self.visit_float_at(path, param);
    }
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
    fn enter_module(&mut self, name: &str, container: &str) {
        self.paths.enter(name, container);
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.paths.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.paths.path();
        self.walker
            .visit_float_in(&path, self.paths.container(), param);
    }
}

impl<B: Backend, W: MapAt<B>> ModuleMapper<B> for Pathed<'_, W> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.paths.enter(name, container);
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
