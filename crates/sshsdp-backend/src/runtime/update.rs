//! The update stage, linear: [`Runtime::begin_update`] collects the reduced gradient pieces,
//! measures the global gradient norm on every rank alike (a non-finite one stops the step
//! everywhere) and moves this rank's pieces — fp32 masters and gradients, where the caller
//! wants them — out of the runtime into an [`UpdateStep`]; the caller (the optimizer) steps
//! them with no runtime lock held; [`UpdateStep::commit`] agrees with every rank that every
//! step succeeded, re-derives each piece's runtime bytes from its master, rebuilds the runtime
//! shards across replicas and ends the step.
//!
//! **When the verdict is read.** By default every rank agrees on the step's gradient norm before
//! the pieces are handed out ([`Verdict::BeforeStep`]): the norm's read drains the device queue
//! between backward and the optimizer. With [`Verdict::AtCommit`] — honoured at world 1 with
//! masters and gradients on the device — the norm is summed on the device and its 4-byte read
//! queued right behind it; the optimizer's kernels are issued at once behind the read, and
//! [`UpdateStep::commit`] waits for it: a non-finite step puts back the masters as they were
//! handed out (the optimizer wrote new tensors, never into them) and re-derives nothing, and
//! the caller learns from the [`StepOutcome`] that its own state must not advance.
//!
//! A step that is not committed — [`UpdateStep::abandon`]ed with the optimizer's error, or
//! dropped (an early return, a panic) — applies nothing more: the masters go back as the
//! optimizer left them, the runtime shards are not re-derived, and this rank's runtime records
//! the failure and aborts the engine's communicators, so every rank gets an error at its next
//! collective (a peer already committing fails in the step verdict). The runtime stays failed:
//! a partly stepped master cannot be told from a whole one, so no rollback is pretended.

use burn_backend::{Backend, FloatDType};

use super::pieces::{Piece, UpdateGroup, Views};
use super::step_agreement::{global_grad_norm, norm_message_len};
use super::{Runtime, State};
use crate::config::{NonFinitePolicy, Placement};
use crate::error::HsdpError;
use crate::storage::{device_sum_of_squares, mark_update, F32Buf, PendingRead};

/// When an update reads the step's non-finite verdict (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verdict {
    /// Before the pieces are handed out: a step skipped for a non-finite gradient hands out
    /// none ([`Runtime::begin_update`] gives `None`), and the optimizer steps only what
    /// applies.
    #[default]
    BeforeStep,
    /// At [`UpdateStep::commit`], where the runtime can (world 1, masters and gradients on the
    /// device; elsewhere as [`Verdict::BeforeStep`]): the optimizer steps before the verdict is
    /// known, writing new tensors (never into the masters it was handed), and the commit's
    /// [`StepOutcome`] says whether the step applied; when it did not, the caller restores its
    /// own state. No gradient norm is known while stepping ([`UpdateGroup::grad_norm`] is
    /// `None`), so an optimizer that clips cannot ask for it.
    AtCommit,
}

/// What a committed update did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// Whether the step applied: false when a verdict read at commit found a non-finite
    /// gradient under [`NonFinitePolicy::SkipStep`] (masters and runtime shards unchanged; the
    /// caller's own state must not advance either).
    pub applied: bool,
    /// The step's global gradient norm (`None` for a masters-only update).
    pub grad_norm: Option<f64>,
}

/// A verdict read at commit: the norm's read in flight, and the masters as handed out.
struct DeferredVerdict<B: Backend> {
    /// The read of `sum`.
    norm_squared: PendingRead,
    /// The sum of the squares of the gradients, on the device (1 element).
    sum: B::FloatTensorPrimitive,
    handed_out: Vec<B::FloatTensorPrimitive>,
}

/// This rank's pieces moved out of the runtime for one update (see the module docs): step
/// them through [`Self::pieces_mut`] (or [`Self::parts`], with the update group's collectives),
/// then [`Self::commit`].
pub struct UpdateStep<'r, B: Backend> {
    runtime: &'r Runtime<B>,
    pieces: Vec<Piece<B>>,
    group: UpdateGroup<'r>,
    /// The verdict still to read at commit ([`Verdict::AtCommit`]).
    deferred: Option<DeferredVerdict<B>>,
    /// Every bucket's piece with empty gradients (checkpoints), not a training step.
    masters_only: bool,
    /// Whether the pieces went back (committed or abandoned).
    closed: bool,
}

