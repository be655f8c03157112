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
//! After a failure the lanes still run every queued collective, which the engine fails at once
//! (see [`run`]): every rank meets the failure in the same call, and no peer waits for a call
//! this rank skipped.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sshsdp_comm::{CallTag, CommError, CommResult};
use sshsdp_plan::Sharding;

use half::bf16;

use crate::comm::{LaneFactory, LaneId, MeshComm};
use crate::config::Precision;
use crate::storage::{DeviceUnits, Elems, Gathered};
use crate::timeline::{Timeline, Track};

/// A request of the model thread; it enters the shard lane.
enum Request {
    Gather {
        tag: CallTag,
        source: ShardPart,
        full_len: usize,
        stage: Option<Box<dyn StageUnits>>,
        reply: Sender<CommResult<Gathered>>,
    },
    // Made only on `CubeBackend<CudaRuntime>` (`cube_gather.rs`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    GatherOnDevice {
        tag: CallTag,
        job: Box<dyn DeviceGatherJob>,
        reply: Sender<CommResult<Gathered>>,
    },
    Reduce {
        tag: CallTag,
        full: Vec<f32>,
        dtype: Precision,
        piece_len: usize,
        reply: Sender<CommResult<Vec<f32>>>,
    },
    ReduceOnDevice {
        tag: CallTag,
        job: Box<dyn DeviceReduceJob>,
        reply: Sender<CommResult<DeviceUnits>>,
    },
    /// Work of the replica lane, forwarded in order.
    Replica(ReplicaRequest),
}

/// What a rank sends in a bucket all-gather on host memory.
pub(crate) enum ShardPart {
    /// Units `range` of a host shard.
    Host(Arc<Elems>, Range<usize>),
    /// Units of a device shard, read back to the host on the shard lane first.
    // Made only on CubeCL backends (`cube_shard.rs`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    Device(Box<dyn ReadUnits>),
}

/// Reads runtime units of a device buffer back to the host, on a lane (so the read overlaps the
/// model thread's compute, as the gather does).
pub(crate) trait ReadUnits: Send {
    /// The units, in host memory.
    fn read(self: Box<Self>) -> CommResult<Elems>;
}

/// The buffers of an all-gather on device memory (`cube_gather.rs`), made by the model thread
/// and handed to the shard lane, which keeps them alive until the engine is done.
pub(crate) trait DeviceGatherJob: Send {
    /// The element type moved.
    fn kind(&self) -> sshsdp_comm::ElementKind;
    /// Units each rank sends.
    fn count(&self) -> usize;
    /// Called on the lane's thread: waits until the device work queued before the buffers
    /// (their writes, earlier reads of recycled memory) is done, then returns the send and
    /// receive addresses, valid while `self` lives.
    fn ready(&mut self) -> CommResult<(u64, u64)>;
    /// The receive buffer, once the engine is done with it (the resources pinned for the
    /// engine are let go).
    fn into_units(self: Box<Self>) -> DeviceUnits;
}

