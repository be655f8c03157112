//! The measurement of one row: plain Burn, or a mode at a world on the threads engine, trained
//! on a synthetic batch; step time, heap peak, runtime counters and the projection check.

use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{shard, Hsdp, HsdpConfig};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::kernels::FusedOps;
use sshsdp::models::Gpt;
use sshsdp::optim::ShardedOptimizer;
use sshsdp::plan::projection::{StepTraffic, TrafficOptions};
use sshsdp::plan::Mesh;

use crate::common::{median, LIVE, PEAK};
use crate::modes::Mode;
use crate::{Inner, B, BATCH, BUCKET_ELEMENTS, SEQ, VOCAB, WARMUP};
use sshsdp::optim::ShardedStep;

fn tokens<A: Backend>(rows: usize, offset: usize, device: &A::Device) -> Tensor<A, 2, Int> {
    let data: Vec<i64> = (0..rows * (SEQ + 1))
        .map(|i| ((i + offset * 7919) * 2_654_435_761 % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, SEQ + 1]), device)
}

/// One measured configuration.
pub struct Row {
    pub secs: f64,
    pub peak_per_rank: f64,
    pub gathered: u64,
    pub reduced: u64,
    pub copied: u64,
    /// Bytes handed to and read back from the backend's tensors (host↔device on a GPU).
    pub traffic: (u64, u64),
    /// Share of the step the model thread waited on collectives (timed steps summed).
    pub exposed: f64,
    /// `None` for plain Burn (no plan); otherwise whether the counters equal the projection,
    /// and the projected (gathered, reduced) bytes.
    pub projection: Option<(bool, u64, u64)>,
    /// The most device memory in use and reserved (CubeCL backends): sampled after each timed
    /// step's forward and after its update. Read by the device table (feature `wgpu`).
    #[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
    pub device_memory: Option<(u64, u64)>,
}

fn reset_peak() -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    base
}

pub fn plain(init: &Gpt<B>, steps: usize) -> Row {
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
pub fn sharded<I: FusedOps, C: CheckpointStrategy>(
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
