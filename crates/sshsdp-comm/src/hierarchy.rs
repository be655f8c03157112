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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{CallTag, Collective, CommError, CommResult, Element, ReduceOp, Reducible};

/// A group of the mesh, as seen from one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeshGroup {
    /// All ranks.
    World,
    /// This rank's replica: the ranks of its row, ordered by shard index.
    Shard,
    /// The ranks with this rank's shard index, ordered by replica index.
    Replica,
}

/// How a group of the mesh is held.
enum Held<C> {
    /// It has the world's ranks in the world's order: it *is* the world.
    World,
    /// It is this rank alone: no communicator, and no collective runs over it.
    Alone,
    /// A communicator split from the world.
    Split(C),
}

/// A rank's communicators over a `replicas × shards` mesh.
///
/// A group with the same ranks in the same order as the world *is* the world: on a flat mesh
/// (one replica) the shard group, under DDP (one shard) the replica group. A group of one rank
/// (the replica group of a flat mesh, the shard group of an `R×1` mesh, every group at world 1)
/// is no communicator at all: a collective over one rank moves nothing, so none is split for it
/// and none is called on it ([`MeshComms::calling`] says so, and the gradient paths below skip
/// it, the average over one rank being the value itself). Engines whose communicators hold large
/// buffers (NCCL: per-peer buffers for every algorithm) pay for neither a duplicate of the world
/// nor a group of one.
pub struct MeshComms<C> {
    // Declared (so dropped) before the world they are split from: engines whose children share
    // their parent's resources (NCCL's `splitShare`) free the children first.
    shard_group: Held<C>,
    replica_group: Held<C>,
    world: C,
    replicas: usize,
    shards: usize,
    /// Collective calls made through [`MeshComms::calling`] (the runtime's counters).
    calls: Arc<AtomicU64>,
}

impl<C: Collective> MeshComms<C> {
    /// Splits `world` into shard and replica groups (only those that are neither the world nor
    /// one rank); collective over `world`, and every rank splits the same groups since the mesh
    /// is the same.
    pub fn new(world: C, replicas: usize, shards: usize) -> CommResult<Self> {
        if replicas == 0 || shards == 0 || replicas * shards != world.size() {
            return Err(CommError::InvalidArgument(format!(
                "mesh {replicas}x{shards} does not match a world of {} ranks",
                world.size()
            )));
        }
        let (replica, shard) = (world.rank() / shards, world.rank() % shards);
        // The shard group has `shards` ranks; it is the world when there is one replica.
        let shard_group = match (shards, replicas) {
            (1, _) => Held::Alone,
            (_, 1) => Held::World,
            _ => Held::Split(world.split(replica, shard)?),
        };
        // The replica group has `replicas` ranks; it is the world when there is one shard.
        let replica_group = match (replicas, shards) {
            (1, _) => Held::Alone,
            (_, 1) => Held::World,
            _ => Held::Split(world.split(shard, replica)?),
        };
        Ok(Self {
            world,
            shard_group,
            replica_group,
            replicas,
            shards,
            calls: Arc::default(),
        })
    }

    /// Counts this mesh's collective calls into `calls` (shared with other meshes: a rank's
    /// lanes) instead of its own counter.
    pub fn with_call_counter(mut self, calls: Arc<AtomicU64>) -> Self {
        self.calls = calls;
        self
    }

    /// The counter of collective calls made through [`MeshComms::calling`].
    pub fn call_counter(&self) -> Arc<AtomicU64> {
        self.calls.clone()
    }

    /// Labels the calls that follow on every communicator (see [`Collective::set_tag`]).
    pub fn set_tag(&self, tag: CallTag) {
        self.world.set_tag(tag);
        for group in [&self.shard_group, &self.replica_group] {
            if let Held::Split(c) = group {
                c.set_tag(tag);
            }
        }
    }

    /// All ranks (a communicator even at world 1: registration agreements and splits run on
    /// it).
    pub fn world(&self) -> &C {
        &self.world
    }

    /// `group`'s communicator, or `None` where it is this rank alone (world 1 included).
    pub fn group(&self, group: MeshGroup) -> Option<&C> {
        let held = match group {
            MeshGroup::World if self.world.size() == 1 => return None,
            MeshGroup::World => return Some(&self.world),
            MeshGroup::Shard => &self.shard_group,
            MeshGroup::Replica => &self.replica_group,
        };
        match held {
            Held::World => Some(&self.world),
            Held::Alone => None,
            Held::Split(c) => Some(c),
        }
    }

