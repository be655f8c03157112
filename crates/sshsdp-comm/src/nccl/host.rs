//! The [`Collective`] implementation on host slices: stage through device memory.
//!
//! Each call copies its input to a fresh device buffer on the communicator's stream, runs the
//! device method, copies the result back and waits for the stream. This is for the
//! conformance suite and small control messages; training keeps its buffers on the device and
//! calls the `*_dev` methods. Averages run `ncclSum` and scale once on the host, which is the
//! crate's definition (sum, then one multiplication by `1 / size`).

use cudarc::driver::CudaSlice;

use super::{cuda_error, host_as_dev, host_as_dev_mut, Bf16Bits, DeviceElement, NcclComm};
use crate::collective::{check_chunks, equal_chunks};
use crate::{
    Collective, CommError, CommResult, DeviceCollective, Element, ElementKind, ReduceOp, Reducible,
};

/// Calls `$f::<T, D>($args)` with `D` the device type of `T::KIND`.
macro_rules! dispatch {
    ($t:ty, $f:ident($($arg:expr),*)) => {
        match <$t as Element>::KIND {
            ElementKind::F32 => $f::<$t, f32>($($arg),*),
            ElementKind::Bf16 => $f::<$t, Bf16Bits>($($arg),*),
            ElementKind::U8 => $f::<$t, u8>($($arg),*),
        }
    };
}

impl NcclComm {
    fn upload<D: DeviceElement>(&self, host: &[D]) -> CommResult<CudaSlice<D>> {
        self.stream()
            .clone_htod(host)
            .map_err(|e| cuda_error("copy to device", e))
    }

    fn zeros<D: DeviceElement>(&self, len: usize) -> CommResult<CudaSlice<D>> {
        self.stream()
            .alloc_zeros(len)
            .map_err(|e| cuda_error("device alloc", e))
    }

    /// Waits (bounded, see `watch.rs`) for the queued collective, then copies `dev` into
    /// `host` (same length). The wait comes first: cudarc's copy to pageable memory blocks on
    /// the stream with no timeout, which behind a dead peer would never return.
    fn download<D: DeviceElement>(&self, dev: &CudaSlice<D>, host: &mut [D]) -> CommResult<()> {
        self.synchronize()?;
        self.stream()
            .memcpy_dtoh(dev, host)
            .map_err(|e| cuda_error("copy to host", e))?;
        self.synchronize()
    }
}

fn gather_in_place<T: Element, D: DeviceElement>(c: &NcclComm, buf: &mut [T]) -> CommResult<()> {
    let chunk = equal_chunks("all_gather", buf.len(), c.size())?;
    let buf = host_as_dev_mut::<T, D>(buf)?;
    if chunk == 0 {
        return Ok(());
    }
    let mine = c.rank() * chunk..(c.rank() + 1) * chunk;
    let mut dev = c.zeros::<D>(buf.len())?;
    c.stream()
        .memcpy_htod(&buf[mine.clone()], &mut dev.slice_mut(mine))
        .map_err(|e| cuda_error("copy to device", e))?;
    c.all_gather_in_place_dev(&mut dev)?;
    c.download(&dev, buf)
}

fn gather<T: Element, D: DeviceElement>(
    c: &NcclComm,
    send: &[T],
    recv: &mut [T],
) -> CommResult<()> {
    check_chunks("all_gather", "recv", recv.len(), send.len(), c.size())?;
    let (send, recv) = (host_as_dev::<T, D>(send)?, host_as_dev_mut::<T, D>(recv)?);
    if send.is_empty() {
        return Ok(());
    }
    let src = c.upload(send)?;
    let mut dst = c.zeros::<D>(recv.len())?;
    c.all_gather_dev(&src, &mut dst)?;
    c.download(&dst, recv)
}

fn scatter<T: Element, D: DeviceElement>(
    c: &NcclComm,
    send: &[T],
    recv: &mut [T],
) -> CommResult<()> {
    if send.len() != recv.len() * c.size() {
        return Err(CommError::InvalidArgument(format!(
            "reduce_scatter: send has {} elements, expected {} · {}",
            send.len(),
            c.size(),
            recv.len()
        )));
    }
    let (send, recv) = (host_as_dev::<T, D>(send)?, host_as_dev_mut::<T, D>(recv)?);
    if recv.is_empty() {
        return Ok(());
    }
    let src = c.upload(send)?;
    let mut dst = c.zeros::<D>(recv.len())?;
    c.reduce_scatter_dev(&src, &mut dst, ReduceOp::Sum)?;
    c.download(&dst, recv)
}

