//! Plumbing shared by the training examples (`train_gpt`, `train_dit`): command-line options,
//! the engine (in-process threads, or one process per rank under `mpirun`), the optimizer
//! (distributed Muon for matrices + AdamW for the rest, or AdamW alone), the learning-rate
//! schedule, and the training loop with its progress bar, metrics CSV, loss-curve SVG and
//! sharded checkpoints.
//!
//! An example describes its job as a [`Task`] (model, batches, held-out loss, what to do after
//! training) and hands it to [`run`].

pub mod plot;

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use indicatif::{ProgressBar, ProgressStyle};
use sshsdp::backend::{named_params, shard, Hsdp, HsdpConfig, HsdpError, HsdpRuntime};
use sshsdp::checkpoint::{self, PieceStates};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::{Collective, ReduceOp};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::{MuonConfig, ShardedMuon, UpdateScale};
use sshsdp::plan::{Mesh, RuntimeFormat};

/// The backend the examples compute on: burn-flex (with SIMD) ran the GPT example's training
/// step 1.3× faster than NdArray at 2 ranks and 2.1× at 1 rank (see `examples/train_gpt.rs`),
/// although the decorator's zero-copy parameter views are specific to NdArray.
pub type Inner = Flex;
/// The training backend: autodiff over the sharding decorator.
pub type B = Autodiff<Hsdp<Inner>>;
/// The backend of evaluation and sampling: the decorator without autodiff (`model.valid()`), so
/// forward passes that are never followed by a backward pass build no graph.
pub type Eval = Hsdp<Inner>;
/// The device of [`B`].
pub type Device = burn::backend::flex::FlexDevice;

/// Which optimizer steps the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimKind {
    /// Distributed Muon on hidden matrices, AdamW on embeddings, norms, biases and heads.
    Muon,
    /// AdamW on everything.
    AdamW,
}

/// Options every training example accepts (see [`COMMON_USAGE`]).
#[derive(Clone, Debug)]
pub struct Args {
    /// `--ranks N`: world size on the threads engine.
    pub ranks: Option<usize>,
    /// `--mesh RxS`: replicas × shards.
    pub mesh: Option<Mesh>,
    /// `--steps N`: optimizer steps in this invocation.
    pub steps: usize,
    /// `--optim muon|adamw`.
    pub optim: OptimKind,
    /// `--format bf16|f32|mxfp8`: runtime parameter format.
    pub format: RuntimeFormat,
    /// `--clip MAX_NORM` (`--clip 0` turns clipping off).
    pub clip: Option<f64>,
    /// `--lr LR`: peak learning rate (both optimizers).
    pub lr: f64,
    /// `--warmup N`: linear warm-up steps.
    pub warmup: usize,
    /// `--eval-every N`: steps between held-out evaluations (0: only at the end).
    pub eval_every: usize,
    /// `--out DIR`: where metrics, plot and samples go.
    pub out: PathBuf,
    /// `--save DIR`: write a sharded checkpoint at the end.
    pub save: Option<PathBuf>,
    /// `--resume DIR`: continue from a checkpoint (any world size or mesh).
    pub resume: Option<PathBuf>,
    /// `--seed N`: initial weights and data order.
    pub seed: u64,
    /// `--trace FILE`: write a Chrome trace of every rank's communication timeline.
    pub trace: Option<PathBuf>,
}

/// Per-example defaults of [`Args`].
pub struct Defaults {
    /// Optimizer steps.
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Steps between evaluations.
    pub eval_every: usize,
    /// Output directory.
    pub out: &'static str,
}

/// Help text of the options in [`Args`].
pub const COMMON_USAGE: &str = "\
Engine and sharding:
  --ranks N            in-process ranks (threads engine; default 2)
  --mesh RxS           R replicas x S shards (hierarchical: runtime shards over S, update
                       shards over all R*S ranks)
  Under mpirun (built with --features mpi) every process is one rank and the world size is
  mpirun's -n; --mesh may still split it into replicas x shards.
