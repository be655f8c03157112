//! The runtime codec on CubeCL backends, following the same [`CodecOp`]s as the host codec
//! (bit-identical: `tests` below and `kernels-cubecl/tests/kernels/`), each list uploaded once
//! as a kernel table (`sshsdp_kernels::CodecTable`, cached per device in the codec):
//!
//! * **Decode** of a gathered MXFP8 or bf16 bucket: the gathered runtime bytes are uploaded as
//!   they are (≈1.001 bytes per value for square-block MXFP8, 2 for bf16), or gathered into
//!   device memory, and one launch (`decode_table`) writes the compute buffer, each rectangle
//!   into its place of its matrix, straight in the compute dtype. Uploading the host-decoded
//!   buffer instead would move 4 bytes per value.
//! * **Encode** of a piece whose fp32 master lives on the device (re-derive after an update):
//!   two launches (`encode_table`: every rectangle's scales, then its tiles and the bf16 runs,
//!   or the whole piece in the bf16 runtime format) into a zeroed device buffer, left there for
//!   a device engine or read back for the host collectives (≈1.001 bytes per value for MXFP8,
//!   2 for bf16) instead of the 4-byte master.

use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, DType, FloatDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::device::Device;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use sshsdp_kernels::{decode_table, encode_table, CodecEntry, CodecTable, DecodeTo, SquareAt};

use super::adapter::{to_cube, Inner};
use super::views::member_views;
use super::{
    client_of, cube_device, for_each_runtime, is_cube, lane_client, lane_upload, padded_to_words,
};
use crate::config::Precision;
use crate::error::HsdpError;
use crate::lanes::StageUnits;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::storage::codec::{BucketCodec, CodecOp, MX_FORMAT};
use crate::storage::compute::{ComputeBuf, Member};
use crate::storage::device_tables::TableOf;
use crate::traffic::{Purpose, Traffic};
use std::sync::Arc;

/// Uploads gathered host units into a CubeCL buffer of `device` on the shard lane, if `B` is a
/// CubeCL backend this build supports (`None` otherwise). Called on the model's thread: the
/// upload is queued on its stream where streams must not share buffers ([`lane_client`]). f32
/// units are narrowed on the host to a 16-bit `compute` dtype first (half the bytes to upload;
/// the same rounding as Burn's cast).
pub(crate) fn stager_if_cube<B: Backend>(
    device: &B::Device,
    compute: Precision,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn StageUnits>> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let client = lane_client(client_of::<B, R>(device));
            let narrow = (compute != Precision::F32).then_some(compute);
            let traffic = traffic.clone();
            return Some(Box::new(CubeStager::<R> { client, narrow, traffic }));
        }
    });
    None
}

/// [`StageUnits`] on a CubeCL client.
struct CubeStager<R: CubeRuntime> {
    client: ComputeClient<R>,
    /// The 16-bit compute dtype f32 units are narrowed to, if any.
    narrow: Option<Precision>,
    /// Charged with the uploads.
    traffic: Arc<Traffic>,
}

impl<R: CubeRuntime> StageUnits for CubeStager<R> {
    fn stage(self: Box<Self>, units: Elems) -> DeviceUnits {
        let len = units.len();
        let (handle, uploaded, narrowed, kind) = match (units, self.narrow) {
            (Elems::F32(values), Some(compute)) => {
                let data = ComputeBuf::new(values, compute).into_data();
                let uploaded = data.bytes.len() as u64;
                let bytes = padded_to_words(data.bytes.to_vec());
                let handle = lane_upload(&self.client, &bytes);
                (handle, uploaded, Some(compute), Elems::F32(Vec::new()))
            }
            (units, _) => {
                let handle = lane_upload(&self.client, &units.word_bytes());
                (handle, units.bytes(), None, units.zeros_like(0))
            }
        };
        self.traffic.upload(uploaded, Purpose::Data);
        DeviceUnits {
            len,
            kind,
            narrowed,
            buffer: Box::new(CubeUnits::<R>::new(self.client, handle)),
        }
    }
}

