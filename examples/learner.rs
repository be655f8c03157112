//! A sharded model and optimizer inside burn-train's `Learner`: a small byte-level GPT trained
//! with SS-HSDP on 2 in-process ranks (CPU, NdArray), each rank running its own `Learner` on its
//! shard of the data, with burn-train's loss metric, LR scheduler and file metric logger.
//!
//! ```text
//! cargo run --release --features learner --example learner -- [--ranks N] [--epochs N] [--text FILE]
//! ```
//!
//! Three adapters make it work with burn-train 0.21 as it is:
//!
//! * [`ShardedAdamW`] implements burn's `Optimizer<M, B>` over [`ShardedOptimizer`]: burn's
//!   per-parameter `GradientsParams` are ignored (the runtime already holds each piece's
//!   reduce-scattered gradient: Autodiff handed every gradient to it during backward) and the
//!   step runs through the runtime. Its `Record` is `()`: save optimizer state with
//!   `sshsdp::checkpoint` (per rank, re-shardable), not burn-train's checkpointer.
//! * [`ShardedStrategy`], a `TrainingStrategy::Custom`: burn-train's built-in strategies start
//!   with `Learner::fork(device)`, i.e. `Param::fork` → `Tensor::to_device`, which turns every
//!   sharded parameter into a gathered local copy (`Hsdp`'s `float_to_device` materialises
//!   parameter handles, as any op on them does). The custom strategy runs the same epoch loop
//!   (LR step, train step, optimizer step, metric events, validation) without forking.
//! * Every rank runs the `Learner` in its own thread of the threads engine with an equal number
//!   of batches, so collectives stay in lockstep; rank 0 renders progress, the others are quiet.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoaderBuilder, Progress};
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamW, AdamWConfig, GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn::train::metric::{Adaptor, LossInput, LossMetric, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    EventProcessorTraining, InferenceStep, ItemLazy, Learner, LearnerEvent,
    LearningComponentsTypes, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainOutput, TrainStep, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};
use sshsdp::backend::{init_seeded, shard, Hsdp, HsdpConfig, HsdpRuntime};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::kernels::FusedOps;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::{ShardedOptimizer, ShardedStep};
use sshsdp::plan::Mesh;

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const CONFIG: GptConfig = GptConfig {
    vocab: 256,
    d_model: 64,
    layers: 2,
    heads: 4,
    seq: 32,
};
const BATCH_PER_RANK: usize = 4;

/// The model burn-train trains: the GPT and its loss.
#[derive(Module, Debug)]
pub struct Lm<B: Backend> {
    gpt: Gpt<B>,
}

/// One step's output: the mean next-token loss.
pub struct LmOutput<B: Backend> {
    loss: Tensor<B, 1>,
}

impl<B: Backend> ItemLazy for LmOutput<B> {
    type ItemSync = Self;

    fn sync(self) -> Self {
        self
    }
}

impl<B: Backend> Adaptor<LossInput<B>> for LmOutput<B> {
    fn adapt(&self) -> LossInput<B> {
        LossInput::new(self.loss.clone())
    }
}

impl<AB: AutodiffBackend + FusedOps> TrainStep for Lm<AB> {
    type Input = Tensor<AB, 2, Int>;
    type Output = LmOutput<AB>;

    fn step(&self, tokens: Self::Input) -> TrainOutput<LmOutput<AB>> {
        let loss = self.gpt.loss(tokens);
        // Backward hands every parameter's gradient to the SS-HSDP runtime (reduce-scattered
        // per bucket); the `GradientsParams` burn-train collects are not used by the step.
        TrainOutput::new(self, loss.backward(), LmOutput { loss })
    }
}

impl<IB: FusedOps> InferenceStep for Lm<IB> {
    type Input = Tensor<IB, 2, Int>;
    type Output = LmOutput<IB>;

    fn step(&self, tokens: Self::Input) -> LmOutput<IB> {
        LmOutput {
            loss: self.gpt.loss(tokens),
        }
    }
}

/// Burn's `Optimizer` over SS-HSDP's [`ShardedOptimizer`] (AdamW on each rank's pieces).
#[derive(Clone)]
pub struct ShardedAdamW {
    inner: Arc<Mutex<ShardedOptimizer<Inner, AdamW>>>,
    runtime: HsdpRuntime<Inner>,
}

impl Optimizer<Lm<B>, B> for ShardedAdamW {
    type Record = ();

    fn step(&mut self, lr: f64, module: Lm<B>, _grads: GradientsParams) -> Lm<B> {
        let mut optim = self.inner.lock().expect("optimizer lock");
        // Optimizer::step cannot return an error: a failed collective is fatal here.
        optim
            .step(lr, module, &self.runtime)
            .unwrap_or_else(|e| panic!("sharded optimizer step: {e}"))
    }

