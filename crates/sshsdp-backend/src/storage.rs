//! Runtime units: what a bucket's runtime shards hold and what its all-gathers move.
//!
//! * `F32`: the runtime elements *are* the fp32 master weights of this rank's piece (updated in
//!   place) and the gathered buffer becomes the compute tensor as it is.
//! * `Bf16`: half the bytes in storage and on the wire; the fp32 masters are kept apart.
//! * `U8`: MXFP8 bytes (E4M3 row- and column-wise planes of 32-row bands, E8M0 scales) and the little-endian bf16 bytes of
//!   parameters that fell back from MXFP8; the fp32 masters are kept apart.
//!
//! Where a parameter sits in these units and how they are encoded from the masters and decoded
//! for compute is the plan's layout, read by the bucket's [`crate::codec::BucketCodec`].

use half::bf16;

/// A run of runtime units.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Elems {
    /// fp32 elements.
    F32(Vec<f32>),
    /// bf16 elements (round-to-nearest-even from fp32).
    Bf16(Vec<bf16>),
    /// Bytes (the MXFP8 runtime format).
    U8(Vec<u8>),
}

impl Elems {
    /// `len` zeros of the same unit type (a receive buffer).
    pub fn zeros_like(&self, len: usize) -> Self {
        match self {
            Elems::F32(_) => Elems::F32(vec![0.0; len]),
            Elems::Bf16(_) => Elems::Bf16(vec![bf16::ZERO; len]),
            Elems::U8(_) => Elems::U8(vec![0; len]),
        }
    }

    /// Number of units.
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len(),
            Elems::Bf16(v) => v.len(),
            Elems::U8(v) => v.len(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            Elems::F32(v) => 4 * v.len() as u64,
            Elems::Bf16(v) => 2 * v.len() as u64,
            Elems::U8(v) => v.len() as u64,
        }
    }

    /// The fp32 elements, for the `F32` format's in-place master update.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Elems::F32(v) => Some(v),
            _ => None,
        }
    }
}
