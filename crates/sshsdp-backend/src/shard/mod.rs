//! Registration: [`shard`] walks an unmodified Burn module, plans it, moves its values into
//! bucket storage and swaps every float parameter for a handle into it.
//!
//! Parameters are keyed by module path (`layers.0.attn.query.weight`), not by Burn's random
//! `ParamId`, so all ranks agree; ranks compare plan fingerprints before anything else and a
//! mismatch is an error on every rank. Initial values are broadcast from rank 0, so ranks that
//! initialised their modules differently still start identical.
//!
//! Registration streams: the plan is built from shapes alone (Burn's lazy parameters report
//! theirs without initialising), then bucket by bucket rank 0 initialises and reads that
//! bucket's parameters (in plan order, so Burn's process-global RNG draws what it would have
//! drawn for the whole module), broadcasts the bucket, and drops its copies; every rank keeps
//! its runtime shard. No rank holds more than about two buckets besides its shards, and ranks
//! other than 0 never initialise a lazy parameter at all.
//!
//! Initial values come from Burn's process-global RNG at the moment rank 0 draws them, not at
//! the seed: a thread that seeds or draws between a program's `B::seed` and the end of `shard`
//! (another test, a data loader, the other ranks of an in-process run that initialise their own
//! models) changes them. Where anything else may draw in the process, draw the model whole
//! first with [`crate::init_seeded`] (seed, build, every parameter in module order, under one
//! process-wide lock that other drawers take through [`crate::with_burn_rng`]), then shard it;
//! `init_seeded`'s docs say more.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use sshsdp_comm::{Collective, CommFactory, SplitLanes};
use sshsdp_plan::Plan;

use crate::backend_ext::ShardableBackend;
use crate::lanes::comm::{LaneFactory, LaneId, RUNTIME_LANES};
use crate::model::buffers::{buffer_specs, BufferSpec};
use crate::model::leaves::leaf;
use crate::model::params::{param_specs, placeholder, without_drawing};
use crate::model::paths::{map_at, MapAt};
use crate::runtime::bucket::NewBuckets;
use crate::runtime::Runtime;
use crate::storage::BucketCodec;
use plan_agreement::agree_on_plan;
mod plan_agreement;
mod source;

use crate::config::HsdpConfig;
use crate::error::HsdpError;
use crate::hsdp_runtime::HsdpRuntime;
use crate::registry;
use crate::tensor::{HsdpFloat, ParamHandle};
pub use source::ParamSource;
use source::{buffers_from_source, check_source, read_shard};

/// Rank 0's reader of one bucket: initialises (if lazy) and reads each member parameter into
/// the bucket's fp32 element space, and leaves a [`placeholder`] in its place so the module
/// holds no copy of the values once they are in the bucket.
struct BucketReader<'a> {
    /// Path → member index in the bucket.
    members: HashMap<&'a str, usize>,
    codec: &'a BucketCodec,
    full: &'a mut [f32],
    error: Option<String>,
}

impl<B: burn::tensor::backend::Backend> MapAt<B> for BucketReader<'_> {
    fn map_float_at<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        let Some(&k) = self.members.get(path) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let (device, require_grad) = (tensor.device(), tensor.is_require_grad());
        match tensor.into_data().convert::<f32>().into_vec::<f32>() {
            Ok(values) => self.codec.place(k, &values, self.full),
            Err(e) => {
                self.error.get_or_insert(format!("reading {path}: {e:?}"));
            }
        }
        Param::from_mapped_value(id, placeholder::<B, D>(&device, require_grad), mapper)
    }
}

/// Swaps each float parameter for a handle into bucket storage, without initialising the
/// parameters that are still lazy.
struct Swapper<B: ShardableBackend> {
    runtime: Arc<Runtime<B::Inner>>,
    index: HashMap<String, usize>,
}

impl<B: ShardableBackend> MapAt<B> for Swapper<B> {
    fn map_float_at<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        // A buffer (not planned) stays as it is.
        let Some(&index) = self.index.get(path) else {
            return param;
        };
        let (id, value, mapper) = without_drawing(param).consume();
        let require_grad = value.is_require_grad();
        drop(value);
        let shape = self.runtime.plan().params()[index].spec.shape.clone();
        let handle = ParamHandle::new(self.runtime.clone(), index, shape.into());
        Param::from_mapped_value(
            id,
            leaf::<B, D>(HsdpFloat::Param(handle), require_grad),
            mapper,
        )
    }
}

