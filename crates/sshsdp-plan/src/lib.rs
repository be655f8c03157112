//! The SS-HSDP layout planner: pure planning, no Burn, no I/O.
//!
//! From a list of [`ParamSpec`]s, a [`Mesh`] and a [`PlanConfig`], [`Plan::build`] decides,
//! identically on every rank:
//!
//! * **buckets** — parameters grouped in execution order up to a size target; one bucket is
//!   one collective;
//! * the **runtime layout**, the one every part of the system reads (runtime storage, gathers,
//!   gradients, optimizers, checkpoints, projection) — each bucket's buffer cut into equal
//!   **pieces**, one per rank of the update group, with the exact bytes each piece stores and
//!   gathers: f32/bf16 elements linearly, square-block MXFP8 as runs of 32×32 tiles cut at tile
//!   edges (see [`format`](mod@format), [`tiles`] and [`Bucket`]); a runtime shard is a run of consecutive
//!   pieces (all-gathered over the shard group);
//! * the **update layout** — each piece owns the fp32 master elements whose runtime bytes it
//!   holds ([`UpdateView`]: a row-major run of one parameter, or whole tiles of a matrix), so
//!   the owner re-derives its own runtime bytes in place;
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

#![deny(missing_docs)]

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
pub mod tiles;
mod update_units;

pub use config::{OptimizerFootprint, PlanConfig, Sharding, MAX_ALIGN_BYTES, MAX_STATE_BYTES};
pub use error::PlanError;
pub use format::{encoded_bytes, resolve_format, RuntimeFormat, MX_BLOCK};
pub use layout::{Bucket, Encoding, PlannedParam, Span, UpdateView};
pub use memory::{MemoryReport, RankMemory};
pub use mesh::{Mesh, MAX_WORLD_SIZE};
pub use owners::newton_schulz_cost;
pub use plan::{
    Fallback, Fingerprint, Plan, PlanStats, MAX_LAYOUT_VIEWS, MAX_TOTAL_ELEMENTS, PLAN_VERSION,
};
pub use spec::{module_type, DType, ParamSpec, Role, RoleRule};
pub use update_units::UpdateUnit;
