//! Errors every engine reports instead of hanging or panicking.

use std::time::Duration;

use thiserror::Error;

/// Result of a collective call.
pub type CommResult<T> = Result<T, CommError>;

/// Why a collective failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CommError {
    /// Peers did not arrive within the configured timeout.
    #[error("{op} timed out after {after:?} waiting for ranks {missing:?}")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The timeout that expired.
        after: Duration,
        /// Ranks (in this communicator) that had not arrived.
        missing: Vec<usize>,
    },
    /// The group is unusable because a rank failed, dropped out or timed out earlier.
    #[error("communicator failed: {0}")]
    PeerFailed(String),
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// Bad arguments on this rank (buffer sizes, root out of range, …).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The engine is not available on this machine (missing library or device).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// An error reported by the underlying engine (MPI, NCCL).
    #[error("engine error: {0}")]
    Engine(String),
}
