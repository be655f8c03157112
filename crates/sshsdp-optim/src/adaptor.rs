//! [`ShardedOptimizer`]: any Burn `SimpleOptimizer` (SGD, Adam, AdamW, …) stepping this rank's
//! pieces — flat fp32 shards of whole buckets — unit by unit: each parameter's part of a piece
//! ([`UpdateUnit`]) is stepped with its own optimizer state, as Burn's optimizer adaptor steps
//! each parameter with its own record.
//!
//! Element-wise optimizers are indifferent to how elements are grouped, so stepping the units
//! equals stepping every parameter whole. Per parameter rather than per piece, because a
//! parameter that received no gradient in a step (frozen, or unused by every rank's graph) is
//! not stepped and its state — AdamW's moments and step count — is left alone, exactly as plain
//! Burn leaves it ([`UpdateGroup::received_gradient`]). (Matrix optimizers such as Muon need
//! whole matrices: [`crate::ShardedMuon`].)

use std::collections::HashMap;
use std::hash::Hash;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use sshsdp_backend::{HsdpError, HsdpRuntime, Piece, PieceValues, UpdateGroup, Views};

use crate::clip::GradClip;
use crate::step::ShardedStep;
use sshsdp_plan::UpdateUnit;

/// A Burn element-wise optimizer over sharded pieces.
pub struct ShardedOptimizer<B: Backend, O: SimpleOptimizer<B>> {
    optimizer: O,
    states: HashMap<usize, O::State<1>>,
    device: B::Device,
    clip: GradClip,
}

impl<B: Backend, O: SimpleOptimizer<B>> ShardedOptimizer<B, O> {
    /// Wraps `optimizer`; its state tensors live on `device`.
    pub fn new(optimizer: O, device: B::Device) -> Self {
        Self {
            optimizer,
            states: HashMap::new(),
            device,
            clip: GradClip::default(),
        }
    }

    /// Clips the global gradient norm (over all shards) to `max_norm` before each step.
    pub fn with_grad_clipping(mut self, max_norm: f64) -> Self {
        self.clip = GradClip::new(Some(max_norm));
        self
    }

    /// The optimizer state of parameter `param`'s part of this rank's piece (`None` before its
    /// first step), for checkpoints. A rank's piece holds at most one part of a parameter.
    pub fn param_state(&self, param: usize) -> Option<&O::State<1>> {
        self.states.get(&param)
    }

    /// Replaces the state of parameter `param`'s part of this rank's piece (`None`: no state
    /// yet), for checkpoints.
    pub fn set_param_state(&mut self, param: usize, state: Option<O::State<1>>) {
        match state {
            Some(state) => self.states.insert(param, state),
            None => self.states.remove(&param),
        };
    }

    /// The device the optimizer state lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The global gradient norm (before clipping) at the last step.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.clip.last_norm
    }

    /// One step on the units `units` (in piece order) of a device-resident piece: each unit's
    /// part of the master is stepped on the device and the master tensor is replaced by the
    /// pieces put back together; the state stays on the same device; nothing crosses to the
    /// host.
    fn step_device_piece(
        &mut self,
        lr: f64,
        grad_scale: f64,
        units: &[&UpdateUnit],
        master: &mut B::FloatTensorPrimitive,
        grad: B::FloatTensorPrimitive,
    ) {
        if units.is_empty() {
            return;
        }
        let whole = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(master.clone()));
        let mut grad = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(grad));
        if grad_scale != 1.0 {
            // The same f32 product as the host path's `g * scale`.
            grad = grad.mul_scalar(grad_scale as f32);
        }
        let len = whole.dims()[0];
        let mut parts = Vec::with_capacity(2 * units.len() + 1);
        let mut at = 0;
        for unit in units {
            let range = unit.in_piece.clone();
            if at < range.start {
                parts.push(whole.clone().slice(at..range.start));
            }
            let param = whole.clone().slice(range.clone());
            let state = self.states.remove(&unit.param);
            let (param, state) =
                self.optimizer
                    .step(lr, param, grad.clone().slice(range.clone()), state);
            if let Some(state) = state {
                self.states.insert(unit.param, state);
            }
            parts.push(param);
            at = range.end;
        }
        if at < len {
            parts.push(whole.slice(at..len));
        }
        *master = Tensor::cat(parts, 0).into_primitive().tensor();
    }

    /// One step on `unit`'s part of a host piece.
    fn step_host_unit(
        &mut self,
        lr: f64,
        grad_scale: f64,
        unit: &UpdateUnit,
        master: &mut [f32],
        grad: &[f32],
    ) -> Result<(), HsdpError> {
        let slice = Slice {
            master: &mut master[unit.in_piece.clone()],
            grad: &grad[unit.in_piece.clone()],
            grad_scale: grad_scale as f32,
        };
        step_slice(
            &self.optimizer,
            &mut self.states,
            unit.param,
            lr,
            slice,
            &self.device,
        )
    }
}