impl<B: Backend> Runtime<B> {
    /// Opens an update: this rank's pieces that received a gradient, handed as `views`, with
    /// their world-averaged gradients. `Ok(None)` when the step was skipped on every rank (a
    /// non-finite gradient under [`NonFinitePolicy::SkipStep`]: nothing to step, nothing
    /// changed). A collective call: every rank calls it, then commits.
    pub fn begin_update(&self, views: Views) -> Result<Option<UpdateStep<'_, B>>, HsdpError> {
        self.begin(false, views, Verdict::BeforeStep)
    }

    /// [`Self::begin_update`], reading the non-finite verdict as `verdict` asks (see the module
    /// docs): with [`Verdict::AtCommit`], `Ok(None)` only when the verdict was read first after
    /// all, and otherwise [`UpdateStep::commit`]'s [`StepOutcome`] says whether the step applied.
    pub fn begin_update_with(
        &self,
        views: Views,
        verdict: Verdict,
    ) -> Result<Option<UpdateStep<'_, B>>, HsdpError> {
        self.begin(false, views, verdict)
    }

    /// Opens an update of every bucket's piece as host slices with empty gradients (device
    /// masters staged, pending gradients left alone), for reading or overwriting the fp32
    /// masters (checkpoints); committing re-derives and rebuilds the runtime shards as after an
    /// update. A collective call.
    pub fn begin_masters(&self) -> Result<UpdateStep<'_, B>, HsdpError> {
        Ok(self
            .begin(true, Views::Host, Verdict::BeforeStep)?
            .expect("a masters-only update is never skipped"))
    }

    /// Runs `step(pieces, group)` on this rank's pieces (see [`Self::begin_update`]) and
    /// commits: the closure form of the linear update. A skipped step does not call `step`.
    pub fn update_pieces(
        &self,
        views: Views,
        step: impl FnOnce(&mut [Piece<B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        match self.begin_update(views)? {
            Some(update) => update.run(step),
            None => Ok(()),
        }
    }

    /// [`Self::begin_masters`] in closure form.
    pub fn master_pieces(
        &self,
        f: impl FnOnce(&mut [Piece<B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        self.begin_masters()?.run(f)
    }

    fn begin(
        &self,
        masters_only: bool,
        views: Views,
        verdict: Verdict,
    ) -> Result<Option<UpdateStep<'_, B>>, HsdpError> {
        let update = self.open(masters_only, views, verdict)?;
        // (A fault injected here fails the step as an optimizer's error would.)
        match (
            update,
            sshsdp_comm::faults::inject("sshsdp::update", self.world_rank),
        ) {
            (Some(update), Err(e)) => Err(update.abandon(HsdpError::Failed(e))),
            (update, _) => Ok(update),
        }
    }

    /// [`Self::begin`] up to the step's pieces, the state's lock held.
    fn open(
        &self,
        masters_only: bool,
        views: Views,
        verdict: Verdict,
    ) -> Result<Option<UpdateStep<'_, B>>, HsdpError> {
        let st = &mut *self.lock();
        if st.updating {
            let failure = "an update was begun while another was open".to_string();
            self.record_failure(st, failure.clone());
            return Err(HsdpError::Failed(failure));
        }
        // A gather prefetched at the end of the last step for a forward that did not come (two
        // updates in a row: a checkpoint's `master_pieces`, a load) would read the shards this
        // update replaces. (A failure is recorded, and met below with the others.)
        let _ = self.drop_prefetches(st);
        if let Some((b, pending)) = st
            .buckets
            .iter()
            .find(|b| b.pending_gradients() > 0)
            .map(|b| (b.index(), b.pending_gradients()))
        {
            let failure = format!(
                "bucket {b} is still waiting for {pending} gradients: finish backward before \
                 stepping"
            );
            self.record_failure(st, failure);
        }
        for b in 0..st.buckets.len() {
            if let Err(e) = st.buckets[b].collect(&self.ctx) {
                self.record_failure(st, e);
            }
        }
        if let Some(f) = st.failure.clone() {
            // The update's first collective is still made (it fails at once: see
            // `worker::run`), so that peers that have not met the failure yet meet it here and
            // return from this same call: the gradient norm, or the verdict when there is no
            // norm (masters only). Only the first: peers stop at it too, so a second would wait
            // for them in vain.
            if masters_only {
                let _ = self.gather_world(st, "step verdict", vec![1]);
            } else {
                let _ = self
                    .ctx
                    .worker
                    .gather_world_bytes("gradient norm", vec![0; norm_message_len(self)])
                    .wait();
            }
            return Err(HsdpError::Failed(f));
        }
        let grads: Vec<(usize, F32Buf<B>)> = if masters_only {
            (0..st.buckets.len())
                .map(|b| (b, F32Buf::Host(Vec::new())))
                .collect()
        } else {
            (0..st.buckets.len())
                .filter_map(|b| st.buckets[b].take_grad().map(|g| (b, g)))
                .collect()
        };
        let defer = verdict == Verdict::AtCommit
            && !masters_only
            && views == Views::AsStored
            && self.ctx.masters == Placement::Device
            && self.plan.mesh().world_size() == 1
            && !grads.is_empty();
        let (grad_norm, received) = if masters_only {
            (Some(0.0), Vec::new())
        } else if defer {
            // World 1: this rank's received bits are the world's, and the norm is its own,
            // summed on the device once the gradients are there (below).
            let fresh = vec![false; self.plan.params().len()];
            (None, std::mem::replace(&mut st.received, fresh))
        } else {
            let (norm, received) = global_grad_norm(self, st, &grads)?;
            st.last_grad_norm = Some(norm);
            if !norm.is_finite() {
                // Every rank measured the same norm: every rank drops this step's gradients
                // and applies nothing, so masters and runtime shards stay as they were.
                drop(grads);
                self.end_step(st)?;
                return match self.non_finite {
                    NonFinitePolicy::Error => Err(HsdpError::NonFiniteGradient { norm }),
                    NonFinitePolicy::SkipStep => {
                        st.counters.skipped_steps += 1;
                        Ok(None)
                    }
                };
            }
            (Some(norm), received)
        };
        let pieces = self
            .take_pieces(st, grads, views)
            .inspect_err(|e| self.record_failure(st, e.to_string()))?;
        let deferred = defer.then(|| {
            let sum =
                device_sum_of_squares::<B>(pieces.iter().filter_map(|p| p.values.device_grad()));
            DeferredVerdict {
                norm_squared: PendingRead::issue::<B>(sum.clone()),
                sum,
                handed_out: pieces
                    .iter()
                    .filter_map(|p| p.values.device_master().cloned())
                    .collect(),
            }
        });
        if !masters_only {
            // After the norm's read was issued (on fusion that flushed the lazy stream): the
            // optimizer's kernels come next.
            mark_update::<B>(&self.ctx.device, true);
        }
        st.updating = true;
        let group = UpdateGroup {
            worker: &self.ctx.worker,
            timeline: &self.ctx.timeline,
            traffic: &self.ctx.traffic,
            engine_on_device: self.ctx.engine_on_device,
            piece: self.ctx.piece,
            piece_ranks: piece_ranks(&self.plan)?,
            grad_norm,
            received,
        };
        Ok(Some(UpdateStep {
            runtime: self,
            pieces,
            group,
            deferred,
            masters_only,
            closed: false,
        }))
    }

    /// The pieces of the buckets in `grads`, their masters taken out of the buckets and each
    /// gradient moved to where its master is: host slices for [`Views::Host`], else where the
    /// masters live. On an error every master taken so far goes back.
    fn take_pieces(
        &self,
        st: &mut State<B>,
        grads: Vec<(usize, F32Buf<B>)>,
        views: Views,
    ) -> Result<Vec<Piece<B>>, HsdpError> {
        let ctx = &self.ctx;
        let placement = match views {
            Views::Host => Placement::Host,
            Views::AsStored => ctx.masters,
        };
        let mut pieces = Vec::with_capacity(grads.len());
        for (b, grad) in grads {
            let piece = st.buckets[b]
                .take_master(placement, ctx)
                .and_then(|master| {
                    let values = match master.with_grad(grad, &ctx.device, &ctx.traffic) {
                        Ok(values) => values,
                        Err((master, e)) => {
                            st.buckets[b].restore_master(master, ctx)?;
                            return Err(e);
                        }
                    };
                    Ok(Piece {
                        bucket: b,
                        index: ctx.piece,
                        start: ctx.piece * st.buckets[b].codec().piece_elems(),
                        values,
                    })
                });
            match piece {
                Ok(piece) => pieces.push(piece),
                Err(e) => {
                    self.restore_pieces(st, pieces);
                    return Err(e);
                }
            }
        }
        Ok(pieces)
    }

    /// Puts the masters of `pieces` back into their buckets (moved home), as they are.
    fn restore_pieces(&self, st: &mut State<B>, pieces: Vec<Piece<B>>) {
        for piece in pieces {
            let b = piece.bucket;
            if let Err(e) = st.buckets[b].restore_master(piece.values.into_master(), &self.ctx) {
                self.record_failure(st, format!("bucket {b}: restoring its master: {e}"));
            }
        }
        st.updating = false;
    }
}

impl<'r, B: Backend> UpdateStep<'r, B> {
    /// This rank's pieces: those with a gradient (every bucket's, with empty gradients, for a
    /// masters-only update), in bucket order.
    pub fn pieces_mut(&mut self) -> &mut [Piece<B>] {
        &mut self.pieces
    }

    /// The collectives the optimizer may run over its update group, and the step's agreed
    /// gradient norm and received-gradient bits.
    pub fn group(&self) -> &UpdateGroup<'r> {
        &self.group
    }

    /// [`Self::pieces_mut`] and [`Self::group`] at once (an optimizer that exchanges between
    /// pieces, as distributed Muon does).
    pub fn parts(&mut self) -> (&mut [Piece<B>], &UpdateGroup<'r>) {
        (&mut self.pieces, &self.group)
    }

    /// Clips the gradients to a global norm of at most `max_norm` where the norm is still on the
    /// device (a verdict read at commit, [`UpdateGroup::grad_norm`] `None`): each device
    /// gradient is multiplied by `min(1, max_norm / (norm + 1e-6))`, formed on the device in f32
    /// (`torch.nn.utils.clip_grad_norm_`'s factor; the host forms it in f64, so a clipped step
    /// may differ from one whose verdict was read first by an f32 rounding of the factor).
    /// Nothing where the norm was agreed before the step (the optimizer clips with it).
    pub fn clip_on_device(&mut self, max_norm: f64) {
        let Some(deferred) = &self.deferred else {
            return;
        };
        let sum = deferred.sum.clone();
        let device = B::float_device(&sum);
        let denominator = B::float_add_scalar(B::float_sqrt(sum), 1e-6f32.into());
        let max = B::float_full(
            [1].into(),
            (max_norm as f32).into(),
            &device,
            FloatDType::F32,
        );
        let factor = B::float_clamp_max(B::float_div(max, denominator), 1f32.into());
        for piece in &mut self.pieces {
            piece.values.scale_device_grad(&factor);
        }
    }

    /// `step(pieces, group)`, then [`Self::commit`], or [`Self::abandon`] with its error.
    pub fn run(
        mut self,
        step: impl FnOnce(&mut [Piece<B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
    ) -> Result<(), HsdpError> {
        let (pieces, group) = self.parts();
        match step(pieces, group) {
            Ok(()) => self.commit().map(|_| ()),
            Err(e) => Err(self.abandon(e)),
        }
    }

    /// Applies the step: a verdict deferred to now ([`Verdict::AtCommit`]) is read first (a
    /// non-finite gradient puts the masters back as handed out: `applied` false under
    /// [`NonFinitePolicy::SkipStep`], [`HsdpError::NonFiniteGradient`] under `Error`); every
    /// rank learns whether every rank's step succeeded (one byte each, over the world, so a
    /// failure in one update group is an error on every rank in this same call and no rank
    /// re-derives and rebuilds alone); then each piece's runtime units are re-derived from its
    /// master, the runtime shards rebuilt across replicas, and every gathered bucket released,
    /// so the next forward gathers the new values.
    pub fn commit(mut self) -> Result<StepOutcome, HsdpError> {
        self.close(None)
    }

    /// Gives up the step after the optimizer's `error` (or any other): nothing more is applied
    /// and every rank gets an error (see the module docs). Returns `error`.
    pub fn abandon(mut self, error: HsdpError) -> HsdpError {
        let _ = self.close(Some(error.to_string()));
        error
    }

    /// Commits (`failure` `None`) or abandons the step.
    fn close(&mut self, failure: Option<String>) -> Result<StepOutcome, HsdpError> {
        self.closed = true;
        let rt = self.runtime;
        let st = &mut *rt.lock();
        let mut pieces = std::mem::take(&mut self.pieces);
        let mut outcome = StepOutcome {
            applied: true,
            grad_norm: self.group.grad_norm,
        };
        if let (None, Some(deferred)) = (&failure, self.deferred.take()) {
            let norm = match deferred.norm_squared.wait(&rt.ctx.traffic) {
                Ok(sum) => f64::from(sum[0]).sqrt(),
                Err(e) => {
                    rt.record_failure(st, e.to_string());
                    rt.restore_pieces(st, pieces);
                    return Err(e);
                }
            };
            st.last_grad_norm = Some(norm);
            outcome.grad_norm = Some(norm);
            if !norm.is_finite() {
                // Nothing applies: the masters go back as they were handed out (the optimizer
                // replaced the tensors, never wrote into them), nothing is re-derived.
                for (piece, master) in pieces.iter_mut().zip(deferred.handed_out) {
                    piece.values.set_device_master(master);
                }
                rt.restore_pieces(st, pieces);
                rt.end_step(st)?;
                return match rt.non_finite {
                    NonFinitePolicy::Error => Err(HsdpError::NonFiniteGradient { norm }),
                    NonFinitePolicy::SkipStep => {
                        st.counters.skipped_steps += 1;
                        outcome.applied = false;
                        Ok(outcome)
                    }
                };
            }
        }
        // A failed step is recorded first: that aborts the engine, so a peer of the update
        // group still inside one of the step's collectives fails at once.
        if let Some(failure) = &failure {
            rt.record_failure(st, failure.clone());
        }
        // Made after a failure too: the engine fails it at once, carrying the failure to the
        // ranks that wait in it.
        let verdicts = rt.gather_world(st, "step verdict", vec![u8::from(failure.is_some())]);
        if let Some(failure) = failure {
            rt.restore_pieces(st, pieces);
            return Err(HsdpError::Failed(failure));
        }
        let verdicts = match verdicts {
            Ok(verdicts) => verdicts,
            Err(e) => {
                rt.restore_pieces(st, pieces);
                return Err(e);
            }
        };
        let failed: Vec<usize> = (0..verdicts.len()).filter(|&r| verdicts[r] != 0).collect();
        if !failed.is_empty() {
            let failure = format!("the optimizer step failed on ranks {failed:?}");
            rt.record_failure(st, failure.clone());
            rt.restore_pieces(st, pieces);
            return Err(HsdpError::Failed(failure));
        }
        st.updating = false;
        // Re-derive each updated piece's runtime units and rebuild the shards across replicas.
        let mut rebuilds = Vec::with_capacity(pieces.len());
        let mut pieces = pieces.into_iter();
        for piece in pieces.by_ref() {
            let b = piece.bucket;
            match st.buckets[b].rederive(&rt.ctx, piece.values.into_master()) {
                Ok(rebuild) => rebuilds.push((b, rebuild)),
                Err(e) => {
                    // Recorded first: that aborts the engine, so peers already waiting in
                    // this step's rebuilds fail at once instead of waiting for this rank.
                    rt.record_failure(st, e.to_string());
                    rt.restore_pieces(st, pieces.collect());
                    return Err(e);
                }
            }
        }
        for (b, rebuild) in rebuilds {
            if let Err(e) = st.buckets[b].finish_rebuild(&rt.ctx, rebuild) {
                rt.record_failure(st, e.to_string());
                return Err(e);
            }
        }
        if !self.masters_only {
            mark_update::<B>(&rt.ctx.device, false);
        }
        rt.end_step(st)?;
        if !self.masters_only {
            // A whole step (forward, backward, update, rebuild) ran on every rank: each
            // compiled its kernels, so engines with a start-up bound tighten their waits now.
            rt.lanes.startup_done();
            rt.prefetch_first(st);
        }
        Ok(outcome)
    }
}

impl<B: Backend> Drop for UpdateStep<'_, B> {
    /// A step neither committed nor abandoned: its masters go back as they are, and the
    /// runtime fails (see the module docs). No collective is made here (this may run while
    /// unwinding): the abort reaches the peers.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let rt = self.runtime;
        let st = &mut *rt.lock();
        let failure = "an update step was dropped without commit: nothing more was applied";
        rt.record_failure(st, failure.into());
        rt.restore_pieces(st, std::mem::take(&mut self.pieces));
    }
}

/// The update-group rank holding each piece of `plan`: the world rank when hierarchical, the
/// shard-group rank (the shard index) under HSDP, rank 0 under DDP.
fn piece_ranks(plan: &sshsdp_plan::Plan) -> Result<Vec<usize>, HsdpError> {
    (0..plan.pieces())
        .map(|p| match plan.config().sharding {
            sshsdp_plan::Sharding::Hierarchical => Ok(plan.ranks_of_piece(p)?[0]),
            sshsdp_plan::Sharding::Hsdp | sshsdp_plan::Sharding::Ddp => Ok(p),
        })
        .collect()
}
