//! Planner settings: bucket size, runtime format, alignment, sharding mode and the optimizer
//! footprint used by memory accounting.

use serde::{Deserialize, Serialize};

use crate::{PlanError, RuntimeFormat, MX_BLOCK};

/// The largest `align_bytes` accepted: 1 MiB, beyond any device's buffer-offset alignment (a
/// few hundred bytes); it bounds the gap before every parameter, so offsets cannot overflow.
pub const MAX_ALIGN_BYTES: u64 = 1 << 20;

/// The largest optimizer state per element accepted in an [`OptimizerFootprint`]: 1 KiB (256
/// fp32 values; AdamW needs 8 bytes), so memory accounting cannot overflow.
pub const MAX_STATE_BYTES: u64 = 1 << 10;

/// Where the update parameters (fp32 master, optimizer state, gradient shard) are sharded.
///
/// The runtime parameters are always sharded over the shard group (except in `Ddp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sharding {
    /// The default: update shards over the whole world (1/(R·S) per rank); gradients are
    /// reduce-scattered in the shard group then across replicas; after the update each rank
    /// re-derives its runtime piece and an all-gather across the replica group rebuilds the
    /// 1/S runtime shard.
    Hierarchical,
    /// HSDP: update shards over the shard group only (1/S per rank, replicated across
    /// replicas); gradients are reduce-scattered in the shard group then all-reduced across
    /// replicas.
    Hsdp,
    /// DDP: nothing sharded; every rank holds and updates everything; gradients all-reduced.
    Ddp,
}

/// Optimizer state bytes per fp32 master element, by role (for memory accounting only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OptimizerFootprint {
    /// State of a matrix element (Muon: one fp32 momentum = 4).
    pub matrix_state_bytes: u64,
    /// State of an element-wise element (AdamW: two fp32 moments = 8).
    pub elementwise_state_bytes: u64,
}

impl Default for OptimizerFootprint {
    fn default() -> Self {
        Self {
            matrix_state_bytes: 4,
            elementwise_state_bytes: 8,
        }
    }
}

/// Settings of [`crate::Plan::build`]. `PlanConfig::default()` is the recommended start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanConfig {
    /// Target elements per bucket (the unit of one collective); a parameter larger than the
    /// target gets a bucket of its own. Default 25M.
    pub bucket_elements: u64,
    /// Requested runtime format; MXFP8 falls back to bf16 per parameter where it cannot hold
    /// the shape (see [`crate::resolve_format`]).
    pub runtime_format: RuntimeFormat,
    /// Alignment of every parameter's region in the bucket buffer and of its start in the
    /// decoded f32 compute buffer, in bytes (a multiple of 32, the MX block). Default 64;
    /// `shard` raises it to the device's buffer-offset alignment on CubeCL backends, where a
    /// parameter view at an unaligned offset would be a copy.
    pub align_bytes: u64,
    /// Where update parameters live.
    pub sharding: Sharding,
    /// Largest block-padding overhead MXFP8 may add to a parameter before it falls back to
    /// bf16 (padded / real − 1). Default 0.125.
    pub mx_max_padding: f64,
    /// Buckets gathered ahead of the one in use (memory accounting of gathered buffers).
    pub prefetch_buckets: usize,
    /// Optimizer state per element (memory accounting).
    pub optimizer: OptimizerFootprint,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            bucket_elements: 25_000_000,
            runtime_format: RuntimeFormat::Bf16,
            align_bytes: 64,
            sharding: Sharding::Hierarchical,
            mx_max_padding: 0.125,
            prefetch_buckets: 1,
            optimizer: OptimizerFootprint::default(),
        }
    }
}

impl PlanConfig {
    /// The same config with another runtime format.
    pub fn with_format(mut self, format: RuntimeFormat) -> Self {
        self.runtime_format = format;
        self
    }

    /// The same config with another sharding mode.
    pub fn with_sharding(mut self, sharding: Sharding) -> Self {
        self.sharding = sharding;
        self
    }

    /// The same config with another bucket target.
    pub fn with_bucket_elements(mut self, elements: u64) -> Self {
        self.bucket_elements = elements;
        self
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.bucket_elements == 0 {
            return Err(PlanError::InvalidConfig(
                "bucket_elements must be at least 1".into(),
            ));
        }
        if self.align_bytes == 0
            || self.align_bytes % MX_BLOCK != 0
            || self.align_bytes > MAX_ALIGN_BYTES
        {
            return Err(PlanError::InvalidConfig(format!(
                "align_bytes = {} must be a positive multiple of {MX_BLOCK}, at most \
                 {MAX_ALIGN_BYTES}",
                self.align_bytes
            )));
        }
        if !self.mx_max_padding.is_finite() || self.mx_max_padding < 0.0 {
            return Err(PlanError::InvalidConfig(format!(
                "mx_max_padding = {} must be finite and non-negative",
                self.mx_max_padding
            )));
        }
        let state = &self.optimizer;
        for (name, bytes) in [
            ("matrix_state_bytes", state.matrix_state_bytes),
            ("elementwise_state_bytes", state.elementwise_state_bytes),
        ] {
            if bytes > MAX_STATE_BYTES {
                return Err(PlanError::InvalidConfig(format!(
                    "optimizer.{name} = {bytes} is more than {MAX_STATE_BYTES}"
                )));
            }
        }
        Ok(())
    }
}
