//! The device path of [`NcclComm`]: collectives on cudarc device buffers, enqueued on the
//! communicator's stream (`*_dev`), with their argument checks.

use std::ffi::c_void;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::{result, sys};

use super::{nccl_dtype, nccl_error, DeviceElement, NcclComm};
use crate::collective::{check_chunks, check_counts, check_root, counts_mismatch, equal_chunks};
use crate::{Collective, CommError, CommResult, ElementKind, ReduceOp};

impl NcclComm {
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
        match reduce {
            ReduceOp::Sum => Ok(sys::ncclRedOp_t::ncclSum),
            // The device path sums only, and callers divide once (the host engines' average:
            // sum, then one multiplication). `ncclAvg` is not trusted: NCCL 2.28.9 on an H200
            // (world 1) left the last 3 of 2^20 + 3 elements of an out-of-place reduce-scatter
            // unwritten (2^20 right), in f32 and bf16, while `ncclSum` was right.
            ReduceOp::Avg => Err(CommError::InvalidArgument(format!(
                "{op}: the NCCL device path reduces with Sum only ({kind:?}); divide by the \
                 world size once afterwards (ncclAvg is not used: docs/H200.md)"
            ))),
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
    /// the reduction of chunk `rank` over all ranks. Sum only: [`ReduceOp::Avg`] is an argument error.
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

    /// All-reduce in place on the device. Sum only: [`ReduceOp::Avg`] is an argument error.
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
}
