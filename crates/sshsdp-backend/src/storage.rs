//! Runtime elements in the plan's runtime format: what a bucket's shards hold and what its
//! all-gathers move.
//!
//! * `F32`: the runtime elements *are* the fp32 master weights of this rank's piece (updated in
//!   place) and the gathered buffer becomes the compute tensor as it is.
//! * `Bf16`: half the bytes in storage and on the wire. The fp32 master weights of the piece are
//!   kept apart ([`crate::runtime`]); after each update the owner re-derives its bf16 piece from
//!   them (a cast, in place), and a gathered bucket is widened to the compute dtype once when it
//!   becomes resident (the CPU analogue of dequantising in a GEMM's load stage).

use std::ops::Range;

use half::bf16;
use sshsdp_plan::RuntimeFormat;

use crate::HsdpError;

/// A run of runtime elements.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Elems {
    /// fp32 elements.
    F32(Vec<f32>),
    /// bf16 elements (round-to-nearest-even from fp32).
    Bf16(Vec<bf16>),
}

/// Bytes per element of `format`, or an error for formats the decorator cannot hold yet.
pub(crate) fn element_bytes(format: RuntimeFormat) -> Result<u64, HsdpError> {
    match format {
        RuntimeFormat::F32 | RuntimeFormat::Bf16 => Ok(format
            .element_bytes()
            .expect("element-wise formats have an element size")),
        RuntimeFormat::Mxfp8 => Err(HsdpError::Unsupported(
            "runtime format Mxfp8: the decorator holds f32 and bf16 runtime parameters so far \
             (MXFP8 planes come with the CubeCL kernels)"
                .into(),
        )),
    }
}

impl Elems {
    /// `len` zeros of `format`'s element type (a receive buffer).
    pub fn zeros_like(&self, len: usize) -> Self {
        match self {
            Elems::F32(_) => Elems::F32(vec![0.0; len]),
            Elems::Bf16(_) => Elems::Bf16(vec![bf16::ZERO; len]),
        }
    }

    /// `values` encoded in `format` (`F32` or `Bf16`).
    pub fn encode(format: RuntimeFormat, values: Vec<f32>) -> Self {
        match format {
            RuntimeFormat::Bf16 => Elems::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            _ => Elems::F32(values),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len(),
            Elems::Bf16(v) => v.len(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            Elems::F32(v) => 4 * v.len() as u64,
            Elems::Bf16(v) => 2 * v.len() as u64,
        }
    }

    /// Whether the compute tensor needs a conversion of these elements (anything but fp32).
    pub fn needs_decode(&self) -> bool {
        !matches!(self, Elems::F32(_))
    }

    /// The elements as fp32: a move for `F32`, a widening pass for `Bf16`.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Elems::F32(v) => v,
            Elems::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Re-derives `range` from fp32 master values (a cast; nothing for `F32`, whose master
    /// elements are the runtime elements themselves).
    pub fn rederive(&mut self, range: Range<usize>, master: &[f32]) {
        match self {
            Elems::F32(v) => debug_assert_eq!(&v[range], master),
            Elems::Bf16(v) => v[range]
                .iter_mut()
                .zip(master)
                .for_each(|(d, &m)| *d = bf16::from_f32(m)),
        }
    }

    /// The fp32 elements, for the `F32` format's in-place master update.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Elems::F32(v) => Some(v),
            Elems::Bf16(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rederive() {
        let values = vec![1.0f32, 1.0 + 1.0 / 256.0, -3.5, 1e-3];
        let mut e = Elems::encode(RuntimeFormat::Bf16, values.clone());
        assert_eq!(e.bytes(), 8);
        assert!(e.needs_decode());
        let back = e.clone().into_f32();
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even gives 1.
        assert_eq!(back[..3], [1.0, 1.0, -3.5]);
        assert!((back[3] - 1e-3).abs() < 1e-5);
        e.rederive(1..3, &[2.0, 4.0]);
        assert_eq!(e.into_f32()[..3], [1.0, 2.0, 4.0]);
    }

    #[test]
    fn mxfp8_is_refused_with_a_reason() {
        let err = element_bytes(RuntimeFormat::Mxfp8).unwrap_err();
        assert!(err.to_string().contains("Mxfp8"), "{err}");
        assert_eq!(element_bytes(RuntimeFormat::Bf16).unwrap(), 2);
    }
}
