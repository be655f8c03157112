//! CubeCL kernels for SS-HSDP, generic over the CubeCL runtime (features `wgpu`, the
//! default, and `cuda`).
//!
//! The crate has two wings: the **production** kernels, which the training runtime calls, and
//! the **lab**, kernels no training path calls, built only with the feature `experimental`
//! (off by default). Start from the production list; the lab is there to be measured, not
//! used.
//!
//! # Production (always built)
//! Called by `sshsdp-backend` on CubeCL backends (`crates/sshsdp-backend/src/storage/cube/`):
//! - [`quantize_square`] / [`dequantize_square`] (`square.rs`) — square-block MXFP8 (E4M3
//!   elements, one E8M0 scale per 32×32 tile, [`ScaleRule`] RCEIL or FLOOR) of a rectangle of
//!   a row-major matrix, read from or written to a strided `f32` buffer ([`SquareAt`]): the
//!   plan's runtime layout of MXFP8 weights, bit-identical to `sshsdp_mx::encode_square` /
//!   `decode_square`.
//! - [`narrow_bf16`] / [`widen_bf16`] (`bf16.rs`) — the layout's bf16 runs from and to `f32`,
//!   bit-identical to `half`'s conversions.
//! - [`decode_table`] / [`encode_table`] over a [`CodecTable`] of [`CodecEntry`]s
//!   (`codec_table.rs`) — a bucket's whole codec (every rectangle and bf16 run) in one launch
//!   to decode and two to encode, through the same per-value functions as the kernels above, so
//!   bit-identical to them. Called by `storage/cube/codec.rs` (decode of gathered buckets,
//!   re-derive of updated pieces); the single-entry kernels above serve the device check and
//!   the lab, and are what the table kernels are tested against.
//! - [`copy_units`] / [`accumulate_units`] / [`store_units`] with [`SumDType`] (`exchange.rs`)
//!   — the collectives' moves between buffers of one device (ranks sharing it). Called by
//!   `storage/cube/exchange.rs`.
//! - What they share: [`InputDType`] and the launch grids (`common.rs`), the E4M3/E8M0 bit
//!   codec and [`round_bf16()`] ([`e4m3`]), [`KernelError`] and the size checks (`error.rs`).
//! - [`check`] — the device check behind the `gpu_check` (CUDA) and `gpu_check_wgpu`
//!   binaries: the square-block codec and AdamW always, the lab kernels with `experimental`.
//!
//! - [`launch_mark`] (`marks.rs`) — two one-element kernels that mark an update's start and end
//!   in CubeCL's profiling log, for counting launches (`scripts/count_launches`); launched by
//!   `storage/cube/mod.rs` only under `SSHSDP_LAUNCH_MARKS=1`.
//!
//! Also always built, though no training path calls it yet: [`adamw_step`] (`adamw.rs`) —
//! fused AdamW over flat `f32` shards with burn-optim 0.21's semantics, kept outside the lab
//! because the device optimizer step is to be built from it.
//!
//! # Lab (feature `experimental`)
//! Nothing in the runtime calls these; they stay for the lab tests (`tests/kernels/`: `mxfp8`,
//! `planes`, `matmul`, `optim`) and the device check's lab rows (MX matmul against the `f32`
//! GEMM, Newton–Schulz rates: `scripts/gpu_check.sh`, `scripts/device/h200.sh`, which build
//! `gpu_check` with `sshsdp-kernels/experimental`):
//! - `quantize_tiled` / `dequantize_tiled` (`quantize.rs`, `dequantize.rs`, `layout`) — the
//!   retired two-plane tiled bucket layout of `sshsdp-mx` (32x32 tiles of 2112 bytes: row data,
//!   row scales, column data, column scales), bit-identical to `sshsdp_mx::encode_tiled` /
//!   `decode_tiled`.
//! - `quantize_plane` / `dequantize_plane` (`planes.rs`) — one 1×32 MXFP8 plane (row- or
//!   column-wise) of a run of 32-row bands, bit-identical to `sshsdp_mx::encode_rows` /
//!   `encode_cols` and their decodes (the two-plane layout the runtime no longer uses).
//! - `mx_matmul` (`matmul.rs`) — `C = A · Bᵀ` with both operands MXFP8 in the tiled layout,
//!   dequantised in the load stage, `f32` accumulation.
//! - `gemm` (`gemm.rs`) — strided `f32` GEMM `C = alpha · A · B + beta · D` (any
//!   transposition).
//! - `ns_step` / `newton_schulz` (`newton_schulz.rs`) — Muon's quintic Newton–Schulz step
//!   (three GEMMs) and the whole orthogonalisation of `sshsdp_optim::newton_schulz` in `f32`.
//! - Their helpers: `e4m3::encode_word` (the word-at-a-time encoder of the tiled and plane
//!   quantisers), the re-export of `sshsdp_mx::Plane`, the device check's `check/lab.rs`.
//!
//! Run the lab's tests with `cargo test -p sshsdp-kernels --features experimental` (CI does:
//! `.ci/run` passes `sshsdp-kernels/experimental`).
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
//! `tests/` run the kernels on wgpu (lavapipe on CPU-only machines; they fail, not skip,
//! without an adapter) against the CPU references on seeded random data and edge cases: the
//! production kernels always, the lab's with `experimental`. [`check`] is the device check
//! behind the `gpu_check` (CUDA) and `gpu_check_wgpu` binaries and `scripts/gpu_check.sh`.

#![deny(missing_docs)]

mod adamw;
mod bf16;
pub mod check;
mod codec_table;
mod common;
pub mod e4m3;
mod error;
mod exchange;
mod marks;
mod square;

#[cfg(feature = "experimental")]
mod dequantize;
#[cfg(feature = "experimental")]
mod gemm;
#[cfg(feature = "experimental")]
pub mod layout;
#[cfg(feature = "experimental")]
mod matmul;
#[cfg(feature = "experimental")]
mod newton_schulz;
#[cfg(feature = "experimental")]
mod planes;
#[cfg(feature = "experimental")]
mod quantize;

// Production: what `sshsdp-backend` calls (and the AdamW step the device optimizer will use).
pub use adamw::{adamw_reference, adamw_step, AdamWFactors, AdamWParams};
pub use bf16::{narrow_bf16, widen_bf16};
pub use codec_table::{decode_table, encode_table, CodecEntry, CodecTable, DecodeTo};
pub use common::InputDType;
pub use e4m3::round_bf16;
pub use error::KernelError;
pub use exchange::{accumulate_units, copy_units, store_units, SumDType};
pub use marks::{launch_mark, LaunchMark};
pub use square::{dequantize_square, quantize_square, SquareAt};
pub use sshsdp_mx::ScaleRule;

// Lab (`experimental`): no training path calls these.
#[cfg(feature = "experimental")]
pub use dequantize::dequantize_tiled;
#[cfg(feature = "experimental")]
pub use gemm::{gemm, MatRef};
#[cfg(feature = "experimental")]
pub use matmul::mx_matmul;
#[cfg(feature = "experimental")]
pub use newton_schulz::{
    newton_schulz, ns_step, NsPrecision, NsWorkspace, NS_COEFFICIENTS, NS_EPS,
};
#[cfg(feature = "experimental")]
pub use planes::{dequantize_plane, quantize_plane, PlaneAt};
#[cfg(feature = "experimental")]
pub use quantize::quantize_tiled;
#[cfg(feature = "experimental")]
pub use sshsdp_mx::Plane;
