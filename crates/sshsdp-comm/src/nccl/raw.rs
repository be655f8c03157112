//! [`DeviceCollective`] for [`NcclComm`]: NCCL on device memory named by address (buffers of
//! another allocator, such as CubeCL's), through the same device-path methods as cudarc's
//! buffers, then the bounded wait.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::{Bf16Bits, DeviceElement, NcclComm};
use crate::{CommResult, DeviceCollective, ElementKind, ReduceOp};

/// `len` elements of `D` at a device address this crate did not allocate, seen as a cudarc
/// buffer so that the device-path methods take it. Ordering against the owner's work is the
/// owner's (see [`DeviceCollective`]): the pointer accessors wait for and record nothing.
struct RawBuffer<'a, D> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _elem: PhantomData<D>,
}

impl<'a, D> RawBuffer<'a, D> {
    fn new(comm: &'a NcclComm, ptr: u64, len: usize) -> Self {
        Self {
            ptr: ptr as CUdeviceptr,
            len,
            stream: comm.stream(),
            _elem: PhantomData,
        }
    }
}

impl<D> DeviceSlice<D> for RawBuffer<'_, D> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<D> DevicePtr<D> for RawBuffer<'_, D> {
    fn device_ptr<'b>(&'b self, _stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<D> DevicePtrMut<D> for RawBuffer<'_, D> {
    fn device_ptr_mut<'b>(&'b mut self, _stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// Calls `$f::<D>($args)` with `D` the device element type of `$kind`.
macro_rules! by_kind {
    ($kind:expr, $f:ident($($arg:expr),*)) => {
        match $kind {
            ElementKind::F32 => $f::<f32>($($arg),*),
            ElementKind::Bf16 => $f::<Bf16Bits>($($arg),*),
            ElementKind::U8 => $f::<u8>($($arg),*),
        }
    };
}

fn all_gather<D: DeviceElement>(c: &NcclComm, send: u64, recv: u64, n: usize) -> CommResult<()> {
    let send = RawBuffer::<D>::new(c, send, n);
    let mut recv = RawBuffer::<D>::new(c, recv, n * c.size());
    c.all_gather_dev(&send, &mut recv)
}

fn reduce_scatter<D: DeviceElement>(
    c: &NcclComm,
    send: u64,
    recv: u64,
    n: usize,
    op: ReduceOp,
) -> CommResult<()> {
    let send = RawBuffer::<D>::new(c, send, n * c.size());
    let mut recv = RawBuffer::<D>::new(c, recv, n);
    c.reduce_scatter_dev(&send, &mut recv, op)
}

fn all_reduce<D: DeviceElement>(c: &NcclComm, buf: u64, n: usize, op: ReduceOp) -> CommResult<()> {
    let mut buf = RawBuffer::<D>::new(c, buf, n);
    c.all_reduce_dev(&mut buf, op)
}

impl DeviceCollective for NcclComm {
    fn device_ordinal(&self) -> usize {
        self.device()
    }

    unsafe fn all_gather_raw(
        &self,
        kind: ElementKind,
        send: u64,
        recv: u64,
        count: usize,
    ) -> CommResult<()> {
        by_kind!(kind, all_gather(self, send, recv, count))?;
        self.synchronize()
    }

    unsafe fn reduce_scatter_raw(
        &self,
        kind: ElementKind,
        send: u64,
        recv: u64,
        count: usize,
        op: ReduceOp,
    ) -> CommResult<()> {
        by_kind!(kind, reduce_scatter(self, send, recv, count, op))?;
        self.synchronize()
    }

    unsafe fn all_reduce_raw(
        &self,
        kind: ElementKind,
        buf: u64,
        count: usize,
        op: ReduceOp,
    ) -> CommResult<()> {
        by_kind!(kind, all_reduce(self, buf, count, op))?;
        self.synchronize()
    }
}
