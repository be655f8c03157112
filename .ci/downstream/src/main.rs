//! Shards a small GPT on Burn's default GPU types, `Autodiff<Hsdp<Wgpu>>` and
//! `Autodiff<Hsdp<Cuda>>` (burn-fusion over CubeCL, autotune on), as a user's program would.
//! `.ci/run` only builds it (the point is that it compiles on its own); run, it trains one step
//! on each backend whose device is present and says which it skipped.

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{shard, Hsdp, HsdpConfig};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::kernels::FusedOps;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::{ShardedOptimizer, ShardedStep};
use sshsdp::plan::Mesh;

/// One sharded training step of a tiny GPT on `I` at world 1; the loss.
fn one_step<I: FusedOps>(device: I::Device) -> Result<f32, String> {
    type A<I> = Autodiff<Hsdp<I>>;
    let config = GptConfig {
        vocab: 32,
        d_model: 32,
        layers: 1,
        heads: 2,
        seq: 8,
    };
    let results = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        let model: Gpt<A<I>> = config.init(&device);
        let hsdp = HsdpConfig::new(Mesh::new(1, 1).unwrap());
        let (model, runtime) = shard::<A<I>, _, _>(model, hsdp, comm, &device)
            .map_err(|e| e.to_string())?;
        let tokens: Vec<i64> = (0..2 * (config.seq + 1) as i64).map(|i| i % 32).collect();
        let tokens = TensorData::new(tokens, [2, config.seq + 1]);
        let tokens: Tensor<A<I>, 2, Int> = Tensor::from_data(tokens, &device);
        let loss = model.loss(tokens);
        let value = loss.clone().into_scalar();
        let _ = loss.backward();
        let adamw = burn::optim::AdamWConfig::new().build();
        let mut optim = ShardedOptimizer::new(adamw, device.clone());
        optim.step(1e-3, model, &runtime).map_err(|e| e.to_string())?;
        Ok::<f32, String>(burn::tensor::ElementConversion::elem(value))
    })
    .map_err(|e| e.to_string())?;
    let rank = results.into_iter().next().expect("one rank");
    rank.map_err(|e| format!("{e:?}"))?
}

/// One step on `I`, unless the backend's driver or device is missing (GPU runtimes panic then).
fn try_on<I: FusedOps>(name: &str)
where
    I::Device: Default,
{
    match std::panic::catch_unwind(|| one_step::<I>(Default::default())) {
        Ok(Ok(loss)) => println!("{name}: one sharded step, loss {loss}"),
        Ok(Err(e)) => {
            eprintln!("{name}: {e}");
            std::process::exit(1);
        }
        Err(_) => println!("{name}: skipped (no device or driver)"),
    }
}

fn main() {
    try_on::<burn_wgpu::Wgpu>("Autodiff<Hsdp<burn_wgpu::Wgpu>>");
    try_on::<burn_cuda::Cuda>("Autodiff<Hsdp<burn_cuda::Cuda>>");
}
