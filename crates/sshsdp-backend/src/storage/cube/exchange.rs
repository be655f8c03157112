//! The device-collective seam: one rank's CubeCL buffers of one collective ([`CubeBuffers`],
//! generic over the runtime) run by either engine that moves device memory —
//!
//! * **NCCL** ([`DeviceGroup::Addresses`], CUDA only): the buffers' raw addresses, readied first
//!   (see `gather.rs` for the ordering against CubeCL's streams), handed to NCCL, which sums
//!   and copies on its own stream; synchronous (NCCL's bounded wait returns once done).
//! * **Ranks of this process that share the device** ([`DeviceGroup::Peers`], any runtime: wgpu
//!   in CI, CUDA): each rank publishes its send buffer through the threads engine's rendezvous
//!   (`sshsdp_comm::peers`) and runs its plan with CubeCL kernels on its own stream
//!   (`sshsdp_kernels::{copy_units, accumulate_units, store_units}`), reading its peers' send
//!   buffers and writing only its own receive buffer. NCCL refuses two ranks on one GPU; this is
//!   the engine that puts the device path above world 1 in CI. Not a network: between devices
//!   and machines the engine stays NCCL.
//!
//! # Ordering (the peers engine)
//! Completion is **a sync of the issuing stream**: a call returns once its kernels are complete
//! on the device, like NCCL's path. Three waits make that hold on every runtime:
//!
//! 1. **Before arrival**, a rank readies its own buffers: `get_resource` on each (and on the
//!    [`stream_mark`](super::stream_mark)s of their last writes) makes its stream wait for the
//!    streams that wrote them, and a host sync of its stream makes those writes complete. So at
//!    the rendezvous every rank's send buffer holds its final bytes on the device. (On wgpu a
//!    lane queues on its model thread's stream, `lane_client`, and cubecl-wgpu flushes a
//!    producing stream when a task binds one of its buffers, so the binding alone would order a
//!    reader after the writer on the one device queue; on CUDA streams run concurrently and
//!    CubeCL orders a reader of another stream's buffer only up to the buffer's *allocation*, so
//!    the sync is what makes a later write visible. One rule for both.)
//! 2. **Before the all-read barrier** (the in-place all-reduce only: peers read the buffer this
//!    rank then writes), a rank syncs its stream: its reads are complete, not merely queued.
//! 3. **Before departure**, a rank syncs its stream again: its reads of peers' buffers and its
//!    writes are complete. The hazard this closes is reuse: a dropped CubeCL buffer returns to
//!    its owner stream's pool at once, so a peer that returns and frees its send buffer could
//!    have the next upload into that memory reach the device before this rank's pending read
//!    (the MXFP8 NaN bug of the device table was this hazard within one rank). Every rank
//!    returns only once every rank has departed.
//!
//! No device work ever waits for a peer (no kernel spins on a flag): every wait is a host wait
//! at the rendezvous, bounded by the engine's timeout, so a rank that errs or panics mid-call
//! fails the call on every rank (its [`PeerCall`](sshsdp_comm::peers::PeerCall) is failed or
//! dropped while unwinding) and a rank that never arrives is a timeout. Lane threads never hold
//! a graph lock of Burn's autodiff, so the argument of `lanes/` holds unchanged.

use std::sync::Arc;

use crate::traffic::Traffic;

use burn_cubecl::CubeRuntime;
use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use sshsdp_comm::peers::{PeerExchange, PeerOp};
use sshsdp_comm::{CommError, CommResult, ElementKind};
use sshsdp_kernels::{accumulate_units, copy_units, store_units, SumDType};

use crate::lanes::comm::{DeviceBuffers, DeviceGroup};

/// A place in a CubeCL buffer: the buffer (as allocated, or with its own aligned offsets) and a
/// byte offset into it (any: kernels take it as an argument, no binding at an unaligned offset).
#[derive(Clone)]
pub(crate) struct Span {
    pub handle: Handle,
    pub byte: u64,
}

impl Span {
    /// The start of `handle`.
    pub fn of(handle: Handle) -> Self {
        Self { handle, byte: 0 }
    }
}

/// What a rank publishes to its peers: its send buffer.
struct CubePost {
    send: Span,
}

/// One rank's CubeCL buffers of one collective (see the module docs).
pub(crate) struct CubeBuffers<R: CubeRuntime> {
    client: ComputeClient<R>,
    kind: ElementKind,
    send: Span,
    recv: Span,
    /// One buffer holding the larger extent from `recv` (`PeerOp::plan`'s in-place layout).
    in_place: bool,
    /// Marks of the last writes of the buffers ([`stream_mark`](super::stream_mark)).
    written: Vec<Handle>,
    /// NCCL's path: the device resources pinned while it works.
    resources: Vec<Box<dyn Send>>,
    /// Charged with each host wait for the device.
    traffic: Option<Arc<Traffic>>,
}

impl<R: CubeRuntime> CubeBuffers<R> {
    /// A send and a receive buffer apart, used through `client` (the lane's).
    pub fn apart(client: ComputeClient<R>, kind: ElementKind, send: Span, recv: Span) -> Self {
        Self {
            client,
            kind,
            send,
            recv,
            in_place: false,
            written: Vec::new(),
            resources: Vec::new(),
            traffic: None,
        }
    }

