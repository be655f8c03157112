//! The kernels on wgpu (Mesa's lavapipe on CPU-only machines) against the CPU references,
//! in one test binary (one link of the wgpu stack). Without an adapter every test fails with
//! what to install.
#![cfg(feature = "wgpu")]

mod common;
mod gpu_check;
mod matmul;
mod mxfp8;
mod optim;
mod planes;
mod square;
