//! The communication a runtime needs, as an object-safe trait over a mesh's communicators, so
//! the runtime and its tensors need no engine type parameter.

use sshsdp_comm::hierarchy::{self, MeshComms};
use sshsdp_comm::{Collective, CommError, CommResult, Element, ReduceOp};
use sshsdp_plan::Sharding;
use std::ops::Range;

use crate::storage::Elems;

/// Collectives of one rank over a `replicas × shards` mesh: runtime elements in the plan's format,
/// gradients in f32.
pub(crate) trait MeshComm: Send {
    /// World rank.
    fn world_rank(&self) -> usize;
    /// World size.
    fn world_size(&self) -> usize;
    /// All-gather of runtime shards over the shard group into the full bucket (under DDP the
    /// runtime shard is the whole bucket: a copy).
    fn gather_bucket(
        &self,
        sharding: Sharding,
        shard: &Elems,
        part: Range<usize>,
        full: &mut Elems,
    ) -> CommResult<()>;
    /// World-averaged gradient of this rank's piece from a full-bucket gradient.
    fn reduce_gradient(
        &self,
        sharding: Sharding,
        full: &[f32],
        piece: &mut [f32],
    ) -> CommResult<()>;
    /// After the update: rebuild the runtime shard from the replica group's pieces.
    fn rebuild_shard(&self, sharding: Sharding, shard: &mut Elems) -> CommResult<()>;
    /// Sum over the update group (the ranks whose pieces make up a bucket: the world when
    /// hierarchical, the shard group under HSDP, this rank alone under DDP).
    fn all_reduce_update_group(&self, sharding: Sharding, buf: &mut [f32]) -> CommResult<()>;
    /// Broadcast from world rank 0.
    fn broadcast_world(&self, buf: &mut [f32]) -> CommResult<()>;
    /// All-gather of equal byte strings over the world.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> CommResult<()>;
}

impl<C: Collective + Send> MeshComm for MeshComms<C> {
    fn world_rank(&self) -> usize {
        self.world.rank()
    }

    fn world_size(&self) -> usize {
        self.world.size()
    }

    fn gather_bucket(
        &self,
        sharding: Sharding,
        shard: &Elems,
        part: Range<usize>,
        full: &mut Elems,
    ) -> CommResult<()> {
        match (shard, full) {
            (Elems::F32(s), Elems::F32(f)) => gather_typed(self, sharding, &s[part], f),
            (Elems::Bf16(s), Elems::Bf16(f)) => gather_typed(self, sharding, &s[part], f),
            (Elems::U8(s), Elems::U8(f)) => gather_typed(self, sharding, &s[part], f),
            _ => Err(mixed_formats()),
        }
    }

    fn reduce_gradient(
        &self,
        sharding: Sharding,
        full: &[f32],
        piece: &mut [f32],
    ) -> CommResult<()> {
        match sharding {
            Sharding::Hierarchical => {
                let mut scratch = vec![0f32; piece.len() * self.replicas()];
                hierarchy::reduce_gradients_hierarchical(self, full, &mut scratch, piece)
            }
            Sharding::Hsdp => hierarchy::reduce_gradients_hsdp(self, full, piece),
            Sharding::Ddp => {
                piece.copy_from_slice(full);
                self.world.all_reduce(piece, ReduceOp::Avg)
            }
        }
    }

    fn rebuild_shard(&self, sharding: Sharding, shard: &mut Elems) -> CommResult<()> {
        match sharding {
            Sharding::Hierarchical => match shard {
                Elems::F32(s) => hierarchy::gather_runtime_shard(self, s),
                Elems::Bf16(s) => hierarchy::gather_runtime_shard(self, s),
                Elems::U8(s) => hierarchy::gather_runtime_shard(self, s),
            },
            // Every replica stepped the same shard with the same gradient: nothing to move.
            Sharding::Hsdp | Sharding::Ddp => Ok(()),
        }
    }

    fn all_reduce_update_group(&self, sharding: Sharding, buf: &mut [f32]) -> CommResult<()> {
        match sharding {
            Sharding::Hierarchical => self.world.all_reduce(buf, ReduceOp::Sum),
            Sharding::Hsdp => self.shard_group.all_reduce(buf, ReduceOp::Sum),
            Sharding::Ddp => Ok(()),
        }
    }

    fn broadcast_world(&self, buf: &mut [f32]) -> CommResult<()> {
        self.world.broadcast(buf, 0)
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> CommResult<()> {
        self.world.all_gather(send, recv)
    }
}

/// The bucket all-gather for one element type.
fn gather_typed<C: Collective, T: Element>(
    comms: &MeshComms<C>,
    sharding: Sharding,
    shard: &[T],
    full: &mut [T],
) -> CommResult<()> {
    match sharding {
        Sharding::Ddp => {
            full.copy_from_slice(shard);
            Ok(())
        }
        Sharding::Hierarchical | Sharding::Hsdp => comms.shard_group.all_gather(shard, full),
    }
}

fn mixed_formats() -> CommError {
    CommError::Mismatch("a shard and its receive buffer hold different runtime formats".into())
}