/// The f32 compute buffer of gathered runtime bytes uploaded from the host (the tests' entry to
/// [`decode_buffer`]).
#[cfg(test)]
pub(super) fn decode<B: Backend, R: CubeRuntime>(
    codec: &BucketCodec,
    bytes: Vec<u8>,
    device: &B::Device,
) -> Result<B::FloatTensorPrimitive, HsdpError> {
    let client = client_of::<B, R>(device);
    let len = bytes.len();
    let handle = client.create_from_slice(&padded_to_words(bytes));
    let units = CubeUnits::<R>::new(client, handle);
    let values = decode_buffer::<B, R>(codec, &units, len, device, Precision::F32)?;
    Ok(super::adapter::from_cube::<B, R>(values))
}

/// A CubeCL buffer of runtime units and the client that owns it (what
/// [`DeviceUnits`](crate::storage::DeviceUnits) holds where an engine gathered into device
/// memory).
pub(crate) struct CubeUnits<R: CubeRuntime> {
    /// The client of the buffer's device.
    pub client: ComputeClient<R>,
    /// The buffer: its length is a whole number of 4-byte words (the codec kernels read words).
    pub handle: Handle,
    /// Where kernels wrote the buffer after its allocation (the update's encode), a
    /// [`stream_mark`](super::stream_mark) made once they were queued: what an
    /// engine on another stream must wait for before it reads the buffer (`gather.rs`).
    /// `None` where the buffer was written with its allocation (an upload) or by an engine
    /// whose wait has returned.
    pub written: Option<Handle>,
}

impl<R: CubeRuntime> CubeUnits<R> {
    /// A buffer written with its allocation (or by a finished engine call): no mark.
    pub fn new(client: ComputeClient<R>, handle: Handle) -> Self {
        Self {
            client,
            handle,
            written: None,
        }
    }
}

/// Another handle on `units`' buffer (no copy), its write mark with it; `None` for a buffer of
/// no runtime this build supports.
pub(crate) fn share_units(units: &DeviceUnits) -> Option<DeviceUnits> {
    for_each_runtime!(R => {
        if let Some(cube) = units.buffer.downcast_ref::<CubeUnits<R>>() {
            let shared = CubeUnits::<R> {
                client: cube.client.clone(),
                handle: cube.handle.clone(),
                written: cube.written.clone(),
            };
            return Some(DeviceUnits {
                buffer: Box::new(shared),
                len: units.len,
                kind: units.kind.zeros_like(0),
                narrowed: units.narrowed,
            });
        }
    });
    None
}

/// The compute buffer (in `compute`) of the gathered runtime bytes in `units` (`len` of
/// them), decoded in one launch: each decoded f32 converted as Burn's cast converts it.
pub(super) fn decode_buffer<B: Backend, R: CubeRuntime>(
    codec: &BucketCodec,
    units: &CubeUnits<R>,
    len: usize,
    device: &B::Device,
    compute: Precision,
) -> Result<CubeTensor<R>, HsdpError> {
    codec.check_gathered(len)?;
    let cube = cube_device::<B, R>(device);
    let table = table_of(
        codec,
        TableOf::Decode,
        || codec.decode_ops(len),
        &units.client,
        cube,
    )?;
    let n = codec.compute_elems();
    let to = match compute {
        Precision::F32 => DecodeTo::F32,
        Precision::F16 => DecodeTo::F16,
        Precision::Bf16 => DecodeTo::Bf16,
    };
    // A fresh buffer for every decode: a wrapped buffer is never rewritten (`adapter.rs`).
    let out = units.client.empty((compute.bytes() as usize * n).max(4));
    decode_table(&units.client, &table, &units.handle, &out, to)
        .map_err(|e| HsdpError::Failed(format!("the device decode of a bucket: {e}")))?;
    Ok(cube_tensor::<B, R>(
        units,
        out,
        n,
        compute.dtype().into(),
        device,
    ))
}

/// `handle` (`n` values of `dtype`, on `units`' client) as a 1-D `CubeTensor` on `device`.
pub(crate) fn cube_tensor<B: Backend, R: CubeRuntime>(
    units: &CubeUnits<R>,
    handle: Handle,
    n: usize,
    dtype: DType,
    device: &B::Device,
) -> CubeTensor<R> {
    CubeTensor::<R>::new_contiguous(
        units.client.clone(),
        cube_device::<B, R>(device).clone(),
        Shape::from([n]),
        handle,
        dtype,
    )
}

