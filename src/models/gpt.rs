//! A GPT-style decoder-only transformer over byte or small-vocabulary tokens.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::kernels::{gelu, FusedOps};

use super::attention::{causal_bias, CausalSelfAttention};

/// Sizes of a [`Gpt`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size (256 for bytes).
    pub vocab: usize,
    /// Model width.
    pub d_model: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub seq: usize,
}

/// One pre-norm block: causal self-attention and a GELU MLP, each with a residual.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    norm_attn: LayerNorm<B>,
    attn: CausalSelfAttention<B>,
    norm_mlp: LayerNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// Token and position embeddings, decoder blocks, final norm and LM head.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    embed: Embedding<B>,
    pos: Embedding<B>,
    blocks: Vec<Block<B>>,
    norm: LayerNorm<B>,
    head: Linear<B>,
}

impl GptConfig {
    /// A model with freshly initialised weights on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt<B> {
        let d = self.d_model;
        Gpt {
            embed: EmbeddingConfig::new(self.vocab, d).init(device),
            pos: EmbeddingConfig::new(self.seq, d).init(device),
            blocks: (0..self.layers)
                .map(|_| Block {
                    norm_attn: LayerNormConfig::new(d).init(device),
                    attn: CausalSelfAttention::new(d, self.heads, device),
                    norm_mlp: LayerNormConfig::new(d).init(device),
                    up: LinearConfig::new(d, 4 * d).init(device),
                    down: LinearConfig::new(4 * d, d).init(device),
                })
                .collect(),
            norm: LayerNormConfig::new(d).init(device),
            head: LinearConfig::new(d, self.vocab).init(device),
        }
    }
}

impl<B: Backend> Gpt<B> {
    /// Context length the position table holds.
    pub fn max_seq(&self) -> usize {
        self.pos.weight.dims()[0]
    }
}

impl<B: FusedOps> Gpt<B> {
    /// Next-token logits `[batch, seq, vocab]` of `input` `[batch, seq]` (`seq` at most
    /// [`Gpt::max_seq`]).
    pub fn logits(&self, input: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = input.dims();
        let device = input.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let mut x = self.embed.forward(input) + self.pos.forward(positions);
        // In the compute dtype once, not per block (the blocks' casts are then no-ops).
        let bias = causal_bias::<B>(seq, &device).cast(x.dtype());
        for b in &self.blocks {
            let h = b.norm_attn.forward(x.clone());
            x = x + b.attn.forward(h, bias.clone());
            let h = b.norm_mlp.forward(x.clone());
            x = x.clone() + b.down.forward(gelu(b.up.forward(h)));
        }
        self.head.forward(self.norm.forward(x))
    }

    /// Mean next-token cross-entropy (nats) of `tokens` `[batch, seq + 1]`.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, width] = tokens.dims();
        let seq = width - 1;
        let device = tokens.device();
        let vocab = self.head.weight.dims()[1];
        let input = tokens.clone().slice([0..batch, 0..seq]);
        let target = tokens.slice([0..batch, 1..seq + 1]).reshape([batch * seq]);
        let logits = self.logits(input).reshape([batch * seq, vocab]);
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, target)
    }
}
