//! The mesh's communicators and the hierarchical gradient paths built on them.
//!
//! With `replicas × shards` ranks (rank = replica · shards + shard):
//! * HSDP: reduce-scatter within the shard group, then all-reduce of that 1/S shard across the
//!   replica group — every replica keeps the whole 1/S update shard.
//! * Hierarchical (the project's default): reduce-scatter within the shard group, then
//!   reduce-scatter across the replica group — each rank keeps 1/(R·S). After the update, an
//!   all-gather across the replica group rebuilds the 1/S runtime shard from the re-derived
//!   pieces. RS + AG move the bytes of one all-reduce, while master weights and optimizer state
//!   shrink R times more than under HSDP.
//!
//! Both average over the whole world. The piece a rank ends with is chunk `replica` of chunk
//! `shard` of the bucket, i.e. piece `shard · replicas + replica` — the order `sshsdp-plan`
//! assigns pieces in.

use crate::{CallTag, Collective, CommError, CommResult, Element, ReduceOp, Reducible};

/// A rank's three communicators over a `replicas × shards` mesh.
///
/// A group with the same ranks in the same order as the world *is* the world: on a flat mesh
/// (one replica) the shard group, under DDP (one shard) the replica group. No communicator is
/// split for it, so a flat mesh holds two communicators, not three: engines whose communicators
/// hold large buffers (NCCL: per-peer buffers for every algorithm) do not pay for a duplicate of
/// the world.
pub struct MeshComms<C> {
    // Declared (so dropped) before the world they are split from: engines whose children share
    // their parent's resources (NCCL's `splitShare`) free the children first.
    /// `None`: the shard group is the world (one replica).
    shard_group: Option<C>,
    /// `None`: the replica group is the world (one shard).
    replica_group: Option<C>,
    world: C,
    replicas: usize,
    shards: usize,
}

impl<C: Collective> MeshComms<C> {
    /// Splits `world` into shard and replica groups (only those that are not the world itself);
    /// collective over `world`, and every rank splits the same groups since the mesh is the same.
    pub fn new(world: C, replicas: usize, shards: usize) -> CommResult<Self> {
        if replicas == 0 || shards == 0 || replicas * shards != world.size() {
            return Err(CommError::InvalidArgument(format!(
                "mesh {replicas}x{shards} does not match a world of {} ranks",
                world.size()
            )));
        }
        let (replica, shard) = (world.rank() / shards, world.rank() % shards);
        let shard_group = match replicas {
            1 => None,
            _ => Some(world.split(replica, shard)?),
        };
        let replica_group = match shards {
            1 => None,
            _ => Some(world.split(shard, replica)?),
        };
        Ok(Self {
            world,
            shard_group,
            replica_group,
            replicas,
            shards,
        })
    }

    /// Labels the calls that follow on every communicator (see [`Collective::set_tag`]).
    pub fn set_tag(&self, tag: CallTag) {
        self.world.set_tag(tag);
        for group in [&self.shard_group, &self.replica_group]
            .into_iter()
            .flatten()
        {
            group.set_tag(tag);
        }
    }

    /// All ranks.
    pub fn world(&self) -> &C {
        &self.world
    }

    /// Ranks of this rank's replica, ordered by shard index (the world when there is one
    /// replica).
    pub fn shard_group(&self) -> &C {
        self.shard_group.as_ref().unwrap_or(&self.world)
    }

    /// Ranks with this rank's shard index, ordered by replica index (the world when there is
    /// one shard).
    pub fn replica_group(&self) -> &C {
        self.replica_group.as_ref().unwrap_or(&self.world)
    }

    /// How many communicators this rank holds for the mesh (1 to 3): the world, and the groups
    /// that are not the world.
    pub fn communicators(&self) -> usize {
        1 + usize::from(self.shard_group.is_some()) + usize::from(self.replica_group.is_some())
    }

    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// This rank's `(replica, shard)`.
    pub fn coords(&self) -> (usize, usize) {
        (self.replica_group().rank(), self.shard_group().rank())
    }
}

fn check_len(what: &str, got: usize, want: usize) -> CommResult<()> {
    if got == want {
        Ok(())
    } else {
        Err(CommError::InvalidArgument(format!(
            "{what} has {got} elements, expected {want}"
        )))
    }
}

/// HSDP gradient reduction: `grad` (a full bucket, `S · shard` elements) becomes this rank's
/// world-averaged 1/S shard in `shard_out`: [`reduce_within_shard_group`], then
/// [`reduce_across_replicas_hsdp`].
pub fn reduce_gradients_hsdp<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    grad: &[T],
    shard_out: &mut [T],
) -> CommResult<()> {
    reduce_within_shard_group(mesh, grad, shard_out)?;
    reduce_across_replicas_hsdp(mesh, shard_out)
}

/// Hierarchical gradient reduction: `grad` (a full bucket, `R · S · piece` elements) becomes
/// this rank's world-averaged piece in `piece_out`; `scratch` holds the intermediate 1/S shard
/// (`R · piece` elements): [`reduce_within_shard_group`], then
/// [`reduce_across_replicas_hierarchical`].
pub fn reduce_gradients_hierarchical<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    grad: &[T],
    scratch: &mut [T],
    piece_out: &mut [T],
) -> CommResult<()> {
    reduce_within_shard_group(mesh, grad, scratch)?;
    reduce_across_replicas_hierarchical(mesh, scratch, piece_out)
}

/// First stage of both gradient paths: `grad` (a full bucket, `S · shard` elements) becomes
/// the shard group's average of this rank's 1/S shard in `shard_out` (reduce-scatter).
pub fn reduce_within_shard_group<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    grad: &[T],
    shard_out: &mut [T],
) -> CommResult<()> {
    check_len("gradient", grad.len(), shard_out.len() * mesh.shards)?;
    mesh.shard_group()
        .reduce_scatter(grad, shard_out, ReduceOp::Avg)
}

/// Second stage under HSDP: the shard-group average `shard` becomes the world average
/// (all-reduce across the replica group, in place).
pub fn reduce_across_replicas_hsdp<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    shard: &mut [T],
) -> CommResult<()> {
    mesh.replica_group().all_reduce(shard, ReduceOp::Avg)
}

/// Second stage when hierarchical: the shard-group average `shard` (`R · piece` elements)
/// becomes this rank's world-averaged piece in `piece_out` (reduce-scatter across the replica
/// group).
pub fn reduce_across_replicas_hierarchical<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    shard: &[T],
    piece_out: &mut [T],
) -> CommResult<()> {
    check_len(
        "hierarchical shard",
        shard.len(),
        piece_out.len() * mesh.replicas,
    )?;
    mesh.replica_group()
        .reduce_scatter(shard, piece_out, ReduceOp::Avg)
}

/// After the update: `shard_buf` (`R · piece` elements) holds this rank's re-derived piece at
/// chunk `replica`; the replica all-gather fills the rest, rebuilding the runtime shard.
pub fn gather_runtime_shard<C: Collective, T: Element>(
    mesh: &MeshComms<C>,
    shard_buf: &mut [T],
) -> CommResult<()> {
    mesh.replica_group().all_gather_in_place(shard_buf)
}
