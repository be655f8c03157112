//! [`NcclComm`]: one rank's NCCL communicator, its bootstrap and its device-buffer collectives.

use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{result, sys};

use super::enqueue::enqueue_lock;
use super::watch::{timeout_from_env, wait_until, Liveness, Progress};
use super::{cuda_error, nccl_dtype, nccl_error, probe, DeviceElement};
use crate::collective::{check_chunks, check_counts, check_root, counts_mismatch, equal_chunks};
use crate::{Collective, CommError, CommResult, ElementKind, ReduceOp};

/// Length in bytes of an NCCL unique id.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// The id every rank of a new NCCL world must share: 128 opaque bytes made by one rank
/// ([`NcclUniqueId::new`]) and sent to the others by any means ([`NcclUniqueId::as_bytes`],
/// [`NcclUniqueId::from_bytes`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    bytes: [u8; NCCL_UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclUniqueId").finish_non_exhaustive()
    }
}

impl NcclUniqueId {
    /// Makes a new id (`ncclGetUniqueId`); call it on one rank only.
    ///
    /// [`CommError::Unavailable`] when NCCL or CUDA is missing (see [`probe`]).
    pub fn new() -> CommResult<Self> {
        probe()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e, None))?;
        let mut bytes = [0u8; NCCL_UNIQUE_ID_BYTES];
        for (b, &c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = c as u8;
        }
        Ok(Self { bytes })
    }

    /// Rebuilds an id from the bytes another rank sent ([`NcclUniqueId::as_bytes`]).
    pub fn from_bytes(bytes: &[u8]) -> CommResult<Self> {
        let bytes: [u8; NCCL_UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            CommError::InvalidArgument(format!(
                "an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, not {}",
                bytes.len()
            ))
        })?;
        Ok(Self { bytes })
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; NCCL_UNIQUE_ID_BYTES] {
        &self.bytes
    }

    fn raw(&self) -> sys::ncclUniqueId {
        let mut internal = [0 as std::ffi::c_char; NCCL_UNIQUE_ID_BYTES];
        for (c, &b) in internal.iter_mut().zip(self.bytes.iter()) {
            *c = b as std::ffi::c_char;
        }
        sys::ncclUniqueId { internal }
    }
}

/// One rank's NCCL communicator, bound to one GPU and one CUDA stream.
///
/// Device methods (`*_dev`) enqueue on [`NcclComm::stream`] and return at once; the
/// [`Collective`] implementation on host slices stages through device memory and waits.
/// Not `Send`: create it on the thread that uses it (one thread or process per rank).
pub struct NcclComm {
    raw: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    /// Whether this rank's communicators may still be used (shared with its other lanes).
    live: Arc<Liveness>,
    /// The watchdog timeout of every wait.
    timeout: Duration,
    /// Set once `ncclCommAbort` has freed the communicator.
    aborted: Cell<bool>,
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

    /// Waits until everything enqueued on the stream (collectives included) has finished, and
    /// reports an asynchronous CUDA error if one was recorded.
    ///
    /// A bounded wait (see `watch.rs`): it polls the stream, NCCL's asynchronous error and this
    /// rank's liveness, and gives up after the watchdog timeout ([`NcclComm::timeout`]). On an
    /// error, an abort or a timeout the communicator is aborted (`ncclCommAbort`), the rank's
    /// other lanes fail their next call, and this call returns the error.
    pub fn synchronize(&self) -> CommResult<()> {
        const OP: &str = "synchronize";
        self.enter(OP)?;
        if let Err(failure) = wait_until(|| self.progress(), &self.live, self.timeout) {
            let e = failure.into_error(OP);
            self.abort_comm(&e.to_string());
            return Err(e);
        }
        self.context()
            .check_err()
            .map_err(|e| cuda_error("asynchronous CUDA error", e))
    }

    /// The watchdog timeout of [`NcclComm::synchronize`] (default
    /// [`DEFAULT_NCCL_TIMEOUT`](super::DEFAULT_NCCL_TIMEOUT), or
    /// [`NCCL_TIMEOUT_ENV`](super::NCCL_TIMEOUT_ENV) seconds).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the watchdog timeout of this communicator's waits.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Shares `live` with other communicators of this rank (e.g. its lanes): a failure or abort
    /// of one fails the next call of every other.
    pub fn with_liveness(mut self, live: Arc<Liveness>) -> Self {
        self.live = live;
        self
    }

