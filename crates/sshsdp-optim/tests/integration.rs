//! The optimizer crate's integration tests, one binary with a module per file (each test binary
//! links Burn: one link instead of five, docs/TROUBLESHOOTING.md, "CI's disk").
//!
//! * [`deferred`]: the device step without a mid-step host read; state held per segment.
//! * [`equivalence`]: sharded training equals single-device training (SGD, AdamW, any mesh).
//! * [`muon`]: Muon and Newton–Schulz against independent float64 vectors.
//! * [`runtime`]: copies, traffic and memory per mode, accumulation, failures, mismatches.
//! * [`trust`]: a lagging replica, accumulation without refreshed leaves, a non-finite rank.
//!
//! A new test file is a module here (`autotests = false`: no one else compiles it;
//! `scripts/check_tests_declared` fails on a file no one names).

mod common;

mod deferred;
mod equivalence;
mod muon;
mod runtime;
mod trust;
