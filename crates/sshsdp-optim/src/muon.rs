//! Muon on whole matrices: SGD momentum (Nesterov by default), Newton–Schulz
//! orthogonalisation of the update, a shape-dependent scale and decoupled weight decay.
//!
//! For a matrix `W` with gradient `G` and momentum buffer `M` (zeros before the first step):
//!
//! ```text
//! M ← μ·M + G
//! U = G + μ·M          (Nesterov)   or   U = M   (plain momentum)
//! O = newton_schulz(U, ns_steps, ns_precision)
//! W ← W·(1 − lr·wd) − lr·scale·O
//! ```
//!
//! `scale` comes from [`UpdateScale`] and the matrix's fan-in / fan-out, which depend on the
//! [`MatrixLayout`]. **Orientation:** Burn's `Linear` stores its weight as
//! `[d_input, d_output]` (`y = x W`), so by default ([`MatrixLayout::InputOutput`])
//! `fan_in = shape[0]` and `fan_out = shape[1]`. (burn-optim 0.21's `Muon` computes
//! `sqrt(max(1, shape[0]/shape[1]))`, the PyTorch `[out, in]` convention, which on a Burn
//! `Linear` weight is `fan_in/fan_out`: inverted.) Newton–Schulz itself is orientation-free
//! (`NS(Gᵀ) = NS(G)ᵀ`), so only the scale depends on the layout.
//!
//! Muon is for the 2-D hidden-layer matrices. 1-D parameters (biases, norm gains),
//! embeddings and the LM head belong to an element-wise rule such as AdamW.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::config::Config;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::{backend::Backend, Tensor};

use crate::newton_schulz::{newton_schulz, newton_schulz_batched, ns_flops, NsPrecision};

/// How the orthogonalised update is scaled before it is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum UpdateScale {
    /// `sqrt(max(1, fan_out / fan_in))` (Keller Jordan's Muon): the update's spectral norm
    /// relative to the `sqrt(fan_out / fan_in)` of a well-conditioned layer.
    #[default]
    SpectralRatio,
    /// `0.2 · sqrt(max(A, B))` for a matrix `A x B` (Moonshot, "Muon is Scalable for LLM
    /// Training"): matches the update RMS of AdamW (~0.2), so AdamW learning rates and weight
    /// decay carry over. Independent of the layout.
    MatchAdamW,
}

impl UpdateScale {
    /// The scale for a matrix with the given fan-in and fan-out.
    pub fn factor(self, fan_in: usize, fan_out: usize) -> f64 {
        match self {
            Self::SpectralRatio => (fan_out as f64 / fan_in as f64).max(1.0).sqrt(),
            Self::MatchAdamW => 0.2 * (fan_in.max(fan_out) as f64).sqrt(),
        }
    }
}

/// Which dimension of a stored matrix is the input (fan-in) and which the output (fan-out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MatrixLayout {
    /// `[d_input, d_output]`: Burn's `Linear` (`y = x W`). `fan_in = shape[0]`,
    /// `fan_out = shape[1]`.
    #[default]
    InputOutput,
    /// `[d_output, d_input]`: PyTorch's `nn.Linear` convention. `fan_in = shape[1]`,
    /// `fan_out = shape[0]`.
    OutputInput,
}

impl MatrixLayout {
    /// `(fan_in, fan_out)` of a matrix of shape `[shape[0], shape[1]]` stored in this layout.
    pub fn fans(self, shape: [usize; 2]) -> (usize, usize) {
        match self {
            Self::InputOutput => (shape[0], shape[1]),
            Self::OutputInput => (shape[1], shape[0]),
        }
    }
}

/// Configuration of [`Muon`]. Defaults follow the reference numerics of the design guide.
#[derive(Config, Debug)]
pub struct MuonConfig {
    /// Momentum factor `μ`.
    #[config(default = 0.95)]
    pub momentum: f64,
    /// Nesterov momentum: orthogonalise `G + μ·M` instead of `M`.
    #[config(default = true)]
    pub nesterov: bool,
    /// Number of Newton–Schulz iterations.
    #[config(default = 5)]
    pub ns_steps: usize,
    /// Number format of the Newton–Schulz iterations.
    #[config(default = "NsPrecision::F32")]
    pub ns_precision: NsPrecision,
    /// Decoupled weight decay `wd`: `W ← W·(1 − lr·wd)` before the update (not scaled by
    /// the update scale).
    #[config(default = 0.0)]
    pub weight_decay: f64,
    /// Scale rule of the orthogonalised update.
    #[config(default = "UpdateScale::SpectralRatio")]
    pub scale: UpdateScale,
    /// Orientation of the stored matrices (which dimension is fan-in).
    #[config(default = "MatrixLayout::InputOutput")]
    pub layout: MatrixLayout,
}

impl MuonConfig {
    /// Builds the optimizer (with fresh Newton–Schulz counters).
    pub fn init(&self) -> Muon {
        Muon {
            config: self.clone(),
            counters: Arc::default(),
        }
    }
}

/// Per-matrix state of [`Muon`]: the momentum buffer, same shape as the parameter.
#[derive(Record, Clone)]
pub struct MuonState<B: Backend, const D: usize> {
    /// Momentum buffer `M`.
    pub momentum: Tensor<B, D>,
}

/// Totals of the Newton–Schulz work done by a [`Muon`] (and its clones).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NsStats {
    /// Newton–Schulz invocations, one per matrix step.
    pub calls: u64,
    /// Their floating-point operations, by [`ns_flops`].
    pub flops: u64,
}

#[derive(Debug, Default)]
struct Counters {
    calls: AtomicU64,
    flops: AtomicU64,
}

