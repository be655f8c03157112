//! Storage of one rank: where each role's buffers live ([`crate::Placement`]) and the runtime units
//! of a bucket's runtime shards.
//!
//! Roles and where they live today:
//!
//! | role | placement |
//! |---|---|
//! | runtime shard | [`HsdpConfig::with_shard_placement`](crate::HsdpConfig::with_shard_placement) ([`ShardBuf`]): host (what the host collectives read and write) or a CubeCL buffer of `B`'s device (by default where the engine moves device memory — NCCL, or in-process ranks sharing the device — and the masters are on the device: gathered from and rebuilt on the device, each update's piece encoded into it; elsewhere this rank's part is read back for each gather) |
//! | gathered bucket | `B`'s device: on CubeCL backends the gathered units land in a device buffer ([`DeviceUnits`]: written by NCCL itself, `cube/gather.rs`, or gathered on the host and uploaded by the shard lane) and are decoded there by kernels; elsewhere decoded on the host into one `B` tensor; parameters are views of it |
//! | gradient bucket | [`HsdpConfig::with_grad_placement`](crate::HsdpConfig::with_grad_placement): host (default; each gradient read back as it arrives) or `B`'s device (summed there; on CubeCL backends reduced from the device, `cube/reduce.rs`; elsewhere read back once per bucket for the host reduction) |
//! | fp32 masters | [`HsdpConfig::with_master_placement`](crate::HsdpConfig::with_master_placement): host (default) or `B`'s device ([`F32Buf`]) |
//! | optimizer state | with the masters: the optimizer's tensors on its device |
//!
//! With device masters the update runs on `B`'s device with no host copy of a master (the
//! optimizer gets [`crate::PieceValues::Device`]); each piece's runtime units are re-derived on
//! the device where `B` is a CubeCL backend (square-block MXFP8 tiles and bf16 encoded by the
//! kernels of `cube/codec.rs`); with device shards they stay there (they become the shard, or are
//! gathered into it), with host shards only those bytes are read back for the host collectives
//! that rebuild the shards — about half the master's bytes; elsewhere, and for the f32 format
//! with host shards, the master's values are read back and encoded on the host
//! ([`crate::Counters::staged_bytes`]).
//!
//! # The seam
//!
//! The runtime's stages (`runtime/`) reach storage only through this module: the buffers of each
//! role ([`ShardBuf`], [`F32Buf`], [`ComputeBuf`]), the codec of a bucket ([`BucketCodec`]:
//! layout and ops), and the functions below, which choose the placement's implementation:
//! `host/` (host memory: the codec run with `sshsdp-mx`, burn-ndarray views) or `cube/` (CubeCL
//! buffers: views, kernels, device collectives; features `wgpu`/`cuda`). What no placement supports is an error here,
//! not a `cfg` in the runtime.
//!
//! Layers: `storage` uses the lanes (`lanes/`, to hand device collectives over) and the
//! runtime units (`runtime_units.rs`), never the runtime or registration.

use std::ops::Range;
use std::sync::Arc;

use burn_backend::{Backend, Shape, Slice};
use sshsdp_comm::CommError;
use sshsdp_plan::Sharding;

use crate::config::Precision;
use crate::error::HsdpError;
use crate::lanes::{DeviceGatherJob, DeviceReduceJob, ShardPart, StageUnits};
use crate::runtime_units::{DeviceUnits, Elems};
use crate::traffic::{Purpose, Traffic};

pub(crate) mod codec;
pub(crate) mod compute;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) mod cube;
pub(crate) mod device_tables;
pub(crate) mod host;
pub(crate) mod rebuild;
pub(crate) mod roles;
pub(crate) mod step_values;

pub(crate) use codec::BucketCodec;
pub(crate) use compute::{ComputeBuf, Member};
pub(crate) use host::views::with_f32_values;
pub(crate) use rebuild::ShardRebuild;
pub(crate) use roles::upload;
pub use roles::DeviceMemory;
pub(crate) use roles::{
    device_sum_of_squares, download, F32Buf, GradSource, PendingRead, SendUnits, ShardBuf,
};
pub(crate) use step_values::TakenMaster;
pub use step_values::{HostMaster, PieceValues};

