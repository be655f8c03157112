//! Sharded checkpoints of SS-HSDP models: files independent of the training runtime, re-sharding
//! to any world size or mesh, and the optimizers' states as re-shardable named arrays.
//!
//! A parameter is identified by its module path and shape; a rank owns *slices* of
//! parameters, element ranges `[start, end)` of the row-major flattened parameter. A rank's
//! checkpoint shard ([`ShardFile`]) holds, for every slice it owns, named `f32` arrays of the
//! slice's length ([`MASTER`] weights and optimizer state arrays), per-shard scalars (the
//! step, optimizer scalars) and metadata: format version, world size, rank and the plan JSON
//! (opaque here). One file per rank, named by [`shard_file_name`]; [`read_all`] loads a
//! whole checkpoint directory and checks that it is complete and consistent.
//!
//! * [`ShardFile::write`] / [`ShardFile::read`]: the on-disk format (safetensors, SHA-256
//!   checksums, atomic writes, reads that validate everything and never panic).
//! * [`Coverage`]: re-sharding. It indexes the slices of any number of old shards once and
//!   assembles any new range of any parameter ([`Coverage::assemble`]), whatever the old and
//!   new world sizes; identical HSDP replicas are accepted, gaps and conflicting copies are
//!   errors. [`export_full`] / [`shard_full`] convert to and from an unsharded model.
//! * [`save`] / [`load`]: a sharded model's checkpoint — each rank's masters and optimizer
//!   state ([`UnitState`]) per update unit; loading re-shards to the current world and mesh.
//! * [`encode_state`] / [`decode_state`]: a Burn optimizer state record (any element-wise
//!   `SimpleOptimizer::State<1>`, e.g. `SgdState`, `AdamState`, `AdamWState`) to named `f32`
//!   arrays plus scalars and back, so that state can be sliced and re-sharded like weights.

#![deny(missing_docs)]

mod export;
mod format;
mod muon_state;
mod piece_state;
mod reshard;
mod runtime_io;
mod state_codec;

use std::path::PathBuf;

pub use export::apply_full;
pub use format::{
    checkpoint_dir_files, read_all, shard_file_name, ShardFile, SliceEntry, FORMAT_VERSION,
};
pub use piece_state::PieceStates;
pub use reshard::{agreed_scalars, assemble, export_full, shard_full, Coverage, FullModel, MASTER};
pub use runtime_io::{load, save, UnitState, WeightsOnly, STEP};
pub use state_codec::{decode_state, encode_state, strip_prefix, with_prefix, EncodedState};

/// Why a checkpoint could not be written, read or re-assembled.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The training runtime failed while the checkpoint was read or written.
    #[error("runtime error during checkpointing: {0}")]
    Runtime(sshsdp_backend::HsdpError),
    /// An I/O error on a file or directory.
    #[error("I/O error on {}: {source}", file.display())]
    Io {
        /// The file or directory.
        file: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid shard file (bad bytes, checksum, structure).
    #[error("corrupt checkpoint file {}: {reason}", file.display())]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file was written in a format version this build does not read.
    #[error(
        "checkpoint file {} has format version {found}; this build reads version {supported}",
        file.display()
    )]
    Version {
        /// The file.
        file: PathBuf,
        /// The version found in the file.
        found: String,
        /// The version this build reads ([`FORMAT_VERSION`]).
        supported: u32,
    },
    /// Something the checkpoint should contain is absent (a rank's file, a parameter, an
    /// array).
    #[error("missing from checkpoint {}: {what}", location.display())]
    Missing {
        /// The directory or file that should contain it.
        location: PathBuf,
        /// What is missing.
        what: String,
    },
    /// Files that are individually valid disagree with each other or with the request
    /// (world size, plan, shapes, scalars).
    #[error("inconsistent checkpoint file {}: {reason}", file.display())]
    Mismatch {
        /// The file (for in-memory shards: the file name its rank would have).
        file: PathBuf,
        /// What disagrees.
        reason: String,
    },
    /// Part of a requested range is held by no shard.
    #[error(
        "elements [{start}, {end}) of array '{array}' of parameter '{path}' are held by no shard"
    )]
    Uncovered {
        /// The parameter's module path.
        path: String,
        /// The array name.
        array: String,
        /// First uncovered element.
        start: usize,
        /// End of the uncovered run.
        end: usize,
    },
    /// Two shards hold different values for the same element.
    #[error(
        "ranks {first_rank} and {second_rank} hold different values for element {index} of \
         array '{array}' of parameter '{path}'"
    )]
    Conflict {
        /// The parameter's module path.
        path: String,
        /// The array name.
        array: String,
        /// The element (flattened index into the parameter).
        index: usize,
        /// A rank whose value was taken first.
        first_rank: usize,
        /// The rank whose value differs.
        second_rank: usize,
    },
    /// An in-memory argument is invalid (e.g. a shard to write with a slice out of bounds,
    /// or a range outside a parameter).
    #[error("invalid checkpoint data: {0}")]
    Invalid(String),
    /// An optimizer state record cannot be converted to or from arrays and scalars.
    #[error("optimizer state codec: {0}")]
    Codec(String),
}