    fn step_multi(&mut self, lr: f64, module: Lm<B>, _grads: MultiGradientsParams) -> Lm<B> {
        self.step(lr, module, GradientsParams::new())
    }

    fn to_record(&self) {}

    fn load_record(self, _record: ()) -> Self {
        self
    }
}

/// burn-train's single-device epoch loop without `Learner::fork` (which would gather every
/// sharded parameter into a local copy).
pub struct ShardedStrategy;

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for ShardedStrategy {
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let mut processor = components.event_processor;
        for epoch in starting_epoch..=components.num_epochs {
            let global = Progress::new(epoch, components.num_epochs);
            let mut items = train.iter();
            let mut iteration = 0;
            while let Some(item) = items.next() {
                iteration += 1;
                learner.lr_step();
                let out = learner.train_step(item);
                learner.optimizer_step(out.grads);
                let event = TrainingItem::new(
                    out.item,
                    items.progress(),
                    global.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                processor.process_train(LearnerEvent::ProcessedItem(event));
            }
            processor.process_train(LearnerEvent::EndEpoch(epoch));

            let model = learner.model().valid();
            let mut items = valid.iter();
            let mut iteration = 0;
            while let Some(item) = items.next() {
                iteration += 1;
                let out = model.step(item);
                let event =
                    TrainingItem::new(out, items.progress(), global.clone(), Some(iteration), None);
                processor.process_valid(LearnerEvent::ProcessedItem(event));
            }
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
        }
        (learner.model(), processor)
    }
}

/// Rank 0 prints the loss every few iterations and at the end of each split; other ranks
/// render nothing.
struct RankRenderer {
    rank: usize,
    every: usize,
    train_loss: Option<f64>,
    valid_loss: Option<f64>,
}

fn numeric(state: &MetricState) -> Option<f64> {
    match state {
        MetricState::Numeric(_, NumericEntry::Value(v)) => Some(*v),
        MetricState::Numeric(
            _,
            NumericEntry::Aggregated {
                aggregated_value, ..
            },
        ) => Some(*aggregated_value),
        MetricState::Generic(_) => None,
    }
}

impl MetricsRendererTraining for RankRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.train_loss = numeric(&state).or(self.train_loss);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.valid_loss = numeric(&state).or(self.valid_loss);
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let iteration = item.iteration.unwrap_or(0);
        if self.rank == 0 && iteration % self.every == 0 {
            println!(
                "epoch {}/{} iteration {iteration}: train loss {:.4}",
                item.global_progress.items_processed,
                item.global_progress.items_total,
                self.train_loss.unwrap_or(f64::NAN)
            );
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let done = item
            .progress
            .as_ref()
            .is_some_and(|p| p.items_processed >= p.items_total);
        if self.rank == 0 && done {
            println!(
                "epoch {}/{}: valid loss {:.4}",
                item.global_progress.items_processed,
                item.global_progress.items_total,
                self.valid_loss.unwrap_or(f64::NAN)
            );
        }
    }
}

impl MetricsRendererEvaluation for RankRenderer {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}

    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for RankRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, _: burn::train::metric::MetricDefinition) {}
}

/// Byte windows of `seq + 1` tokens as an `[n, seq + 1]` batch.
#[derive(Clone)]
struct Windows;

impl<BB: Backend> Batcher<BB, Vec<i64>, Tensor<BB, 2, Int>> for Windows {
    fn batch(&self, items: Vec<Vec<i64>>, device: &BB::Device) -> Tensor<BB, 2, Int> {
        let rows = items.len();
        let width = CONFIG.seq + 1;
        let flat: Vec<i64> = items.into_iter().flatten().collect();
        Tensor::from_data(TensorData::new(flat, [rows, width]), device)
    }
}

/// This rank's windows: every `ranks`-th window of `bytes`, cut to a whole number of batches
/// that is the same on every rank.
fn windows(bytes: &[u8], rank: usize, ranks: usize, batches: usize) -> Vec<Vec<i64>> {
    let width = CONFIG.seq + 1;
    bytes
        .chunks_exact(width)
        .map(|w| w.iter().map(|&b| b as i64).collect())
        .skip(rank)
        .step_by(ranks)
        .take(batches * BATCH_PER_RANK)
        .collect()
}

struct Args {
    ranks: usize,
    epochs: usize,
    text: PathBuf,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        ranks: 2,
        epochs: 2,
        text: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let count = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{flag} wants a positive integer"))
        };
        match flag.as_str() {
            "--ranks" => args.ranks = count()?,
            "--epochs" => args.epochs = count()?,
            "--text" => args.text = PathBuf::from(&value),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(args)
}

