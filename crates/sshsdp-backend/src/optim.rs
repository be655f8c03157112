//! [`ShardedOptimizer`]: any Burn `SimpleOptimizer` (SGD, Adam, AdamW, …) stepping this rank's
//! pieces — flat fp32 shards of whole buckets — with one optimizer state per bucket.
//!
//! Element-wise optimizers are indifferent to how elements are grouped, so stepping a flat piece
//! equals stepping every parameter whole. (Matrix optimizers such as Muon need whole matrices:
//! they come with the optimizer crate.)

use std::collections::HashMap;

use burn::module::Module;
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::clip::GradClip;
use crate::shard::refresh_leaves;
use crate::{HsdpError, HsdpRuntime, ShardableBackend};

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

    /// The optimizer state of bucket `bucket`'s piece on this rank (`None` before its first
    /// step), for checkpoints.
    pub fn piece_state(&self, bucket: usize) -> Option<&O::State<1>> {
        self.states.get(&bucket)
    }

    /// Replaces the state of bucket `bucket`'s piece (`None`: no state yet), for checkpoints.
    pub fn set_piece_state(&mut self, bucket: usize, state: Option<O::State<1>>) {
        match state {
            Some(state) => self.states.insert(bucket, state),
            None => self.states.remove(&bucket),
        };
    }

    /// The device the optimizer state lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The global gradient norm before clipping at the last step (when clipping is on).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.clip.last_norm
    }

    /// One optimizer step with learning rate `lr` on every piece of `runtime` that has a
    /// gradient; returns `module` with fresh autodiff leaves over the updated storage (as Burn's
    /// own optimizers return a new module).
    pub fn step<AB, M>(
        &mut self,
        lr: f64,
        module: M,
        runtime: &HsdpRuntime<B>,
    ) -> Result<M, HsdpError>
    where
        AB: ShardableBackend<Inner = B>,
        M: Module<AB>,
    {
        self.step_pieces(runtime, lr)?;
        Ok(refresh_leaves(module))
    }

    fn step_pieces(&mut self, runtime: &HsdpRuntime<B>, lr: f64) -> Result<(), HsdpError> {
        runtime.update_pieces(|pieces, group| {
            let scale = self.clip.factor(pieces, group)?;
            for piece in pieces.iter_mut() {
                self.step_piece(lr, scale, piece.bucket, piece.master, piece.grad)?;
            }
            Ok(())
        })
    }

    fn step_piece(
        &mut self,
        lr: f64,
        grad_scale: f64,
        bucket: usize,
        master: &mut [f32],
        grad: &[f32],
    ) -> Result<(), HsdpError> {
        let n = master.len();
        let param = Tensor::<B, 1>::from_data(TensorData::new(master.to_vec(), [n]), &self.device);
        let mut grad = Tensor::<B, 1>::from_data(TensorData::new(grad.to_vec(), [n]), &self.device);
        if grad_scale != 1.0 {
            grad = grad.mul_scalar(grad_scale);
        }
        let state = self.states.remove(&bucket);
        let (param, state) = self.optimizer.step(lr, param, grad, state);
        if let Some(state) = state {
            self.states.insert(bucket, state);
        }
        let values = param
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| HsdpError::Failed(format!("reading updated bucket {bucket}: {e:?}")))?;
        master.copy_from_slice(&values);
        Ok(())
    }
}