    /// Charges each host wait for the device to `traffic`.
    pub fn charging(mut self, traffic: &Arc<Traffic>) -> Self {
        self.traffic = Some(traffic.clone());
        self
    }

    /// Counts one host wait for the device.
    fn charge_sync(&self) {
        if let Some(t) = &self.traffic {
            t.sync();
        }
    }

    /// One buffer in place, its larger extent starting at `buffer`.
    pub fn in_place(client: ComputeClient<R>, kind: ElementKind, buffer: Span) -> Self {
        Self {
            in_place: true,
            ..Self::apart(client, kind, buffer.clone(), buffer)
        }
    }

    /// Also waits for the writes `mark` was made after before the engine reads.
    pub fn after(mut self, mark: Option<Handle>) -> Self {
        self.written.extend(mark);
        self
    }

    fn unit(&self) -> u64 {
        self.kind.bytes() as u64
    }

    /// Step 1 of the ordering: this rank's buffers' writes complete on the device.
    fn ready(&self) -> CommResult<()> {
        for handle in [&self.send.handle, &self.recv.handle]
            .into_iter()
            .chain(&self.written)
        {
            drop(self.client.get_resource(handle.clone()).map_err(engine)?);
        }
        self.sync()
    }

    fn sync(&self) -> CommResult<()> {
        self.charge_sync();
        cubecl::future::block_on(self.client.sync()).map_err(engine)
    }

    /// The peers engine (see the module docs).
    fn run_with_peers(
        &mut self,
        peers: &dyn PeerExchange,
        op: PeerOp,
        count: usize,
    ) -> CommResult<()> {
        let rank = peers.peer_rank();
        let unit = self.unit();
        let (send, recv) = if self.in_place {
            let (s, r) = op.in_place_offsets(rank, count, 0);
            let at = |units: usize| Span {
                handle: self.recv.handle.clone(),
                byte: self.recv.byte + units as u64 * unit,
            };
            (at(s), at(r))
        } else {
            (self.send.clone(), self.recv.clone())
        };
        let dtype = match (op.sums(), self.kind) {
            (false, _) => None,
            (true, ElementKind::F32) => Some(SumDType::F32),
            (true, ElementKind::Bf16) => Some(SumDType::Bf16),
            (true, ElementKind::U8) => {
                return Err(CommError::InvalidArgument(
                    "device reductions sum f32 or bf16, not bytes".into(),
                ))
            }
        };
        self.ready()?;
        let mut call = peers.exchange(op, self.kind, count, Arc::new(CubePost { send }))?;
        let moved = (|| {
            // After arrival: an all-to-all-v is planned from every rank's counts.
            let plan = call.plan(op, count, self.in_place)?;
            let sources: Vec<Span> = call
                .posts_as::<CubePost>()?
                .into_iter()
                .map(|p| p.send.clone())
                .collect();
            let mut sums = Vec::new();
            for t in &plan.transfers {
                let dst = recv.byte + t.at as u64 * unit;
                let len = t.len;
                match dtype {
                    None => {
                        let (q, from) = t.sources[0];
                        let src = &sources[q];
                        let src_byte = src.byte + from as u64 * unit;
                        copy_units(
                            &self.client,
                            &src.handle,
                            src_byte as usize,
                            &recv.handle,
                            dst as usize,
                            len * unit as usize,
                        )
                        .map_err(kernel)?;
                    }
                    Some(dtype) => {
                        let acc = self.client.empty(4 * len);
                        for (j, &(q, from)) in t.sources.iter().enumerate() {
                            let src = &sources[q];
                            let src_byte = (src.byte + from as u64 * unit) as usize;
                            accumulate_units(
                                &self.client,
                                &src.handle,
                                src_byte,
                                dtype,
                                len,
                                &acc,
                                j == 0,
                            )
                            .map_err(kernel)?;
                        }
                        sums.push((acc, dtype, dst, len));
                    }
                }
            }
            if plan.write_after_all_read {
                self.sync()?;
                call.all_read();
            }
            for (acc, dtype, dst, len) in sums {
                store_units(&self.client, &acc, len, dtype, &recv.handle, dst as usize)
                    .map_err(kernel)?;
            }
            self.sync()
        })();
        if let Err(e) = &moved {
            call.fail(format!("rank {rank} in {}: {e}", op.name()));
        }
        let finished = call.finish();
        moved.and(finished)
    }

    /// A group of this rank alone: no engine. In place the buffer already holds the result (a
    /// gather or a sum of one rank's units is those units); apart the receive extent is copied
    /// from the send buffer, ordered as the peers engine orders its moves (steps 1 and 3).
    fn run_alone(&mut self, op: PeerOp, count: usize) -> CommResult<()> {
        if self.in_place {
            return Ok(());
        }
        let (_, units) = op.extents(1, count);
        if units == 0 {
            return Ok(());
        }
        self.ready()?;
        copy_units(
            &self.client,
            &self.send.handle,
            self.send.byte as usize,
            &self.recv.handle,
            self.recv.byte as usize,
            units * self.unit() as usize,
        )
        .map_err(kernel)?;
        self.sync()
    }

