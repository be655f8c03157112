//! `--unsharded`: the same model, data, learning-rate schedule and AdamW on plain Burn, one rank,
//! nothing sharded — the baseline the decorator's step time is measured against (the device
//! issue's "GPT step against the same model unsharded", target ≤ 1.03).
//!
//! The model is built on the same backend type, `Autodiff<Hsdp<I>>`, but never given to
//! `shard`: the decorator then passes every tensor op straight to `I` (no plan, no buckets, no
//! views), and Burn's own `AdamW` steps the parameters where they are. Compute is f32 (the
//! parameters' own dtype). Burn's gradient clipping clips each tensor, not the global norm, so
//! the baseline does not clip: its step does slightly less work than a clipped sharded one.

use std::time::Instant;

use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use sshsdp::backend::init_seeded;

use super::*;

/// The arguments `--unsharded` cannot honour, as an error naming the first one given.
pub(crate) fn check_unsharded_args(args: &Args) -> Result<(), String> {
    let world = args
        .mesh
        .map(|m| m.world_size())
        .or(args.ranks)
        .unwrap_or(1);
    let refuse = |what: &str| Err(format!("--unsharded trains one unsharded rank: {what}"));
    if world != 1 {
        return refuse(&format!("drop --ranks/--mesh ({world} ranks asked for)"));
    }
    if args.optim != OptimKind::AdamW {
        return refuse("it steps Burn's AdamW, add --optim adamw (Muon is the sharded runtime's)");
    }
    if args.precision != sshsdp::backend::MixedPrecision::default() {
        return refuse("it computes in f32 (drop --compute/--reduce)");
    }
    if args.nccl {
        return refuse("there are no collectives (drop --nccl)");
    }
    if args.save.is_some() || args.resume.is_some() || args.init_from.is_some() {
        return refuse("checkpoints are the sharded runtime's (drop --save/--resume/--init-from)");
    }
    if args.export.is_some() || args.trace.is_some() {
        return refuse("drop --export/--trace (the sharded runtime's)");
    }
    Ok(())
}

/// Trains `task` unsharded on backend `I` for `args.steps` steps and prints the losses and the
/// throughput in the sharded runs' words (`step N ... tok/s` lines, `train loss`, `throughput`),
/// so scripts read both alike. Returns each step's loss.
pub(crate) fn train_unsharded<I: Compute, T: Task<I>>(
    task: &T,
    args: &Args,
) -> Result<Vec<f32>, String> {
    check_unsharded_args(args)?;
    if mpi_launch_size().is_some() {
        return Err("--unsharded runs one process: start it without mpirun".into());
    }
    let device = I::Device::default();
    // Burn initialises a lazy parameter at its first use (forward order); `shard` draws them in
    // module order. Drawing them here in module order, under the process's RNG lock, gives both
    // runs the same initial weights whatever else the process draws meanwhile.
    let mut model = init_seeded::<Train<I>, _>(&device, args.seed, |d| task.init(d));
    println!(
        "{}: {:.2}M parameters, unsharded on plain Burn (one rank, no shard, Burn's AdamW, \
         f32, no clipping), {} steps",
        task.name(),
        parameter_count(&model) as f64 / 1e6,
        args.steps
    );
    let mut optim = adamw_config().init();
    let log_every = (args.steps / 20).max(1);
    let mut rate = RecentRate::new(task.items_per_step());
    let mut warm = WarmRate::new(task.items_per_step(), args.steps);
    let (mut losses, mut train_s) = (Vec::with_capacity(args.steps), 0.0);
    for step in 0..args.steps {
        let t0 = Instant::now();
        let lr = learning_rate(args.lr, args.warmup, step, args.steps);
        let loss = task.train_loss(&model, step, 0, 1);
        let read = loss.clone();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        // Read after the step, as the sharded loop does (`train.rs`).
        let value = read.into_scalar().elem::<f32>();
        let dt = t0.elapsed().as_secs_f64();
        train_s += dt;
        warm.push(dt);
        if !value.is_finite() {
            return Err(format!("the loss diverged at step {step} ({value})"));
        }
        losses.push(value);
        rate.push(dt);
        if step % log_every == 0 || step + 1 == args.steps {
            println!(
                "step {step:>5}  loss {value:.4}  lr {lr:.2e}  {:.0} tok/s  rss {:.0} MiB",
                rate.items_per_s(),
                mib(rss_bytes().unwrap_or(0))
            );
        }
    }
    let tail = &losses[losses.len().saturating_sub(20)..];
    println!(
        "train loss  {:.4} -> {:.4} (first and last step); mean of the last {} steps {:.4}",
        losses[0],
        losses[losses.len() - 1],
        tail.len(),
        tail.iter().sum::<f32>() / tail.len() as f32
    );
    println!(
        "throughput  {} tokens/s ({:.1} s in training steps; the first {} left out: warm-up)",
        human(warm.items_per_s()),
        train_s,
        warm.warmup()
    );
    Ok(losses)
}
