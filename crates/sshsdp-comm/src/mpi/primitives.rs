//! The MPI calls under [`MpiComm`]'s collectives: all-gather on raw pointers, the in-place
//! `f32` sum, and the `f32` reduce-scatter by policy (with its scratch buffer).

use std::ffi::{c_int, c_void};

use mpi::ffi;

use super::raw::{check, f32_datatype, mpi_count, sum_op};
use super::{MpiComm, ReduceScatterAlgo};
use crate::CommResult;

impl MpiComm {
    /// `MPI_Allgather` of `count` elements of datatype `dt` per rank from `send` into `recv`.
    ///
    /// # Safety
    /// `send` is `MPI_IN_PLACE` (then chunk `rank` of `recv` is the input) or holds `count`
    /// elements of `dt`; `recv` holds size · `count` elements of `dt` and does not overlap `send`.
    pub(super) unsafe fn raw_all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dt: ffi::MPI_Datatype,
    ) -> CommResult<()> {
        // SAFETY: the caller's contract above.
        let code = unsafe { ffi::MPI_Allgather(send, count, dt, recv, count, dt, self.raw()) };
        check("MPI_Allgather", code)
    }

    /// `MPI_SUM` of `len` `f32`s at `buf`, in place (or through a scratch copy of the input if
    /// `MPI_IN_PLACE` is unknown).
    ///
    /// # Safety
    /// `buf` is valid for reads and writes of `len` `f32`s.
    pub(super) unsafe fn sum_f32_in_place(&self, buf: *mut f32, len: usize) -> CommResult<()> {
        let count = mpi_count("all_reduce", len)?;
        let (dt, sum) = (f32_datatype(), sum_op());
        let code = match self.in_place {
            // SAFETY: caller guarantees `buf`; MPI_IN_PLACE makes it both input and output.
            Some(ip) => unsafe { ffi::MPI_Allreduce(ip, buf.cast(), count, dt, sum, self.raw()) },
            None => {
                // SAFETY: caller guarantees `buf` is readable for `len` f32s.
                let input = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
                // SAFETY: `input` and `buf` are disjoint buffers of `count` f32s.
                unsafe {
                    ffi::MPI_Allreduce(
                        input.as_ptr().cast(),
                        buf.cast(),
                        count,
                        dt,
                        sum,
                        self.raw(),
                    )
                }
            }
        };
        check("MPI_Allreduce", code)
    }

    /// Reduce-scatter (`MPI_SUM`) of `f32`s: `send` holds `size · recv.len()` (checked by the
    /// caller, as is that `send.len()` fits an MPI count).
    pub(super) fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32]) -> CommResult<()> {
        let n = recv.len();
        let count = mpi_count("reduce_scatter", n)?;
        let (dt, sum) = (f32_datatype(), sum_op());
        let mine = self.rank * n..(self.rank + 1) * n;
        match self.rs_policy.algo(size_of_val(send)) {
            // SAFETY (both): `send` holds size · n f32s and `recv` n f32s (checked by the
            // caller); they are distinct borrows, so disjoint; `counts` holds size ints.
            ReduceScatterAlgo::Block => check("MPI_Reduce_scatter_block", unsafe {
                ffi::MPI_Reduce_scatter_block(
                    send.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    count,
                    dt,
                    sum,
                    self.raw(),
                )
            }),
            ReduceScatterAlgo::Varcount => {
                let counts = vec![count; self.size];
                check("MPI_Reduce_scatter", unsafe {
                    ffi::MPI_Reduce_scatter(
                        send.as_ptr().cast(),
                        recv.as_mut_ptr().cast(),
                        counts.as_ptr(),
                        dt,
                        sum,
                        self.raw(),
                    )
                })
            }
            ReduceScatterAlgo::AllReduce => {
                let mut scratch = self.scratch.borrow_mut();
                if scratch.len() < send.len() {
                    scratch.resize(send.len(), 0.0);
                }
                let total = mpi_count("reduce_scatter", send.len())?;
                // SAFETY: `send` and `scratch` are distinct buffers of at least `total` f32s.
                check("MPI_Allreduce", unsafe {
                    ffi::MPI_Allreduce(
                        send.as_ptr().cast(),
                        scratch.as_mut_ptr().cast(),
                        total,
                        dt,
                        sum,
                        self.raw(),
                    )
                })?;
                recv.copy_from_slice(&scratch[mine]);
                Ok(())
            }
        }
    }
}
