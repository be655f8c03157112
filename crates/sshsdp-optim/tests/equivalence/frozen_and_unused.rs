//! Frozen and unused parameters train as plain Burn trains them, whether they have buckets of
//! their own or share one with trained parameters: a burn-nn `Linear` frozen with `no_grad()` is
//! never stepped (bitwise unchanged; a bucket of its own is never reduced), and a
//! `Linear` the graph uses on odd steps only is not stepped on even ones (its AdamW moments and
//! step count untouched), as Burn's optimizer adaptor skips a parameter without a gradient —
//! bitwise at world 1 and within 1e-5 at world 2, with and without gradient accumulation, for
//! AdamW (element-wise, per parameter); within 1e-5 for Muon (matrices split across pieces).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sshsdp_backend::{init_seeded, named_params, shard, HsdpConfig, NamedParam};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::{Muon, MuonConfig, MuonWithElementwise, ShardedMuon, ShardedOptimizer};
use sshsdp_plan::Mesh;

use super::{Inner, B};
use sshsdp_optim::ShardedStep;

const WIDTH: usize = 8;
const BATCH: usize = 4;
const STEPS: usize = 5;
const LR: f64 = 2e-2;

/// Four `Linear`s: `frozen` never trains, `odd` is used on odd steps only.
#[derive(Module, Debug)]
struct Branchy<B: Backend> {
    first: Linear<B>,
    frozen: Linear<B>,
    odd: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> Branchy<B> {
    fn new(device: &B::Device) -> Self {
        let linear = || LinearConfig::new(WIDTH, WIDTH).init(device);
        Self {
            first: linear(),
            frozen: linear().no_grad(),
            odd: linear(),
            head: linear(),
        }
    }

    /// Mean square of the output for `x` `[rows, WIDTH]` at `step`.
    fn loss(&self, x: Tensor<B, 2>, step: usize) -> Tensor<B, 1> {
        let mut h = self.first.forward(x).tanh();
        h = h.clone() + self.frozen.forward(h).tanh();
        if step % 2 == 1 {
            h = h.clone() + self.odd.forward(h).tanh();
        }
        self.head.forward(h).powi_scalar(2).mean()
    }
}

/// The global batch of `step`'s micro-batch `micro`.
fn batch(step: usize, micro: usize) -> Vec<f32> {
    (0..BATCH * WIDTH)
        .map(|i| (((i * 7 + step * 13 + micro * 29) % 17) as f32 - 8.0) / 8.0)
        .collect()
}

/// Rows `rows` of a global batch.
fn rows(values: &[f32], rows: std::ops::Range<usize>) -> Tensor<B, 2> {
    let data = values[rows.start * WIDTH..rows.end * WIDTH].to_vec();
    Tensor::from_data(
        TensorData::new(data, [rows.len(), WIDTH]),
        &Default::default(),
    )
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    AdamW,
    Muon,
}

fn muon() -> Muon {
    MuonConfig::new().init()
}

/// Plain Burn on one device with the global batch: losses per micro-batch, final weights.
fn plain(init: &Branchy<B>, opt: Opt, micro: usize) -> (Vec<f32>, Vec<NamedParam>) {
    let mut model = init.clone();
    let mut adamw = AdamWConfig::new().init::<B, Branchy<B>>();
    let mut muon = MuonWithElementwise::<B, _>::new(muon(), AdamWConfig::new().build());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut accumulator = GradientsAccumulator::<Branchy<B>>::new();
        for m in 0..micro {
            let loss = model.loss(rows(&batch(step, m), 0..BATCH), step);
            losses.push(loss.clone().into_scalar());
            accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let grads = accumulator.grads();
        model = match opt {
            Opt::AdamW => adamw.step(LR, model, grads),
            Opt::Muon => muon.step(LR, model, grads),
        };
    }
    (losses, named_params(&model).unwrap())
}

/// One rank's losses, final weights, gradient bytes reduced and each bucket's reduction bytes.
type RankRun = (Vec<f32>, Vec<NamedParam>, u64, Vec<u64>);

/// How the four `Linear`s are bucketed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Buckets {
    /// One `Linear` per bucket: frozen and unused layers have buckets of their own.
    PerLayer,
    /// A bucket size for all four: the frozen layer still gets a bucket of its own (the
    /// planner never mixes frozen and trainable parameters), the unused one shares a bucket
    /// with a trained one.
    Shared,
}

