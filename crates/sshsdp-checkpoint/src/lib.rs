//! Sharded checkpoints of SS-HSDP models: files independent of the training runtime, re-sharding
//! to any world size or mesh, the optimizers' states as re-shardable named arrays, and saves
//! committed atomically over all ranks.
//!
//! A parameter is identified by its module path and shape; a rank owns *slices* of
//! parameters, element ranges `[start, end)` of the row-major flattened parameter. A rank's
//! checkpoint shard ([`ShardFile`]) holds, for every slice it owns, named `f32` arrays of the
//! slice's length ([`MASTER`] weights and optimizer state arrays), per-shard scalars (the
//! step, optimizer scalars) and metadata: format version, world size, rank and the plan JSON
//! (opaque here). One file per rank, named by [`shard_file_name`].
//!
//! # On disk
//!
//! ```text
//! ROOT/                                  the directory given to `save` / `load`
//!   step-500/                            a committed checkpoint of step 500
//!     rank-00000-of-00004.safetensors    one shard file per rank
//!     ...
//!     rank-00003-of-00004.safetensors
//!     manifest.json                      written last: step, world, plan fingerprint,
//!                                        every file's name, size and SHA-256
//!   step-1000/                           the latest committed checkpoint
//!   step-1500.tmp/                       a save in progress or crashed: never loaded
//! ```
//!
//! A directory is a checkpoint exactly when it holds a valid [`Manifest`].
//!
//! # Saving: one commit for all ranks
//!
//! [`save`] (every rank calls it) writes every rank's file into a fresh `ROOT/step-N.tmp/`
//! (files created with `create_new`, fsynced, with the directory), then the ranks agree over
//! the world (each rank's verdict, file size and SHA-256 reach every rank,
//! `HsdpRuntime::all_gather_world`). If any rank failed, every rank returns an error and
//! the temporary directory is removed: nothing is renamed, the previous checkpoints stay.
//! Otherwise rank 0 writes the manifest last, renames `step-N.tmp` to `step-N` (one atomic
//! rename), fsyncs `ROOT` and deletes the committed checkpoints beyond the last K
//! ([`SaveOptions::keep_last`], default 3); a second agreement makes no rank return before
//! the commit is visible. A step already committed is never overwritten
//! ([`CheckpointError::Exists`]). A crash at any point leaves the previous checkpoints intact
//! and at most a `step-N.tmp` without a manifest, which the next save of step N replaces.
//!
//! # Loading: all or nothing
//!
//! [`load`] takes a step directory or `ROOT` (its latest committed step; directories without
//! a manifest are skipped, and named in the error when given directly). Every rank checks the
//! manifest, every file's size (before reading it) and SHA-256 against it, the shards against
//! each other and the model (parameters, shapes, optimizer), and assembles its new units in
//! memory; the ranks agree, and only if all succeeded does any rank overwrite its masters.
//! Otherwise every rank returns an error naming the failing ranks and why
//! ([`CheckpointError::Ranks`] on the ranks that did not fail themselves).
//!
//! # Modules
//!
//! * [`ShardFile::write`] / [`ShardFile::read`]: the on-disk format (safetensors, SHA-256
//!   checksums, reads that validate everything and never panic). [`read_checkpoint`] reads a
//!   committed checkpoint's shards checked against its manifest; [`read_all`] reads a bare
//!   directory of shard files.
//! * [`Coverage`]: re-sharding. It indexes the slices of any number of old shards once and
//!   assembles any new range of any parameter ([`Coverage::assemble`]), whatever the old and
//!   new world sizes; identical HSDP replicas are accepted, gaps and conflicting copies are
//!   errors. [`export_full`] / [`shard_full`] convert to and from an unsharded model.
//! * [`save`] / [`load`]: a sharded model's checkpoint — each rank's masters and optimizer
//!   state ([`UnitState`]) per update unit; loading re-shards to the current world and mesh.
//!   [`save_model`] / [`load_model`] / [`export_model`] also take the module, for models with
//!   module buffers (BatchNorm's running statistics: rank 0's saved as [`BUFFER`] arrays,
//!   restored on every rank); the calls without the module refuse such models.
//! * [`encode_state`] / [`decode_state`] (from `sshsdp-optim`, which splits and joins its
//!   optimizer states with them): a Burn optimizer state record (any element-wise
//!   `SimpleOptimizer::State<1>`, e.g. `SgdState`, `AdamState`, `AdamWState`) to named `f32`
//!   arrays plus scalars and back, so that state can be sliced and re-sharded like weights.

#![deny(missing_docs)]

mod agree;
mod buffers;
mod commit;
mod consolidated;
mod export;
mod format;
mod layout;
mod load;
mod manifest;
mod muon_state;
mod piece_state;
mod reshard;
mod runtime_io;
mod shard_dir;

use std::path::PathBuf;

pub use commit::{save, save_model, save_model_with, save_with, SaveOptions};
pub use consolidated::{export_model, export_safetensors, SafetensorsSource};
pub use export::apply_full;
pub use format::{ShardFile, SliceEntry, FORMAT_VERSION};
pub use layout::{committed_steps, resolve, step_dir_name};
pub use load::{load, load_model, read_checkpoint};
pub use manifest::{Manifest, ManifestFile, MANIFEST_FILE};
pub use piece_state::PieceStates;
pub use reshard::{
    agreed_scalars, assemble, export_full, shard_full, Coverage, FullModel, BUFFER, MASTER,
};
pub use runtime_io::{UnitState, WeightsOnly, STEP};
pub use shard_dir::{checkpoint_dir_files, read_all, shard_file_name};
pub use sshsdp_optim::state_codec::{
    decode_state, encode_state, strip_prefix, with_prefix, CodecError, EncodedState,
};

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
    /// A parameter's optimizer state in the checkpoint belongs to another optimizer role than
    /// the one it has now (Muon momentum for a parameter now stepped element-wise, or the
    /// other way round): its role changed (a module type or name now routes it elsewhere).
    #[error(
        "parameter {param} was saved with {saved} state but is stepped {now} now: its \
         optimizer role changed since the checkpoint; keep its role, or load the weights alone \
         and start the optimizer state cold"
    )]
    RoleChanged {
        /// The parameter (its index in the plan).
        param: usize,
        /// The state the checkpoint holds.
        saved: &'static str,
        /// How it is stepped now.
        now: &'static str,
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
    /// A save would reuse the directory of a step already saved (or any path of that name):
    /// step labels are never overwritten.
    #[error(
        "{} already exists: a checkpoint's step is never overwritten (save another step, or \
         delete the directory first)",
        dir.display()
    )]
    Exists {
        /// The step's directory.
        dir: PathBuf,
    },
    /// Some ranks failed a phase of a collective save or load, so every rank gave it up
    /// (what a rank that did not fail returns; a failing rank returns its own error).
    #[error("checkpoint {phase} failed on {}", describe(failures))]
    Ranks {
        /// The phase (e.g. `"save: write"`, `"load: validate"`).
        phase: String,
        /// Each failing rank and its reason.
        failures: Vec<(usize, String)>,
    },
}

fn describe(failures: &[(usize, String)]) -> String {
    failures
        .iter()
        .map(|(rank, reason)| format!("rank {rank} ({reason})"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl From<CodecError> for CheckpointError {
    fn from(e: CodecError) -> Self {
        CheckpointError::Codec(e.0)
    }
}
