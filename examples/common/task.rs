//! What an example describes ([`Task`]) and what a run reports.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::Tensor;

use super::*;

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
