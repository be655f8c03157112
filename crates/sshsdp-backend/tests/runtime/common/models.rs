//! Small burn-nn models (widths ≤ 32) and their deterministic data (no draw from Burn's RNG
//! but the seeded initial weights, under its lock). The sharded model and the unsharded
//! reference are clones of one module drawn once.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp_backend::init_seeded;

use super::{B as Hb, P};

/// Token vocabulary of [`Net`].
pub const VOCAB: usize = 32;
/// Model width of [`Net`]: 32, so that its 32×32 matrices are whole MXFP8 tiles.
pub const D: usize = 32;
/// Classes [`Net`] predicts.
pub const CLASSES: usize = 8;
/// Tokens per row.
pub const SEQ: usize = 4;
/// Rows of a global batch: divisible by every world size tested (1, 2, 3, 4).
pub const GLOBAL: usize = 12;

/// An embedding, a layer norm and two `Linear`s with a residual: matrices that MXFP8 holds
/// (`embed.weight` 32×32, `up.weight` 32×32) and parameters that fall back to bf16 (vectors,
/// `down.weight` 32×8).
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub embed: Embedding<B>,
    pub norm: LayerNorm<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

impl<B: Backend> Net<B> {
    /// The module, its parameters lazy.
    pub fn new(device: &B::Device) -> Self {
        Self {
            embed: EmbeddingConfig::new(VOCAB, D).init(device),
            norm: LayerNormConfig::new(D).init(device),
            up: LinearConfig::new(D, D).init(device),
            down: LinearConfig::new(D, CLASSES).init(device),
        }
    }

    /// Mean cross-entropy over rows `rows` of `step`'s global batch.
    pub fn loss(&self, step: usize, rows: Range<usize>) -> Tensor<B, 1> {
        let device = self.up.weight.device();
        let (tokens, targets) = net_batch(step, rows.clone());
        let n = rows.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [n, SEQ]), &device);
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [n * SEQ]), &device);
        let x = self.embed.forward(tokens);
        let h = gelu(self.up.forward(self.norm.forward(x.clone()))) + x;
        let logits = self.down.forward(h).reshape([n * SEQ, CLASSES]);
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, targets)
    }
}

/// Tokens and targets of rows `rows` of `step`'s global batch (xorshift, no RNG of Burn's).
pub fn net_batch(step: usize, rows: Range<usize>) -> (Vec<i64>, Vec<i64>) {
    let mut tokens = Vec::new();
    let mut targets = Vec::new();
    for row in rows {
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (((step as u64) << 32) | (row as u64 + 1));
        for _ in 0..SEQ {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let t = (state % VOCAB as u64) as i64;
            tokens.push(t);
            targets.push((t * 5 + 3 + (state >> 40) as i64 % 2) % CLASSES as i64);
        }
    }
    (tokens, targets)
}

/// The plain [`Net`] drawn from `seed` (under Burn's RNG lock, every parameter at once).
pub fn plain_net(seed: u64) -> Net<P> {
    init_seeded(&Default::default(), seed, Net::new)
}

/// `plain` to be sharded (the same backend: a clone sharing its values).
pub fn sharded_net(plain: &Net<P>) -> Net<Hb> {
    plain.clone()
}

/// Width of [`Branchy`].
pub const WIDTH: usize = 8;

/// Four `Linear`s: `frozen` never trains (`no_grad`), `odd` joins the graph only where asked.
#[derive(Module, Debug)]
pub struct Branchy<B: Backend> {
    pub first: Linear<B>,
    pub frozen: Linear<B>,
    pub odd: Linear<B>,
    pub head: Linear<B>,
}

impl<B: Backend> Branchy<B> {
    pub fn new(device: &B::Device) -> Self {
        let linear = || LinearConfig::new(WIDTH, WIDTH).init(device);
        Self {
            first: linear(),
            frozen: linear().no_grad(),
            odd: linear(),
            head: linear(),
        }
    }

    /// Mean square of the output for rows `rows` of `step`'s inputs, through `odd` if
    /// `use_odd`; `poison` is added to every input (NaN makes every gradient NaN).
    pub fn loss(
        &self,
        step: usize,
        rows: Range<usize>,
        use_odd: bool,
        poison: f32,
    ) -> Tensor<B, 1> {
        let device = self.head.weight.device();
        let n = rows.len();
        let x: Vec<f32> = rows
            .flat_map(|r| {
                (0..WIDTH).map(move |c| (((r * 7 + c * 3 + step * 13) % 17) as f32 - 8.0) / 8.0)
            })
            .map(|v| v + poison)
            .collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(x, [n, WIDTH]), &device);
        let mut h = self.first.forward(x).tanh();
        h = h.clone() + self.frozen.forward(h).tanh();
        if use_odd {
            h = h.clone() + self.odd.forward(h).tanh();
        }
        self.head.forward(h).powi_scalar(2).mean()
    }
}

/// The plain [`Branchy`] drawn from `seed`.
pub fn plain_branchy(seed: u64) -> Branchy<P> {
    init_seeded(&Default::default(), seed, Branchy::new)
}

/// `plain` to be sharded (`frozen` stays frozen).
pub fn sharded_branchy(plain: &Branchy<P>) -> Branchy<Hb> {
    plain.clone()
}

/// A 32×32 matrix and a 32-vector whose loss is the sum of their elements: every gradient
/// element is exactly 1 on every rank (so the world average is exactly 1).
#[derive(Module, Debug)]
pub struct Plane<B: Backend> {
    pub w: Param<Tensor<B, 2>>,
    pub v: Param<Tensor<B, 1>>,
}

impl<B: Backend> Plane<B> {
    /// Values near 1 with varied low bits (not bf16 numbers).
    pub fn new(device: &B::Device) -> Self {
        let value = |i: usize| 0.75 + (i % 29) as f32 / 64.0 + (i % 5) as f32 * 1e-4;
        let w: Vec<f32> = (0..D * D).map(value).collect();
        let v: Vec<f32> = (0..D).map(|i| value(i + 3)).collect();
        Self {
            w: Param::from_tensor(Tensor::from_data(TensorData::new(w, [D, D]), device)),
            v: Param::from_tensor(Tensor::from_data(TensorData::new(v, [D]), device)),
        }
    }

    /// The sum of every element.
    pub fn loss(&self) -> Tensor<B, 1> {
        self.w.val().sum() + self.v.val().sum()
    }
}