/// Shards `module` over the ranks of `comm` (a collective call: every rank calls it with the same
/// module structure and config). Returns the module with its parameters in bucket storage and the
/// runtime that steps them. The one entry point; [`Shard`] builds its variants (initial values
/// from a [`ParamSource`], communicators that cannot cross threads).
///
/// `comm` must be able to cross threads (threads engine, MPI): the runtime's communication
/// lanes are split from it here. For communicators that cannot (NCCL), use [`Shard::run_on`].
///
/// Initialisation order: rank 0 draws lazy parameters here, bucket by bucket in module order,
/// from Burn's process-global RNG. A seed set before this call fixes them only if nothing else
/// in the process seeds or draws in between; otherwise pass a module drawn with
/// [`crate::init_seeded`] (see the module docs).
pub fn shard<B, M, C>(
    module: M,
    config: HsdpConfig,
    comm: C,
    device: &B::Device,
) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
where
    B: ShardableBackend,
    M: Module<B>,
    C: Collective + Send + 'static,
{
    Shard::new(config).run::<B, M, C>(module, comm, device)
}

/// [`shard`]'s variants, built: `Shard::new(config)`, optionally `.from_source(&source)`, then
/// `.run(module, comm, &device)` (communicators that cross threads) or `.run_on(module, factory,
/// &device)` (a factory of communicators, e.g. NCCL lanes).
pub struct Shard<'s> {
    config: HsdpConfig,
    source: Option<&'s dyn ParamSource>,
}

impl<'s> Shard<'s> {
    /// Sharding with `config`, initial values from the module.
    pub fn new(config: HsdpConfig) -> Self {
        Self {
            config,
            source: None,
        }
    }

    /// The initial values read from `source` instead of the module: the module gives only its
    /// structure and parameter shapes (its lazy parameters are never initialised, on any rank),
    /// and each rank reads just its runtime shard's element ranges from `source`. A missing
    /// parameter, a shape or dtype the source cannot give, or a failed read is an error on
    /// every rank, naming the parameter.
    pub fn from_source(mut self, source: &'s dyn ParamSource) -> Self {
        self.source = Some(source);
        self
    }

    /// Shards `module` over the ranks of `comm`, which must be able to cross threads (threads
    /// engine, MPI): the runtime's communication lanes are split from it (see [`shard`]).
    pub fn run<B, M, C>(
        self,
        module: M,
        comm: C,
        device: &B::Device,
    ) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
    where
        B: ShardableBackend,
        M: Module<B>,
        C: Collective + Send + 'static,
    {
        let factory = SplitLanes::new(comm, RUNTIME_LANES)?;
        self.run_on::<B, M, _>(module, factory, device)
    }

    /// Shards `module` with a factory of communicators: the model thread connects lane 0 for
    /// the registration collectives, and each of the runtime's two communication lanes connects
    /// its own lane (1, 2) on its own thread — so `factory`'s communicators need not cross
    /// threads (e.g. `sshsdp_comm::nccl::NcclLanes`). `factory` must offer [`RUNTIME_LANES`]
    /// lanes. On a local error it aborts the factory's communicators: the others may be waiting
    /// in a collective of `shard` for this rank, so they fail now (where the engine can) rather
    /// than at their timeouts.
    pub fn run_on<B, M, F>(
        self,
        module: M,
        factory: F,
        device: &B::Device,
    ) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
    where
        B: ShardableBackend,
        M: Module<B>,
        F: CommFactory,
    {
        let rank = factory.rank();
        let factory = Arc::new(factory);
        let lanes: Arc<dyn LaneFactory> = factory.clone();
        let sharded = shard_on::<B, M>(module, self.config, lanes, device, self.source);
        if let Err(e) = &sharded {
            factory.abort(&format!("rank {rank} failed in shard: {e}"));
        }
        sharded
    }
}

/// [`shard`] with a factory of communicators.
#[deprecated(note = "use `Shard::new(config).run_on(module, factory, device)`")]
pub fn shard_with<B, M, F>(
    module: M,
    config: HsdpConfig,
    factory: F,
    device: &B::Device,
) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
where
    B: ShardableBackend,
    M: Module<B>,
    F: CommFactory,
{
    Shard::new(config).run_on::<B, M, F>(module, factory, device)
}

/// [`shard`] with the initial values read from `source`.
#[deprecated(note = "use `Shard::new(config).from_source(source).run(module, comm, device)`")]
pub fn shard_from<B, M, C>(
    module: M,
    config: HsdpConfig,
    comm: C,
    device: &B::Device,
    source: &dyn ParamSource,
) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
where
    B: ShardableBackend,
    M: Module<B>,
    C: Collective + Send + 'static,
{
    Shard::new(config)
        .from_source(source)
        .run::<B, M, C>(module, comm, device)
}