/// The memory of `device` if `B` is a CubeCL backend this build supports (`None` otherwise,
/// and when the device cannot say).
pub(crate) fn device_memory<B: Backend>(device: &B::Device) -> Option<DeviceMemory> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        cube::memory_usage::<B>(device)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        None
    }
}

/// The buffer-offset alignment of `device` in bytes where `B` is a CubeCL backend this build
/// supports (`None` otherwise: other backends place no constraint on views).
pub(crate) fn alignment<B: Backend>(device: &B::Device) -> Option<u64> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::alignment::<B>(device);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        None
    }
}

/// The CUDA ordinal of `device` where `B` is `CubeBackend<CudaRuntime, …>` or fusion over it
/// (`None` elsewhere):
/// where an engine that moves device memory (NCCL) can gather and reduce `B`'s buffers.
pub(crate) fn cuda_ordinal<B: Backend>(device: &B::Device) -> Option<usize> {
    #[cfg(feature = "cuda")]
    return cube::gather::cuda_ordinal::<B>(device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// The bucket buffer `full` as one tensor per member, each a view into it; the bytes uploaded
/// into `B`'s memory (none where `B` takes the host allocation itself: burn-ndarray) are
/// charged to `traffic`.
pub(crate) fn bucket_views<B: Backend>(
    full: ComputeBuf,
    members: &[Member],
    device: &B::Device,
    traffic: &Traffic,
) -> Vec<B::FloatTensorPrimitive> {
    #[cfg(feature = "ndarray")]
    let full = match full {
        ComputeBuf::F32(values) => match host::views::views_if_ndarray::<B>(values, members) {
            Ok(views) => return views,
            Err(values) => ComputeBuf::F32(values),
        },
        other => other,
    };
    traffic.upload(full.bytes(), Purpose::Data);
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    let full = match cube::views::views_if_cube::<B>(full, members, device) {
        Ok(views) => return views,
        Err(full) => full,
    };
    let bucket = B::float_from_data(full.into_data(), device);
    members
        .iter()
        .map(|m| {
            let slice = Slice {
                start: m.start as isize,
                end: Some(m.end() as isize),
                step: 1,
            };
            let flat = B::float_slice(bucket.clone(), &[slice]);
            B::float_reshape(flat, Shape::from(m.shape.clone()))
        })
        .collect()
}

/// Each member of the bucket buffer `full` copied into a tensor of its own (the FSDP2-style
/// baseline's copy-out; the uploads charged to `traffic`), and the bytes copied.
pub(crate) fn member_copies<B: Backend>(
    full: &ComputeBuf,
    members: &[Member],
    device: &B::Device,
    traffic: &Traffic,
) -> (Vec<B::FloatTensorPrimitive>, u64) {
    let mut copied = 0;
    let params = members
        .iter()
        .map(|m| {
            let data = full.member_data(m);
            copied += data.bytes.len() as u64;
            traffic.upload(data.bytes.len() as u64, Purpose::Data);
            B::float_from_data(data, device)
        })
        .collect();
    (params, copied)
}

/// What uploads a host gather's units on the lane (charging `traffic`), where parameters are
/// views of a CubeCL buffer of `device` in `compute` (`None` elsewhere: host backends).
pub(crate) fn stager<B: Backend>(
    device: &B::Device,
    compute: Precision,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn StageUnits>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::codec::stager_if_cube::<B>(device, compute, traffic);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (device, compute, traffic);
        None
    }
}

/// Parameter views of units gathered into device memory, decoded there where they are not in
/// the compute dtype `compute`.
pub(crate) fn device_views<B: Backend>(
    codec: &BucketCodec,
    units: &DeviceUnits,
    members: &[Member],
    device: &B::Device,
    compute: Precision,
) -> Result<Vec<B::FloatTensorPrimitive>, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::codec::device_units_views::<B>(codec, units, members, device, compute);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (codec, units, members, device, compute);
        Err(no_cube())
    }
}

