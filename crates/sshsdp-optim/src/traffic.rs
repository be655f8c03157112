//! The optimizers' own host↔tensor traffic: every read of a tensor's values into host memory and
//! every upload of host values into a tensor goes through [`read_values`] and [`upload_values`],
//! which charge a [`TrafficCounter`], so "nothing crosses" is checkable (a test asserts no read
//! in the device update). On a GPU backend each read is a host wait for the device queue; on a
//! CPU backend (NdArray, Flex) the same calls are copies, counted alike.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp_backend::HsdpError;

/// Reads and uploads an optimizer made (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTraffic {
    /// Tensor reads into host memory (each a host wait on a device backend).
    pub reads: u64,
    /// Bytes they read.
    pub read_bytes: u64,
    /// Uploads of host values into tensors.
    pub uploads: u64,
    /// Bytes they uploaded.
    pub upload_bytes: u64,
}

impl HostTraffic {
    /// Whether nothing crossed.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// What was charged after `start` (an earlier reading of the same running counts).
    pub fn since(self, start: Self) -> Self {
        Self {
            reads: self.reads.saturating_sub(start.reads),
            read_bytes: self.read_bytes.saturating_sub(start.read_bytes),
            uploads: self.uploads.saturating_sub(start.uploads),
            upload_bytes: self.upload_bytes.saturating_sub(start.upload_bytes),
        }
    }

    /// Both counts added.
    pub fn plus(self, other: Self) -> Self {
        Self {
            reads: self.reads + other.reads,
            read_bytes: self.read_bytes + other.read_bytes,
            uploads: self.uploads + other.uploads,
            upload_bytes: self.upload_bytes + other.upload_bytes,
        }
    }
}

/// A running [`HostTraffic`], charged through shared references (reads for checkpoints happen
/// in `&self` methods).
#[derive(Debug, Default)]
pub(crate) struct TrafficCounter {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    uploads: AtomicU64,
    upload_bytes: AtomicU64,
}

impl TrafficCounter {
    /// What was charged since the last call, reset to zero.
    pub fn take(&self) -> HostTraffic {
        HostTraffic {
            reads: self.reads.swap(0, Ordering::Relaxed),
            read_bytes: self.read_bytes.swap(0, Ordering::Relaxed),
            uploads: self.uploads.swap(0, Ordering::Relaxed),
            upload_bytes: self.upload_bytes.swap(0, Ordering::Relaxed),
        }
    }

    /// What was charged so far, without resetting.
    pub fn peek(&self) -> HostTraffic {
        HostTraffic {
            reads: self.reads.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
            upload_bytes: self.upload_bytes.load(Ordering::Relaxed),
        }
    }

    fn read(&self, bytes: u64) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn upload(&self, bytes: u64) {
        self.uploads.fetch_add(1, Ordering::Relaxed);
        self.upload_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// `tensor`'s values as f32 in host memory (one read, charged to `counter`).
pub(crate) fn read_values<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    counter: &TrafficCounter,
) -> Result<Vec<f32>, HsdpError> {
    let values = tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| HsdpError::Failed(format!("reading optimizer values: {e:?}")))?;
    counter.read(4 * values.len() as u64);
    Ok(values)
}

/// `values` (row-major, of `shape`) as a tensor on `device` (one upload, charged to `counter`).
pub(crate) fn upload_values<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
    counter: &TrafficCounter,
) -> Tensor<B, D> {
    counter.upload(4 * values.len() as u64);
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// `indices` as an index tensor on `device` (one upload, charged to `counter`).
pub(crate) fn upload_indices<B: Backend>(
    indices: Vec<i64>,
    device: &B::Device,
    counter: &TrafficCounter,
) -> Tensor<B, 1, Int> {
    let n = indices.len();
    counter.upload(8 * n as u64);
    Tensor::from_data(TensorData::new(indices, [n]), device)
}
