//! Sharding an ordinary Burn model: a two-layer MLP on `Autodiff<Hsdp<NdArray>>` learns a
//! fixed linear map on 2 in-process ranks (the threads engine), each rank training on its half
//! of every global batch. The README quotes `main`.
//!
//! ```text
//! cargo run --example shard_model
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sshsdp::backend::{shard, Hsdp, HsdpConfig, HsdpError};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::ShardedStep;
use sshsdp::plan::Mesh;

/// Autodiff over the sharding decorator over any Burn backend.
type Sharded = Autodiff<Hsdp<NdArray>>;

/// An ordinary Burn module: nothing in it knows about sharding.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    up: Linear<B>,
    down: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        let (up, down) = (LinearConfig::new(8, 32), LinearConfig::new(32, 2));
        Mlp {
            up: up.init(device),
            down: down.init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.down.forward(Relu::new().forward(self.up.forward(x)))
    }
}

/// This rank's half of step `step`'s global batch of 16 rows: inputs in [-1, 1) and targets
/// `(sum of the first four inputs, sum of the last four)`.
fn my_rows<B: Backend>(
    step: usize,
    rank: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x: Vec<f32> = (0..8 * 8)
        .map(|i| (((i + 64 * rank + 128 * step) * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let y: Vec<f32> = x.chunks(4).map(|half| half.iter().sum()).collect();
    let x = Tensor::from_data(TensorData::new(x, [8, 8]), device);
    (x, Tensor::from_data(TensorData::new(y, [8, 2]), device))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ranks = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let model = Mlp::<Sharded>::new(&device); // lazy: rank 0 draws it in `shard`
        let config = HsdpConfig::new(Mesh::flat(2)?); // .with_format(RuntimeFormat::Bf16), ...
        let (mut model, runtime) = shard::<Sharded, _, _>(model, config, comm, &device)?;
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let mut losses = Vec::new();
        for step in 0..30 {
            let (x, y) = my_rows(step, rank, &device);
            let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward(); // each bucket is reduce-scattered once its gradients are in
            model = optim.step(1e-2, model, &runtime)?; // each rank steps its piece; views rebuilt
        }
        Ok::<_, HsdpError>(losses)
    })?;
    for (rank, losses) in ranks.into_iter().enumerate() {
        let losses = losses.map_err(|_| format!("rank {rank} panicked"))??;
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        println!(
            "rank {rank}: local loss {first:.4} -> {last:.4} in {} steps",
            losses.len()
        );
        if !last.is_finite() || last >= first {
            return Err(format!("rank {rank} did not learn").into());
        }
    }
    Ok(())
}
