//! [`NcclComm`]: one rank's NCCL communicator, its state and lifecycle: creation (from an id,
//! over a bootstrap engine, as threads, by split), accessors, the entry check of every call,
//! and its release on drop.

use std::cell::Cell;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result, sys};

use super::enqueue::enqueue_lock;
use super::id::{agree_ids, NcclUniqueId};
use super::watch::{startup_timeout_from_env, timeout_from_env, Liveness};
use super::{cuda_error, nccl_error, probe};
use crate::{Collective, CommError, CommResult};

/// One rank's NCCL communicator, bound to one GPU and one CUDA stream.
///
/// Device methods (`*_dev`) enqueue on [`NcclComm::stream`] and return at once; the
/// [`Collective`] implementation on host slices stages through device memory and waits.
/// Not `Send`: create it on the thread that uses it (one thread or process per rank).
pub struct NcclComm {
    pub(super) raw: sys::ncclComm_t,
    pub(super) stream: Arc<CudaStream>,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// Whether this rank's communicators may still be used (shared with its other lanes).
    pub(super) live: Arc<Liveness>,
    /// The watchdog timeout of every wait.
    pub(super) timeout: Duration,
    /// The bound of a wait while the liveness says the run is starting.
    pub(super) startup_timeout: Duration,
    /// Set once `ncclCommAbort` has freed the communicator.
    pub(super) aborted: Cell<bool>,
    /// An NCCL communicator is driven from one thread; keeps the type `!Send` and `!Sync`.
    _not_send: PhantomData<*mut ()>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device())
            .finish_non_exhaustive()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; never panic here. An aborted communicator was
        // freed by ncclCommAbort, and waiting on its stream could hang behind a dead peer.
        if self.aborted.get() {
            return;
        }
        if self.live.failure().is_some() {
            // The rank failed while this communicator may have work queued behind a dead
            // peer: abort instead of waiting for it.
            // SAFETY: `raw` is owned by this value and not used after this call.
            let _ = unsafe { result::comm_abort(self.raw) };
            return;
        }
        // Let queued work finish, then free the communicator (ncclCommDestroy waits for this
        // rank's outstanding operations).
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: `raw` is a communicator this value owns, created by ncclCommInitRank or
        // ncclCommSplit and not destroyed before; it is not used after this call.
        let _ = unsafe { result::comm_destroy(self.raw) };
    }
}

fn to_i32(what: &str, x: usize) -> CommResult<i32> {
    i32::try_from(x)
        .map_err(|_| CommError::InvalidArgument(format!("{what} {x} does not fit NCCL's int")))
}

