//! The kernels on wgpu (Mesa's lavapipe on CPU-only machines) against the CPU references,
//! in one test binary (one link of the wgpu stack). Without an adapter every test fails with
//! what to install.
//!
//! Production kernels (`adamw`, `bf16`, `square`, and the device check): always. The lab's
//! (`matmul`, `mxfp8`, `optim`, `planes`): with the feature `experimental` (each of those
//! modules is `#![cfg(feature = "experimental")]`); CI runs them (`.ci/run`).
#![cfg(feature = "wgpu")]

mod adamw;
mod bf16;
mod codec_table;
mod common;
mod gpu_check;
mod matmul;
mod mxfp8;
mod optim;
mod planes;
mod square;
