//! The runtime layout: buckets in plan order, each parameter's region in its bucket's buffer,
//! and the buffer's split into equal *pieces*.
//!
//! A bucket buffer is `pieces × piece_bytes` bytes. Pieces are the unit of update ownership
//! (one per rank of the update group); a runtime shard is `pieces_per_shard` consecutive
//! pieces, so the replica all-gather of pieces rebuilds a runtime shard and the shard-group
//! all-gather of shards rebuilds the bucket. `piece_bytes` is a multiple of 32, and every
//! region starts at a multiple of `align_bytes` (itself a multiple of 32), so no MX block of 32
//! bytes — and no f32/bf16 element — is ever cut by a piece or shard boundary.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::{format, ParamSpec, PlanConfig, RuntimeFormat, MX_BLOCK};

/// One collective's worth of parameters and the geometry of its buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Indices into [`crate::Plan::params`] of this bucket's parameters, in layout order.
    pub params: Range<usize>,
    /// Bytes used by regions and their alignment gaps (the end of the last region).
    pub used_bytes: u64,
    /// Bytes of one piece; the buffer is `pieces × piece_bytes`.
    pub piece_bytes: u64,
}

impl Bucket {
    /// Bytes of `piece` covered by parameter regions (the rest is padding); `members` are the
    /// bucket's parameters (`&plan.params()[bucket.params]`).
    pub fn covered_bytes(&self, members: &[PlannedParam], piece: usize) -> u64 {
        let start = piece as u64 * self.piece_bytes;
        let end = start + self.piece_bytes;
        let first = members.partition_point(|p| p.offset + p.bytes <= start);
        members[first..]
            .iter()
            .take_while(|p| p.offset < end)
            .map(|p| (p.offset + p.bytes).min(end) - p.offset.max(start))
            .sum()
    }
}

/// Where one parameter lives at runtime.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannedParam {
    /// The parameter.
    pub spec: ParamSpec,
    /// Its runtime format after fallback.
    pub format: RuntimeFormat,
    /// Index of its bucket.
    pub bucket: usize,
    /// Byte offset of its region in the bucket buffer.
    pub offset: u64,
    /// Byte length of its region.
    pub bytes: u64,
    /// For `Matrix` parameters, the piece whose ranks run its Newton–Schulz (owner-compute).
    pub ns_owner: Option<usize>,
    /// The region spans more than one piece: its update is split over several owners, and a
    /// `Matrix` must be gathered to its `ns_owner` before orthogonalisation.
    pub split: bool,
}

impl PlannedParam {
    /// Byte range of the region in the bucket buffer.
    pub fn region(&self) -> Range<u64> {
        self.offset..self.offset + self.bytes
    }

    /// Pieces the region touches (first..=last), given the bucket's piece size.
    pub fn piece_span(&self, piece_bytes: u64) -> Range<usize> {
        let first = self.offset / piece_bytes;
        let last = (self.offset + self.bytes - 1) / piece_bytes;
        first as usize..last as usize + 1
    }
}

/// Groups `specs` (already in plan order) into buckets and places their regions.
pub(crate) fn place(
    specs: Vec<(ParamSpec, RuntimeFormat)>,
    config: &PlanConfig,
    pieces: usize,
) -> (Vec<PlannedParam>, Vec<Bucket>) {
    let mut params = Vec::with_capacity(specs.len());
    let mut buckets = Vec::new();
    let mut start = 0usize;
    let mut elements = 0u64;
    let mut cursor = 0u64;
    for (spec, fmt) in specs {
        let numel = spec.numel();
        if elements > 0 && elements + numel > config.bucket_elements {
            buckets.push(close_bucket(start..params.len(), cursor, pieces));
            start = params.len();
            elements = 0;
            cursor = 0;
        }
        let offset = cursor.next_multiple_of(config.align_bytes);
        let bytes = format::region_bytes(&spec, fmt);
        cursor = offset + bytes;
        elements += numel;
        params.push(PlannedParam {
            spec,
            format: fmt,
            bucket: buckets.len(),
            offset,
            bytes,
            ns_owner: None,
            split: false,
        });
    }
    if start < params.len() {
        buckets.push(close_bucket(start..params.len(), cursor, pieces));
    }
    for p in &mut params {
        let piece_bytes = buckets[p.bucket].piece_bytes;
        p.split = p.piece_span(piece_bytes).len() > 1;
    }
    (params, buckets)
}

fn close_bucket(params: Range<usize>, used_bytes: u64, pieces: usize) -> Bucket {
    let piece_bytes = used_bytes
        .div_ceil(pieces as u64)
        .next_multiple_of(MX_BLOCK)
        .max(MX_BLOCK);
    Bucket {
        params,
        used_bytes,
        piece_bytes,
    }
}
