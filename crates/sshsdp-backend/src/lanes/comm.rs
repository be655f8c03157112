//! The communication a runtime needs, as an object-safe trait over a mesh's communicators, so
//! the runtime and its tensors need no engine type parameter.
//!
//! Every method belongs to one of the worker's two lanes (see `lanes/`): the *shard lane*
//! (bucket gathers, the shard-group stage of gradient reductions) or the *replica lane* (the
//! replica-group stage of reductions, runtime-shard rebuilds, the update group's exchanges).
//! Each lane owns its own set of communicators, made on the lane's thread from the user's
//! [`CommFactory`] ([`LaneFactory::connect_mesh`]), so communicators that cannot cross threads
//! (NCCL's) work as well as those that can.

use sshsdp_comm::hierarchy::{self, check_len, MeshComms, MeshGroup};
use sshsdp_comm::peers::PeerOp;
use sshsdp_comm::{
    CallTag, Collective, CommError, CommFactory, CommResult, Element, ReduceOp, Reducible,
};
use sshsdp_plan::Sharding;
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::runtime_units::Elems;

/// The lanes of a runtime: the model thread's during `shard` (registration), then the shard
/// lane's and the replica lane's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneId {
    /// The model thread, during `shard` only.
    Bootstrap = 0,
    /// Gathers and the shard-group stage of reductions.
    Shard = 1,
    /// The replica-group stage, rebuilds and the update group's exchanges.
    Replica = 2,
}

/// How many lanes a runtime connects: what a [`CommFactory`] handed to `Shard::run_on` must offer.
pub const RUNTIME_LANES: usize = 3;

/// A [`CommFactory`] seen without its communicator type: makes a lane's mesh communicators on
/// the calling thread.
pub(crate) trait LaneFactory: Send + Sync {
    /// This rank's index in the world.
    fn world_rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;
    /// Number of lanes the factory makes.
    fn lanes(&self) -> usize;
    /// Lane `lane`'s communicators over a `replicas × shards` mesh (collective over the lane),
    /// counting their collective calls into `calls`.
    fn connect_mesh(
        &self,
        lane: LaneId,
        mesh: (usize, usize),
        calls: Arc<AtomicU64>,
    ) -> CommResult<Box<dyn MeshComm>>;
    /// Fails every lane's communicators on every rank, where the engine can.
    fn abort_all(&self, reason: &str);
    /// The first optimizer step is done ([`CommFactory::end_startup`]).
    fn startup_done(&self);
}

impl<F: CommFactory> LaneFactory for F {
    fn world_rank(&self) -> usize {
        self.rank()
    }

    fn world_size(&self) -> usize {
        self.size()
    }

    fn lanes(&self) -> usize {
        CommFactory::lanes(self)
    }

    fn connect_mesh(
        &self,
        lane: LaneId,
        (replicas, shards): (usize, usize),
        calls: Arc<AtomicU64>,
    ) -> CommResult<Box<dyn MeshComm>> {
        let world = self.connect(lane as usize)?;
        let mesh = MeshComms::new(world, replicas, shards)?.with_call_counter(calls);
        Ok(Box::new(mesh))
    }

    fn abort_all(&self, reason: &str) {
        self.abort(reason);
    }

    fn startup_done(&self) {
        CommFactory::end_startup(self);
    }
}

