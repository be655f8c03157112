//! The examples' optimizers (distributed Muon + AdamW, or AdamW alone) and learning-rate schedule.

use std::path::Path;

use burn::module::Module;
use burn::optim::{AdamW, AdamWConfig};
use sshsdp::backend::{HsdpError, HsdpRuntime};
use sshsdp::checkpoint::{self, PieceStates};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::{MuonConfig, MuonExchange, ShardedMuon, UpdateScale};

use super::*;
use sshsdp::optim::ShardedStep;

/// The optimizer of a run on backend `I`.
pub(crate) enum Optim<I: Compute> {
    // Boxed: the two differ in size by hundreds of bytes.
    Muon(Box<ShardedMuon<I, AdamW>>),
    AdamW(Box<ShardedOptimizer<I, AdamW>>),
}

impl<I: Compute> Optim<I> {
    pub(crate) fn new(
        kind: OptimKind,
        exchange: MuonExchange,
        clip: Option<f64>,
        device: &I::Device,
    ) -> Self {
        let adamw = adamw_config().build();
        match kind {
            OptimKind::Muon => {
                // Moonshot's scale matches AdamW's update RMS, so one learning rate serves
                // both optimizers.
                let muon = MuonConfig::new()
                    .with_scale(UpdateScale::MatchAdamW)
                    .with_weight_decay(0.01)
                    .init();
                let mut o = ShardedMuon::new(muon, adamw, device.clone()).with_exchange(exchange);
                if let Some(c) = clip {
                    o = o.with_grad_clipping(c);
                }
                Optim::Muon(Box::new(o))
            }
            OptimKind::AdamW => {
                let mut o = ShardedOptimizer::new(adamw, device.clone());
                if let Some(c) = clip {
                    o = o.with_grad_clipping(c);
                }
                Optim::AdamW(Box::new(o))
            }
        }
    }

    pub(crate) fn step<M: Module<Train<I>>>(
        &mut self,
        lr: f64,
        model: M,
        runtime: &HsdpRuntime<I>,
    ) -> Result<M, HsdpError> {
        match self {
            Optim::Muon(o) => o.step(lr, model, runtime),
            Optim::AdamW(o) => o.step(lr, model, runtime),
        }
    }

    /// The optimizer's own reads of device values and uploads since the last call.
    pub(crate) fn take_host_traffic(&self) -> sshsdp::optim::HostTraffic {
        match self {
            Optim::Muon(o) => o.take_host_traffic(),
            Optim::AdamW(o) => o.take_host_traffic(),
        }
    }

    pub(crate) fn last_grad_norm(&self) -> Option<f64> {
        match self {
            Optim::Muon(o) => o.last_grad_norm(),
            Optim::AdamW(o) => o.last_grad_norm(),
        }
    }

    pub(crate) fn save(
        &mut self,
        dir: &Path,
        runtime: &HsdpRuntime<I>,
        step: u64,
    ) -> Result<(), String> {
        let r = match self {
            Optim::Muon(o) => checkpoint::save(dir, runtime, &**o, step),
            Optim::AdamW(o) => checkpoint::save(dir, runtime, &PieceStates::new(o), step),
        };
        r.map(|_| ())
            .map_err(|e| format!("saving to {}: {e}", dir.display()))
    }

    pub(crate) fn load(&mut self, dir: &Path, runtime: &HsdpRuntime<I>) -> Result<u64, String> {
        let r = match self {
            Optim::Muon(o) => checkpoint::load(dir, runtime, &mut **o),
            Optim::AdamW(o) => checkpoint::load(dir, runtime, &mut PieceStates::new(o)),
        };
        r.map_err(|e| format!("resuming from {}: {e}", dir.display()))
    }
}

/// The examples' AdamW (the elementwise optimizer of both kinds, and `--unsharded`'s).
pub(crate) fn adamw_config() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.01)
}

/// Learning rate at `step` of a run ending at `last`: linear warm-up over `warmup` steps from
/// the start of training, then cosine decay to 10 % at `last`.
pub fn learning_rate(peak: f64, warmup: usize, step: usize, last: usize) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = last.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}
