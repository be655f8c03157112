//! The runtime's communication threads — two *lanes*, each owning its own communicators — and
//! why gathers can never deadlock against Burn's autodiff locks.
//!
//! # The lanes
//! * **Shard lane**: bucket all-gathers and the shard-group stage of gradient reductions
//!   (reduce-scatter within the shard group). Every request enters here, from the model thread,
//!   in program order — the same order on every rank.
//! * **Replica lane**: the replica-group stage of reductions (all-reduce or reduce-scatter across
//!   replicas; the world all-reduce under DDP), runtime-shard rebuilds and the update group's
//!   exchanges (gradient norm, Muon). It is fed only by the shard lane, which forwards each of
//!   these in the order it met them, without waiting for any of them.
//!
//! # Why a rank inside backward cannot deadlock
//! Burn's autodiff holds a graph's lock for the whole of that graph's backward, and after *every*
//! backward (even an unrelated `x.sum().backward()`) the thread that ran it locks every graph of
//! the process in turn (`cleanup_orphaned_entries`). Ranks of the threads engine (or one
//! process driving several GPUs) share that lock set, so:
//!
//! 1. Inside backward a model thread waits only for **gathers** (re-gathers after resharding,
//!    their prefetches). Gradient reductions are queued and never waited for there; the update,
//!    which waits for reductions, rebuilds and exchanges, runs outside backward.
//! 2. A gather runs on the shard lane, whose requests are the same sequence on every rank of the
//!    shard group, and the shard lane never waits for the replica lane (it hands the second
//!    stage over and moves on). So the k-th gather completes once every rank of the shard group
//!    has *requested* its k-th shard-lane collective — nothing queued on the replica lane, and
//!    no lagging replica, stands in front of it. (With one FIFO queue it waited behind a replica
//!    all-reduce whose peer, one step behind, was stuck in `cleanup_orphaned_entries` on this
//!    rank's graph lock: a cycle.)
//! 3. A shard-group peer requests that gather in its own forward or backward of the same step,
//!    and it is past its previous backward's clean-up: our forward's gathers of this step
//!    completed, which needed its requests from this step's forward. Between its forward and its
//!    backward it takes no graph lock of ours (forward registers nodes in its own graph only),
//!    and in its own backward it waits, by 1–2, only for gathers of the shard group.
//!
//! So the only waits inside backward are on shard-group peers that are themselves in a forward
//! or backward of the same step and need nothing from us but requests they are about to make.
//! The one assumption: no *other* backward runs on a rank between its forward and its backward
//! (a training loop's micro-batch is forward, then backward). The replica lane's waits happen
//! in the update, where no graph lock is held, so a replica that lags (sleeping, evaluating,
//! running another backward) only delays the update, never deadlocks it.
//!
//! This holds for any engine whose communicators progress independently on different threads
//! (threads; MPI initialised with `MPI_THREAD_MULTIPLE`; NCCL with a stream per
//! communicator); under MPI each rank is a process of its own, whose graph locks no peer shares.
//!
//! # Two lanes on one GPU (NCCL)
//! NCCL asks that communicators used at the same time on one device see their operations in
//! the same order on every rank (its "Using multiple NCCL communicators concurrently"; NVIDIA/nccl
//! #195), because a kernel blocked on a peer can keep another communicator's kernel from
//! running. Each lane's own order is the same on every rank (above), but how the two lanes
//! interleave is not: it depends on timing. The order need not be the same, because nothing
//! here lets one lane's blocked collective stop the other's:
//!
//! 1. **Issuing never waits for a peer.** Every enqueue holds its GPU's enqueue lock only while
//!    it enqueues (`sshsdp-comm/src/nccl/enqueue.rs`), and peers are connected in
//!    `ncclCommInitRank`, not in a first collective under that lock: `NcclLanes` requires
//!    `NCCL_RUNTIME_CONNECT=0` on every rank (`sshsdp-comm/src/nccl/lanes.rs`).
//! 2. **At most one NCCL kernel per lane is in flight on a GPU**: a lane waits for each
//!    collective to finish before it issues the next (`DeviceCollective` is synchronous), so a
//!    GPU holds at most two kernels that wait for peers, one per lane, on two streams (each
//!    lane's communicators come from their own unique id with their own stream; the groups split
//!    within a lane share its stream).
//! 3. **The GPU runs both at once.** Each NCCL kernel uses at most `NCCL_MAX_CTAS` blocks (32 by
//!    default, 64 at most), so two fit on any GPU with 128 SMs or more (an H100 SXM has 132;
//!    blocks of both can also share SMs); compute kernels never wait for anything, so the SMs
//!    they hold come free; and streams map to several hardware queues
//!    (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default: `NcclLanes` refuses `1`, under which one
//!    lane's kernel would queue behind the other's).
//!
//! So each lane's k-th collective, once issued by every rank of its group (which it is: 1 and
//! the lane's order), runs to completion whatever the other lane does. A device-wide
//! synchronisation on the model thread (an allocation may imply one) only waits for kernels
//! that complete by the same argument. What is not proven here: GPUs with fewer than 128 SMs
//! with both lanes' kernels at full width and a resident compute kernel that fills the rest;
//! NCCL has never run above world 1 in this project (`docs/LAUNCH.md`).
//!
//! After a failure the lanes still run every queued collective, which the engine fails at once
//! (see `serve.rs`): every rank meets the failure in the same call, and no peer waits for a call
//! this rank skipped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use sshsdp_comm::{CallTag, CommError, CommResult};
use sshsdp_plan::Sharding;

