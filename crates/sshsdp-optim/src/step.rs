//! [`ShardedStep`]: what every optimizer of sharded pieces shares — opening the runtime's
//! update, stepping its pieces with the optimizer as the caller, committing (or abandoning it
//! with the optimizer's error) — once, for both `step` and `step_offloaded`.

use burn::module::Module;
use burn::tensor::backend::Backend;
use sshsdp_backend::{
    check_gradient_leaves, HsdpError, HsdpRuntime, Piece, ShardableBackend, StepOutcome,
    UpdateGroup, UpdateStep, Verdict, Views,
};

/// An optimizer over a sharded model's update pieces whose own state lives on `B`.
pub trait ShardedStep<B: Backend> {
    /// How [`Self::step`] asks the runtime for the pieces (on the optimizer's own backend):
    /// host slices unless the optimizer steps device pieces where they are.
    fn views(&self) -> Views {
        Views::Host
    }

    /// When [`Self::step`] reads the step's non-finite verdict: before the step by default; an
    /// optimizer that can undo its own state ([`Self::settle`]) and needs no norm before the
    /// step may take it at commit, so no host read stalls the device between backward and its
    /// kernels (honoured at world 1 with device masters and gradients).
    fn verdict(&self) -> Verdict {
        Verdict::BeforeStep
    }

    /// The global norm [`Self::step`] clips the gradients to (`None`: no clipping). Where the
    /// verdict is read at commit the runtime clips on the device before the optimizer steps
    /// ([`sshsdp_backend::UpdateStep::clip_on_device`]) and the optimizer sees no norm; else
    /// the optimizer clips with the agreed norm ([`crate::GradClip::factor`]).
    fn max_grad_norm(&self) -> Option<f64> {
        None
    }

    /// Called by [`Self::step`] once the step is settled: `outcome` is what the commit said, or
    /// `None` when the step did not complete (an error). An optimizer that stepped before a
    /// verdict read at commit keeps its new state only when `outcome` says the step applied.
    fn settle(&mut self, outcome: Option<&StepOutcome>) {
        let _ = outcome;
    }

    /// Steps this rank's `pieces` of `runtime` (on the optimizer's own backend), handed as
    /// [`Self::views`], with the update `group`'s collectives; by default as host slices
    /// ([`Self::step_host_pieces`]).
    fn step_pieces(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<B>,
        pieces: &mut [Piece<B>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        self.step_host_pieces(lr, runtime, pieces, group)
    }

    /// Steps this rank's `pieces` of `runtime` on any backend, handed as host slices.
    fn step_host_pieces<R: Backend>(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        pieces: &mut [Piece<R>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError>;

    /// One step with learning rate `lr` on every parameter of `runtime`'s pieces that received
    /// a gradient in this step; returns `module`, whose parameters now read the updated storage
    /// (as Burn's own optimizers return the module). Fails on every rank alike, e.g. with
    /// [`HsdpError::NonFiniteGradient`] (nothing applied; see
    /// [`sshsdp_backend::NonFinitePolicy`]).
    fn step<AB, M>(&mut self, lr: f64, module: M, runtime: &HsdpRuntime<B>) -> Result<M, HsdpError>
    where
        Self: Sized,
        AB: ShardableBackend<Inner = B>,
        M: Module<AB>,
    {
        let leaves = check_gradient_leaves(&module);
        if let Some(mut update) = runtime.begin_update_with(self.views(), self.verdict())? {
            if let Some(max_norm) = self.max_grad_norm() {
                update.clip_on_device(max_norm);
            }
            let (pieces, group) = update.parts();
            let stepped = self.step_pieces(lr, runtime, pieces, group);
            let committed = close_step(update, stepped);
            self.settle(committed.as_ref().ok());
            committed?;
        }
        leaves.map(|()| module)
    }

    /// [`Self::step`] for a model on another backend than the optimizer's: the runtime hands
    /// host views of every piece (host masters as they are; device masters staged), and the
    /// optimizer steps them on `B` — with a CPU backend (burn-flex, NdArray) under a GPU model
    /// its state never touches the device: FSDP2's CPU offload policy. Keep the masters on the
    /// host too (`Placement::Host`, the default) so nothing is staged.
    fn step_offloaded<AB, M>(
        &mut self,
        lr: f64,
        module: M,
        runtime: &HsdpRuntime<AB::Inner>,
    ) -> Result<M, HsdpError>
    where
        Self: Sized,
        AB: ShardableBackend,
        M: Module<AB>,
    {
        let leaves = check_gradient_leaves(&module);
        if let Some(mut update) = runtime.begin_update(Views::Host)? {
            let (pieces, group) = update.parts();
            let stepped = self.step_host_pieces(lr, runtime, pieces, group);
            let committed = close_step(update, stepped);
            self.settle(committed.as_ref().ok());
            committed?;
        }
        leaves.map(|()| module)
    }
}

/// Commits `update` after a successful step, or abandons it with the step's error.
fn close_step<B: Backend>(
    update: UpdateStep<'_, B>,
    stepped: Result<(), HsdpError>,
) -> Result<StepOutcome, HsdpError> {
    match stepped {
        Ok(()) => update.commit(),
        Err(e) => Err(update.abandon(e)),
    }
}
