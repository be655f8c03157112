//! `Hsdp<B>` over a CubeCL backend: `Autodiff<Hsdp<Wgpu>>` trains a small GPT and follows the
//! same losses as `Autodiff<Hsdp<NdArray>>` (float differences between the backends' kernels
//! only). On a CPU-only machine wgpu runs over Mesa's lavapipe; run with
//! `cargo test --features wgpu --test wgpu_backend`.
//!
//! The ranks of a test share the wgpu device, so by default their collectives run on device
//! buffers (the threads engine's peers collectives: the production device path above world 1);
//! `Case::staged` runs them through host memory instead, as engines without device collectives do.
//!
//! * **The device path** (`device_path.rs`): at world 2, 2×2 and 4 a step moves no parameter or
//!   gradient byte between host and device (the gradient norm's 4 bytes aside), and trains like
//!   the staged path.
//! * **Device storage against NdArray, pairwise** (device path): fp32 masters, AdamW state,
//!   gradient buckets and runtime shards on the Wgpu device, against host storage on NdArray at
//!   the same world size: f32 losses within 1e-5, bf16/MXFP8 within 2e-3, for a pairwise subset
//!   of format × mesh (flat 2, flat 4, 2×2) × sharding (hierarchical, HSDP) × optimizer (9 runs,
//!   reshard alternating); `SSHSDP_WGPU_MATRIX=full` runs 24.
//! * **The storage seam's proof on a device** (staged): device storage trains bitwise like host
//!   storage on the same device (the same kernels step the same values), and its host↔device
//!   bytes are the host storage's plus each piece's gradient up and its runtime bytes down.
//! * **Checkpoints**: device storage saved at world 2 on the device path resumes at world 1.
//! * **16-bit compute on the device**: parameters as f16 views of a bucket decoded on the device
//!   (lavapipe has no bf16; CUDA runs the same path in bf16) train like f32 parameters.
//! * MXFP8 in many buckets on Wgpu against NdArray, host and device storage.

//! * **Fusion** (`fusion.rs`): `Wgpu` above is burn-wgpu's default type, burn-fusion over
//!   CubeCL with autotune, as Burn's users run it; the same jobs on `CubeBackend` without fusion
//!   and on plain Burn (unsharded, Burn's own AdamW) give the same losses and weights within
//!   stated tolerances; views share one allocation; a checkpoint of a fused run resumes on the
//!   unfused backend and on NdArray.
//! * **Distributed Muon on the device path** (`device_path.rs`): nothing read back at world 1, 2
//!   and 2×2, trains like host Muon; a rank abandoning its update fails its peer in the device
//!   all-reduce, bounded.
//! * **The world-1 device step** (`verdict.rs`): the verdict read at commit; a non-finite step
//!   applies nothing (bitwise the run without that batch), fused and not.

#[path = "../common/mod.rs"]
mod common;
mod device_path;
mod fusion;
mod harness;
mod storage;
mod verdict;
