//! A diffusion transformer (DiT, Peebles & Xie 2023) over patchified video clips.
//!
//! A clip `[frames, channels, height, width]` is cut into `patch × patch` squares per frame;
//! every square of every frame is one token (spatio-temporal tokens, full attention over all of
//! them). The model predicts the noise `ε` added to a clean clip `x₀` at diffusion time
//! `t ∈ [0, 1]` under the cosine schedule `ᾱ(t) = cos²(π/2 · (t + s) / (1 + s))`, `s = 0.008`
//! (Nichol & Dhariwal 2021): `x_t = √ᾱ·x₀ + √(1 − ᾱ)·ε`. The timestep conditions every block
//! through adaLN-Zero: a sinusoidal embedding of `t` goes through an MLP, and each block
//! regresses from it the shift, scale and gate of its two sub-layers, the modulation layers
//! starting at zero so that every block starts as the identity.

use std::f64::consts::PI;

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use crate::kernels::{gelu, FusedOps};

/// Offset `s` of the cosine noise schedule.
const SCHEDULE_OFFSET: f64 = 0.008;

/// Shape of the clips and sizes of a [`Dit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DitConfig {
    /// Frames per clip.
    pub frames: usize,
    /// Channels per frame.
    pub channels: usize,
    /// Frame height in pixels (a multiple of `patch`).
    pub height: usize,
    /// Frame width in pixels (a multiple of `patch`).
    pub width: usize,
    /// Side of the square patches.
    pub patch: usize,
    /// Model width.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
}

/// One DiT block: pre-norm self-attention and a GELU MLP, each modulated (shift, scale) and
/// gated by the timestep through `ada`.
#[derive(Module, Debug)]
pub struct DitBlock<B: Backend> {
    norm_attn: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    norm_mlp: LayerNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
    /// `[d, 6d]`: shift, scale, gate of attention, then of the MLP (zero at init).
    ada: Linear<B>,
}

/// Patch and position embeddings, timestep MLP, DiT blocks and the adaLN-modulated head.
#[derive(Module, Debug)]
pub struct Dit<B: Backend> {
    patch_embed: Linear<B>,
    pos_embed: Embedding<B>,
    time_in: Linear<B>,
    time_out: Linear<B>,
    blocks: Vec<DitBlock<B>>,
    norm_out: LayerNorm<B>,
    /// `[d, 2d]`: shift and scale of the final norm (zero at init).
    ada_out: Linear<B>,
    /// `[d, patch_dim]`: predicted noise per patch (zero at init).
    head: Linear<B>,
}

impl DitConfig {
    /// Tokens per clip: frames × patches per frame.
    pub fn tokens(&self) -> usize {
        self.frames * (self.height / self.patch) * (self.width / self.patch)
    }

    /// Values per token: channels × patch².
    pub fn patch_dim(&self) -> usize {
        self.channels * self.patch * self.patch
    }

    /// Values per clip.
    pub fn clip_len(&self) -> usize {
        self.frames * self.channels * self.height * self.width
    }

    /// Checks that the frame divides into patches and the width into heads.
    pub fn validate(&self) -> Result<(), String> {
        if self.patch == 0 || self.height % self.patch != 0 || self.width % self.patch != 0 {
            return Err(format!(
                "a {}x{} frame does not divide into {}x{} patches",
                self.height, self.width, self.patch, self.patch
            ));
        }
        if self.heads == 0 || self.d_model % self.heads != 0 {
            return Err(format!(
                "width {} does not split into {} heads",
                self.d_model, self.heads
            ));
        }
        if self.d_model % 2 != 0 {
            return Err("the width must be even (sinusoidal timestep features)".into());
        }
        Ok(())
    }

