//! Sharded training equals single-device training: the small transformer trained 20 steps with
//! SGD and with AdamW at world 1, 2, 4 (full sharding) and HSDP 2×2 gives the losses and final
//! weights of one device on the same global batch.
//!
//! Tolerance: gradients are averaged over ranks in a different order than one device sums its
//! batch, so they differ in the last bits; 20 optimizer steps keep that at the 1e-5 level.
//! Losses are compared with 1e-4 relative and weights with 1e-4 absolute tolerance.

use crate::common;

// More of "trains like": activation checkpointing, and registration that streams.
mod activation_checkpointing;
mod frozen_and_unused;
mod streaming_shard;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use common::{batches, rows, seeded, TinyLm};
use sshsdp_backend::{named_params, shard, Hsdp, HsdpConfig, Shard, RUNTIME_LANES};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::{Collective, CommFactory, CommResult, Element, ReduceOp, Reducible, SplitLanes};
use sshsdp_optim::ShardedOptimizer;
use sshsdp_optim::ShardedStep;
use sshsdp_plan::{Mesh, RuntimeFormat, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const STEPS: usize = 20;
const GLOBAL_BATCH: usize = 8;
const LR: f64 = 1e-2;

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

type Weights = Vec<(String, Vec<f32>)>;

fn initial_model() -> TinyLm<B> {
    seeded(7)
}

fn reference(opt: Opt, init: &TinyLm<B>) -> (Vec<f32>, Weights) {
    let device = Default::default();
    let mut model = init.clone();
    let data = batches(STEPS, GLOBAL_BATCH);
    let mut losses = Vec::new();
    let mut sgd = SgdConfig::new().init::<B, TinyLm<B>>();
    let mut adamw = AdamWConfig::new().init::<B, TinyLm<B>>();
    for batch in &data {
        let loss = model.loss(rows::<B>(batch, 0, GLOBAL_BATCH, &device));
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = match opt {
            Opt::Sgd => sgd.step(LR, model, grads),
            Opt::AdamW => adamw.step(LR, model, grads),
        };
    }
    let weights = named_params(&model)
        .unwrap()
        .into_iter()
        .map(|p| (p.path, p.values))
        .collect();
    (losses, weights)
}

fn sharded(opt: Opt, init: &TinyLm<B>, mesh: Mesh, sharding: Sharding) -> Vec<(Vec<f32>, Weights)> {
    sharded_in(opt, init, mesh, sharding, RuntimeFormat::F32)
}

fn sharded_in(
    opt: Opt,
    init: &TinyLm<B>,
    mesh: Mesh,
    sharding: Sharding,
    format: RuntimeFormat,
) -> Vec<(Vec<f32>, Weights)> {
    sharded_with(opt, init, mesh, sharding, &|c| c.with_format(format))
}

fn sharded_with(
    opt: Opt,
    init: &TinyLm<B>,
    mesh: Mesh,
    sharding: Sharding,
    configure: &(dyn Fn(HsdpConfig) -> HsdpConfig + Sync),
) -> Vec<(Vec<f32>, Weights)> {
    sharded_over(opt, init, mesh, sharding, configure, false)
}

/// [`sharded_with`]; with `thread_bound`, through `Shard::run_on` and communicators that cannot
/// cross threads ([`ThreadBound`]).
fn sharded_over(
    opt: Opt,
    init: &TinyLm<B>,
    mesh: Mesh,
    sharding: Sharding,
    configure: &(dyn Fn(HsdpConfig) -> HsdpConfig + Sync),
    thread_bound: bool,
) -> Vec<(Vec<f32>, Weights)> {
    let world = mesh.world_size();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        // Small buckets so that several collectives and piece boundaries are exercised.
        let config = configure(
            HsdpConfig::new(mesh)
                .with_sharding(sharding)
                .with_bucket_elements(1500),
        );
        let (mut model, runtime) = match thread_bound {
            false => shard::<B, _, _>(init.clone(), config, comm, &device),
            true => {
                let lanes = ThreadBoundLanes(SplitLanes::new(comm, RUNTIME_LANES).unwrap());
                Shard::new(config).run_on::<B, _, _>(init.clone(), lanes, &device)
            }
        }
        .unwrap();
        let local = GLOBAL_BATCH / world;
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let mut adamw = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let mut losses = Vec::new();
        for batch in batches(STEPS, GLOBAL_BATCH) {
            let loss = model.loss(rows::<B>(&batch, rank * local, local, &device));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            match opt {
                Opt::Sgd => model = sgd.step(LR, model, &runtime).unwrap(),
                Opt::AdamW => model = adamw.step(LR, model, &runtime).unwrap(),
            }
        }
        let weights = named_params(&model)
            .unwrap()
            .into_iter()
            .map(|p| (p.path, p.values))
            .collect();
        (losses, weights)
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

fn assert_equivalent(opt: Opt, mesh: Mesh, sharding: Sharding) {
    // One initial model for both runs (tests run in parallel and share Burn's global RNG).
    let init = initial_model();
    let reference = reference(opt, &init);
    let ranks = sharded(opt, &init, mesh, sharding);
    assert_matches(opt, mesh, sharding, reference, &ranks);
}

fn assert_matches(
    opt: Opt,
    mesh: Mesh,
    sharding: Sharding,
    (ref_losses, ref_weights): (Vec<f32>, Weights),
    ranks: &[(Vec<f32>, Weights)],
) {
    let world = ranks.len() as f32;
    for step in 0..STEPS {
        // The global loss is the mean of the ranks' local-batch losses (equal batch sizes).
        let loss: f32 = ranks.iter().map(|(l, _)| l[step]).sum::<f32>() / world;
        let want = ref_losses[step];
        assert!(
            (loss - want).abs() <= 1e-4 * want.abs(),
            "{opt:?} {mesh} {sharding:?} step {step}: loss {loss} vs {want}"
        );
    }
    if let Opt::AdamW = opt {
        let mean = |l: &[f32]| l.iter().sum::<f32>() / l.len() as f32;
        assert!(
            mean(&ref_losses[STEPS - 5..]) < mean(&ref_losses[..5]) - 0.1,
            "the model learns: {ref_losses:?}"
        );
    }
    for (_, weights) in ranks {
        assert_eq!(weights.len(), ref_weights.len());
        for ((path, got), (ref_path, want)) in weights.iter().zip(&ref_weights) {
            assert_eq!(path, ref_path);
            let max = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                max <= 1e-4,
                "{opt:?} {mesh} {sharding:?} {path}: max diff {max}"
            );
        }
    }
}

#[test]
fn world_1_equals_single_device() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        assert_equivalent(opt, Mesh::flat(1).unwrap(), Sharding::Hierarchical);
    }
}

