//! [`HsdpRuntime`]: what a training loop holds besides the sharded module.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use sshsdp_plan::Plan;

use crate::runtime::{Counters, Runtime};
use crate::HsdpError;

/// One rank's handle on its sharded parameters: the plan, the update step and the counters.
pub struct HsdpRuntime<B: Backend> {
    runtime: Arc<Runtime<B>>,
}

impl<B: Backend> Clone for HsdpRuntime<B> {
    fn clone(&self) -> Self {
        Self {
            runtime: self.runtime.clone(),
        }
    }
}

impl<B: Backend> HsdpRuntime<B> {
    pub(crate) fn new(runtime: Arc<Runtime<B>>) -> Self {
        Self { runtime }
    }

    /// The plan every rank agreed on.
    pub fn plan(&self) -> &Plan {
        self.runtime.plan()
    }

    /// Updates this rank's pieces with `step(bucket, master, grad)` (see
    /// [`crate::ShardedOptimizer`] for Burn optimizers) and rebuilds the runtime shards.
    pub fn update(
        &self,
        step: impl FnMut(usize, &mut [f32], &[f32]) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        self.runtime.update(step)
    }

    /// Bytes moved and copied since the last call.
    pub fn take_counters(&self) -> Counters {
        self.runtime.take_counters()
    }

    /// The current values of the parameter at `path`, gathered.
    pub fn param_values(&self, path: &str) -> Result<Vec<f32>, HsdpError> {
        let index = self
            .runtime
            .plan()
            .param_index(path)
            .ok_or_else(|| HsdpError::Unsupported(format!("no parameter at path `{path}`")))?;
        self.runtime.param_values(index)
    }

    /// Bytes of this rank's persistent runtime shards.
    pub fn shard_bytes(&self) -> u64 {
        self.runtime.shard_bytes()
    }

    /// Bytes of this rank's fp32 master pieces kept apart from the runtime shards (bf16 runtime
    /// format; 0 in f32, where the runtime shard is the master).
    pub fn master_bytes(&self) -> u64 {
        self.runtime.master_bytes()
    }
}
