//! The runtime's communication thread: it owns the rank's communicators and runs its
//! collectives in the order they were requested.
//!
//! Why a thread: Burn's autodiff runs backward holding its graph's lock, and after a backward
//! every rank's thread locks *every* graph of the process to clean up. A rank that blocked in a
//! collective inside backward (a gradient reduction, a re-gather) while a peer thread waited for
//! that lock would deadlock. Requests are therefore queued from the model's thread — in the same
//! order on every rank — and executed here, independent of what the model thread is waiting on.
//! Reductions are fire-and-forget (they overlap the rest of backward); gathers are waited for.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use sshsdp_comm::{CommError, CommResult};
use sshsdp_plan::Sharding;

use crate::comm::MeshComm;
use crate::storage::Elems;

/// One collective for the worker.
enum Request {
    Gather {
        shard: Arc<Elems>,
        part: Range<usize>,
        full_len: usize,
        reply: Sender<CommResult<Elems>>,
    },
    Reduce {
        full: Vec<f32>,
        piece_len: usize,
        reply: Sender<CommResult<Vec<f32>>>,
    },
    Rebuild {
        shard: Elems,
        reply: Sender<CommResult<Elems>>,
    },
    AllReduce {
        buf: Vec<f32>,
        reply: Sender<CommResult<Vec<f32>>>,
    },
}

/// A reply on its way: runtime elements (gathers, rebuilds) or a gradient piece (reductions).
pub(crate) struct Reply<T = Vec<f32>>(Receiver<CommResult<T>>);

impl<T> Reply<T> {
    /// Blocks until the collective is done.
    pub fn wait(self) -> CommResult<T> {
        self.0.recv().unwrap_or_else(|_| {
            Err(CommError::PeerFailed(
                "the communication thread stopped".into(),
            ))
        })
    }
}

/// Handle to the communication thread.
pub(crate) struct Worker {
    tx: Option<Sender<Request>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the thread; it owns `comm` from now on.
    pub fn start(comm: Box<dyn MeshComm>, sharding: Sharding, rank: usize) -> Self {
        let (tx, rx) = channel::<Request>();
        let thread = std::thread::Builder::new()
            .name(format!("hsdp-comm-{rank}"))
            .spawn(move || serve(comm, sharding, rx))
            .expect("spawn the communication thread");
        Self {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    fn send<T>(&self, make: impl FnOnce(Sender<CommResult<T>>) -> Request) -> Reply<T> {
        let (reply, rx) = channel();
        if let Some(tx) = &self.tx {
            // If the thread is gone the reply sender is dropped and `wait` reports it.
            let _ = tx.send(make(reply));
        }
        Reply(rx)
    }

    /// All-gather of part `part` of every rank's runtime shard (the whole shard, or the
    /// sections one pass decodes) into a new buffer of `full_len` units.
    pub fn gather(&self, shard: Arc<Elems>, part: Range<usize>, full_len: usize) -> Reply<Elems> {
        self.send(|reply| Request::Gather {
            shard,
            part,
            full_len,
            reply,
        })
    }

    /// World-averaged gradient piece of a full-bucket gradient.
    pub fn reduce(&self, full: Vec<f32>, piece_len: usize) -> Reply {
        self.send(|reply| Request::Reduce {
            full,
            piece_len,
            reply,
        })
    }

    /// Sum of `buf` over the update group (the optimizer's exchanges, e.g. Muon's split
    /// matrices).
    pub fn all_reduce(&self, buf: Vec<f32>) -> Reply {
        self.send(|reply| Request::AllReduce { buf, reply })
    }

    /// Rebuild of a runtime shard from the replica group's updated pieces.
    pub fn rebuild(&self, shard: Elems) -> Reply<Elems> {
        self.send(|reply| Request::Rebuild { shard, reply })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(comm: Box<dyn MeshComm>, sharding: Sharding, rx: Receiver<Request>) {
    let mut failed: Option<CommError> = None;
    for request in rx {
        match request {
            Request::Gather {
                shard,
                part,
                full_len,
                reply,
            } => {
                let r = run(&mut failed, || {
                    let mut full = shard.zeros_like(full_len);
                    comm.gather_bucket(sharding, &shard, part, &mut full)?;
                    Ok(full)
                });
                // Release our reference before replying, so the runtime owns the shard alone
                // again (an update then modifies it in place instead of copying it).
                drop(shard);
                let _ = reply.send(r);
            }
            Request::Reduce {
                full,
                piece_len,
                reply,
            } => {
                let r = run(&mut failed, || {
                    let mut piece = vec![0f32; piece_len];
                    comm.reduce_gradient(sharding, &full, &mut piece)?;
                    Ok(piece)
                });
                let _ = reply.send(r);
            }
            Request::AllReduce { mut buf, reply } => {
                let r = run(&mut failed, || {
                    comm.all_reduce_update_group(sharding, &mut buf)?;
                    Ok(buf)
                });
                let _ = reply.send(r);
            }
            Request::Rebuild { mut shard, reply } => {
                let r = run(&mut failed, || {
                    comm.rebuild_shard(sharding, &mut shard)?;
                    Ok(shard)
                });
                let _ = reply.send(r);
            }
        }
    }
}

/// Runs one collective unless an earlier one failed: after a failure no further collective is
/// attempted (peers would not match it) and every later request gets the first error at once.
fn run<T>(failed: &mut Option<CommError>, f: impl FnOnce() -> CommResult<T>) -> CommResult<T> {
    if let Some(e) = failed {
        return Err(e.clone());
    }
    let r = f();
    if let Err(e) = &r {
        *failed = Some(e.clone());
    }
    r
}
