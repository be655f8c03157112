//! Runtime shards in CubeCL buffers ([`ShardBuf::Device`](crate::storage::ShardBuf)): made once
//! at registration from the host-encoded shard, replaced by each update's piece encoded on the
//! device (`codec.rs`, `encode_piece_units_if_cube`) or by the rebuilt shard, and read back only
//! where a host collective needs this rank's part (engines without device collectives).

use std::ops::Range;

use burn_backend::Backend;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use sshsdp_comm::{CommError, CommResult};

use super::codec::CubeUnits;
use super::{client_of, for_each_runtime, is_cube};
use crate::error::HsdpError;
use crate::lanes::ReadUnits;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::traffic::{Purpose, Traffic};
use std::sync::Arc;

/// `units` in a new CubeCL buffer of `device`, if `B` is a CubeCL backend this build supports
/// (`None` otherwise).
pub(crate) fn upload_units<B: Backend>(
    device: &B::Device,
    units: &Elems,
    traffic: &Traffic,
    purpose: Purpose,
) -> Option<DeviceUnits> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let client = client_of::<B, R>(device);
            let handle = client.create_from_slice(&units.word_bytes());
            traffic.upload(units.bytes(), purpose);
            return Some(DeviceUnits {
                buffer: Box::new(CubeUnits::<R>::new(client, handle)),
                len: units.len(),
                kind: units.zeros_like(0),
                narrowed: None,
            });
        }
    });
    None
}

/// What reads units `range` of `units` back to the host on a lane (charging `traffic` with
/// `purpose`).
pub(crate) fn units_reader(
    units: &DeviceUnits,
    range: Range<usize>,
    traffic: Arc<Traffic>,
    purpose: Purpose,
) -> Result<Box<dyn ReadUnits>, HsdpError> {
    for_each_runtime!(R => {
        if let Some(cube) = units.buffer.downcast_ref::<CubeUnits<R>>() {
            return Ok(Box::new(CubeReader::<R> {
                client: cube.client.clone(),
                handle: cube.handle.clone(),
                kind: units.kind.zeros_like(0),
                range,
                traffic,
                purpose,
            }));
        }
    });
    Err(HsdpError::Failed(
        "a device shard of a runtime this build does not support".into(),
    ))
}

/// Units `range` of `units`, read back to the host now (on the calling thread; staging).
pub(crate) fn read_units(
    units: &DeviceUnits,
    range: Range<usize>,
    traffic: &Arc<Traffic>,
) -> Result<Elems, HsdpError> {
    Ok(units_reader(units, range, traffic.clone(), Purpose::Stage)?.read()?)
}

/// [`ReadUnits`] over a CubeCL buffer.
struct CubeReader<R: CubeRuntime> {
    client: ComputeClient<R>,
    /// The whole buffer (whole 4-byte words).
    handle: Handle,
    /// An empty run of the units' type.
    kind: Elems,
    /// The units to read.
    range: Range<usize>,
    /// Charged with the bytes read.
    traffic: Arc<Traffic>,
    purpose: Purpose,
}

impl<R: CubeRuntime> ReadUnits for CubeReader<R> {
    fn read(self: Box<Self>) -> CommResult<Elems> {
        if self.range.is_empty() {
            return Ok(self.kind);
        }
        let unit = self.kind.unit_bytes();
        let (start, end) = (unit * self.range.start as u64, unit * self.range.end as u64);
        // Copies out of a device buffer move whole words (wgpu): read the words around the
        // units, keep the units.
        let (first, last) = (start / 4 * 4, end.next_multiple_of(4));
        // Relative to the handle's own offsets, if any (a master's buffer).
        let size = self.handle.size_in_used();
        if last > size {
            return Err(CommError::Engine(format!(
                "reading bytes {start}..{end} of a device buffer of {size}"
            )));
        }
        let words = self.handle.offset_start(first).offset_end(size - last);
        let bytes = self
            .client
            .read_one(words)
            .map_err(|e| CommError::Engine(format!("reading a device shard: {e:?}")))?;
        let at = (start - first) as usize;
        self.traffic.download(end - start, self.purpose);
        Ok(self
            .kind
            .units_from_le_bytes(&bytes[at..at + (end - start) as usize]))
    }
}
