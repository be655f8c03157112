//! The two lane threads' loops: each request of the model thread run on the shard lane, and the
//! work it forwards run on the replica lane, in order, each collective labelled and timed, the
//! first failure kept (see [`run`]).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use sshsdp_comm::{CallTag, CommError, CommResult};
use sshsdp_plan::Sharding;

use half::bf16;

use super::comm::MeshComm;
use super::jobs::{
    DeviceGatherJob, DeviceReduceJob, ShardPart, StageUnits, UpdateBuffer, UpdateReceived,
};
use crate::config::Precision;
use crate::runtime_units::{DeviceUnits, Elems, Gathered};
use crate::timeline::{Timeline, Track};

/// A request of the model thread; it enters the shard lane.
pub(super) enum Request {
    Gather {
        tag: CallTag,
        source: ShardPart,
        full_len: usize,
        stage: Option<Box<dyn StageUnits>>,
        reply: Sender<CommResult<Gathered>>,
    },
    // Made only on CubeCL backends (`storage/cube/gather.rs`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
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

/// Work of the replica lane.
pub(super) enum ReplicaRequest {
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
    /// The update group's all-reduce, on host or device memory (one job, two forms).
    AllReduce {
        tag: CallTag,
        buf: UpdateBuffer,
        reply: Sender<CommResult<UpdateReceived>>,
    },
    /// The update group's all-to-all-v, on host or device memory (one job, two forms).
    AllToAllV {
        tag: CallTag,
        send: UpdateBuffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        reply: Sender<CommResult<UpdateReceived>>,
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

/// The first failure of either lane, reported by every later request.
pub(super) type Failure = Arc<Mutex<Option<CommError>>>;

/// What a lane thread owns: its communicators, the shared failure flag and the timeline.
pub(super) struct Lane {
    pub comm: Box<dyn MeshComm>,
    pub sharding: Sharding,
    pub failure: Failure,
    pub timeline: Arc<Timeline>,
    pub track: Track,
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

pub(super) fn serve_shard_lane(lane: Lane, rx: Receiver<Request>, replica: Sender<ReplicaRequest>) {
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
                let (shard, part) = match source {
                    ShardPart::Host(shard, part) => (Ok(shard), part),
                    ShardPart::Device(reader) => {
                        let read = lane
                            .timeline
                            .span(lane.track, "download shard", bucket, || {
                                run(&lane.failure, || reader.read())
                            });
                        let len = read.as_ref().map_or(0, |e| e.len());
                        (read.map(Arc::new), 0..len)
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
                        let units =
                            lane.timeline
                                .span(lane.track, "upload gathered", bucket, || stage.stage(full));
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
                    let count = job.count();
                    comm.gather_bucket_device(job.buffers()?, count)
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

pub(super) fn serve_replica_lane(lane: Lane, rx: Receiver<ReplicaRequest>) {
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
            ReplicaRequest::AllReduce { tag, buf, reply } => {
                let r = lane.run("all-reduce (update group)", tag, || match buf {
                    UpdateBuffer::Host(mut buf) => {
                        comm.all_reduce_update_group(sharding, &mut buf)?;
                        Ok(UpdateReceived::Host(buf))
                    }
                    UpdateBuffer::Device(mut job) => {
                        let count = job.count();
                        comm.all_reduce_update_group_device(sharding, job.buffers()?, count)?;
                        Ok(UpdateReceived::Device(job.into_units()))
                    }
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
                let r = lane.run("all-to-all (update group)", tag, || match send {
                    UpdateBuffer::Host(send) => {
                        let mut recv = vec![0f32; recv_counts.iter().sum()];
                        comm.all_to_all_v_update_group(
                            sharding,
                            &send,
                            &send_counts,
                            &mut recv,
                            &recv_counts,
                        )?;
                        Ok(UpdateReceived::Host(recv))
                    }
                    UpdateBuffer::Device(mut job) => {
                        comm.all_to_all_v_update_group_device(
                            sharding,
                            job.buffers()?,
                            &send_counts,
                            &recv_counts,
                        )?;
                        Ok(UpdateReceived::Device(job.into_units()))
                    }
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
                    let count = job.count();
                    comm.rebuild_shard_device(sharding, job.buffers()?, count)
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
