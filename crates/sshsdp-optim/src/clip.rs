//! Global-norm gradient clipping across shards. The norm itself is measured by the runtime at
//! every update (each rank's sum of squares in f64, gathered over the update group, whose pieces
//! make up every bucket once; see [`UpdateGroup::grad_norm`]), so every rank scales by the same
//! factor and clipping costs no collective of its own.

use sshsdp_backend::UpdateGroup;

/// Optional global-norm clipping, remembering the last norm it saw: what the sharded and
/// single-device optimizers hold.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradClip {
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub max_norm: Option<f64>,
    /// The global norm before clipping at the last step.
    pub last_norm: Option<f64>,
}

impl GradClip {
    /// Clipping to `max_norm`, or none.
    pub fn new(max_norm: Option<f64>) -> Self {
        Self {
            max_norm,
            last_norm: None,
        }
    }

    /// The factor for this update's gradients (1 without clipping), from the global norm the
    /// runtime measured over the update group. 1 without a norm yet: the verdict is read at
    /// commit, and the runtime clipped the gradients on the device already
    /// (`ShardedStep::max_grad_norm`).
    pub fn factor(&mut self, group: &UpdateGroup<'_>) -> f64 {
        match group.grad_norm() {
            Some(norm) => self.factor_for(norm),
            None => 1.0,
        }
    }

    /// The factor for a gradient of global norm `norm` (computed by the caller); remembers
    /// `norm` as the last one.
    pub fn factor_for(&mut self, norm: f64) -> f64 {
        self.last_norm = Some(norm);
        match self.max_norm {
            Some(max_norm) => clip_factor(norm, max_norm),
            None => 1.0,
        }
    }
}

/// The factor that scales a gradient of norm `norm` down to at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` computes it: `max_norm / (norm + 1e-6)`, at most 1. A NaN
/// norm gives NaN (never a silent 1) and an infinite one 0: callers must not apply either (the
/// sharded runtime never hands a non-finite gradient to an optimizer).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    let factor = max_norm / (norm + 1e-6);
    if factor >= 1.0 {
        1.0
    } else {
        factor
    }
}

#[cfg(test)]
mod tests {
    use super::clip_factor;

    #[test]
    fn clip_factor_scales_only_large_norms() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert!((clip_factor(4.0, 1.0) - 0.25).abs() < 1e-6);
    }

    #[test]
    fn clip_factor_never_hides_a_non_finite_norm() {
        assert!(clip_factor(f64::NAN, 1.0).is_nan());
        assert_eq!(clip_factor(f64::INFINITY, 1.0), 0.0);
    }
}
