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
/// By default a bucket gathered in forward stays resident through backward and is released by
/// the update (FSDP2's `reshard_after_forward=False`: fastest, most memory).
/// [`HsdpConfig::with_reshard_after_forward`] releases each bucket when forward moves on to
/// the next one and gathers it again in backward (prefetched in reverse forward order on the
/// communication thread), releasing it again once its gradients are in: gathered memory stays
/// at about two buckets, for one more all-gather per bucket. Burn's autodiff saves the
/// parameter *handles* its backward needs (`linear`, `layer_norm`, …), so releasing really
/// frees the gathered buffers.
///
/// Backward gathers run inside Burn's autodiff, which holds its graph lock during backward and
/// locks every graph of the process after it; collectives are requested from every rank's
/// model thread in the same order and run on the communication thread, so a rank waiting for a
/// gather never waits for a peer's model thread to move past that lock.
#[derive(Clone, Debug, PartialEq)]
pub struct HsdpConfig {
    /// The rank mesh; must cover the communicator's world.
    pub mesh: Mesh,
    /// Planner settings (bucket size, sharding mode, runtime format, …).
    pub plan: PlanConfig,
    /// Zero-copy (default) or the FSDP2-style copy-in/copy-out baseline.
    pub copy_mode: CopyMode,
    /// Release gathered buckets after their forward use and gather them again in backward.
    pub reshard_after_forward: bool,
}

impl HsdpConfig {
    /// Sharding over `mesh` with the planner's defaults (hierarchical: runtime shards over the
    /// shard group, update pieces over the world) and f32 runtime parameters.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            plan: PlanConfig::default().with_format(RuntimeFormat::F32),
            copy_mode: CopyMode::ZeroCopy,
            reshard_after_forward: false,
        }
    }

    /// The same config with resharding after forward on or off (see the type's docs).
    pub fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
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

    /// The same config with another runtime format: `F32` (default), `Bf16` (half the
    /// runtime memory and all-gather bytes; fp32 master weights kept per piece) or `Mxfp8`
    /// (matrices as E4M3 + E8M0 tiles holding both planes, forward decoding one and backward the
    /// other; parameters the format cannot hold fall back to bf16 and are listed in
    /// `plan().fallbacks()`; fp32 masters kept per piece). See `layout.rs` for the banded layout.
    pub fn with_format(mut self, format: RuntimeFormat) -> Self {
        self.plan.runtime_format = format;
        self
    }

    /// The same config with another bucket target (elements).
    pub fn with_bucket_elements(mut self, elements: u64) -> Self {
        self.plan.bucket_elements = elements;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), HsdpError> {
        self.plan.validate().map_err(HsdpError::from)
    }
}