Optimization:
  --steps N            optimizer steps in this run
  --optim muon|adamw   muon: distributed Muon on hidden matrices + AdamW on the rest (default)
  --lr LR              peak learning rate of both optimizers (linear warm-up, cosine decay to 10%)
  --warmup N           warm-up steps
  --clip MAX_NORM      global gradient-norm clipping (default 1; 0 turns it off)
  --format FORMAT      runtime parameters: bf16 (default), f32 or mxfp8
  --seed N             initial weights and data order (default 0)
Output:
  --out DIR            metrics.csv, loss.svg and samples (default runs/<example>/)
  --eval-every N       steps between held-out evaluations (0: at the end only)
  --save DIR           write a sharded checkpoint at the end
  --resume DIR         continue from a checkpoint written at any world size or mesh
  --trace FILE         Chrome-trace JSON of every collective and every wait on one (open it in
                       Perfetto); under mpirun rank r > 0 writes FILE.rank<r>
  -h, --help           this help";

/// Parses a value of option `flag`.
pub fn parse_num<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e| format!("{flag}: `{value}` is not valid ({e})"))
}

/// Parses the command line: the options of [`Args`], and the example's own through `extra`
/// (called with each unknown flag and a function that takes its value; it returns `Ok(false)`
/// for flags it does not know). `Ok(None)` means `--help` was asked for.
pub fn parse_args(
    args: impl IntoIterator<Item = String>,
    defaults: &Defaults,
    mut extra: impl FnMut(&str, &mut dyn FnMut() -> Result<String, String>) -> Result<bool, String>,
) -> Result<Option<Args>, String> {
    let mut out = Args {
        ranks: None,
        mesh: None,
        steps: defaults.steps,
        optim: OptimKind::Muon,
        format: RuntimeFormat::Bf16,
        clip: Some(1.0),
        lr: defaults.lr,
        warmup: defaults.warmup,
        eval_every: defaults.eval_every,
        out: PathBuf::from(defaults.out),
        save: None,
        resume: None,
        seed: 0,
        trace: None,
    };
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--ranks" => {
                let n: usize = parse_num(&flag, &value()?)?;
                if n == 0 {
                    return Err("--ranks must be at least 1".into());
                }
                out.ranks = Some(n);
            }
            "--mesh" => {
                let v = value()?;
                let (r, s) = v
                    .split_once('x')
                    .ok_or_else(|| format!("--mesh is REPLICASxSHARDS (e.g. 2x2), not `{v}`"))?;
                let mesh = Mesh::new(parse_num("--mesh", r)?, parse_num("--mesh", s)?)
                    .map_err(|e| format!("--mesh {v}: {e}"))?;
                out.mesh = Some(mesh);
            }
            "--steps" => {
                out.steps = parse_num(&flag, &value()?)?;
                if out.steps == 0 {
                    return Err("--steps must be at least 1".into());
                }
            }
            "--optim" => {
                out.optim = match value()?.as_str() {
                    "muon" => OptimKind::Muon,
                    "adamw" => OptimKind::AdamW,
                    o => return Err(format!("--optim is muon or adamw, not `{o}`")),
                }
            }
            "--format" => {
                out.format = match value()?.as_str() {
                    "bf16" => RuntimeFormat::Bf16,
                    "f32" => RuntimeFormat::F32,
                    "mxfp8" => RuntimeFormat::Mxfp8,
                    f => return Err(format!("--format is bf16, f32 or mxfp8, not `{f}`")),
                }
            }
            "--clip" => {
                let c: f64 = parse_num(&flag, &value()?)?;
                if !(c >= 0.0 && c.is_finite()) {
                    return Err(format!("--clip must be a finite norm >= 0, not {c}"));
                }
                out.clip = (c > 0.0).then_some(c);
            }
            "--lr" => {
                out.lr = parse_num(&flag, &value()?)?;
                if !(out.lr > 0.0 && out.lr.is_finite()) {
                    return Err(format!("--lr must be positive, not {}", out.lr));
                }
            }
            "--warmup" => out.warmup = parse_num(&flag, &value()?)?,
            "--eval-every" => out.eval_every = parse_num(&flag, &value()?)?,
            "--seed" => out.seed = parse_num(&flag, &value()?)?,
            "--out" => out.out = PathBuf::from(value()?),
            "--save" => out.save = Some(PathBuf::from(value()?)),
            "--resume" => out.resume = Some(PathBuf::from(value()?)),
            "--trace" => out.trace = Some(PathBuf::from(value()?)),
            other => {
                if !extra(other, &mut value)? {
                    return Err(format!("unknown option `{other}` (see --help)"));
                }
            }
        }
    }
    if let (Some(n), Some(mesh)) = (out.ranks, out.mesh) {
        if n != mesh.world_size() {
            return Err(format!(
                "--ranks {n} and --mesh {mesh} disagree (the mesh has {} ranks)",
                mesh.world_size()
            ));
        }
    }
    Ok(Some(out))
}

