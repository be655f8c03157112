//! Watches how many handles to this runtime's parameters are alive, to warn about forward
//! passes on an autodiff model that never run backward.
//!
//! Burn's autodiff keeps each forward's graph, and every parameter it saved for backward, until
//! a backward runs (its clean-up of orphaned graphs only runs after one), so an evaluation loop
//! on an `Autodiff<Hsdp<B>>` module grows memory with every batch. The runtime cannot see a
//! "forward pass", but it sees the graphs' copies of its parameter handles: each handle is
//! counted while it lives. A training step keeps about one forward's worth (the module's own
//! handles plus what one graph saved); forwards without backward keep one more graph's worth
//! each. When the live count passes a limit, the runtime warns once (through `log`, or on
//! standard error when no logger is installed), naming the cause and the fix
//! (`model.valid()`). Evaluation on `model.valid()` runs on the inner backend's graph-free
//! tensors and saves no handles.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Forwards' worth of graph-held handles tolerated once a backward has shown what one step's
/// graphs hold.
const STEP_FACTOR: u64 = 8;
/// Graph-held handles per parameter tolerated before any backward: about this many forwards of
/// a model that saves each parameter once per forward.
const PER_PARAM_BEFORE_FIRST_BACKWARD: u64 = 64;

/// Live parameter handles and the warning's state.
#[derive(Debug)]
pub(crate) struct Retention {
    /// Parameters: the module's own handles, one each.
    params: u64,
    live: AtomicU64,
    /// Most handles alive at the start of a backward, beyond the module's own: what one
    /// step's graphs hold (0 before the first backward).
    step_graphs: AtomicU64,
    warned: AtomicBool,
}

impl Retention {
    /// A watch over `params` parameters.
    pub fn new(params: usize) -> Self {
        Self {
            params: params as u64,
            live: AtomicU64::new(0),
            step_graphs: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Handles alive beyond which forwards without backward are reported: the module's own
    /// plus 8 steps' worth of graphs, or 64 per parameter before the first backward.
    pub fn limit(&self) -> u64 {
        let graphs = match self.step_graphs.load(Ordering::Relaxed) {
            0 => PER_PARAM_BEFORE_FIRST_BACKWARD * self.params.max(1),
            step => STEP_FACTOR * step.max(self.params),
        };
        self.params + graphs
    }

    /// Handles alive now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Whether the warning was given.
    pub fn warned(&self) -> bool {
        self.warned.load(Ordering::Relaxed)
    }

    /// A handle was made.
    pub fn acquire(&self) {
        let live = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        if live > self.limit() && !self.warned.swap(true, Ordering::Relaxed) {
            warn(live, self.params);
        }
    }

    /// A handle was dropped.
    pub fn release(&self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    /// A backward starts: the handles alive now beyond the module's own are what this step's
    /// graphs hold.
    pub fn backward_started(&self) {
        let graphs = self.live().saturating_sub(self.params).max(1);
        self.step_graphs.fetch_max(graphs, Ordering::Relaxed);
    }
}

fn warn(live: u64, params: u64) {
    let message = format!(
        "sshsdp: {live} handles to {params} sharded parameters are alive: forward passes on an \
         autodiff model without a backward keep their graphs (and memory) until the next \
         backward. Evaluate or sample on `model.valid()`, or run backward after each forward."
    );
    if log::log_enabled!(log::Level::Warn) {
        log::warn!("{message}");
    } else {
        eprintln!("warning: {message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_follows_what_a_step_keeps() {
        let r = Retention::new(10);
        assert_eq!(r.limit(), 10 + 640);
        // The module's 10 handles and one forward's 20.
        (0..30).for_each(|_| r.acquire());
        r.backward_started();
        assert_eq!(r.limit(), 10 + 8 * 20);
        (0..140).for_each(|_| r.acquire());
        assert!(!r.warned(), "{} live, limit {}", r.live(), r.limit());
        r.acquire();
        assert!(r.warned(), "{} live, limit {}", r.live(), r.limit());
    }
}
