//! A decoded bucket on the host ([`ComputeBuf`]) and each parameter's place in it ([`Member`]):
//! what parameter views are cut from, on the host and on the device.

use burn_backend::TensorData;
use half::{bf16, f16};

use crate::config::Precision;

/// A decoded bucket on the host, in the compute dtype: what its parameters are views of.
pub(crate) enum ComputeBuf {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values (rounded to nearest even from the decoded f32, exact for bf16 and MXFP8
    /// runtime parameters).
    Bf16(Vec<bf16>),
    /// f16 values (rounded to nearest even from the decoded f32).
    F16(Vec<f16>),
}

impl ComputeBuf {
    /// The decoded f32 values `values` in `precision`.
    pub fn new(values: Vec<f32>, precision: Precision) -> Self {
        match precision {
            Precision::F32 => ComputeBuf::F32(values),
            Precision::Bf16 => {
                ComputeBuf::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect())
            }
            Precision::F16 => ComputeBuf::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            ComputeBuf::F32(v) => v.len(),
            ComputeBuf::Bf16(v) => v.len(),
            ComputeBuf::F16(v) => v.len(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            ComputeBuf::F32(v) => 4 * v.len() as u64,
            ComputeBuf::Bf16(v) => 2 * v.len() as u64,
            ComputeBuf::F16(v) => 2 * v.len() as u64,
        }
    }

    /// The whole buffer as 1-D tensor data (moved, not copied).
    pub fn into_data(self) -> TensorData {
        let n = self.len();
        match self {
            ComputeBuf::F32(v) => TensorData::new(v, [n]),
            ComputeBuf::Bf16(v) => TensorData::new(v, [n]),
            ComputeBuf::F16(v) => TensorData::new(v, [n]),
        }
    }

    /// A copy of `member`'s values as tensor data of its shape.
    pub fn member_data(&self, member: &Member) -> TensorData {
        let range = member.start..member.end();
        match self {
            ComputeBuf::F32(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
            ComputeBuf::Bf16(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
            ComputeBuf::F16(v) => TensorData::new(v[range].to_vec(), member.shape.clone()),
        }
    }
}

/// One parameter's place in a bucket: first element and shape.
pub(crate) struct Member {
    /// Element offset in the bucket.
    pub start: usize,
    /// Shape of the parameter.
    pub shape: Vec<usize>,
}

impl Member {
    /// One past the member's last element.
    pub fn end(&self) -> usize {
        self.start + self.shape.iter().product::<usize>()
    }
}
