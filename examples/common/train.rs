//! One rank's training: shard, (resume,) train, (save,) finish.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::Instant;

use burn::tensor::ElementConversion;
use indicatif::{ProgressBar, ProgressStyle};
use sshsdp::backend::{HsdpConfig, HsdpRuntime, Shard, RUNTIME_LANES};
use sshsdp::checkpoint::{export_safetensors, SafetensorsSource};
use sshsdp::comm::{Collective, ReduceOp, SplitLanes};
use sshsdp::plan::Mesh;

use super::*;

/// A launch engine's world communicator, and how the runtime's lanes come from it.
pub(crate) trait LaunchComm: Collective + Sized {
    /// Shards `init` over lanes made from `self`: split from it (host engines), or NCCL lanes
    /// agreed over it under `--nccl` (and always for an NCCL launch communicator).
    fn shard<I: Compute, T: Task<I>>(
        self,
        args: &Args,
        init: T::Model,
        config: HsdpConfig,
        device: &I::Device,
        source: Option<&dyn sshsdp::backend::ParamSource>,
    ) -> Result<Sharded<T::Model, I>, String>;

    /// The GPU this communicator is bound to, where it is (an NCCL launch communicator): the
    /// rank computes there.
    fn gpu(&self) -> Option<usize> {
        None
    }
}

/// [`LaunchComm::shard`] for a host engine's communicator (threads, MPI).
fn shard_on_host_engine<I: Compute, T: Task<I>, C: Collective + Send + 'static>(
    comm: C,
    args: &Args,
    init: T::Model,
    config: HsdpConfig,
    device: &I::Device,
    source: Option<&dyn sshsdp::backend::ParamSource>,
) -> Result<Sharded<T::Model, I>, String> {
    if args.nccl {
        // Without the `nccl` feature the parser refuses `--nccl` before this is reached.
        #[cfg(not(feature = "nccl"))]
        return Err("--nccl needs the `nccl` feature".into());
        #[cfg(feature = "nccl")]
        Ok(sharding(config, source).run_on::<Train<I>, _, _>(
            init,
            nccl_lanes(&comm, device)?,
            device,
        ))
    } else {
        let lanes = SplitLanes::new(comm, RUNTIME_LANES).map_err(|e| e.to_string())?;
        Ok(sharding(config, source).run_on::<Train<I>, _, _>(init, lanes, device))
    }
}

/// `config`'s sharding, with initial values from `source` where given.
fn sharding(config: HsdpConfig, source: Option<&dyn sshsdp::backend::ParamSource>) -> Shard<'_> {
    match source {
        Some(source) => Shard::new(config).from_source(source),
        None => Shard::new(config),
    }
}

macro_rules! host_launch_comm {
    ($comm:ty) => {
        impl LaunchComm for $comm {
            fn shard<I: Compute, T: Task<I>>(
                self,
                args: &Args,
                init: T::Model,
                config: HsdpConfig,
                device: &I::Device,
                source: Option<&dyn sshsdp::backend::ParamSource>,
            ) -> Result<Sharded<T::Model, I>, String> {
                shard_on_host_engine::<I, T, $comm>(self, args, init, config, device, source)
            }
        }
    };
}

host_launch_comm!(sshsdp::comm::threads::ThreadComm);
#[cfg(feature = "mpi")]
host_launch_comm!(sshsdp::comm::mpi::MpiComm);

/// A process started by `torchrun`/`srun` without MPI: its world communicator is NCCL's
/// (`NcclComm::from_launch`), the lanes' ids go over it, and the lanes share its liveness (one
/// abort fails all, and the runtime's first step ends the start-up bound for all).
#[cfg(feature = "nccl")]
impl LaunchComm for sshsdp::comm::nccl::NcclComm {
    fn shard<I: Compute, T: Task<I>>(
        self,
        _args: &Args,
        init: T::Model,
        config: HsdpConfig,
        device: &I::Device,
        source: Option<&dyn sshsdp::backend::ParamSource>,
    ) -> Result<Sharded<T::Model, I>, String> {
        let lanes = nccl_lanes(&self, device)?.with_liveness(self.liveness());
        Ok(sharding(config, source).run_on::<Train<I>, _, _>(init, lanes, device))
    }

    fn gpu(&self) -> Option<usize> {
        Some(self.device())
    }
}