/// Collectives of one rank over a `replicas × shards` mesh: runtime elements in the plan's format,
/// gradients in f32. Used only on the thread that made it.
pub(crate) trait MeshComm {
    /// World rank.
    fn world_rank(&self) -> usize;
    /// World size.
    fn world_size(&self) -> usize;
    /// Labels the calls that follow (step, bucket, stage), so that engines that check labels
    /// report ranks making different calls instead of pairing them.
    fn set_tag(&self, tag: CallTag);
    /// Shard lane. All-gather of runtime shards over the shard group into the full bucket
    /// (under DDP the runtime shard is the whole bucket: a copy).
    fn gather_bucket(
        &self,
        sharding: Sharding,
        shard: &Elems,
        part: Range<usize>,
        full: &mut Elems,
    ) -> CommResult<()>;
    /// How the shard group's engine moves device memory, where it can: NCCL on its GPU, or
    /// ranks of this process exchanging device buffers (the threads engine); `None` for engines
    /// that move host memory only (MPI), whose gathers stage through the host.
    fn device_engine(&self) -> Option<DeviceEngine>;
    /// Shard lane. The bucket all-gather of [`MeshComm::gather_bucket`] on device memory:
    /// `count` units of every rank of the shard group from `bufs`' send buffer into its
    /// receive buffer, in rank order (under DDP the group is this rank alone: a copy). Returns
    /// once done.
    fn gather_bucket_device(&self, bufs: &mut dyn DeviceBuffers, count: usize) -> CommResult<()>;
    /// Shard lane. The first stage of a gradient reduction ([`MeshComm::reduce_within_shard_group`])
    /// on device memory: the full-bucket gradient (`bufs`' send, `S · shard_len` units) becomes
    /// the shard group's *sum* of this rank's shard (its receive, `shard_len`; the device path
    /// only sums, and the caller divides once by the world size after both stages). Under DDP
    /// nothing moves (the caller passes the full gradient on as the shard).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn reduce_within_shard_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        shard_len: usize,
    ) -> CommResult<()>;
    /// Replica lane. The second stage ([`MeshComm::reduce_across_replicas`]) on device
    /// memory: the shard (`bufs`' send) becomes the world-summed piece (its receive,
    /// `piece_len` units): a reduce-scatter across replicas when hierarchical; in place across
    /// replicas under HSDP and over the world under DDP.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn reduce_across_replicas_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        piece_len: usize,
    ) -> CommResult<()>;
    /// Shard lane. First stage of a gradient reduction: a full-bucket gradient (f32 or bf16,
    /// the reduction dtype) becomes the shard group's average of this rank's 1/S shard (under
    /// DDP the whole bucket, unchanged).
    fn reduce_within_shard_group(&self, sharding: Sharding, full: Elems) -> CommResult<Elems>;
    /// Replica lane. Second stage: the first stage's result becomes the world-averaged gradient
    /// of this rank's piece (`piece_len` elements), across the replica group (the world under
    /// DDP), in the same dtype.
    fn reduce_across_replicas(
        &self,
        sharding: Sharding,
        shard: Elems,
        piece_len: usize,
    ) -> CommResult<Elems>;
    /// Replica lane. After the update: rebuild the runtime shard from the replica group's
    /// pieces.
    fn rebuild_shard(&self, sharding: Sharding, shard: &mut Elems) -> CommResult<()>;
    /// Replica lane. [`MeshComm::rebuild_shard`] on device memory: `piece_len` units (`bufs`'
    /// send) from every rank of the replica group into the shard (its receive; hierarchical
    /// sharding only: elsewhere a shard is one piece, with nothing to rebuild).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn rebuild_shard_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        piece_len: usize,
    ) -> CommResult<()>;
    /// Replica lane. Sum over the update group (the ranks whose pieces make up a bucket: the
    /// world when hierarchical, the shard group under HSDP, this rank alone under DDP).
    fn all_reduce_update_group(&self, sharding: Sharding, buf: &mut [f32]) -> CommResult<()>;
    /// Replica lane. [`MeshComm::all_reduce_update_group`] on device memory: `count` f32 units
    /// of `bufs` (one buffer, in place) summed over the update group (nothing under DDP).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn all_reduce_update_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        count: usize,
    ) -> CommResult<()>;
    /// Replica lane. [`MeshComm::all_to_all_v_update_group`] on device memory: `bufs`' send
    /// buffer (chunks for each update-group rank, packed in rank order) into its receive buffer
    /// (what each rank sent, in rank order), on the peers engine (NCCL's is not wired: an
    /// `Unavailable` error; under DDP the group is this rank alone and the caller moves nothing).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn all_to_all_v_update_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> CommResult<()>;
    /// Replica lane. All-to-all with per-peer counts over the update group (counts indexed by
    /// update-group rank; under DDP the group is this rank alone: `recv` is `send`).
    fn all_to_all_v_update_group(
        &self,
        sharding: Sharding,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> CommResult<()>;
    /// Broadcast from world rank 0 (registration, before the lanes start).
    fn broadcast_world(&self, buf: &mut [f32]) -> CommResult<()>;
    /// All-gather of equal byte strings over the world (registration; the replica lane for
    /// agreements between all ranks, such as a checkpoint's commit).
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> CommResult<()>;
}

impl<C: Collective> MeshComm for MeshComms<C> {
    fn world_rank(&self) -> usize {
        self.world().rank()
    }

    fn world_size(&self) -> usize {
        self.world().size()
    }

    fn set_tag(&self, tag: CallTag) {
        MeshComms::set_tag(self, tag);
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

    fn device_engine(&self) -> Option<DeviceEngine> {
        let group = self.world();
        match (group.device(), group.peers()) {
            (Some(gpu), _) => Some(DeviceEngine::Gpu(gpu.device_ordinal())),
            (None, Some(_)) => Some(DeviceEngine::Peers),
            (None, None) => None,
        }
    }

    fn gather_bucket_device(&self, bufs: &mut dyn DeviceBuffers, count: usize) -> CommResult<()> {
        bufs.run(
            device_group(self.calling(MeshGroup::Shard))?,
            PeerOp::AllGather,
            count,
        )
    }

    fn reduce_within_shard_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        shard_len: usize,
    ) -> CommResult<()> {
        match sharding {
            Sharding::Ddp => Ok(()),
            Sharding::Hierarchical | Sharding::Hsdp => bufs.run(
                device_group(self.calling(MeshGroup::Shard))?,
                PeerOp::ReduceScatter,
                shard_len,
            ),
        }
    }

