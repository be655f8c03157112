//! `sshsdp-bench`: the training-step table the project is judged by. Run:
//! `cargo bench --bench sshsdp-bench` (about 4–6 minutes on 2 cores; `SSHSDP_BENCH_STEPS=n`
//! for `n` timed steps per row, default 6, after 2 warm-up steps).
//!
//! One GPT (`sshsdp::models::Gpt`, 4 layers × 256 wide, vocabulary 256, sequence 64, global
//! batch 16, AdamW) trained on the threads engine at world 1, 2 and 4 (flat mesh, each rank a
//! thread with `16 / world` sequences) as:
//!
//! * **plain Burn** — the model unsharded with Burn's own AdamW on `Autodiff<Hsdp<NdArray>>`
//!   whose parameters are ordinary tensors: every op forwards to NdArray, so this is NdArray's
//!   arithmetic in the same process and build (an `Autodiff<NdArray>` build cannot sit in this
//!   workspace: burn's `distributed` feature, which `Hsdp` needs, makes `Autodiff<B>` require
//!   `B: DistributedBackend`);
//! * **Ddp** — `Sharding::Ddp`: replicated parameters, all-reduced gradients;
//! * **Fsdp2Style** — `CopyMode::Fsdp2Style`: FSDP2's copy-in / copy-out data path on the same
//!   machinery (the baseline of the ratio column);
//! * **SS-HSDP f32 / bf16 / MXFP8** — zero-copy views, hierarchical sharding, runtime parameters
//!   in f32, bf16 or MXFP8 (a row the backend refuses prints `n/a: <reason>`);
//! * **… reshard** — both data paths releasing buckets after forward (FSDP2's default); their
//!   ratio is against `Fsdp2Style reshard`;
//! * **2×2 rows** (world 4 only, a mesh of 2 replicas × 2 shards): `Fsdp2Style HSDP` — FSDP2's
//!   HSDP (runtime shards over the shard group, masters and optimizer state replicated across
//!   replicas, gradients all-reduced across replicas) — against `SS-HSDP f32 2×2`, the
//!   hierarchical default (masters and optimizer state sharded over the whole world): the
//!   setting where SS-HSDP saves memory, which the flat-mesh rows cannot show.
//!
//! Columns: median step time (forward, backward, optimizer step; rank 0's clock), its ratio to
//! `Fsdp2Style` at the same world (plain Burn: at world 1), the process's peak heap per rank from
//! the counting allocator (`benches/common`), bytes all-gathered and bytes of gradients reduced
//! per step from the runtime counters (rank 0), parameter bytes copied outside collectives,
//! exposed communication (the time rank 0's model thread waited on collectives, as a share of
//! the step: `Counters::comm_wait_ns`), model-FLOPs utilisation against a matmul ceiling
//! measured in the same run, and whether the counters equal the bytes
//! `sshsdp::plan::projection` predicts from the plan.
//!
//! Model FLOPs per step = tokens · (6·N + 12·L·d·T) (PaLM's accounting: N parameters without the
//! token and position embedding tables, L layers, width d, context T; attention scores counted
//! without causal savings). The ceiling is a Burn NdArray f32 `[1024, 256] · [256, 1024]`
//! matmul (the MLP up-projection of the global batch), best of several runs with one matmul per
//! core at once; MFU = model FLOPs / step time / ceiling.
//!
//! The table goes to stdout as Markdown (with the command and the machine); progress to stderr.

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use sshsdp::backend::{init_seeded, named_params, shard, CopyMode, Hsdp, HsdpConfig, Placement};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::kernels::FusedOps;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::plan::projection::{StepTraffic, TrafficOptions};
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

mod common;
use common::{cpu_ticks, median, others_share, LIVE, PEAK};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;
/// `B` with Burn's activation checkpointing.
type Checkpointing = Autodiff<Hsdp<Inner>, BalancedCheckpointing>;

