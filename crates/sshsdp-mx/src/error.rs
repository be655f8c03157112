//! The crate's error type.

use thiserror::Error;

/// Errors returned by the MX codec for malformed arguments (never for unusual values:
/// NaN, infinities and overflow are encoded as documented in the crate root).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MxError {
    /// A buffer does not have the exact length the shape requires.
    #[error("buffer `{what}` has length {got}, expected {expected}")]
    BufferLength {
        /// Which buffer (e.g. `"src"`, `"data"`, `"scales"`, `"out"`).
        what: &'static str,
        /// The length the shape requires.
        expected: usize,
        /// The length that was passed.
        got: usize,
    },
    /// A tile range `[t0, t1)` is empty-inverted or exceeds the tensor's tile count.
    #[error("tile range {t0}..{t1} is invalid for a tensor of {n_tiles} tiles")]
    TileRange {
        /// First tile of the range.
        t0: usize,
        /// One past the last tile of the range.
        t1: usize,
        /// Number of tiles of the tensor.
        n_tiles: usize,
    },
    /// The padded shape's byte counts do not fit in `usize`.
    #[error("shape {rows}x{cols} is too large")]
    ShapeOverflow {
        /// Rows of the tensor.
        rows: usize,
        /// Columns of the tensor.
        cols: usize,
    },
}
