//! [`ShardedMuon`]: distributed owner-compute Muon for matrices, with any element-wise Burn
//! optimizer (AdamW by default) for everything else, on a sharded model's update pieces.
//!
//! Per step, on each rank:
//! 1. Element-wise units (1-D parameters, embeddings, the LM head — the plan's roles) step
//!    with the element-wise optimizer on their slice, state kept per parameter slice.
//! 2. Matrix units update their momentum slice locally (`M ← μM + G`, `U = G + μM` with
//!    Nesterov) — element-wise, so a slice needs nothing from other ranks.
//! 3. A matrix whole in this rank's piece is orthogonalised right there: no communication.
//! 4. Split matrices (cut by a piece boundary) are exchanged: each holder writes its `U` slice
//!    into one buffer of all split matrices, one all-reduce over the update group assembles
//!    them, the plan's Newton–Schulz owner orthogonalises each, and a second all-reduce hands
//!    every holder its slice of the result. Each matrix is therefore orthogonalised exactly
//!    once per update group (once in the world with the default hierarchical sharding; once
//!    per replica under HSDP, whose replicas step identical copies).
//!
//! Both all-reduces move the split matrices' elements only (the plan keeps them few: at most
//! one per piece boundary). A point-to-point gather to the owner would move less; the
//! engines' collective set has no gather-v yet.

use std::collections::HashMap;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sshsdp_backend::{HsdpError, HsdpRuntime, Piece, UpdateGroup};

use crate::{step_slice, GradClip, Slice};
pub use sshsdp_plan::projection::MuonExchange;
use sshsdp_plan::{Role, UpdateUnit};

use crate::step::ShardedStep;
use crate::Muon;

mod exchange;

/// A piece's host master and gradient slices.
struct HostPiece<'a> {
    master: &'a mut [f32],
    grad: &'a [f32],
}

/// Newton–Schulz and exchange counts of the last step on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MuonStepStats {
    /// Matrices orthogonalised on this rank.
    pub ns_local: u64,
    /// Of those, split matrices assembled from other ranks' slices.
    pub ns_split: u64,
    /// Elements of the split matrices exchanged (each all-reduce's length with
    /// [`MuonExchange::AllReduce`]; 0 when no matrix is split).
    pub exchanged_elements: u64,
    /// Elements this rank sent to other ranks in the owner exchange (both directions).
    pub sent_elements: u64,
    /// Elements this rank received from other ranks in the owner exchange (both directions).
    pub received_elements: u64,
}

/// The optimizer state of one parameter's slice in a [`ShardedMuon`].
#[derive(Clone, Debug, PartialEq)]
pub enum ParamState<S> {
    /// Muon's momentum of a matrix slice (one value per element).
    Momentum(Vec<f32>),
    /// The element-wise optimizer's state record.
    Elementwise(S),
}

