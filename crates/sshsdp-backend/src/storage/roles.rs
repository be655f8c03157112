//! The buffers of one rank's storage roles, whatever the placement: fp32 masters
//! ([`F32Buf`]), runtime shards ([`ShardBuf`]), moves between host and device, and the
//! device allocator's report ([`DeviceMemory`]).

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use burn_backend::{read_sync, Backend, ExecutionError, TensorData, TensorMetadata};

use sshsdp_comm::CommError;

use crate::config::Placement;
use crate::error::HsdpError;
use crate::lanes::ShardPart;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::storage::BucketCodec;
use crate::traffic::{Purpose, Traffic};

/// Memory of the decorated backend's device as its allocator reports it (CubeCL's
/// `memory_usage`): what tensors use against what the memory pools hold. Shared by every user
/// of the device in the process (all ranks driving it, and anything else on it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes in live allocations.
    pub in_use: u64,
    /// Bytes the pools hold (in use, plus free pages kept for reuse).
    pub reserved: u64,
    /// Live allocations.
    pub allocations: u64,
}

/// fp32 values of one piece (its master weights, or its reduced gradient) where their role's
/// [`Placement`] put them. Every move between host and device goes through [`F32Buf::to`],
/// which charges the bytes it moves.
pub(crate) enum F32Buf<B: Backend> {
    /// On the host.
    Host(Vec<f32>),
    /// A 1-D tensor on `B`'s device.
    Device(B::FloatTensorPrimitive),
}

impl<B: Backend> F32Buf<B> {
    /// `values` placed by `placement` (uploaded to `device` for [`Placement::Device`]).
    pub fn new(
        placement: Placement,
        values: Vec<f32>,
        device: &B::Device,
        traffic: &Traffic,
    ) -> Self {
        F32Buf::Host(values)
            .to(placement, device, traffic)
            .expect("an upload cannot fail")
    }

    /// Where the values are.
    pub fn placement(&self) -> Placement {
        match self {
            F32Buf::Host(_) => Placement::Host,
            F32Buf::Device(_) => Placement::Device,
        }
    }

    /// The values moved to `placement` (staging: charged to `traffic`); as they are when they
    /// are there already.
    pub fn to(
        self,
        placement: Placement,
        device: &B::Device,
        traffic: &Traffic,
    ) -> Result<Self, HsdpError> {
        Ok(match (self, placement) {
            (F32Buf::Host(values), Placement::Device) => {
                F32Buf::Device(upload::<B>(values, device, traffic, Purpose::Stage))
            }
            (F32Buf::Device(t), Placement::Host) => {
                F32Buf::Host(download::<B>(t, traffic, Purpose::Stage)?)
            }
            (values, _) => values,
        })
    }

    /// `self + other`, on the device if both are there, else on the host.
    pub fn add(self, other: Self, traffic: &Traffic) -> Result<Self, HsdpError> {
        Ok(match (self, other) {
            (F32Buf::Device(a), F32Buf::Device(b)) => F32Buf::Device(B::float_add(a, b)),
            (a, b) => {
                let (F32Buf::Host(mut a), F32Buf::Host(b)) =
                    (a.into_host(traffic)?, b.into_host(traffic)?)
                else {
                    unreachable!("moved to the host")
                };
                a.iter_mut().zip(&b).for_each(|(a, g)| *a += g);
                F32Buf::Host(a)
            }
        })
    }

    /// The values on the host (device ones read back: staging, charged to `traffic`).
    fn into_host(self, traffic: &Traffic) -> Result<Self, HsdpError> {
        match self {
            F32Buf::Device(t) => Ok(F32Buf::Host(download::<B>(t, traffic, Purpose::Stage)?)),
            host => Ok(host),
        }
    }

    /// The tensor of device values (`None` on the host).
    pub fn device_tensor(&self) -> Option<&B::FloatTensorPrimitive> {
        match self {
            F32Buf::Device(t) => Some(t),
            F32Buf::Host(_) => None,
        }
    }

    /// Encodes these values — piece `piece`'s updated fp32 master — into slot `slot` of the
    /// host shard `units` with `codec`: host values by the host codec; device values by the
    /// device kernels where `B` has them (only the encoded bytes read back), else read back and
    /// encoded on the host (staging, charged to `traffic`).
    pub fn encode_piece_into(
        &self,
        codec: &BucketCodec,
        units: &mut Elems,
        (slot, piece): (usize, usize),
        traffic: &Traffic,
    ) -> Result<(), HsdpError> {
        match self {
            F32Buf::Host(values) => codec.rederive(units, slot, piece, values),
            F32Buf::Device(t) => match super::encode_on_device::<B>(codec, piece, t, traffic) {
                Some(bytes) => codec.store_piece(units, slot, &bytes?),
                None => {
                    let values = download::<B>(t.clone(), traffic, Purpose::Stage)?;
                    codec.rederive(units, slot, piece, &values)
                }
            },
        }
    }