/// How the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// One thread per rank in this process.
    Threads,
    /// One process per rank, launched by `mpirun`.
    #[cfg(feature = "mpi")]
    Mpi,
}

/// The world size `mpirun` (Open MPI) or a PMI launcher (MPICH, Slurm) gave this process.
fn mpi_launch_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The engine and mesh of this run: MPI when launched by `mpirun`, threads otherwise.
pub fn engine_and_mesh(args: &Args, example: &str) -> Result<(Engine, Mesh), String> {
    let flat = |n| Mesh::flat(n).map_err(|e| e.to_string());
    match mpi_launch_size() {
        Some(size) => {
            #[cfg(feature = "mpi")]
            {
                let mesh = match args.mesh {
                    Some(m) => m,
                    None => flat(size)?,
                };
                if mesh.world_size() != size || args.ranks.is_some_and(|n| n != size) {
                    return Err(format!(
                        "launched as {size} MPI processes but asked for {} ranks; drop \
                         --ranks/--mesh or match mpirun -n",
                        args.ranks.unwrap_or(mesh.world_size())
                    ));
                }
                Ok((Engine::Mpi, mesh))
            }
            #[cfg(not(feature = "mpi"))]
            {
                let _ = (&args, flat);
                Err(format!(
                    "launched by mpirun ({size} processes) but built without MPI: \
                     cargo build --release --features mpi --example {example}"
                ))
            }
        }
        None => {
            let _ = example;
            let mesh = match (args.mesh, args.ranks) {
                (Some(m), _) => m,
                (None, n) => flat(n.unwrap_or(2))?,
            };
            Ok((Engine::Threads, mesh))
        }
    }
}

/// A small deterministic random number generator (SplitMix64): the same stream on every rank
/// and in every run, which is how the ranks agree on a global batch without communicating.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for stream `stream` of seed `seed` (e.g. the step).
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    #[allow(dead_code)] // train_dit's noise; train_gpt has none
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(f64::MIN_POSITIVE);
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()
    }
}

/// The rows of a global batch of `global` rows that rank `rank` of `world` trains on.
pub fn my_rows(global: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let local = global / world;
    rank * local..(rank + 1) * local
}

/// A training job: the model, its batches and what to do once trained.
pub trait Task: Sync {
    /// The module trained.
    type Model: Module<B> + Sync;