/// Muon on matrices and an element-wise optimizer on the rest, over sharded pieces.
pub struct ShardedMuon<B: Backend, O: SimpleOptimizer<B>> {
    muon: Muon,
    elementwise: O,
    device: B::Device,
    states: HashMap<usize, O::State<1>>,
    momentum: HashMap<usize, Vec<f32>>,
    last: MuonStepStats,
    clip: GradClip,
    exchange: MuonExchange,
    megabatch: bool,
}

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// `muon` for `Matrix` parameters, `elementwise` (e.g. AdamW) for the others; state and
    /// Newton–Schulz run on `device`.
    pub fn new(muon: Muon, elementwise: O, device: B::Device) -> Self {
        Self {
            muon,
            elementwise,
            device,
            states: HashMap::new(),
            momentum: HashMap::new(),
            last: MuonStepStats::default(),
            clip: GradClip::default(),
            exchange: MuonExchange::default(),
            megabatch: true,
        }
    }

    /// Same-shape matrices this rank orthogonalises in a step run as one batched Newton–Schulz
    /// (`true`, the default: fewer, larger matmuls) or one by one. The two agree up to the
    /// matmuls' summation order.
    pub fn with_megabatches(mut self, on: bool) -> Self {
        self.megabatch = on;
        self
    }

    /// The same optimizer exchanging split matrices by `exchange` (default
    /// [`MuonExchange::OwnerAllToAll`]). Both give bitwise the same update.
    pub fn with_exchange(mut self, exchange: MuonExchange) -> Self {
        self.exchange = exchange;
        self
    }

    /// Clips the global gradient norm (over all shards, measured by the runtime) to `max_norm`
    /// before each step.
    pub fn with_grad_clipping(mut self, max_norm: f64) -> Self {
        self.clip = GradClip::new(Some(max_norm));
        self
    }

    /// The global gradient norm (before clipping) at the last step.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.clip.last_norm
    }

    /// The Muon optimizer (its counters include every orthogonalisation run here).
    pub fn muon(&self) -> &Muon {
        &self.muon
    }

    /// Counts of the last step.
    pub fn last_step(&self) -> MuonStepStats {
        self.last
    }

    /// The device the optimizer state lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The optimizer state of this rank's slice of parameter `param` (a plan index): Muon's
    /// momentum for a matrix, the element-wise optimizer's record otherwise; `None` before its
    /// first step. For checkpoints.
    pub fn param_state(&self, param: usize) -> Option<ParamState<&O::State<1>>> {
        match self.momentum.get(&param) {
            Some(m) => Some(ParamState::Momentum(m.clone())),
            None => self.states.get(&param).map(ParamState::Elementwise),
        }
    }

    /// Replaces the state of this rank's slice of parameter `param` (`None`: no state yet).
    /// For checkpoints.
    pub fn set_param_state(&mut self, param: usize, state: Option<ParamState<O::State<1>>>) {
        self.momentum.remove(&param);
        self.states.remove(&param);
        match state {
            Some(ParamState::Momentum(m)) => {
                self.momentum.insert(param, m);
            }
            Some(ParamState::Elementwise(s)) => {
                self.states.insert(param, s);
            }
            None => {}
        }
    }

    /// Newton–Schulz of whole matrices' updates `(param, values)`, in order: same-shape
    /// matrices in one batched Newton–Schulz each ([`Self::with_megabatches`]), or one by one.
    fn orthogonalize_all<R: Backend>(
        &self,
        runtime: &HsdpRuntime<R>,
        matrices: Vec<(usize, Vec<f32>)>,
    ) -> Result<Vec<(usize, Vec<f32>)>, HsdpError> {
        let shape = |param: usize| {
            let s = &runtime.plan().params()[param].spec.shape;
            [s[0], s[1]]
        };
        let mut out: Vec<Option<Vec<f32>>> = vec![None; matrices.len()];
        // Indices by shape, in order of first appearance.
        let mut batches: Vec<([usize; 2], Vec<usize>)> = Vec::new();
        for (i, (param, _)) in matrices.iter().enumerate() {
            let s = shape(*param);
            match batches.iter_mut().find(|(b, _)| *b == s) {
                Some((_, members)) if self.megabatch => members.push(i),
                _ => batches.push((s, vec![i])),
            }
        }
        for ([rows, cols], members) in batches {
            if members.len() == 1 {
                let (param, u) = &matrices[members[0]];
                out[members[0]] = Some(self.orthogonalize(runtime, *param, u.clone())?);
                continue;
            }
            let n = rows * cols;
            let mut values = Vec::with_capacity(members.len() * n);
            for &i in &members {
                values.extend_from_slice(&matrices[i].1);
            }
            let batch = Tensor::<B, 3>::from_data(
                TensorData::new(values, [members.len(), rows, cols]),
                &self.device,
            );
            let o = read(self.muon.orthogonalize_batch(batch))?;
            for (k, &i) in members.iter().enumerate() {
                out[i] = Some(o[k * n..(k + 1) * n].to_vec());
            }
        }
        Ok(matrices
            .into_iter()
            .zip(out)
            .map(|((param, _), o)| (param, o.expect("every matrix is in a batch")))
            .collect())
    }

    /// The element-wise optimizer on one slice (gradient already clipped).
    fn step_elementwise(
        &mut self,
        lr: f64,
        param: usize,
        master: &mut [f32],
        grad: &[f32],
    ) -> Result<(), HsdpError> {
        let slice = Slice {
            master,
            grad,
            grad_scale: 1.0,
        };
        step_slice(
            &self.elementwise,
            &mut self.states,
            param,
            lr,
            slice,
            &self.device,
        )
    }

    /// Momentum of one matrix slice; returns its update `U` (Nesterov or plain momentum).
    fn momentum_update(&mut self, unit: &UpdateUnit, grad: &[f32]) -> Vec<f32> {
        let cfg = self.muon.config();
        let mu = cfg.momentum as f32;
        // Keyed by parameter: a rank holds at most one slice of each parameter.
        let m = self
            .momentum
            .entry(unit.param)
            .and_modify(|m| m.iter_mut().zip(grad).for_each(|(m, &g)| *m = *m * mu + g))
            .or_insert_with(|| grad.to_vec());
        if cfg.nesterov {
            grad.iter()
                .zip(m.iter())
                .map(|(&g, &m)| g + m * mu)
                .collect()
        } else {
            m.clone()
        }
    }

    /// Newton–Schulz of a whole matrix's update.
    fn orthogonalize<R: Backend>(
        &self,
        runtime: &HsdpRuntime<R>,
        param: usize,
        u: Vec<f32>,
    ) -> Result<Vec<f32>, HsdpError> {
        let shape = &runtime.plan().params()[param].spec.shape;
        let u = Tensor::<B, 2>::from_data(TensorData::new(u, [shape[0], shape[1]]), &self.device);
        read(self.muon.orthogonalize(u))
    }

    /// `W ← W·(1 − lr·wd) − lr·scale·O` on one slice.
    fn apply<R: Backend>(
        &self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        param: usize,
        master: &mut [f32],
        o: &[f32],
    ) {
        let shape = &runtime.plan().params()[param].spec.shape;
        let scale = self.muon.update_scale([shape[0], shape[1]]);
        let decay = (1.0 - lr * self.muon.config().weight_decay) as f32;
        let step = (lr * scale) as f32;
        master
            .iter_mut()
            .zip(o)
            .for_each(|(w, &o)| *w = *w * decay - o * step);
    }
}

