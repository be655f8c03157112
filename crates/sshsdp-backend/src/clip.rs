//! Global-norm gradient clipping across shards: each rank sums the squares of its pieces'
//! gradients, one all-reduce over the update group (whose pieces make up every bucket once)
//! gives the global squared norm, and every rank scales by the same factor.

use crate::runtime::{Piece, UpdateGroup};
use crate::HsdpError;

/// The L2 norm of the whole model's gradient (padding gradients are zero).
pub fn global_grad_norm(pieces: &[Piece<'_>], group: &UpdateGroup<'_>) -> Result<f64, HsdpError> {
    let local: f64 = pieces
        .iter()
        .flat_map(|p| p.grad.iter())
        .map(|&g| f64::from(g) * f64::from(g))
        .sum();
    // f32 on the wire: the sum is exact enough for a clipping threshold.
    let total = group.all_reduce_sum(vec![local as f32])?;
    Ok(f64::from(total[0]).sqrt())
}

/// Optional global-norm clipping, remembering the last norm it measured: what the sharded and
/// single-device optimizers hold.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradClip {
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub max_norm: Option<f64>,
    /// The global norm before clipping at the last step (when clipping is on).
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

    /// The factor for this step's gradients (1 without clipping), measuring the global norm
    /// over the update group when clipping is on.
    pub fn factor(
        &mut self,
        pieces: &[Piece<'_>],
        group: &UpdateGroup<'_>,
    ) -> Result<f64, HsdpError> {
        match self.max_norm {
            Some(_) => Ok(self.factor_for(global_grad_norm(pieces, group)?)),
            None => Ok(1.0),
        }
    }

    /// The factor for a gradient of global norm `norm` (computed by the caller).
    pub fn factor_for(&mut self, norm: f64) -> f64 {
        match self.max_norm {
            Some(max_norm) => {
                self.last_norm = Some(norm);
                clip_factor(norm, max_norm)
            }
            None => 1.0,
        }
    }
}

/// The factor that scales a gradient of norm `norm` down to at most `max_norm` (1 when it is
/// already within it), as `torch.nn.utils.clip_grad_norm_` computes it.
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::clip_factor;

    #[test]
    fn clip_factor_scales_only_large_norms() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert!((clip_factor(4.0, 1.0) - 0.25).abs() < 1e-6);
    }
}