/// What reads units `range` of a device shard back on the shard lane (staging, charged to
/// `traffic`).
pub(crate) fn device_part(
    shard: &DeviceUnits,
    range: Range<usize>,
    traffic: &Arc<Traffic>,
) -> Result<ShardPart, CommError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::shard::units_reader(shard, range, traffic.clone(), Purpose::Stage)
        .map(ShardPart::Device)
        .map_err(|e| CommError::Engine(e.to_string()));
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (shard, range, traffic);
        Err(CommError::Engine(no_cube().to_string()))
    }
}

/// Another handle on the device buffer of `units` (no copy), where the backend is a CubeCL
/// backend this build supports.
pub(crate) fn share_device_units(units: &DeviceUnits) -> Option<DeviceUnits> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(shared) = cube::codec::share_units(units) {
        return Some(shared);
    }
    let _ = units;
    None
}

/// Whether launch marks are on (`SSHSDP_LAUNCH_MARKS=1`, read once): a diagnostic for
/// counting kernel launches with CubeCL's profiling log (`scripts/count_launches`).
pub(crate) fn launch_marks_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SSHSDP_LAUNCH_MARKS").is_ok_and(|v| v == "1"))
}

/// Marks the start (`begin`) or end of an update in `device`'s queue when launch marks are on
/// ([`launch_marks_on`]) and `B` is a CubeCL backend: one 1-element kernel whose name the
/// profiling log shows. The end mark first flushes the backend's lazy work (fusion holds the
/// optimizer's element-wise chains until something reads them), so that the update's kernels
/// run inside its marks: marking runs count launches, they time nothing. Nothing otherwise.
pub(crate) fn mark_update<B: Backend>(device: &B::Device, begin: bool) {
    if !launch_marks_on() {
        return;
    }
    if !begin {
        let _ = B::sync(device);
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    cube::launch_mark::<B>(
        device,
        match begin {
            true => sshsdp_kernels::LaunchMark::UpdateBegin,
            false => sshsdp_kernels::LaunchMark::UpdateEnd,
        },
    );
    let _ = (device, begin);
}

/// Piece `piece`'s runtime bytes encoded on the device from its device master `master`, where
/// the decorated backend is a CubeCL backend this build supports and the format has an encoding
/// (`None` otherwise: the master is read back and encoded on the host). The bytes read back
/// are charged to `traffic`.
pub(crate) fn encode_on_device<B: Backend>(
    codec: &BucketCodec,
    piece: usize,
    master: &B::FloatTensorPrimitive,
    traffic: &Traffic,
) -> Option<Result<Vec<u8>, HsdpError>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(bytes) = cube::codec::encode_piece_if_cube::<B>(codec, piece, master, traffic) {
        return Some(bytes);
    }
    let _ = (codec, piece, master, traffic);
    None
}

/// Piece `piece`'s runtime units encoded on the device from its device master, left there (a
/// device shard exists only on CubeCL backends).
pub(crate) fn encode_units_on_device<B: Backend>(
    codec: &BucketCodec,
    piece: usize,
    master: &B::FloatTensorPrimitive,
) -> Result<DeviceUnits, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(units) = cube::codec::encode_piece_units_if_cube::<B>(codec, piece, master) {
        return units;
    }
    let _ = (codec, piece, master);
    Err(no_cube())
}

/// Every unit of `units`, read back to the host (staging, charged to `traffic`).
pub(crate) fn read_device_units(
    units: &DeviceUnits,
    traffic: &Arc<Traffic>,
) -> Result<Elems, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::shard::read_units(units, 0..units.len, traffic);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (units, traffic);
        Err(no_cube())
    }
}

/// `shard` uploaded into a device buffer of `device` (staging, charged to `traffic`).
pub(crate) fn upload_shard<B: Backend>(
    device: &B::Device,
    shard: &Elems,
    traffic: &Traffic,
) -> Result<DeviceUnits, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(units) = cube::shard::upload_units::<B>(device, shard, traffic, Purpose::Stage) {
        return Ok(units);
    }
    let _ = (device, shard, traffic);
    Err(no_cube())
}

