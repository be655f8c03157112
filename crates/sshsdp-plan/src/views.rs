//! Update views: which elements of which parameters a piece (and so a rank) owns, where they sit
//! in the rank's flat fp32 master shard, and which runtime bytes the owner re-derives from them.
//!
//! Ownership is the *preimage of the piece's runtime bytes*: for f32/bf16 the elements whose
//! bytes lie in the piece (pieces never cut an element); for MXFP8 the tiles whose first byte
//! lies in the piece. Re-derivation is therefore local — a rank writes its own piece of the
//! runtime buffer — except for an MXFP8 tile that straddles a piece boundary, whose tail bytes
//! land in the next piece ([`SplitTile`]; at most one per boundary).

use serde::{Deserialize, Serialize};

use crate::{format::MxGrid, Bucket, PlannedParam, RuntimeFormat, MX_TILE_BYTES};

/// The part of a parameter an update view covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Selection {
    /// Elements `[start, start + len)` in row-major order (f32/bf16 runtime formats).
    Elements {
        /// First element.
        start: u64,
        /// Number of elements.
        len: u64,
    },
    /// 32×32 tiles `[start, start + len)` in row-major tile order (MXFP8). The master shard
    /// holds each tile's real elements row-major, tile after tile.
    Tiles {
        /// First tile.
        start: u64,
        /// Number of tiles.
        len: u64,
    },
}

/// One piece's share of one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UpdateView {
    /// Index into [`crate::Plan::params`].
    pub param: usize,
    /// Bucket of the parameter.
    pub bucket: usize,
    /// What part of the parameter.
    pub selection: Selection,
    /// Real (unpadded) elements covered: the fp32 master elements owned.
    pub elements: u64,
    /// Offset, in elements, of this view in the piece's master shard of this bucket.
    pub master_offset: u64,
    /// Byte offset in the bucket buffer of the runtime bytes this view re-derives.
    pub runtime_offset: u64,
    /// Number of runtime bytes this view re-derives (may run past the piece end for a
    /// straddling MXFP8 tile).
    pub runtime_bytes: u64,
}

/// An MXFP8 tile cut by a piece boundary: owned (and re-derived) by the piece before the
/// boundary, its tail bytes belong to the next piece and must be forwarded to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SplitTile {
    /// Index into [`crate::Plan::params`].
    pub param: usize,
    /// Tile index in the parameter.
    pub tile: u64,
    /// The piece holding the tile's first byte, which owns and re-derives it.
    pub owner_piece: usize,
    /// The piece that starts at the boundary cutting the tile.
    pub boundary_piece: usize,
    /// Bytes of the tile at or after that boundary.
    pub spill_bytes: u64,
}

/// The views of `piece` in `bucket`.
pub(crate) fn piece_views(
    params: &[PlannedParam],
    bucket_index: usize,
    bucket: &Bucket,
    piece: usize,
) -> Vec<UpdateView> {
    let start = piece as u64 * bucket.piece_bytes;
    let end = start + bucket.piece_bytes;
    let members = &params[bucket.params.clone()];
    let first = members.partition_point(|p| p.offset + p.bytes <= start);
    let mut views = Vec::new();
    let mut master_offset = 0;
    for (k, p) in members.iter().enumerate().skip(first) {
        if p.offset >= end {
            break;
        }
        let lo = start.saturating_sub(p.offset);
        let hi = (end - p.offset).min(p.bytes);
        let view = match p.format.element_bytes() {
            Some(size) => {
                let (a, b) = (lo / size, hi / size);
                (b > a).then(|| {
                    (
                        Selection::Elements {
                            start: a,
                            len: b - a,
                        },
                        b - a,
                        p.offset + a * size,
                        (b - a) * size,
                    )
                })
            }
            None => {
                let grid = MxGrid::of(&p.spec);
                let a = lo.div_ceil(MX_TILE_BYTES);
                let b = hi.div_ceil(MX_TILE_BYTES).min(grid.tiles());
                (b > a).then(|| {
                    (
                        Selection::Tiles {
                            start: a,
                            len: b - a,
                        },
                        grid.elements_in(a, b),
                        p.offset + a * MX_TILE_BYTES,
                        (b - a) * MX_TILE_BYTES,
                    )
                })
            }
        };
        if let Some((selection, elements, runtime_offset, runtime_bytes)) = view {
            views.push(UpdateView {
                param: bucket.params.start + k,
                bucket: bucket_index,
                selection,
                elements,
                master_offset,
                runtime_offset,
                runtime_bytes,
            });
            master_offset += elements;
        }
    }
    views
}

/// MXFP8 tiles of `bucket` that straddle a piece boundary.
pub(crate) fn split_tiles(
    params: &[PlannedParam],
    bucket: &Bucket,
    pieces: usize,
) -> Vec<SplitTile> {
    let members = &params[bucket.params.clone()];
    let mut out = Vec::new();
    for boundary_piece in 1..pieces {
        let boundary = boundary_piece as u64 * bucket.piece_bytes;
        let k = members.partition_point(|p| p.offset + p.bytes <= boundary);
        let Some(p) = members.get(k) else { break };
        if p.format != RuntimeFormat::Mxfp8 || p.offset >= boundary {
            continue;
        }
        let rel = boundary - p.offset;
        if rel % MX_TILE_BYTES != 0 {
            let tile = rel / MX_TILE_BYTES;
            let tile_start = p.offset + tile * MX_TILE_BYTES;
            out.push(SplitTile {
                param: bucket.params.start + k,
                tile,
                owner_piece: (tile_start / bucket.piece_bytes) as usize,
                boundary_piece,
                spill_bytes: (tile_start + MX_TILE_BYTES).min(p.offset + p.bytes) - boundary,
            });
        }
    }
    out
}