/// Per-rank training: shard, (resume,) train, (save,) finish.
pub(crate) fn train_rank<I: Compute, T: Task<I>, C: LaunchComm>(
    task: &T,
    args: &Args,
    mesh: Mesh,
    comm: C,
    init: &T::Model,
) -> Result<Option<Report>, String> {
    let start = Instant::now();
    let (rank, world) = (comm.rank(), comm.size());
    let lead = rank == 0;
    // A second communicator for the metrics (the first goes to the runtime's lanes; on NCCL the
    // split shares its parent's resources).
    let stats = comm.split(0, rank).map_err(|e| e.to_string())?;
    let device = launch_device::<I, C>(args, &comm)?;
    let config = HsdpConfig::new(mesh)
        .with_format(args.format)
        .with_master_placement(args.storage)
        .with_grad_placement(args.storage)
        .with_mixed_precision(args.precision)
        .with_device_collectives(!args.staged)
        .with_trace(args.trace.is_some());
    let source = match &args.init_from {
        Some(file) => Some(SafetensorsSource::open(file).map_err(|e| e.to_string())?),
        None => None,
    };
    let source = source
        .as_ref()
        .map(|s| s as &dyn sshsdp::backend::ParamSource);
    let sharded = comm.shard::<I, T>(args, init.clone(), config, &device, source)?;
    let (mut model, runtime) =
        sharded.map_err(|e| format!("{} runtime parameters: {e}", format_name(args.format)))?;
    let mut optim = Optim::<I>::new(args.optim, args.muon_exchange, args.clip, &device);
    let first = match &args.resume {
        Some(dir) => optim.load(dir, &runtime)? as usize,
        None => 0,
    };
    let last = first + args.steps;
    // fp32 masters apart from the runtime shard, on the host or the device (`--storage`).
    let master_bytes = runtime.master_bytes() + runtime.device_master_bytes();
    let per_rank_bytes = runtime.shard_bytes() + master_bytes;
    if lead {
        let plan = runtime.plan().to_string();
        println!("{}", plan.lines().next().unwrap_or_default());
        println!(
            "per rank: {:.2} MiB runtime shard + {:.2} MiB fp32 master; {}",
            mib(runtime.shard_bytes()),
            mib(master_bytes),
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
        if let Some(file) = &args.init_from {
            println!("initial weights from {}", file.display());
        }
    }
    let csv = args.out.join("metrics.csv");
    let svg = args.out.join("loss.svg");
    let png = args.out.join("loss.png");
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
    let mut peak_gathered = 0;
    // CubeCL backends: the device's memory after each step (most seen) and the last step's
    // host↔device bytes.
    let mut device = None;
    let mut rate = RecentRate::new(task.items_per_step());
    let mut warm = WarmRate::new(task.items_per_step(), args.steps);
    // The last steps' (seconds, exposed and busy communication ns, collective calls): the `comm`
    // line.
    let mut comm = std::collections::VecDeque::new();
    for step in first..last {
        let t0 = Instant::now();
        let lr = learning_rate(args.lr, args.warmup, step, last);
        let loss = task.train_loss(&model, step, rank, world);
        let value = loss.clone();
        let _ = loss.backward();
        model = optim.step(lr, model, &runtime).map_err(|e| e.to_string())?;
        // Read after the step (as PyTorch's `loss.item()` after `optimizer.step()`): reading it
        // before backward would stall the host on the device mid-step.
        let local = value.into_scalar().elem::<f32>();
        // Inside the timed step: reading the counters lets the next step's prefetched gathers
        // land (their bytes count in this step), a wait the next step would otherwise pay.
        let counters = runtime.take_counters();
        // The optimizer's own reads and uploads: charged where they happen, beside the runtime's.
        let optimizer = optim.take_host_traffic();
        let dt = t0.elapsed().as_secs_f64();
        train_s += dt;
        warm.push(dt);
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
        comm.push_back((
            dt,
            counters.comm_wait_ns,
            counters.comm_busy_ns,
            counters.collectives,
        ));
        if comm.len() > 10 {
            comm.pop_front();
        }
        peak_gathered = peak_gathered.max(counters.peak_resident_bytes);
        if let Some(m) = runtime.device_memory() {
            let seen: DeviceReport = device.unwrap_or_default();
            device = Some(DeviceReport {
                in_use: m.in_use.max(seen.in_use),
                reserved: m.reserved.max(seen.reserved),
                up: counters.uploaded_bytes + optimizer.upload_bytes,
                down: counters.downloaded_bytes + optimizer.read_bytes,
                reads: counters.host_reads + optimizer.reads,
                syncs: counters.host_syncs,
            });
        }
        if let (Some(metrics), Some(bar)) = (metrics.as_mut(), progress.as_ref()) {
            let rss = rss_bytes().unwrap_or(0);
            peak_rss = peak_rss.max(rss);
            rate.push(dt);
            let rate = rate.items_per_s();
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
                    // Whole tokens/s (the device check compares rates to within 3 %).
                    "step {step:>5}  loss {global:.4}  lr {lr:.2e}  {rate:.0} tok/s  rss {:.0} MiB",
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
    if lead && !comm.is_empty() {
        let n = comm.len() as f64;
        let step_s = comm.iter().map(|c| c.0).sum::<f64>() / n;
        let wait_s = comm.iter().map(|c| c.1 as f64).sum::<f64>() * 1e-9 / n;
        let busy_s = comm.iter().map(|c| c.2 as f64).sum::<f64>() * 1e-9 / n;
        let calls = comm.iter().map(|c| c.3 as f64).sum::<f64>() / n;
        println!(
            "comm        exposed {:.2} ms per step = {:.2} % of the step ({:.2} ms); engine busy \
             {:.2} ms per step; {calls:.1} collective calls per step (rank 0, last {} steps)",
            wait_s * 1e3,
            100.0 * wait_s / step_s,
            step_s * 1e3,
            busy_s * 1e3,
            comm.len()
        );
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
    if let Some(file) = &args.export {
        export_safetensors(&runtime, file).map_err(|e| e.to_string())?;
        if lead {
            println!("exported the weights at step {last} to {}", file.display());
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
                plot::Series::new("train loss (global batch)", 0x9ab8d8, train.clone()),
                plot::Series::new(
                    "train loss (moving average, 20 steps)",
                    0x1f5fa8,
                    plot::moving_average(&train, 20),
                ),
                plot::Series::new("held-out loss", 0xd2691e, eval_points).with_markers(),
            ],
            baseline,
        };
        chart.write(&svg, &png)?;
    }
    let mut broadcast = |values: &mut [f32]| stats.broadcast(values, 0).map_err(|e| e.to_string());
    let finish = task.finish(&model, rank, &args.out, &mut broadcast)?;
    let tail = &losses[losses.len().saturating_sub(20)..];
    Ok(lead.then(|| Report {
        first_loss: losses[0],
        final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
        last_loss: losses[losses.len() - 1],
        eval,
        steps: args.steps,
        first_step: first,
        train_s,
        wall_s: start.elapsed().as_secs_f64(),
        items_per_s: warm.items_per_s(),
        warmup_steps: warm.warmup(),
        peak_rss,
        parameters: parameter_count(init),
        world,
        mesh,
        engine: if mpi_launch_size().is_some() {
            "MPI processes"
        } else {
            "in-process ranks"
        },
        args: args.clone(),
        shard_bytes: runtime.shard_bytes(),
        master_bytes,
        peak_gathered,
        device,
        launches: device.and(launch_count(world)),
        collectives_on_device: runtime.collectives_on_device(),
        shards_on_device: runtime.shards_on_device(),
        csv,
        svg,
        png,
        finish,
    }))
}

/// The device rank `rank` computes on: with `--nccl` (or an NCCL launch) on `--backend cuda`,
/// the GPU its launcher's local rank picks (`sshsdp::comm::launch::local_device`: the local
/// rank modulo the visible GPUs; in-process ranks use their rank), the one its NCCL
/// communicators use, so gathers land in that GPU's memory directly; otherwise the backend's
/// default device.
pub(crate) fn rank_device<I: Compute>(args: &Args, rank: usize) -> Result<I::Device, String> {
    let default = I::Device::default();
    if !args.nccl || args.backend != BackendKind::Cuda {
        return Ok(default);
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = rank;
        Ok(default)
    }
    #[cfg(feature = "nccl")]
    {
        use sshsdp::comm::launch::{local_device, node_local_rank};
        let visible = sshsdp::comm::nccl::device_count().map_err(|e| format!("--nccl: {e}"))?;
        let local = node_local_rank().unwrap_or(rank);
        let index = local_device(local, visible).map_err(|e| format!("--nccl: {e}"))?;
        Ok(device_of_index::<I>(index))
    }
}

/// The device a rank with launch communicator `comm` computes on: the GPU an NCCL launch
/// communicator is bound to (its local rank's pick), else [`rank_device`].
pub(crate) fn launch_device<I: Compute, C: LaunchComm>(
    args: &Args,
    comm: &C,
) -> Result<I::Device, String> {
    match comm.gpu() {
        Some(gpu) if args.backend == BackendKind::Cuda => Ok(device_of_index::<I>(gpu)),
        _ => rank_device::<I>(args, comm.rank()),
    }
}

/// The device of `I` with ordinal `index` (a CUDA GPU).
pub(crate) fn device_of_index<I: Compute>(index: usize) -> I::Device {
    use burn::tensor::backend::{Device as _, DeviceId};
    let id = I::Device::default().to_id();
    I::Device::from_id(DeviceId::new(
        id.type_id,
        u16::try_from(index).unwrap_or(u16::MAX),
    ))
}

/// What `shard` returns: the sharded model and its runtime, or why not.
pub(crate) type Sharded<M, I> = Result<(M, HsdpRuntime<I>), sshsdp::backend::HsdpError>;

/// NCCL lanes agreed over `boot` (the launch engine: threads, MPI, or NCCL itself) on the GPU
/// of `device` ([`launch_device`]'s pick). In one process (threads) every rank needs a GPU of its
/// own: NCCL refuses two ranks of one communicator on one GPU.
#[cfg(feature = "nccl")]
fn nccl_lanes<C: Collective, D: burn::tensor::backend::Device>(
    boot: &C,
    device: &D,
) -> Result<sshsdp::comm::nccl::NcclLanes, String> {
    use sshsdp::comm::nccl::{device_count, NcclLanes};
    let gpus = device_count().map_err(|e| format!("--nccl: {e}"))?;
    let launched = sshsdp::comm::launch::node_local_rank().is_some();
    if !launched && boot.size() > gpus {
        return Err(format!(
            "--nccl needs one GPU per rank: {} in-process ranks, {gpus} GPU(s) visible",
            boot.size()
        ));
    }
    let gpu = usize::from(device.to_id().index_id);
    NcclLanes::from_collective(boot, gpu, RUNTIME_LANES).map_err(|e| format!("--nccl: {e}"))
}
