//! MXFP8 reference codec (OCP Microscaling v1.0) on the CPU: E4M3/E5M2 elements with one
//! E8M0 scale per block of 32 values, written into caller-provided byte buffers so that
//! bucket storage can hold the encoded tensors in place.
//!
//! # Numerics
//! - Element encode of `x / scale`: round-to-nearest-even, saturating to `±max_elem`
//!   (satfinite: E5M2 never produces inf from a finite input). Bit manipulation on the f32
//!   bits; decode is exact (a product beyond the f32 range, only possible for `amax` within
//!   one element ulp of `f32::MAX`, decodes to ±inf).
//! - Scale ([`ScaleRule`]): RCEIL `2^ceil(log2(amax / max_elem))` (default) or FLOOR
//!   `2^(floor(log2(amax)) - emax_elem)`, both by integer arithmetic on the f32 exponent and
//!   mantissa of `amax`, clamped to the E8M0 range `[2^-127, 2^127]` (bytes `0..=254`).
//! - **All-zero block** (`amax == 0`, including padding): scale byte `0x00` (`2^-127`,
//!   which both rules give after clamping); the elements are ±0 (`0x00`, or `0x80` for
//!   `-0.0` inputs: the sign of zero is kept, like every other element).
//! - **NaN or ±inf anywhere in a block**: scale byte `0xFF` (NaN) and every element byte set
//!   to the format's NaN ([`ElemFormat::nan_byte`]: `0x7F` E4M3, `0x7E` E5M2). The whole
//!   block decodes to NaN. Infinity is treated like NaN as in OCP implementations, where
//!   `amax = inf` yields a NaN shared exponent.
//! - Inputs: `f32` and `half::bf16` ([`MxInput`]).
//!
//! # Layouts
//! For a row-major tensor `[rows, cols]`, `cols_p = round_up(cols, 32)` and
//! `rows_p = round_up(rows, 32)`. The tensor is logically zero-padded to
//! `[rows_p, cols_p]`: padded positions encode as `0x00` (and padded blocks get the
//! all-zero scale `0x00`); decoders ignore them.
//! - **Row-wise plane** ([`encode_rows`], forward GEMM): data `rows x cols_p` bytes
//!   row-major; scales `rows x cols_p/32` bytes, block `(r, cb)` at `r * cols_p/32 + cb`.
//! - **Column-wise plane** ([`encode_cols`], backward GEMM): blocks along rows, stored
//!   transposed: data `cols x rows_p` bytes, element `(r, c)` at `c * rows_p + r`; scales
//!   `cols x rows_p/32` bytes, block `(c, rb)` at `c * rows_p/32 + rb`.
//! - **Tiled bucket layout** ([`encode_tiled`]): the padded tensor is cut into 32x32 tiles in
//!   row-major tile order (tile `(tr, tc)` is number `tr * cols_p/32 + tc`). Each tile is
//!   exactly [`TILE_BYTES`] = 2112 bytes:
//!   `[row data 1024: byte r*32 + c][row scales 32: one per tile row]`
//!   `[col data 1024: byte c*32 + r][col scales 32: one per tile column]`
//!   (offsets [`TILE_ROW_DATA`], [`TILE_ROW_SCALES`], [`TILE_COL_DATA`],
//!   [`TILE_COL_SCALES`]). Its row (column) scales equal the row (column) plane's scales of
//!   the same blocks. [`encode_tiled_range`] encodes only tiles `[t0, t1)` into a buffer of
//!   `(t1 - t0) * TILE_BYTES`; [`decode_tiled_range`] decodes such a buffer into the tiles'
//!   positions of the full row-major `f32` tensor.
//!
//! Every function checks buffer lengths exactly and returns [`MxError`] instead of
//! panicking. The [`par`] functions split the work over threads with byte-identical output.
//!
//! # Performance
//! Kernels work a block (or a 32x32 tile) at a time with branch-free, auto-vectorised loops
//! (column blocks: vertical amax, encode in row order, 8x8 `u64` byte transposes). On
//! x86-64 the same portable code is also instantiated inside an AVX2 function chosen at run
//! time (the crate's only `unsafe`: calling it after `is_x86_feature_detected!("avx2")`).

#![deny(missing_docs)]

mod block;
mod error;
mod format;
mod input;
pub mod par;
mod plane;
mod scale;
mod shape;
mod simd;
mod square;
mod tile;
mod tiled;

pub use block::{decode_block, encode_block};
pub use error::MxError;
pub use format::{ElemFormat, ScaleRule};
pub use input::MxInput;
pub use plane::{decode_cols, decode_rows, encode_cols, encode_rows};
pub use scale::{scale_byte, scale_to_f32, SCALE_MAX, SCALE_NAN, SCALE_ZERO_BLOCK};
pub use shape::{round_up32, tiled_bytes, MxShape};
pub use square::{decode_square, encode_square};
pub use tiled::{
    decode_tiled, decode_tiled_range, encode_tiled, encode_tiled_range, Plane, TILE_COL_DATA,
    TILE_COL_SCALES, TILE_ROW_DATA, TILE_ROW_SCALES,
};

/// Values per MX block (one E8M0 scale each).
pub const BLOCK: usize = 32;
/// Side of the square tiles of the tiled bucket layout.
pub const TILE: usize = 32;
/// Bytes per tile of the tiled layout: row data, row scales, column data, column scales.
pub const TILE_BYTES: usize = 2 * TILE * TILE + 2 * TILE;
