//! The benched parameter set: GPT-small's shapes as a Burn module, its synthetic loss and batch,
//! and its element counts by optimizer role.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{named_params, param_roles};
use sshsdp::plan::Role;

use crate::{B, D, MATRICES_PER_LAYER, MLP, TOKENS, VOCAB};

/// One decoder layer's parameters (pre-norm attention projections and MLP).
#[derive(Module, Debug)]
pub struct Layer<B: Backend> {
    ln_attn: LayerNorm<B>,
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    proj: Linear<B>,
    ln_mlp: LayerNorm<B>,
    fc_in: Linear<B>,
    fc_out: Linear<B>,
}

/// GPT-small's parameter shapes with `layers` layers (no position embedding, untied head).
#[derive(Module, Debug)]
pub struct GptShapes<B: Backend> {
    embed: Embedding<B>,
    layers: Vec<Layer<B>>,
    ln_final: LayerNorm<B>,
    lm_head: Linear<B>,
}

impl<B: Backend> GptShapes<B> {
    pub fn new(layers: usize, device: &B::Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        let norm = || LayerNormConfig::new(D).init(device);
        Self {
            embed: EmbeddingConfig::new(VOCAB, D).init(device),
            layers: (0..layers)
                .map(|_| Layer {
                    ln_attn: norm(),
                    query: linear(D, D),
                    key: linear(D, D),
                    value: linear(D, D),
                    proj: linear(D, D),
                    ln_mlp: norm(),
                    fc_in: linear(D, MLP),
                    fc_out: linear(MLP, D),
                })
                .collect(),
            ln_final: norm(),
            lm_head: linear(D, VOCAB),
        }
    }

    /// A cheap synthetic loss that gives every parameter a gradient: mean squared logit.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let mut x = self.embed.forward(tokens);
        for l in &self.layers {
            let h = l.ln_attn.forward(x.clone());
            let mix =
                l.query.forward(h.clone()).tanh() * l.key.forward(h.clone()) + l.value.forward(h);
            x = x + l.proj.forward(mix);
            let h = l.ln_mlp.forward(x.clone());
            x = x + l.fc_out.forward(gelu(l.fc_in.forward(h)));
        }
        self.lm_head
            .forward(self.ln_final.forward(x))
            .powi_scalar(2)
            .mean()
    }
}

pub fn tokens(step: usize, rank: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = (0..TOKENS)
        .map(|i| ((i + 31 * step + 977 * rank) * 2_654_435_761 % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(data, [1, TOKENS]), device)
}

/// Element counts of a parameter set.
#[derive(Default)]
pub struct Counts {
    /// Elements outside the layers (embedding, final norm, head): all element-wise.
    pub fixed: usize,
    /// Per layer: in Muon matrices, and element-wise (biases, LayerNorm vectors).
    pub layer_matrix: usize,
    pub layer_elementwise: usize,
    pub matrices: usize,
}

pub fn counts(init: &GptShapes<B>, layers: usize) -> Counts {
    // The roles `shard` plans: the holding module's type first, the path second.
    let roles: std::collections::HashMap<String, Role> = param_roles(init).into_iter().collect();
    let mut c = Counts::default();
    for p in named_params(init).unwrap() {
        let n = p.values.len();
        let role = roles[&p.path];
        match (p.path.starts_with("layers."), role) {
            (false, Role::Matrix) => panic!("{}: a matrix outside the layers", p.path),
            (false, Role::Elementwise) => c.fixed += n,
            (true, Role::Matrix) => {
                c.layer_matrix += n;
                c.matrices += 1;
            }
            (true, Role::Elementwise) => c.layer_elementwise += n,
        }
    }
    assert_eq!(
        c.matrices,
        MATRICES_PER_LAYER * layers,
        "role rule: six matrices a layer"
    );
    c.layer_matrix = c.layer_matrix.checked_div(layers).unwrap_or(0);
    c.layer_elementwise = c.layer_elementwise.checked_div(layers).unwrap_or(0);
    c
}