/// The parameters `members` of runtime units an engine gathered into device memory (`units`:
/// every piece), decoded into `compute` on the device: f32
/// units and bf16 units computed in bf16 are the compute buffer as they are (the views share
/// the engine's receive buffer); others are decoded as in [`decode_views_if_cube`].
pub(crate) fn device_units_views<B: Backend>(
    codec: &BucketCodec,
    units: &DeviceUnits,
    members: &[Member],
    device: &B::Device,
    compute: Precision,
) -> Result<Vec<B::FloatTensorPrimitive>, HsdpError> {
    for_each_runtime!(R => {
        if let (true, Some(cube)) = (is_cube::<B, R>(), units.buffer.downcast_ref::<CubeUnits<R>>()) {
            let n = codec.compute_elems();
            let tensor = |dtype| cube_tensor::<B, R>(cube, cube.handle.clone(), n, dtype, device);
            // The bucket, and whether it is in the compute dtype already.
            let (bucket, is_compute) = match (&units.kind, compute) {
                _ if units.narrowed == Some(compute) => (tensor(compute.dtype().into()), true),
                (Elems::Bf16(_), Precision::Bf16) => (tensor(DType::BF16), true),
                (Elems::F32(_), _) => (tensor(DType::F32), compute == Precision::F32),
                // Decoded straight into the compute dtype: one launch, no second pass.
                _ => {
                    let len = units.bytes() as usize;
                    (decode_buffer::<B, R>(codec, cube, len, device, compute)?, true)
                }
            };
            // The cast runs on the CubeCL stream now (a fresh buffer), not in fusion's.
            let bucket = if is_compute {
                bucket
            } else {
                Inner::<R>::float_cast(bucket, compute.dtype())
            };
            return Ok(member_views::<B, R>(bucket, members));
        }
    });
    Err(HsdpError::Failed(
        "a gathered bucket in device memory of a runtime this build does not support".into(),
    ))
}

/// Piece `piece`'s runtime bytes (every section) encoded on the device from its fp32 elements
/// `master` (a 1-D tensor on `B`'s device) and read back — if `B` is a CubeCL backend this build
/// supports and the format has an encoding (`None` otherwise, and for the f32 format).
pub(crate) fn encode_piece_if_cube<B: Backend>(
    codec: &BucketCodec,
    piece: usize,
    master: &B::FloatTensorPrimitive,
    traffic: &Traffic,
) -> Option<Result<Vec<u8>, HsdpError>> {
    if !codec.encodes() {
        return None;
    }
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let bytes = encode::<B, R>(codec, piece, master);
            if let Ok(bytes) = &bytes {
                traffic.download(bytes.len() as u64, Purpose::Stage);
            }
            return Some(bytes);
        }
    });
    None
}

fn encode<B: Backend, R: CubeRuntime>(
    codec: &BucketCodec,
    piece: usize,
    master: &B::FloatTensorPrimitive,
) -> Result<Vec<u8>, HsdpError> {
    let master = to_cube::<B, R>(master.clone());
    let units = encode_on_device::<R>(codec, piece, &master)?;
    let mut read = units
        .client
        .read_one(units.handle)
        .map_err(|e| HsdpError::Failed(format!("reading an encoded piece: {e:?}")))?
        .to_vec();
    read.truncate(codec.piece_bytes());
    Ok(read)
}