fn main() -> Result<(), String> {
    let args = parse()?;
    let bytes = std::fs::read(&args.text).map_err(|e| format!("{}: {e}", args.text.display()))?;
    let per_rank = bytes.len() / (CONFIG.seq + 1) / args.ranks;
    let train_batches = (per_rank * 9 / 10) / BATCH_PER_RANK;
    let valid_batches = (per_rank / 10) / BATCH_PER_RANK;
    if train_batches == 0 || valid_batches == 0 {
        return Err(format!(
            "{} is too short for {} ranks",
            args.text.display(),
            args.ranks
        ));
    }
    let split = bytes.len() * 9 / 10;
    let (train_text, valid_text) = bytes.split_at(split);
    let device = Default::default();
    // Drawn whole under the process's RNG lock: the in-process ranks share Burn's RNG.
    let init = init_seeded(&device, 42, |d| Lm::<B> {
        gpt: CONFIG.init(d),
    });
    let artifacts = std::env::temp_dir().join("sshsdp-learner");
    println!(
        "{} ranks, {} epochs of {train_batches} batches of {BATCH_PER_RANK} x {} bytes per rank; \
         metrics under {}",
        args.ranks,
        args.epochs,
        CONFIG.seq + 1,
        artifacts.display()
    );
    let results = ThreadsWorld::run(args.ranks, ThreadsConfig::default(), |comm| {
        let rank = comm.rank();
        let device = Default::default();
        let mesh = Mesh::flat(args.ranks).map_err(|e| e.to_string())?;
        let (model, runtime) = shard::<B, _, _>(init.clone(), HsdpConfig::new(mesh), comm, &device)
            .map_err(|e| e.to_string())?;
        let counters = runtime.clone();
        let optim = ShardedAdamW {
            inner: Arc::new(Mutex::new(ShardedOptimizer::new(
                AdamWConfig::new().build(),
                device,
            ))),
            runtime,
        };
        let train = DataLoaderBuilder::<B, _, _>::new(Windows)
            .batch_size(BATCH_PER_RANK)
            .build(InMemDataset::new(windows(
                train_text,
                rank,
                args.ranks,
                train_batches,
            )));
        let valid = DataLoaderBuilder::<Hsdp<Inner>, _, _>::new(Windows)
            .batch_size(BATCH_PER_RANK)
            .build(InMemDataset::new(windows(
                valid_text,
                rank,
                args.ranks,
                valid_batches,
            )));
        let steps = args.epochs * train_batches;
        let scheduler = CosineAnnealingLrSchedulerConfig::new(3e-3, steps)
            .with_min_lr(3e-4)
            .init()
            .map_err(|e| e.to_string())?;
        let renderer = RankRenderer {
            rank,
            every: 10,
            train_loss: None,
            valid_loss: None,
        };
        let strategy: TrainingStrategy<_> = TrainingStrategy::Custom(Arc::new(ShardedStrategy));
        let result = SupervisedTraining::new(artifacts.join(format!("rank{rank}")), train, valid)
            .metric_train_numeric(LossMetric::<B>::new())
            .metric_valid_numeric(LossMetric::<Hsdp<Inner>>::new())
            .num_epochs(args.epochs)
            .renderer(renderer)
            .with_application_logger(None)
            .with_training_strategy(strategy)
            .launch(Learner::new(model, optim, scheduler));
        // The trained (inference) model still holds sharded parameters: every rank gathers.
        let check = valid_text
            .iter()
            .take(CONFIG.seq + 1)
            .map(|&b| b as i64)
            .collect::<Vec<_>>();
        let loss = result
            .model
            .step(Tensor::from_data(
                TensorData::new(check, [1, CONFIG.seq + 1]),
                &device,
            ))
            .loss
            .into_scalar();
        // Counters since sharding: the parameters stayed sharded and zero-copy all along.
        Ok::<_, String>((loss, counters.take_counters()))
    })
    .map_err(|e| e.to_string())?;
    for (rank, r) in results.into_iter().enumerate() {
        let (loss, c) = r.map_err(|_| format!("rank {rank} panicked"))??;
        if rank == 0 {
            let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
            println!(
                "after training: loss {loss:.4} on the first validation window; rank 0 \
                 all-gathered {:.1} MiB in {} bucket gathers, reduced {:.1} MiB of gradients, \
                 copied {} parameter bytes",
                mib(c.gathered_bytes),
                c.gathers,
                mib(c.reduced_bytes),
                c.param_bytes_copied
            );
        }
    }
    Ok(())
}
