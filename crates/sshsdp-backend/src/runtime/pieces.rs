//! What the optimizer sees of an update: this rank's pieces (fp32 masters and their reduced
//! gradients, on the host or the device) and the update group it may exchange with (Muon's
//! whole matrices).

use std::sync::Arc;

use burn_backend::{Backend, TensorMetadata};

use crate::error::HsdpError;
use crate::lanes::{UpdateBuffer, UpdateReceived, Worker};
use crate::storage::{device_piece, device_update_job, download, upload, PieceValues};
use crate::timeline::{Timeline, Track};
use crate::traffic::{Purpose, Traffic};

/// How an update hands this rank's pieces to its caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Views {
    /// Where the masters live ([`crate::Placement`]): [`PieceValues::Host`] slices or
    /// [`PieceValues::Device`] tensors, for optimizers that step either (as
    /// `sshsdp_optim::ShardedOptimizer` does).
    #[default]
    AsStored,
    /// Always [`PieceValues::Host`] slices: device masters are staged to the host before the
    /// step and back after it (counted in [`crate::Counters::staged_bytes`]), for code written
    /// over host slices (distributed Muon's exchange, checkpoints).
    Host,
}

/// One bucket's piece on this rank during an update.
pub struct Piece<B: Backend> {
    /// The bucket.
    pub bucket: usize,
    /// The piece's index in the bucket (the plan's: `Plan::piece_views(bucket, index)` are its
    /// update views, `Plan::update_units` its units).
    pub index: usize,
    /// Position of the piece's first element in the bucket's element space (the plan's update
    /// views of the piece say where parameters sit in it).
    pub start: usize,
    /// The master and gradient values.
    pub values: PieceValues<B>,
}

impl<B: Backend> Piece<B> {
    /// Number of elements (padding included).
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the piece has no elements.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The host master and gradient slices; an error for device values (ask the update for
    /// [`Views::Host`] to get host slices in every placement).
    pub fn host(&mut self) -> Result<(&mut [f32], &[f32]), HsdpError> {
        let bucket = self.bucket;
        self.values.host().ok_or_else(|| {
            HsdpError::Failed(format!(
                "bucket {bucket}'s piece is on the device: request host views (Views::Host)"
            ))
        })
    }
}

/// The collectives an optimizer may run during an update, over the *update group*: the ranks
/// whose pieces make up a bucket (the world when hierarchical, the shard group under HSDP, this
/// rank alone under DDP).
pub struct UpdateGroup<'a> {
    pub(super) worker: &'a Worker,
    pub(super) timeline: &'a Timeline,
    /// Charged with what a staged device exchange moves.
    pub(super) traffic: &'a Arc<Traffic>,
    /// Whether the engine sums device memory itself (else a device exchange is staged).
    pub(super) engine_on_device: bool,
    pub(super) piece: usize,
    /// The update-group rank holding each piece.
    pub(super) piece_ranks: Vec<usize>,
    pub(super) grad_norm: Option<f64>,
    /// Per parameter, whether it received a gradient on some rank in this step.
    pub(super) received: Vec<bool>,
}

impl UpdateGroup<'_> {
    /// Element-wise sum of `buf` over the update group (every rank calls it, in the same order).
    /// A group of one rank makes no collective: the sum is `buf`.
    pub fn all_reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, HsdpError> {
        if self.alone() {
            return Ok(buf);
        }
        match self.sum(UpdateBuffer::Host(buf))? {
            UpdateReceived::Host(sum) => Ok(sum),
            UpdateReceived::Device(_) => Err(HsdpError::Failed(
                "a host all-reduce came back in device memory".into(),
            )),
        }
    }

    /// [`Self::all_reduce_sum`] of a 1-D f32 tensor of the decorated backend `B` on `device`,
    /// where it is: summed in place by the engine where it moves device memory (NCCL, or ranks
    /// of this process sharing a CubeCL device), else staged through the host collectives (read
    /// back and uploaded: charged to the runtime's counters as staging). A group of one rank
    /// makes no collective and moves nothing.
    pub fn all_reduce_sum_tensor<B: Backend>(
        &self,
        tensor: B::FloatTensorPrimitive,
        device: &B::Device,
    ) -> Result<B::FloatTensorPrimitive, HsdpError> {
        if self.alone() {
            return Ok(tensor);
        }
        let n = tensor.shape().num_elements();
        let job = if self.engine_on_device {
            device_update_job::<B>(tensor.clone(), None, self.traffic)
        } else {
            None
        };
        let buf = match job {
            Some(job) => UpdateBuffer::Device(job),
            None => UpdateBuffer::Host(download::<B>(tensor, self.traffic, Purpose::Stage)?),
        };
        match self.sum(buf)? {
            UpdateReceived::Device(units) if units.len == n => device_piece::<B>(&units, device),
            UpdateReceived::Host(sum) if sum.len() == n => {
                Ok(upload::<B>(sum, device, self.traffic, Purpose::Stage))
            }
            _ => Err(HsdpError::Failed(
                "an update-group all-reduce returned another length than it was given".into(),
            )),
        }
    }

    /// One all-reduce of `buf` over the update group, waited for.
    fn sum(&self, buf: UpdateBuffer) -> Result<UpdateReceived, HsdpError> {
        let reply = self.worker.all_reduce(buf);
        Ok(self
            .timeline
            .span(Track::Model, "wait optimizer all-reduce", None, || {
                reply.wait()
            })?)
    }

    /// Whether the update group is this rank alone (its collectives move nothing).
    pub(super) fn alone(&self) -> bool {
        self.piece_ranks.len() <= 1
    }

    /// Number of pieces in the update group (one per rank of it).
    pub fn pieces(&self) -> usize {
        self.piece_ranks.len()
    }

    /// This rank's piece index (what the plan's `ns_owner` refers to).
    pub fn piece(&self) -> usize {
        self.piece
    }

    /// The L2 norm of the whole model's world-averaged gradient (every piece of the update
    /// group, summed in f64; the same on every rank). Finite here: a non-finite gradient never
    /// reaches an optimizer whose step applies (see [`crate::NonFinitePolicy`]). 0 when handing
    /// out masters only; `None` when the verdict is read at commit
    /// ([`super::Verdict::AtCommit`]: the commit's [`super::StepOutcome`] carries the norm).
    pub fn grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }

    /// Whether parameter `param` (its index in the plan) received a gradient in this step, on
    /// any rank and in any backward since the last update (the same answer on every rank).
    /// One that did not — frozen (`require_grad` false), or unused by every rank's graph — is
    /// not stepped and its optimizer state is left alone, as Burn's optimizers skip a
    /// parameter without a gradient. False for every parameter when handing out masters only.
    pub fn received_gradient(&self, param: usize) -> bool {
        self.received.get(param).copied().unwrap_or(false)
    }
}