#[test]
fn world_2_and_4_equal_single_device() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        assert_equivalent(opt, Mesh::flat(2).unwrap(), Sharding::Hierarchical);
        assert_equivalent(opt, Mesh::flat(4).unwrap(), Sharding::Hierarchical);
    }
}

#[test]
fn hsdp_and_hierarchical_2x2_equal_single_device() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        assert_equivalent(opt, Mesh::new(2, 2).unwrap(), Sharding::Hsdp);
        assert_equivalent(opt, Mesh::new(2, 2).unwrap(), Sharding::Hierarchical);
        assert_equivalent(opt, Mesh::new(2, 2).unwrap(), Sharding::Ddp);
    }
}

/// Runs `reference/plain-burn` — the same model on `Autodiff<NdArray>`, built outside this
/// workspace without burn's `distributed` feature — from `init`'s weights and the same data.
fn plain_burn(opt: Opt, init: &TinyLm<B>) -> (Vec<f32>, Weights) {
    use std::path::Path;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = root.join("target/reference");
    std::fs::create_dir_all(&target).unwrap();
    let name = format!("{opt:?}-{}", std::process::id());
    let input = target.join(format!("in-{name}.json"));
    let output = target.join(format!("out-{name}.json"));
    let params: Vec<serde_json::Value> = named_params(init)
        .unwrap()
        .into_iter()
        .map(|p| serde_json::json!({ "path": p.path, "values": p.values }))
        .collect();
    let request = serde_json::json!({
        "vocab": common::VOCAB,
        "d_model": common::D_MODEL,
        "seq": common::SEQ,
        "batch": GLOBAL_BATCH,
        "lr": LR,
        "optimizer": match opt { Opt::Sgd => "sgd", Opt::AdamW => "adamw" },
        "batches": batches(STEPS, GLOBAL_BATCH),
        "params": params,
    });
    std::fs::write(&input, request.to_string()).unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["run", "--quiet", "--manifest-path"])
        .arg(root.join("reference/plain-burn/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .arg("--")
        .arg(&input)
        .arg(&output)
        .status()
        .expect("run cargo for the plain-Burn reference");
    assert!(
        status.success(),
        "the plain-Burn reference failed: {status}"
    );
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let losses = floats(&result["losses"]);
    let weights = result["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["path"].as_str().unwrap().to_string(),
                floats(&p["values"]),
            )
        })
        .collect();
    (losses, weights)
}

