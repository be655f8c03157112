//! Causal multi-head self-attention for [`Gpt`](super::Gpt).
//!
//! The parameters, their initialisation (in the same order, so the same draws) and the math of
//! Burn's `MultiHeadAttention` with an autoregressive `mask_attn`, with one difference in how
//! the mask is applied: Burn fills the masked scores with −1e4 (`mask_fill` with a
//! `[batch, 1, seq, seq]` mask); this module adds a `[1, 1, seq, seq]` bias of 0 and −1e4.
//! After softmax both give exactly 0 at masked positions (their exponent is ~−1e4 below the
//! row's maximum, far past f32's underflow), and the gradient reaching a masked score is 0
//! either way (softmax's gradient there is its weight, 0, times something finite), so training
//! is unchanged. The bias is cheaper on CPU backends: burn-flex's `mask_fill` broadcasts the
//! mask to every head and copies it into a contiguous buffer through a strided iterator, in
//! forward and again in backward — 11 % of `train_gpt`'s step on burn-flex (measured with
//! `perf`); a broadcast add is one vectorised pass, and its backward is the gradient itself.
//! The bias is flattened to `[1, 1, seq·seq]` and added to the scores viewed as
//! `[batch, heads, seq·seq]` (a free reshape of the matmul's contiguous output): burn-flex
//! vectorises a broadcast whose rhs is one contiguous row shared by every outer index, and a
//! `[1, 1, seq, seq]` bias is not one (it takes the scalar strided path, as slow as the mask).

use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor};

use crate::kernels::{softmax, FusedOps};

/// The score Burn's `MultiHeadAttention` gives masked positions (its `min_float` default).
const MASKED_SCORE: f32 = -1.0e4;

/// Causal multi-head self-attention: query, key, value and output projections of
/// `d_model × d_model`, scaled dot-product attention over `heads` heads.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    output: Linear<B>,
    heads: usize,
}

impl<B: Backend> CausalSelfAttention<B> {
    /// Fresh projections on `device`, initialised as Burn's `MultiHeadAttentionConfig` does
    /// (Kaiming uniform with gain 1/√3: U(−1/√d, 1/√d)), in the order query, key, value,
    /// output. `heads` must divide `d_model`.
    pub fn new(d_model: usize, heads: usize, device: &B::Device) -> Self {
        assert!(
            heads > 0 && d_model % heads == 0,
            "{heads} heads do not divide width {d_model}"
        );
        let linear = || {
            LinearConfig::new(d_model, d_model)
                .with_initializer(projection_initializer())
                .init(device)
        };
        Self {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            heads,
        }
    }
}

impl<B: FusedOps> CausalSelfAttention<B> {
    /// Attends `x` `[batch, seq, d_model]` to itself under `bias` (from [`causal_bias`]), giving
    /// `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>, bias: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, d_model] = x.dims();
        let d_head = d_model / self.heads;
        let heads = |linear: &Linear<B>| {
            linear
                .forward(x.clone())
                .reshape([batch, seq, self.heads, d_head])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (heads(&self.query), heads(&self.key), heads(&self.value));
        let scores = q
            .matmul(k.transpose())
            .div_scalar((d_head as f32).sqrt())
            .reshape([batch, self.heads, seq * seq]);
        // The bias in the scores' dtype (bf16 or f16 under 16-bit compute); a no-op when the
        // caller already made it so, as `Gpt` does once per forward.
        let dtype = scores.dtype();
        let scores = scores + bias.cast(dtype);
        let context = softmax(scores.reshape([batch, self.heads, seq, seq]))
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([batch, seq, d_model]);
        self.output.forward(context)
    }
}

/// Burn's `MultiHeadAttentionConfig` default: Kaiming uniform with gain 1/√3, U(−1/√d, 1/√d).
fn projection_initializer() -> Initializer {
    Initializer::KaimingUniform {
        gain: 1.0 / 3f64.sqrt(),
        fan_out_only: false,
    }
}

/// The causal mask as an additive bias, flattened to `[1, 1, seq·seq]`: row `i` of the
/// `seq × seq` matrix is 0 where query `i` may attend (itself and earlier keys), −1e4 after.
pub fn causal_bias<B: Backend>(seq: usize, device: &B::Device) -> Tensor<B, 3> {
    let later = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, device);
    Tensor::<B, 2>::zeros([seq, seq], device)
        .mask_fill(later, MASKED_SCORE)
        .reshape([1, 1, seq * seq])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::module::{ModuleVisitor, Param};
    use burn::nn::attention::{generate_autoregressive_mask, MhaInput, MultiHeadAttentionConfig};
    use burn::tensor::Distribution;

    // The decorator with nothing registered: Burn's `distributed` feature (on in this
    // workspace) lets only a `DistributedBackend` run backward, and `Hsdp` is one.
    type B = Autodiff<crate::backend::Hsdp<NdArray>>;

    /// Initialises every (lazy) parameter of a module.
    struct Materialise;

    impl ModuleVisitor<B> for Materialise {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }

    /// The same outputs and gradients as Burn's `MultiHeadAttention` with an autoregressive
    /// mask, over the same parameters (its own, cloned: Burn's RNG is process-global and other
    /// tests draw from it concurrently, so two seeded initialisations would race).
    #[test]
    fn matches_burns_multi_head_attention_with_a_causal_mask() {
        let device = Default::default();
        let (batch, seq, d, heads) = (2, 7, 16, 4);
        let burns = MultiHeadAttentionConfig::new(d, heads)
            .with_dropout(0.0)
            .init::<B>(&device);
        // Initialise Burn's lazy parameters once, so that the clones share their values.
        burns.visit(&mut Materialise);
        let ours = CausalSelfAttention {
            query: burns.query.clone(),
            key: burns.key.clone(),
            value: burns.value.clone(),
            output: burns.output.clone(),
            heads,
        };
        let x = sshsdp_backend::with_burn_rng(|| {
            Tensor::<B, 3>::random([batch, seq, d], Distribution::Default, &device)
        });
        let a = ours.forward(x.clone(), causal_bias(seq, &device));
        let mask = generate_autoregressive_mask::<B>(batch, seq, &device);
        let b = burns
            .forward(MhaInput::self_attn(x).mask_attn(mask))
            .context;
        // Bit for bit: unmasked scores get + 0.0, masked ones underflow to 0 either way.
        assert_eq!(a.to_data(), b.to_data());
        let (ga, gb) = (a.sum().backward(), b.sum().backward());
        let grad = |w: &Tensor<B, 2>, grads| w.grad(grads).unwrap().into_data();
        for (o, t) in [
            (&ours.query, &burns.query),
            (&ours.key, &burns.key),
            (&ours.value, &burns.value),
            (&ours.output, &burns.output),
        ] {
            assert_eq!(grad(&o.weight.val(), &ga), grad(&t.weight.val(), &gb));
        }
    }

    /// The projections are initialised as Burn's `MultiHeadAttentionConfig` does by default
    /// (with the same draws in the same order, `train_gpt`'s losses are unchanged by this module).
    #[test]
    fn initialises_like_burns_multi_head_attention() {
        assert_eq!(
            format!("{:?}", projection_initializer()),
            format!("{:?}", MultiHeadAttentionConfig::new(16, 4).initializer)
        );
    }
}
