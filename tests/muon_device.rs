//! Distributed Muon on device pieces: with masters and gradients placed on the backend's device
//! (`Placement::Device`), `ShardedMuon` steps them there (momentum as tensors, the update and
//! Newton–Schulz as tensor operations, split matrices exchanged by the update group's
//! all-to-all-v or all-reduce on device tensors, the verdict read at commit at world 1). On NdArray the "device" is host
//! memory, so the device path and the host path run the same f32 operations: they are compared
//! here bitwise-close (1e-6) at world 1, 2, 4 and 2×2 (hierarchical and HSDP, both exchanges,
//! matrices cut by piece boundaries). The wgpu tests (`tests/wgpu_backend/`) run the same
//! optimizer on lavapipe and count its host reads.
//!
//! * a non-finite step read at commit applies nothing, Muon's momentum included;
//! * device momentum is saved and resumed by host Muon, bit for bit at the same world size, and
//!   at another world size training continues as the uninterrupted run; the other way round too;
//! * the optimizer's own reads on device pieces: none.

use std::path::Path;
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{
    init_seeded, named_params, shard, Hsdp, HsdpConfig, NonFinitePolicy, Placement,
};
use sshsdp::checkpoint;
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::{HostTraffic, MuonConfig, MuonExchange, ParamState, ShardedMuon, ShardedStep};
use sshsdp::plan::{Mesh, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const BATCH: usize = 8;
const LR: f64 = 2e-2;
const CONFIG: GptConfig = GptConfig {
    vocab: 32,
    d_model: 16,
    layers: 2,
    heads: 2,
    seq: 8,
};

type Weights = Vec<(String, Vec<f32>)>;

/// How a run is set up.
#[derive(Clone, Copy)]
struct Setup {
    mesh: (usize, usize),
    sharding: Sharding,
    exchange: MuonExchange,
    /// Masters and gradients on the device (the device path), or on the host.
    device: bool,
}

impl Setup {
    fn new(mesh: (usize, usize), device: bool) -> Self {
        Setup {
            mesh,
            sharding: Sharding::Hierarchical,
            exchange: MuonExchange::default(),
            device,
        }
    }

    fn world(&self) -> usize {
        self.mesh.0 * self.mesh.1
    }
}

/// One rank's run.
struct RankRun {
    losses: Vec<f32>,
    weights: Weights,
    /// Split matrices this rank orthogonalised over the run.
    split: u64,
    /// Elements this rank sent to others in the owner exchange over the run.
    sent: u64,
    /// The optimizer's own reads and uploads, per step.
    traffic: Vec<HostTraffic>,
    /// Every parameter's optimizer state on this rank at the end.
    states: Vec<Option<ParamState<Vec<Vec<f32>>>>>,
    skipped: u64,
}

fn tokens(step: usize, first: usize, rows: usize) -> Tensor<B, 2, Int> {
    let w = CONFIG.seq + 1;
    let data: Vec<i64> = (first * w..(first + rows) * w)
        .map(|i| ((i * 7 + step * 13 + (i / w) * 3) % CONFIG.vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, w]), &Default::default())
}

fn initial() -> Gpt<B> {
    init_seeded(&Default::default(), 11, |d| CONFIG.init(d))
}

