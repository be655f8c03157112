//! [`MuonWithElementwise`]: single-device Muon for matrices and an element-wise Burn optimizer
//! (AdamW by default) for the rest of an ordinary Burn module — the parameter groups Muon is
//! used with, and the reference the sharded driver ([`crate::ShardedMuon`]) must equal.
//!
//! Parameters are routed by the planner's [`RoleRule`], as registration routes them: 2-D
//! parameters are matrices unless the module holding them is an element-wise type (a burn-nn
//! `Embedding`, whatever it is called) or their path names an embedding or an output head; 1-D
//! parameters are element-wise.

use std::collections::HashMap;

use crate::GradClip;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, SimpleOptimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use sshsdp_plan::{module_type, Role, RoleRule};

use crate::{Muon, MuonState};

/// Muon on matrices, `O` on everything else, for a module on one device.
pub struct MuonWithElementwise<B: AutodiffBackend, O: SimpleOptimizer<B::InnerBackend>> {
    muon: Muon,
    elementwise: O,
    rule: RoleRule,
    muon_states: HashMap<ParamId, MuonState<B::InnerBackend, 2>>,
    states: HashMap<ParamId, O::State<1>>,
    clip: GradClip,
}

impl<B: AutodiffBackend, O: SimpleOptimizer<B::InnerBackend>> MuonWithElementwise<B, O> {
    /// Routes parameters with [`RoleRule::default`].
    pub fn new(muon: Muon, elementwise: O) -> Self {
        Self::with_rule(muon, elementwise, RoleRule::default())
    }

    /// Routes parameters with `rule`.
    pub fn with_rule(muon: Muon, elementwise: O, rule: RoleRule) -> Self {
        Self {
            muon,
            elementwise,
            rule,
            muon_states: HashMap::new(),
            states: HashMap::new(),
            clip: GradClip::default(),
        }
    }

    /// Clips the global gradient norm (all parameters together) to `max_norm` before each
    /// step. (Burn's own `GradientClipping::Norm` clips each parameter separately.)
    pub fn with_grad_clipping(mut self, max_norm: f64) -> Self {
        self.clip = GradClip::new(Some(max_norm));
        self
    }

    /// The global gradient norm before clipping at the last step (when clipping is on).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.clip.last_norm
    }

    /// The Muon optimizer.
    pub fn muon(&self) -> &Muon {
        &self.muon
    }

    /// One step with learning rate `lr`; parameters without a gradient are left as they are.
    pub fn step<M: AutodiffModule<B>>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let grad_scale = match self.clip.max_norm {
            Some(_) => {
                let mut norm = SquaredNorm {
                    grads: &grads,
                    sum: 0.0,
                };
                module.visit(&mut norm);
                self.clip.factor_for(norm.sum.sqrt())
            }
            None => 1.0,
        };
        let mut stepper = Stepper {
            optim: self,
            grads,
            lr,
            grad_scale,
            path: Vec::new(),
            containers: Vec::new(),
        };
        module.map(&mut stepper)
    }
}

struct Stepper<'a, B: AutodiffBackend, O: SimpleOptimizer<B::InnerBackend>> {
    optim: &'a mut MuonWithElementwise<B, O>,
    grads: GradientsParams,
    lr: f64,
    grad_scale: f64,
    path: Vec<String>,
    /// Burn's description of each entered level's holder (`Struct:Embedding`).
    containers: Vec<String>,
}

/// Sums the squares of every parameter's gradient.
struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    sum: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let squares: f64 = g.powi_scalar(2).sum().into_scalar().elem();
            self.sum += squares;
        }
    }
}

impl<B: AutodiffBackend, O: SimpleOptimizer<B::InnerBackend>> ModuleMapper<B>
    for Stepper<'_, B, O>
{
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.push(name.to_string());
        self.containers.push(container.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
        self.containers.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let grad = if self.grad_scale != 1.0 {
            grad.mul_scalar(self.grad_scale)
        } else {
            grad
        };
        let shape = tensor.dims();
        let inner = tensor.inner();
        let module = self.containers.last().and_then(|c| module_type(c));
        let role = self
            .optim
            .rule
            .role_in(&self.path.join("."), &shape, module);
        let stepped: Tensor<B::InnerBackend, D> = match role {
            Role::Matrix => {
                let [rows, cols] = [shape[0], shape[1]];
                let state = self.optim.muon_states.remove(&id);
                let (value, state) = self.optim.muon.step_matrix(
                    self.lr,
                    inner.reshape([rows, cols]),
                    grad.reshape([rows, cols]),
                    state,
                );
                self.optim.muon_states.insert(id, state);
                value.reshape(shape)
            }
            Role::Elementwise => {
                let n = shape.iter().product::<usize>();
                let state = self.optim.states.remove(&id);
                let (value, state) = self.optim.elementwise.step(
                    self.lr,
                    inner.reshape([n]),
                    grad.reshape([n]),
                    state,
                );
                if let Some(state) = state {
                    self.optim.states.insert(id, state);
                }
                value.reshape(shape)
            }
        };
        Param::from_mapped_value(id, Tensor::from_inner(stepped).require_grad(), mapper)
    }
}
