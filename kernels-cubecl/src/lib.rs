//! CubeCL kernels for SS-HSDP, generic over the CubeCL runtime (features `wgpu`, the
//! default, and `cuda`).
//!
//! # Kernels
//! - [`quantize_tiled`] — MXFP8 (E4M3 elements, E8M0 scales, [`ScaleRule`] RCEIL or FLOOR)
//!   of a row-major `[rows, cols]` `f32` or `bf16` tensor into the tiled bucket layout of
//!   `sshsdp-mx` (32x32 tiles of 2112 bytes: row data, row scales, column data, column
//!   scales), written in place at a word offset of a `u32` bucket buffer. NaN/±inf in a block
//!   give the 0xFF scale and NaN bytes, all-zero blocks the 0x00 scale, padding to 32 in both
//!   dimensions is zero. Bit-identical to `sshsdp_mx::encode_tiled`.
//! - [`dequantize_tiled`] — one plane ([`Plane::Row`] or [`Plane::Col`]) of the tiled layout
//!   back to row-major `f32`, bit-identical to `sshsdp_mx::decode_tiled`.
//! - [`quantize_square`] / [`dequantize_square`] — square-block MXFP8 (one scale per 32×32
//!   tile) of a rectangle of a row-major matrix, read from or written to a strided `f32`
//!   buffer: the plan's runtime layout of MXFP8 weights, bit-identical to
//!   `sshsdp_mx::encode_square` / `decode_square`; [`narrow_bf16`] / [`widen_bf16`] — the
//!   layout's bf16 runs from and to `f32`, bit-identical to `half`'s conversions.
//! - [`quantize_plane`] / [`dequantize_plane`] — one 1×32 MXFP8 plane (row- or column-wise) of
//!   a run of 32-row bands, bit-identical to `sshsdp_mx::encode_rows` / `encode_cols` and their
//!   decodes (the two-plane layout the runtime no longer uses; kept for kernels that want
//!   1×32 operands).
//! - [`mx_matmul`] — `C = A · Bᵀ` with both operands MXFP8 in the tiled layout (the forward
//!   GEMM `y = x Wᵀ`), dequantised in the load stage, `f32` accumulation.
//! - [`gemm`] — strided `f32` GEMM `C = alpha · A · B + beta · D` (any transposition).
//! - [`ns_step`] / [`newton_schulz`] — Muon's quintic Newton–Schulz step (three GEMMs) and the
//!   whole orthogonalisation of `sshsdp_optim::newton_schulz` in `f32`.
//! - [`adamw_step`] — fused AdamW over flat `f32` shards with burn-optim 0.21's semantics.
//!
//! # Numerics without fp8 types
//! WGSL has no 8-bit types and lavapipe (Mesa's software Vulkan) no fp8 conversions, so
//! E4M3/E8M0 are encoded and decoded with integer bit operations on `u32` words, four bytes
//! per word in little-endian order (the byte layout of `sshsdp-mx`'s buffers); see [`e4m3`].
//! The quantiser uses a float encoder where it is exact on every device (scale bytes from
//! [`e4m3::FAST_MIN_SCALE`] on: no dependence on subnormal flushing) and the integer encoder
//! below it.
//!
//! # Host API
//! Every function takes a [`ComputeClient`](cubecl::prelude::ComputeClient) and
//! [`Handle`](cubecl::server::Handle)s (untyped buffers: a Burn tensor's handle can be passed
//! as is), checks buffer sizes and 32-bit index ranges, launches, and returns without waiting
//! ([`KernelError`] when a check fails).
//!
//! # Tests and device check
//! `tests/` run every kernel on wgpu (lavapipe on CPU-only machines; they fail, not skip,
//! without an adapter) against the CPU references on seeded random data and edge cases.
//! [`check`] is the device check behind the `gpu_check` (CUDA) and `gpu_check_wgpu` binaries
//! and `scripts/gpu_check.sh`.

#![deny(missing_docs)]

mod adamw;
mod bf16;
pub mod check;
mod dequantize;
pub mod e4m3;
mod error;
mod exchange;
mod gemm;
pub mod layout;
mod matmul;
mod newton_schulz;
mod planes;
mod quantize;
mod square;

pub use adamw::{adamw_reference, adamw_step, AdamWFactors, AdamWParams};
pub use bf16::{narrow_bf16, widen_bf16};
pub use dequantize::dequantize_tiled;
pub use e4m3::round_bf16;
pub use error::KernelError;
pub use exchange::{accumulate_units, copy_units, store_units, SumDType};
pub use gemm::{gemm, MatRef};
pub use matmul::mx_matmul;
pub use newton_schulz::{
    newton_schulz, ns_step, NsPrecision, NsWorkspace, NS_COEFFICIENTS, NS_EPS,
};
pub use planes::{dequantize_plane, quantize_plane, PlaneAt};
pub use quantize::{quantize_tiled, InputDType};
pub use square::{dequantize_square, quantize_square, SquareAt};
pub use sshsdp_mx::{Plane, ScaleRule};