/// [`shard`] over a factory of communicators, with initial values from `source` if given.
#[deprecated(note = "use `Shard::new(config)` with `.from_source(source)` and `.run_on(…)`")]
pub fn shard_with_source<B, M, F>(
    module: M,
    config: HsdpConfig,
    factory: F,
    device: &B::Device,
    source: Option<&dyn ParamSource>,
) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
where
    B: ShardableBackend,
    M: Module<B>,
    F: CommFactory,
{
    let shard = Shard::new(config);
    match source {
        Some(source) => shard.from_source(source),
        None => shard,
    }
    .run_on::<B, M, F>(module, factory, device)
}

/// [`Shard::run_on`] on a factory seen as lanes; an error here is aborted on every rank there.
fn shard_on<B, M>(
    module: M,
    config: HsdpConfig,
    factory: Arc<dyn LaneFactory>,
    device: &B::Device,
    source: Option<&dyn ParamSource>,
) -> Result<(M, HsdpRuntime<B::Inner>), HsdpError>
where
    B: ShardableBackend,
    M: Module<B>,
{
    // Parameters start on the device's buffer-offset alignment, so each is a view of its bucket.
    let config = {
        let mut config = config;
        if let Some(align) = crate::storage::alignment::<B::Inner>(device) {
            // The plan aligns starts in f32 bytes; a bf16 compute buffer has half the bytes
            // before each parameter, so it needs twice the alignment in f32 terms.
            let align = align.next_multiple_of(32) * (4 / config.precision.compute.bytes());
            config.plan.align_bytes = config.plan.align_bytes.max(align);
        }
        config
    };
    // What this rank can get wrong on its own is folded into the plan agreement, so that it is
    // an error on every rank in that same call (on MPI too, whose peers would otherwise wait).
    let buffers = buffer_specs(&module);
    let local = check_backend::<B::Inner>(device, &config)
        .and_then(|()| local_plan(&module, &buffers, &config, &*factory))
        .and_then(|plan| match source {
            Some(source) => check_source(&plan, source).map(|()| plan),
            None => Ok(plan),
        });
    let (replicas, shards) = (config.mesh.replicas(), config.mesh.shards());
    let calls = Default::default();
    let comm = match factory.connect_mesh(LaneId::Bootstrap, (replicas, shards), calls) {
        Ok(comm) => comm,
        Err(e) => return Err(local.err().unwrap_or(e.into())),
    };
    let plan = agree_on_plan(&*comm, local, &buffers)?;

    let rank = comm.world_rank();
    let shard_index = plan.runtime_shard_of(rank)?;
    let index: HashMap<String, usize> = plan
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| (p.spec.path.clone(), i))
        .collect();
    // Bucket by bucket. From the module: rank 0 reads the bucket's parameters into its fp32
    // element space and broadcasts it (with a trailing flag: whether rank 0 could read them),
    // every rank keeps its runtime shard. From a source: every rank reads its runtime shard
    // and the ranks agree that all could. The runtime encodes each shard and keeps its piece
    // as the fp32 master before asking for the next.
    let mut module = Some(module);
    let mut shard_of = |plan: &Plan, b: usize, codec: &BucketCodec| match source {
        Some(source) => {
            let read = read_shard(plan, b, shard_index, source);
            let mut flags = vec![0u8; comm.world_size()];
            comm.all_gather_bytes(&[u8::from(read.is_err())], &mut flags)?;
            match (read, flags.iter().position(|&f| f != 0)) {
                (Err(e), _) => Err(HsdpError::Unsupported(e)),
                (Ok(_), Some(r)) => Err(HsdpError::Failed(format!(
                    "rank {r} could not read its shard of bucket {b}"
                ))),
                (Ok(shard), None) => Ok(shard),
            }
        }
        None => {
            let elems = codec.bucket_elems();
            let mut full = vec![0f32; elems + 1];
            let mut read_error = None;
            if rank == 0 {
                let members = plan.params()[plan.buckets()[b].params.clone()]
                    .iter()
                    .enumerate()
                    .map(|(k, p)| (p.spec.path.as_str(), k))
                    .collect();
                let mut reader = BucketReader {
                    members,
                    codec,
                    full: &mut full[..elems],
                    error: None,
                };
                module = module.take().map(|m| map_at(m, &mut reader));
                read_error = reader.error;
                full[elems] = f32::from(read_error.is_some());
            }
            comm.broadcast_world(&mut full)?;
            if full[elems] != 0.0 {
                return Err(HsdpError::Unsupported(read_error.unwrap_or_else(|| {
                    format!("rank 0 could not read the parameters of bucket {b}")
                })));
            }
            let shard_len = elems / plan.runtime_shards();
            full.truncate((shard_index + 1) * shard_len);
            Ok(full.split_off(shard_index * shard_len))
        }
    };
    let mut buckets = NewBuckets::new(&plan, rank, device, &config)?;
    for (b, bucket) in plan.buckets().iter().enumerate() {
        let codec = BucketCodec::new(&plan, b);
        let shard = shard_of(&plan, b, &codec)?;
        buckets.push(bucket.params.clone(), codec, shard)?;
    }
    let runtime = Arc::new(Runtime::new(
        plan,
        device.clone(),
        factory,
        buckets,
        &config,
    )?);
    runtime.set_ids(registry::register(&runtime));
    let mut swapper = Swapper::<B> {
        runtime: runtime.clone(),
        index,
    };
    let module = map_at(
        module.expect("the module is put back after each bucket"),
        &mut swapper,
    );
    let runtime = HsdpRuntime::new(runtime, buffers);
    let module = match source {
        Some(source) => buffers_from_source(module, &runtime, source)?,
        None => module,
    };
    Ok((module, runtime))
}

