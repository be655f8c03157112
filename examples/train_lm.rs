//! A real sharded training run on the CPU: a small GPT-style byte-level language model trained
//! with SS-HSDP (`Autodiff<Hsdp<NdArray>>`) over in-process ranks, AdamW on the sharded pieces.
//!
//! ```text
//! cargo run --release --example train_lm -- [--ranks N] [--mesh RxS] [--steps N] [--text FILE]
//! ```
//! Defaults: 2 ranks (fully sharded), 300 steps, the repository's README as the corpus. Prints
//! the loss every 25 steps with tokens/s, and compares the final loss with the corpus's byte
//! unigram entropy (what a model that learned nothing about context would reach).

use std::process::ExitCode;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sshsdp::backend::{named_params, shard, Hsdp, HsdpConfig, ShardedOptimizer};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::plan::Mesh;

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const D: usize = 128;
const LAYERS: usize = 2;
const SEQ: usize = 64;
const BATCH: usize = 16;

const CONFIG: GptConfig = GptConfig {
    vocab: 256,
    d_model: D,
    layers: LAYERS,
    heads: 4,
    seq: SEQ,
};

struct Args {
    mesh: Mesh,
    steps: usize,
    text: Vec<u8>,
}

fn parse() -> Result<Args, String> {
    let mut mesh = Mesh::flat(2).map_err(|e| e.to_string())?;
    let mut steps = 300;
    let mut path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md").to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--ranks" => {
                let n = value()?.parse().map_err(|e| format!("--ranks: {e}"))?;
                mesh = Mesh::flat(n).map_err(|e| e.to_string())?;
            }
            "--mesh" => {
                let v = value()?;
                let (r, s) = v.split_once('x').ok_or("--mesh is REPLICASxSHARDS")?;
                let n = |x: &str| x.parse::<usize>().map_err(|e| format!("--mesh: {e}"));
                mesh = Mesh::new(n(r)?, n(s)?).map_err(|e| e.to_string())?;
            }
            "--steps" => steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--text" => path = value()?,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let text = std::fs::read(&path).map_err(|e| format!("reading {path}: {e}"))?;
    if text.len() < 4 * (SEQ + 1) {
        return Err(format!("{path} is too short to train on"));
    }
    if BATCH % mesh.world_size() != 0 {
        return Err(format!(
            "the batch of {BATCH} does not split over {} ranks",
            mesh.world_size()
        ));
    }
    Ok(Args { mesh, steps, text })
}

/// Byte unigram entropy in nats.
fn unigram_entropy(text: &[u8]) -> f64 {
    let mut counts = [0usize; 256];
    text.iter().for_each(|&b| counts[b as usize] += 1);
    let n = text.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let device = Default::default();
    B::seed(&device, 0);
    let init: Gpt<B> = CONFIG.init(&device);
    let params: usize = named_params(&init)
        .unwrap()
        .iter()
        .map(|p| p.values.len())
        .sum();
    let world = args.mesh.world_size();
    let entropy = unigram_entropy(&args.text);
    println!(
        "training a {:.2}M-parameter byte-level GPT on {} bytes, {} ranks (mesh {}), {} steps",
        params as f64 / 1e6,
        args.text.len(),
        world,
        args.mesh,
        args.steps
    );
    let start = Instant::now();
    let outcome = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
        let rank = comm.rank();
        let config = HsdpConfig::new(args.mesh);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device)?;
        if rank == 0 {
            println!("{}", runtime.plan());
        }
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let local = BATCH / world;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut last = f32::NAN;
        for step in 0..args.steps {
            // Every rank draws the same global batch and trains on its share of it.
            let mut rows = Vec::with_capacity(BATCH * (SEQ + 1));
            for _ in 0..BATCH {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = (state % (args.text.len() - SEQ - 1) as u64) as usize;
                rows.extend(args.text[at..at + SEQ + 1].iter().map(|&b| b as i64));
            }
            let mine = rows[rank * local * (SEQ + 1)..(rank + 1) * local * (SEQ + 1)].to_vec();
            let tokens = Tensor::from_data(TensorData::new(mine, [local, SEQ + 1]), &device);
            let loss = model.loss(tokens);
            last = loss.clone().into_scalar();
            let _ = loss.backward();
            model = optim.step(3e-3, model, &runtime)?;
            if rank == 0 && (step % 25 == 0 || step + 1 == args.steps) {
                let tokens = ((step + 1) * BATCH * SEQ) as f64;
                println!(
                    "step {step:>4}  loss (rank 0's share) {last:.3}  {:.0} tokens/s",
                    tokens / start.elapsed().as_secs_f64()
                );
            }
        }
        Ok::<f32, sshsdp::backend::HsdpError>(last)
    });
    match outcome {
        Ok(results) => {
            let mut losses = Vec::new();
            for (rank, r) in results.into_iter().enumerate() {
                match r {
                    Ok(Ok(l)) => losses.push(l),
                    Ok(Err(e)) => {
                        eprintln!("rank {rank} failed: {e}");
                        return ExitCode::FAILURE;
                    }
                    Err(_) => {
                        eprintln!("rank {rank} panicked");
                        return ExitCode::FAILURE;
                    }
                }
            }
            let mean = losses.iter().sum::<f32>() / losses.len() as f32;
            println!(
                "final loss {mean:.3} nats/byte (mean over ranks) vs unigram entropy {entropy:.3}; {:.1} s",
                start.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
