//! The runs the tests of this binary compare: a small GPT trained by `Autodiff<Hsdp<I>>` on the
//! threads engine, with its losses, weights, byte counters and checkpoints ([`run`]).

use std::path::Path;
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::backend::distributed::DistributedBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ElementConversion;
use sshsdp::backend::{shard, Hsdp, HsdpConfig, HsdpRuntime, MixedPrecision, Placement, Precision};
use sshsdp::checkpoint::{self, PieceStates};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::kernels::FusedOps;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedStep;
use sshsdp::optim::{HostTraffic, MuonConfig, ShardedMuon, ShardedOptimizer, UpdateScale};
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

/// burn-wgpu's `Wgpu` with Burn's default features: burn-fusion over CubeCL, autotune on.
pub(crate) type Wgpu = burn_wgpu::Wgpu;
/// CubeCL's wgpu runtime without fusion (the examples' `--no-fusion`).
pub(crate) type WgpuUnfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;

pub(crate) const STEPS: usize = 6;
/// Sequences per step over all ranks.
pub(crate) const GLOBAL: usize = 8;
pub(crate) const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 64,
    layers: 1,
    heads: 2,
    seq: 32,
};

/// The initial weights, made once on the CPU so both backends start from the same values.
///
/// Made once per process: Burn's RNG is global, and the tests of this file run in parallel, so
/// a second seeding and drawing could interleave with another test's ranks drawing their own
/// (discarded) initial values.
pub(crate) fn initial_record() -> &'static [(Vec<usize>, Vec<f32>)] {
    static RECORD: std::sync::OnceLock<Vec<(Vec<usize>, Vec<f32>)>> = std::sync::OnceLock::new();
    RECORD.get_or_init(|| crate::common::record(&CONFIG, 3))
}

/// The optimizer of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Opt {
    /// AdamW on every parameter.
    AdamW,
    /// Distributed Muon on hidden matrices, AdamW on the rest.
    Muon,
    /// AdamW on NdArray over host views (`step_offloaded`): its state off the device.
    AdamWOnCpu,
    /// Distributed Muon (and AdamW) on NdArray over host views (`step_offloaded`).
    MuonOnCpu,
}

/// One training configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Case {
    pub(crate) format: RuntimeFormat,
    pub(crate) optim: Opt,
    /// `(replicas, shards)` of the mesh: `(1, 2)` is a flat world of 2, `(2, 2)` HSDP.
    pub(crate) mesh: (usize, usize),
    /// Whether buckets are released after forward.
    pub(crate) reshard: bool,
    /// Where the fp32 masters and the gradients live.
    pub(crate) placement: (Placement, Placement),
    /// The dtype parameters compute in.
    pub(crate) compute: Precision,
    /// Where the runtime shards live (`None`: the default placement).
    pub(crate) shards: Option<Placement>,
    /// Elements per bucket (`None`: the default, one bucket for this model).
    pub(crate) bucket: Option<u64>,
    /// Hierarchical (the default) or HSDP.
    pub(crate) sharding: Sharding,
    /// Collectives staged through the host even where the ranks share a CubeCL device (whose
    /// buffers the threads engine's peers collectives move by default).
    pub(crate) staged: bool,
}

impl Case {
    /// AdamW on a flat world of 2 without resharding, host storage.
    pub(crate) const fn new(format: RuntimeFormat) -> Self {
        Case {
            format,
            optim: Opt::AdamW,
            mesh: (1, 2),
            reshard: false,
            placement: (Placement::Host, Placement::Host),
            compute: Precision::F32,
            shards: None,
            bucket: None,
            staged: false,
            sharding: Sharding::Hierarchical,
        }
    }

    pub(crate) fn world(&self) -> usize {
        self.mesh.0 * self.mesh.1
    }
}

