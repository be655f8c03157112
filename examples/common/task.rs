//! What an example describes ([`Task`]) and what a run reports.

use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use sshsdp::backend::Placement;
use sshsdp::plan::Mesh;

use super::*;

/// What a training job is, whatever backend it runs on.
pub trait Job: Sync {
    /// Name of the example (for messages and the default output directory).
    fn name(&self) -> &str;
    /// Rows (sequences, clips) in one global batch; split evenly over the ranks.
    fn global_batch(&self) -> usize;
    /// Items (tokens) one global batch trains on, for throughput.
    fn items_per_step(&self) -> usize;
    /// A reference level for the loss (drawn in the plot, printed at the end).
    fn baseline(&self) -> Option<(f64, String)>;
}

/// A training job on backend `I`: the model, its batches and what to do once trained.
pub trait Task<I: Compute>: Job {
    /// The module trained.
    type Model: AutodiffModule<Train<I>> + Sync;

    /// A freshly initialised model (call after seeding the backend).
    fn init(&self, device: &I::Device) -> Self::Model;
    /// The loss of this rank's rows of step `step`'s global batch.
    fn train_loss(
        &self,
        model: &Self::Model,
        step: usize,
        rank: usize,
        world: usize,
    ) -> Tensor<Train<I>, 1>;
    /// The loss of this rank's rows of the fixed held-out batch (computed on `model.valid()`,
    /// the [`Eval`] backend).
    fn eval_loss(&self, model: &Self::Model, rank: usize, world: usize) -> f32;
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

/// A job on Wgpu, fused and not, where this build has it (feature `wgpu`; any type otherwise).
#[cfg(feature = "wgpu")]
pub trait OnWgpu: Task<Wgpu> + Task<WgpuUnfused> {}
#[cfg(feature = "wgpu")]
impl<T: Task<Wgpu> + Task<WgpuUnfused>> OnWgpu for T {}
/// A job on Wgpu where this build has it (feature `wgpu`; any type otherwise).
#[cfg(not(feature = "wgpu"))]
pub trait OnWgpu {}
#[cfg(not(feature = "wgpu"))]
impl<T> OnWgpu for T {}

/// A job on CUDA, fused and not, where this build has it (feature `cuda`; any type otherwise).
#[cfg(feature = "cuda")]
pub trait OnCuda: Task<Cuda> + Task<CudaUnfused> {}
#[cfg(feature = "cuda")]
impl<T: Task<Cuda> + Task<CudaUnfused>> OnCuda for T {}
/// A job on CUDA where this build has it (feature `cuda`; any type otherwise).
#[cfg(not(feature = "cuda"))]
pub trait OnCuda {}
#[cfg(not(feature = "cuda"))]
impl<T> OnCuda for T {}

/// A job on every backend this build supports (`--backend`): burn-flex always, Wgpu and CUDA
/// with their features.
pub trait Tasks: Task<Flex> + OnWgpu + OnCuda {}
impl<T: Task<Flex> + OnWgpu + OnCuda> Tasks for T {}

/// A device run's memory and traffic: the device's bytes in use and reserved (the most seen
/// after a step, all ranks on the device), and rank 0's host↔device bytes, its runtime's host
/// reads of the device and host waits for it, in the last step.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceReport {
    /// Bytes in use, most seen after a step.
    pub in_use: u64,
    /// Bytes reserved by the pools, most seen after a step.
    pub reserved: u64,
    /// Host → device bytes of the last step (rank 0's runtime and optimizer).
    pub up: u64,
    /// Device → host bytes of the last step (rank 0's runtime and optimizer).
    pub down: u64,
    /// Host reads of device memory in the last step (rank 0's runtime and optimizer).
    pub reads: u64,
    /// Host waits for the device around device collectives in the last step (rank 0).
    pub syncs: u64,
}

/// What a run measured (on rank 0), and how it was set up.
#[derive(Clone, Debug)]
pub struct Report {
    /// Global loss of the first step of this run.
    pub first_loss: f32,
    /// Mean global training loss over the last (up to) 20 steps.
    pub final_loss: f32,
    /// Global loss of the last step.
    pub last_loss: f32,
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
    /// Items per second over the training steps after the warm-up.
    pub items_per_s: f64,
    /// Steps at the start left out of `items_per_s` (autotune, kernel compilation).
    pub warmup_steps: usize,
    /// Peak resident set of the process, bytes.
    pub peak_rss: u64,
    /// Parameters of the model.
    pub parameters: usize,
    /// Ranks.
    pub world: usize,
    /// The mesh (replicas × shards).
    pub mesh: Mesh,
    /// What the ranks are ("in-process ranks" or "MPI processes").
    pub engine: &'static str,
    /// The options of the run.
    pub args: Args,
    /// Runtime shard bytes per rank.
    pub shard_bytes: u64,
    /// fp32 master bytes per rank kept apart from the runtime shard (host or device).
    pub master_bytes: u64,
    /// Largest gathered (resident) bucket bytes of rank 0 in any step.
    pub peak_gathered: u64,
    /// On CubeCL backends: the device's memory and rank 0's traffic ([`DeviceReport`]).
    pub device: Option<DeviceReport>,
    /// Kernel launches per step, from CubeCL's profiling log when the run was made for it
    /// ([`super::launch_count`]).
    pub launches: Option<super::LaunchCount>,
    /// Whether rank 0's engine gathered and reduced device memory itself (NCCL on the
    /// backend's GPU).
    pub collectives_on_device: bool,
    /// Whether rank 0's runtime shards were in device memory.
    pub shards_on_device: bool,
    /// Where the metrics, the plot and the samples went.
    pub csv: PathBuf,
    /// The loss curve as SVG.
    pub svg: PathBuf,
    /// The loss curve as PNG.
    pub png: PathBuf,
    /// What [`Task::finish`] returned.
    pub finish: String,
}