    /// The sum of the squares of every value of `bufs`, in f64: host values summed on the host
    /// in f64, device values on the device in f32 ([`device_sum_of_squares`]; one scalar
    /// read back for all, charged to `traffic`). An f32 sum can overflow to infinity where f64
    /// would not, which only makes values of norm beyond 1.8e19 count as non-finite.
    pub fn sum_of_squares<'a>(
        bufs: impl IntoIterator<Item = &'a Self> + Clone,
        traffic: &Traffic,
    ) -> Result<f64, HsdpError>
    where
        B: 'a,
    {
        let mut sum = 0f64;
        for buf in bufs.clone() {
            if let F32Buf::Host(v) = buf {
                sum += v.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>()
            }
        }
        if bufs
            .clone()
            .into_iter()
            .any(|b| b.device_tensor().is_some())
        {
            let device = bufs.into_iter().filter_map(|b| b.device_tensor());
            let total = device_sum_of_squares::<B>(device);
            sum += f64::from(download::<B>(total, traffic, Purpose::Data)?[0]);
        }
        Ok(sum)
    }

    /// Bytes held on the host.
    pub fn host_bytes(&self) -> u64 {
        match self {
            F32Buf::Host(v) => 4 * v.len() as u64,
            F32Buf::Device(_) => 0,
        }
    }

    /// Bytes held on the device.
    pub fn device_bytes(&self) -> u64 {
        match self {
            F32Buf::Host(_) => 0,
            F32Buf::Device(t) => 4 * t.shape().num_elements() as u64,
        }
    }
}

/// `values` as a 1-D f32 tensor on `device` (the upload charged to `traffic`).
pub(crate) fn upload<B: Backend>(
    values: Vec<f32>,
    device: &B::Device,
    traffic: &Traffic,
    purpose: Purpose,
) -> B::FloatTensorPrimitive {
    let n = values.len();
    let tensor = B::float_from_data(TensorData::new(values, [n]), device);
    traffic.upload(4 * n as u64, purpose);
    tensor
}

/// A float tensor's values, read back to the host as f32 (charged to `traffic`).
pub(crate) fn download<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    traffic: &Traffic,
    purpose: Purpose,
) -> Result<Vec<f32>, HsdpError> {
    let values = read_sync(B::float_into_data(tensor))
        .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))?;
    traffic.download(4 * values.len() as u64, purpose);
    Ok(values)
}

/// The sum of the squares of the values of `tensors` (at least one), left on the device: a
/// 1-element tensor (Burn's f32 sums: one per tensor, then of those).
pub(crate) fn device_sum_of_squares<'a, B: Backend>(
    tensors: impl IntoIterator<Item = &'a B::FloatTensorPrimitive>,
) -> B::FloatTensorPrimitive {
    let sums: Vec<_> = tensors
        .into_iter()
        .map(|t| B::float_sum(B::float_mul(t.clone(), t.clone())))
        .collect();
    B::float_sum(B::float_cat(sums, 0))
}

/// A read of a device tensor issued now and awaited later: the copy is queued behind the work
/// that produces the tensor, and the host waits for the device only in [`PendingRead::wait`] —
/// by which time the work queued after the read (an optimizer step) keeps the device busy.
///
/// Issued by polling Burn's read once: burn-cubecl's `into_data` queues the copy before its
/// first suspension point (CubeCL's `read_async` submits it), and burn-fusion's first drains
/// the lazy stream into the device queue and does the same; a backend that reads at once
/// (host memory) is done after that poll.
pub(crate) struct PendingRead {
    state: PendingState,
}

type ReadFuture = Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>>;

enum PendingState {
    InFlight(ReadFuture),
    Done(Result<TensorData, ExecutionError>),
}

impl PendingRead {
    /// Issues the read of `tensor`.
    pub fn issue<B: Backend>(tensor: B::FloatTensorPrimitive) -> Self {
        let mut future: ReadFuture = Box::pin(B::float_into_data(tensor));
        let mut cx = Context::from_waker(Waker::noop());
        let state = match future.as_mut().poll(&mut cx) {
            Poll::Ready(data) => PendingState::Done(data),
            Poll::Pending => PendingState::InFlight(future),
        };
        Self { state }
    }

    /// The values, once the device has produced them (a host wait until then), charged to
    /// `traffic` as one read.
    pub fn wait(self, traffic: &Traffic) -> Result<Vec<f32>, HsdpError> {
        let data = match self.state {
            PendingState::Done(data) => data,
            PendingState::InFlight(future) => read_sync(future),
        };
        let values = data
            .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))?
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))?;
        traffic.download(4 * values.len() as u64, Purpose::Data);
        Ok(values)
    }
}