    /// A model with freshly initialised weights on `device` (modulation layers and the head at
    /// zero, so the untrained model predicts no noise).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Dit<B> {
        let d = self.d_model;
        let zero = |i, o| {
            LinearConfig::new(i, o)
                .with_initializer(Initializer::Zeros)
                .init(device)
        };
        Dit {
            patch_embed: LinearConfig::new(self.patch_dim(), d).init(device),
            pos_embed: EmbeddingConfig::new(self.tokens(), d).init(device),
            time_in: LinearConfig::new(d, d).init(device),
            time_out: LinearConfig::new(d, d).init(device),
            blocks: (0..self.layers)
                .map(|_| DitBlock {
                    norm_attn: LayerNormConfig::new(d).init(device),
                    attn: MultiHeadAttentionConfig::new(d, self.heads)
                        .with_dropout(0.0)
                        .init(device),
                    norm_mlp: LayerNormConfig::new(d).init(device),
                    up: LinearConfig::new(d, 4 * d).init(device),
                    down: LinearConfig::new(4 * d, d).init(device),
                    ada: zero(d, 6 * d),
                })
                .collect(),
            norm_out: LayerNormConfig::new(d).init(device),
            ada_out: zero(d, 2 * d),
            head: zero(d, self.patch_dim()),
        }
    }

    /// Clips `[n][frames][channels][height][width]` (row-major, `n` clips) as tokens
    /// `[n][tokens][patch_dim]`: frame-major, then patch rows, patch columns; within a token
    /// channel-major, then pixel rows.
    pub fn patchify(&self, clips: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; clips.len()];
        self.for_each_pixel(clips.len(), |clip_index, token_index| {
            out[token_index] = clips[clip_index];
        });
        out
    }

    /// The inverse of [`DitConfig::patchify`].
    pub fn unpatchify(&self, tokens: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; tokens.len()];
        self.for_each_pixel(tokens.len(), |clip_index, token_index| {
            out[clip_index] = tokens[token_index];
        });
        out
    }

    /// Calls `f(clip layout index, token layout index)` for every value of `len / clip_len`
    /// clips.
    fn for_each_pixel(&self, len: usize, mut f: impl FnMut(usize, usize)) {
        let (c, h, w, p) = (self.channels, self.height, self.width, self.patch);
        let (ph, pw) = (h / p, w / p);
        for n in 0..len / self.clip_len() {
            for fr in 0..self.frames {
                for ch in 0..c {
                    for y in 0..h {
                        for x in 0..w {
                            let clip = (((n * self.frames + fr) * c + ch) * h + y) * w + x;
                            let token = (n * self.frames + fr) * ph * pw + (y / p) * pw + x / p;
                            let within = (ch * p + y % p) * p + x % p;
                            f(clip, token * self.patch_dim() + within);
                        }
                    }
                }
            }
        }
    }
}

/// `ᾱ(t)` of the cosine schedule, elementwise.
fn alpha_bar<B: Backend>(t: Tensor<B, 1>) -> Tensor<B, 1> {
    let s = SCHEDULE_OFFSET;
    ((t + s) * (PI / 2.0 / (1.0 + s))).cos().powi_scalar(2)
}

/// `ᾱ(t)` of the cosine schedule for one `t`.
pub fn alpha_bar_scalar(t: f64) -> f64 {
    let s = SCHEDULE_OFFSET;
    ((t + s) / (1.0 + s) * PI / 2.0).cos().powi(2)
}

/// `x * (1 + scale) + shift` with `scale` and `shift` `[batch, d]` broadcast over tokens.
fn modulate<B: Backend>(x: Tensor<B, 3>, shift: Tensor<B, 2>, scale: Tensor<B, 2>) -> Tensor<B, 3> {
    x * (scale.unsqueeze_dim::<3>(1) + 1.0) + shift.unsqueeze_dim(1)
}

impl<B: FusedOps> Dit<B> {
    /// Sinusoidal features `[batch, d]` of `t` `[batch]` (scaled to 0..1000 as in DDPM).
    fn time_features(&self, t: Tensor<B, 1>) -> Tensor<B, 2> {
        let d = self.time_in.weight.dims()[0];
        let half = d / 2;
        let freqs: Vec<f32> = (0..half)
            .map(|i| (-(10_000f64.ln()) * i as f64 / half as f64).exp() as f32)
            .collect();
        let freqs = Tensor::<B, 1>::from_data(TensorData::new(freqs, [half]), &t.device());
        let args = (t * 1000.0).unsqueeze_dim::<2>(1) * freqs.unsqueeze_dim(0);
        Tensor::cat(vec![args.clone().sin(), args.cos()], 1)
    }

    /// The dtype the parameters compute in (f32, or a 16-bit dtype under a mixed-precision
    /// policy): float inputs are cast to it, as FSDP2's `cast_forward_inputs` does.
    pub fn compute_dtype(&self) -> DType {
        self.patch_embed.weight.val().dtype()
    }

    /// Predicted noise `[batch, tokens, patch_dim]` of noisy tokens `x` (same shape) at
    /// diffusion times `t` `[batch]`, in [`Self::compute_dtype`].
    pub fn forward(&self, x: Tensor<B, 3>, t: Tensor<B, 1>) -> Tensor<B, 3> {
        let dtype = self.compute_dtype();
        let x = x.cast(dtype);
        let [batch, tokens, _] = x.dims();
        let device = x.device();
        let positions = Tensor::<B, 1, Int>::arange(0..tokens as i64, &device)
            .reshape([1, tokens])
            .repeat_dim(0, batch);
        let mut h = self.patch_embed.forward(x) + self.pos_embed.forward(positions);
        let c = self
            .time_out
            // Time features in the input's precision (f32: t · 1000 needs more than bf16's 8
            // bits), then cast.
            .forward(silu(
                self.time_in.forward(self.time_features(t).cast(dtype)),
            ));
        let c = silu(c);
        for b in &self.blocks {
            let m = b.ada.forward(c.clone()).chunk(6, 1);
            let [shift_a, scale_a, gate_a, shift_m, scale_m, gate_m] =
                <[Tensor<B, 2>; 6]>::try_from(m).expect("six modulation chunks");
            let a = modulate(b.norm_attn.forward(h.clone()), shift_a, scale_a);
            let a = b.attn.forward(MhaInput::self_attn(a)).context;
            h = h + a * gate_a.unsqueeze_dim(1);
            let m = modulate(b.norm_mlp.forward(h.clone()), shift_m, scale_m);
            let m = b.down.forward(gelu(b.up.forward(m)));
            h = h + m * gate_m.unsqueeze_dim(1);
        }
        let m = self.ada_out.forward(c).chunk(2, 1);
        let [shift, scale] = <[Tensor<B, 2>; 2]>::try_from(m).expect("two modulation chunks");
        self.head
            .forward(modulate(self.norm_out.forward(h), shift, scale))
    }