    fn reduce_across_replicas_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        piece_len: usize,
    ) -> CommResult<()> {
        let (group, op) = match sharding {
            Sharding::Hierarchical => (replica_stage(sharding), PeerOp::ReduceScatter),
            Sharding::Hsdp | Sharding::Ddp => (replica_stage(sharding), PeerOp::AllReduce),
        };
        bufs.run(device_group(self.calling(group))?, op, piece_len)
    }

    fn reduce_within_shard_group(&self, sharding: Sharding, full: Elems) -> CommResult<Elems> {
        match full {
            Elems::F32(full) => reduce_within_typed(self, sharding, full).map(Elems::F32),
            Elems::Bf16(full) => reduce_within_typed(self, sharding, full).map(Elems::Bf16),
            Elems::U8(_) => Err(not_a_gradient()),
        }
    }

    fn reduce_across_replicas(
        &self,
        sharding: Sharding,
        shard: Elems,
        piece_len: usize,
    ) -> CommResult<Elems> {
        match shard {
            Elems::F32(s) => reduce_across_typed(self, sharding, s, piece_len).map(Elems::F32),
            Elems::Bf16(s) => reduce_across_typed(self, sharding, s, piece_len).map(Elems::Bf16),
            Elems::U8(_) => Err(not_a_gradient()),
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

    fn rebuild_shard_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        piece_len: usize,
    ) -> CommResult<()> {
        match sharding {
            Sharding::Hierarchical => bufs.run(
                device_group(self.calling(MeshGroup::Replica))?,
                PeerOp::AllGather,
                piece_len,
            ),
            Sharding::Hsdp | Sharding::Ddp => Err(CommError::InvalidArgument(
                "a shard rebuild under HSDP or DDP, whose shards are one piece".into(),
            )),
        }
    }

    fn all_reduce_update_group(&self, sharding: Sharding, buf: &mut [f32]) -> CommResult<()> {
        match self.calling(update_group(sharding)) {
            Some(group) => group.all_reduce(buf, ReduceOp::Sum),
            None => Ok(()),
        }
    }

    fn all_reduce_update_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        count: usize,
    ) -> CommResult<()> {
        match self.calling(update_group(sharding)) {
            Some(group) => bufs.run(device_group(Some(group))?, PeerOp::AllReduce, count),
            None => Ok(()),
        }
    }

    fn all_to_all_v_update_group_device(
        &self,
        sharding: Sharding,
        bufs: &mut dyn DeviceBuffers,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        let op = PeerOp::AllToAllV {
            send: send_counts,
            recv: recv_counts,
        };
        bufs.run(device_group(self.calling(update_group(sharding)))?, op, 0)
    }

    fn all_to_all_v_update_group(
        &self,
        sharding: Sharding,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        match self.calling(update_group(sharding)) {
            Some(group) => group.all_to_all_v(send, send_counts, recv, recv_counts),
            None => {
                if send.len() != recv.len() {
                    return Err(CommError::InvalidArgument(format!(
                        "all_to_all_v on one rank: {} elements sent, {} expected",
                        send.len(),
                        recv.len()
                    )));
                }
                recv.copy_from_slice(send);
                Ok(())
            }
        }
    }

    fn broadcast_world(&self, buf: &mut [f32]) -> CommResult<()> {
        match self.calling(MeshGroup::World) {
            Some(world) => world.broadcast(buf, 0),
            None => Ok(()),
        }
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> CommResult<()> {
        match self.calling(MeshGroup::World) {
            Some(world) => world.all_gather(send, recv),
            None => {
                check_len("all_gather_bytes", recv.len(), send.len())?;
                recv.copy_from_slice(send);
                Ok(())
            }
        }
    }
}

/// The update group (the ranks whose pieces make up a bucket: the world when hierarchical, the
/// shard group under HSDP, this rank alone under DDP, whose shard group is one rank).
fn update_group(sharding: Sharding) -> MeshGroup {
    match sharding {
        Sharding::Hierarchical => MeshGroup::World,
        Sharding::Hsdp | Sharding::Ddp => MeshGroup::Shard,
    }
}

/// `comm`'s collectives on device memory, or why there are none; a group of one rank (`None`)
/// calls no engine ([`DeviceGroup::Alone`]).
fn device_group<C: Collective>(comm: Option<&C>) -> CommResult<DeviceGroup<'_>> {
    let Some(comm) = comm else {
        return Ok(DeviceGroup::Alone);
    };
    match (comm.device(), comm.peers()) {
        (Some(gpu), _) => Ok(DeviceGroup::Addresses(gpu)),
        (None, Some(peers)) => Ok(DeviceGroup::Peers(peers)),
        (None, None) => Err(CommError::Unavailable(
            "this engine has no collectives on device memory".into(),
        )),
    }
}

