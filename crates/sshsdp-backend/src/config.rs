//! Settings of [`crate::shard`].

use sshsdp_plan::{Mesh, PlanConfig, RuntimeFormat, Sharding};

use crate::HsdpError;

/// How gathered parameters reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// SS-HSDP: the all-gather writes the bucket buffer that parameters are views of; nothing is
    /// copied around the collective.
    ZeroCopy,
    /// The PyTorch FSDP2 data path, as a baseline on the same machinery: the local shard is
    /// copied into the all-gather input (copy-in) and every parameter is copied out of the
    /// gathered buffer into a tensor of its own (copy-out).
    Fsdp2Style,
}

/// How to shard a model.
///
/// A bucket gathered in forward stays resident through backward and is released by the update
/// (FSDP2's `reshard_after_forward=False`). Releasing it after forward needs backward to gather
/// it again *inside* Burn's autodiff, which holds its graph lock while a backward runs and, after
/// each backward, locks every graph of the process: a rank blocked there on a peer that waits
/// for that lock deadlocks. Resharding after forward therefore waits for a backward schedule
/// that gathers ahead of autodiff (recorded order, prefetch on the communication thread).
#[derive(Clone, Debug, PartialEq)]
pub struct HsdpConfig {
    /// The rank mesh; must cover the communicator's world.
    pub mesh: Mesh,
    /// Planner settings (bucket size, sharding mode, runtime format, …).
    pub plan: PlanConfig,
    /// Zero-copy (default) or the FSDP2-style copy-in/copy-out baseline.
    pub copy_mode: CopyMode,
}

impl HsdpConfig {
    /// Sharding over `mesh` with the planner's defaults (hierarchical: runtime shards over the
    /// shard group, update pieces over the world) and f32 runtime parameters.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            plan: PlanConfig::default().with_format(RuntimeFormat::F32),
            copy_mode: CopyMode::ZeroCopy,
        }
    }

    /// The same config with another sharding mode.
    pub fn with_sharding(mut self, sharding: Sharding) -> Self {
        self.plan.sharding = sharding;
        self
    }

    /// The same config with another copy mode.
    pub fn with_copy_mode(mut self, mode: CopyMode) -> Self {
        self.copy_mode = mode;
        self
    }

    /// The same config with another bucket target (elements).
    pub fn with_bucket_elements(mut self, elements: u64) -> Self {
        self.plan.bucket_elements = elements;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), HsdpError> {
        if self.plan.runtime_format != RuntimeFormat::F32 {
            return Err(HsdpError::Unsupported(format!(
                "runtime format {:?}: the decorator holds f32 runtime parameters so far \
                 (bf16 and MXFP8 storage come with the kernels issue)",
                self.plan.runtime_format
            )));
        }
        Ok(())
    }
}
