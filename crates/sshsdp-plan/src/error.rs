//! Errors the planner reports instead of panicking.

use thiserror::Error;

/// Everything that can go wrong while describing a mesh or building a [`crate::Plan`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// A mesh dimension was zero, or the mesh spans more than [`crate::MAX_WORLD_SIZE`] ranks.
    #[error(
        "invalid mesh {replicas}x{shards}: replicas and shards must both be at least 1 and span \
         at most {} ranks",
        crate::MAX_WORLD_SIZE
    )]
    InvalidMesh {
        /// Requested replica count.
        replicas: usize,
        /// Requested shard count.
        shards: usize,
    },
    /// The mesh does not cover the communicator's world.
    #[error(
        "mesh {replicas}x{shards} has {} ranks but the world has {world} ranks",
        replicas * shards
    )]
    MeshWorldMismatch {
        /// Mesh replicas.
        replicas: usize,
        /// Mesh shards.
        shards: usize,
        /// Size of the world the mesh was checked against.
        world: usize,
    },
    /// A rank, replica or shard index outside the mesh.
    #[error("{what} {index} is out of range (must be < {bound})")]
    OutOfRange {
        /// Which index ("rank", "replica", "shard", "bucket", "piece").
        what: &'static str,
        /// The offending index.
        index: usize,
        /// The exclusive upper bound.
        bound: usize,
    },
    /// No parameters were given.
    #[error("no parameters to plan")]
    NoParameters,
    /// A parameter path was empty.
    #[error("a parameter has an empty path")]
    EmptyPath,
    /// Two parameters share a path.
    #[error("duplicate parameter path `{0}`")]
    DuplicatePath(String),
    /// A parameter has a rank-0 shape or a zero-sized dimension.
    #[error("parameter `{path}` has shape {shape:?}: every parameter needs at least one dimension and no zero-sized dimension")]
    ZeroSized {
        /// Parameter path.
        path: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The element count of a shape does not fit in 64 bits.
    #[error("parameter `{path}` has shape {shape:?} whose size overflows 64 bits")]
    ShapeOverflow {
        /// Parameter path.
        path: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A `Matrix` role on a parameter that is not 2-D.
    #[error("parameter `{path}` has role Matrix but shape {shape:?} is not 2-D")]
    MatrixNot2d {
        /// Parameter path.
        path: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A size in the inputs exceeds what the planner accepts: planning it would overflow 64-bit
    /// arithmetic or allocate beyond reason (e.g. a corrupt or hostile saved plan). Checked
    /// before anything is sized by it.
    #[error("{what} is {value}, more than the limit {limit}")]
    TooLarge {
        /// What was measured.
        what: &'static str,
        /// Its value.
        value: u128,
        /// The largest value accepted.
        limit: u128,
    },
    /// A configuration value is out of its valid range.
    #[error("invalid plan configuration: {0}")]
    InvalidConfig(String),
    /// A serialized plan could not be read.
    #[error("cannot read plan: {0}")]
    Corrupt(String),
    /// A serialized plan does not match the plan rebuilt from its own inputs.
    #[error("plan fingerprint mismatch: file says {stored}, inputs give {rebuilt}")]
    FingerprintMismatch {
        /// Fingerprint stored in the file.
        stored: String,
        /// Fingerprint of the plan rebuilt from the file's inputs.
        rebuilt: String,
    },
}