const VOCAB: usize = 256;
const D: usize = 256;
const LAYERS: usize = 4;
const SEQ: usize = 64;
const BATCH: usize = 16;
const WARMUP: usize = 2;
const DEFAULT_STEPS: usize = 6;
const BUCKET_ELEMENTS: u64 = 300_000;

const CONFIG: GptConfig = GptConfig {
    vocab: VOCAB,
    d_model: D,
    layers: LAYERS,
    heads: 4,
    seq: SEQ,
};

fn tokens<A: Backend>(rows: usize, offset: usize, device: &A::Device) -> Tensor<A, 2, Int> {
    let data: Vec<i64> = (0..rows * (SEQ + 1))
        .map(|i| ((i + offset * 7919) * 2_654_435_761 % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, SEQ + 1]), device)
}

/// One measured configuration.
struct Row {
    secs: f64,
    peak_per_rank: f64,
    gathered: u64,
    reduced: u64,
    copied: u64,
    /// Bytes handed to and read back from the backend's tensors (host↔device on a GPU).
    traffic: (u64, u64),
    /// Share of the step the model thread waited on collectives (timed steps summed).
    exposed: f64,
    /// `None` for plain Burn (no plan); otherwise whether the counters equal the projection,
    /// and the projected (gathered, reduced) bytes.
    projection: Option<(bool, u64, u64)>,
    /// The most device memory in use and reserved (CubeCL backends): sampled after each timed
    /// step's forward and after its update. Read by the device table (feature `wgpu`).
    #[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
    device_memory: Option<(u64, u64)>,
}

/// A table row: world, mode, measurement (or why there is none), baseline step seconds.
type TableRow = (usize, &'static str, Result<Row, String>, Option<f64>);

/// A configuration of the sharded runs.
struct Mode {
    name: &'static str,
    sharding: Sharding,
    copy: CopyMode,
    format: RuntimeFormat,
    reshard: bool,
    /// Replicas of the mesh (1: flat).
    replicas: usize,
    /// Where masters and gradients live (and the optimizer state, with the optimizer on the
    /// model's backend).
    storage: Placement,
    /// Where the runtime shards live (`None`: the default, the host for the threads engine).
    shards: Option<Placement>,
    /// AdamW on the CPU (NdArray) over host views (`step_offloaded`): its state off the device.
    offload: bool,
    /// Burn's `BalancedCheckpointing` (activation checkpointing: memory-bound ops recomputed
    /// in backward) instead of keeping every activation.
    checkpointing: bool,
    /// Name of the mode this one's ratio is against.
    baseline: &'static str,
}

/// The 2×2-mesh rows, at world 4 only.
const MESH_MODES: [Mode; 2] = [
    Mode {
        name: "Fsdp2Style HSDP 2×2",
        sharding: Sharding::Hsdp,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 2,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style HSDP 2×2",
    },
    Mode {
        name: "SS-HSDP f32 2×2",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 2,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style HSDP 2×2",
    },
];

const MODES: [Mode; 9] = [
    Mode {
        name: "Ddp",
        sharding: Sharding::Ddp,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "Fsdp2Style",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP f32",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP f32 device storage",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Device,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP bf16",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::Bf16,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP MXFP8",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::Mxfp8,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "Fsdp2Style reshard",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style reshard",
    },
    Mode {
        name: "SS-HSDP f32 reshard",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style reshard",
    },
    Mode {
        name: "SS-HSDP f32 reshard + activation checkpointing",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: true,
        baseline: "Fsdp2Style reshard",
    },
];

fn reset_peak() -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    base
}