fn reduce<T: Element, D: DeviceElement>(c: &NcclComm, buf: &mut [T]) -> CommResult<()> {
    let buf = host_as_dev_mut::<T, D>(buf)?;
    if buf.is_empty() {
        return Ok(());
    }
    let mut dev = c.upload(buf)?;
    c.all_reduce_dev(&mut dev, ReduceOp::Sum)?;
    c.download(&dev, buf)
}

fn a2a<T: Element, D: DeviceElement>(
    c: &NcclComm,
    (send, send_counts): (&[T], &[usize]),
    (recv, recv_counts): (&mut [T], &[usize]),
) -> CommResult<()> {
    let (send, recv) = (host_as_dev::<T, D>(send)?, host_as_dev_mut::<T, D>(recv)?);
    // A rank may send or receive nothing: an empty buffer is a view of a one-element allocation.
    let src = if send.is_empty() {
        c.zeros::<D>(1)?
    } else {
        c.upload(send)?
    };
    let mut dst = c.zeros::<D>(recv.len().max(1))?;
    let src = src.slice(0..send.len());
    let mut dst = dst.slice_mut(0..recv.len());
    c.all_to_all_v_dev(&src, send_counts, &mut dst, recv_counts)?;
    if !recv.is_empty() {
        c.stream()
            .memcpy_dtoh(&dst, recv)
            .map_err(|e| cuda_error("copy to host", e))?;
    }
    c.synchronize()
}

fn bcast<T: Element, D: DeviceElement>(c: &NcclComm, buf: &mut [T], root: usize) -> CommResult<()> {
    if root >= c.size() {
        return Err(CommError::InvalidArgument(format!(
            "broadcast: root {root} outside a communicator of {} ranks",
            c.size()
        )));
    }
    let buf = host_as_dev_mut::<T, D>(buf)?;
    if buf.is_empty() {
        return Ok(());
    }
    let mut dev = if c.rank() == root {
        c.upload(buf)?
    } else {
        c.zeros::<D>(buf.len())?
    };
    c.broadcast_dev(&mut dev, root)?;
    c.download(&dev, buf)
}

/// Applies the average's single multiplication to summed values.
fn scale<T: Reducible>(buf: &mut [T], op: ReduceOp, size: usize) {
    if op == ReduceOp::Avg {
        let s = op.scale(size);
        buf.iter_mut()
            .for_each(|x| *x = T::from_acc(x.to_acc() * s));
    }
}

/// Host slices staged through device memory (see the module docs). Synchronous: each call
/// returns when its result is in the host buffer. `start_*` use the trait's synchronous
/// defaults.
impl Collective for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn size(&self) -> usize {
        NcclComm::size(self)
    }

    fn device(&self) -> Option<&dyn DeviceCollective> {
        Some(self)
    }

    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> CommResult<()> {
        dispatch!(T, gather_in_place(self, buf))
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        dispatch!(T, gather(self, send, recv))
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        dispatch!(T, scatter(self, send, recv))?;
        scale(recv, op, self.size());
        Ok(())
    }

    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        dispatch!(T, reduce(self, buf))?;
        scale(buf, op, self.size());
        Ok(())
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        dispatch!(T, a2a(self, (send, send_counts), (recv, recv_counts)))
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        dispatch!(T, bcast(self, buf, root))
    }

    /// An all-reduce of one element, then a stream synchronisation (NCCL has no barrier).
    fn barrier(&self) -> CommResult<()> {
        let mut one = self.zeros::<f32>(1)?;
        self.all_reduce_dev(&mut one, ReduceOp::Sum)?;
        self.synchronize()
    }

    fn split(&self, color: usize, key: usize) -> CommResult<Self> {
        self.split_comm(color, key)
    }

    /// Fails this rank's communicators (its lanes and splits): a wait in progress aborts its
    /// communicator and returns the error, and later calls fail before they enqueue.
    fn abort_handle(&self) -> Option<crate::AbortHandle> {
        let live = self.liveness();
        Some(std::sync::Arc::new(move |reason: &str| live.fail(reason)))
    }
}