    /// Name of the example (for messages and the default output directory).
    fn name(&self) -> &str;
    /// Rows (sequences, clips) in one global batch; split evenly over the ranks.
    fn global_batch(&self) -> usize;
    /// Items (tokens) one global batch trains on, for throughput.
    fn items_per_step(&self) -> usize;
    /// A freshly initialised model (call after seeding the backend).
    fn init(&self, device: &Device) -> Self::Model;
    /// The loss of this rank's rows of step `step`'s global batch.
    fn train_loss(
        &self,
        model: &Self::Model,
        step: usize,
        rank: usize,
        world: usize,
    ) -> Tensor<B, 1>;
    /// The loss of this rank's rows of the fixed held-out batch (computed on `model.valid()`,
    /// the [`Eval`] backend).
    fn eval_loss(&self, model: &Self::Model, rank: usize, world: usize) -> f32;
    /// A reference level for the loss (drawn in the plot, printed at the end).
    fn baseline(&self) -> Option<(f64, String)>;
    /// Runs on every rank after training, in lockstep (forward passes gather parameters, so
    /// every rank runs the same ones; use `model.valid()`, the [`Eval`] backend). `broadcast` copies rank 0's values to every rank. Returns
    /// what rank 0 prints (e.g. generated text); may write files into `out`.
    fn finish(
        &self,
        model: &Self::Model,
        rank: usize,
        out: &Path,
        broadcast: &mut dyn FnMut(&mut [f32]) -> Result<(), String>,
    ) -> Result<String, String>;
}

/// What a run measured (on rank 0).
#[derive(Clone, Debug)]
pub struct Report {
    /// Global loss of the first step of this run.
    pub first_loss: f32,
    /// Mean global training loss over the last (up to) 20 steps.
    pub final_loss: f32,
    /// Held-out loss: first and last evaluation.
    pub eval: Option<(f32, f32)>,
    /// Steps run and the step the run started at.
    pub steps: usize,
    /// First step (non-zero after `--resume`).
    pub first_step: usize,
    /// Seconds spent in training steps, and in the whole run.
    pub train_s: f64,
    /// Seconds of the whole run (including evaluation, checkpoint and `finish`).
    pub wall_s: f64,
    /// Items per second over the training steps.
    pub items_per_s: f64,
    /// Peak resident set of the process, bytes.
    pub peak_rss: u64,
    /// Where the metrics, the plot and the samples went.
    pub csv: PathBuf,
    /// The loss curve.
    pub svg: PathBuf,
    /// What [`Task::finish`] returned.
    pub finish: String,
}

/// The optimizer of a run.
enum Optim {
    Muon(ShardedMuon<Inner, AdamW>),
    AdamW(ShardedOptimizer<Inner, AdamW>),
}

impl Optim {
    fn new(kind: OptimKind, clip: Option<f64>, device: &Device) -> Self {
        let adamw = AdamWConfig::new().with_weight_decay(0.01).build();
        match kind {
            OptimKind::Muon => {
                // Moonshot's scale matches AdamW's update RMS, so one learning rate serves
                // both optimizers.
                let muon = MuonConfig::new()
                    .with_scale(UpdateScale::MatchAdamW)
                    .with_weight_decay(0.01)
                    .init();
                let mut o = ShardedMuon::new(muon, adamw, *device);
                if let Some(c) = clip {
                    o = o.with_grad_clipping(c);
                }
                Optim::Muon(o)
            }
            OptimKind::AdamW => {
                let mut o = ShardedOptimizer::new(adamw, *device);
                if let Some(c) = clip {
                    o = o.with_grad_clipping(c);
                }
                Optim::AdamW(o)
            }
        }
    }

    fn step<M: Module<B>>(
        &mut self,
        lr: f64,
        model: M,
        runtime: &HsdpRuntime<Inner>,
    ) -> Result<M, HsdpError> {
        match self {
            Optim::Muon(o) => o.step(lr, model, runtime),
            Optim::AdamW(o) => o.step(lr, model, runtime),
        }
    }

    fn last_grad_norm(&self) -> Option<f64> {
        match self {
            Optim::Muon(o) => o.last_grad_norm(),
            Optim::AdamW(o) => o.last_grad_norm(),
        }
    }