/// The same training sharded over `world` ranks; per rank its losses, final weights and the
/// gradient bytes it reduced.
fn sharded(
    init: &Branchy<B>,
    (opt, micro, world): (Opt, usize, usize),
    buckets: Buckets,
) -> Vec<RankRun> {
    ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let layer = (WIDTH * WIDTH + WIDTH) as u64;
        let config =
            HsdpConfig::new(Mesh::flat(world).unwrap()).with_bucket_elements(match buckets {
                Buckets::PerLayer => layer,
                Buckets::Shared => 4 * layer,
            });
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        // Each bucket's reduction bytes (f32 gradients of every piece).
        let plan = runtime.plan();
        let bucket_bytes = plan
            .buckets()
            .iter()
            .map(|b| 4 * plan.pieces() as u64 * b.piece_elements)
            .collect();
        let mut adamw = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
        let mut muon = ShardedMuon::<Inner, _>::new(muon(), AdamWConfig::new().build(), device);
        let local = BATCH / world;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            for m in 0..micro {
                let x = rows(&batch(step, m), rank * local..(rank + 1) * local);
                let loss = model.loss(x, step);
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
            }
            model = match opt {
                Opt::AdamW => adamw.step(LR, model, &runtime).unwrap(),
                Opt::Muon => muon.step(LR, model, &runtime).unwrap(),
            };
        }
        let reduced = runtime.take_counters().reduced_bytes;
        (losses, named_params(&model).unwrap(), reduced, bucket_bytes)
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

fn by_path<'a>(params: &'a [NamedParam], path: &str) -> &'a NamedParam {
    params.iter().find(|p| p.path == path).expect("path")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(opt: Opt, micro: usize, world: usize) {
    let init: Branchy<B> = init_seeded(&Default::default(), 11, Branchy::new);
    let start = named_params(&init).unwrap();
    let (want_losses, want) = plain(&init, opt, micro);
    for buckets in [Buckets::PerLayer, Buckets::Shared] {
        let ranks = sharded(&init, (opt, micro, world), buckets);
        let what = format!("{opt:?}, {micro} micro-batches, world {world}, {buckets:?}");
        check_ranks(
            &what,
            (opt, micro, world),
            buckets,
            &ranks,
            &start,
            (&want_losses, &want),
        );
    }
    // The odd layer did train (on odd steps), so skipping is what keeps it equal.
    let odd_start = &by_path(&start, "odd.weight").values;
    assert!(max_diff(&by_path(&want, "odd.weight").values, odd_start) > 1e-3);
}

fn check_ranks(
    what: &str,
    (opt, micro, world): (Opt, usize, usize),
    buckets: Buckets,
    ranks: &[RankRun],
    start: &[NamedParam],
    (want_losses, want): (&[f32], &[NamedParam]),
) {
    for (losses, got, reduced, bucket_bytes) in ranks {
        // The frozen layer is bitwise where it started, on every rank, as under plain Burn.
        for path in ["frozen.weight", "frozen.bias"] {
            assert_eq!(by_path(got, path), by_path(start, path), "{what}: {path}");
        }
        if buckets == Buckets::PerLayer {
            // Its bucket (the second) is never reduced; the odd layer's (the third) on odd
            // steps only.
            let odd_steps = (STEPS / 2) as u64;
            let per_step = bucket_bytes[0] + bucket_bytes[3];
            let expected = micro as u64 * (STEPS as u64 * per_step + odd_steps * bucket_bytes[2]);
            assert_eq!(bucket_bytes.len(), 4, "{what}: one Linear per bucket");
            assert_eq!(*reduced, expected, "{what}: reduced bytes");
        } else {
            // A bucket size for all four, but the planner gives the frozen layer a bucket of
            // its own (never reduced); the odd layer shares the last with the head, reduced
            // every step (zeros for the odd layer on even steps).
            assert_eq!(
                bucket_bytes.len(),
                3,
                "{what}: [first] [frozen] [odd, head]"
            );
            let expected = micro as u64 * STEPS as u64 * (bucket_bytes[0] + bucket_bytes[2]);
            assert_eq!(*reduced, expected, "{what}: reduced bytes");
        }
        // Everything else follows plain Burn: bitwise at world 1 with AdamW (Muon's batched
        // Newton–Schulz sums in another order than one matrix at a time: 1e-5 there).
        let exact = world == 1 && opt == Opt::AdamW;
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.path, w.path);
            let diff = max_diff(&g.values, &w.values);
            let tolerance = if exact { 0.0 } else { 1e-5 };
            assert!(diff <= tolerance, "{what}: {} differs by {diff}", g.path);
        }
        if exact {
            assert_eq!(losses.as_slice(), want_losses, "{what}: losses");
        } else if world == 1 {
            assert!(max_diff(losses, want_losses) <= 1e-5, "{what}: losses");
        }
    }
}

#[test]
fn frozen_and_unused_parameters_train_as_plain_burn_with_adamw() {
    for world in [1, 2] {
        check(Opt::AdamW, 1, world);
    }
}

#[test]
fn frozen_and_unused_parameters_train_as_plain_burn_with_gradient_accumulation() {
    for world in [1, 2] {
        check(Opt::AdamW, 2, world);
    }
}

#[test]
fn frozen_and_unused_parameters_train_as_plain_burn_with_muon() {
    for world in [1, 2] {
        check(Opt::Muon, 1, world);
    }
}