/// Checkpoints of a run: resumed from before its first step, saved after its last.
#[derive(Clone, Copy, Default)]
pub(crate) struct Checkpoints<'a> {
    pub(crate) resume: Option<&'a Path>,
    pub(crate) save: Option<&'a Path>,
}

/// A run's optimizer.
pub(crate) enum Optimizer<I: Backend> {
    AdamW(ShardedOptimizer<I, AdamW>),
    Muon(ShardedMuon<I, AdamW>),
    OnCpu(ShardedOptimizer<NdArray<f32>, AdamW>),
    MuonOnCpu(ShardedMuon<NdArray<f32>, AdamW>),
}

impl<I: Backend> Optimizer<I> {
    /// The optimizer's own reads and uploads since the last call.
    fn take_host_traffic(&self) -> HostTraffic {
        match self {
            Optimizer::AdamW(o) => o.take_host_traffic(),
            Optimizer::Muon(o) => o.take_host_traffic(),
            Optimizer::OnCpu(o) => o.take_host_traffic(),
            Optimizer::MuonOnCpu(o) => o.take_host_traffic(),
        }
    }
}

/// What a run leaves.
#[derive(Debug, PartialEq)]
pub(crate) struct Run {
    /// Losses of every rank's local batch, averaged, at each step.
    pub(crate) losses: Vec<f32>,
    /// Rank 0's weights before the first step (after resuming), parameter by parameter.
    pub(crate) initial: Vec<Vec<f32>>,
    /// Rank 0's final weights, parameter by parameter.
    pub(crate) weights: Vec<Vec<f32>>,
    /// The parameters' paths, in the order of `initial` and `weights` (the plan's).
    pub(crate) paths: Vec<String>,
    /// Rank 0's master bytes on the host and on the device.
    pub(crate) master_bytes: (u64, u64),
    /// Rank 0's (uploaded, downloaded) bytes of the last step: host↔device traffic.
    pub(crate) traffic: (u64, u64),
    /// Rank 0's runtime host reads of the last step.
    pub(crate) reads: u64,
    /// Rank 0's optimizer's own reads and uploads in the last step.
    pub(crate) optimizer_traffic: HostTraffic,
    /// Muon's split matrices in rank 0's last step: their elements, and the elements rank 0
    /// sent to others in the owner exchange (0 for AdamW).
    pub(crate) exchanged: (u64, u64),
    /// Runtime bytes of rank 0's pieces (one per bucket).
    pub(crate) piece_bytes: u64,
    /// Bytes of rank 0's runtime shards, and whether they are in device memory.
    pub(crate) shards: (u64, bool),
    /// Rank 0's gathers of the last step, and the bytes they received from peers.
    pub(crate) gathered: (u64, u64),
    /// Whether the collectives ran on device buffers (the peers engine) or staged.
    pub(crate) on_device: bool,
}

/// Every parameter's values on this rank.
pub(crate) fn weights<I: Backend>(runtime: &HsdpRuntime<I>) -> Vec<Vec<f32>> {
    runtime
        .plan()
        .params()
        .iter()
        .map(|p| runtime.param_values(&p.spec.path).unwrap())
        .collect()
}

/// Every parameter's path on this rank, in the order of [`weights`].
pub(crate) fn paths<I: Backend>(runtime: &HsdpRuntime<I>) -> Vec<String> {
    let params = runtime.plan().params().iter();
    params.map(|p| p.spec.path.clone()).collect()
}

