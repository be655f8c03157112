//! Helpers shared by the GPT training tests (`mixed_precision.rs`, `wgpu_backend/`):
//! deterministic batches, a recorded initial model, and a mapper loading it into any backend.

use burn::backend::NdArray;
use burn::module::{ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::init_seeded;
use sshsdp::models::{Gpt, GptConfig};

/// `rows` sequences of `config.seq + 1` tokens of step `step`, starting at sequence `first` of
/// the step's global batch (the same tokens whatever the backend or world size).
pub fn tokens<B: Backend>(
    config: &GptConfig,
    step: usize,
    first: usize,
    rows: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let w = config.seq + 1;
    let data: Vec<i64> = (first * w..(first + rows) * w)
        .map(|i| ((i * 7 + step * 13 + (i / w) * 3) % config.vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [rows, w]), device)
}

/// A GPT's initial weights drawn on the CPU after seeding Burn's RNG with `seed`, parameter by
/// parameter in module order, under the process's RNG lock (`init_seeded`: tests run in
/// parallel and Burn's RNG is global).
pub fn record(config: &GptConfig, seed: u64) -> Vec<(Vec<usize>, Vec<f32>)> {
    let device = Default::default();
    let model: Gpt<NdArray<f32>> = init_seeded(&device, seed, |d| config.init(d));
    sshsdp::backend::named_params(&model)
        .unwrap()
        .into_iter()
        .map(|p| (p.shape, p.values))
        .collect()
}

/// The model `init` builds on `device`, its parameters replaced by `record`'s values. Built
/// under the process's Burn RNG lock and synced before it is released: building draws the lazy
/// parameters Load then replaces, and a draw outside the lock (on fusion, queued and run later)
/// would move another thread's seeded sequence (`sshsdp::backend::with_burn_rng`).
pub fn loaded<B: Backend, M: burn::module::Module<B>>(
    device: &B::Device,
    record: &[(Vec<usize>, Vec<f32>)],
    init: impl FnOnce(&B::Device) -> M,
) -> M {
    sshsdp::backend::with_burn_rng(|| {
        let model = init(device).map(&mut Load(record.iter()));
        if let Err(e) = B::sync(device) {
            panic!("synchronising the device after loading a record: {e:?}");
        }
        model
    })
}

/// Replaces every float parameter, in module order, with the next recorded values.
pub struct Load<'a>(pub std::slice::Iter<'a, (Vec<usize>, Vec<f32>)>);

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