/// A `Linear` frozen after `shard` (`no_grad()` on the sharded module) stops receiving
/// gradients: from then on it is not stepped, bitwise, while the others train on.
#[test]
fn a_layer_frozen_after_shard_is_not_stepped() {
    // A trainable `Linear` where `Branchy` has its frozen one (drawn under the RNG lock).
    let mut unfrozen: Branchy<B> = init_seeded(&Default::default(), 12, Branchy::new);
    let other: Branchy<B> = init_seeded(&Default::default(), 13, Branchy::new);
    unfrozen.frozen = other.first;
    let ranks = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(2).unwrap());
        let (mut model, runtime) =
            shard::<B, _, _>(unfrozen.clone(), config, comm, &device).unwrap();
        let mut adamw = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
        let mut at_freeze = Vec::new();
        for step in 0..4 {
            if step == 2 {
                model.frozen = model.frozen.no_grad();
                at_freeze = named_params(&model).unwrap();
            }
            let x = rows(&batch(step, 0), rank * 2..rank * 2 + 2);
            let _ = model.loss(x, step).backward();
            model = adamw.step(LR, model, &runtime).unwrap();
        }
        (at_freeze, named_params(&model).unwrap())
    })
    .unwrap();
    for r in ranks {
        let (at_freeze, end) = r.unwrap();
        for path in ["frozen.weight", "frozen.bias"] {
            assert_eq!(by_path(&end, path), by_path(&at_freeze, path), "{path}");
        }
        let first = "first.weight";
        let moved = max_diff(
            &by_path(&end, first).values,
            &by_path(&at_freeze, first).values,
        );
        assert!(moved > 1e-4, "the other layers train on: {moved}");
    }
}

/// Plain Burn's way to unfreeze: every parameter of `module` made trainable again.
fn unfreeze<B: Backend, M: Module<B>>(module: M) -> M {
    struct Unfreeze;
    impl<B: Backend> burn::module::ModuleMapper<B> for Unfreeze {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            burn::module::Param::from_mapped_value(id, tensor.set_require_grad(true), mapper)
        }
    }
    module.map(&mut Unfreeze)
}

#[test]
fn a_layer_unfrozen_after_shard_trains_as_plain_burn_once_its_leaves_are_refreshed() {
    const UNFREEZE_AT: usize = 2;
    let init: Branchy<B> = init_seeded(&Default::default(), 14, Branchy::new);
    let mut plain = init.clone();
    let mut adamw = AdamWConfig::new().init::<B, Branchy<B>>();
    for step in 0..STEPS {
        if step == UNFREEZE_AT {
            plain.frozen = unfreeze(plain.frozen);
        }
        let loss = plain.loss(rows(&batch(step, 0), 0..BATCH), step);
        let grads = GradientsParams::from_grads(loss.backward(), &plain);
        plain = adamw.step(LR, plain, grads);
    }
    let want = named_params(&plain).unwrap();
    let start = named_params(&init).unwrap();
    for world in [1, 2] {
        let ranks = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
            let device = Default::default();
            let rank = comm.rank();
            let config = HsdpConfig::new(Mesh::flat(world).unwrap());
            let (mut model, runtime) =
                shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
            let mut adamw = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
            let local = BATCH / world;
            for step in 0..STEPS {
                if step == UNFREEZE_AT {
                    model.frozen = unfreeze(model.frozen);
                    model = sshsdp_backend::refresh_leaves(model);
                }
                let x = rows(&batch(step, 0), rank * local..(rank + 1) * local);
                let _ = model.loss(x, step).backward();
                model = adamw.step(LR, model, &runtime).unwrap();
            }
            named_params(&model).unwrap()
        })
        .unwrap();
        for r in ranks {
            let end = r.unwrap();
            for p in &want {
                let diff = max_diff(&by_path(&end, &p.path).values, &p.values);
                assert!(diff <= 1e-5, "world {world}: {} differs by {diff}", p.path);
            }
        }
    }
    let moved = max_diff(
        &by_path(&want, "frozen.weight").values,
        &by_path(&start, "frozen.weight").values,
    );
    assert!(moved > 1e-3, "the unfrozen layer trains: {moved}");
}

#[test]
fn a_layer_unfrozen_without_refreshing_its_leaves_is_an_error_not_a_silent_skip() {
    let init: Branchy<B> = init_seeded(&Default::default(), 15, Branchy::new);
    let out = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(1).unwrap());
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut adamw = ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), device);
        model.frozen = unfreeze(model.frozen);
        let _ = model.loss(rows(&batch(0, 0), 0..BATCH), 1).backward();
        adamw
            .step(LR, model, &runtime)
            .expect_err("refused")
            .to_string()
    })
    .unwrap();
    let error = out.into_iter().next().unwrap().unwrap();
    assert!(
        error.contains("`frozen.weight`") && error.contains("refresh_leaves"),
        "{error}"
    );
}
