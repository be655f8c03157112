//! SS-HSDP for Burn: sharded data parallelism (ZeRO-3/FSDP class) with *runtime* parameters
//! (packed, kernel-specific layouts such as MXFP8) decoupled from *update* parameters (fp32
//! master weights, whole matrices for Muon).
//!
//! This facade re-exports the workspace crates:
//! - [`plan`]: the layout planner (mesh, parameter specs, buckets, runtime and update layouts,
//!   memory accounting);
//! - [`mx`]: the MXFP8 format reference (E4M3/E5M2 elements, E8M0 scales, row/column planes);
//! - [`backend`]: `Hsdp<B>`, the Burn backend decorator, with `shard` and update views;
//! - [`optim`]: optimizer drivers on update views: any Burn element-wise optimizer
//!   (`ShardedOptimizer`), clipping, Muon (single-device and distributed owner-compute);
//! - [`checkpoint`]: sharded checkpoints, re-sharding to any world size or mesh;
//! - [`models`]: a GPT-style model for the examples and benchmarks;
//! - [`kernels`]: the fused GELU and softmax those models call (vectorised on burn-flex);
//! - [`comm`]: collectives (the `Collective` trait, threads/MPI/NCCL engines, hierarchical
//!   gradient paths).

#![deny(missing_docs)]

pub mod kernels;
pub mod models;

pub use sshsdp_backend as backend;
pub use sshsdp_checkpoint as checkpoint;
pub use sshsdp_comm as comm;
pub use sshsdp_mx as mx;
pub use sshsdp_optim as optim;
pub use sshsdp_plan as plan;
