//! `Hsdp<B>` over a CubeCL backend: `Autodiff<Hsdp<Wgpu>>` trains a small GPT with bf16 and
//! MXFP8 runtime parameters at world 2 and follows the same losses as `Autodiff<Hsdp<NdArray>>`
//! (float differences between the backends' kernels only). On a CPU-only machine wgpu runs over
//! Mesa's lavapipe; run with `cargo test --features wgpu --test wgpu_backend`.
//!
//! Also the storage seam's proof on a device: with the fp32 masters and the gradients on the
//! Wgpu device (`Placement::Device`: masters, AdamW state and gradient accumulators in device
//! buffers, collectives through the host) training is bitwise the same as with host ones.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_wgpu::Wgpu;
use sshsdp::backend::{shard, Hsdp, HsdpConfig, Placement};
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
///
/// Made once per process: Burn's RNG is global, and the tests of this file run in parallel, so
/// a second seeding and drawing could interleave with another test's ranks drawing their own
/// (discarded) initial values.
fn initial_record() -> &'static [(Vec<usize>, Vec<f32>)] {
    static RECORD: std::sync::OnceLock<Vec<(Vec<usize>, Vec<f32>)>> = std::sync::OnceLock::new();
    RECORD.get_or_init(|| {
        let device = Default::default();
        NdArray::<f32>::seed(&device, 3);
        let model: Gpt<NdArray<f32>> = CONFIG.init(&device);
        sshsdp::backend::named_params(&model)
            .unwrap()
            .into_iter()
            .map(|p| (p.shape, p.values))
            .collect()
    })
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
    train_placed::<I>(format, (Placement::Host, Placement::Host), device).losses
}

/// What a run leaves.
#[derive(Debug, PartialEq)]
struct Run {
    /// Losses of every rank's local batch, averaged, at each step.
    losses: Vec<f32>,
    /// Rank 0's final weights, parameter by parameter.
    weights: Vec<Vec<f32>>,
    /// Rank 0's master bytes on the host and on the device.
    master_bytes: (u64, u64),
    /// Rank 0's (uploaded, downloaded) bytes of the last step: host↔device traffic.
    traffic: (u64, u64),
    /// Runtime bytes of rank 0's pieces (one per bucket).
    piece_bytes: u64,
}

/// [`train`] with the fp32 masters in `masters` and gradients accumulated in `grads`.
fn train_placed<I: Backend>(
    format: RuntimeFormat,
    (masters, grads): (Placement, Placement),
    device: I::Device,
) -> Run
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
        let config = HsdpConfig::new(Mesh::flat(world).unwrap())
            .with_format(format)
            .with_master_placement(masters)
            .with_grad_placement(grads);
        let (mut model, runtime) = shard::<A<I>, _, _>(model, config, comm, &device).unwrap();
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            if step == STEPS - 1 {
                // The last step alone (forward, backward, update).
                runtime.take_counters();
            }
            let loss = model.loss(tokens::<A<I>>(step, rank * BATCH, BATCH, &device));
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let _ = loss.backward();
            model = optim.step(1e-2, model, &runtime).unwrap();
        }
        let counters = runtime.take_counters();
        let traffic = (counters.uploaded_bytes, counters.downloaded_bytes);
        let weights: Vec<Vec<f32>> = runtime
            .plan()
            .params()
            .iter()
            .map(|p| runtime.param_values(&p.spec.path).unwrap())
            .collect();
        let bytes = (runtime.master_bytes(), runtime.device_master_bytes());
        let piece_bytes = runtime.plan().buckets().iter().map(|b| b.piece_bytes).sum();
        (losses, weights, bytes, traffic, piece_bytes)
    })
    .unwrap();
    let mut ranks: Vec<_> = ranks
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect();
    let losses = (0..STEPS)
        .map(|s| ranks.iter().map(|r| r.0[s]).sum::<f32>() / world as f32)
        .collect();
    let (_, weights, master_bytes, traffic, piece_bytes) = ranks.swap_remove(0);
    Run {
        losses,
        weights,
        master_bytes,
        traffic,
        piece_bytes,
    }
}

#[test]
fn device_masters_and_gradients_on_wgpu_train_bitwise_like_host_ones() {
    use Placement::{Device, Host};
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        let host = train_placed::<Wgpu>(format, (Host, Host), Default::default());
        let device = train_placed::<Wgpu>(format, (Device, Device), Default::default());
        assert_eq!(host.losses, device.losses, "{format:?}");
        assert_eq!(host.weights, device.weights, "{format:?}");
        assert!(device.losses[STEPS - 1] < device.losses[0], "{device:?}");
        assert_eq!(
            device.master_bytes.0, 0,
            "{format:?}: no master on the host"
        );
        assert!(device.master_bytes.1 > 0, "{format:?}");
        assert_eq!(host.master_bytes.1, 0, "{format:?}");
        // Host↔device bytes of a step: both upload the gathered buckets and download every
        // gradient once; device storage also uploads each piece's reduced gradient and
        // downloads each updated piece once for the host collectives that rebuild the shards:
        // the runtime bytes encoded on the device (bf16, MXFP8), or the master itself (f32,
        // whose runtime elements are the masters). (With host masters the optimizer's own
        // copies to its device are not the runtime's to count.)
        let m = device.master_bytes.1;
        let encoded = match format {
            RuntimeFormat::F32 => m,
            _ => device.piece_bytes,
        };
        eprintln!(
            "{format:?}: (uploaded, downloaded) host {:?}, device {:?}, masters {m}, encoded \
             pieces {encoded}",
            host.traffic, device.traffic
        );
        assert_eq!(device.traffic.0, host.traffic.0 + m, "{format:?}");
        assert_eq!(device.traffic.1, host.traffic.1 + encoded, "{format:?}");
        if format != RuntimeFormat::F32 {
            assert!(
                2 * encoded < m + m / 10,
                "{format:?}: about half the master or less"
            );
        }
    }
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
