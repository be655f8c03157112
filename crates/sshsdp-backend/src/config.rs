//! Settings of [`crate::shard`].

use sshsdp_plan::{Mesh, PlanConfig, RuntimeFormat, Sharding};

use crate::HsdpError;

/// How to shard a model.
#[derive(Clone, Debug, PartialEq)]
pub struct HsdpConfig {
    /// The rank mesh; must cover the communicator's world.
    pub mesh: Mesh,
    /// Planner settings (bucket size, sharding mode, runtime format, …).
    pub plan: PlanConfig,
    /// Gathered buckets kept at once (the one in use plus those just used); older ones are
    /// released. Backward gathers again what it needs. Default 2.
    pub max_resident_buckets: usize,
}

impl HsdpConfig {
    /// Full sharding over `world` ranks with the planner's defaults and f32 runtime parameters.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            plan: PlanConfig::default().with_format(RuntimeFormat::F32),
            max_resident_buckets: 2,
        }
    }

    /// The same config with another sharding mode.
    pub fn with_sharding(mut self, sharding: Sharding) -> Self {
        self.plan.sharding = sharding;
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
