//! Runtime formats and the byte sizes of a parameter's encoding in each.
//!
//! * `F32` / `Bf16`: the parameter's elements in row-major order, 4 or 2 bytes each.
//! * `Mxfp8`: **square-block** MXFP8 of the parameter's 2-D view `[rows, cols]` (its last
//!   dimension is `cols`): E4M3 elements, one byte each, and one E8M0 scale (RCEIL) per 32×32
//!   tile of the view padded to multiples of 32 — `rows · cols + ⌈rows/32⌉·⌈cols/32⌉` bytes,
//!   ≈ 1 + 1/1024 per element, about half of bf16 ([`crate::tiles`], `sshsdp-mx`'s
//!   `encode_square`). A tile's scale covers every 1×32 block (what backward's `dy · Wᵀ`
//!   contracts over) and every 32×1 block (forward's `x · W`) inside it, so this one encoding
//!   serves both passes: forward and backward see the same quantised weights, and one copy is
//!   gathered whether or not buckets are resharded after forward. Cutting at tile edges is what
//!   lets the owner of a run of tiles re-derive them from its own fp32 masters.
//!
//!   The finer 1×32 two-plane layout (a row-wise plane for backward, a column-wise one for
//!   forward: 2.06 bytes per element, more than bf16) is retired from the runtime: it moved
//!   more bytes than bf16 whenever a bucket was kept through backward, and its per-element
//!   fidelity gain did not show in training (docs/MXFP8.md has the measurements and the rule).
//!   `sshsdp-mx` keeps both codecs.

use serde::{Deserialize, Serialize};

use crate::tiles::TileGrid;
use crate::ParamSpec;

/// Elements per MX scaling block.
pub const MX_BLOCK: u64 = 32;

/// Format of the runtime parameters that kernels consume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RuntimeFormat {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// Square-block MXFP8: E4M3 elements, one E8M0 scale per 32×32 tile.
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

/// Bytes a parameter's runtime encoding takes in `format` (elements and tile scales for
/// MXFP8).
pub fn encoded_bytes(spec: &ParamSpec, format: RuntimeFormat) -> u64 {
    match format.element_bytes() {
        Some(size) => spec.numel() * size,
        None => {
            let (rows, cols) = spec.matrix_dims();
            TileGrid::new(rows, cols).encoded_bytes()
        }
    }
}

/// The format a parameter gets when `requested` is asked for, and why it fell back if it did.
///
/// MXFP8 needs a parameter with at least two dimensions whose tile padding stays within
/// `mx_max_padding`: the elements of its tiles, both dimensions padded to 32
/// (`rows_p · cols_p`), over the real ones, minus one. The padding is never stored, but a
/// partial tile shares one scale among fewer values and an MX GEMM would pad it. Other
/// parameters fall back to bf16.
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
    let padded = rows.next_multiple_of(MX_BLOCK) * cols.next_multiple_of(MX_BLOCK);
    let overhead = padded as f64 / spec.numel() as f64 - 1.0;
    if overhead > mx_max_padding {
        return (
            RuntimeFormat::Bf16,
            Some(format!(
                "{rows}x{cols} pads to {:.1}% more elements in 32x32 tiles (limit {:.1}%)",
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
        // Both dimensions' padding counts: 40 x 40 pads to 64 x 64 (2.56x), 33 x 64 to 64 x 64.
        let square = ParamSpec::new("w", vec![40, 40], DType::F32);
        assert_eq!(
            resolve_format(&square, RuntimeFormat::Mxfp8, 1.5).0,
            RuntimeFormat::Bf16
        );
        assert_eq!(
            resolve_format(&square, RuntimeFormat::Mxfp8, 1.6).0,
            RuntimeFormat::Mxfp8
        );
        let m = ParamSpec::new("w", vec![256, 512], DType::F32);
        assert_eq!(
            resolve_format(&m, RuntimeFormat::Mxfp8, 0.125),
            (RuntimeFormat::Mxfp8, None)
        );
        // 256 x 512: one byte per element, one scale per 32 x 32 tile.
        assert_eq!(encoded_bytes(&m, RuntimeFormat::Mxfp8), 256 * 512 + 8 * 16);
        assert_eq!(encoded_bytes(&m, RuntimeFormat::Bf16), 256 * 512 * 2);
        let odd = ParamSpec::new("w", vec![70, 96], DType::F32);
        assert_eq!(encoded_bytes(&odd, RuntimeFormat::Mxfp8), 70 * 96 + 3 * 3);
    }
}