    fn save(&mut self, dir: &Path, runtime: &HsdpRuntime<Inner>, step: u64) -> Result<(), String> {
        let r = match self {
            Optim::Muon(o) => checkpoint::save(dir, runtime, o, step),
            Optim::AdamW(o) => checkpoint::save(dir, runtime, &PieceStates::new(o), step),
        };
        r.map(|_| ())
            .map_err(|e| format!("saving to {}: {e}", dir.display()))
    }

    fn load(&mut self, dir: &Path, runtime: &HsdpRuntime<Inner>) -> Result<u64, String> {
        let r = match self {
            Optim::Muon(o) => checkpoint::load(dir, runtime, o),
            Optim::AdamW(o) => checkpoint::load(dir, runtime, &mut PieceStates::new(o)),
        };
        r.map_err(|e| format!("resuming from {}: {e}", dir.display()))
    }
}

/// Learning rate at `step` of a run ending at `last`: linear warm-up over `warmup` steps from
/// the start of training, then cosine decay to 10 % at `last`.
pub fn learning_rate(peak: f64, warmup: usize, step: usize, last: usize) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = last.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// Resident set size of this process (all ranks of the threads engine), bytes.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// A count with a k/M suffix.
pub fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Name of a runtime format as `--format` spells it.
pub fn format_name(format: RuntimeFormat) -> &'static str {
    match format {
        RuntimeFormat::F32 => "f32",
        RuntimeFormat::Bf16 => "bf16",
        RuntimeFormat::Mxfp8 => "mxfp8",
    }
}

/// The metrics file: one row per step.
struct Metrics {
    file: BufWriter<File>,
}

impl Metrics {
    const HEADER: &'static str = "step,loss,eval_loss,lr,grad_norm,tokens_per_s,elapsed_s,\
                                  rss_mib,shard_mib,peak_gathered_mib,gathered_mib";

    fn create(path: &Path, append: bool) -> Result<Self, String> {
        let exists = path.exists();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| format!("creating {}: {e}", path.display()))?;
        let mut m = Metrics {
            file: BufWriter::new(file),
        };
        if !(append && exists) {
            m.line(Self::HEADER)?;
        }
        Ok(m)
    }

    fn line(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| format!("writing metrics: {e}"))
    }
}

/// `(step, loss)` points.
type Curve = Vec<(f64, f64)>;

/// Reads `step,loss,eval_loss` back from a metrics file (the whole history, across resumed
/// runs) for the plot.
fn read_curves(path: &Path) -> (Curve, Curve) {
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines().skip(1) {
        let mut cols = line.split(',');
        let (Some(step), Some(loss), Some(ev)) = (cols.next(), cols.next(), cols.next()) else {
            continue;
        };
        let Ok(step) = step.parse::<f64>() else {
            continue;
        };
        if let Ok(l) = loss.parse::<f64>() {
            train.push((step, l));
        }
        if let Ok(e) = ev.parse::<f64>() {
            eval.push((step, e));
        }
    }
    (train, eval)
}