    /// `group`'s communicator for one collective call, counted; `None` where the group is this
    /// rank alone, and the caller makes no call (the collective's result over one rank is its
    /// input: a sum or an average of one value, a gather of one part).
    pub fn calling(&self, group: MeshGroup) -> Option<&C> {
        let comm = self.group(group)?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        Some(comm)
    }

    /// How many communicators this rank holds for the mesh (1 to 3): the world, and the groups
    /// that are neither the world nor one rank.
    pub fn communicators(&self) -> usize {
        let split = |g: &Held<C>| usize::from(matches!(g, Held::Split(_)));
        1 + split(&self.shard_group) + split(&self.replica_group)
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
        let rank = self.world.rank();
        (rank / self.shards, rank % self.shards)
    }
}

/// An argument error unless `what` has `want` elements (`got`).
pub fn check_len(what: &str, got: usize, want: usize) -> CommResult<()> {
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
    match mesh.calling(MeshGroup::Shard) {
        Some(group) => group.reduce_scatter(grad, shard_out, ReduceOp::Avg),
        None => {
            shard_out.copy_from_slice(grad);
            Ok(())
        }
    }
}

/// Second stage under HSDP: the shard-group average `shard` becomes the world average
/// (all-reduce across the replica group, in place).
pub fn reduce_across_replicas_hsdp<C: Collective, T: Reducible>(
    mesh: &MeshComms<C>,
    shard: &mut [T],
) -> CommResult<()> {
    match mesh.calling(MeshGroup::Replica) {
        Some(group) => group.all_reduce(shard, ReduceOp::Avg),
        None => Ok(()),
    }
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
    match mesh.calling(MeshGroup::Replica) {
        Some(group) => group.reduce_scatter(shard, piece_out, ReduceOp::Avg),
        None => {
            piece_out.copy_from_slice(shard);
            Ok(())
        }
    }
}

/// After the update: `shard_buf` (`R · piece` elements) holds this rank's re-derived piece at
/// chunk `replica`; the replica all-gather fills the rest, rebuilding the runtime shard.
pub fn gather_runtime_shard<C: Collective, T: Element>(
    mesh: &MeshComms<C>,
    shard_buf: &mut [T],
) -> CommResult<()> {
    match mesh.calling(MeshGroup::Replica) {
        Some(group) => group.all_gather_in_place(shard_buf),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::{ThreadsConfig, ThreadsWorld};

    /// Groups of one rank are no communicator, and the gradient paths make no call over them;
    /// the paths' results are the reduction's whatever the mesh.
    #[test]
    fn groups_of_one_rank_are_not_split_and_not_called() {
        // (replicas, shards): communicators held, calls of one hierarchical reduction and
        // rebuild (shard stage + replica stage + rebuild).
        for ((replicas, shards), held, calls) in [
            ((1, 1), 1, 0),
            ((1, 4), 1, 1),
            ((4, 1), 1, 2),
            ((2, 2), 3, 3),
        ] {
            let world = replicas * shards;
            let out = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
                let mesh = MeshComms::new(comm, replicas, shards).unwrap();
                let alone = |g| mesh.group(g).is_none();
                let groups = (
                    alone(MeshGroup::World),
                    alone(MeshGroup::Shard),
                    alone(MeshGroup::Replica),
                );
                let piece = 3;
                let rank = mesh.world().rank();
                let grad: Vec<f32> = (0..piece * world).map(|i| (i + rank) as f32).collect();
                let mut scratch = vec![0f32; piece * replicas];
                let mut out = vec![0f32; piece];
                reduce_gradients_hierarchical(&mesh, &grad, &mut scratch, &mut out).unwrap();
                gather_runtime_shard(&mesh, &mut scratch).unwrap();
                let calls = mesh.call_counter().load(Ordering::Relaxed);
                (
                    mesh.communicators(),
                    groups,
                    calls,
                    out,
                    mesh.coords(),
                    rank,
                )
            })
            .unwrap();
            for r in out {
                let (communicators, groups, made, piece_out, (replica, shard), rank) = r.unwrap();
                let what = format!("{replicas}x{shards} rank {rank}");
                assert_eq!(communicators, held, "{what}");
                assert_eq!(groups, (world == 1, shards == 1, replicas == 1), "{what}");
                assert_eq!(made, calls, "{what}");
                assert_eq!(rank, replica * shards + shard, "{what}");
                // The world average of element i of piece p (p = shard · replicas + replica):
                // mean over ranks of (p·3 + i + rank).
                let p = shard * replicas + replica;
                let mean_rank = (world - 1) as f32 / 2.0;
                for (i, &got) in piece_out.iter().enumerate() {
                    let want = (p * 3 + i) as f32 + mean_rank;
                    assert!((got - want).abs() < 1e-5, "{what}: {got} vs {want}");
                }
            }
        }
    }
}
