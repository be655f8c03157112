//! The SS-HSDP layout planner: pure planning, no Burn, no I/O.
//!
//! From a list of [`ParamSpec`]s, a [`Mesh`] and a [`PlanConfig`], [`Plan::build`] decides,
//! identically on every rank:
//!
//! * **buckets** — parameters grouped in execution order up to a size target; one bucket is
//!   one collective;
//! * the **runtime layout** — each parameter's region (f32, bf16 or tiled MXFP8, see
//!   [`format`]) at an aligned offset in its bucket's buffer. The buffer is cut into equal
//!   **pieces**, one per rank of the update group; a runtime shard is a run of consecutive
//!   pieces (all-gathered over the shard group);
//! * the **update layout** — each piece owns the fp32 master elements whose runtime bytes lie in
//!   it ([`UpdateView`]), so the owner re-derives its runtime bytes in place;
//! * **Newton–Schulz owners** — each `Matrix` is orthogonalised on exactly one piece: the one
//!   holding it whole when there is one, otherwise the least-loaded piece (LPT by the
//!   iteration's FLOPs, [`newton_schulz_cost`]);
//! * **memory accounting** per rank ([`MemoryReport`]) and a [`Fingerprint`] ranks compare at
//!   startup;
//! * a **projection** of each step's collectives, bytes and time on given links
//!   ([`projection`]), to size a cluster before having one.
//!
//! Hierarchical sharding (the default) uses one piece per rank of the world; HSDP one per rank
//! of the shard group (replicas hold the same piece); DDP a single piece. The three modes share
//! every mechanism, so baselines are measured on the same machinery.

mod config;
mod error;
pub mod format;
mod layout;
mod memory;
mod mesh;
mod owners;
mod plan;
pub mod presets;
pub mod projection;
mod spec;
mod views;

pub use config::{OptimizerFootprint, PlanConfig, Sharding};
pub use error::PlanError;
pub use format::{resolve_format, MxGrid, RuntimeFormat, MX_BLOCK, MX_TILE, MX_TILE_BYTES};
pub use layout::{Bucket, PlannedParam};
pub use memory::{MemoryReport, RankMemory};
pub use mesh::Mesh;
pub use owners::newton_schulz_cost;
pub use plan::{Fallback, Fingerprint, Plan, PlanStats, PLAN_VERSION};
pub use spec::{DType, ParamSpec, Role, RoleRule};
pub use views::{Selection, SplitTile, UpdateView};
