//! A small transformer language model (embedding, attention, MLP, layer norm, LM head) and its
//! data, shared by the decorator's tests.

#![allow(dead_code)]

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// The model drawn after seeding Burn's RNG with `seed`, its lazily initialised parameters
/// drawn at once in module order under the process's RNG lock (`init_seeded`), so that clones
/// share the values instead of drawing their own and no other test's draws change them.
pub fn seeded<B: Backend>(seed: u64) -> TinyLm<B> {
    sshsdp_backend::init_seeded(&Default::default(), seed, |d| TinyLm::new(d))
}

pub const VOCAB: usize = 32;
pub const D_MODEL: usize = 16;
pub const SEQ: usize = 8;

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub norm_attn: LayerNorm<B>,
    pub attn: MultiHeadAttention<B>,
    pub norm_mlp: LayerNorm<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

/// Embedding, two blocks, final norm and LM head.
#[derive(Module, Debug)]
pub struct TinyLm<B: Backend> {
    pub embed: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub norm: LayerNorm<B>,
    pub lm_head: Linear<B>,
}

impl<B: Backend> TinyLm<B> {
    pub fn new(device: &B::Device) -> Self {
        let block = || Block {
            norm_attn: LayerNormConfig::new(D_MODEL).init(device),
            attn: MultiHeadAttentionConfig::new(D_MODEL, 2)
                .with_dropout(0.0)
                .init(device),
            norm_mlp: LayerNormConfig::new(D_MODEL).init(device),
            up: LinearConfig::new(D_MODEL, 4 * D_MODEL).init(device),
            down: LinearConfig::new(4 * D_MODEL, D_MODEL).init(device),
        };
        Self {
            embed: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            blocks: vec![block(), block()],
            norm: LayerNormConfig::new(D_MODEL).init(device),
            lm_head: LinearConfig::new(D_MODEL, VOCAB).init(device),
        }
    }

    /// Mean next-token cross-entropy of `tokens` `[batch, SEQ + 1]`.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, _] = tokens.dims();
        let input = tokens.clone().slice([0..batch, 0..SEQ]);
        let target = tokens.slice([0..batch, 1..SEQ + 1]).reshape([batch * SEQ]);
        let mut x = self.embed.forward(input);
        for b in &self.blocks {
            let h = b.norm_attn.forward(x.clone());
            x = x + b.attn.forward(MhaInput::self_attn(h)).context;
            let h = b.norm_mlp.forward(x.clone());
            x = x.clone() + b.down.forward(gelu(b.up.forward(h)));
        }
        let logits = self
            .lm_head
            .forward(self.norm.forward(x))
            .reshape([batch * SEQ, VOCAB]);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, target)
    }
}

/// Deterministic token batches: `steps` batches of `batch` sequences of `SEQ + 1` tokens with a
/// learnable pattern (each token predicts the next by a fixed rule, plus noise).
pub fn batches(steps: usize, batch: usize) -> Vec<Vec<i64>> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..steps)
        .map(|_| {
            let mut out = Vec::with_capacity(batch * (SEQ + 1));
            for _ in 0..batch {
                let mut t = (next() % VOCAB as u64) as i64;
                for _ in 0..=SEQ {
                    out.push(t);
                    t = if next() % 8 == 0 {
                        (next() % VOCAB as u64) as i64
                    } else {
                        (t * 5 + 3) % VOCAB as i64
                    };
                }
            }
            out
        })
        .collect()
}

/// Rows `[first, first + count)` of a flat batch as a token tensor.
pub fn rows<B: Backend>(
    batch: &[i64],
    first: usize,
    count: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let w = SEQ + 1;
    let data = batch[first * w..(first + count) * w].to_vec();
    Tensor::from_data(TensorData::new(data, [count, w]), device)
}