/// The job of [`run`] on plain Burn: `Autodiff<I>` without the decorator, one device, the
/// global batch, Burn's own AdamW (`GradientsParams`, `Optimizer::step`), f32. Returns the
/// losses and the final weights by parameter path.
pub(crate) fn plain_burn<I: FusedOps + DistributedBackend>(
    steps: usize,
    device: I::Device,
) -> (Vec<f32>, Weights) {
    use burn::optim::{GradientsParams, Optimizer};
    let record = initial_record();
    let mut model: Gpt<Autodiff<I>> = crate::common::loaded(&device, record, |d| CONFIG.init(d));
    let mut optim = AdamWConfig::new().init::<Autodiff<I>, Gpt<Autodiff<I>>>();
    let mut losses = Vec::new();
    for step in 0..steps {
        let tokens = crate::common::tokens::<Autodiff<I>>(&CONFIG, step, 0, GLOBAL, &device);
        let loss = model.loss(tokens);
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    let weights = sshsdp::backend::named_params(&model).unwrap();
    (
        losses,
        weights.into_iter().map(|p| (p.path, p.values)).collect(),
    )
}

/// Weights by parameter path.
pub(crate) type Weights = std::collections::BTreeMap<String, Vec<f32>>;

impl Run {
    /// The final weights by parameter path.
    pub(crate) fn weights_by_path(&self) -> Weights {
        self.paths
            .iter()
            .cloned()
            .zip(self.weights.iter().cloned())
            .collect()
    }
}

/// The relative L2 distance between two sets of weights over every parameter:
/// `‖a − b‖ / ‖b‖`, both over all values (the same paths and shapes, checked).
pub(crate) fn relative_distance(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (path, x) in a {
        let y = &b[path];
        assert_eq!(x.len(), y.len(), "{path}");
        for (x, y) in x.iter().zip(y) {
            diff += (*x as f64 - *y as f64).powi(2);
            norm += (*y as f64).powi(2);
        }
    }
    (diff / norm).sqrt()
}

/// Trains `case` over `steps` (the step numbers pick the batches: [`GLOBAL`] sequences split
/// over the ranks), with `checkpoints`.
pub(crate) fn run<I: FusedOps>(
    case: Case,
    steps: std::ops::Range<usize>,
    checkpoints: Checkpoints<'_>,
    device: I::Device,
) -> Run
where
    I::Device: Default,
{
    let record = initial_record();
    let world = case.world();
    let rows = GLOBAL / world;
    let config = ThreadsConfig {
        timeout: Duration::from_secs(300),
    };
    let last = steps.end - 1;
    let ranks = ThreadsWorld::run(world, config, |comm| {
        type A<I> = Autodiff<Hsdp<I>>;
        let rank = comm.rank();
        let model: Gpt<A<I>> = crate::common::loaded(&device, record, |d| CONFIG.init(d));
        let (masters, grads) = case.placement;
        let mut config = HsdpConfig::new(Mesh::new(case.mesh.0, case.mesh.1).unwrap())
            .with_format(case.format)
            .with_reshard_after_forward(case.reshard)
            .with_master_placement(masters)
            .with_grad_placement(grads)
            .with_mixed_precision(MixedPrecision::new(case.compute, Precision::F32))
            .with_device_collectives(!case.staged)
            .with_sharding(case.sharding);
        if let Some(shards) = case.shards {
            config = config.with_shard_placement(shards);
        }
        if let Some(elements) = case.bucket {
            config = config.with_bucket_elements(elements);
        }
        let (mut model, runtime) = shard::<A<I>, _, _>(model, config, comm, &device).unwrap();
        let adamw = AdamWConfig::new().build();
        let mut optim = match case.optim {
            Opt::AdamW => Optimizer::AdamW(ShardedOptimizer::new(adamw, device.clone())),
            Opt::Muon => {
                let muon = MuonConfig::new().with_scale(UpdateScale::MatchAdamW).init();
                Optimizer::Muon(ShardedMuon::new(muon, adamw, device.clone()))
            }
            Opt::AdamWOnCpu => Optimizer::OnCpu(ShardedOptimizer::new(adamw, Default::default())),
            Opt::MuonOnCpu => {
                let muon = MuonConfig::new().with_scale(UpdateScale::MatchAdamW).init();
                Optimizer::MuonOnCpu(ShardedMuon::new(muon, adamw, Default::default()))
            }
        };
        if let Some(dir) = checkpoints.resume {
            let step = match &mut optim {
                Optimizer::AdamW(o) => checkpoint::load(dir, &runtime, &mut PieceStates::new(o)),
                Optimizer::Muon(o) => checkpoint::load(dir, &runtime, o),
                Optimizer::OnCpu(o) => checkpoint::load(dir, &runtime, &mut PieceStates::new(o)),
                Optimizer::MuonOnCpu(o) => checkpoint::load(dir, &runtime, o),
            };
            assert_eq!(step.unwrap(), steps.start as u64);
        }
        let initial = weights(&runtime);
        let mut losses = Vec::new();
        for step in steps.clone() {
            if step == last {
                // The last step alone (forward, backward, update).
                runtime.take_counters();
                optim.take_host_traffic();
            }
            let loss = model.loss(crate::common::tokens::<A<I>>(
                &CONFIG,
                step,
                rank * rows,
                rows,
                &device,
            ));
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let _ = loss.backward();
            model = match &mut optim {
                Optimizer::AdamW(o) => o.step(1e-2, model, &runtime),
                Optimizer::Muon(o) => o.step(1e-2, model, &runtime),
                Optimizer::OnCpu(o) => o.step_offloaded(1e-2, model, &runtime),
                Optimizer::MuonOnCpu(o) => o.step_offloaded(1e-2, model, &runtime),
            }
            .unwrap();
        }
        let counters = runtime.take_counters();
        let optimizer_traffic = optim.take_host_traffic();
        let exchanged = match &optim {
            Optimizer::Muon(o) => (
                o.last_step().exchanged_elements,
                o.last_step().sent_elements,
            ),
            Optimizer::MuonOnCpu(o) => (
                o.last_step().exchanged_elements,
                o.last_step().sent_elements,
            ),
            _ => (0, 0),
        };
        if let Some(dir) = checkpoints.save {
            let saved = match &mut optim {
                Optimizer::AdamW(o) => {
                    checkpoint::save(dir, &runtime, &PieceStates::new(o), steps.end as u64)
                }
                Optimizer::Muon(o) => checkpoint::save(dir, &runtime, o, steps.end as u64),
                Optimizer::OnCpu(o) => {
                    checkpoint::save(dir, &runtime, &PieceStates::new(o), steps.end as u64)
                }
                Optimizer::MuonOnCpu(o) => checkpoint::save(dir, &runtime, o, steps.end as u64),
            };
            saved.unwrap();
        }
        let traffic = (
            (counters.uploaded_bytes, counters.downloaded_bytes),
            counters.host_reads,
            (optimizer_traffic, exchanged),
        );
        let on_device = runtime.collectives_on_device();
        let bytes = (runtime.master_bytes(), runtime.device_master_bytes());
        let piece_bytes = runtime.plan().buckets().iter().map(|b| b.piece_bytes).sum();
        let shards = (runtime.shard_bytes(), runtime.shards_on_device());
        let gathered = (counters.gathers, counters.gathered_bytes);
        let weights = (weights(&runtime), paths(&runtime));
        let placed = (shards, gathered, on_device);
        (
            losses,
            initial,
            weights,
            bytes,
            traffic,
            piece_bytes,
            placed,
        )
    })
    .unwrap();
    let mut ranks: Vec<_> = ranks
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect();
    let losses = (0..steps.len())
        .map(|s| ranks.iter().map(|r| r.0[s]).sum::<f32>() / world as f32)
        .collect();
    let (_, initial, (weights, paths), master_bytes, traffic, piece_bytes, placed) =
        ranks.swap_remove(0);
    let (traffic, reads, (optimizer_traffic, exchanged)) = traffic;
    let (shards, gathered, on_device) = placed;
    Run {
        losses,
        initial,
        weights,
        paths,
        master_bytes,
        traffic,
        reads,
        optimizer_traffic,
        exchanged,
        piece_bytes,
        shards,
        gathered,
        on_device,
    }
}