    /// Mean squared error of the noise prediction for clean tokens `x0`, times `t` `[batch]`
    /// and noise `noise` (shaped as `x0`).
    pub fn loss(&self, x0: Tensor<B, 3>, t: Tensor<B, 1>, noise: Tensor<B, 3>) -> Tensor<B, 1> {
        let ab = alpha_bar(t.clone())
            .unsqueeze_dim::<2>(1)
            .unsqueeze_dim::<3>(2);
        let xt = x0 * ab.clone().sqrt() + noise.clone() * (ab.neg() + 1.0).sqrt();
        // The loss in the inputs' dtype (f32), whatever the compute dtype.
        let pred = self.forward(xt, t).cast(noise.dtype());
        (pred - noise).powi_scalar(2).mean()
    }

    /// Deterministic DDIM sampling (η = 0) from pure noise `noise` `[batch, tokens,
    /// patch_dim]` in `steps` steps from `t = 1` to `t = 0`; returns clean tokens, clamped to
    /// `[-1, 1]` (the data range).
    pub fn sample(&self, noise: Tensor<B, 3>, steps: usize) -> Tensor<B, 3> {
        let [batch, _, _] = noise.dims();
        let device = noise.device();
        let mut x = noise;
        for i in (1..=steps.max(1)).rev() {
            let t = i as f64 / steps.max(1) as f64;
            let t_prev = (i - 1) as f64 / steps.max(1) as f64;
            let (ab, ab_prev) = (alpha_bar_scalar(t).max(1e-4), alpha_bar_scalar(t_prev));
            let tt = Tensor::<B, 1>::full([batch], t as f32, &device);
            let eps = self.forward(x.clone(), tt).cast(x.dtype());
            let x0 = ((x - eps.clone() * (1.0 - ab).sqrt()) / ab.sqrt()).clamp(-1.0, 1.0);
            x = x0 * ab_prev.sqrt() + eps * (1.0 - ab_prev).max(0.0).sqrt();
        }
        x.clamp(-1.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patchify_round_trips_and_groups_patches() {
        let cfg = DitConfig {
            frames: 2,
            channels: 2,
            height: 4,
            width: 6,
            patch: 2,
            d_model: 8,
            layers: 1,
            heads: 2,
        };
        cfg.validate().unwrap();
        let clips: Vec<f32> = (0..2 * cfg.clip_len()).map(|i| i as f32).collect();
        let tokens = cfg.patchify(&clips);
        assert_eq!(cfg.unpatchify(&tokens), clips);
        // Token 1 of clip 0 is frame 0's patch at row 0, column 1: pixels x = 2..4, y = 0..2.
        let t1 = &tokens[cfg.patch_dim()..2 * cfg.patch_dim()];
        assert_eq!(&t1[..4], &[2.0, 3.0, 8.0, 9.0]);
        assert_eq!(t1[4], 24.0 + 2.0); // channel 1 starts 24 values later
    }

    #[test]
    fn untrained_model_predicts_no_noise_and_samples_in_range() {
        use burn::backend::NdArray;
        type B = NdArray<f32>;
        let cfg = DitConfig {
            frames: 2,
            channels: 1,
            height: 8,
            width: 8,
            patch: 4,
            d_model: 16,
            layers: 2,
            heads: 2,
        };
        let device = Default::default();
        let model: Dit<B> = cfg.init(&device);
        let shape = [3, cfg.tokens(), cfg.patch_dim()];
        let x0 = Tensor::<B, 3>::ones(shape, &device) * 0.5;
        let noise = Tensor::<B, 3>::ones(shape, &device) * 2.0;
        let t = Tensor::<B, 1>::from_floats([0.1, 0.5, 0.9], &device);
        // The zero-initialised head predicts 0, so the loss is the mean of noise².
        let loss: f32 = model.loss(x0, t, noise.clone()).into_scalar();
        assert!((loss - 4.0).abs() < 1e-5, "{loss}");
        let sample = model.sample(noise, 4);
        assert_eq!(sample.dims(), shape);
        let max: f32 = sample.abs().max().into_scalar();
        assert!(max <= 1.0);
    }

    #[test]
    fn schedule_runs_from_clean_to_noise() {
        assert!((alpha_bar_scalar(0.0) - 1.0).abs() < 1e-3);
        assert!(alpha_bar_scalar(1.0) < 1e-6);
        assert!(alpha_bar_scalar(0.3) > alpha_bar_scalar(0.6));
    }
}