/// Refuses inner backends whose tensors cannot be views of a gathered bucket: burn-fusion over
/// anything but the CubeCL runtimes this build supports (`Fusion<CubeBackend<…>>`, what `Wgpu`
/// and `Cuda` are with Burn's default features, is supported through `storage/cube/adapter.rs`;
/// fusion over another backend would make every parameter a copy, and the memory and copy
/// counters false). Refuses a bf16 compute policy on a backend that cannot compute in bf16.
fn check_backend<B: burn_backend::Backend>(
    device: &B::Device,
    config: &HsdpConfig,
) -> Result<(), HsdpError> {
    let name = B::name(device);
    let compute = config.precision.compute;
    if !B::supports_dtype(device, compute.dtype().into()) {
        return Err(HsdpError::Unsupported(format!(
            "Hsdp<{name}>: the mixed-precision policy computes in {compute:?}, which this \
             backend does not support on {device:?}; use a backend that computes in bf16 \
             (burn-flex on the CPU, CUDA) or `Precision::F32`"
        )));
    }
    if is_fusion(&name) && !crate::storage::is_cube_backend::<B>() {
        return Err(HsdpError::Unsupported(format!(
            "Hsdp<{name}>: burn-fusion is supported over CubeCL's wgpu and CUDA runtimes \
             (burn-wgpu's `Wgpu`, burn-cuda's `Cuda`) with sshsdp's `wgpu` or `cuda` feature; \
             over this backend, or without that feature, a parameter could not be a view of its \
             gathered bucket. Enable the feature matching your backend (`sshsdp = {{ features = \
             [\"wgpu\"] }}`), or decorate the backend without fusion"
        )));
    }
    Ok(())
}

/// Whether a backend name is burn-fusion's (`fusion<inner>`, burn-fusion 0.21's
/// `Backend::name`).
fn is_fusion(name: &str) -> bool {
    name.starts_with("fusion<")
}

/// This rank's plan (from the module's parameter shapes, without initialising them), or why it
/// cannot shard (a local error: bad config, world size, factory, parameters, or an injected
/// fault).
fn local_plan<B: ShardableBackend, M: Module<B>>(
    module: &M,
    buffers: &[BufferSpec],
    config: &HsdpConfig,
    factory: &dyn LaneFactory,
) -> Result<Plan, HsdpError> {
    sshsdp_comm::faults::inject("sshsdp::shard", factory.world_rank())
        .map_err(HsdpError::Failed)?;
    config.validate()?;
    config.mesh.check_world_size(factory.world_size())?;
    if factory.lanes() < RUNTIME_LANES {
        return Err(HsdpError::Unsupported(format!(
            "the communicator factory offers {} lanes; the runtime connects {RUNTIME_LANES}",
            factory.lanes()
        )));
    }
    Ok(Plan::build(
        param_specs(module, buffers),
        config.mesh,
        config.plan.clone(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fusion_backends_are_told_by_name() {
        // burn-fusion 0.21 names itself `fusion<{inner}>`; CubeCL backends `cubecl<{runtime}>`.
        assert!(is_fusion("fusion<cubecl<wgpu<vulkan>>>"));
        assert!(!is_fusion("cubecl<wgpu<vulkan>>"));
        #[cfg(feature = "ndarray")]
        {
            type Nd = burn_ndarray::NdArray<f32>;
            let config = HsdpConfig::new(sshsdp_plan::Mesh::new(1, 1).unwrap());
            assert!(check_backend::<Nd>(&Default::default(), &config).is_ok());
        }
    }
}
