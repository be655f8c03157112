//! The checkpoint crate's integration tests, one binary with a module per file (each test binary
//! links Burn: one link instead of seven, docs/TROUBLESHOOTING.md, "CI's disk"). `faults.rs` is
//! a binary of its own: its fail points are process-global, and would fail the other tests'
//! saves and loads.
//!
//! * [`buffers`]: module buffers (BatchNorm's running statistics) against plain Burn.
//! * [`commit`]: saving as one atomic commit over all ranks.
//! * [`format`]: the sharded files' format; every corruption an error, never a panic.
//! * [`load_all_or_nothing`]: a failed load changes no master on any rank.
//! * [`reshard`]: re-sharding across world sizes, replicas and consolidated files.
//! * [`state_codec`]: the optimizer state codec on Burn's SGD, Adam and AdamW states.
//! * [`untrusted_bytes`]: every reader answers `Ok` or `Err` for any bytes.
//!
//! A new test file is a module here (`autotests = false`: no one else compiles it;
//! `scripts/check_tests_declared` fails on a file no one names).

mod common;

mod buffers;
mod commit;
mod format;
mod load_all_or_nothing;
mod reshard;
mod state_codec;
mod untrusted_bytes;
