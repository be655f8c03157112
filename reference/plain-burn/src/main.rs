//! Trains the decorator tests' small transformer on plain Burn (`Autodiff<NdArray>`), from the
//! initial weights and token batches given in a JSON file, and writes the per-step losses and
//! the final weights as JSON.
//!
//! Usage: `plain-burn-reference IN.json OUT.json`. The model must stay identical to
//! `crates/sshsdp-optim/tests/common.rs` (`TinyLm`); parameters are matched by module path,
//! and a missing or extra path is an error.

use std::collections::HashMap;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

type B = Autodiff<NdArray<f32>>;

#[derive(Module, Debug)]
struct Block<B: Backend> {
    norm_attn: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    norm_mlp: LayerNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
}

#[derive(Module, Debug)]
struct TinyLm<B: Backend> {
    embed: Embedding<B>,
    blocks: Vec<Block<B>>,
    norm: LayerNorm<B>,
    lm_head: Linear<B>,
}

#[derive(Deserialize)]
struct Input {
    vocab: usize,
    d_model: usize,
    seq: usize,
    batch: usize,
    lr: f64,
    optimizer: String,
    batches: Vec<Vec<i64>>,
    params: Vec<NamedValues>,
}

#[derive(Serialize, Deserialize)]
struct NamedValues {
    path: String,
    values: Vec<f32>,
}

#[derive(Serialize)]
struct Output {
    losses: Vec<f32>,
    params: Vec<NamedValues>,
}

impl<B: Backend> TinyLm<B> {
    fn new(vocab: usize, d: usize, device: &B::Device) -> Self {
        let block = || Block {
            norm_attn: LayerNormConfig::new(d).init(device),
            attn: MultiHeadAttentionConfig::new(d, 2).with_dropout(0.0).init(device),
            norm_mlp: LayerNormConfig::new(d).init(device),
            up: LinearConfig::new(d, 4 * d).init(device),
            down: LinearConfig::new(4 * d, d).init(device),
        };
        Self {
            embed: EmbeddingConfig::new(vocab, d).init(device),
            blocks: vec![block(), block()],
            norm: LayerNormConfig::new(d).init(device),
            lm_head: LinearConfig::new(d, vocab).init(device),
        }
    }

    fn loss(&self, tokens: Tensor<B, 2, Int>, seq: usize, vocab: usize) -> Tensor<B, 1> {
        let [batch, _] = tokens.dims();
        let input = tokens.clone().slice([0..batch, 0..seq]);
        let target = tokens.slice([0..batch, 1..seq + 1]).reshape([batch * seq]);
        let mut x = self.embed.forward(input);
        for b in &self.blocks {
            let h = b.norm_attn.forward(x.clone());
            x = x + b.attn.forward(MhaInput::self_attn(h)).context;
            let h = b.norm_mlp.forward(x.clone());
            x = x.clone() + b.down.forward(gelu(b.up.forward(h)));
        }
        let logits = self.lm_head.forward(self.norm.forward(x)).reshape([batch * seq, vocab]);
        CrossEntropyLossConfig::new().init(&logits.device()).forward(logits, target)
    }
}

/// Sets every float parameter from `values` by module path.
struct Loader {
    path: Vec<String>,
    values: HashMap<String, Vec<f32>>,
    missing: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for Loader {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let path = self.path.join(".");
        let Some(values) = self.values.remove(&path) else {
            self.missing.push(path);
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let shape = tensor.shape();
        let loaded = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device());
        let loaded = if tensor.is_require_grad() { loaded.require_grad() } else { loaded };
        Param::from_mapped_value(id, loaded, mapper)
    }
}

/// Reads every float parameter by module path.
struct Reader {
    path: Vec<String>,
    out: Vec<NamedValues>,
}

impl<B: Backend> ModuleVisitor<B> for Reader {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let values = param.val().into_data().convert::<f32>().into_vec::<f32>().expect("f32 data");
        self.out.push(NamedValues { path: self.path.join("."), values });
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output] = args.as_slice() else {
        return Err("usage: plain-burn-reference IN.json OUT.json".into());
    };
    let text = std::fs::read_to_string(input).map_err(|e| format!("{input}: {e}"))?;
    let input: Input = serde_json::from_str(&text).map_err(|e| format!("{input}: {e}"))?;
    let device = Default::default();
    let mut loader = Loader {
        path: Vec::new(),
        values: input.params.into_iter().map(|p| (p.path, p.values)).collect(),
        missing: Vec::new(),
    };
    let mut model = TinyLm::<B>::new(input.vocab, input.d_model, &device).map(&mut loader);
    if !loader.missing.is_empty() || !loader.values.is_empty() {
        return Err(format!(
            "parameters do not match: missing {:?}, unknown {:?}",
            loader.missing,
            loader.values.keys().collect::<Vec<_>>()
        ));
    }
    let mut sgd = SgdConfig::new().init::<B, TinyLm<B>>();
    let mut adamw = AdamWConfig::new().init::<B, TinyLm<B>>();
    let mut losses = Vec::new();
    for batch in &input.batches {
        let tokens = Tensor::<B, 2, Int>::from_data(
            TensorData::new(batch.clone(), [input.batch, input.seq + 1]),
            &device,
        );
        let loss = model.loss(tokens, input.seq, input.vocab);
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = match input.optimizer.as_str() {
            "sgd" => sgd.step(input.lr, model, grads),
            "adamw" => adamw.step(input.lr, model, grads),
            other => return Err(format!("unknown optimizer {other}")),
        };
    }
    let mut reader = Reader { path: Vec::new(), out: Vec::new() };
    model.visit(&mut reader);
    let out = Output { losses, params: reader.out };
    std::fs::write(output, serde_json::to_string(&out).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{output}: {e}"))
}