    /// NCCL's path: raw addresses, readied (CUDA only).
    fn run_on_addresses(
        &mut self,
        engine: &dyn sshsdp_comm::DeviceCollective,
        op: PeerOp,
        count: usize,
    ) -> CommResult<()> {
        let ready = addresses_for::<R>().ok_or_else(|| {
            CommError::Unavailable(
                "an engine on raw device addresses (NCCL) with buffers of a runtime other than \
                 CUDA"
                    .into(),
            )
        })?;
        let mut handles = vec![
            self.send.handle.clone().offset_start(self.send.byte),
            self.recv.handle.clone().offset_start(self.recv.byte),
        ];
        handles.extend(self.written.iter().cloned());
        self.charge_sync();
        let at = ready(&self.client, &handles, &mut self.resources)?;
        let (send, recv, kind) = (at[0], at[1], self.kind);
        let same_place = !self.in_place || matches!(op, PeerOp::AllReduce);
        if !same_place {
            return Err(CommError::InvalidArgument(format!(
                "{} in place on raw addresses",
                op.name()
            )));
        }
        // SAFETY: both buffers are live CubeCL allocations on the engine's GPU (the runtime
        // takes this path only where the engine's GPU is the backend's), of the extents `op`
        // needs (the caller's), pinned in `resources` until this job is dropped and readied
        // (their earlier device work done) by `ready`.
        unsafe {
            match op {
                PeerOp::AllGather => engine.all_gather_raw(kind, send, recv, count),
                PeerOp::ReduceScatter => {
                    engine.reduce_scatter_raw(kind, send, recv, count, sshsdp_comm::ReduceOp::Sum)
                }
                PeerOp::AllReduce if send == recv => {
                    engine.all_reduce_raw(kind, recv, count, sshsdp_comm::ReduceOp::Sum)
                }
                PeerOp::AllReduce | PeerOp::Broadcast { .. } => Err(CommError::InvalidArgument(
                    format!("{} apart on raw addresses", op.name()),
                )),
                // NCCL's device all-to-all-v (grouped sends and receives) is not wired to raw
                // addresses: above world 1 nothing here could test it. Device optimizers
                // exchange by all-reduce over NCCL (`UpdateGroup::all_to_all_on_device`).
                PeerOp::AllToAllV { .. } => Err(CommError::Unavailable(
                    "all_to_all_v on raw device addresses (NCCL)".into(),
                )),
            }
        }
    }
}

impl<R: CubeRuntime> DeviceBuffers for CubeBuffers<R> {
    fn run(&mut self, group: DeviceGroup<'_>, op: PeerOp, count: usize) -> CommResult<()> {
        match group {
            DeviceGroup::Addresses(engine) => self.run_on_addresses(engine, op, count),
            DeviceGroup::Peers(peers) => self.run_with_peers(peers, op, count),
            DeviceGroup::Alone => self.run_alone(op, count),
        }
    }
}

/// The readying of raw addresses for runtime `R`, where an engine can use them (CUDA).
type Addresses<R> =
    fn(&ComputeClient<R>, &[Handle], &mut Vec<Box<dyn Send>>) -> CommResult<Vec<u64>>;

/// [`Addresses`] for `R`, if `R` is CUDA's runtime.
fn addresses_for<R: CubeRuntime>() -> Option<Addresses<R>> {
    #[cfg(feature = "cuda")]
    {
        let cuda: Box<dyn std::any::Any> =
            Box::new(ready_addresses as Addresses<cubecl::cuda::CudaRuntime>);
        if let Ok(f) = cuda.downcast::<Addresses<R>>() {
            return Some(*f);
        }
    }
    None
}

/// Called on a lane's thread: the device addresses of `handles`, once the device work queued
/// before them on any CubeCL stream is done (see `gather.rs`); their resources go into
/// `keep`, which pins the allocations until it is dropped.
#[cfg(feature = "cuda")]
pub(crate) fn ready_addresses(
    client: &ComputeClient<cubecl::cuda::CudaRuntime>,
    handles: &[Handle],
    keep: &mut Vec<Box<dyn Send>>,
) -> CommResult<Vec<u64>> {
    let err =
        |e| sshsdp_comm::CommError::Engine(format!("readying a CubeCL buffer for NCCL: {e:?}"));
    let mut addresses = Vec::with_capacity(handles.len());
    for handle in handles {
        // This thread's stream now waits for the streams that used the buffer last.
        let resource = client.get_resource(handle.clone()).map_err(err)?;
        addresses.push(resource.resource().ptr);
        keep.push(Box::new(resource));
    }
    // And this waits for that stream.
    cubecl::future::block_on(client.sync()).map_err(err)?;
    Ok(addresses)
}

fn engine(e: impl std::fmt::Debug) -> CommError {
    CommError::Engine(format!("a device collective's CubeCL call: {e:?}"))
}

fn kernel(e: sshsdp_kernels::KernelError) -> CommError {
    CommError::Engine(format!("a device collective's kernel: {e}"))
}