/// A tensor's values as f32.
fn read<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, HsdpError> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| HsdpError::Failed(format!("reading optimizer values: {e:?}")))
}

/// Host slices in every case (the trait's defaults): Muon's exchange and Newton–Schulz read whole
/// matrices on the host.
impl<B: Backend, O: SimpleOptimizer<B>> ShardedStep<B> for ShardedMuon<B, O> {
    /// One step on `runtime`'s pieces, as host views, whatever its backend.
    fn step_host_pieces<R: Backend>(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        pieces: &mut [Piece<R>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        let mut units = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))?;
        // A parameter without a gradient in this step (on any rank) is not stepped, its
        // momentum and state left alone, as Burn's optimizers do; every rank agrees.
        units.retain(|u| group.received_gradient(u.param));
        // Host slices (device masters are staged by the runtime for `Views::Host`).
        let mut pieces: Vec<HostPiece<'_>> = pieces
            .iter_mut()
            .map(|p| p.host().map(|(master, grad)| HostPiece { master, grad }))
            .collect::<Result<_, _>>()?;
        let plan = runtime.plan();
        let mut stats = MuonStepStats::default();
        let scale = self.clip.factor(group) as f32;
        let scaled: Vec<Option<Vec<f32>>> = pieces
            .iter()
            .map(|p| (scale != 1.0).then(|| p.grad.iter().map(|g| g * scale).collect()))
            .collect();
        let mut split_updates = Vec::new();
        let mut owned_updates = Vec::new();
        for unit in &units {
            let piece = &mut pieces[unit.piece];
            let grad = match &scaled[unit.piece] {
                Some(g) => &g[unit.in_piece.clone()],
                None => &piece.grad[unit.in_piece.clone()],
            };
            match unit.role {
                Role::Elementwise => {
                    let master = &mut piece.master[unit.in_piece.clone()];
                    self.step_elementwise(lr, unit.param, master, grad)?;
                }
                Role::Matrix => {
                    let u = self.momentum_update(unit, grad);
                    if plan.params()[unit.param].split {
                        split_updates.push((unit.clone(), u));
                    } else {
                        owned_updates.push((unit.clone(), u));
                    }
                }
            }
        }
        // Split matrices go to their owners (in plan order); every matrix this rank owns —
        // whole in its pieces or assembled — is orthogonalised here, same shapes together.
        split_updates.sort_by_key(|(unit, _)| unit.param);
        let assembled = self.send_to_owners(runtime, group, &split_updates, &mut stats)?;
        let whole = owned_updates.len();
        let (owned_units, owned_u): (Vec<UpdateUnit>, Vec<Vec<f32>>) =
            owned_updates.into_iter().unzip();
        let matrices: Vec<(usize, Vec<f32>)> = owned_units
            .iter()
            .map(|unit| unit.param)
            .zip(owned_u)
            .chain(assembled)
            .collect();
        stats.ns_local += matrices.len() as u64;
        stats.ns_split += (matrices.len() - whole) as u64;
        let mut orthogonal = self.orthogonalize_all(runtime, matrices)?;
        let split_results: Vec<(usize, Vec<f32>)> = orthogonal.split_off(whole);
        for (unit, (_, o)) in owned_units.iter().zip(orthogonal) {
            let master = &mut pieces[unit.piece].master[unit.in_piece.clone()];
            self.apply(lr, runtime, unit.param, master, &o);
        }
        // Each holder's rows of the results back.
        let rows =
            self.return_to_holders(runtime, group, &split_updates, split_results, &mut stats)?;
        for ((unit, _), o) in split_updates.iter().zip(rows) {
            let master = &mut pieces[unit.piece].master[unit.in_piece.clone()];
            self.apply(lr, runtime, unit.param, master, &o);
        }
        self.last = stats;
        Ok(())
    }
}