    /// The liveness this communicator shares with the rank's others; [`Liveness::fail`] on it
    /// ends waits in progress with an error and fails later calls before they enqueue.
    pub fn liveness(&self) -> Arc<Liveness> {
        self.live.clone()
    }

    /// The check before any call: `Err` once the rank has failed; then binds the stream's
    /// context to this thread.
    fn enter(&self, op: &str) -> CommResult<()> {
        self.live.check(op)?;
        bind(&self.stream)
    }

    /// [`NcclComm::enter`] for a call that enqueues NCCL work: also takes this GPU's enqueue
    /// lock (`enqueue.rs`), held by the returned guard until the call has enqueued (never
    /// across a wait).
    fn enter_enqueue(&self, op: &str) -> CommResult<std::sync::MutexGuard<'static, ()>> {
        self.enter(op)?;
        Ok(enqueue_lock(self.device()))
    }

    /// One look at the work queued on this communicator's stream.
    fn progress(&self) -> Progress {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.raw` is live (not aborted: `enter` checked the liveness, which an abort
        // sets first); `state` is a valid out-pointer. The symbol was checked by the probe.
        let got = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        if got != sys::ncclResult_t::ncclSuccess {
            return Progress::Failed(
                nccl_error("ncclCommGetAsyncError", NcclError(got), None).to_string(),
            );
        }
        if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress {
            return Progress::Failed(
                nccl_error("asynchronous NCCL error", NcclError(state), Some(self.raw)).to_string(),
            );
        }
        // SAFETY: the stream is live for as long as `self` holds it.
        match unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) } {
            cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS => Progress::Done,
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY => Progress::Pending,
            e => Progress::Failed(format!("cuStreamQuery: {e:?}")),
        }
    }

    /// Marks the rank failed and aborts this communicator (once): `ncclCommAbort` stops its
    /// kernels and frees it, so the stream drains and nothing waits on a dead peer.
    fn abort_comm(&self, reason: &str) {
        self.live.fail(reason);
        if !self.aborted.replace(true) {
            // SAFETY: `self.raw` is live and not used again (`aborted` is set; every call
            // checks the liveness, failed above, before touching it).
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }

    fn check_buffer<D: DeviceElement, B: DeviceSlice<D>>(&self, op: &str, b: &B) -> CommResult<()> {
        let ordinal = b.stream().context().ordinal();
        if ordinal != self.device() {
            return Err(CommError::InvalidArgument(format!(
                "{op}: buffer on GPU {ordinal}, communicator on GPU {}",
                self.device()
            )));
        }
        Ok(())
    }

    fn nccl_op(
        &self,
        op: &str,
        kind: ElementKind,
        reduce: ReduceOp,
    ) -> CommResult<sys::ncclRedOp_t> {
        match (reduce, kind) {
            (ReduceOp::Sum, _) => Ok(sys::ncclRedOp_t::ncclSum),
            // The average over one rank is the value itself, exactly what `ncclSum` returns.
            // And `ncclAvg` is wrong there: NCCL 2.28.9 on an H200 (world 1) left the last 3 of
            // 2^20 + 3 elements of an out-of-place reduce-scatter unwritten (2^20 right), in
            // f32 and bf16, while `ncclSum` and an `ncclAvg` all-reduce were right.
            (ReduceOp::Avg, ElementKind::F32 | ElementKind::Bf16) if self.size == 1 => {
                Ok(sys::ncclRedOp_t::ncclSum)
            }
            (ReduceOp::Avg, ElementKind::U8) => Err(CommError::InvalidArgument(format!(
                "{op}: averaging u8 is not supported"
            ))),
            (ReduceOp::Avg, _) => Ok(sys::ncclRedOp_t::ncclAvg),
        }
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// In-place all-gather on the device: `buf` holds `size` chunks; chunk `rank` is this rank's
    /// input and the others are filled from the peers. Uses NCCL's in-place convention
    /// (`sendbuff = recvbuff + rank · chunk`): no staging buffer.
    pub fn all_gather_in_place_dev<D: DeviceElement, B: DevicePtrMut<D>>(
        &self,
        buf: &mut B,
    ) -> CommResult<()> {
        const OP: &str = "all_gather_in_place_dev";
        self.check_buffer(OP, buf)?;
        let chunk = equal_chunks(OP, buf.len(), self.size)?;
        if chunk == 0 {
            return Ok(());
        }
        let _serial = self.enter_enqueue(OP)?;
        let (ptr, _write) = buf.device_ptr_mut(&self.stream);
        let send = ptr + (self.rank * chunk * std::mem::size_of::<D>()) as CUdeviceptr;
        // SAFETY: `ptr` is a live device allocation of `size · chunk` elements of D on this
        // comm's GPU, borrowed mutably for the call; `send` is its chunk `rank` (NCCL's in-place
        // all-gather). The stream waits for prior work on the buffer (cudarc events) and `_write`
        // records this write when dropped after the enqueue.
        unsafe {
            result::all_gather(
                send as *const c_void,
                ptr as *mut c_void,
                chunk,
                nccl_dtype(D::KIND),
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// All-gather on the device: `recv` (`size · send.len()`) receives every rank's `send` in
    /// rank order.
    pub fn all_gather_dev<D: DeviceElement, S: DevicePtr<D>, R: DevicePtrMut<D>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> CommResult<()> {
        const OP: &str = "all_gather_dev";
        self.check_buffer(OP, send)?;
        self.check_buffer(OP, recv)?;
        check_chunks(OP, "recv", recv.len(), send.len(), self.size)?;
        if send.is_empty() {
            return Ok(());
        }
        let _serial = self.enter_enqueue(OP)?;
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = recv.device_ptr_mut(&self.stream);
        // SAFETY: `src` holds send.len() elements and `dst` size · send.len(), both live device
        // allocations on this GPU; distinct Rust borrows, so they do not overlap.
        unsafe {
            result::all_gather(
                src as *const c_void,
                dst as *mut c_void,
                send.len(),
                nccl_dtype(D::KIND),
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// Reduce-scatter on the device: `send` holds `size` chunks of `recv.len()`; `recv` gets
    /// the reduction of chunk `rank` over all ranks. [`ReduceOp::Avg`] is `ncclAvg`.
    pub fn reduce_scatter_dev<D: DeviceElement, S: DevicePtr<D>, R: DevicePtrMut<D>>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> CommResult<()> {
        const OP: &str = "reduce_scatter_dev";
        self.check_buffer(OP, send)?;
        self.check_buffer(OP, recv)?;
        let redop = self.nccl_op(OP, D::KIND, op)?;
        check_chunks(OP, "send", send.len(), recv.len(), self.size)?;
        let count = recv.len();
        if count == 0 {
            return Ok(());
        }
        let _serial = self.enter_enqueue(OP)?;
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = recv.device_ptr_mut(&self.stream);
        // SAFETY: `src` holds size · recv.len() elements and `dst` recv.len(), both live device
        // allocations on this GPU; distinct Rust borrows, so they do not overlap.
        unsafe {
            result::reduce_scatter(
                src as *const c_void,
                dst as *mut c_void,
                count,
                nccl_dtype(D::KIND),
                redop,
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// All-to-all with per-peer counts on the device (see [`Collective::all_to_all_v`]): one
    /// `ncclSend` and one `ncclRecv` per peer with a non-empty chunk, in one NCCL group. The
    /// counts are first all-gathered (16 bytes per rank and peer, through the host) and checked
    /// pair by pair, so counts that disagree are [`CommError::Mismatch`] on every rank instead
    /// of a hang.
    pub fn all_to_all_v_dev<D: DeviceElement, S: DevicePtr<D>, R: DevicePtrMut<D>>(
        &self,
        send: &S,
        send_counts: &[usize],
        recv: &mut R,
        recv_counts: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all_v_dev";
        self.check_buffer(OP, send)?;
        self.check_buffer(OP, recv)?;
        check_counts(OP, "send", send.len(), send_counts, self.size)?;
        check_counts(OP, "recv", recv.len(), recv_counts, self.size)?;
        let mine: Vec<u8> = send_counts
            .iter()
            .chain(recv_counts)
            .flat_map(|&c| (c as u64).to_le_bytes())
            .collect();
        let mut all = vec![0u8; mine.len() * self.size];
        Collective::all_gather(self, &mine, &mut all)?;
        let counts: Vec<Vec<usize>> = all
            .chunks(mine.len())
            .map(|r| {
                r.chunks(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
                    .collect()
            })
            .collect();
        let sends: Vec<&[usize]> = counts.iter().map(|c| &c[..self.size]).collect();
        let recvs: Vec<&[usize]> = counts.iter().map(|c| &c[self.size..]).collect();
        if let Some(msg) = counts_mismatch(OP, &sends, &recvs) {
            return Err(CommError::Mismatch(msg));
        }
        let _serial = self.enter_enqueue(OP)?;
        let elem = std::mem::size_of::<D>() as u64;
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = recv.device_ptr_mut(&self.stream);
        let (mut s_at, mut r_at) = (0u64, 0u64);
        result::group_start().map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        let mut posted = Ok(());
        for peer in 0..self.size {
            let (sn, rn) = (send_counts[peer], recv_counts[peer]);
            // SAFETY: [s_at, s_at + sn) lies in `send` and [r_at, r_at + rn) in `recv` (their
            // counts add up to their lengths), live device allocations on this GPU; distinct
            // Rust borrows, so they do not overlap. The peer posts the matching call (checked).
            let r = unsafe {
                let sent = match sn {
                    0 => Ok(()),
                    _ => result::send(
                        (src + s_at * elem) as *const c_void,
                        sn,
                        nccl_dtype(D::KIND),
                        peer as i32,
                        self.raw,
                        self.cu_stream(),
                    )
                    .map(|_| ()),
                };
                sent.and_then(|()| match rn {
                    0 => Ok(()),
                    _ => result::recv(
                        (dst + r_at * elem) as *mut c_void,
                        rn,
                        nccl_dtype(D::KIND),
                        peer as i32,
                        self.raw,
                        self.cu_stream(),
                    )
                    .map(|_| ()),
                })
            };
            if let Err(e) = r {
                posted = Err(nccl_error(OP, e, Some(self.raw)));
                break;
            }
            s_at += sn as u64;
            r_at += rn as u64;
        }
        // The group is closed whatever happened inside it.
        let ended = result::group_end().map_err(|e| nccl_error(OP, e, Some(self.raw)));
        posted.and(ended.map(|_| ()))
    }

    /// In-place reduce-scatter on the device: `buf` holds `size` chunks; afterwards chunk
    /// `rank` holds the reduction of chunk `rank` over all ranks (NCCL's in-place convention
    /// `recvbuff = sendbuff + rank · chunk`); the other chunks are unspecified.
    pub fn reduce_scatter_in_place_dev<D: DeviceElement, B: DevicePtrMut<D>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> CommResult<()> {
        const OP: &str = "reduce_scatter_in_place_dev";
        self.check_buffer(OP, buf)?;
        let redop = self.nccl_op(OP, D::KIND, op)?;
        let chunk = equal_chunks(OP, buf.len(), self.size)?;
        if chunk == 0 {
            return Ok(());
        }
        let _serial = self.enter_enqueue(OP)?;
        let (ptr, _write) = buf.device_ptr_mut(&self.stream);
        let recv = ptr + (self.rank * chunk * std::mem::size_of::<D>()) as CUdeviceptr;
        // SAFETY: `ptr` is a live device allocation of size · chunk elements on this GPU,
        // borrowed mutably; `recv` is its chunk `rank` (NCCL's in-place reduce-scatter).
        unsafe {
            result::reduce_scatter(
                ptr as *const c_void,
                recv as *mut c_void,
                chunk,
                nccl_dtype(D::KIND),
                redop,
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// All-reduce in place on the device. [`ReduceOp::Avg`] is `ncclAvg`.
    pub fn all_reduce_dev<D: DeviceElement, B: DevicePtrMut<D>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> CommResult<()> {
        const OP: &str = "all_reduce_dev";
        self.check_buffer(OP, buf)?;
        let redop = self.nccl_op(OP, D::KIND, op)?;
        if buf.is_empty() {
            return Ok(());
        }
        let count = buf.len();
        let _serial = self.enter_enqueue(OP)?;
        let (ptr, _write) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` is a live device allocation of `count` elements on this GPU, borrowed
        // mutably; NCCL supports sendbuff == recvbuff for all-reduce.
        unsafe {
            result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                nccl_dtype(D::KIND),
                redop,
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// Broadcast in place on the device: every rank's `buf` gets `root`'s.
    pub fn broadcast_dev<D: DeviceElement, B: DevicePtrMut<D>>(
        &self,
        buf: &mut B,
        root: usize,
    ) -> CommResult<()> {
        const OP: &str = "broadcast_dev";
        self.check_buffer(OP, buf)?;
        check_root(OP, root, self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        let count = buf.len();
        let _serial = self.enter_enqueue(OP)?;
        let (ptr, _write) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` is a live device allocation of `count` elements on this GPU, borrowed
        // mutably; NCCL supports sendbuff == recvbuff for broadcast. root < size fits i32.
        unsafe {
            result::broadcast(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                nccl_dtype(D::KIND),
                root as i32,
                self.raw,
                self.cu_stream(),
            )
        }
        .map_err(|e| nccl_error(OP, e, Some(self.raw)))?;
        Ok(())
    }

    /// Splits into sub-communicators with `ncclCommSplit` (collective over this communicator):
    /// ranks with the same `color` form one, ordered by `key`, then by rank. The child uses
    /// this communicator's GPU and stream.
    pub fn split_comm(&self, color: usize, key: usize) -> CommResult<Self> {
        const OP: &str = "ncclCommSplit";
        let (c, k) = (to_i32("split color", color)?, to_i32("split key", key)?);
        self.enter(OP)?;
        let mut child = MaybeUninit::<sys::ncclComm_t>::uninit();
        // SAFETY: `self.raw` is live; `child` is written by NCCL on success and read only then;
        // a null config makes the child inherit the parent's configuration. The symbol was
        // checked present by the probe that ran when `self` was created.
        let child = unsafe {
            sys::ncclCommSplit(self.raw, c, k, child.as_mut_ptr(), std::ptr::null_mut())
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
            aborted: Cell::new(false),
            _not_send: PhantomData,
        })
    }
}

/// Makes the stream's context current on this thread (NCCL uses the current device).
fn bind(stream: &CudaStream) -> CommResult<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| cuda_error("bind context", e))
}

/// `count` fresh unique ids, the same on every rank of `boot`: checks every rank has NCCL, rank
/// 0 makes the ids, `boot` broadcasts their bytes. Collective over `boot`; if any rank lacks
/// NCCL or rank 0 cannot make an id, every rank returns the error (no rank hangs).
pub(super) fn agree_ids<C: Collective>(boot: &C, count: usize) -> CommResult<Vec<NcclUniqueId>> {
    let local = probe();
    let mut missing = [if local.is_err() { 1f32 } else { 0f32 }];
    boot.all_reduce(&mut missing, ReduceOp::Sum)?;
    if missing[0] > 0.0 {
        return Err(match local {
            Err(e) => e,
            Ok(()) => CommError::Unavailable(format!(
                "NCCL engine: unavailable on {} rank(s) of the bootstrap world",
                missing[0]
            )),
        });
    }
    // Byte 0: 1 when rank 0 made the ids; then the ids.
    let mut msg = vec![0u8; 1 + count * NCCL_UNIQUE_ID_BYTES];
    let mut made = Ok(());
    if boot.rank() == 0 {
        let ids: CommResult<Vec<NcclUniqueId>> = (0..count).map(|_| NcclUniqueId::new()).collect();
        match ids {
            Ok(ids) => {
                msg[0] = 1;
                for (chunk, id) in msg[1..].chunks_mut(NCCL_UNIQUE_ID_BYTES).zip(&ids) {
                    chunk.copy_from_slice(id.as_bytes());
                }
            }
            Err(e) => made = Err(e),
        }
    }
    boot.broadcast(&mut msg, 0)?;
    made?;
    if msg[0] != 1 {
        return Err(CommError::Engine(
            "rank 0 of the bootstrap world could not create an NCCL unique id".into(),
        ));
    }
    msg[1..]
        .chunks(NCCL_UNIQUE_ID_BYTES)
        .map(NcclUniqueId::from_bytes)
        .collect()
}
