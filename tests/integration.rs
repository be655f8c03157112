//! The `sshsdp` crate's integration tests, one binary with a module per file (each test binary
//! links Burn, CubeCL and wgpu: one link instead of five, docs/TROUBLESHOOTING.md, "CI's disk");
//! `tests/wgpu_backend/` (the `wgpu` feature) is a binary of its own.
//!
//! * [`mixed_precision`]: FSDP2's mixed-precision policy on burn-flex (bf16 compute on the CPU).
//! * [`muon_device`]: distributed Muon on device pieces steps like on host pieces; its checkpoints.
//! * [`muon_sharded`]: distributed Muon equals single-device Muon; sharded optimizer checkpoints.
//! * [`mxfp8_training`]: square-block MXFP8 runtime parameters train like bf16, at every world.
//! * [`plan_and_mx`]: the planner's MXFP8 layout and the reference codec agree.
//! * [`projection`]: the projection's bytes equal the runtime's counters of real runs.
//!
//! A new test file is a module here (`autotests = false`: no one else compiles it;
//! `scripts/check_tests_declared` fails on a file no one names).

mod common;
mod mixed_precision;
mod muon_device;
mod muon_sharded;
mod mxfp8_training;
mod plan_and_mx;
mod projection;