use crate::config::Precision;
use crate::runtime_units::{DeviceUnits, Elems, Gathered};
use crate::timeline::{Timeline, Track};
pub(crate) use comm::DeviceEngine;
use comm::{LaneFactory, LaneId};
use serve::{serve_replica_lane, serve_shard_lane, Failure, Lane, ReplicaRequest, Request};

pub(crate) mod comm;
mod jobs;
mod serve;

pub use comm::RUNTIME_LANES;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) use jobs::ReadUnits;
pub(crate) use jobs::{
    DeviceGatherJob, DeviceReduceJob, Reply, ShardPart, StageUnits, UpdateBuffer, UpdateReceived,
};

/// Handle to the two communication lanes.
pub(crate) struct Worker {
    tx: Option<Sender<Request>>,
    /// How the shard lane's engine moves device memory, if it can.
    device_engine: Option<DeviceEngine>,
    threads: Vec<JoinHandle<()>>,
    /// The optimizer step the requests belong to, for their [`CallTag`]s.
    step: AtomicU64,
    /// Collective calls both lanes made (groups of one make none).
    calls: Arc<AtomicU64>,
}

impl Worker {
    /// Starts both lanes, each connecting its own communicators over the `replicas × shards`
    /// mesh from `factory` on its own thread; returns once both are connected (or the first
    /// error). Each lane records its collectives in `timeline`.
    pub fn start(
        factory: Arc<dyn LaneFactory>,
        (replicas, shards): (usize, usize),
        sharding: Sharding,
        rank: usize,
        timeline: Arc<Timeline>,
    ) -> CommResult<Self> {
        let failure = Failure::default();
        let calls = Arc::new(AtomicU64::new(0));
        let (tx, rx) = channel::<Request>();
        let (replica_tx, replica_rx) = channel::<ReplicaRequest>();
        // Each lane reports its connection and the GPU its engine moves device memory on.
        let (ready_tx, ready_rx) = channel::<CommResult<(LaneId, Option<DeviceEngine>)>>();
        // What a lane thread runs first: connect, report, and hand back the lane to serve.
        let connect = |id: LaneId, track: Track| {
            let (factory, failure, timeline) = (factory.clone(), failure.clone(), timeline.clone());
            let (ready, calls) = (ready_tx.clone(), calls.clone());
            move || match factory.connect_mesh(id, (replicas, shards), calls) {
                Ok(comm) => {
                    let _ = ready.send(Ok((id, comm.device_engine())));
                    Some(Lane {
                        comm,
                        sharding,
                        failure,
                        timeline,
                        track,
                    })
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    None
                }
            }
        };
        let spawn = |name: String, body: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(body)
                .map_err(|e| CommError::Engine(format!("spawning a communication thread: {e}")))
        };
        let shard = connect(LaneId::Shard, Track::ShardLane);
        let replica = connect(LaneId::Replica, Track::ReplicaLane);
        drop(ready_tx);
        let shard_lane = spawn(
            format!("hsdp-shard-{rank}"),
            Box::new(move || {
                if let Some(lane) = shard() {
                    serve_shard_lane(lane, rx, replica_tx)
                }
            }),
        )?;
        let mut worker = Self {
            tx: Some(tx),
            device_engine: None,
            threads: vec![shard_lane],
            step: AtomicU64::new(0),
            calls,
        };
        worker.threads.push(spawn(
            format!("hsdp-replica-{rank}"),
            Box::new(move || {
                if let Some(lane) = replica() {
                    serve_replica_lane(lane, replica_rx)
                }
            }),
        )?);
        for _ in 0..2 {
            match ready_rx.recv() {
                Ok(Ok((LaneId::Shard, engine))) => worker.device_engine = engine,
                Ok(Ok(_)) => {}
                // Dropping the worker stops the lanes that did connect.
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(CommError::Engine(
                        "a communication thread stopped while connecting".into(),
                    ))
                }
            }
        }
        Ok(worker)
    }

    fn send<T>(&self, make: impl FnOnce(Sender<CommResult<T>>) -> Request) -> Reply<T> {
        let (reply, rx) = channel();
        if let Some(tx) = &self.tx {
            // If the thread is gone the reply sender is dropped and `wait` reports it.
            let _ = tx.send(make(reply));
        }
        Reply(rx)
    }

    /// The label of a request of `stage` about `bucket` in the current step.
    fn tag(&self, bucket: Option<usize>, stage: &'static str) -> CallTag {
        CallTag::new(self.step.load(Ordering::Relaxed), bucket, stage)
    }

    /// Collective calls the lanes made since the last call (engine calls: a group of one rank
    /// makes none).
    pub fn take_collective_calls(&self) -> u64 {
        self.calls.swap(0, Ordering::Relaxed)
    }

    /// Marks the end of an optimizer step: later requests carry the next step in their tags.
    pub fn end_step(&self) {
        self.step.fetch_add(1, Ordering::Relaxed);
    }

    /// All-gather of `source`, this rank's part of its runtime shard of `bucket` (the whole
    /// shard, or the sections one pass decodes), into a new buffer of `full_len` units: in host
    /// memory, then uploaded by `stage` on the lane where given.
    pub fn gather(
        &self,
        bucket: usize,
        source: ShardPart,
        full_len: usize,
        stage: Option<Box<dyn StageUnits>>,
    ) -> Reply<Gathered> {
        let tag = self.tag(Some(bucket), "gather");
        self.send(|reply| Request::Gather {
            tag,
            source,
            full_len,
            stage,
            reply,
        })
    }

    /// How the shard lane's engine moves device memory, where it can (NCCL on a GPU, or ranks
    /// of this process sharing a device).
    pub fn device_engine(&self) -> Option<DeviceEngine> {
        self.device_engine
    }

    /// The all-gather of [`Worker::gather`] on device memory: `job`'s buffers, filled by the
    /// engine itself (only where [`Worker::device_engine`] is `Some`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn gather_on_device(
        &self,
        bucket: usize,
        job: Box<dyn DeviceGatherJob>,
    ) -> Reply<Gathered> {
        let tag = self.tag(Some(bucket), "gather");
        self.send(|reply| Request::GatherOnDevice { tag, job, reply })
    }

    /// World-averaged gradient piece of `bucket`'s full-bucket gradient, reduced in `dtype`
    /// (rounded to it on the shard lane, widened back to f32 for the reply).
    pub fn reduce(
        &self,
        bucket: usize,
        full: Vec<f32>,
        dtype: Precision,
        piece_len: usize,
    ) -> Reply {
        let tag = self.tag(Some(bucket), "reduce");
        self.send(|reply| Request::Reduce {
            tag,
            full,
            dtype,
            piece_len,
            reply,
        })
    }

    /// The reduction of [`Worker::reduce`] on a full-bucket gradient in device memory (`job`);
    /// the reply is the world-averaged piece, in device memory.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn reduce_on_device(
        &self,
        bucket: usize,
        job: Box<dyn DeviceReduceJob>,
    ) -> Reply<DeviceUnits> {
        let tag = self.tag(Some(bucket), "reduce");
        self.send(|reply| Request::ReduceOnDevice { tag, job, reply })
    }

    /// Sum of `buf` (host or device memory) over the update group (the optimizer's exchanges,
    /// e.g. Muon's split matrices).
    pub fn all_reduce(&self, buf: UpdateBuffer) -> Reply<UpdateReceived> {
        let tag = self.tag(None, "optimizer all-reduce");
        self.send(|reply| Request::Replica(ReplicaRequest::AllReduce { tag, buf, reply }))
    }

    /// All-to-all over the update group with per-rank counts (by update-group rank), from
    /// host or device memory; the optimizer's owner exchanges (Muon's split matrices).
    pub fn all_to_all_v(
        &self,
        send: UpdateBuffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Reply<UpdateReceived> {
        let tag = self.tag(None, "optimizer all-to-all");
        self.send(|reply| {
            Request::Replica(ReplicaRequest::AllToAllV {
                tag,
                send,
                send_counts,
                recv_counts,
                reply,
            })
        })
    }

    /// All-gather of equal byte strings over the whole world, in rank order; `stage` names
    /// what for.
    pub fn gather_world_bytes(&self, stage: &'static str, send: Vec<u8>) -> Reply<Vec<u8>> {
        let tag = self.tag(None, stage);
        self.send(|reply| Request::Replica(ReplicaRequest::WorldGatherBytes { tag, send, reply }))
    }

    /// World rank 0's `buf` on every rank (every rank passes a buffer of the same length);
    /// `stage` names what for.
    pub fn broadcast_world(&self, stage: &'static str, buf: Vec<f32>) -> Reply {
        let tag = self.tag(None, stage);
        self.send(|reply| Request::Replica(ReplicaRequest::WorldBroadcast { tag, buf, reply }))
    }

    /// Rebuild of `bucket`'s runtime shard from the replica group's updated pieces.
    pub fn rebuild(&self, bucket: usize, shard: Elems) -> Reply<Elems> {
        let tag = self.tag(Some(bucket), "rebuild");
        self.send(|reply| Request::Replica(ReplicaRequest::Rebuild { tag, shard, reply }))
    }

    /// The rebuild of [`Worker::rebuild`] on device memory: `job` sends this rank's updated
    /// piece and receives the shard, filled by the engine itself (only where
    /// [`Worker::device_engine`] is `Some`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn rebuild_on_device(
        &self,
        bucket: usize,
        job: Box<dyn DeviceGatherJob>,
    ) -> Reply<DeviceUnits> {
        let tag = self.tag(Some(bucket), "rebuild");
        self.send(|reply| Request::Replica(ReplicaRequest::RebuildOnDevice { tag, job, reply }))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the shard lane's queue stops it, which closes the replica lane's.
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
