//! [`NcclUniqueId`]: the id every rank of a new NCCL world shares, and its agreement over a
//! bootstrap engine (`agree_ids`).

use cudarc::nccl::{result, sys};

use super::{nccl_error, probe};
use crate::{Collective, CommError, CommResult, ReduceOp};

/// Length in bytes of an NCCL unique id.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// The id every rank of a new NCCL world must share: 128 opaque bytes made by one rank
/// ([`NcclUniqueId::new`]) and sent to the others by any means ([`NcclUniqueId::as_bytes`],
/// [`NcclUniqueId::from_bytes`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    bytes: [u8; NCCL_UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclUniqueId").finish_non_exhaustive()
    }
}

impl NcclUniqueId {
    /// Makes a new id (`ncclGetUniqueId`); call it on one rank only.
    ///
    /// [`CommError::Unavailable`] when NCCL or CUDA is missing (see [`probe`]).
    pub fn new() -> CommResult<Self> {
        probe()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e, None))?;
        let mut bytes = [0u8; NCCL_UNIQUE_ID_BYTES];
        for (b, &c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = c as u8;
        }
        Ok(Self { bytes })
    }

    /// Rebuilds an id from the bytes another rank sent ([`NcclUniqueId::as_bytes`]).
    pub fn from_bytes(bytes: &[u8]) -> CommResult<Self> {
        let bytes: [u8; NCCL_UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            CommError::InvalidArgument(format!(
                "an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, not {}",
                bytes.len()
            ))
        })?;
        Ok(Self { bytes })
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; NCCL_UNIQUE_ID_BYTES] {
        &self.bytes
    }

    pub(super) fn raw(&self) -> sys::ncclUniqueId {
        let mut internal = [0 as std::ffi::c_char; NCCL_UNIQUE_ID_BYTES];
        for (c, &b) in internal.iter_mut().zip(self.bytes.iter()) {
            *c = b as std::ffi::c_char;
        }
        sys::ncclUniqueId { internal }
    }
}

/// `count` fresh unique ids, the same on every rank of `boot`: checks every rank has NCCL, rank
/// 0 makes the ids, `boot` broadcasts their bytes. Collective over `boot`; if any rank lacks
/// NCCL or rank 0 cannot make an id, every rank returns the error (no rank hangs).
pub(super) fn agree_ids<C: Collective>(boot: &C, count: usize) -> CommResult<Vec<NcclUniqueId>> {
    let local = probe();
    let mut missing = [if local.is_err() { 1f32 } else { 0f32 }];
    boot.all_reduce(&mut missing, ReduceOp::Sum)?;
    if missing[0] > 0.0 {
        return Err(match local {
            Err(e) => e,
            Ok(()) => CommError::Unavailable(format!(
                "NCCL engine: unavailable on {} rank(s) of the bootstrap world",
                missing[0]
            )),
        });
    }
    // Byte 0: 1 when rank 0 made the ids; then the ids.
    let mut msg = vec![0u8; 1 + count * NCCL_UNIQUE_ID_BYTES];
    let mut made = Ok(());
    if boot.rank() == 0 {
        let ids: CommResult<Vec<NcclUniqueId>> = (0..count).map(|_| NcclUniqueId::new()).collect();
        match ids {
            Ok(ids) => {
                msg[0] = 1;
                for (chunk, id) in msg[1..].chunks_mut(NCCL_UNIQUE_ID_BYTES).zip(&ids) {
                    chunk.copy_from_slice(id.as_bytes());
                }
            }
            Err(e) => made = Err(e),
        }
    }
    boot.broadcast(&mut msg, 0)?;
    made?;
    if msg[0] != 1 {
        return Err(CommError::Engine(
            "rank 0 of the bootstrap world could not create an NCCL unique id".into(),
        ));
    }
    msg[1..]
        .chunks(NCCL_UNIQUE_ID_BYTES)
        .map(NcclUniqueId::from_bytes)
        .collect()
}
