//! [`DeviceCollective`]: collectives on buffers that live in device memory owned by someone
//! else (a tensor library's allocator, such as CubeCL's), named by their raw addresses.
//!
//! A runtime whose buffers are device tensors cannot hand an engine typed device slices of the
//! engine's own library; it can hand it addresses. An engine that can move device memory
//! directly (NCCL) offers this through [`Collective::device`](crate::Collective::device); the
//! host engines (threads, MPI) do not, and a runtime then stages through host memory.
//!
//! Reductions sum: [`ReduceOp::Sum`] only ([`ReduceOp::Avg`] is an argument error), and a
//! caller that wants the average divides once afterwards, as the host engines define it (sum,
//! then one multiplication). NCCL's own `ncclAvg` is not used (`docs/H200.md`).
//!
//! Every call is synchronous: it returns once the device work is complete (with the engine's
//! bounded wait: NCCL's polls its asynchronous error, the rank's liveness and a watchdog), so
//! the caller may reuse or read the buffers as soon as it returns.

use crate::{CommResult, ElementKind, ReduceOp};

/// Collectives on raw device addresses, in the communicator's device context.
///
/// # Safety (of every method)
/// The caller guarantees that each address names a live allocation on the communicator's
/// device ([`DeviceCollective::device_ordinal`]) of at least the bytes the call reads or
/// writes, that no pending device work still writes (or, for a buffer this call writes, reads)
/// that memory, and that it stays allocated until the call returns. Buffers of one call do not
/// overlap.
pub trait DeviceCollective {
    /// The GPU (CUDA ordinal) this communicator's buffers must be on.
    fn device_ordinal(&self) -> usize;

    /// All-gather: `recv` (`size · count` elements of `kind`) receives every rank's `send`
    /// (`count` elements) in rank order.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_gather_raw(
        &self,
        kind: ElementKind,
        send: u64,
        recv: u64,
        count: usize,
    ) -> CommResult<()>;

    /// Reduce-scatter: `send` holds `size` chunks of `count` elements; `recv` (`count`)
    /// receives the reduction of chunk `rank` over all ranks.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn reduce_scatter_raw(
        &self,
        kind: ElementKind,
        send: u64,
        recv: u64,
        count: usize,
        op: ReduceOp,
    ) -> CommResult<()>;

    /// All-reduce of `count` elements in place.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_reduce_raw(
        &self,
        kind: ElementKind,
        buf: u64,
        count: usize,
        op: ReduceOp,
    ) -> CommResult<()>;
}
