//! Sharded training across MPI processes, checked against the same run on in-process ranks.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_train
//! mpirun -n 2 target/release/examples/mpi_train [STEPS]
//! ```
//! Every process trains its share of a small GPT with `Autodiff<Hsdp<NdArray>>` over an
//! `MpiComm` mesh (from an `MpiSession`). Rank 0 then trains the same model on the same data with the threads engine at
//! the same world size and compares the global losses and its final weights; the program exits
//! non-zero if they differ or if the model did not learn.

use std::path::Path;
use std::process::ExitCode;

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use burn::tensor::{Tensor, TensorData};
use sshsdp::backend::{init_seeded, named_params, shard, Hsdp, HsdpConfig};
use sshsdp::checkpoint::{self, PieceStates};
use sshsdp::comm::mpi::{MpiOptions, MpiSession};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::{Collective, ReduceOp};
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::{ShardedOptimizer, ShardedStep};
use sshsdp::plan::Mesh;

type B = Autodiff<Hsdp<NdArray<f32>>>;

const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 64,
    layers: 2,
    heads: 4,
    seq: 16,
};
const BATCH: usize = 8;
const LR: f64 = 3e-3;

/// The global batch of `step`: the same on every rank and in every run.
fn batch(step: usize) -> Vec<i64> {
    (0..BATCH * (CONFIG.seq + 1))
        .map(|i| (((i / 3) * 7 + step * 13 + i % 3) % CONFIG.vocab) as i64)
        .collect()
}

/// Trains on `comm`'s rank; returns this rank's local losses and the final weights. With
/// `checkpoint`, the trained state is then saved there and loaded back (the same values).
fn train<C: Collective + Send + 'static>(
    comm: C,
    init: &Gpt<B>,
    steps: usize,
    checkpoint: Option<&Path>,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let device = Default::default();
    let (rank, world) = (comm.rank(), comm.size());
    let mesh = Mesh::flat(world).map_err(|e| e.to_string())?;
    let (mut model, runtime) = shard::<B, _, _>(init.clone(), HsdpConfig::new(mesh), comm, &device)
        .map_err(|e| e.to_string())?;
    let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device);
    let local = BATCH / world;
    let w = CONFIG.seq + 1;
    let mut losses = Vec::new();
    for step in 0..steps {
        let rows = batch(step)[rank * local * w..(rank + 1) * local * w].to_vec();
        let tokens = Tensor::from_data(TensorData::new(rows, [local, w]), &device);
        let loss = model.loss(tokens);
        losses.push(loss.clone().into_scalar());
        let _ = loss.backward();
        model = optim.step(LR, model, &runtime).map_err(|e| e.to_string())?;
    }
    if let Some(dir) = checkpoint {
        let saved = checkpoint::save(dir, &runtime, &PieceStates::new(&mut optim), steps as u64)
            .map_err(|e| format!("save: {e}"))?;
        checkpoint::load(&saved, &runtime, &mut PieceStates::new(&mut optim))
            .map_err(|e| format!("load: {e}"))?;
    }
    let weights = named_params(&model)
        .map_err(|e| e.to_string())?
        .into_iter()
        .flat_map(|p| p.values)
        .collect();
    Ok((losses, weights))
}

fn run() -> Result<(), String> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().map_err(|e| format!("STEPS: {e}")))
        .transpose()?
        .unwrap_or(20);
    // Fault injection for the failure tests: `FAILPOINTS=sshsdp::gather=return(1)` fails rank 1
    // at that point (sshsdp_comm::faults), and a short watchdog bounds the job.
    let _faults = fail::FailScenario::setup();
    let options = if std::env::var_os("FAILPOINTS").is_some() {
        MpiOptions {
            watchdog: Some(std::time::Duration::from_secs(10)),
            ..MpiOptions::default()
        }
    } else {
        MpiOptions::default()
    };
    let mpi = MpiSession::init_with(options).map_err(|e| e.to_string())?;
    let comm = mpi.world().map_err(|e| e.to_string())?;
    let (rank, world) = (comm.rank(), comm.size());
    if BATCH % world != 0 {
        return Err(format!(
            "the batch of {BATCH} does not split over {world} ranks"
        ));
    }
    // The initial weights come from rank 0 (shard broadcasts them), so a seed is enough here.
    let device = Default::default();
    let init: Gpt<B> = init_seeded(&device, 42, |d| CONFIG.init(d));
    // A second communicator for the check below (the first moves into the runtime).
    let check = comm.split(0, rank).map_err(|e| e.to_string())?;
    // A checkpoint directory every rank agrees on: named by rank 0's process id.
    let mut id = std::process::id().to_le_bytes();
    check.broadcast(&mut id, 0).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("sshsdp-mpi-train-{}", u32::from_le_bytes(id)));
    let trained = train(comm, &init, steps, Some(&dir));
    // Every rank is done with the directory (after a failure the barrier fails too, at once).
    let synced = check.barrier();
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (losses, weights) = trained?;
    synced.map_err(|e| e.to_string())?;
    // The global loss of each step: the mean of the ranks' local losses.
    let mut global = losses.clone();
    check
        .all_reduce(&mut global, ReduceOp::Avg)
        .map_err(|e| e.to_string())?;
    let mut verdict = [0f32];
    if rank == 0 {
        let threads = ThreadsWorld::run(world, ThreadsConfig::default(), |c| {
            train(c, &init, steps, None)
        })
        .map_err(|e| e.to_string())?;
        let mut reference: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for r in threads {
            reference.push(r.map_err(|_| "a threads rank panicked".to_string())??);
        }
        let ref_global: Vec<f32> = (0..steps)
            .map(|s| reference.iter().map(|(l, _)| l[s]).sum::<f32>() / world as f32)
            .collect();
        let loss_diff = global
            .iter()
            .zip(&ref_global)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0f32, f32::max);
        let weight_diff = weights
            .iter()
            .zip(&reference[0].1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let learned = global[steps - 1] < global[0] - 0.1;
        println!(
            "MPI world {world}, {steps} steps: loss {:.4} -> {:.4}",
            global[0],
            global[steps - 1]
        );
        println!("vs threads engine: max relative loss difference {loss_diff:.2e}, max weight difference {weight_diff:.2e}");
        if loss_diff > 1e-4 || weight_diff > 1e-4 || !learned {
            verdict[0] = 1.0;
        }
    }
    check
        .broadcast(&mut verdict, 0)
        .map_err(|e| e.to_string())?;
    if verdict[0] == 0.0 {
        Ok(())
    } else {
        Err("MPI training does not match the threads engine (or did not learn)".into())
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