/// A gradient reduction of a full-bucket gradient held in device memory of the decorated
/// backend (`cube_reduce.rs`): its two stages run on the two lanes in turn, as host reductions
/// do, either by the engine on device memory (NCCL) or staged through the host.
pub(crate) trait DeviceReduceJob: Send {
    /// Shard lane: the shard-group stage.
    fn within_shard_group(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()>;
    /// Replica lane: the replica stage.
    fn across_replicas(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()>;
    /// The world-averaged gradient piece, in device memory.
    fn into_piece(self: Box<Self>) -> DeviceUnits;
}

/// Uploads gathered host units into a device buffer of the decorated backend, on the shard
/// lane (the staged path of engines without device collectives: the upload overlaps the model
/// thread's compute, as the gather does).
pub(crate) trait StageUnits: Send {
    /// `units` in a new device buffer.
    fn stage(self: Box<Self>, units: Elems) -> DeviceUnits;
}

/// Work of the replica lane.
enum ReplicaRequest {
    /// The second stage of a reduction whose first stage ran on the shard lane.
    FinishReduce {
        tag: CallTag,
        shard: CommResult<Elems>,
        piece_len: usize,
        reply: Sender<CommResult<Vec<f32>>>,
    },
    FinishReduceOnDevice {
        tag: CallTag,
        job: Box<dyn DeviceReduceJob>,
        first: CommResult<()>,
        reply: Sender<CommResult<DeviceUnits>>,
    },
    Rebuild {
        tag: CallTag,
        shard: Elems,
        reply: Sender<CommResult<Elems>>,
    },
    RebuildOnDevice {
        tag: CallTag,
        job: Box<dyn DeviceGatherJob>,
        reply: Sender<CommResult<DeviceUnits>>,
    },
    AllReduce {
        tag: CallTag,
        buf: Vec<f32>,
        reply: Sender<CommResult<Vec<f32>>>,
    },
    AllToAllV {
        tag: CallTag,
        send: Vec<f32>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        reply: Sender<CommResult<Vec<f32>>>,
    },
    WorldGatherBytes {
        tag: CallTag,
        send: Vec<u8>,
        reply: Sender<CommResult<Vec<u8>>>,
    },
    WorldBroadcast {
        tag: CallTag,
        buf: Vec<f32>,
        reply: Sender<CommResult<Vec<f32>>>,
    },
}

/// A reply on its way: runtime elements (gathers, rebuilds) or a gradient piece (reductions).
pub(crate) struct Reply<T = Vec<f32>>(Receiver<CommResult<T>>);

impl<T> Reply<T> {
    /// A reply that is already the failure `e` (a collective that could not be queued: the
    /// caller records the failure, which aborts the peers' side of it).
    pub fn failed(e: CommError) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(Err(e));
        Reply(rx)
    }

    /// Blocks until the collective is done.
    pub fn wait(self) -> CommResult<T> {
        self.0.recv().unwrap_or_else(|_| {
            Err(CommError::PeerFailed(
                "the communication thread stopped".into(),
            ))
        })
    }
}

/// The first failure of either lane, reported by every later request.
type Failure = Arc<Mutex<Option<CommError>>>;

/// Handle to the two communication lanes.
pub(crate) struct Worker {
    tx: Option<Sender<Request>>,
    /// The GPU the shard lane's engine moves device memory on (NCCL), if it can.
    device_ordinal: Option<usize>,
    threads: Vec<JoinHandle<()>>,
    /// The optimizer step the requests belong to, for their [`CallTag`]s.
    step: AtomicU64,
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
        let (tx, rx) = channel::<Request>();
        let (replica_tx, replica_rx) = channel::<ReplicaRequest>();
        // Each lane reports its connection and the GPU its engine moves device memory on.
        let (ready_tx, ready_rx) = channel::<CommResult<(LaneId, Option<usize>)>>();
        // What a lane thread runs first: connect, report, and hand back the lane to serve.
        let connect = |id: LaneId, track: Track| {
            let (factory, failure, timeline) = (factory.clone(), failure.clone(), timeline.clone());
            let ready = ready_tx.clone();
            move || match factory.connect_mesh(id, replicas, shards) {
                Ok(comm) => {
                    let _ = ready.send(Ok((id, comm.device_ordinal())));
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
            device_ordinal: None,
            threads: vec![shard_lane],
            step: AtomicU64::new(0),
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
                Ok(Ok((LaneId::Shard, ordinal))) => worker.device_ordinal = ordinal,
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

    /// The GPU the shard lane's engine moves device memory on, where it can (NCCL).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn device_ordinal(&self) -> Option<usize> {
        self.device_ordinal
    }

    /// The all-gather of [`Worker::gather`] on device memory: `job`'s buffers, filled by the
    /// engine itself (only where [`Worker::device_ordinal`] is `Some`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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

    /// Sum of `buf` over the update group (the optimizer's exchanges, e.g. Muon's split
    /// matrices).
    pub fn all_reduce(&self, buf: Vec<f32>) -> Reply {
        let tag = self.tag(None, "optimizer all-reduce");
        self.send(|reply| Request::Replica(ReplicaRequest::AllReduce { tag, buf, reply }))
    }

    /// All-to-all over the update group with per-rank counts (by update-group rank); the
    /// optimizer's owner exchanges (Muon's split matrices).
    pub fn all_to_all_v(
        &self,
        send: Vec<f32>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Reply {
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
    /// [`Worker::device_ordinal`] is `Some`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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

/// What a lane thread owns: its communicators, the shared failure flag and the timeline.
struct Lane {
    comm: Box<dyn MeshComm>,
    sharding: Sharding,
    failure: Failure,
    timeline: Arc<Timeline>,
    track: Track,
}

impl Lane {
    /// Runs one collective named `name`, labelled `tag` (see [`run`]), timed on this lane's
    /// track.
    fn run<T>(
        &self,
        name: &'static str,
        tag: CallTag,
        f: impl FnOnce() -> CommResult<T>,
    ) -> CommResult<T> {
        self.comm.set_tag(tag);
        self.timeline
            .span(self.track, name, None, || run(&self.failure, f))
    }
}

fn serve_shard_lane(lane: Lane, rx: Receiver<Request>, replica: Sender<ReplicaRequest>) {
    let (comm, sharding) = (&lane.comm, lane.sharding);
    for request in rx {
        match request {
            Request::Gather {
                tag,
                source,
                full_len,
                stage,
                reply,
            } => {
                let bucket = tag.bucket.map(|b| b as usize);
                // A device shard's part is read back first (the staged path of device shards).
                let (shard, part, downloaded) = match source {
                    ShardPart::Host(shard, part) => (Ok(shard), part, 0),
                    ShardPart::Device(reader) => {
                        let read = lane
                            .timeline
                            .span(lane.track, "download shard", bucket, || {
                                run(&lane.failure, || reader.read())
                            });
                        let (len, bytes) = read.as_ref().map_or((0, 0), |e| (e.len(), e.bytes()));
                        (read.map(Arc::new), 0..len, bytes)
                    }
                };
                let r = shard.and_then(|shard| {
                    lane.run("all-gather", tag, || {
                        let mut full = shard.zeros_like(full_len);
                        comm.gather_bucket(sharding, &shard, part, &mut full)?;
                        Ok(full)
                    })
                    // Our reference is released before replying, so the runtime owns a host
                    // shard alone again (an update then modifies it in place, not a copy).
                });
                let r = r.map(|full| match stage {
                    Some(stage) => {
                        let mut units =
                            lane.timeline
                                .span(lane.track, "upload gathered", bucket, || stage.stage(full));
                        units.downloaded += downloaded;
                        Gathered::Device(units)
                    }
                    None => Gathered::Host(full),
                });
                let _ = reply.send(r);
            }
            Request::GatherOnDevice {
                tag,
                mut job,
                reply,
            } => {
                let r = lane.run("all-gather (device)", tag, || {
                    let (send, recv) = job.ready()?;
                    // SAFETY: `job` holds both buffers (live, on the engine's GPU: checked when
                    // the runtime chose this path) until after the call; `ready` waited for the
                    // device work before them; the receive buffer is a fresh allocation.
                    unsafe { comm.gather_bucket_device(job.kind(), send, recv, job.count()) }
                });
                let _ = reply.send(r.map(|()| Gathered::Device(job.into_units())));
            }
            Request::Reduce {
                tag,
                full,
                dtype,
                piece_len,
                reply,
            } => {
                let shard = lane.run("reduce (shard group)", tag, || {
                    let full = match dtype {
                        Precision::F32 => Elems::F32(full),
                        Precision::Bf16 => {
                            Elems::Bf16(full.iter().map(|&g| bf16::from_f32(g)).collect())
                        }
                        // Refused by `HsdpConfig::validate`.
                        Precision::F16 => {
                            return Err(CommError::Mismatch(
                                "gradients reduce in f32 or bf16".into(),
                            ))
                        }
                    };
                    comm.reduce_within_shard_group(sharding, full)
                });
                let _ = replica.send(ReplicaRequest::FinishReduce {
                    tag,
                    shard,
                    piece_len,
                    reply,
                });
            }
            Request::ReduceOnDevice {
                tag,
                mut job,
                reply,
            } => {
                let first = lane.run("reduce (shard group)", tag, || {
                    job.within_shard_group(&**comm, sharding)
                });
                let _ = replica.send(ReplicaRequest::FinishReduceOnDevice {
                    tag,
                    job,
                    first,
                    reply,
                });
            }
            Request::Replica(work) => {
                let _ = replica.send(work);
            }
        }
    }
}

fn serve_replica_lane(lane: Lane, rx: Receiver<ReplicaRequest>) {
    let (comm, sharding) = (&lane.comm, lane.sharding);
    for request in rx {
        match request {
            ReplicaRequest::FinishReduce {
                tag,
                shard,
                piece_len,
                reply,
            } => {
                let r = shard.and_then(|shard| {
                    lane.run("reduce (replicas)", tag, || {
                        match comm.reduce_across_replicas(sharding, shard, piece_len)? {
                            Elems::F32(piece) => Ok(piece),
                            Elems::Bf16(piece) => Ok(piece.iter().map(|g| g.to_f32()).collect()),
                            Elems::U8(_) => Err(CommError::Mismatch(
                                "a gradient reduction returned bytes".into(),
                            )),
                        }
                    })
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::FinishReduceOnDevice {
                tag,
                mut job,
                first,
                reply,
            } => {
                let r = first.and_then(|()| {
                    lane.run("reduce (replicas)", tag, || {
                        job.across_replicas(&**comm, sharding)
                    })
                });
                let _ = reply.send(r.map(|()| job.into_piece()));
            }
            ReplicaRequest::AllReduce {
                tag,
                mut buf,
                reply,
            } => {
                let r = lane.run("all-reduce (update group)", tag, || {
                    comm.all_reduce_update_group(sharding, &mut buf)?;
                    Ok(buf)
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::AllToAllV {
                tag,
                send,
                send_counts,
                recv_counts,
                reply,
            } => {
                let r = lane.run("all-to-all (update group)", tag, || {
                    let mut recv = vec![0f32; recv_counts.iter().sum()];
                    comm.all_to_all_v_update_group(
                        sharding,
                        &send,
                        &send_counts,
                        &mut recv,
                        &recv_counts,
                    )?;
                    Ok(recv)
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::WorldGatherBytes { tag, send, reply } => {
                // Named by its stage (e.g. "gradient norm", "step verdict") on the timeline.
                let r = lane.run(tag.stage, tag, || {
                    let mut recv = vec![0u8; send.len() * comm.world_size()];
                    comm.all_gather_bytes(&send, &mut recv)?;
                    Ok(recv)
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::WorldBroadcast {
                tag,
                mut buf,
                reply,
            } => {
                let r = lane.run(tag.stage, tag, || {
                    comm.broadcast_world(&mut buf)?;
                    Ok(buf)
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::Rebuild {
                tag,
                mut shard,
                reply,
            } => {
                let r = lane.run("rebuild", tag, || {
                    comm.rebuild_shard(sharding, &mut shard)?;
                    Ok(shard)
                });
                let _ = reply.send(r);
            }
            ReplicaRequest::RebuildOnDevice {
                tag,
                mut job,
                reply,
            } => {
                let r = lane.run("rebuild (device)", tag, || {
                    let (piece, shard) = job.ready()?;
                    // SAFETY: as for `Request::GatherOnDevice`: `job` holds both buffers until
                    // after the call, `ready` waited for the device work before them, and the
                    // shard buffer is a fresh allocation.
                    unsafe {
                        comm.rebuild_shard_device(sharding, job.kind(), piece, shard, job.count())
                    }
                });
                let _ = reply.send(r.map(|()| job.into_units()));
            }
        }
    }
}

/// Runs one collective and keeps the first failure of either lane.
///
/// After a failure the lanes still run every collective the model thread queues, in order:
/// the engine fails each at once (the threads engine's aborted world, MPI's call check with
/// this rank's failure flag, an aborted NCCL communicator), so every rank meets the failure in
/// the same call and the ranks stay in step — no peer is left waiting for a call this rank
/// skipped. Where an engine cannot abort, the call runs normally and its result is discarded
/// by the runtime, which has recorded the failure.
fn run<T>(failure: &Failure, f: impl FnOnce() -> CommResult<T>) -> CommResult<T> {
    let r = f();
    let mut first = failure.lock().unwrap_or_else(|p| p.into_inner());
    match (&r, first.as_ref()) {
        (Err(e), None) => {
            *first = Some(e.clone());
            r
        }
        // Report the first failure, the cause, rather than its echo.
        (_, Some(e)) => Err(e.clone()),
        (Ok(_), None) => r,
    }
}