impl<B: Backend, O: SimpleOptimizer<B>> ShardedStep<B> for ShardedOptimizer<B, O> {
    /// Where the masters live: device pieces step on the device.
    fn views(&self) -> Views {
        Views::AsStored
    }

    fn step_pieces(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<B>,
        pieces: &mut [Piece<B>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        let scale = self.clip.factor(group);
        let units = stepped_units(runtime, pieces, group)?;
        for (p, piece) in pieces.iter_mut().enumerate() {
            let mine = units.iter().filter(|u| u.piece == p);
            match &mut piece.values {
                PieceValues::Host { master, grad } => {
                    for unit in mine {
                        self.step_host_unit(lr, scale, unit, master, grad)?;
                    }
                }
                PieceValues::Device { master, grad } => {
                    let mine: Vec<&UpdateUnit> = mine.collect();
                    self.step_device_piece(lr, scale, &mine, master, grad.clone());
                }
            }
        }
        Ok(())
    }

    fn step_host_pieces<R: Backend>(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        pieces: &mut [Piece<R>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        let scale = self.clip.factor(group);
        let units = stepped_units(runtime, pieces, group)?;
        for unit in &units {
            let (master, grad) = pieces[unit.piece].host()?;
            self.step_host_unit(lr, scale, unit, master, grad)?;
        }
        Ok(())
    }
}

/// The units of `pieces` whose parameter received a gradient in this step, in piece order.
fn stepped_units<B: Backend>(
    runtime: &HsdpRuntime<B>,
    pieces: &[Piece<B>],
    group: &UpdateGroup<'_>,
) -> Result<Vec<UpdateUnit>, HsdpError> {
    let mut units = runtime
        .plan()
        .update_units(pieces.iter().map(|p| (p.bucket, p.index)))?;
    units.retain(|u| group.received_gradient(u.param));
    Ok(units)
}

/// A flat run of fp32 master elements with its gradient, for [`step_slice`].
pub struct Slice<'a> {
    /// Master elements, updated in place.
    pub master: &'a mut [f32],
    /// Their gradient.
    pub grad: &'a [f32],
    /// Factor applied to the gradient first (clipping); 1 for none.
    pub grad_scale: f32,
}

/// The adapter every sharded driver uses: one step of a Burn element-wise optimizer on a flat
/// slice of fp32 master elements, with its state kept in `states` under `key`.
pub fn step_slice<B: Backend, O: SimpleOptimizer<B>, K: Eq + Hash>(
    optimizer: &O,
    states: &mut HashMap<K, O::State<1>>,
    key: K,
    lr: f64,
    slice: Slice<'_>,
    device: &B::Device,
) -> Result<(), HsdpError> {
    let n = slice.master.len();
    let grad: Vec<f32> = if slice.grad_scale == 1.0 {
        slice.grad.to_vec()
    } else {
        slice.grad.iter().map(|g| g * slice.grad_scale).collect()
    };
    let param = Tensor::<B, 1>::from_data(TensorData::new(slice.master.to_vec(), [n]), device);
    let grad = Tensor::<B, 1>::from_data(TensorData::new(grad, [n]), device);
    let state = states.remove(&key);
    let (param, state) = optimizer.step(lr, param, grad, state);
    if let Some(state) = state {
        states.insert(key, state);
    }
    let values = param
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| HsdpError::Failed(format!("reading updated optimizer values: {e:?}")))?;
    slice.master.copy_from_slice(&values);
    Ok(())
}
