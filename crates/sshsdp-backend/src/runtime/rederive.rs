//! Re-deriving runtime units after an update: each piece's bytes encoded from its updated
//! fp32 master (bf16 cast or square-block MXFP8, on the host or by the device kernels) into
//! this rank's slot of its shard, and the shard rebuilt across the replicas.

use std::sync::Arc;

use burn_backend::Backend;

use super::{Runtime, State};
use crate::lanes::Reply;
use crate::storage::{
    device_gather, download, encode_on_device, encode_units_on_device, read_device_units, upload,
    upload_shard, MasterBuf, SendUnits, ShardBuf,
};
use crate::units::{DeviceUnits, Elems};
use crate::HsdpError;

/// A runtime shard's rebuild after its piece was re-derived.
pub(super) enum Rebuild {
    /// A host shard, rebuilt by the host collectives.
    Host(Reply<Elems>),
    /// A device shard rebuilt by the host collectives (the engine moves host memory), uploaded
    /// once rebuilt.
    Staged(Reply<Elems>),
    /// A device shard rebuilt by the engine on device memory.
    Device(Reply<DeviceUnits>),
    /// A device shard that is one piece: the re-derived piece is the shard.
    Done(ShardBuf),
}

/// The rebuilt shard of bucket `b`.
pub(super) fn finish_rebuild<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    rebuild: Rebuild,
) -> Result<ShardBuf, HsdpError> {
    Ok(match rebuild {
        Rebuild::Host(reply) => ShardBuf::Host(Arc::new(rt.wait(b, "wait rebuild", reply)?)),
        Rebuild::Staged(reply) => {
            let shard = rt.wait(b, "wait rebuild", reply)?;
            let units = upload_shard::<B>(&rt.materialiser.device, &shard)?;
            st.counters.staged_bytes += units.uploaded;
            st.counters.uploaded_bytes += units.uploaded;
            ShardBuf::Device(units)
        }
        Rebuild::Device(reply) => ShardBuf::Device(rt.wait(b, "wait rebuild", reply)?),
        Rebuild::Done(shard) => shard,
    })
}

/// Re-derives the runtime units of piece `piece` of bucket `b` (this rank's slot of its shard)
/// from the updated master and queues the shard's rebuild: `staged` holds the master's values
/// when they were staged to the host for the step.
pub(super) fn rederive_piece<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    piece: usize,
    staged: Option<Vec<f32>>,
) -> Result<Rebuild, HsdpError> {
    if st.storage[b].shard.on_device() {
        return rederive_device_piece(rt, st, b, piece, staged);
    }
    let device = &rt.materialiser.device;
    let State {
        storage, counters, ..
    } = &mut *st;
    let bucket = &mut storage[b];
    // Where the piece's new runtime units come from.
    let source = match (&mut bucket.master, staged) {
        (Some(MasterBuf::Device(t)), Some(values)) => {
            // Staged for host views: the updated values go back to the device.
            counters.staged_bytes += 4 * values.len() as u64;
            counters.uploaded_bytes += 4 * values.len() as u64;
            *t = upload::<B>(values.clone(), device);
            Rederive::Host(values)
        }
        (Some(MasterBuf::Device(t)), None) => {
            match encode_on_device::<B>(&rt.codecs[b], piece, t) {
                Some(bytes) => {
                    let bytes = bytes?;
                    counters.staged_bytes += bytes.len() as u64;
                    counters.downloaded_bytes += bytes.len() as u64;
                    Rederive::Encoded(bytes)
                }
                None => {
                    let values = download::<B>(t.clone())?;
                    counters.staged_bytes += 4 * values.len() as u64;
                    counters.downloaded_bytes += 4 * values.len() as u64;
                    Rederive::Host(values)
                }
            }
        }
        _ => Rederive::Stored,
    };
    let ShardBuf::Host(shard) = &mut bucket.shard else {
        unreachable!("device shards are re-derived by rederive_device_piece")
    };
    let units = Arc::make_mut(shard);
    let (codec, slot) = (&rt.codecs[b], rt.piece_in_shard);
    match (&bucket.master, &source) {
        (_, Rederive::Host(values)) => codec.rederive(units, slot, piece, values)?,
        (_, Rederive::Encoded(bytes)) => codec.store_piece(units, slot, bytes)?,
        (Some(MasterBuf::Host(master)), Rederive::Stored) => {
            codec.rederive(units, slot, piece, master)?
        }
        // f32 with host masters: the runtime elements were updated in place.
        (_, Rederive::Stored) => {}
    }
    let empty = Arc::new(units.zeros_like(0));
    let shard = std::mem::replace(shard, empty);
    let shard = Arc::try_unwrap(shard).unwrap_or_else(|shared| (*shared).clone());
    Ok(Rebuild::Host(rt.worker.rebuild(b, shard)))
}

/// [`rederive_piece`] for a device shard: the piece is encoded on the device from its device
/// master (uploaded first when staged for the step) and becomes the shard where the shard is one
/// piece; otherwise the replica group's pieces are gathered into the shard, by the engine on
/// device memory where it can, else through the host.
fn rederive_device_piece<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    b: usize,
    piece: usize,
    staged: Option<Vec<f32>>,
) -> Result<Rebuild, HsdpError> {
    let device = &rt.materialiser.device;
    let State {
        storage, counters, ..
    } = &mut *st;
    let bucket = &mut storage[b];
    let Some(MasterBuf::Device(master)) = &mut bucket.master else {
        return Err(HsdpError::Failed(format!(
            "bucket {b}: a device shard without a device master"
        )));
    };
    if let Some(values) = staged {
        counters.staged_bytes += 4 * values.len() as u64;
        counters.uploaded_bytes += 4 * values.len() as u64;
        *master = upload::<B>(values, device);
    }
    let codec = &rt.codecs[b];
    let units = encode_units_on_device::<B>(codec, piece, master)?;
    if rt.plan.pieces_per_shard() == 1 {
        return Ok(Rebuild::Done(ShardBuf::Device(units)));
    }
    let shard_len = bucket.shard.len();
    if rt.engine_on_device {
        let send = SendUnits::Device(&units, 0..units.len);
        let (job, _) = device_gather::<B>(device, send, shard_len)?;
        return Ok(Rebuild::Device(rt.worker.rebuild_on_device(b, job)));
    }
    // Through the host: this rank's piece in its slot of a host shard, rebuilt by the host
    // collectives, uploaded once rebuilt (`finish_rebuild`).
    let piece_units = read_device_units(&units)?;
    counters.staged_bytes += piece_units.bytes();
    counters.downloaded_bytes += piece_units.bytes();
    let mut shard = piece_units.zeros_like(shard_len);
    shard.write_at(rt.piece_in_shard * piece_units.len(), &piece_units)?;
    Ok(Rebuild::Staged(rt.worker.rebuild(b, shard)))
}

/// Where a piece's new runtime units come from after its update.
enum Rederive {
    /// The master's values on the host (host masters, or device ones staged to the host):
    /// encoded by the host codec.
    Host(Vec<f32>),
    /// Encoded on the device from the device master and read back (runtime bytes).
    Encoded(Vec<u8>),
    /// The host master in storage, or (f32 format with host masters) nothing to do: the runtime
    /// elements are the masters, updated in place.
    Stored,
}