#[test]
fn sharded_runs_equal_plain_burn_built_without_the_decorator() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let init = initial_model();
        let plain = plain_burn(opt, &init);
        // `Autodiff<Hsdp<NdArray>>` without `shard` is plain Burn, bit for bit: the supported way
        // to train an unsharded model in a program built with burn's `distributed` feature
        // (where plain `Autodiff<NdArray>`'s backward does not compile).
        let (losses, weights) = reference(opt, &init);
        assert_eq!(
            losses, plain.0,
            "{opt:?}: unsharded Hsdp vs plain Burn losses"
        );
        assert_eq!(
            weights, plain.1,
            "{opt:?}: unsharded Hsdp vs plain Burn weights"
        );
        for (mesh, sharding) in [
            (Mesh::flat(1).unwrap(), Sharding::Hierarchical),
            (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
            (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
            (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        ] {
            let ranks = sharded(opt, &init, mesh, sharding);
            assert_matches(opt, mesh, sharding, plain.clone(), &ranks);
        }
    }
}

/// bf16 runtime parameters (fp32 master weights per piece): every world size and mesh trains as
/// world 1 does, and close to f32 training.
///
/// Tolerance: the masters differ across world sizes in the last f32 bits (reduction order), and
/// a bf16 re-derivation can round such a pair to neighbouring bf16 values, so weights may differ
/// by one bf16 step (up to 2^-7 relative) plus 1e-4 absolute — 1 % of one AdamW step at lr
/// 1e-2 — for weights near zero, which AdamW moves by whole learning-rate steps whose sign the
/// rounding can flip; losses by 1e-3 relative. Against f32 training the bf16 rounding of every
/// weight (≈0.2 % relative) moves the losses by up to 2 %.
#[test]
fn bf16_runtime_trains_the_same_at_every_world_size() {
    let init = initial_model();
    let one = sharded_in(
        Opt::AdamW,
        &init,
        Mesh::flat(1).unwrap(),
        Sharding::Hierarchical,
        RuntimeFormat::Bf16,
    );
    let (base_losses, base_weights) = &one[0];
    let (f32_losses, _) = reference(Opt::AdamW, &init);
    for (step, (a, b)) in base_losses.iter().zip(&f32_losses).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * b.abs(),
            "step {step}: bf16 {a} vs f32 {b}"
        );
    }
    assert!(
        base_losses[STEPS - 1] < base_losses[0] - 0.1,
        "{base_losses:?}"
    );
    for (mesh, sharding) in [
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
    ] {
        let ranks = sharded_in(Opt::AdamW, &init, mesh, sharding, RuntimeFormat::Bf16);
        let world = ranks.len() as f32;
        for step in 0..STEPS {
            let loss: f32 = ranks.iter().map(|(l, _)| l[step]).sum::<f32>() / world;
            let want = base_losses[step];
            assert!(
                (loss - want).abs() <= 1e-3 * want.abs(),
                "{mesh} {sharding:?} step {step}: loss {loss} vs {want}"
            );
        }
        for (_, weights) in &ranks {
            for ((path, got), (_, want)) in weights.iter().zip(base_weights) {
                for (a, b) in got.iter().zip(want) {
                    let ulp = a.abs().max(b.abs()) / 128.0 + 1e-4;
                    assert!(
                        (a - b).abs() <= ulp,
                        "{mesh} {sharding:?} {path}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Resharding after forward (buckets released after their forward use, gathered again in
/// backward) trains exactly as keeping them resident.
#[test]
fn reshard_after_forward_equals_single_device() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let init = initial_model();
        let reference = reference(opt, &init);
        for (mesh, sharding) in [
            (Mesh::flat(1).unwrap(), Sharding::Hierarchical),
            (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
            (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
            (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        ] {
            let ranks = sharded_with(opt, &init, mesh, sharding, &|c| {
                c.with_reshard_after_forward(true)
            });
            assert_matches(opt, mesh, sharding, reference.clone(), &ranks);
        }
    }
}

/// A threads-engine communicator that cannot cross threads (`!Send`) and fails any call made on
/// another thread than the one that made it: what an NCCL communicator is to the runtime.
struct ThreadBound<C> {
    inner: C,
    owner: std::thread::ThreadId,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl<C> ThreadBound<C> {
    fn new(inner: C) -> Self {
        Self {
            inner,
            owner: std::thread::current().id(),
            _not_send: std::marker::PhantomData,
        }
    }

    fn on_owner(&self) -> &C {
        assert_eq!(
            std::thread::current().id(),
            self.owner,
            "a thread-bound communicator was used on another thread"
        );
        &self.inner
    }
}

impl<C: Collective> Collective for ThreadBound<C> {
    fn rank(&self) -> usize {
        self.on_owner().rank()
    }
    fn size(&self) -> usize {
        self.on_owner().size()
    }
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        self.on_owner().all_gather_in_place(buf)
    }
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        self.on_owner().all_gather(send, recv)
    }
    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        self.on_owner().reduce_scatter(send, recv, op)
    }
    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        self.on_owner().all_reduce(buf, op)
    }
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        self.on_owner()
            .all_to_all_v(send, send_counts, recv, recv_counts)
    }
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        self.on_owner().broadcast(buf, root)
    }
    fn barrier(&self) -> CommResult<()> {
        self.on_owner().barrier()
    }
    fn split(&self, color: usize, key: usize) -> CommResult<Self> {
        self.on_owner().split(color, key).map(ThreadBound::new)
    }
}

/// Lanes of [`ThreadBound`] communicators, each made on the thread that connects it.
struct ThreadBoundLanes<C>(SplitLanes<C>);

impl<C: Collective + Send + 'static> CommFactory for ThreadBoundLanes<C> {
    type Comm = ThreadBound<C>;
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn lanes(&self) -> usize {
        self.0.lanes()
    }
    fn connect(&self, lane: usize) -> CommResult<ThreadBound<C>> {
        self.0.connect(lane).map(ThreadBound::new)
    }
}

#[test]
fn communicators_that_cannot_cross_threads_train_the_same() {
    let init = initial_model();
    let mesh = Mesh::new(2, 2).unwrap();
    let keep = |c: HsdpConfig| c.with_reshard_after_forward(true);
    let send = sharded_over(
        Opt::AdamW,
        &init,
        mesh,
        Sharding::Hierarchical,
        &keep,
        false,
    );
    let bound = sharded_over(Opt::AdamW, &init, mesh, Sharding::Hierarchical, &keep, true);
    assert_eq!(send, bound, "the same collectives in the same order");
}