/// `git describe` of the source tree the example was built from, when git can tell.
fn git_describe() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR")])
        .args(["describe", "--always", "--dirty", "--abbrev=10"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

/// Prints the end-of-run summary: one screen a user can paste into an issue. `name` is the
/// example, `model` describes its model and data (one line), `baseline` its reference level.
pub fn print_summary(name: &str, model: &str, report: &Report, baseline: Option<&(f64, String)>) {
    let args = &report.args;
    let rule = "-".repeat(72);
    println!("{rule}\n{name} summary (paste this into an issue)");
    println!(
        "version     sshsdp {}{}, {} build, {} {}, {} CPUs",
        env!("CARGO_PKG_VERSION"),
        git_describe().map_or(String::new(), |g| format!(" (git {g})")),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        std::env::consts::OS,
        std::env::consts::ARCH,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "model       {:.2}M parameters; {model}",
        report.parameters as f64 / 1e6
    );
    println!(
        "sharding    {} {}, mesh {} (replicas x shards); {} runtime parameters, compute in {}, \
         gradients reduced in {}",
        report.world,
        report.engine,
        report.mesh,
        format_name(args.format),
        precision_name(args.precision.compute),
        precision_name(args.precision.reduce)
    );
    println!(
        "backend     {}; fp32 masters, optimizer state and gradients on the {}",
        args.backend.describe(!args.no_fusion),
        match args.storage {
            Placement::Host => "host",
            Placement::Device => "device",
        }
    );
    println!(
        "optimizer   {}; lr {:.1e} (warm-up {}, cosine); clip {}; seed {}",
        match args.optim {
            OptimKind::Muon => "Muon (hidden matrices) + AdamW (the rest)",
            OptimKind::AdamW => "AdamW",
        },
        args.lr,
        args.warmup,
        args.clip.map_or("off".to_string(), |c| c.to_string()),
        args.seed
    );
    println!(
        "steps       {}..{} ({} steps): {:.1} s in training steps, {:.1} s in all",
        report.first_step,
        report.first_step + report.steps,
        report.steps,
        report.train_s,
        report.wall_s
    );
    println!(
        "train loss  {:.4} -> {:.4} (global batch, first and last step); mean of the last {} \
         steps {:.4}",
        report.first_loss,
        report.last_loss,
        report.steps.min(20),
        report.final_loss
    );
    if let Some((first, last)) = report.eval {
        println!("held-out    {first:.4} -> {last:.4}");
    }
    if let Some((level, what)) = baseline {
        let gap = *level - report.final_loss as f64;
        let side = if gap >= 0.0 { "below" } else { "above" };
        println!(
            "reference   {what} {level:.4}: the mean train loss is {:.4} {side} it",
            gap.abs()
        );
    }
    println!(
        "throughput  {} tokens/s (the first {} steps left out: warm-up)",
        human(report.items_per_s),
        report.warmup_steps
    );
    println!(
        "memory      peak RSS {:.0} MiB ({}); per rank: runtime shard {:.2} MiB, fp32 \
         master {:.2} MiB, gathered peak {:.2} MiB",
        mib(report.peak_rss),
        if report.engine == "MPI processes" {
            "rank 0's process"
        } else {
            "all ranks"
        },
        mib(report.shard_bytes),
        mib(report.master_bytes),
        mib(report.peak_gathered)
    );
    if let Some(DeviceReport {
        in_use,
        reserved,
        up,
        down,
        reads,
        syncs,
    }) = report.device
    {
        println!(
            "device      {:.0} MiB in use / {:.0} MiB reserved (most seen after a step); \
             host<->device per step {:.2} MiB up, {:.2} MiB down (rank 0); collectives {}; \
             runtime shards on the {}",
            mib(in_use),
            mib(reserved),
            mib(up),
            mib(down),
            if report.collectives_on_device {
                "on device memory"
            } else {
                "staged through the host"
            },
            if report.shards_on_device {
                "device"
            } else {
                "host"
            }
        );
        println!(
            "host reads  {reads} per step (rank 0's runtime and optimizer reading device memory); \
             host syncs \
             {syncs} per step (waits for the device around device collectives)"
        );
        match report.launches {
            Some(c) => println!(
                "launches    {} per step, {} in the update (all ranks; CubeCL's profiling log)",
                c.per_step, c.update
            ),
            None => println!(
                "launches    not counted: run with CUBECL_DEBUG_OPTION=profile-full \
                 CUBECL_DEBUG_LOG=<file> SSHSDP_LAUNCH_MARKS=1 (profiling synchronises: not \
                 for timing; scripts/count_launches)"
            ),
        }
    }
    let dir = report.csv.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    println!("outputs     {}/: {}", dir.display(), files.join(" "));
    println!(
        "loss curve  {} {}",
        report.png.display(),
        report.svg.display()
    );
    if let Some(save) = &args.save {
        println!("checkpoint  {}", save.display());
    }
    if let Some(trace) = &args.trace {
        println!("trace       {}", trace.display());
    }
    println!("{rule}");
}
