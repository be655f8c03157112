//! Runtime formats and how many bucket bytes a parameter takes in each.
//!
//! * `F32` / `Bf16`: the parameter's elements in row-major order, 4 or 2 bytes each.
//! * `Mxfp8`: the parameter's 2-D view `[rows, cols]` is zero-padded to multiples of 32 and cut
//!   into 32×32 tiles in row-major tile order. Each tile takes [`MX_TILE_BYTES`] = 2112 bytes:
//!   row-wise plane data (1024, blocks along columns, for the forward GEMM), its 32 E8M0 scales,
//!   column-wise plane data (1024, the tile transposed, blocks along rows, for the dgrad GEMM)
//!   and its 32 scales. The codec for this layout lives in `sshsdp-mx` (`encode_tiles`); the
//!   constants here must agree with it (a facade test checks).
//!
//!   Tiling both planes per 32×32 tile is what lets the *owner of a tile range* re-derive both
//!   planes from its own fp32 master elements — a column-wise block needs 32 rows, which a
//!   row-major split of the matrix would cut.

use serde::{Deserialize, Serialize};

use crate::ParamSpec;

/// Elements per MX scaling block.
pub const MX_BLOCK: u64 = 32;
/// Side of an MX tile (32×32 elements).
pub const MX_TILE: u64 = 32;
/// Bytes of one MXFP8 tile: 1024 + 32 (row plane) + 1024 + 32 (column plane).
pub const MX_TILE_BYTES: u64 = 2 * (MX_TILE * MX_TILE + MX_TILE);

/// Format of the runtime parameters that kernels consume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RuntimeFormat {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// MXFP8 (E4M3 elements, E8M0 scales) in the tiled two-plane layout above.
    Mxfp8,
}

impl RuntimeFormat {
    /// Bytes one element takes for the linear formats; `None` for tiled MXFP8.
    pub fn element_bytes(self) -> Option<u64> {
        match self {
            RuntimeFormat::F32 => Some(4),
            RuntimeFormat::Bf16 => Some(2),
            RuntimeFormat::Mxfp8 => None,
        }
    }
}

/// The tile grid of a parameter in MXFP8: its 2-D view and the number of 32×32 tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MxGrid {
    /// Rows of the 2-D view.
    pub rows: u64,
    /// Columns of the 2-D view (the contiguous dimension).
    pub cols: u64,
}

impl MxGrid {
    /// The grid of a spec's 2-D view.
    pub fn of(spec: &ParamSpec) -> Self {
        let (rows, cols) = spec.matrix_dims();
        Self { rows, cols }
    }

    /// Tile rows (`ceil(rows / 32)`).
    pub fn tile_rows(&self) -> u64 {
        self.rows.div_ceil(MX_TILE)
    }

    /// Tile columns (`ceil(cols / 32)`).
    pub fn tile_cols(&self) -> u64 {
        self.cols.div_ceil(MX_TILE)
    }

    /// Number of tiles.
    pub fn tiles(&self) -> u64 {
        self.tile_rows() * self.tile_cols()
    }

    /// Padded element count (`tiles · 1024`).
    pub fn padded_elements(&self) -> u64 {
        self.tiles() * MX_TILE * MX_TILE
    }

    /// Real (unpadded) elements held by tiles `[0, tile)` in row-major tile order.
    pub fn elements_before(&self, tile: u64) -> u64 {
        let tc = self.tile_cols();
        let (full_rows, rest) = (tile / tc, tile % tc);
        let above = (full_rows * MX_TILE).min(self.rows) * self.cols;
        let height = self.rows.saturating_sub(full_rows * MX_TILE).min(MX_TILE);
        above + height * (rest * MX_TILE).min(self.cols)
    }

    /// Real elements held by tiles `[start, end)`.
    pub fn elements_in(&self, start: u64, end: u64) -> u64 {
        self.elements_before(end) - self.elements_before(start)
    }
}

/// Bytes a parameter takes in the bucket buffer in `format`.
pub fn region_bytes(spec: &ParamSpec, format: RuntimeFormat) -> u64 {
    match format.element_bytes() {
        Some(size) => spec.numel() * size,
        None => MxGrid::of(spec).tiles() * MX_TILE_BYTES,
    }
}

/// The format a parameter gets when `requested` is asked for, and why it fell back if it did.
///
/// MXFP8 needs a parameter with at least two dimensions whose tile padding stays within
/// `mx_max_padding` (padded / real − 1); other parameters fall back to bf16.
pub fn resolve_format(
    spec: &ParamSpec,
    requested: RuntimeFormat,
    mx_max_padding: f64,
) -> (RuntimeFormat, Option<String>) {
    if requested != RuntimeFormat::Mxfp8 {
        return (requested, None);
    }
    if spec.shape.len() < 2 {
        return (
            RuntimeFormat::Bf16,
            Some(format!(
                "{}-D parameter has no GEMM layout",
                spec.shape.len()
            )),
        );
    }
    let grid = MxGrid::of(spec);
    let overhead = grid.padded_elements() as f64 / spec.numel() as f64 - 1.0;
    if overhead > mx_max_padding {
        return (
            RuntimeFormat::Bf16,
            Some(format!(
                "{}x{} pads to {:.1}% more elements in 32x32 tiles (limit {:.1}%)",
                grid.rows,
                grid.cols,
                overhead * 100.0,
                mx_max_padding * 100.0
            )),
        );
    }
    (RuntimeFormat::Mxfp8, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn tile_prefix_counts_real_elements() {
        for (rows, cols) in [(1, 1), (33, 7), (64, 65), (100, 100), (32, 32), (5, 200)] {
            let grid = MxGrid { rows, cols };
            let mut count = 0;
            for t in 0..grid.tiles() {
                assert_eq!(grid.elements_before(t), count, "{rows}x{cols} tile {t}");
                let (tr, tc) = (t / grid.tile_cols(), t % grid.tile_cols());
                let h = (rows - tr * 32).min(32);
                let w = (cols - tc * 32).min(32);
                count += h * w;
            }
            assert_eq!(grid.elements_before(grid.tiles()), rows * cols);
        }
    }

    #[test]
    fn mx_falls_back_for_vectors_and_thin_matrices() {
        let v = ParamSpec::new("norm", vec![64], DType::F32);
        assert_eq!(
            resolve_format(&v, RuntimeFormat::Mxfp8, 0.125).0,
            RuntimeFormat::Bf16
        );
        let thin = ParamSpec::new("w", vec![4096, 8], DType::F32);
        let (f, why) = resolve_format(&thin, RuntimeFormat::Mxfp8, 0.125);
        assert_eq!(f, RuntimeFormat::Bf16);
        assert!(why.unwrap().contains("pads"));
        let m = ParamSpec::new("w", vec![256, 512], DType::F32);
        assert_eq!(
            resolve_format(&m, RuntimeFormat::Mxfp8, 0.125),
            (RuntimeFormat::Mxfp8, None)
        );
        assert_eq!(
            region_bytes(&m, RuntimeFormat::Mxfp8),
            8 * 16 * MX_TILE_BYTES
        );
        assert_eq!(region_bytes(&m, RuntimeFormat::Bf16), 256 * 512 * 2);
        assert_eq!(MX_TILE_BYTES, 2112);
    }
}
