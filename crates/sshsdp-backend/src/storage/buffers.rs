//! The buffers of one rank's storage roles, whatever the placement: fp32 masters
//! ([`MasterBuf`]), runtime shards ([`ShardBuf`]), moves between host and device, and the
//! device allocator's report ([`DeviceMemory`]).

use std::ops::Range;
use std::sync::Arc;

use burn_backend::{read_sync, Backend, TensorData, TensorMetadata};

use crate::config::Placement;
use crate::units::{DeviceUnits, Elems};
use crate::HsdpError;

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

/// One piece's fp32 master weights, where [`Placement`] put them.
pub(crate) enum MasterBuf<B: Backend> {
    /// On the host.
    Host(Vec<f32>),
    /// A 1-D tensor on `B`'s device.
    Device(B::FloatTensorPrimitive),
}

impl<B: Backend> MasterBuf<B> {
    /// `values` placed by `placement` (uploaded to `device` for [`Placement::Device`]).
    pub fn new(placement: Placement, values: Vec<f32>, device: &B::Device) -> Self {
        match placement {
            Placement::Host => MasterBuf::Host(values),
            Placement::Device => MasterBuf::Device(upload::<B>(values, device)),
        }
    }

    /// Bytes held on the host.
    pub fn host_bytes(&self) -> u64 {
        match self {
            MasterBuf::Host(v) => 4 * v.len() as u64,
            MasterBuf::Device(_) => 0,
        }
    }

    /// Bytes held on the device.
    pub fn device_bytes(&self) -> u64 {
        match self {
            MasterBuf::Host(_) => 0,
            MasterBuf::Device(t) => 4 * t.shape().num_elements() as u64,
        }
    }
}

/// `values` as a 1-D f32 tensor on `device`.
pub(crate) fn upload<B: Backend>(values: Vec<f32>, device: &B::Device) -> B::FloatTensorPrimitive {
    let n = values.len();
    B::float_from_data(TensorData::new(values, [n]), device)
}

/// A float tensor's values, read back to the host as f32.
pub(crate) fn download<B: Backend>(tensor: B::FloatTensorPrimitive) -> Result<Vec<f32>, HsdpError> {
    read_sync(B::float_into_data(tensor))
        .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| HsdpError::Failed(format!("reading a device buffer: {e:?}")))
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