fn plain(init: &Gpt<B>, steps: usize) -> Row {
    let device = Default::default();
    let base = reset_peak();
    let mut model = init.clone();
    let mut optim = AdamWConfig::new().init::<B, Gpt<B>>();
    let mut times = Vec::new();
    for step in 0..WARMUP + steps {
        let t = Instant::now();
        let loss = model.loss(tokens::<B>(BATCH, step, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
        if step >= WARMUP {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Row {
        secs: median(times),
        peak_per_rank: (PEAK.load(Ordering::Relaxed) - base) as f64,
        gathered: 0,
        reduced: 0,
        copied: 0,
        traffic: (0, 0),
        exposed: 0.0,
        projection: None,
        device_memory: None,
    }
}

/// `mode` at `world` over `Hsdp<I>` on `device` (every rank drives it), from `init`.
fn sharded<I: FusedOps, C: CheckpointStrategy>(
    init: &Gpt<Autodiff<Hsdp<I>, C>>,
    world: usize,
    mode: &Mode,
    steps: usize,
    device: &I::Device,
) -> Result<Row, String> {
    type A<I, C> = Autodiff<Hsdp<I>, C>;
    let base = reset_peak();
    let results = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let rank = comm.rank();
        let mesh = Mesh::new(mode.replicas, world / mode.replicas).map_err(|e| e.to_string())?;
        let config = HsdpConfig::new(mesh)
            .with_sharding(mode.sharding)
            .with_copy_mode(mode.copy)
            .with_format(mode.format)
            .with_reshard_after_forward(mode.reshard)
            .with_master_placement(mode.storage)
            .with_grad_placement(mode.storage)
            .with_bucket_elements(BUCKET_ELEMENTS);
        let config = match mode.shards {
            Some(shards) => config.with_shard_placement(shards),
            None => config,
        };
        let (mut model, runtime) = shard::<A<I, C>, _, _>(init.clone(), config, comm, device)
            .map_err(|e| e.to_string())?;
        let options = TrafficOptions {
            reshard_after_forward: mode.reshard,
            muon_exchange: None,
        };
        let projected = StepTraffic::of(runtime.plan(), options);
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
        let mut offloaded =
            ShardedOptimizer::<Inner, _>::new(AdamWConfig::new().build(), Default::default());
        let local = BATCH / world;
        let mut times = Vec::new();
        let mut counters = Default::default();
        let (mut waited, mut stepped) = (0.0, 0.0);
        let mut memory: Option<(u64, u64)> = None;
        let mut sample = |timed: bool| {
            if let (true, Some(m)) = (timed, runtime.device_memory()) {
                let (u, r) = memory.unwrap_or_default();
                memory = Some((u.max(m.in_use), r.max(m.reserved)));
            }
        };
        for step in 0..WARMUP + steps {
            runtime.take_counters();
            let t = Instant::now();
            let loss = model.loss(tokens::<A<I, C>>(local, step * world + rank, device));
            sample(step >= WARMUP);
            let _ = loss.backward();
            model = if mode.offload {
                offloaded.step_offloaded(1e-3, model, &runtime)
            } else {
                optim.step(1e-3, model, &runtime)
            }
            .map_err(|e| e.to_string())?;
            let secs = t.elapsed().as_secs_f64();
            sample(step >= WARMUP);
            counters = runtime.take_counters();
            if step >= WARMUP {
                times.push(secs);
                waited += counters.comm_wait_ns as f64 * 1e-9;
                stepped += secs;
            }
        }
        Ok::<_, String>((median(times), counters, projected, waited / stepped, memory))
    })
    .map_err(|e| e.to_string())?;
    // A rank that panicked or failed fails the row (every rank fails alike on a refused
    // config); rank 0 reports.
    let mut ranks = Vec::with_capacity(world);
    for r in results {
        ranks.push(r.map_err(|_| "a rank panicked".to_string())??);
    }
    let (secs, c, projected, exposed, device_memory) = ranks.swap_remove(0);
    let (pg, pr) = (projected.gathered_bytes(), projected.reduced_bytes());
    Ok(Row {
        secs,
        peak_per_rank: (PEAK.load(Ordering::Relaxed) - base) as f64 / world as f64,
        gathered: c.gathered_bytes,
        reduced: c.reduced_bytes,
        copied: c.param_bytes_copied,
        traffic: (c.uploaded_bytes, c.downloaded_bytes),
        exposed,
        projection: Some((pg == c.gathered_bytes && pr == c.reduced_bytes, pg, pr)),
        device_memory,
    })
}

/// GFLOP/s of an NdArray f32 matmul `[m, k] · [k, n]`: (one thread, one matmul per core at once).
fn matmul_ceiling(m: usize, k: usize, n: usize, cores: usize) -> (f64, f64) {
    let device = Default::default();
    let a = Tensor::<Inner, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<Inner, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device);
    let flops = 2.0 * (m * k * n) as f64;
    let best = |runs: usize| {
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                let c = a.clone().matmul(b.clone());
                std::hint::black_box(c.into_data());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let one = flops / best(10) / 1e9;
    let slowest = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores).map(|_| s.spawn(|| best(5))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("matmul thread"))
            .fold(0.0, f64::max)
    });
    (one, cores as f64 * flops / slowest / 1e9)
}

