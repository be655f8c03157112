//! Training-step comparison on the threads engine: plain Burn, `Ddp`, `Fsdp2Style` and SS-HSDP
//! (zero-copy, hierarchical; f32, bf16, and both data paths with resharding after forward, whose
//! `/FSDP2` ratio is against `Fsdp2Style reshard`) at world 1, 2 and 4 — step time, its ratio to plain Burn and to
//! `Fsdp2Style`, the process's peak heap per rank, and bytes gathered, reduced and copied per
//! step. Run: `cargo bench --bench hsdp`.
//!
//! "Plain Burn" is the same model trained unsharded with Burn's own AdamW on
//! `Autodiff<Hsdp<NdArray>>` whose parameters are ordinary tensors: every op forwards to NdArray,
//! so this is NdArray's arithmetic, measured in the same process and build. (A build of
//! `Autodiff<NdArray>` itself cannot sit in this workspace: burn's `distributed` feature, which
//! `Hsdp` needs, makes `Autodiff<B>` require `B: DistributedBackend`.)

use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{named_params, shard, CopyMode, Hsdp, HsdpConfig, ShardedOptimizer};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

mod common;
use common::{LIVE, PEAK};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const VOCAB: usize = 256;
const D: usize = 256;
const LAYERS: usize = 4;
const SEQ: usize = 64;
const BATCH: usize = 16;
const WARMUP: usize = 2;
const STEPS: usize = 6;

const CONFIG: GptConfig = GptConfig {
    vocab: VOCAB,
    d_model: D,
    layers: LAYERS,
    heads: 4,
    seq: SEQ,
};

fn tokens(rows: usize, offset: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = (0..rows * (SEQ + 1))
        .map(|i| ((i + offset * 7919) * 2_654_435_761 % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, SEQ + 1]), device)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Row {
    secs: f64,
    peak_per_rank: f64,
    gathered: u64,
    reduced: u64,
    copied: u64,
}

fn plain(init: &Gpt<B>) -> Row {
    let device = Default::default();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut model = init.clone();
    let mut optim = AdamWConfig::new().init::<B, Gpt<B>>();
    let mut times = Vec::new();
    for step in 0..WARMUP + STEPS {
        let t = Instant::now();
        let loss = model.loss(tokens(BATCH, step, &device));
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
    }
}

fn sharded(
    init: &Gpt<B>,
    world: usize,
    sharding: Sharding,
    mode: CopyMode,
    configure: &(dyn Fn(HsdpConfig) -> HsdpConfig + Sync),
) -> Row {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let results = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = configure(
            HsdpConfig::new(Mesh::flat(world).unwrap())
                .with_sharding(sharding)
                .with_copy_mode(mode)
                .with_bucket_elements(300_000),
        );
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let local = BATCH / world;
        let mut times = Vec::new();
        let mut counters = Default::default();
        for step in 0..WARMUP + STEPS {
            runtime.take_counters();
            let t = Instant::now();
            let loss = model.loss(tokens(local, step * world + rank, &device));
            let _ = loss.backward();
            model = optim.step(1e-3, model, &runtime).unwrap();
            if step >= WARMUP {
                times.push(t.elapsed().as_secs_f64());
            }
            counters = runtime.take_counters();
        }
        (median(times), counters)
    })
    .unwrap();
    let (secs, c) = results.into_iter().next().unwrap().unwrap();
    Row {
        secs,
        peak_per_rank: (PEAK.load(Ordering::Relaxed) - base) as f64 / world as f64,
        gathered: c.gathered_bytes,
        reduced: c.reduced_bytes,
        copied: c.param_bytes_copied,
    }
}

fn main() {
    let device = Default::default();
    B::seed(&device, 1);
    let init: Gpt<B> = CONFIG.init(&device);
    let params: usize = named_params(&init)
        .unwrap()
        .iter()
        .map(|p| p.values.len())
        .sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "GPT {LAYERS}x{D}, vocab {VOCAB}, seq {SEQ}, global batch {BATCH}: {:.2}M parameters; \
         AdamW; threads engine on {cores} cores; median of {STEPS} steps",
        params as f64 / 1e6
    );
    let plain = plain(&init);
    println!(
        "{:<6} {:<18} {:>9} {:>9} {:>9} {:>13} {:>11} {:>11} {:>11}",
        "world",
        "mode",
        "step ms",
        "/plain",
        "/FSDP2",
        "peak MiB/rank",
        "gather MiB",
        "reduce MiB",
        "copied MiB"
    );
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let print = |world: usize, name: &str, r: &Row, fsdp2: Option<&Row>| {
        println!(
            "{:<6} {:<18} {:>9.1} {:>9.2} {:>9} {:>13.1} {:>11.2} {:>11.2} {:>11.2}",
            world,
            name,
            r.secs * 1e3,
            r.secs / plain.secs,
            fsdp2.map_or("-".into(), |f| format!("{:.2}", r.secs / f.secs)),
            mib(r.peak_per_rank),
            mib(r.gathered as f64),
            mib(r.reduced as f64),
            mib(r.copied as f64)
        );
    };
    print(1, "plain Burn", &plain, None);
    for world in [1, 2, 4] {
        let same = |c: HsdpConfig| c;
        let ddp = sharded(&init, world, Sharding::Ddp, CopyMode::ZeroCopy, &same);
        let hier = Sharding::Hierarchical;
        let fsdp2 = sharded(&init, world, hier, CopyMode::Fsdp2Style, &same);
        let ours = sharded(&init, world, hier, CopyMode::ZeroCopy, &same);
        let bf16 = |c: HsdpConfig| c.with_format(RuntimeFormat::Bf16);
        let ours_bf16 = sharded(&init, world, hier, CopyMode::ZeroCopy, &bf16);
        let reshard = |c: HsdpConfig| c.with_reshard_after_forward(true);
        let ours_reshard = sharded(&init, world, hier, CopyMode::ZeroCopy, &reshard);
        let fsdp2_reshard = sharded(&init, world, hier, CopyMode::Fsdp2Style, &reshard);
        print(world, "Ddp", &ddp, Some(&fsdp2));
        print(world, "Fsdp2Style", &fsdp2, Some(&fsdp2));
        print(world, "SS-HSDP zero-copy", &ours, Some(&fsdp2));
        print(world, "SS-HSDP bf16", &ours_bf16, Some(&fsdp2));
        print(
            world,
            "Fsdp2Style reshard",
            &fsdp2_reshard,
            Some(&fsdp2_reshard),
        );
        print(
            world,
            "SS-HSDP reshard",
            &ours_reshard,
            Some(&fsdp2_reshard),
        );
    }
}