/// Per-rank training: shard, (resume,) train, (save,) finish.
fn train_rank<T: Task, C: Collective + Send + 'static>(
    task: &T,
    args: &Args,
    mesh: Mesh,
    comm: C,
    init: &T::Model,
) -> Result<Option<Report>, String> {
    let start = Instant::now();
    let (rank, world) = (comm.rank(), comm.size());
    let lead = rank == 0;
    // A second communicator for the metrics (the first moves into the runtime).
    let stats = comm.split(0, rank).map_err(|e| e.to_string())?;
    let device = Device::default();
    let config = HsdpConfig::new(mesh)
        .with_format(args.format)
        .with_trace(args.trace.is_some());
    let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device)
        .map_err(|e| format!("{} runtime parameters: {e}", format_name(args.format)))?;
    let mut optim = Optim::new(args.optim, args.clip, &device);
    let first = match &args.resume {
        Some(dir) => optim.load(dir, &runtime)? as usize,
        None => 0,
    };
    let last = first + args.steps;
    let per_rank_bytes = runtime.shard_bytes() + runtime.master_bytes();
    if lead {
        let plan = runtime.plan().to_string();
        println!("{}", plan.lines().next().unwrap_or_default());
        println!(
            "per rank: {:.2} MiB runtime shard + {:.2} MiB fp32 master; {}",
            mib(runtime.shard_bytes()),
            mib(runtime.master_bytes()),
            match args.optim {
                OptimKind::Muon => "Muon (hidden matrices) + AdamW (the rest)",
                OptimKind::AdamW => "AdamW",
            }
        );
        if first > 0 {
            println!(
                "resumed at step {first} from {}",
                args.resume.as_ref().unwrap().display()
            );
        }
    }
    let csv = args.out.join("metrics.csv");
    let svg = args.out.join("loss.svg");
    let mut metrics = if lead {
        Some(Metrics::create(&csv, first > 0)?)
    } else {
        None
    };
    let progress = lead.then(|| {
        let bar = ProgressBar::new(args.steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}<{eta_precise}] {wide_bar} {pos}/{len}\n  {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_prefix(task.name().to_string());
        bar
    });
    // Plain log lines where the bar cannot draw (output to a file or pipe).
    let plain = lead && !std::io::stderr().is_terminal();
    let log_every = (args.steps / 20).max(1);
    let all_reduce = |values: &mut [f32]| {
        stats
            .all_reduce(values, ReduceOp::Avg)
            .map_err(|e| e.to_string())
    };
    let evaluate = |model: &T::Model| -> Result<f32, String> {
        let mut v = [task.eval_loss(model, rank, world)];
        all_reduce(&mut v)?;
        Ok(v[0])
    };
    let mut eval = None;
    if args.eval_every > 0 {
        let e = evaluate(&model)?;
        eval = Some((e, e));
        if lead && plain {
            println!("step {first:>5}  held-out loss {e:.4}");
        }
    }
    let mut losses = Vec::with_capacity(args.steps);
    let mut train_s = 0.0;
    let mut peak_rss = 0;
    let mut recent: Vec<f64> = Vec::new();
    for step in first..last {
        let t0 = Instant::now();
        let lr = learning_rate(args.lr, args.warmup, step, last);
        let loss = task.train_loss(&model, step, rank, world);
        let local = loss.clone().into_scalar();
        let _ = loss.backward();
        model = optim.step(lr, model, &runtime).map_err(|e| e.to_string())?;
        let dt = t0.elapsed().as_secs_f64();
        train_s += dt;
        let mut global = [local];
        all_reduce(&mut global)?;
        let global = global[0];
        if !global.is_finite() {
            return Err(format!("the loss diverged at step {step} ({global})"));
        }
        losses.push(global);
        let done = step + 1 == last;
        let ev = if (args.eval_every > 0 && (step + 1) % args.eval_every == 0) || done {
            let e = evaluate(&model)?;
            eval = Some((eval.map_or(e, |(f, _)| f), e));
            Some(e)
        } else {
            None
        };
        let counters = runtime.take_counters();
        if let (Some(metrics), Some(bar)) = (metrics.as_mut(), progress.as_ref()) {
            let rss = rss_bytes().unwrap_or(0);
            peak_rss = peak_rss.max(rss);
            recent.push(dt);
            if recent.len() > 10 {
                recent.remove(0);
            }
            let rate =
                task.items_per_step() as f64 * recent.len() as f64 / recent.iter().sum::<f64>();
            let grad_norm = optim.last_grad_norm();
            metrics.line(&format!(
                "{step},{global:.5},{},{lr:.6e},{},{:.1},{:.2},{:.1},{:.3},{:.3},{:.3}",
                ev.map_or(String::new(), |e| format!("{e:.5}")),
                grad_norm.map_or(String::new(), |g| format!("{g:.4}")),
                task.items_per_step() as f64 / dt,
                start.elapsed().as_secs_f64(),
                mib(rss),
                mib(per_rank_bytes),
                mib(counters.peak_resident_bytes),
                mib(counters.gathered_bytes),
            ))?;
            let mut msg = format!(
                "loss {global:.4}  lr {lr:.2e}  {} tok/s  rss {:.0} MiB  shard {:.2} MiB/rank  \
                 gathered peak {:.2} MiB",
                human(rate),
                mib(rss),
                mib(per_rank_bytes),
                mib(counters.peak_resident_bytes)
            );
            if let Some((_, e)) = eval {
                let _ = write!(msg, "  held-out {e:.4}");
            }
            bar.set_message(msg);
            bar.inc(1);
            if plain && ((step - first) % log_every == 0 || done || ev.is_some()) {
                let mut line = format!(
                    "step {step:>5}  loss {global:.4}  lr {lr:.2e}  {} tok/s  rss {:.0} MiB",
                    human(rate),
                    mib(rss)
                );
                if let Some(e) = ev {
                    let _ = write!(line, "  held-out {e:.4}");
                }
                println!("{line}");
            }
        }
    }
    if let Some(bar) = &progress {
        bar.finish();
    }
    drop(metrics);
    if args.trace.is_some() {
        trace_spans().extend(runtime.take_trace());
    }
    if let Some(dir) = &args.save {
        optim.save(dir, &runtime, last as u64)?;
        if lead {
            println!(
                "saved a {world}-rank checkpoint at step {last} to {}",
                dir.display()
            );
        }
    }
    if lead {
        let (train, eval_points) = read_curves(&csv);
        let baseline = task.baseline();
        let chart = plot::Chart {
            title: format!("{}: loss per step", task.name()),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![
                plot::Series::new("train loss (global batch)", "#9ab8d8", train.clone()),
                plot::Series::new(
                    "train loss (moving average, 20 steps)",
                    "#1f5fa8",
                    plot::moving_average(&train, 20),
                ),
                plot::Series::new("held-out loss", "#d2691e", eval_points).with_markers(),
            ],
            baseline: baseline.clone(),
        };
        std::fs::write(&svg, chart.to_svg())
            .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    }
    let mut broadcast = |values: &mut [f32]| stats.broadcast(values, 0).map_err(|e| e.to_string());
    let finish = task.finish(&model, rank, &args.out, &mut broadcast)?;
    let tail = &losses[losses.len().saturating_sub(20)..];
    Ok(lead.then(|| Report {
        first_loss: losses[0],
        final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
        eval,
        steps: args.steps,
        first_step: first,
        train_s,
        wall_s: start.elapsed().as_secs_f64(),
        items_per_s: (task.items_per_step() * args.steps) as f64 / train_s,
        peak_rss,
        csv,
        svg,
        finish,
    }))
}