fn first_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    text.lines().next().map(|l| l.trim().to_string())
}

fn proc_field(file: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    let steps = std::env::var("SSHSDP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(DEFAULT_STEPS);
    if std::env::var_os("SSHSDP_BENCH_DEVICE_ONLY").is_none() {
        cpu_table(steps);
    }
    #[cfg(feature = "wgpu")]
    device_table(steps);
}

/// The `Hsdp<Wgpu>` table (feature `wgpu`): host against device storage of masters, AdamW state
/// and gradients, in f32 and MXFP8, at world 1 and 2 (ranks sharing the one device).
#[cfg(feature = "wgpu")]
fn device_table(steps: usize) {
    use burn_wgpu::{Wgpu, WgpuDevice};
    type W = Autodiff<Hsdp<Wgpu>>;
    let device = WgpuDevice::default();
    let init: Gpt<W> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let mut rows = Vec::new();
    for world in [1, 2] {
        for format in [RuntimeFormat::F32, RuntimeFormat::Mxfp8] {
            let mut host_secs = None;
            let storages = [
                ("Host", Placement::Host, false, None),
                ("Host, AdamW on the CPU", Placement::Host, true, None),
                ("Device", Placement::Device, false, None),
                (
                    "Device, shards too",
                    Placement::Device,
                    false,
                    Some(Placement::Device),
                ),
            ];
            for (storage, placement, offload, shards) in storages {
                let mode = Mode {
                    name: "device table",
                    sharding: Sharding::Hierarchical,
                    copy: CopyMode::ZeroCopy,
                    format,
                    reshard: false,
                    replicas: 1,
                    storage: placement,
                    shards,
                    offload,
                    checkpointing: false,
                    baseline: "host storage",
                };
                eprintln!("Hsdp<Wgpu> world {world}: {format:?}, {storage} storage");
                let row = sharded(&init, world, &mode, steps, &device);
                if storage == "Host" {
                    host_secs = row.as_ref().ok().map(|r| r.secs);
                }
                rows.push((world, format, storage, row, host_secs));
            }
        }
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("\n## Hsdp<Wgpu>: host and device storage\n");
    println!(
        "Command: `cargo bench --bench sshsdp-bench --features wgpu` (`SSHSDP_BENCH_DEVICE_ONLY=1` \
         for this table alone). The same GPT and batch on `Autodiff<Hsdp<Wgpu>>` (CubeCL's wgpu \
         runtime on the default adapter: Mesa's lavapipe on a machine without a GPU), AdamW, \
         flat mesh, threads engine with every rank on the one device; median of {steps} steps \
         after {WARMUP} warm-up. Host storage: fp32 masters and gradient buckets on the host, \
         AdamW (a Burn optimizer on the model's backend) and its state on the device; host with \
         AdamW on the CPU: the optimizer on NdArray over host views (`step_offloaded`), its \
         state off the device (FSDP2's CPU offload); device storage: masters, state and \
         gradients on the device, the runtime bytes re-derived there (MXFP8), runtime shards on the host; device, shards too: the runtime shards on the device as well (`with_shard_placement`: each gather reads this rank's part back, each update's piece stays on the device). The collectives are on the host in every row (the threads engine: the staged path; NCCL gathers from device shards with no host copy)."
    );
    println!(
        "\n| world | format | storage | step ms | / host storage | to / from device MiB per step \
         | device MiB in use / reserved (max) | host heap peak MiB/rank |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (world, format, storage, row, host_secs) in rows {
        match row {
            Ok(r) => {
                let ratio = host_secs.map_or("–".into(), |h| format!("{:.2}", r.secs / h));
                let memory = r.device_memory.map_or("n/a".into(), |(u, res)| {
                    format!("{:.1} / {:.1}", mib(u), mib(res))
                });
                println!(
                    "| {world} | {format:?} | {storage} | {:.0} | {ratio} | {:.2} / {:.2} | \
                     {memory} | {:.0} |",
                    r.secs * 1e3,
                    mib(r.traffic.0),
                    mib(r.traffic.1),
                    r.peak_per_rank / (1024.0 * 1024.0),
                );
            }
            Err(reason) => {
                println!("| {world} | {format:?} | {storage} | n/a: {reason} | | | | |")
            }
        }
    }
    println!(
        "\nto / from device: bytes uploaded to and read back from the device per step by rank 0 \
         (`Counters::uploaded_bytes` / `downloaded_bytes`). Device memory: CubeCL's \
         `memory_usage()` of the shared device (all ranks), sampled after each timed step's \
         forward and after its update, the most seen; CubeCL reports no peak between samples."
    );
}

/// The main table: `Hsdp<NdArray>` against plain Burn and the FSDP2-style baseline.
fn cpu_table(steps: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load_start = load_average();
    let ticks = cpu_ticks();
    let started = first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);

    let device = Default::default();
    let init: Gpt<B> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let params = named_params(&init).expect("parameters");
    // The same weights on the activation-checkpointing backend (the same seed, drawn whole the
    // same way, so Burn's RNG draws the same values).
    let init_checkpointing: Gpt<Checkpointing> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let total: usize = params.iter().map(|p| p.values.len()).sum();
    let embeddings: usize = params
        .iter()
        .filter(|p| p.path.starts_with("embed.") || p.path.starts_with("pos."))
        .map(|p| p.values.len())
        .sum();
    let n = (total - embeddings) as f64;
    let tokens_per_step = (BATCH * SEQ) as f64;
    let model_flops = tokens_per_step * (6.0 * n + 12.0 * (LAYERS * D * SEQ) as f64);

    eprintln!("measuring the matmul ceiling");
    let (mm_one, mm_all) = matmul_ceiling(BATCH * SEQ, D, 4 * D, cores);
    let ceiling = mm_one.max(mm_all) * 1e9;

    let mut rows: Vec<TableRow> = Vec::new();
    eprintln!("world 1: plain Burn");
    let plain_row = plain(&init, steps);
    rows.push((1, "plain Burn", Ok(plain_row), None));
    for world in [1, 2, 4] {
        let mut done: Vec<(&str, Result<Row, String>)> = Vec::new();
        let modes = MODES.iter().chain(MESH_MODES.iter().filter(|_| world == 4));
        for mode in modes.clone() {
            eprintln!("world {world}: {}", mode.name);
            let row = if mode.checkpointing {
                sharded(&init_checkpointing, world, mode, steps, &device)
            } else {
                sharded(&init, world, mode, steps, &device)
            };
            done.push((mode.name, row));
        }
        let secs_of = |name: &str| {
            done.iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, r)| r.as_ref().ok())
                .map(|r| r.secs)
        };
        let baselines: Vec<Option<f64>> = modes.map(|m| secs_of(m.baseline)).collect();
        if world == 1 {
            rows[0].3 = secs_of("Fsdp2Style");
        }
        for ((name, row), baseline) in done.into_iter().zip(baselines) {
            rows.push((world, name, row, baseline));
        }
    }
    let load_end = load_average();
    let shares = others_share(ticks);

    let mib = |b: f64| b / (1024.0 * 1024.0);
    println!("## sshsdp-bench\n");
    println!("Command: `cargo bench --bench sshsdp-bench`");
    println!(
        "Machine: {} ({cores} cores), {} RAM; {}; load average {load_start} at start, \
         {load_end} at end ({shares}){}.\n",
        proc_field("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown CPU".into()),
        proc_field("/proc/meminfo", "MemTotal").unwrap_or_else(|| "unknown".into()),
        first_line("rustc", &["-V"]).unwrap_or_else(|| "rustc unknown".into()),
        started.map(|s| format!("; {s}")).unwrap_or_default(),
    );
    println!(
        "Model: GPT {LAYERS}×{D}, vocabulary {VOCAB}, sequence {SEQ}, global batch {BATCH} \
         ({:.2}M parameters, {:.2}M without embedding tables); AdamW; threads engine, flat mesh, \
         {BUCKET_ELEMENTS}-element buckets (2×2 rows: 2 replicas × 2 shards); median of {steps} \
         steps after {WARMUP} warm-up.",
        total as f64 / 1e6,
        n / 1e6
    );
    println!(
        "Model FLOPs per step {:.2} GFLOP (6·N·tokens + 12·L·d·T·tokens). Ceiling: NdArray f32 \
         matmul {}×{D}·{D}×{}: {mm_one:.1} GFLOP/s on one thread, {mm_all:.1} GFLOP/s with one \
         per core at once; MFU against {:.1} GFLOP/s.\n",
        model_flops / 1e9,
        BATCH * SEQ,
        4 * D,
        ceiling / 1e9
    );
    println!(
        "| world | mode | step ms | / Fsdp2Style | peak MiB/rank | all-gathered MiB | reduced MiB \
         | copied MiB | to / from backend MiB | exposed comm % of step | MFU | bytes = projection |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (world, name, row, baseline) in &rows {
        match row {
            Ok(r) => {
                let ratio = baseline.map_or("–".into(), |b| format!("{:.2}", r.secs / b));
                let check = match r.projection {
                    None => "–".to_string(),
                    Some((true, _, _)) => "yes".to_string(),
                    Some((false, g, red)) => format!(
                        "no: counters {:+.1}% / {:+.1}% against the plan's layout",
                        100.0 * (r.gathered as f64 / g.max(1) as f64 - 1.0),
                        100.0 * (r.reduced as f64 / red.max(1) as f64 - 1.0),
                    ),
                };
                println!(
                    "| {world} | {name} | {:.0} | {ratio} | {:.0} | {:.2} | {:.2} | {:.2} | \
                     {:.2} / {:.2} | {:.1}% | {:.1}% | {check} |",
                    r.secs * 1e3,
                    mib(r.peak_per_rank),
                    mib(r.gathered as f64),
                    mib(r.reduced as f64),
                    mib(r.copied as f64),
                    mib(r.traffic.0 as f64),
                    mib(r.traffic.1 as f64),
                    100.0 * r.exposed,
                    100.0 * model_flops / r.secs / ceiling,
                );
            }
            Err(reason) => {
                println!("| {world} | {name} | n/a: {reason} | | | | | | | | | |");
            }
        }
    }
    println!(
        "\nall-gathered: bytes received by bucket all-gathers; reduced: bytes of full-bucket fp32 \
         gradients entering reductions (reduce-scatter; all-reduce under Ddp); copied: parameter \
         bytes copied outside collectives (Fsdp2Style's copy-in/out, Ddp's replicated bucket); \
         to / from backend: bytes copied into and out of the backend's tensors (host↔device \
         traffic on a GPU; on NdArray the zero-copy rows hand buffers over without a copy, and \
         \"device storage\" keeps masters, AdamW state and gradients as backend tensors, \
         staged through the host for the host collectives); \
         all per step, rank 0; exposed comm: rank 0's model thread waiting on collectives. \
         / Fsdp2Style of reshard rows: against Fsdp2Style reshard; of 2×2 rows: against \
         Fsdp2Style HSDP 2×2."
    );
}