impl NcclComm {
    /// Joins the world of `size` ranks named by `id` as `rank`, on GPU `device` with a new
    /// stream. Blocks until all ranks have joined (`ncclCommInitRank`).
    pub fn from_id(id: &NcclUniqueId, rank: usize, size: usize, device: usize) -> CommResult<Self> {
        probe()?;
        let ctx = CudaContext::new(device).map_err(|e| cuda_error("CudaContext::new", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error("CudaContext::new_stream", e))?;
        Self::from_id_on_stream(id, rank, size, stream)
    }

    /// As [`NcclComm::from_id`], on the device and stream of `stream` (for example a stream
    /// shared with the compute that produces the buffers).
    pub fn from_id_on_stream(
        id: &NcclUniqueId,
        rank: usize,
        size: usize,
        stream: Arc<CudaStream>,
    ) -> CommResult<Self> {
        probe()?;
        if size == 0 || rank >= size {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} of a world of {size} ranks"
            )));
        }
        let (nranks, r) = (to_i32("world size", size)?, to_i32("rank", rank)?);
        // Before joining: a malformed setting fails every rank alike, with nothing to free.
        let timeout = timeout_from_env()?;
        let startup_timeout = startup_timeout_from_env()?;
        bind(&stream)?;
        let mut raw = MaybeUninit::uninit();
        // SAFETY: `raw` is written by NCCL on success and read only then; the id is a valid
        // ncclUniqueId by construction (128 bytes); the current context is the stream's device.
        let raw = unsafe {
            result::comm_init_rank(raw.as_mut_ptr(), nranks, id.raw(), r)
                .map_err(|e| nccl_error("ncclCommInitRank", e, None))?;
            raw.assume_init()
        };
        Ok(Self {
            raw,
            stream,
            rank,
            size,
            live: Arc::default(),
            timeout,
            startup_timeout,
            aborted: Cell::new(false),
            _not_send: PhantomData,
        })
    }

    /// Bootstraps a world over another engine (`boot`, e.g. MPI or threads): checks every rank
    /// has NCCL, rank 0 makes the id, `boot` broadcasts its bytes, and each rank joins with
    /// `boot`'s rank and size on GPU `device`. Collective over `boot`; if any rank lacks NCCL or
    /// rank 0 cannot make an id, every rank returns the error (no rank hangs).
    pub fn from_collective<C: Collective>(boot: &C, device: usize) -> CommResult<Self> {
        let ids = agree_ids(boot, 1)?;
        Self::from_id(&ids[0], boot.rank(), boot.size(), device)
    }

    /// Runs a one-process world: one thread per entry of `devices` (rank `i` on GPU
    /// `devices[i]`), each joining with a shared, freshly made id and then running `f`.
    /// Returns each rank's outcome in rank order: `Err` when its communicator could not be
    /// created or `f` panicked ([`CommError::PeerFailed`] with the panic message).
    ///
    /// Every rank must be able to join: if one thread fails to create its communicator after
    /// the others started, NCCL's init on the others waits for it (NCCL's bootstrap timeout).
    pub fn run_threads<R, F>(devices: &[usize], f: F) -> CommResult<Vec<CommResult<R>>>
    where
        R: Send,
        F: Fn(NcclComm) -> R + Sync,
    {
        if devices.is_empty() {
            return Err(CommError::InvalidArgument(
                "a world needs at least one rank".into(),
            ));
        }
        let id = NcclUniqueId::new()?;
        let size = devices.len();
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, &device)| {
                    let f = &f;
                    std::thread::Builder::new()
                        .name(format!("nccl-rank-{rank}"))
                        .spawn_scoped(s, move || NcclComm::from_id(&id, rank, size, device).map(f))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Err(e) => Err(CommError::Engine(format!(
                        "could not spawn the thread of rank {rank}: {e}"
                    ))),
                    Ok(h) => h.join().unwrap_or_else(|payload| {
                        let msg = payload
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        Err(CommError::PeerFailed(format!(
                            "rank {rank} panicked: {msg}"
                        )))
                    }),
                })
                .collect()
        }))
    }

    /// Splits into sub-communicators with `ncclCommSplit` (collective over this communicator):
    /// ranks with the same `color` form one, ordered by `key`, then by rank. The child uses
    /// this communicator's GPU and stream, and shares its resources (`splitShare`: no buffers
    /// or proxy of its own, a fraction of a new communicator's memory). Sharing serialises the
    /// two, which costs nothing here: the child runs on the parent's stream, and both are
    /// driven from the one thread that owns them (`NcclComm` is `!Send`), so they never run at
    /// the same time anyway. Communicators that do run at the same time (a runtime's two
    /// lanes) are never split from one another: each lane's comes from its own unique id.
    pub fn split_comm(&self, color: usize, key: usize) -> CommResult<Self> {
        const OP: &str = "ncclCommSplit";
        let (c, k) = (to_i32("split color", color)?, to_i32("split key", key)?);
        self.enter(OP)?;
        let mut child = MaybeUninit::<sys::ncclComm_t>::uninit();
        let mut config = SplitConfig::sharing();
        // SAFETY: `self.raw` is live; `child` is written by NCCL on success and read only then;
        // `config` is a valid NCCL 2.17 `ncclConfig_t` (size, magic and version set, the rest
        // NCCL's "undefined" values: NCCL copies `size` bytes into a defaulted config, so newer
        // libraries read it too) that outlives the call. The symbol was checked present by the
        // probe that ran when `self` was created.
        let child = unsafe {
            sys::ncclCommSplit(
                self.raw,
                c,
                k,
                child.as_mut_ptr(),
                (&mut config as *mut SplitConfig).cast(),
            )
            .result()
            .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
            child.assume_init()
        };
        if child.is_null() {
            return Err(CommError::Engine(format!("{OP} returned no communicator")));
        }
        // SAFETY: `child` is a live communicator just created.
        let info = unsafe { (result::comm_user_rank(child), result::comm_count(child)) };
        let (rank, size) = match info {
            (Ok(r), Ok(n)) if r >= 0 && n > 0 => (r as usize, n as usize),
            (r, n) => {
                // SAFETY: `child` is live and owned here; it is not used afterwards.
                let _ = unsafe { result::comm_destroy(child) };
                return Err(CommError::Engine(format!(
                    "{OP}: could not read the new rank and size ({r:?}, {n:?})"
                )));
            }
        };
        Ok(Self {
            raw: child,
            stream: self.stream.clone(),
            rank,
            size,
            live: self.live.clone(),
            timeout: self.timeout,
            startup_timeout: self.startup_timeout,
            aborted: Cell::new(false),
            _not_send: PhantomData,
        })
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The GPU ordinal this rank runs on.
    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The stream collectives are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (GPU) of this rank.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// The raw `ncclComm_t`, for NCCL calls this type does not wrap. Do not destroy it.
    pub fn raw(&self) -> sys::ncclComm_t {
        self.raw
    }

    /// The check before any call: `Err` once the rank has failed; then binds the stream's
    /// context to this thread.
    pub(super) fn enter(&self, op: &str) -> CommResult<()> {
        self.live.check(op)?;
        bind(&self.stream)
    }

    /// [`NcclComm::enter`] for a call that enqueues NCCL work: also takes this GPU's enqueue
    /// lock (`enqueue.rs`), held by the returned guard until the call has enqueued (never
    /// across a wait).
    pub(super) fn enter_enqueue(&self, op: &str) -> CommResult<std::sync::MutexGuard<'static, ()>> {
        self.enter(op)?;
        Ok(enqueue_lock(self.device()))
    }
}

/// `ncclConfig_t` as NCCL 2.17 defined it (the first version with `splitShare`): NCCL reads a
/// config of any earlier layout by its `size` and `version`, so this works with every library
/// the engine accepts, whatever layout cudarc's bindings were generated from.
#[repr(C)]
struct SplitConfig {
    size: usize,
    magic: std::ffi::c_uint,
    version: std::ffi::c_uint,
    blocking: std::ffi::c_int,
    cga_cluster_size: std::ffi::c_int,
    min_ctas: std::ffi::c_int,
    max_ctas: std::ffi::c_int,
    net_name: *const std::ffi::c_char,
    split_share: std::ffi::c_int,
}

impl SplitConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `splitShare = 1`.
    fn sharing() -> Self {
        /// NCCL's `NCCL_CONFIG_UNDEF_INT`: "use the default (or the parent's)".
        const UNDEF: std::ffi::c_int = std::ffi::c_int::MIN;
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            version: 2 * 10_000 + 17 * 100,
            blocking: UNDEF,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: 1,
        }
    }
}

/// Makes the stream's context current on this thread (NCCL uses the current device).
fn bind(stream: &CudaStream) -> CommResult<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| cuda_error("bind context", e))
}