/// How a lane's engine moves device memory ([`MeshComm::device_engine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceEngine {
    /// NCCL, on the GPU of this CUDA ordinal.
    Gpu(usize),
    /// Ranks of this process exchanging buffers of the one device they share
    /// ([`sshsdp_comm::peers`]): the threads engine.
    Peers,
}

/// One communicator's collectives on device memory, as a collective's buffers meet them.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) enum DeviceGroup<'a> {
    /// An engine that moves device memory named by raw addresses (NCCL).
    Addresses(&'a dyn sshsdp_comm::DeviceCollective),
    /// Ranks of this process that exchange descriptions of their buffers; the buffers' own
    /// kernels move the data (`storage/cube/exchange.rs`).
    Peers(&'a dyn sshsdp_comm::peers::PeerExchange),
    /// A group of this rank alone: no engine is called; the result is the input, copied where
    /// the receive buffer is apart (callers skip such stages where they can alias the buffers).
    Alone,
}

/// One rank's buffers of one collective on device memory (a send and a receive buffer, or one
/// in place), held by the storage of a CubeCL runtime (`storage/cube/exchange.rs`): the seam
/// both device engines meet.
pub(crate) trait DeviceBuffers {
    /// Runs `op` on `count` units (as [`PeerOp`] defines its buffers) over `group`; returns once
    /// the device work is complete (the buffers may be read, reused or freed).
    fn run(&mut self, group: DeviceGroup<'_>, op: PeerOp, count: usize) -> CommResult<()>;
}

/// The bucket all-gather for one element type.
fn gather_typed<C: Collective, T: Element>(
    comms: &MeshComms<C>,
    sharding: Sharding,
    shard: &[T],
    full: &mut [T],
) -> CommResult<()> {
    let group = match sharding {
        Sharding::Ddp => None,
        Sharding::Hierarchical | Sharding::Hsdp => comms.calling(MeshGroup::Shard),
    };
    match group {
        Some(group) => group.all_gather(shard, full),
        // Under DDP, or one shard per replica: the shard is the whole bucket.
        None => {
            check_len("bucket all-gather", full.len(), shard.len())?;
            full.copy_from_slice(shard);
            Ok(())
        }
    }
}

/// The shard-group stage of a gradient reduction for one element type.
fn reduce_within_typed<C: Collective, T: Reducible>(
    comms: &MeshComms<C>,
    sharding: Sharding,
    full: Vec<T>,
) -> CommResult<Vec<T>> {
    // Under DDP, or a shard group of one: the shard is the full gradient (no copy).
    if sharding == Sharding::Ddp || comms.group(MeshGroup::Shard).is_none() {
        return Ok(full);
    }
    let mut shard = vec![T::default(); full.len() / comms.shards()];
    hierarchy::reduce_within_shard_group(comms, &full, &mut shard)?;
    Ok(shard)
}

/// The replica stage of a gradient reduction for one element type.
fn reduce_across_typed<C: Collective, T: Reducible>(
    comms: &MeshComms<C>,
    sharding: Sharding,
    mut shard: Vec<T>,
    piece_len: usize,
) -> CommResult<Vec<T>> {
    if comms.group(replica_stage(sharding)).is_none() {
        // A replica group of one (or world 1 under DDP): the shard is the piece (no copy).
        check_len("gradient piece", shard.len(), piece_len)?;
        return Ok(shard);
    }
    match sharding {
        Sharding::Hierarchical => {
            let mut piece = vec![T::default(); piece_len];
            hierarchy::reduce_across_replicas_hierarchical(comms, &shard, &mut piece)?;
            Ok(piece)
        }
        Sharding::Hsdp => {
            hierarchy::reduce_across_replicas_hsdp(comms, &mut shard)?;
            Ok(shard)
        }
        Sharding::Ddp => {
            if let Some(world) = comms.calling(MeshGroup::World) {
                world.all_reduce(&mut shard, ReduceOp::Avg)?;
            }
            Ok(shard)
        }
    }
}

/// The group of a gradient reduction's second stage: across replicas, or the world under DDP.
fn replica_stage(sharding: Sharding) -> MeshGroup {
    match sharding {
        Sharding::Hierarchical | Sharding::Hsdp => MeshGroup::Replica,
        Sharding::Ddp => MeshGroup::World,
    }
}

fn not_a_gradient() -> CommError {
    CommError::Mismatch("gradients are reduced in f32 or bf16, not bytes".into())
}

fn mixed_formats() -> CommError {
    CommError::Mismatch("a shard and its receive buffer hold different runtime formats".into())
}