/// Muon optimizer for 2-D matrices (see the module docs for the update rule).
///
/// Clones share the Newton–Schulz counters ([`Muon::ns_calls`], [`Muon::ns_stats`]), which
/// count every orthogonalisation this optimizer has run: a distributed driver uses them to
/// show that each matrix is orthogonalised exactly once in the world per step.
#[derive(Clone, Debug)]
pub struct Muon {
    config: MuonConfig,
    counters: Arc<Counters>,
}

impl Muon {
    /// The configuration this optimizer was built from.
    pub fn config(&self) -> &MuonConfig {
        &self.config
    }

    /// Number of Newton–Schulz invocations so far (this optimizer and its clones).
    pub fn ns_calls(&self) -> u64 {
        self.counters.calls.load(Ordering::Relaxed)
    }

    /// Newton–Schulz invocations and their flops so far (this optimizer and its clones).
    pub fn ns_stats(&self) -> NsStats {
        NsStats {
            calls: self.counters.calls.load(Ordering::Relaxed),
            flops: self.counters.flops.load(Ordering::Relaxed),
        }
    }

    /// Resets the Newton–Schulz counters to zero (for this optimizer and its clones).
    pub fn reset_ns_stats(&self) {
        self.counters.calls.store(0, Ordering::Relaxed);
        self.counters.flops.store(0, Ordering::Relaxed);
    }

    /// The update scale for a matrix of this shape, under the configured
    /// [`UpdateScale`] and [`MatrixLayout`].
    pub fn update_scale(&self, shape: [usize; 2]) -> f64 {
        let (fan_in, fan_out) = self.config.layout.fans(shape);
        self.config.scale.factor(fan_in, fan_out)
    }

    /// Newton–Schulz orthogonalisation of a momentum update with the configured steps and
    /// precision, counted in [`Muon::ns_stats`]. Distributed drivers call it on the matrix's
    /// owner only.
    pub fn orthogonalize<B: Backend>(&self, update: Tensor<B, 2>) -> Tensor<B, 2> {
        let [rows, cols] = update.dims();
        let cfg = &self.config;
        let ortho = newton_schulz(update, cfg.ns_steps, cfg.ns_precision);
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        self.counters
            .flops
            .fetch_add(ns_flops(rows, cols, cfg.ns_steps), Ordering::Relaxed);
        ortho
    }

    /// [`Muon::orthogonalize`] of a batch of same-shape updates `[batch, rows, cols]` in one
    /// batched Newton–Schulz (counted as one call per matrix in [`Muon::ns_stats`]).
    pub fn orthogonalize_batch<B: Backend>(&self, updates: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, rows, cols] = updates.dims();
        let cfg = &self.config;
        let ortho = newton_schulz_batched(updates, cfg.ns_steps, cfg.ns_precision);
        self.counters
            .calls
            .fetch_add(batch as u64, Ordering::Relaxed);
        self.counters.flops.fetch_add(
            batch as u64 * ns_flops(rows, cols, cfg.ns_steps),
            Ordering::Relaxed,
        );
        ortho
    }

    /// One Muon step of the matrix `param` with gradient `grad`; `state` is `None` at the
    /// first step (zero momentum). Returns the new parameter and state.
    ///
    /// Runs Newton–Schulz exactly once (counted in [`Muon::ns_stats`]).
    pub fn step_matrix<B: Backend>(
        &self,
        lr: LearningRate,
        param: Tensor<B, 2>,
        grad: Tensor<B, 2>,
        state: Option<MuonState<B, 2>>,
    ) -> (Tensor<B, 2>, MuonState<B, 2>) {
        let [rows, cols] = param.dims();
        assert_eq!(
            grad.dims(),
            [rows, cols],
            "Muon: gradient shape differs from the parameter's"
        );
        let cfg = &self.config;
        let mu = cfg.momentum;

        let momentum = match state {
            Some(s) => s.momentum.mul_scalar(mu).add(grad.clone()),
            None => grad.clone(),
        };
        let update = if cfg.nesterov {
            grad.add(momentum.clone().mul_scalar(mu))
        } else {
            momentum.clone()
        };

        let ortho = self.orthogonalize(update);

        let scale = self.update_scale([rows, cols]);
        let decayed = if cfg.weight_decay != 0.0 {
            param.mul_scalar(1.0 - lr * cfg.weight_decay)
        } else {
            param
        };
        let param = decayed.sub(ortho.mul_scalar(lr * scale));
        (param, MuonState { momentum })
    }
}

/// Single-device Muon through Burn's optimizer machinery (e.g. `OptimizerAdaptor`).
///
/// Only 2-D parameters are accepted: for `D == 2` this is [`Muon::step_matrix`]. **Panics**
/// for any other rank, because Muon steps 2-D matrices only; 1-D parameters (biases, norm
/// gains), embeddings and the LM head belong to an element-wise rule such as AdamW, so route
/// them to a separate optimizer.
impl<B: Backend> SimpleOptimizer<B> for Muon {
    type State<const D: usize> = MuonState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        assert!(
            D == 2,
            "Muon steps 2-D matrices only, got a {D}-D parameter: 1-D parameters (biases, norms), \
             embeddings and the LM head belong to an element-wise optimizer such as AdamW"
        );
        let dims = tensor.dims();
        let shape = [dims[0], dims[1]];
        let state = state.map(|s| MuonState {
            momentum: s.momentum.reshape(shape),
        });
        let (param, state) =
            self.step_matrix(lr, tensor.reshape(shape), grad.reshape(shape), state);
        (
            param.reshape(dims),
            Some(MuonState {
                momentum: state.momentum.reshape(dims),
            }),
        )
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        MuonState {
            momentum: state.momentum.to_device(device),
        }
    }
}
