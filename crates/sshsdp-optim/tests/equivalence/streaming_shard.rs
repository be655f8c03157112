//! Streaming registration: `shard` plans from parameter shapes alone, rank 0 initialises and
//! reads one bucket at a time, and the other ranks never initialise a lazy parameter — with the
//! same values and the same training as a module read whole before sharding.

use std::cell::Cell;
use std::sync::Mutex;

use crate::common::{batches, rows, TinyLm};
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param, ParamId};
use burn::optim::SgdConfig;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sshsdp_backend::{named_params, shard, with_burn_rng, Hsdp, HsdpConfig, NamedParam};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_optim::ShardedOptimizer;
use sshsdp_optim::ShardedStep;
use sshsdp_plan::{Mesh, RuntimeFormat};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

/// Trains `init` (sharded over `world` ranks, buckets of 1500 elements) for 2 SGD steps;
/// returns rank 0's weights right after `shard` and after training, and every rank's losses.
fn sharded_run(
    world: usize,
    format: RuntimeFormat,
    init: &TinyLm<B>,
) -> (Vec<NamedParam>, Vec<NamedParam>, Vec<Vec<f32>>) {
    let ranks = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(world).unwrap())
            .with_bucket_elements(1500)
            .with_format(format);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        assert!(runtime.plan().buckets().len() > 2, "several buckets");
        let start = named_params(&model).unwrap();
        let mut sgd = ShardedOptimizer::new(SgdConfig::new().build::<Inner>(), device);
        let mut losses = Vec::new();
        for batch in batches(2, 8) {
            let local = 8 / world;
            let loss = model.loss(rows::<B>(&batch, rank * local, local, &device));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            model = sgd.step(0.05, model, &runtime).unwrap();
        }
        (start, named_params(&model).unwrap(), losses)
    })
    .unwrap();
    let mut ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap()).collect();
    let losses = ranks.iter().map(|r| r.2.clone()).collect();
    let (start, end, _) = ranks.swap_remove(0);
    (start, end, losses)
}

fn bits(params: &[NamedParam]) -> Vec<(String, Vec<u32>)> {
    params
        .iter()
        .map(|p| {
            (
                p.path.clone(),
                p.values.iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

/// A lazy model sharded as it is (only rank 0 initialises it, bucket by bucket) starts from the
/// values and trains exactly like the same model read whole before `shard` — the draws of
/// Burn's process-global RNG happen in the same order — in f32 and bf16 runtime formats, at
/// world 1, 2 and 4. Rank 1's parameters are never initialised, yet keep their gradients.
#[test]
fn a_lazy_model_shards_and_trains_like_one_read_whole() {
    for format in [RuntimeFormat::F32, RuntimeFormat::Bf16] {
        for world in [1, 2, 4] {
            // One RNG section per run: the eager model is drawn then read whole; the lazy one
            // is drawn by rank 0 inside `shard`, so the RNG stays held until it is done.
            let (eager_start, eager_end, eager_losses, lazy) = with_burn_rng(|| {
                let device = Default::default();
                B::seed(&device, 11);
                let eager = TinyLm::<B>::new(&device);
                let read = named_params(&eager).unwrap();
                let (start, end, losses) = sharded_run(world, format, &eager);
                B::seed(&device, 11);
                let lazy = TinyLm::<B>::new(&device);
                assert!(
                    named_params_initialised(&lazy) == 0,
                    "a fresh Burn module is lazy"
                );
                let lazy_run = sharded_run(world, format, &lazy);
                check_start(&read, &start, format);
                (start, end, losses, lazy_run)
            });
            let (lazy_start, lazy_end, lazy_losses) = lazy;
            let what = format!("{format:?} at world {world}");
            assert_eq!(bits(&eager_start), bits(&lazy_start), "start, {what}");
            assert_eq!(eager_losses, lazy_losses, "losses, {what}");
            assert_eq!(bits(&eager_end), bits(&lazy_end), "trained, {what}");
            assert_ne!(bits(&lazy_start), bits(&lazy_end), "it trained, {what}");
        }
    }
}

/// `start` (the sharded parameters right after `shard`) is `read` (the values read before it)
/// as `format` holds them: the same bits in f32, rounded to bf16 in bf16.
fn check_start(read: &[NamedParam], start: &[NamedParam], format: RuntimeFormat) {
    let round = |v: f32| match format {
        RuntimeFormat::Bf16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    };
    for (r, s) in read.iter().zip(start) {
        let want: Vec<u32> = r.values.iter().map(|&v| round(v).to_bits()).collect();
        let got: Vec<u32> = s.values.iter().map(|v| v.to_bits()).collect();
        assert_eq!(want, got, "{}", r.path);
    }
}

/// How many of `module`'s float parameters are initialised.
fn named_params_initialised<M: Module<B>>(module: &M) -> usize {
    struct Count(usize);
    impl burn::module::ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 += usize::from(param.is_initialized());
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

thread_local! {
    /// The world rank of the thread (set by each rank of the test below).
    static RANK: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Which rank ran each initialiser, in order (parameter index, rank).
static INITS: Mutex<Vec<(usize, Option<usize>)>> = Mutex::new(Vec::new());

/// A module of lazy parameters whose initialisers record who ran them.
#[derive(Module, Debug)]
struct Recorded<B: Backend> {
    weights: Vec<Param<Tensor<B, 2>>>,
}

fn recorded(device: &burn::tensor::Device<B>) -> Recorded<B> {
    let weights = (0..6)
        .map(|i| {
            Param::uninitialized(
                ParamId::new(),
                move |device, require_grad| {
                    INITS.lock().unwrap().push((i, RANK.with(|r| r.get())));
                    Tensor::<B, 2>::full([40, 30], i as f32 + 0.5, device)
                        .set_require_grad(require_grad)
                },
                *device,
                true,
                [40, 30].into(),
            )
        })
        .collect();
    Recorded { weights }
}

/// Only rank 0 runs initialisers, each once, in plan order; every rank then holds the values
/// rank 0 drew.
#[test]
fn only_rank_0_initialises_lazy_parameters() {
    let world = 4;
    let results = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        RANK.with(|r| r.set(Some(comm.rank())));
        let device = Default::default();
        let model = recorded(&device);
        let config = HsdpConfig::new(Mesh::flat(world).unwrap()).with_bucket_elements(2400);
        let (model, runtime) = shard::<B, _, _>(model, config, comm, &device).unwrap();
        assert_eq!(
            runtime.plan().buckets().len(),
            3,
            "two parameters per bucket"
        );
        named_params(&model).unwrap()
    })
    .unwrap();
    let inits = INITS.lock().unwrap().clone();
    assert_eq!(
        inits,
        (0..6).map(|i| (i, Some(0))).collect::<Vec<_>>(),
        "rank 0 alone initialises, each parameter once, in order"
    );
    for params in results {
        for (i, p) in params.unwrap().iter().enumerate() {
            assert_eq!(p.shape, [40, 30]);
            assert!(p.values.iter().all(|&v| v == i as f32 + 0.5), "{}", p.path);
        }
    }
}