/// The timeline spans the ranks of this process recorded (`--trace`).
fn trace_spans() -> std::sync::MutexGuard<'static, Vec<sshsdp::backend::Span>> {
    static SPANS: std::sync::Mutex<Vec<sshsdp::backend::Span>> = std::sync::Mutex::new(Vec::new());
    SPANS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes the spans this process's ranks recorded to `path` (`rank`: this process's rank under
/// MPI, whose ranks > 0 write `path.rank<r>`).
fn write_trace(path: &Path, rank: Option<usize>) -> Result<(), String> {
    let path = match rank {
        Some(r) if r > 0 => PathBuf::from(format!("{}.rank{r}", path.display())),
        _ => path.to_path_buf(),
    };
    let spans = std::mem::take(&mut *trace_spans());
    std::fs::write(&path, sshsdp::backend::chrome_trace(&spans))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    if rank.unwrap_or(0) == 0 {
        println!(
            "trace: {} spans written to {} (open it in https://ui.perfetto.dev)",
            spans.len(),
            path.display()
        );
    }
    Ok(())
}

/// Number of parameters of `model`.
pub fn parameter_count<M: Module<B>>(model: &M) -> usize {
    named_params(model)
        .map(|ps| ps.iter().map(|p| p.values.len()).sum())
        .unwrap_or(0)
}

