//! Fused AdamW over flat `f32` shards, in place on the parameter and both moments, with
//! burn-optim 0.21's `AdamW` semantics (no AMSGrad, no cautious weight decay):
//!
//! ```text
//! m ← β1·m + (1 − β1)·g              v ← β2·v + (1 − β2)·g²
//! m̂ = m / (1 − β1^t)                 v̂ = v / (1 − β2^t)
//! p ← p·(1 − lr·wd) − lr · m̂ / (√v̂ + eps)
//! ```
//!
//! `t` is the step count after this step (1 on the first step, where burn's fresh state
//! equals zero moments). The scalar factors are formed on the host exactly as burn forms
//! them (`f32` powers, `1 − lr·wd` in `f64`).
//!
//! Not behind `experimental`, though no training path calls it yet: the device optimizer step
//! is to be built from it (see the crate docs). Keep it un-fenced.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::{check_size, product, to_u32, KernelError};

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// Learning rate (`f64`, as Burn's `LearningRate`).
    pub lr: f64,
    /// First-moment decay `β1`.
    pub beta1: f32,
    /// Second-moment decay `β2`.
    pub beta2: f32,
    /// Denominator epsilon (added to `√v̂`).
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Step number after this step (1 for the first), for the bias corrections.
    pub step: i32,
}

impl Default for AdamWParams {
    /// Burn's `AdamWConfig` defaults (β = 0.9 / 0.999, eps 1e-5, weight decay 1e-4), lr 1e-3,
    /// first step.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-5,
            weight_decay: 1e-4,
            step: 1,
        }
    }
}

/// The per-element factors of a step, as Burn computes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWFactors {
    /// `β1`.
    pub beta1: f32,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// `β2`.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `1 − β1^t`.
    pub bias1: f32,
    /// `1 − β2^t`.
    pub bias2: f32,
    /// `eps`.
    pub eps: f32,
    /// `lr` as `f32`.
    pub lr: f32,
    /// `1 − lr·wd` (formed in `f64`).
    pub decay: f32,
}

impl AdamWParams {
    /// The factors of this step.
    pub fn factors(&self) -> AdamWFactors {
        AdamWFactors {
            beta1: self.beta1,
            one_minus_beta1: 1.0 - self.beta1,
            beta2: self.beta2,
            one_minus_beta2: 1.0 - self.beta2,
            bias1: 1f32 - self.beta1.powi(self.step),
            bias2: 1f32 - self.beta2.powi(self.step),
            eps: self.eps,
            lr: self.lr as f32,
            decay: (1.0 - self.lr * self.weight_decay as f64) as f32,
        }
    }
}

/// The fused kernel: grid-stride over `len` elements, the same operation order as Burn's
/// tensor ops.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel(
    param: &mut Array<f32>,
    grad: &Array<f32>,
    m: &mut Array<f32>,
    v: &mut Array<f32>,
    len: u32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias1: f32,
    bias2: f32,
    eps: f32,
    lr: f32,
    decay: f32,
) {
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < len {
        let idx = i as usize;
        let g = grad[idx];
        let m_new = m[idx] * beta1 + g * one_minus_beta1;
        let v_new = v[idx] * beta2 + (g * g) * one_minus_beta2;
        let delta = (m_new / bias1) / (f32::sqrt(v_new / bias2) + eps);
        param[idx] = param[idx] * decay - delta * lr;
        m[idx] = m_new;
        v[idx] = v_new;
        i += stride;
    }
}

/// One fused AdamW step over `len` elements of the flat `f32` shards `param`, `grad`, `m`,
/// `v` (`param`, `m`, `v` updated in place; zero moments before the first step).
pub fn adamw_step<R: Runtime>(
    client: &ComputeClient<R>,
    param: &Handle,
    grad: &Handle,
    m: &Handle,
    v: &Handle,
    len: usize,
    params: &AdamWParams,
) -> Result<(), KernelError> {
    if len == 0 {
        return Ok(());
    }
    let bytes = product("len", &[len, 4])?;
    for (what, h) in [("param", param), ("grad", grad), ("m", m), ("v", v)] {
        check_size(what, h, bytes)?;
    }
    let len32 = to_u32("len", len as u64)?;
    let f = params.factors();
    let cubes = (len as u64).div_ceil(256).clamp(1, 65_535) as u32;
    // SAFETY: every index is below `len`, checked against all four handles above.
    unsafe {
        adamw_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(param.clone(), len),
            ArrayArg::from_raw_parts(grad.clone(), len),
            ArrayArg::from_raw_parts(m.clone(), len),
            ArrayArg::from_raw_parts(v.clone(), len),
            len32,
            f.beta1,
            f.one_minus_beta1,
            f.beta2,
            f.one_minus_beta2,
            f.bias1,
            f.bias2,
            f.eps,
            f.lr,
            f.decay,
        );
    }
    Ok(())
}

/// CPU reference of [`adamw_step`] (Burn's formula, element by element).
pub fn adamw_reference(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    params: &AdamWParams,
) {
    let f = params.factors();
    for i in 0..param.len() {
        let g = grad[i];
        m[i] = m[i] * f.beta1 + g * f.one_minus_beta1;
        v[i] = v[i] * f.beta2 + (g * g) * f.one_minus_beta2;
        let delta = (m[i] / f.bias1) / ((v[i] / f.bias2).sqrt() + f.eps);
        param[i] = param[i] * f.decay - delta * f.lr;
    }
}
