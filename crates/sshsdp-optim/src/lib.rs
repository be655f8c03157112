//! Optimizers for SS-HSDP.
//!
//! Today: a single-device **Muon** ([`Muon`], [`MuonConfig`]) of our own — SGD momentum
//! (Nesterov), quintic Newton–Schulz orthogonalisation of each whole 2-D matrix
//! ([`newton_schulz`]), a shape-dependent update scale ([`UpdateScale`], mind the
//! [`MatrixLayout`]: Burn's `Linear` weight is `[d_input, d_output]`) and decoupled weight
//! decay. It steps one matrix at a time ([`Muon::step_matrix`]) or, through
//! [`burn::optim::SimpleOptimizer`], any Burn module whose optimised parameters are all
//! 2-D. [`ns_flops`] is the cost model used to balance matrix owners across ranks, and
//! [`Muon::ns_stats`] counts the orthogonalisations actually run.
//!
//! Parameter groups: [`MuonWithElementwise`] routes a module's matrices to Muon and its 1-D
//! parameters, embeddings and LM head to an element-wise Burn optimizer (AdamW) on one device;
//! [`ShardedMuon`] does the same on a sharded model's update pieces ([`UpdateUnit`]s), with
//! distributed owner-compute Muon: each matrix is orthogonalised exactly once per update group,
//! on the owner the plan assigned, and matrices whole on their owner need no communication.
//! Element-wise optimizers alone run through [`ShardedOptimizer`]: any Burn `SimpleOptimizer`
//! (SGD, Adam, AdamW, …) on flat pieces, with global-norm clipping ([`GradClip`]).
//!
//! Checkpoints of these optimizers (and of the weights) live in the `sshsdp-checkpoint` crate.
//!
//! # Reference numerics
//! Momentum 0.95 with Nesterov, 5 Newton–Schulz steps with `(a, b, c) = (3.4445, −4.7750,
//! 2.0315)`, `X = G / (‖G‖_F + 1e-7)`, transpose when `rows > cols`; scale
//! `sqrt(max(1, fan_out/fan_in))` or `0.2·sqrt(max(A, B))`. The tests compare against
//! float64 vectors from an independent numpy implementation
//! (`tests/data/gen_muon_vectors.py`).

#![deny(missing_docs)]

mod adaptor;
mod clip;
mod hybrid;
mod muon;
mod newton_schulz;
mod segments;
mod sharded_muon;
pub mod state_codec;
mod step;
mod traffic;

pub use adaptor::ShardedOptimizer;
pub use clip::{clip_factor, GradClip};
pub use hybrid::MuonWithElementwise;
pub use muon::{MatrixLayout, Muon, MuonConfig, MuonState, NsStats, UpdateScale};
pub use newton_schulz::{
    newton_schulz, newton_schulz_batched, ns_flops, NsPrecision, NS_COEFFICIENTS, NS_EPS,
};
pub use sharded_muon::{MuonExchange, MuonStepStats, ParamState, ShardedMuon};
pub use sshsdp_plan::UpdateUnit;
pub use step::ShardedStep;
pub use traffic::HostTraffic;
