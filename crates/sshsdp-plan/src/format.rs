//! Runtime formats and the byte sizes of a parameter's encoding in each.
//!
//! * `F32` / `Bf16`: the parameter's elements in row-major order, 4 or 2 bytes each.
//! * `Mxfp8`: the parameter's 2-D view `[rows, cols]` (its last dimension is `cols`) as a run of
//!   **bands** of [`MX_BAND`] = 32 rows (the last one may be shorter). A band is encoded as two
//!   planes (OCP MX, E4M3 elements with one E8M0 scale per block of 32):
//!   the *row-wise* plane (blocks of 32 along columns: `rows · cols_p` data bytes and
//!   `rows · cols_p / 32` scales, `cols_p` = `cols` rounded up to 32), which backward's
//!   `dy · Wᵀ` consumes, and the *column-wise* plane (blocks of 32 along rows, stored transposed:
//!   `cols · rows_p` data bytes and `cols · rows_p / 32` scales), which forward's `x · W`
//!   consumes. These are exactly `sshsdp-mx`'s `encode_rows` / `encode_cols` of the band, and a
//!   band's blocks are exactly the whole matrix's blocks, so the encoded values do not depend on
//!   where a matrix is cut into bands (a facade test checks the sizes against `sshsdp-mx`).
//!
//!   Cutting at band edges is what lets the owner of a run of bands re-derive both planes from
//!   its own fp32 master rows: a column-wise block needs 32 rows, which any finer cut would
//!   split.

use serde::{Deserialize, Serialize};

use crate::ParamSpec;

/// Elements per MX scaling block.
pub const MX_BLOCK: u64 = 32;
/// Rows of an MXFP8 band: the height of a column-wise block, the finest cut of an MXFP8 matrix.
pub const MX_BAND: u64 = 32;

/// Format of the runtime parameters that kernels consume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RuntimeFormat {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// MXFP8 (E4M3 elements, E8M0 scales), row-wise and column-wise planes of 32-row bands.
    Mxfp8,
}

impl RuntimeFormat {
    /// Bytes one element takes for the linear formats; `None` for MXFP8.
    pub fn element_bytes(self) -> Option<u64> {
        match self {
            RuntimeFormat::F32 => Some(4),
            RuntimeFormat::Bf16 => Some(2),
            RuntimeFormat::Mxfp8 => None,
        }
    }
}

/// Bytes of the row-wise plane (data and scales) of a `rows × cols` run of an MXFP8 matrix.
pub fn mx_row_plane_bytes(rows: u64, cols: u64) -> u64 {
    let cols_p = cols.next_multiple_of(MX_BLOCK);
    rows * cols_p + rows * (cols_p / MX_BLOCK)
}

/// Bytes of the column-wise plane (data and scales) of a `rows × cols` run of an MXFP8 matrix.
pub fn mx_col_plane_bytes(rows: u64, cols: u64) -> u64 {
    let rows_p = rows.next_multiple_of(MX_BLOCK);
    cols * rows_p + cols * (rows_p / MX_BLOCK)
}

/// Bytes of both planes of one full band of a matrix with `cols` columns.
pub fn mx_band_bytes(cols: u64) -> u64 {
    mx_row_plane_bytes(MX_BAND, cols) + mx_col_plane_bytes(MX_BAND, cols)
}

/// Bytes a parameter's runtime encoding takes in `format` (both planes for MXFP8).
pub fn encoded_bytes(spec: &ParamSpec, format: RuntimeFormat) -> u64 {
    match format.element_bytes() {
        Some(size) => spec.numel() * size,
        None => {
            let (rows, cols) = spec.matrix_dims();
            mx_row_plane_bytes(rows, cols) + mx_col_plane_bytes(rows, cols)
        }
    }
}

/// The format a parameter gets when `requested` is asked for, and why it fell back if it did.
///
/// MXFP8 needs a parameter with at least two dimensions whose block padding stays within
/// `mx_max_padding`: the larger plane's padded elements (`rows · cols_p` or `rows_p · cols`)
/// over the real ones, minus one. Other parameters fall back to bf16.
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
    let (rows, cols) = spec.matrix_dims();
    let padded =
        (rows * cols.next_multiple_of(MX_BLOCK)).max(rows.next_multiple_of(MX_BLOCK) * cols);
    let overhead = padded as f64 / spec.numel() as f64 - 1.0;
    if overhead > mx_max_padding {
        return (
            RuntimeFormat::Bf16,
            Some(format!(
                "{rows}x{cols} pads to {:.1}% more elements in blocks of 32 (limit {:.1}%)",
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
        // 256 x 512: both planes hold every element once plus one scale per 32.
        assert_eq!(encoded_bytes(&m, RuntimeFormat::Mxfp8), 2 * 33 * 256 * 16);
        assert_eq!(encoded_bytes(&m, RuntimeFormat::Bf16), 256 * 512 * 2);
        assert_eq!(mx_band_bytes(96), 33 * (96 + 96));
    }

    #[test]
    fn band_sizes_add_up_to_the_matrix() {
        for (rows, cols) in [(1, 1), (33, 7), (64, 65), (100, 100), (32, 32), (70, 200)] {
            let full = mx_row_plane_bytes(rows, cols);
            let bands: u64 = (0..rows.div_ceil(MX_BAND))
                .map(|i| mx_row_plane_bytes((rows - i * MX_BAND).min(MX_BAND), cols))
                .sum();
            assert_eq!(bands, full, "row planes of {rows}x{cols}");
            let full = mx_col_plane_bytes(rows, cols);
            let bands: u64 = (0..rows.div_ceil(MX_BAND))
                .map(|i| mx_col_plane_bytes((rows - i * MX_BAND).min(MX_BAND), cols))
                .sum();
            assert_eq!(bands, full, "column planes of {rows}x{cols}");
        }
    }
}
