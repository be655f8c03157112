//! A real sharded training run on the CPU: a small GPT-style byte-level language model trained
//! with SS-HSDP (`Autodiff<Hsdp<NdArray>>`) over in-process ranks.
//!
//! ```text
//! cargo run --release --example train_lm -- [--ranks N] [--mesh RxS] [--steps N] [--text FILE]
//!     [--optim adamw|muon] [--format f32|bf16] [--clip MAX_NORM] [--save DIR] [--resume DIR]
//! ```
//! Defaults: 2 ranks (fully sharded), 300 steps, the repository's README as the corpus, AdamW
//! with a cosine learning-rate schedule (Burn's scheduler), f32 runtime parameters. `muon`
//! runs distributed Muon on the matrices and AdamW on embeddings, norms, biases and the head.
//! `--save` writes a sharded checkpoint at the end; `--resume` continues from one, at any
//! number of ranks. Prints the loss every 25 steps with tokens/s, and compares the final loss
//! with the corpus's byte unigram entropy (what a model that learned nothing about context
//! would reach).

use std::process::ExitCode;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::LrScheduler;
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sshsdp::backend::{
    named_params, shard, Hsdp, HsdpConfig, HsdpError, HsdpRuntime, ShardedOptimizer,
};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::checkpoint::{self, PieceStates};
use sshsdp::optim::{MuonConfig, ShardedMuon};
use sshsdp::plan::{Mesh, RuntimeFormat};

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

const LR: f64 = 6e-3;

struct Args {
    mesh: Mesh,
    steps: usize,
    text: Vec<u8>,
    muon: bool,
    format: RuntimeFormat,
    clip: Option<f64>,
    save: Option<String>,
    resume: Option<String>,
}

/// The optimizer the run uses.
enum Optim {
    AdamW(ShardedOptimizer<Inner, AdamW>),
    Muon(ShardedMuon<Inner, AdamW>),
}

impl Optim {
    fn new(muon: bool, clip: Option<f64>) -> Self {
        let adamw = AdamWConfig::new().build();
        let device = Default::default();
        if muon {
            let mut o = ShardedMuon::new(MuonConfig::new().init(), adamw, device);
            if let Some(c) = clip {
                o = o.with_grad_clipping(c);
            }
            Optim::Muon(o)
        } else {
            let mut o = ShardedOptimizer::new(adamw, device);
            if let Some(c) = clip {
                o = o.with_grad_clipping(c);
            }
            Optim::AdamW(o)
        }
    }

    fn step(
        &mut self,
        lr: f64,
        model: Gpt<B>,
        runtime: &HsdpRuntime<Inner>,
    ) -> Result<Gpt<B>, HsdpError> {
        match self {
            Optim::AdamW(o) => o.step(lr, model, runtime),
            Optim::Muon(o) => o.step(lr, model, runtime),
        }
    }

    fn save(&mut self, dir: &str, runtime: &HsdpRuntime<Inner>, step: u64) -> Result<(), String> {
        let r = match self {
            Optim::AdamW(o) => checkpoint::save(dir, runtime, &PieceStates::new(o), step),
            Optim::Muon(o) => checkpoint::save(dir, runtime, o, step),
        };
        r.map(|_| ()).map_err(|e| e.to_string())
    }

    fn load(&mut self, dir: &str, runtime: &HsdpRuntime<Inner>) -> Result<u64, String> {
        let r = match self {
            Optim::AdamW(o) => checkpoint::load(dir, runtime, &mut PieceStates::new(o)),
            Optim::Muon(o) => checkpoint::load(dir, runtime, o),
        };
        r.map_err(|e| e.to_string())
    }
}

fn parse() -> Result<Args, String> {
    let mut mesh = Mesh::flat(2).map_err(|e| e.to_string())?;
    let mut steps = 300;
    let mut muon = false;
    let mut format = RuntimeFormat::F32;
    let (mut clip, mut save, mut resume) = (None, None, None);
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
            "--optim" => {
                muon = match value()?.as_str() {
                    "adamw" => false,
                    "muon" => true,
                    o => return Err(format!("--optim is adamw or muon, not `{o}`")),
                }
            }
            "--format" => {
                format = match value()?.as_str() {
                    "f32" => RuntimeFormat::F32,
                    "bf16" => RuntimeFormat::Bf16,
                    f => return Err(format!("--format is f32 or bf16, not `{f}`")),
                }
            }
            "--clip" => clip = Some(value()?.parse().map_err(|e| format!("--clip: {e}"))?),
            "--save" => save = Some(value()?),
            "--resume" => resume = Some(value()?),
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
    Ok(Args {
        mesh,
        steps,
        text,
        muon,
        format,
        clip,
        save,
        resume,
    })
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
        let config = HsdpConfig::new(args.mesh).with_format(args.format);
        let (mut model, runtime) =
            shard::<B, _, _>(init.clone(), config, comm, &device).map_err(|e| e.to_string())?;
        if rank == 0 {
            println!("{}", runtime.plan());
        }
        let mut optim = Optim::new(args.muon, args.clip);
        let first = match &args.resume {
            Some(dir) => optim.load(dir, &runtime)? as usize,
            None => 0,
        };
        // Any Burn scheduler drives the sharded optimizers: they take the rate each step. The
        // schedule spans this invocation's steps.
        let mut schedule = CosineAnnealingLrSchedulerConfig::new(LR, args.steps.max(1))
            .init()
            .map_err(|e| format!("learning-rate schedule: {e}"))?;
        let local = BATCH / world;
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ first as u64;
        let mut last = f32::NAN;
        for step in first..first + args.steps {
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
            let lr = schedule.step();
            model = optim.step(lr, model, &runtime).map_err(|e| e.to_string())?;
            if rank == 0 && (step % 25 == 0 || step + 1 == first + args.steps) {
                let tokens = ((step + 1 - first) * BATCH * SEQ) as f64;
                println!(
                    "step {step:>4}  loss (rank 0's share) {last:.3}  {:.0} tokens/s",
                    tokens / start.elapsed().as_secs_f64()
                );
            }
        }
        if let Some(dir) = &args.save {
            optim.save(dir, &runtime, (first + args.steps) as u64)?;
            if rank == 0 {
                println!("saved a {world}-rank checkpoint to {dir}");
            }
        }
        Ok::<f32, String>(last)
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
