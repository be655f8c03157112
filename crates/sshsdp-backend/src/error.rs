//! Errors of sharding and stepping.

use sshsdp_comm::CommError;
use sshsdp_plan::PlanError;
use thiserror::Error;

/// Why sharding a model or a training step failed.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum HsdpError {
    /// The plan could not be built.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A collective failed (a peer failed, timed out, or the calls did not match).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Ranks planned different models: their module structures (or configs) differ.
    #[error("ranks disagree on the model: {detail} (plan fingerprint on this rank: {ours}); every rank must shard the same module structure with the same config")]
    PlanMismatch {
        /// This rank's plan fingerprint.
        ours: String,
        /// The first difference found: a parameter path and the two shapes, or the config.
        detail: String,
    },
    /// A feature the decorator does not support yet.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The global gradient norm was NaN or infinite: nothing was applied, on any rank (see
    /// `NonFinitePolicy`). The runtime stays usable; the next step can go on.
    #[error(
        "the gradient is not finite (global norm {norm}): the update was not applied on any rank"
    )]
    NonFiniteGradient {
        /// The global gradient norm measured (NaN or infinite).
        norm: f64,
    },
    /// The runtime failed: a collective, the codec, a device read, or a failure recorded during
    /// this step's forward or backward (ops cannot return errors, so it surfaces here).
    #[error("the runtime failed: {0}")]
    Failed(String),
}