/// A reduced piece in device memory as an f32 tensor of `B` on `device`.
pub(crate) fn device_piece<B: Backend>(
    units: &DeviceUnits,
    device: &B::Device,
) -> Result<B::FloatTensorPrimitive, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::reduce::piece_tensor::<B>(units, device);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (units, device);
        Err(no_cube())
    }
}

/// Whether `B`'s float tensors hold CubeCL buffers of a runtime this build supports
/// (`CubeBackend<R, …>` or `Fusion<CubeBackend<R, …>>`, `cube/adapter.rs`).
#[cfg_attr(
    not(any(feature = "wgpu", feature = "cuda")),
    allow(clippy::extra_unused_type_parameters)
)]
pub(crate) fn is_cube_backend<B: Backend>() -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::is_cube_backend::<B>();
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    false
}

/// Whether gradients of `B` held on its device are reduced from there (a CubeCL backend this
/// build supports; elsewhere the runtime reads them back for the host collectives).
#[cfg_attr(
    not(any(feature = "wgpu", feature = "cuda")),
    allow(clippy::extra_unused_type_parameters)
)]
pub(crate) fn reduces_on_device<B: Backend>() -> bool {
    is_cube_backend::<B>()
}

/// The mesh and piece a gradient reduction runs over: the replica and shard groups' sizes (a
/// group of one rank is a stage that moves nothing) and the piece's elements.
#[derive(Clone, Copy, Debug)]
// Read only by the device reduction of CubeCL backends.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) struct ReduceShape {
    /// Ranks of the replica group.
    pub replicas: usize,
    /// Ranks of the shard group (runtime shards per bucket).
    pub shards: usize,
    /// Elements of this rank's reduced piece.
    pub piece_len: usize,
}

/// The reduction job of `source` over `shards` shards into a piece of `piece_len` elements in
/// the reduction dtype `reduce`: by the engine on device memory for [`GradSource::Full`],
/// staged through the host for [`GradSource::Members`] (`None` where `B` is not a CubeCL
/// backend this build supports: see [`reduces_on_device`]).
pub(crate) fn device_reduce_job<B: Backend>(
    source: GradSource<B>,
    reduce: Precision,
    sharding: Sharding,
    shape: ReduceShape,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn DeviceReduceJob>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::reduce::reduce_job_if_cube::<B>(source, reduce, sharding, shape, traffic);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (source, reduce, sharding, shape, traffic);
        None
    }
}

/// The buffers of an all-gather of `send` into `full_len` units on `device`, moved by the engine
/// in device memory (NCCL on `CubeBackend<CudaRuntime>` where [`cuda_ordinal`] matches the
/// engine's GPU, or ranks of this process sharing `device`): the job for a lane (which charges
/// `traffic` with a host part's upload).
pub(crate) fn device_gather<B: Backend>(
    device: &B::Device,
    send: SendUnits<'_>,
    full_len: usize,
    traffic: &Arc<Traffic>,
) -> Result<Box<dyn DeviceGatherJob>, HsdpError> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::gather::gather_buffers::<B>(device, send, full_len, traffic);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (device, send, full_len, traffic);
        Err(no_cube())
    }
}

/// The job of an update-group collective on `tensor` (f32, 1-D), moved by the engine in device
/// memory: the all-reduce in place (`recv` `None`) or the all-to-all-v into a new buffer of
/// `recv` elements (`None` where `B` is not a CubeCL backend this build supports).
pub(crate) fn device_update_job<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    recv: Option<usize>,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn DeviceGatherJob>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::update_job::update_job_if_cube::<B>(tensor, recv, traffic);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (tensor, recv, traffic);
        None
    }
}

/// Why device runtime units cannot exist on this backend.
fn no_cube() -> HsdpError {
    HsdpError::Unsupported(
        "runtime shards on the device need a CubeCL backend (burn-cubecl's CubeBackend on wgpu \
         or CUDA, with this crate's `wgpu` or `cuda` feature)"
            .into(),
    )
}
