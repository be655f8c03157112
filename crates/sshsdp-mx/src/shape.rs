//! Tensor shapes and the byte sizes of every layout.

use crate::{MxError, BLOCK, TILE, TILE_BYTES};

/// Shape of a 2-D row-major tensor `[rows, cols]` and the sizes of its MX layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MxShape {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns (the contiguous dimension).
    pub cols: usize,
}

/// `n` rounded up to a multiple of 32 (saturating is never needed: callers check overflow).
#[inline]
pub const fn round_up32(n: usize) -> usize {
    n.div_ceil(BLOCK) * BLOCK
}

impl MxShape {
    /// A new shape.
    pub const fn new(rows: usize, cols: usize) -> Self {
        Self { rows, cols }
    }

    /// Checks that all sizes of the padded shape fit in `usize`.
    pub fn validate(&self) -> Result<(), MxError> {
        let err = MxError::ShapeOverflow {
            rows: self.rows,
            cols: self.cols,
        };
        let rp = self.rows.checked_add(BLOCK - 1).ok_or(err.clone())? / BLOCK;
        let cp = self.cols.checked_add(BLOCK - 1).ok_or(err.clone())? / BLOCK;
        rp.checked_mul(cp)
            .and_then(|t| t.checked_mul(TILE_BYTES))
            .ok_or(err.clone())?;
        self.rows.checked_mul(self.cols).ok_or(err)?;
        Ok(())
    }

    /// Number of elements `rows * cols`.
    pub const fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the tensor has no elements.
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows rounded up to a multiple of 32.
    pub const fn rows_p(&self) -> usize {
        round_up32(self.rows)
    }

    /// Columns rounded up to a multiple of 32.
    pub const fn cols_p(&self) -> usize {
        round_up32(self.cols)
    }

    /// Bytes of the row-wise data plane: `rows * cols_p`.
    pub const fn row_data_bytes(&self) -> usize {
        self.rows * self.cols_p()
    }

    /// Bytes of the row-wise scales: `rows * cols_p / 32`.
    pub const fn row_scale_bytes(&self) -> usize {
        self.rows * (self.cols_p() / BLOCK)
    }

    /// Bytes of the column-wise data plane: `cols * rows_p`.
    pub const fn col_data_bytes(&self) -> usize {
        self.cols * self.rows_p()
    }

    /// Bytes of the column-wise scales: `cols * rows_p / 32`.
    pub const fn col_scale_bytes(&self) -> usize {
        self.cols * (self.rows_p() / BLOCK)
    }

    /// Tile rows of the padded tensor.
    pub const fn tile_rows(&self) -> usize {
        self.rows_p() / TILE
    }

    /// Tile columns of the padded tensor.
    pub const fn tile_cols(&self) -> usize {
        self.cols_p() / TILE
    }

    /// Number of 32x32 tiles of the padded tensor.
    pub const fn n_tiles(&self) -> usize {
        self.tile_rows() * self.tile_cols()
    }

    /// Bytes of the tiled bucket layout: `n_tiles * TILE_BYTES`.
    pub const fn tiled_bytes(&self) -> usize {
        self.n_tiles() * TILE_BYTES
    }
}

/// Bytes of the tiled bucket layout of a `[rows, cols]` tensor.
pub const fn tiled_bytes(rows: usize, cols: usize) -> usize {
    MxShape::new(rows, cols).tiled_bytes()
}

/// Returns `Err(BufferLength)` unless `got == expected`.
#[inline]
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), MxError> {
    if expected == got {
        Ok(())
    } else {
        Err(MxError::BufferLength {
            what,
            expected,
            got,
        })
    }
}
