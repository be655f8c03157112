//! Module buffers (burn-nn `BatchNorm`'s running statistics) against plain Burn: told apart
//! from frozen parameters and left out of the plan; a BatchNorm model trains exactly as plain
//! Burn at world 1 (losses, weights, running statistics, eval outputs, bitwise); its eval
//! outputs after training at world 2 come back bit for bit after resuming at world 1 and at
//! world 3, and from the safetensors export in plain Burn; `broadcast_buffers` makes every
//! rank's statistics rank 0's; the calls that cannot reach the buffers refuse such a model.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_store::{ModuleSnapshot, SafetensorsStore};
use sshsdp_backend::{
    init_seeded, named_params, param_shapes, shard, Hsdp, HsdpConfig, HsdpRuntime, NamedParam,
};
use sshsdp_checkpoint::{
    apply_full, export_full, export_model, export_safetensors, load, load_model, read_checkpoint,
    save, save_model, WeightsOnly,
};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::ShardedOptimizer;
use sshsdp_optim::ShardedStep;
use sshsdp_plan::Mesh;

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const WIDTH: usize = 6;
const HIDDEN: usize = 5;
const BATCH: usize = 6;
const STEPS: usize = 4;
const LR: f64 = 5e-2;
const SEED: u64 = 23;

/// A linear layer, a BatchNorm over its features, a frozen linear layer and a head.
#[derive(Module, Debug)]
struct Normed<B: Backend> {
    first: Linear<B>,
    norm: BatchNorm<B>,
    frozen: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> Normed<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            first: LinearConfig::new(WIDTH, HIDDEN).init(device),
            norm: BatchNormConfig::new(HIDDEN).init(device),
            frozen: LinearConfig::new(HIDDEN, HIDDEN).init(device).no_grad(),
            head: LinearConfig::new(HIDDEN, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.norm.forward(self.first.forward(x)).tanh();
        self.head.forward(self.frozen.forward(h).tanh())
    }

    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        self.forward(x).powi_scalar(2).mean()
    }
}

/// Rows `rows` of step `step`'s global batch (step `STEPS`: the eval batch).
fn batch<B: Backend>(step: usize, rows: std::ops::Range<usize>) -> Tensor<B, 2> {
    let values: Vec<f32> = (rows.start * WIDTH..rows.end * WIDTH)
        .map(|i| (((i * 5 + step * 11) % 13) as f32 - 6.0) / 3.0 + i as f32 * 0.01)
        .collect();
    Tensor::from_data(
        TensorData::new(values, [rows.len(), WIDTH]),
        &Default::default(),
    )
}

fn eval_batch<B: Backend>() -> Tensor<B, 2> {
    batch(STEPS, 0..BATCH)
}

fn model() -> Normed<B> {
    init_seeded(&Default::default(), SEED, Normed::new)
}

fn values<B: Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn by_path<'a>(params: &'a [NamedParam], path: &str) -> &'a NamedParam {
    params.iter().find(|p| p.path == path).expect(path)
}

fn threads() -> ThreadsConfig {
    ThreadsConfig {
        timeout: Duration::from_secs(60),
    }
}

/// Shards a freshly built model (built on each rank: `RunningState` clones share their value,
/// so one model cloned into in-process ranks would mix their statistics).
fn sharded(
    world: usize,
    comm: impl Collective + Send + 'static,
) -> (Normed<B>, HsdpRuntime<Inner>) {
    let config = HsdpConfig::new(Mesh::flat(world).unwrap()).with_bucket_elements(40);
    shard::<B, _, _>(model(), config, comm, &Default::default()).unwrap()
}

/// `STEPS` AdamW steps, each rank on its rows of the global batch.
fn train(
    mut model: Normed<B>,
    runtime: &HsdpRuntime<Inner>,
    world: usize,
) -> (Normed<B>, Vec<f32>) {
    let mut optim =
        ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), Default::default());
    let (rank, local) = (runtime.rank(), BATCH / world);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let loss = model.loss(batch(step, rank * local..(rank + 1) * local));
        losses.push(loss.clone().into_scalar());
        let _ = loss.backward();
        model = optim.step(LR, model, runtime).unwrap();
    }
    (model, losses)
}

#[test]
fn buffers_are_told_apart_from_frozen_parameters_and_not_planned() {
    let paths: Vec<String> = param_shapes(&model()).into_iter().map(|(p, _)| p).collect();
    assert!(paths.contains(&"frozen.weight".to_string()), "{paths:?}");
    assert!(
        !paths.iter().any(|p| p.starts_with("norm.running")),
        "{paths:?}"
    );
    let out = ThreadsWorld::run(1, threads(), |comm| {
        let (_, runtime) = sharded(1, comm);
        let buffers: Vec<(String, Vec<usize>)> = runtime
            .buffers()
            .iter()
            .map(|b| (b.path.clone(), b.shape.clone()))
            .collect();
        let planned: Vec<String> = runtime
            .plan()
            .params()
            .iter()
            .map(|p| p.spec.path.clone())
            .collect();
        (buffers, planned)
    })
    .unwrap();
    let (buffers, planned) = out.into_iter().next().unwrap().unwrap();
    assert_eq!(
        buffers,
        [
            ("norm.running_mean".to_string(), vec![HIDDEN]),
            ("norm.running_var".to_string(), vec![HIDDEN])
        ]
    );
    assert!(planned.contains(&"norm.gamma".to_string()));
    assert!(planned.contains(&"frozen.weight".to_string()));
    assert!(!planned.iter().any(|p| p.starts_with("norm.running")));
}