/// Trains `setup` on `batches` (one step each; the loss of batch `poison` is made NaN),
/// resuming from a checkpoint `(directory, its step)` and saving to one where given.
fn run(
    setup: Setup,
    batches: &[usize],
    poison: Option<usize>,
    resume: Option<(&Path, usize)>,
    save: Option<&Path>,
) -> Vec<RankRun> {
    let init = initial();
    let world = setup.world();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let placement = if setup.device {
            Placement::Device
        } else {
            Placement::Host
        };
        // Small buckets: pieces cut through matrices, so split matrices are exchanged.
        let config = HsdpConfig::new(Mesh::new(setup.mesh.0, setup.mesh.1).unwrap())
            .with_sharding(setup.sharding)
            .with_bucket_elements(1500)
            .with_master_placement(placement)
            .with_grad_placement(placement)
            .with_non_finite_policy(NonFinitePolicy::SkipStep);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let muon = MuonConfig::new().with_weight_decay(0.01).init();
        let mut optim = ShardedMuon::new(muon, AdamWConfig::new().build(), device)
            .with_exchange(setup.exchange);
        let mut number = 0;
        if let Some((dir, at)) = resume {
            number = checkpoint::load(dir, &runtime, &mut optim).unwrap() as usize;
            assert_eq!(number, at);
        }
        let local = BATCH / world;
        let (mut losses, mut split, mut sent, mut traffic) = (Vec::new(), 0, 0, Vec::new());
        for &step in batches {
            number += 1;
            let mut loss = model.loss(tokens(step, rank * local, local));
            losses.push(loss.clone().into_scalar());
            if poison == Some(step) {
                loss = loss * f32::NAN;
            }
            let _ = loss.backward();
            model = optim.step(LR, model, &runtime).unwrap();
            split += optim.last_step().ns_split;
            sent += optim.last_step().sent_elements;
            traffic.push(optim.take_host_traffic());
        }
        if let Some(dir) = save {
            checkpoint::save(dir, &runtime, &optim, number as u64).unwrap();
        }
        let states = (0..runtime.plan().params().len())
            .map(|p| {
                optim.param_state(p).unwrap().map(|s| match s {
                    ParamState::Momentum(m) => ParamState::Momentum(m),
                    ParamState::Elementwise(adamw) => {
                        let (arrays, _) =
                            sshsdp::optim::state_codec::encode_state::<Inner, _>(adamw).unwrap();
                        ParamState::Elementwise(arrays.into_values().collect())
                    }
                })
            })
            .collect();
        let weights = named_params(&model)
            .unwrap()
            .into_iter()
            .map(|p| (p.path, p.values))
            .collect();
        RankRun {
            losses,
            weights,
            split,
            sent,
            traffic,
            states,
            skipped: runtime.take_counters().skipped_steps,
        }
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// The largest absolute difference between two runs' rank-0 weights, and between their mean
/// losses relative to the loss.
fn distance(a: &[RankRun], b: &[RankRun]) -> (f32, f32) {
    let mean =
        |r: &[RankRun], i: usize| r.iter().map(|r| r.losses[i]).sum::<f32>() / r.len() as f32;
    let loss = (0..a[0].losses.len())
        .map(|i| ((mean(a, i) - mean(b, i)) / mean(b, i)).abs())
        .fold(0f32, f32::max);
    assert_eq!(a[0].weights.len(), b[0].weights.len());
    let weights = a[0]
        .weights
        .iter()
        .zip(&b[0].weights)
        .flat_map(|((pa, x), (pb, y))| {
            assert_eq!(pa, pb);
            x.iter().zip(y).map(|(x, y)| (x - y).abs())
        })
        .fold(0f32, f32::max);
    (loss, weights)
}

/// The device path steps like the host path at every mesh, with split matrices.
#[test]
fn device_muon_steps_like_host_muon() {
    let setups = [
        ((1, 1), Sharding::Hierarchical, MuonExchange::OwnerAllToAll),
        ((1, 2), Sharding::Hierarchical, MuonExchange::OwnerAllToAll),
        ((1, 2), Sharding::Hierarchical, MuonExchange::AllReduce),
        ((1, 4), Sharding::Hierarchical, MuonExchange::AllReduce),
        ((2, 2), Sharding::Hierarchical, MuonExchange::OwnerAllToAll),
        ((2, 2), Sharding::Hsdp, MuonExchange::AllReduce),
    ];
    for (mesh, sharding, exchange) in setups {
        let what = format!("{mesh:?} {sharding:?} {exchange:?}");
        let setup = |device| Setup {
            sharding,
            exchange,
            ..Setup::new(mesh, device)
        };
        let device = run(setup(true), &[0, 1, 2, 3, 4], None, None, None);
        let host = run(setup(false), &[0, 1, 2, 3, 4], None, None, None);
        let (loss, weights) = distance(&device, &host);
        assert!(loss <= 1e-6 && weights <= 1e-6, "{what}: {loss} {weights}");
        let split: u64 = device.iter().map(|r| r.split).sum();
        assert_eq!(split, host.iter().map(|r| r.split).sum::<u64>(), "{what}");
        if mesh.1 > 1 {
            assert!(split > 0, "{what}: a matrix is cut by a piece boundary");
        }
        // The owner exchange runs on device pieces too (staged through the host on NdArray,
        // whose engine moves host memory), moving what the host path moves.
        let sent = |r: &[RankRun]| r.iter().map(|r| r.sent).collect::<Vec<_>>();
        assert_eq!(sent(&device), sent(&host), "{what}");
        if exchange == MuonExchange::OwnerAllToAll && mesh.1 > 1 {
            assert!(sent(&device).iter().sum::<u64>() > 0, "{what}");
        }
        // On device pieces the optimizer reads nothing back; it uploads only the split slices'
        // positions, once.
        for (rank, r) in device.iter().enumerate() {
            assert!(r.traffic.iter().all(|t| t.reads == 0), "{what} rank {rank}");
            assert!(r.traffic[1..].iter().all(HostTraffic::is_empty), "{what}");
            if split == 0 {
                assert!(r.traffic[0].is_empty(), "{what}: {:?}", r.traffic[0]);
            }
        }
        assert!(
            host[0].traffic.iter().all(|t| t.reads > 0),
            "host steps read"
        );
    }
}

/// A non-finite step whose verdict is read at commit applies nothing: masters, AdamW's state
/// and Muon's momentum are as if the batch had never been seen.
#[test]
fn a_non_finite_device_step_applies_nothing_momentum_included() {
    let setup = Setup::new((1, 1), true);
    let skipped = run(setup, &[0, 1, 2, 3, 4], Some(2), None, None);
    assert_eq!(skipped[0].skipped, 1);
    let without = run(setup, &[0, 1, 3, 4], None, None, None);
    for ((path, a), (_, b)) in skipped[0].weights.iter().zip(&without[0].weights) {
        assert!(
            a == b,
            "{path}: the skipped run differs from the run without the batch"
        );
    }
    for (param, (a, b)) in skipped[0].states.iter().zip(&without[0].states).enumerate() {
        assert!(a == b, "parameter {param}'s optimizer state differs");
    }
}

/// Device momentum saved at world 2 is read by host Muon at world 2 bit for bit, and host Muon
/// resumed from it at world 1 (re-sharded) trains on as the uninterrupted device run; a host
/// checkpoint resumes on the device likewise.
#[test]
fn device_and_host_muon_resume_each_other_at_any_world_size() {
    let all: Vec<usize> = (0..6).collect();
    for (saver, loader) in [(true, false), (false, true)] {
        let what = format!("saved on the {}", if saver { "device" } else { "host" });
        let dir = scratch_dir(&format!("muon-device-{saver}"));
        let saved = run(Setup::new((1, 2), saver), &all[..3], None, None, Some(&dir));
        // The same world: every state as it was saved, bit for bit.
        let same = run(Setup::new((1, 2), loader), &[], None, Some((&dir, 3)), None);
        for (a, b) in saved.iter().zip(&same) {
            assert_eq!(a.states, b.states, "{what}");
            assert_eq!(a.weights, b.weights, "{what}");
        }
        assert!(saved[0]
            .states
            .iter()
            .any(|s| matches!(s, Some(ParamState::Momentum(_)))));
        // Another world: training continues as the uninterrupted run.
        let whole = run(Setup::new((1, 2), saver), &all, None, None, None);
        let resumed = run(
            Setup::new((1, 1), loader),
            &all[3..],
            None,
            Some((&dir, 3)),
            None,
        );
        let tail: Vec<RankRun> = whole
            .into_iter()
            .map(|mut r| {
                r.losses.drain(..3);
                r
            })
            .collect();
        let (loss, weights) = distance(&resumed, &tail);
        assert!(loss <= 1e-4 && weights <= 2e-4, "{what}: {loss} {weights}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A model whose `pos` is a linear map (Muon steps it) and one whose `pos` is a lookup table of
/// the same shape (element-wise): the same parameter path, another role.
mod role_change {
    use burn::module::Module;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::tensor::backend::Backend;

    #[derive(Module, Debug)]
    pub struct AsLinear<B: Backend> {
        pub pos: Linear<B>,
    }

    #[derive(Module, Debug)]
    pub struct AsTable<B: Backend> {
        pub pos: Embedding<B>,
    }

    pub fn as_linear<B: Backend>(device: &B::Device) -> AsLinear<B> {
        AsLinear {
            pos: LinearConfig::new(8, 16).with_bias(false).init(device),
        }
    }

    pub fn as_table<B: Backend>(device: &B::Device) -> AsTable<B> {
        AsTable {
            pos: EmbeddingConfig::new(8, 16).init(device),
        }
    }
}

/// Roles follow module types: a checkpoint holding Muon momentum for a parameter that is now
/// an `Embedding`'s table is refused with an error naming the parameter and the change, and
/// loads as a cold start with the weights alone.
#[test]
fn a_checkpoint_of_another_role_is_refused_and_loads_cold_with_the_weights_alone() {
    let dir = scratch_dir("role-change");
    ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        type A = Autodiff<Hsdp<Inner>>;
        let device = Default::default();
        // Drawn under the process's RNG lock: a draw of Burn's global RNG outside it would
        // change the weights other tests of this binary draw from their seeds.
        let model = init_seeded(&device, 3, role_change::as_linear::<A>);
        let config = HsdpConfig::new(Mesh::flat(1).unwrap());
        let (model, runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
        let x = Tensor::<A, 2>::ones([2, 8], &device);
        let _ = model.pos.forward(x).sum().backward();
        let muon = MuonConfig::new().init();
        let mut optim = ShardedMuon::new(muon, AdamWConfig::new().build(), device);
        let _ = optim.step(LR, model, &runtime).unwrap();
        assert!(matches!(
            optim.param_state(0).unwrap(),
            Some(ParamState::Momentum(_))
        ));
        checkpoint::save(&dir, &runtime, &optim, 1).unwrap();
    })
    .unwrap();
    ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        type A = Autodiff<Hsdp<Inner>>;
        let device = Default::default();
        let model = init_seeded(&device, 3, role_change::as_table::<A>);
        assert_eq!(
            sshsdp::backend::param_roles(&model),
            vec![("pos.weight".to_string(), sshsdp::plan::Role::Elementwise)]
        );
        let config = HsdpConfig::new(Mesh::flat(1).unwrap());
        let (_model, runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
        let muon = MuonConfig::new().init();
        let mut optim = ShardedMuon::<Inner, _>::new(muon, AdamWConfig::new().build(), device);
        let error = checkpoint::load(&dir, &runtime, &mut optim).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("parameter 0") && message.contains("Muon momentum"),
            "{message}"
        );
        let step = checkpoint::load(&dir, &runtime, &mut checkpoint::WeightsOnly).unwrap();
        assert_eq!(step, 1);
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
