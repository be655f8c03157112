//! `Hsdp<B>` over a CubeCL backend: `Autodiff<Hsdp<Wgpu>>` trains a small GPT and follows the
//! same losses as `Autodiff<Hsdp<NdArray>>` (float differences between the backends' kernels
//! only). On a CPU-only machine wgpu runs over Mesa's lavapipe; run with
//! `cargo test --features wgpu --test wgpu_backend`.
//!
//! * **Device storage against NdArray, pairwise**: fp32 masters, AdamW state and gradient
//!   buckets on the Wgpu device, runtime bytes re-derived there, against host storage on NdArray:
//!   f32 losses within 1e-5, bf16/MXFP8 within 2e-3, for a pairwise subset of format × optimizer
//!   × mesh × reshard (6 runs); `SSHSDP_WGPU_MATRIX=full` runs all 24.
//! * **The storage seam's proof on a device**: device storage trains bitwise like host storage
//!   on the same device (the same kernels step the same values), and its host↔device bytes are
//!   the host storage's plus each piece's gradient up and its runtime bytes down.
//! * **Checkpoints**: device storage saved at world 2 resumes at world 1, bit for bit.
//! * **16-bit compute on the device**: parameters as f16 views of a bucket decoded on the device
//!   (lavapipe has no bf16; CUDA runs the same path in bf16) train like f32 parameters.
//! * bf16 and MXFP8 on Wgpu against NdArray with host storage.

//! * **Fusion** (`fusion.rs`): `Wgpu` above is burn-wgpu's default type, burn-fusion over
//!   CubeCL with autotune, as Burn's users run it; the same jobs on `CubeBackend` without fusion
//!   and on plain Burn (unsharded, Burn's own AdamW) give the same losses and weights within
//!   stated tolerances; views share one allocation; a checkpoint of a fused run resumes on the
//!   unfused backend and on NdArray.

#[path = "../common/mod.rs"]
mod common;
mod fusion;
mod harness;
mod storage;