#[test]
fn batchnorm_trains_exactly_as_plain_burn_at_world_1() {
    // Plain Burn on one device with the global batch.
    let mut plain = model();
    let mut adamw = AdamWConfig::new().init::<B, Normed<B>>();
    let mut want_losses = Vec::new();
    for step in 0..STEPS {
        let loss = plain.loss(batch(step, 0..BATCH));
        want_losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &plain);
        plain = adamw.step(LR, plain, grads);
    }
    let plain = plain.valid();
    let want = named_params(&plain).unwrap();
    let want_eval = values(plain.forward(eval_batch()));

    let out = ThreadsWorld::run(1, threads(), |comm| {
        let (model, runtime) = sharded(1, comm);
        let (model, losses) = train(model, &runtime, 1);
        let buffers = runtime.buffer_values(&model).unwrap();
        let weights = named_params(&model).unwrap();
        let eval = values(model.valid().forward(eval_batch()));
        (losses, weights, buffers, eval)
    })
    .unwrap();
    let (losses, weights, buffers, eval) = out.into_iter().next().unwrap().unwrap();
    assert_eq!(losses, want_losses);
    for p in weights
        .iter()
        .filter(|p| !p.path.starts_with("norm.running"))
    {
        assert_eq!(p.values, by_path(&want, &p.path).values, "{}", p.path);
    }
    for b in &buffers {
        assert_eq!(b.values, by_path(&want, &b.path).values, "{}", b.path);
    }
    // The statistics did move (the test would not see a lost update otherwise), and the frozen
    // layer did not.
    assert_ne!(
        by_path(&buffers, "norm.running_var").values,
        vec![1.0; HIDDEN]
    );
    let start = named_params(&model()).unwrap();
    assert_eq!(
        by_path(&weights, "frozen.weight"),
        by_path(&start, "frozen.weight")
    );
    assert_eq!(eval, want_eval);
}

#[test]
fn batchnorm_eval_outputs_survive_a_checkpoint_at_other_world_sizes() {
    let dir = tempdir("resume");
    let export = dir.join("model.safetensors");
    // Train at world 2: each rank normalises with its own rows' statistics.
    let saved = ThreadsWorld::run(2, threads(), |comm| {
        let (model, runtime) = sharded(2, comm);
        let (model, _) = train(model, &runtime, 2);
        // The calls that do not take the module refuse it rather than lose its buffers.
        let refused = save(dir.join("refused"), &runtime, &WeightsOnly, 1).unwrap_err();
        assert!(refused.to_string().contains("save_model"), "{refused}");
        let refused = export_safetensors(&runtime, &export).unwrap_err();
        assert!(refused.to_string().contains("export_model"), "{refused}");
        // Saved straight after training, while the last update is still held back.
        save_model(&dir, &model, &runtime, &WeightsOnly, STEPS as u64).unwrap();
        export_model(&model, &runtime, &export).unwrap();
        let eval = values(model.valid().forward(eval_batch()));
        let buffers = runtime.buffer_values(&model).unwrap();
        (eval, buffers)
    })
    .unwrap();
    let saved: Vec<_> = saved.into_iter().map(|r| r.unwrap()).collect();
    let (want_eval, want_buffers) = &saved[0];
    assert_ne!(
        saved[0].1, saved[1].1,
        "the ranks' statistics come from different rows"
    );

    for world in [1, 3] {
        let resumed = ThreadsWorld::run(world, threads(), |comm| {
            let (mut model, runtime) = sharded(world, comm);
            let mut weights = WeightsOnly;
            let refused = load(&dir, &runtime, &mut weights).unwrap_err();
            assert!(refused.to_string().contains("load_model"), "{refused}");
            let step = load_model(&dir, &mut model, &runtime, &mut weights).unwrap();
            assert_eq!(step, STEPS as u64);
            let buffers = runtime.buffer_values(&model).unwrap();
            (values(model.valid().forward(eval_batch())), buffers)
        })
        .unwrap();
        for (rank, r) in resumed.into_iter().enumerate() {
            let (eval, buffers) = r.unwrap();
            assert_eq!(
                &buffers, want_buffers,
                "world {world} rank {rank}: rank 0's buffers"
            );
            assert_eq!(&eval, want_eval, "world {world} rank {rank}: eval outputs");
        }
    }

    // Offline: the checkpoint as an unsharded model, and the export loaded by plain Burn.
    let full = export_full(&read_checkpoint(&dir).unwrap()).unwrap();
    let offline = apply_full(model(), &full).unwrap().valid();
    assert_eq!(&values(offline.forward(eval_batch())), want_eval);
    let mut plain = Normed::<Inner>::new(&Default::default());
    let applied = plain
        .load_from(&mut SafetensorsStore::from_file(&export))
        .unwrap();
    assert!(applied.errors.is_empty(), "{applied:?}");
    assert_eq!(&values(plain.forward(eval_batch())), want_eval);
}

#[test]
fn broadcast_buffers_gives_every_rank_rank_0s_statistics() {
    let out = ThreadsWorld::run(2, threads(), |comm| {
        let (model, runtime) = sharded(2, comm);
        let (model, _) = train(model, &runtime, 2);
        let before = runtime.buffer_values(&model).unwrap();
        let model = runtime.broadcast_buffers(model).unwrap();
        let after = runtime.buffer_values(&model).unwrap();
        // The module goes on training with them.
        let (model, _) = train(model, &runtime, 2);
        let _ = model;
        (before, after)
    })
    .unwrap();
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_ne!(out[0].0, out[1].0);
    assert_eq!(out[0].1, out[0].0, "rank 0 keeps its own");
    assert_eq!(out[1].1, out[0].0, "rank 1 now holds rank 0's");
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "sshsdp-buffers-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