/// Runs `task` with `args` on the engine the launch calls for; returns rank 0's report (`None`
/// on the other MPI processes).
pub fn run<T: Task>(task: &T, args: &Args) -> Result<Option<Report>, String> {
    let (engine, mesh) = engine_and_mesh(args, task.name())?;
    let world = mesh.world_size();
    if task.global_batch() % world != 0 {
        return Err(format!(
            "the global batch of {} does not split over {world} ranks",
            task.global_batch()
        ));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    let device = Device::default();
    let init = || {
        B::seed(&device, args.seed);
        task.init(&device)
    };
    match engine {
        Engine::Threads => {
            let init = init();
            println!(
                "{}: {:.2}M parameters, {world} in-process ranks (mesh {mesh}), {} runtime \
                 parameters, {} steps",
                task.name(),
                parameter_count(&init) as f64 / 1e6,
                format_name(args.format),
                args.steps
            );
            let results = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
                train_rank(task, args, mesh, comm, &init)
            })
            .map_err(|e| e.to_string())?;
            let mut report = None;
            for (rank, r) in results.into_iter().enumerate() {
                match r {
                    Ok(Ok(Some(r))) => report = Some(r),
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => {
                        return Err(if rank == 0 {
                            e
                        } else {
                            format!("rank {rank}: {e}")
                        })
                    }
                    Err(_) => return Err(format!("rank {rank} panicked")),
                }
            }
            if let Some(path) = &args.trace {
                write_trace(path, None)?;
            }
            Ok(report)
        }
        #[cfg(feature = "mpi")]
        Engine::Mpi => {
            let comm = sshsdp::comm::mpi::MpiComm::init().map_err(|e| e.to_string())?;
            let init = init();
            if comm.rank() == 0 {
                println!(
                    "{}: {:.2}M parameters, {world} MPI processes (mesh {mesh}), {} runtime \
                     parameters, {} steps",
                    task.name(),
                    parameter_count(&init) as f64 / 1e6,
                    format_name(args.format),
                    args.steps
                );
            }
            let rank = comm.rank();
            let report = train_rank(task, args, mesh, comm, &init)?;
            if let Some(path) = &args.trace {
                write_trace(path, Some(rank))?;
            }
            Ok(report)
        }
    }
}

/// Prints the common part of a report.
pub fn print_report(report: &Report, baseline: Option<&(f64, String)>) {
    println!(
        "steps {}..{}: train loss {:.4} -> {:.4} (mean of the last 20 steps)",
        report.first_step,
        report.first_step + report.steps,
        report.first_loss,
        report.final_loss
    );
    if let Some((first, last)) = report.eval {
        println!("held-out loss {first:.4} -> {last:.4}");
    }
    if let Some((level, name)) = baseline {
        println!("{name}: {level:.4}");
    }
    println!(
        "{:.1} s in training steps ({} tokens/s), {:.1} s in all; peak RSS {:.0} MiB",
        report.train_s,
        human(report.items_per_s),
        report.wall_s,
        mib(report.peak_rss)
    );
    println!(
        "metrics: {}\nloss curve: {}",
        report.csv.display(),
        report.svg.display()
    );
}

/// An example's whole `main`: `setup` parses the command line (`Ok(None)` after `--help`,
/// which prints `usage`), `banner` describes the data, [`run`] trains, and `finish` prints what
/// is particular to the example after the common report. Errors print one line and exit 1.
pub fn main<T: Task>(
    usage: &str,
    setup: impl FnOnce() -> Result<Option<(T, Args)>, String>,
    banner: impl FnOnce(&T),
    finish: impl FnOnce(&T, &Report),
) -> ExitCode {
    let (task, args) = match setup() {
        Ok(Some(x)) => x,
        Ok(None) => {
            println!("{usage}\n{COMMON_USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    banner(&task);
    match run(&task, &args) {
        Ok(Some(report)) => {
            finish(&task, &report);
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
