//! `Hsdp<B>`: a Burn backend decorator for sharded data parallelism.
//!
//! ```ignore
//! type B = Autodiff<Hsdp<NdArray>>;
//! let model: MyModel<B> = MyModelConfig::new().init(&device);
//! let (model, runtime) = sshsdp_backend::shard::<B, _, _>(model, HsdpConfig::new(mesh), comm, &device)?;
//! // Optimizers live in `sshsdp-optim`; the backend hands them update views.
//! let mut optim = sshsdp_optim::ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
//! for batch in data {
//!     let loss = model.forward(batch);
//!     let _ = loss.backward();          // gradients are reduce-scattered as they become final
//!     model = optim.step(lr, model, &runtime)?; // each rank steps its pieces; shards rebuilt
//! }
//! ```
//!
//! Every op of `Hsdp<B>` runs on `B` with `B`'s own kernels (the forwarding in `ops/` is
//! generated from Burn's ops traits). What differs is parameters: [`shard`] keeps them in
//! bucket storage planned by `sshsdp-plan`, sharded over the mesh, and swaps each for a handle;
//! an op that meets a handle gathers its bucket (one all-gather into a fresh buffer that
//! becomes the bucket tensor) and uses a view at the parameter's offset. Autodiff hands each
//! final gradient to the runtime, which accumulates it into the bucket's gradient buffer and
//! reduces the bucket (reduce-scatter in the shard group, then across replicas) once complete.

#![deny(missing_docs)]

// Layers, lowest first; a module imports only from the layers below it (`scripts/layers`
// checks this): `error`, `config`, `counters`, `traffic`, `timeline`, `rng`, `runtime_units` |
// `lanes` | `storage` | `tensor` | `runtime` | `registry`, `backend`, `backend_ext`, `ops` |
// `model` | `hsdp_runtime` | `shard`.
mod backend;
mod backend_ext;
mod config;
mod counters;
mod error;
mod hsdp_runtime;
mod lanes;
mod model;
mod ops;
mod registry;
mod rng;
mod runtime;
mod runtime_units;
mod shard;
mod storage;
mod tensor;
mod timeline;
mod traffic;

pub use backend::Hsdp;
pub use backend_ext::ShardableBackend;
pub use config::{CopyMode, HsdpConfig, MixedPrecision, NonFinitePolicy, Placement, Precision};
pub use counters::Counters;
pub use error::HsdpError;
pub use hsdp_runtime::HsdpRuntime;
pub use lanes::RUNTIME_LANES;
pub use model::buffers::BufferSpec;
pub use model::leaves::{check_gradient_leaves, refresh_leaves};
pub use model::params::{named_params, param_roles, param_shapes};
pub use model::paths::NamedParam;
pub use rng::{init_seeded, initialise_in_module_order, with_burn_rng, ConcurrentDrawer};
pub use runtime::{Piece, StepOutcome, UpdateGroup, UpdateStep, Verdict, Views};
#[allow(deprecated)]
pub use shard::{shard, shard_from, shard_with, shard_with_source, ParamSource, Shard};
pub use storage::{DeviceMemory, HostMaster, PieceValues};
pub use tensor::{HsdpFloat, LeafRearm, ParamHandle};
pub use timeline::{chrome_trace, Span, Track};
