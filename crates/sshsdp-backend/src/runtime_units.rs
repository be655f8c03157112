//! Runtime units: the runs of elements a bucket's runtime shards hold and its collectives move
//! ([`Elems`] on the host, [`DeviceUnits`] in a device buffer, [`Gathered`] either way). The
//! payload of the lanes (`lanes/`) and of storage (`storage/`), known to both, depending on
//! neither.
//!
//! * `F32`: the runtime elements *are* the fp32 master weights of this rank's piece (updated in
//!   place) and the gathered buffer becomes the compute tensor as it is.
//! * `Bf16`: half the bytes in storage and on the wire; the fp32 masters are kept apart.
//! * `U8`: square-block MXFP8 bytes (E4M3 elements, one E8M0 scale per 32×32 tile) and the
//!   little-endian bf16 bytes of parameters that fell back from MXFP8; the fp32 masters are kept
//!   apart.
//!
//! Where a parameter sits in these units and how they are encoded from the masters and decoded
//! for compute is the plan's layout, read by the bucket's codec (`storage/codec.rs`).

use half::bf16;

use crate::error::HsdpError;

/// Runtime units in a device buffer of the decorated backend (a CubeCL buffer: written by the
/// engine itself, `storage/cube/gather.rs`, or uploaded by the shard lane after a host gather,
/// `storage/cube/codec.rs`), opaque to the backend-generic runtime.
// Made and read only on CubeCL backends.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) struct DeviceUnits {
    /// The buffer and its client, as `storage/cube/gather.rs` made them.
    pub buffer: Box<dyn std::any::Any + Send>,
    /// Number of runtime units it holds.
    pub len: usize,
    /// An empty run of the units' type.
    pub kind: Elems,
    /// Where f32 units were narrowed on the host to a 16-bit compute dtype before the upload
    /// (the staged path of an f32 bucket computed in 16 bits: half the bytes), that dtype: the
    /// buffer holds the compute values then.
    pub narrowed: Option<crate::config::Precision>,
}

impl DeviceUnits {
    /// Bytes of the units.
    pub fn bytes(&self) -> u64 {
        self.kind.unit_bytes() * self.len as u64
    }
}

/// A gathered bucket's runtime units: in host memory (host backends, the FSDP2-style baseline)
/// or in device memory (CubeCL backends: NCCL on CubeCL's buffers, or staged by the lane).
pub(crate) enum Gathered {
    /// Host memory.
    Host(Elems),
    /// The decorated backend's device memory.
    Device(DeviceUnits),
}

impl Gathered {
    /// Bytes of the units.
    pub fn bytes(&self) -> u64 {
        match self {
            Gathered::Host(e) => e.bytes(),
            Gathered::Device(d) => d.bytes(),
        }
    }
}

/// Bytes of a device buffer holding `bytes` bytes: whole 4-byte words (the codec kernels read
/// words), at least one.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn word_buffer_len(bytes: usize) -> usize {
    bytes.next_multiple_of(4).max(4)
}

/// `bytes` zero-padded to [`word_buffer_len`].
pub(crate) fn padded_to_words(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes.resize(word_buffer_len(bytes.len()), 0);
    bytes
}

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
        self.unit_bytes() * self.len() as u64
    }

    /// Bytes of one unit.
    pub fn unit_bytes(&self) -> u64 {
        match self {
            Elems::F32(_) => 4,
            Elems::Bf16(_) => 2,
            Elems::U8(_) => 1,
        }
    }

    /// The units' element type for the engines.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn kind(&self) -> sshsdp_comm::ElementKind {
        match self {
            Elems::F32(_) => sshsdp_comm::ElementKind::F32,
            Elems::Bf16(_) => sshsdp_comm::ElementKind::Bf16,
            Elems::U8(_) => sshsdp_comm::ElementKind::U8,
        }
    }

    /// Every unit as little-endian bytes, zero-padded to whole 4-byte words (what a device
    /// buffer the codec kernels read holds); borrowed where nothing needs changing.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn word_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Elems::U8(v) if v.len() % 4 == 0 && !v.is_empty() => std::borrow::Cow::Borrowed(v),
            _ => std::borrow::Cow::Owned(padded_to_words(self.le_bytes(0..self.len()))),
        }
    }

    /// Units of the same type from their little-endian bytes (`bytes.len()` a multiple of the
    /// unit's size).
    pub fn units_from_le_bytes(&self, bytes: &[u8]) -> Self {
        match self {
            Elems::F32(_) => Elems::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Elems::Bf16(_) => Elems::Bf16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            Elems::U8(_) => Elems::U8(bytes.to_vec()),
        }
    }

    /// Copies `src` (the same unit type, `len` units) over units `at..at + len`.
    pub fn write_at(&mut self, at: usize, src: &Elems) -> Result<(), HsdpError> {
        let n = src.len();
        match (self, src) {
            (Elems::F32(d), Elems::F32(s)) => d[at..at + n].copy_from_slice(s),
            (Elems::Bf16(d), Elems::Bf16(s)) => d[at..at + n].copy_from_slice(s),
            (Elems::U8(d), Elems::U8(s)) => d[at..at + n].copy_from_slice(s),
            _ => {
                return Err(HsdpError::Failed(
                    "runtime units of another format than the shard's".into(),
                ))
            }
        }
        Ok(())
    }

    /// Units `range` as little-endian bytes (a copy).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn le_bytes(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        match self {
            Elems::F32(v) => v[range].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Elems::Bf16(v) => v[range]
                .iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect(),
            Elems::U8(v) => v[range].to_vec(),
        }
    }
}
