//! `Hsdp<B>` over a CubeCL backend: `Autodiff<Hsdp<Wgpu>>` trains a small GPT with bf16 and
//! MXFP8 runtime parameters at world 2 and follows the same losses as `Autodiff<Hsdp<NdArray>>`
//! (float differences between the backends' kernels only). On a CPU-only machine wgpu runs over
//! Mesa's lavapipe; run with `cargo test --features wgpu --test wgpu_backend`.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_wgpu::Wgpu;
use sshsdp::backend::{shard, Hsdp, HsdpConfig};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::plan::{Mesh, RuntimeFormat};

const STEPS: usize = 6;
const BATCH: usize = 4;
const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 64,
    layers: 1,
    heads: 2,
    seq: 32,
};

fn tokens<B: Backend>(
    step: usize,
    first: usize,
    rows: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let w = CONFIG.seq + 1;
    let data: Vec<i64> = (first * w..(first + rows) * w)
        .map(|i| ((i * 7 + step * 13 + (i / w) * 3) % CONFIG.vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, w]), device)
}

/// The initial weights, made once on the CPU so both backends start from the same values.
fn initial_record() -> Vec<(Vec<usize>, Vec<f32>)> {
    let device = Default::default();
    NdArray::<f32>::seed(&device, 3);
    let model: Gpt<NdArray<f32>> = CONFIG.init(&device);
    sshsdp::backend::named_params(&model)
        .unwrap()
        .into_iter()
        .map(|p| (p.shape, p.values))
        .collect()
}

/// Replaces every float parameter, in module order, with the next recorded values.
struct Load<'a>(std::slice::Iter<'a, (Vec<usize>, Vec<f32>)>);

impl<B: Backend> ModuleMapper<B> for Load<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let (shape, values) = self.0.next().expect("the same model structure");
        let loaded = Tensor::from_data(
            TensorData::new(values.clone(), shape.clone()),
            &tensor.device(),
        );
        let loaded = if tensor.is_require_grad() {
            loaded.require_grad()
        } else {
            loaded
        };
        Param::from_mapped_value(id, loaded, mapper)
    }
}

/// Losses of every rank's local batch, averaged, at each step.
fn train<I: Backend>(format: RuntimeFormat, device: I::Device) -> Vec<f32>
where
    I::Device: Default,
{
    let record = initial_record();
    let world = 2;
    let config = ThreadsConfig {
        timeout: Duration::from_secs(300),
    };
    let ranks = ThreadsWorld::run(world, config, |comm| {
        type A<I> = Autodiff<Hsdp<I>>;
        let rank = comm.rank();
        let model: Gpt<A<I>> = CONFIG.init(&device);
        let model = model.map(&mut Load(record.iter()));
        let config = HsdpConfig::new(Mesh::flat(world).unwrap()).with_format(format);
        let (mut model, runtime) = shard::<A<I>, _, _>(model, config, comm, &device).unwrap();
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let loss = model.loss(tokens::<A<I>>(step, rank * BATCH, BATCH, &device));
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let _ = loss.backward();
            model = optim.step(1e-2, model, &runtime).unwrap();
        }
        losses
    })
    .unwrap();
    let ranks: Vec<Vec<f32>> = ranks
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect();
    (0..STEPS)
        .map(|s| ranks.iter().map(|l| l[s]).sum::<f32>() / world as f32)
        .collect()
}

#[test]
fn hsdp_over_wgpu_trains_like_hsdp_over_ndarray() {
    for format in [RuntimeFormat::Bf16, RuntimeFormat::Mxfp8] {
        let cpu = train::<NdArray<f32>>(format, Default::default());
        let gpu = train::<Wgpu>(format, Default::default());
        eprintln!("{format:?}: NdArray {cpu:?}\n        Wgpu    {gpu:?}");
        for (step, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
            assert!(
                (a - b).abs() <= 2e-3 * b.abs(),
                "{format:?} step {step}: Wgpu {a} vs NdArray {b}"
            );
        }
        assert!(gpu[STEPS - 1] < gpu[0], "{gpu:?}");
    }
}
