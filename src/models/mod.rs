//! Models for the examples and benchmarks, written with Burn's `nn` modules and generic over
//! the backend:
//! - [`Gpt`]: a GPT-style decoder-only transformer over byte or small-vocabulary tokens;
//! - [`Dit`]: a diffusion transformer over patchified video clips (spatio-temporal tokens,
//!   adaLN-Zero timestep conditioning, noise prediction).

mod attention;
mod dit;
mod gpt;

pub use attention::{causal_bias, CausalSelfAttention};
pub use dit::{Dit, DitBlock, DitConfig};
pub use gpt::{Block, Gpt, GptConfig};