/// A bucket's runtime shard on this rank, where its [`Placement`] put it.
pub(crate) enum ShardBuf {
    /// Host memory, what the host collectives read (shared with a gather in flight).
    Host(Arc<Elems>),
    /// A CubeCL buffer of the decorated backend's device (`cube/shard.rs`).
    Device(DeviceUnits),
}

impl ShardBuf {
    /// Number of runtime units.
    pub fn len(&self) -> usize {
        match self {
            ShardBuf::Host(e) => e.len(),
            ShardBuf::Device(d) => d.len,
        }
    }

    /// Bytes of the units.
    pub fn bytes(&self) -> u64 {
        match self {
            ShardBuf::Host(e) => e.bytes(),
            ShardBuf::Device(d) => d.bytes(),
        }
    }

    /// `len` zeros of the shard's unit type (a receive buffer).
    pub fn zeros_like(&self, len: usize) -> Elems {
        match self {
            ShardBuf::Host(e) => e.zeros_like(len),
            ShardBuf::Device(d) => d.kind.zeros_like(len),
        }
    }

    /// Whether the shard is in device memory.
    pub fn on_device(&self) -> bool {
        matches!(self, ShardBuf::Device(_))
    }

    /// What this rank sends of units `range` in an all-gather on device memory (a host shard's
    /// part is uploaded by the lane).
    pub fn send_units(&self, range: Range<usize>) -> SendUnits<'_> {
        match self {
            ShardBuf::Host(shard) => SendUnits::Host(shard, range),
            ShardBuf::Device(shard) => SendUnits::Device(shard, range),
        }
    }

    /// The gathered bucket of a rank alone in its shard group: a device shard's own buffer, shared
    /// (no copy: a shard is never rewritten, an update replaces it). `None` for a host shard.
    pub fn alone_gathered(&self) -> Option<DeviceUnits> {
        match self {
            ShardBuf::Device(shard) => super::share_device_units(shard),
            ShardBuf::Host(_) => None,
        }
    }

    /// What this rank contributes of units `range` to an all-gather on host memory: a host
    /// shard itself, or a copy of it where `copy_in` (FSDP2-style; its bytes are returned), or
    /// a reader of a device shard's part run on the lane (staging, charged to `traffic`).
    pub fn gather_part(
        &self,
        range: Range<usize>,
        copy_in: bool,
        traffic: &Arc<Traffic>,
    ) -> Result<(ShardPart, u64), CommError> {
        Ok(match self {
            ShardBuf::Host(shard) if copy_in => (
                ShardPart::Host(Arc::new((**shard).clone()), range),
                shard.bytes(),
            ),
            ShardBuf::Host(shard) => (ShardPart::Host(shard.clone(), range), 0),
            ShardBuf::Device(shard) => (super::device_part(shard, range, traffic)?, 0),
        })
    }

    /// A host shard's units, taken out (the shard holds no units until it is replaced; a copy
    /// where a gather still shares them); `None` for a device shard.
    pub fn take_host_units(&mut self) -> Option<Elems> {
        match self {
            ShardBuf::Host(shard) => {
                let shard = std::mem::replace(shard, Arc::new(shard.zeros_like(0)));
                Some(Arc::try_unwrap(shard).unwrap_or_else(|shared| (*shared).clone()))
            }
            ShardBuf::Device(_) => None,
        }
    }
}

/// What this rank sends in an all-gather on device memory.
// Read only on `CubeBackend<CudaRuntime>` (`cube/gather.rs`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum SendUnits<'a> {
    /// Units `range` of a host shard: uploaded first.
    Host(&'a Elems, Range<usize>),
    /// Units `range` of a CubeCL buffer (a device shard, or an updated piece for a rebuild):
    /// sent from where they are.
    Device(&'a DeviceUnits, Range<usize>),
}

/// A bucket's device gradient as a reduction starts from it.
// Read only on CubeCL backends (`cube/reduce.rs`).
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) enum GradSource<B: Backend> {
    /// The full-bucket gradient in the bucket's element space (a contiguous 1-D tensor in the
    /// reduction dtype), for the engine's reduction on device memory.
    Full(B::FloatTensorPrimitive),
    /// The members' flattened f32 gradients one after the other (`cat`), and where their runs
    /// go in the bucket's `full_len` elements: `(first element in the bucket, first element in
    /// cat, length)`. The staged path reads back only these values and places them on the host.
    Members {
        /// The concatenated gradients.
        cat: B::FloatTensorPrimitive,
        /// The runs.
        runs: Vec<(usize, usize, usize)>,
        /// Elements of the bucket.
        full_len: usize,
    },
}