/// Piece `piece`'s runtime units encoded on the device from its fp32 elements `master` (a 1-D
/// tensor on `B`'s device), left there: a new buffer of the encoded bytes, or, in the f32
/// format, the master's own buffer (its runtime elements are the master's values; Burn never
/// writes a buffer another handle shares) — if `B` is a CubeCL backend this build supports
/// (`None` otherwise).
pub(crate) fn encode_piece_units_if_cube<B: Backend>(
    codec: &BucketCodec,
    piece: usize,
    master: &B::FloatTensorPrimitive,
) -> Option<Result<DeviceUnits, HsdpError>> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            // The master's buffer as the update left it (on fusion: its queued work drained,
            // once per piece).
            let master = to_cube::<B, R>(master.clone());
            let units = if codec.encodes() {
                encode_on_device::<R>(codec, piece, &master)
            } else {
                f32_master::<R>(codec, &master)
                    .map(|m| CubeUnits::new(m.client.clone(), m.handle.clone()))
            };
            // The encode (or the update that wrote the f32 master) is queued: mark it, so an
            // engine on another stream reads the units only after it (`gather.rs`).
            let units = units.map(|mut units| {
                units.written = Some(super::stream_mark(&units.client));
                units
            });
            return Some(units.map(|units| {
                let kind = codec.empty_units();
                DeviceUnits {
                    buffer: Box::new(units),
                    len: codec.piece_bytes() / kind.unit_bytes() as usize,
                    kind,
                    narrowed: None,
                }
            }));
        }
    });
    None
}

/// `master` as the piece's contiguous f32 elements of a `CubeTensor<R>`, or why it is not.
fn f32_master<'a, R: CubeRuntime>(
    codec: &BucketCodec,
    master: &'a CubeTensor<R>,
) -> Result<&'a CubeTensor<R>, HsdpError> {
    let n = codec.piece_elems();
    let shape = master.meta.shape();
    if master.dtype != DType::F32 || !master.is_contiguous() || shape.num_elements() != n {
        return Err(HsdpError::Failed(format!(
            "a device master of {:?} {:?} is not the piece's {n} contiguous f32 elements",
            master.dtype,
            shape.to_vec()
        )));
    }
    Ok(master)
}

/// Encodes piece `piece` from its device master into a new zeroed buffer of its runtime bytes
/// (whole words).
fn encode_on_device<R: CubeRuntime>(
    codec: &BucketCodec,
    piece: usize,
    master: &CubeTensor<R>,
) -> Result<CubeUnits<R>, HsdpError> {
    let master = f32_master::<R>(codec, master)?;
    let ops = || {
        codec
            .encode_ops(piece)
            .ok_or_else(|| HsdpError::Failed("the f32 format has no encoding".into()))
    };
    let client = &master.client;
    let table = table_of(codec, TableOf::Encode(piece), ops, client, &master.device)?;
    let bytes = codec.piece_bytes();
    // A fresh zeroed buffer (Burn's fill kernel, on the CubeCL stream): bytes no operation
    // writes are zero, as on the host.
    let out = Inner::<R>::float_zeros(
        Shape::from([bytes.div_ceil(4).max(1)]),
        &master.device,
        FloatDType::F32,
    );
    encode_table(client, &table, MX_FORMAT.1, &master.handle, &out.handle)
        .map_err(|e| HsdpError::Failed(format!("the device encode of a piece: {e}")))?;
    Ok(CubeUnits::new(client.clone(), out.handle))
}

/// `codec`'s operations `which` as a kernel table on `device` (`client`'s): uploaded the first
/// time, from `ops()`.
fn table_of<R: CubeRuntime>(
    codec: &BucketCodec,
    which: TableOf,
    ops: impl FnOnce() -> Result<Vec<CodecOp>, HsdpError>,
    client: &ComputeClient<R>,
    device: &R::Device,
) -> Result<Arc<CodecTable>, HsdpError> {
    codec.device_tables.get_or_make(device.to_id(), which, || {
        let entries = ops()?
            .into_iter()
            .map(|op| match op {
                CodecOp::Square {
                    shape,
                    values,
                    stride,
                    data,
                    scales,
                } => {
                    if data % 4 != 0 || scales % 4 != 0 {
                        return Err(HsdpError::Failed(format!(
                            "an MXFP8 rectangle at bytes {data}/{scales} is not word-aligned"
                        )));
                    }
                    Ok(CodecEntry::Square(SquareAt {
                        rows: shape.rows,
                        cols: shape.cols,
                        values_offset: values,
                        values_stride: stride,
                        data_word: data / 4,
                        scales_word: scales / 4,
                    }))
                }
                CodecOp::Bf16 { bytes, n, values } => Ok(CodecEntry::Bf16 {
                    byte: bytes,
                    n,
                    values,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        CodecTable::new(client, &entries)
            .map_err(|e| HsdpError::Failed(format!("the codec's device table: {e}")))
    })
}
