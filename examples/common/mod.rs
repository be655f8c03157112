//! Plumbing shared by the training examples (`train_gpt`, `train_dit`): command-line options,
//! the engine (in-process threads, or one process per rank under `mpirun`), the optimizer
//! (distributed Muon for matrices + AdamW for the rest, or AdamW alone), the learning-rate
//! schedule, and the training loop with its progress bar, metrics CSV, loss curve (SVG, PNG) and
//! sharded checkpoints; `--unsharded` trains the same job on plain Burn as the baseline.
//!
//! An example describes its job as a [`Task`] (model, batches, held-out loss, what to do after
//! training) and hands it to [`run`].

mod args;
mod data;
mod launch;
mod launch_count;
mod metrics;
mod optim;
pub mod plot;
mod task;
mod train;
mod unsharded;

pub use args::*;
pub use data::*;
pub use launch::*;
pub use launch_count::*;
pub use metrics::*;
use optim::*;
pub use task::*;
use train::*;
pub(crate) use unsharded::*;

use burn::backend::Autodiff;
use sshsdp::backend::Hsdp;
use sshsdp::kernels::FusedOps;

/// A backend the examples compute on (`--backend`): any Burn backend whose default device is
/// where a rank trains, with the fused ops the models call (`sshsdp::kernels`).
pub trait Compute: FusedOps<Device: Default> {}

impl<I: FusedOps<Device: Default>> Compute for I {}

/// The CPU backend of `--backend flex` (the default): burn-flex with SIMD ran the GPT
/// example's training step 1.3× faster than NdArray at 2 ranks and 2.1× at 1 rank (see
/// `examples/train_gpt/main.rs`), although the decorator's zero-copy parameter views are specific to
/// NdArray; the models' GELU and softmax use `sshsdp::kernels`' fused ops on it.
pub type Flex = burn::backend::Flex;
/// The GPU backend of `--backend wgpu` (feature `wgpu`): burn-wgpu's `Wgpu` as Burn's users run
/// it, fusion and autotune on (Vulkan, Metal, DirectX; Mesa's lavapipe without a GPU).
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_wgpu::Wgpu;
/// `--backend wgpu --no-fusion`: CubeCL's wgpu runtime without burn-fusion (autotune on).
#[cfg(feature = "wgpu")]
pub type WgpuUnfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
/// The NVIDIA backend of `--backend cuda` (feature `cuda`): burn-cuda's `Cuda` as Burn's users
/// run it, fusion and autotune on.
#[cfg(feature = "cuda")]
pub type Cuda = burn_cuda::Cuda;
/// `--backend cuda --no-fusion`: CubeCL's CUDA runtime without burn-fusion (autotune on).
#[cfg(feature = "cuda")]
pub type CudaUnfused = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// The training backend over `I`: autodiff over the sharding decorator.
pub type Train<I> = Autodiff<Hsdp<I>>;
/// The backend of evaluation and sampling over `I`: the decorator without autodiff
/// (`model.valid()`), so forward passes that are never followed by a backward pass build no
/// graph.
pub type Eval<I> = Hsdp<I>;
