//! The [`Collective`] implementation of [`MpiComm`]: argument checks, the guarded MPI calls,
//! bf16 widening for reductions, and splits.

use std::ffi::c_int;

use mpi::ffi;
use mpi::topology::{Color, Communicator};

use super::raw::*;
use super::{MpiComm, ReduceScatterAlgo};
use crate::call::CallDesc as Call;
use crate::collective::{check_chunks, check_counts, check_root, equal_chunks};
use crate::{
    AbortHandle, CallTag, Collective, CommError, CommResult, Element, ReduceOp, Reducible,
};

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        let n = equal_chunks("all_gather", buf.len(), self.size)?;
        let dt = datatype::<T>("all_gather")?;
        let count = mpi_count("all_gather", n)?;
        self.guarded(Call::data::<T>("all_gather", n, self.tag.get()), || {
            if n == 0 || self.size == 1 {
                return Ok(());
            }
            match self.in_place {
                // SAFETY: `buf` holds size · n elements of T, whose MPI datatype is `dt`
                // (checked by `datatype`); with MPI_IN_PLACE chunk `rank` is the input and the
                // rest is written.
                Some(ip) => unsafe { self.raw_all_gather(ip, buf.as_mut_ptr().cast(), count, dt) },
                None => {
                    let mine = buf[self.rank * n..(self.rank + 1) * n].to_vec();
                    // SAFETY: `mine` (n elements) and `buf` (size · n) are disjoint buffers of T.
                    unsafe {
                        self.raw_all_gather(
                            mine.as_ptr().cast(),
                            buf.as_mut_ptr().cast(),
                            count,
                            dt,
                        )
                    }
                }
            }
        })
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        check_chunks("all_gather", "recv", recv.len(), send.len(), self.size)?;
        let dt = datatype::<T>("all_gather")?;
        let count = mpi_count("all_gather", send.len())?;
        self.guarded(
            Call::data::<T>("all_gather", send.len(), self.tag.get()),
            || {
                if send.is_empty() {
                    return Ok(());
                }
                // SAFETY: `send` (n) and `recv` (size · n) are distinct borrows of T, datatype `dt`.
                unsafe {
                    self.raw_all_gather(send.as_ptr().cast(), recv.as_mut_ptr().cast(), count, dt)
                }
            },
        )
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        check_chunks("reduce_scatter", "send", send.len(), recv.len(), self.size)?;
        mpi_count("reduce_scatter", send.len())?;
        let call = Call::reduce::<T>("reduce_scatter", recv.len(), op, self.tag.get());
        self.guarded(call, || {
            if recv.is_empty() {
                return Ok(());
            }
            let scale = op.scale(self.size);
            if let (Some(send), Some(recv)) = (as_f32(send), as_f32_mut(recv)) {
                self.reduce_scatter_f32(send, recv)?;
                if op != ReduceOp::Sum {
                    recv.iter_mut().for_each(|x| *x *= scale);
                }
                return Ok(());
            }
            // Widen to f32, reduce, round once.
            let mut wide: Vec<f32> = send.iter().map(|x| x.to_acc()).collect();
            let n = recv.len();
            let all_reduce =
                self.rs_policy.algo(size_of_val(wide.as_slice())) == ReduceScatterAlgo::AllReduce;
            let out = if all_reduce {
                // The widened copy is ours: all-reduce it in place, no scratch buffer.
                // SAFETY: `wide` is an owned buffer of `wide.len()` f32s.
                unsafe { self.sum_f32_in_place(wide.as_mut_ptr(), wide.len())? };
                wide.drain(self.rank * n..(self.rank + 1) * n).collect()
            } else {
                let mut out = vec![0f32; n];
                self.reduce_scatter_f32(&wide, &mut out)?;
                out
            };
            recv.iter_mut()
                .zip(&out)
                .for_each(|(r, &s)| *r = T::from_acc(s * scale));
            Ok(())
        })
    }

    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        mpi_count("all_reduce", buf.len())?;
        self.guarded(
            Call::reduce::<T>("all_reduce", buf.len(), op, self.tag.get()),
            || {
                if buf.is_empty() {
                    return Ok(());
                }
                let scale = op.scale(self.size);
                if let Some(buf) = as_f32_mut(buf) {
                    // SAFETY: `buf` is an exclusive borrow of `buf.len()` f32s.
                    unsafe { self.sum_f32_in_place(buf.as_mut_ptr(), buf.len())? };
                    if op != ReduceOp::Sum {
                        buf.iter_mut().for_each(|x| *x *= scale);
                    }
                    return Ok(());
                }
                let mut wide: Vec<f32> = buf.iter().map(|x| x.to_acc()).collect();
                // SAFETY: `wide` is an owned buffer of `buf.len()` f32s.
                unsafe { self.sum_f32_in_place(wide.as_mut_ptr(), wide.len())? };
                buf.iter_mut()
                    .zip(&wide)
                    .for_each(|(b, &s)| *b = T::from_acc(s * scale));
                Ok(())
            },
        )
    }

    /// `MPI_Alltoallv` on the caller's buffers, no copy, after an `MPI_Alltoall` of the counts
    /// and an `MPI_Allgather` of each rank's first disagreement (if any), so that counts that
    /// disagree are the same [`CommError::Mismatch`] on every rank instead of a truncation.
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        const OP: &str = "all_to_all_v";
        check_counts(OP, "send", send.len(), send_counts, self.size)?;
        check_counts(OP, "recv", recv.len(), recv_counts, self.size)?;
        let dt = datatype::<T>(OP)?;
        let ints = |counts: &[usize]| -> CommResult<(Vec<c_int>, Vec<c_int>)> {
            let counts = counts
                .iter()
                .map(|&c| mpi_count(OP, c))
                .collect::<CommResult<Vec<_>>>()?;
            let mut displs = Vec::with_capacity(counts.len());
            let mut at: c_int = 0;
            for &c in &counts {
                displs.push(at);
                at = at.checked_add(c).ok_or_else(|| {
                    CommError::InvalidArgument(format!("{OP}: more than MPI's int count in all"))
                })?;
            }
            Ok((counts, displs))
        };
        let (scounts, sdispls) = ints(send_counts)?;
        let (rcounts, rdispls) = ints(recv_counts)?;
        let int = i32_datatype();
        self.guarded(Call::data::<T>(OP, self.size, self.tag.get()), || {
            // What every peer will send us, against what we expect.
            let mut incoming = vec![0 as c_int; self.size];
            // SAFETY: `scounts` and `incoming` hold one int per rank.
            let code = unsafe {
                ffi::MPI_Alltoall(
                    scounts.as_ptr().cast(),
                    1,
                    int,
                    incoming.as_mut_ptr().cast(),
                    1,
                    int,
                    self.raw(),
                )
            };
            check("MPI_Alltoall", code)?;
            // (sender, receiver, sent, expected) of this rank's first disagreement, or -1s.
            let mine: [c_int; 4] = incoming
                .iter()
                .zip(&rcounts)
                .position(|(got, want)| got != want)
                .map_or([-1; 4], |a| {
                    [a as c_int, self.rank as c_int, incoming[a], rcounts[a]]
                });
            let mut all = vec![0 as c_int; 4 * self.size];
            // SAFETY: `mine` holds 4 ints, `all` 4 per rank.
            unsafe { self.raw_all_gather(mine.as_ptr().cast(), all.as_mut_ptr().cast(), 4, int) }?;
            if let Some(w) = all.chunks(4).find(|w| w[0] >= 0) {
                return Err(CommError::Mismatch(format!(
                    "{OP}: rank {} sends {} elements to rank {}, which expects {}",
                    w[0], w[2], w[1], w[3]
                )));
            }
            // SAFETY: `send` holds the sum of `scounts` elements of `dt` at `sdispls`, `recv` the
            // sum of `rcounts` at `rdispls` (checked above); distinct borrows; the counts agree
            // pairwise (checked with every rank).
            let code = unsafe {
                ffi::MPI_Alltoallv(
                    send.as_ptr().cast(),
                    scounts.as_ptr(),
                    sdispls.as_ptr(),
                    dt,
                    recv.as_mut_ptr().cast(),
                    rcounts.as_ptr(),
                    rdispls.as_ptr(),
                    dt,
                    self.raw(),
                )
            };
            check("MPI_Alltoallv", code)
        })
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        check_root("broadcast", root, self.size)?;
        let dt = datatype::<T>("broadcast")?;
        let count = mpi_count("broadcast", buf.len())?;
        let call = Call {
            root,
            ..Call::data::<T>("broadcast", buf.len(), self.tag.get())
        };
        self.guarded(call, || {
            if buf.is_empty() {
                return Ok(());
            }
            // `root < size`, and `size` came from a c_int.
            let root = root as c_int;
            // SAFETY: `buf` is an exclusive borrow of `count` elements of T, datatype `dt`.
            check("MPI_Bcast", unsafe {
                ffi::MPI_Bcast(buf.as_mut_ptr().cast(), count, dt, root, self.raw())
            })
        })
    }

    fn barrier(&self) -> CommResult<()> {
        self.guarded(Call::control("barrier", self.tag.get()), || {
            // SAFETY: `self.comm` is a live communicator.
            check("MPI_Barrier", unsafe { ffi::MPI_Barrier(self.raw()) })
        })
    }

    fn set_tag(&self, tag: CallTag) {
        self.tag.set(tag);
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        let guard = self.live.guard().clone();
        Some(std::sync::Arc::new(move |reason: &str| guard.fail(reason)))
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Self> {
        let color = c_int::try_from(color)
            .map_err(|_| CommError::InvalidArgument(format!("split: color {color} > i32::MAX")))?;
        let key = c_int::try_from(key)
            .map_err(|_| CommError::InvalidArgument(format!("split: key {key} > i32::MAX")))?;
        let comm = self.guarded(Call::control("split", self.tag.get()), || {
            self.comm
                .split_by_color_with_key(Color::with_value(color), key)
                .ok_or_else(|| engine("MPI_Comm_split returned no communicator"))
        })?;
        Self::wrap(
            comm,
            self.in_place,
            self.rs_override,
            self.check_calls,
            self.live.guard().register(),
        )
    }
}
