//! The one runtime layout: buckets in plan order, where each parameter's runtime bytes and fp32
//! elements sit in its bucket, and the bucket's cut into equal *pieces*.
//!
//! A bucket's runtime buffer is `pieces × piece_bytes` bytes and its fp32 element space (master
//! weights, gradients) `pieces × piece_elements` elements. Pieces are the unit of update
//! ownership (one per rank of the update group); a runtime shard is `pieces_per_shard`
//! consecutive pieces, so the replica all-gather of pieces rebuilds a runtime shard and the
//! shard-group all-gather of shards rebuilds the bucket. The part of a parameter one piece
//! holds is an [`UpdateView`]: a contiguous run of the parameter (row-major), at
//! `master_offset` in the piece's elements, re-derived into the piece's own runtime bytes — the
//! owner of a piece never writes another piece's bytes.
//!
//! * **Linear** (f32 and bf16): each parameter's elements are contiguous in the bucket at an
//!   offset aligned to `align_bytes`; the element space is the byte space divided by the element
//!   size, so the gathered buffer *is* the compute buffer (f32) or is widened once (bf16), and
//!   the pieces cut it every `piece_bytes` (a multiple of 32 bytes: never inside an element).
//! * **Tiled** (MXFP8): a square-block MXFP8 parameter is a run of 32×32 tiles in band-major
//!   order ([`crate::tiles`]: one E8M0 scale per tile, one copy that forward and backward both
//!   decode), a parameter that fell back to bf16 a run of bf16 elements. The bucket is cut at
//!   the ideal positions `i · total / pieces` moved to the nearest tile (or element) edge, so
//!   pieces differ by at most one tile and the owner of a piece holds whole tiles (a tile's
//!   scale needs all its values). A piece's part of a matrix is then up to three rectangles
//!   ([`UpdateView::rects`]); its fp32 elements are those rectangles' elements in the matrix's
//!   row-major order ([`UpdateView::runs`]). Every view's bytes sit one after the other in the
//!   piece, each rectangle's data and scales starting on a 4-byte word (device
//!   kernels write whole words, so no two views share one). Elements sit one piece after the
//!   other (each piece padded to the largest), and the decoded compute buffer holds the
//!   parameters back to back, each starting on `align_bytes`.
//!
//! Every format decodes the same bytes for forward and backward (one square-block MXFP8 copy
//! serves both passes), so a gather always moves whole pieces: there are no per-pass planes to
//! gather separately (plan version 2's two 1×32 planes were retired; docs/MXFP8.md).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::format;
use crate::tiles::{Rect, TileGrid};
use crate::{ParamSpec, PlanConfig, RuntimeFormat, MX_BLOCK};

/// How a parameter's elements are encoded in runtime bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Encoding {
    /// Little-endian f32 elements.
    F32,
    /// Little-endian bf16 elements.
    Bf16,
    /// Square-block MXFP8 of the parameter's 2-D view: E4M3 elements, one E8M0 scale per
    /// 32×32 tile ([`crate::tiles`]).
    Mxfp8 {
        /// Rows of the parameter's 2-D view.
        rows: u64,
        /// Columns of the parameter's 2-D view.
        cols: u64,
    },
}

impl Encoding {
    /// The tiles of a square-block MXFP8 parameter (`None` for f32 and bf16).
    pub fn grid(self) -> Option<TileGrid> {
        match self {
            Encoding::Mxfp8 { rows, cols } => Some(TileGrid::new(rows, cols)),
            _ => None,
        }
    }
}

/// Which elements of its parameter a view holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Span {
    /// A row-major run of elements (f32 and bf16 encodings).
    Elements(Range<u64>),
    /// A run of the parameter's 32×32 tiles in band-major order (square-block MXFP8).
    Tiles(Range<u64>),
}

/// The part of one parameter that one piece holds: what that piece's owner updates and
/// re-derives.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UpdateView {
    /// Index into [`crate::Plan::params`].
    pub param: usize,
    /// Bucket of the parameter.
    pub bucket: usize,
    /// The piece.
    pub piece: usize,
    /// How the elements are encoded.
    pub encoding: Encoding,
    /// Which elements of the parameter (a row-major run, or whole tiles for MXFP8).
    pub span: Span,
    /// Position of the first element in the piece's fp32 elements (master and gradient).
    pub master_offset: u64,
    /// Its bytes in the piece's runtime bytes: its elements or tiles, alignment padding
    /// included.
    pub bytes: Range<u64>,
}

impl UpdateView {
    /// Number of elements.
    pub fn len(&self) -> u64 {
        match (&self.span, self.encoding.grid()) {
            (Span::Tiles(t), Some(grid)) => {
                grid.elements_before(t.end) - grid.elements_before(t.start)
            }
            (Span::Elements(e), _) => e.end - e.start,
            (Span::Tiles(_), None) => 0,
        }
    }

    /// Its elements as ascending row-major runs of the parameter, each with its position in
    /// the piece's fp32 elements (masters, gradients): the runs lie one after the other from
    /// `master_offset` on. One run for f32 and bf16 views; for MXFP8 up to one per row of the
    /// partial bands it holds ([`crate::tiles`]).
    pub fn runs(&self) -> Vec<(Range<u64>, u64)> {
        let runs = match (&self.span, self.encoding.grid()) {
            (Span::Tiles(t), Some(grid)) => grid.runs(t.clone()),
            (Span::Elements(e), _) => vec![e.clone()],
            (Span::Tiles(_), None) => Vec::new(),
        };
        let mut at = self.master_offset;
        runs.into_iter()
            .map(|run| {
                let placed = (run.clone(), at);
                at += run.end - run.start;
                placed
            })
            .collect()
    }

    /// The rectangles of a square-block MXFP8 view (row-major, in order; see
    /// [`crate::tiles`]), each with where its data and its scales start in the piece's
    /// bytes: its fp32 elements are the rectangles' elements one after the other. Empty for
    /// f32 and bf16 views.
    pub fn rects(&self) -> Vec<(Rect, u64, u64)> {
        let (Span::Tiles(t), Some(grid)) = (&self.span, self.encoding.grid()) else {
            return Vec::new();
        };
        let mut at = self.bytes.start;
        grid.rects(t.clone())
            .into_iter()
            .map(|rect| {
                let data = at;
                let scales = (data + rect.len()).next_multiple_of(WORD);
                at = (scales + (rect.encoded_bytes() - rect.len())).next_multiple_of(WORD);
                (rect, data, scales)
            })
            .collect()
    }

    /// Whether the view holds no element (never in a plan).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runtime bytes of the view, alignment padding included.
    pub fn runtime_bytes(&self) -> u64 {
        self.bytes.end - self.bytes.start
    }

    /// Bytes of the view's encoding without alignment padding (for MXFP8 each rectangle's
    /// data and scales).
    pub fn encoded_bytes(&self) -> u64 {
        match self.encoding {
            Encoding::Mxfp8 { .. } => self.rects().iter().map(|(r, _, _)| r.encoded_bytes()).sum(),
            Encoding::F32 => 4 * self.len(),
            Encoding::Bf16 => 2 * self.len(),
        }
    }
}

/// The alignment of every view's (and every rectangle's data and scales') bytes in a tiled
/// bucket: device kernels write whole 4-byte words.
const WORD: u64 = 4;

/// One collective's worth of parameters and the geometry of its buffers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Indices into [`crate::Plan::params`] of this bucket's parameters, in layout order.
    pub params: Range<usize>,
    /// Runtime bytes of the parameters' encodings (alignment gaps included in linear layouts).
    pub used_bytes: u64,
    /// Runtime bytes of one piece; the buffer is `pieces × piece_bytes`.
    pub piece_bytes: u64,
    /// fp32 elements of one piece (master weights and gradients), padding included.
    pub piece_elements: u64,
    /// fp32 elements of the decoded compute buffer of the whole bucket.
    pub compute_elements: u64,
    /// Each piece's views, in parameter order.
    pub views: Vec<Vec<UpdateView>>,
}

impl Bucket {
    /// Bytes of `piece` holding parameter encodings (the rest is padding: alignment, and
    /// pieces padded to equal size).
    pub fn covered_bytes(&self, piece: usize) -> u64 {
        self.views[piece]
            .iter()
            .map(UpdateView::encoded_bytes)
            .sum()
    }
}

/// Where one parameter lives at run time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannedParam {
    /// The parameter.
    pub spec: ParamSpec,
    /// Its runtime format after fallback.
    pub format: RuntimeFormat,
    /// Index of its bucket.
    pub bucket: usize,
    /// Its first element in the bucket's decoded compute buffer.
    pub compute_offset: u64,
    /// Bytes of its runtime encoding (elements and tile scales for MXFP8).
    pub runtime_bytes: u64,
    /// For `Matrix` parameters, the piece whose ranks run its Newton–Schulz (owner-compute).
    pub ns_owner: Option<usize>,
    /// It lies in more than one piece: its update is split over several owners, and a
    /// `Matrix` must be assembled on its `ns_owner` before orthogonalisation.
    pub split: bool,
}

impl PlannedParam {
    /// The encoding of its elements.
    pub fn encoding(&self) -> Encoding {
        match self.format {
            RuntimeFormat::F32 => Encoding::F32,
            RuntimeFormat::Bf16 => Encoding::Bf16,
            RuntimeFormat::Mxfp8 => {
                let (rows, cols) = self.spec.matrix_dims();
                Encoding::Mxfp8 { rows, cols }
            }
        }
    }
}

/// Groups `specs` (already in plan order, formats resolved) into buckets and lays each out. A
/// bucket holds consecutive parameters up to the bucket size, and never frozen and trainable
/// parameters together (a bucket of frozen ones is never reduced: no gradient bytes).
pub(crate) fn place(
    specs: Vec<(ParamSpec, RuntimeFormat)>,
    config: &PlanConfig,
    pieces: usize,
) -> (Vec<PlannedParam>, Vec<Bucket>) {
    let mut groups: Vec<Vec<(ParamSpec, RuntimeFormat)>> = Vec::new();
    let mut elements = 0u64;
    for (spec, fmt) in specs {
        let numel = spec.numel();
        let frozen_changes = groups
            .last()
            .and_then(|g| g.last())
            .is_some_and(|(last, _)| last.frozen != spec.frozen);
        if groups.is_empty()
            || frozen_changes
            || (elements > 0 && elements + numel > config.bucket_elements)
        {
            groups.push(Vec::new());
            elements = 0;
        }
        elements += numel;
        groups.last_mut().expect("a group").push((spec, fmt));
    }
    let mut params = Vec::new();
    let mut buckets = Vec::with_capacity(groups.len());
    for (b, members) in groups.into_iter().enumerate() {
        let first = params.len();
        params.extend(members.into_iter().map(|(spec, format)| PlannedParam {
            runtime_bytes: format::encoded_bytes(&spec, format),
            spec,
            format,
            bucket: b,
            compute_offset: 0,
            ns_owner: None,
            split: false,
        }));
        let members = &mut params[first..];
        let bucket = match config.runtime_format.element_bytes() {
            Some(size) => linear(members, first, b, config.align_bytes, size, pieces),
            None => tiled(members, first, b, config.align_bytes, pieces),
        };
        buckets.push(bucket);
    }
    for bucket in &buckets {
        let mut seen = vec![0usize; bucket.params.len()];
        for v in bucket.views.iter().flatten() {
            seen[v.param - bucket.params.start] += 1;
        }
        for (p, &n) in params[bucket.params.clone()].iter_mut().zip(&seen) {
            p.split = n > 1;
        }
    }
    (params, buckets)
}

/// The linear layout of one bucket (f32/bf16 elements of `size` bytes): aligned regions, cut
/// every `piece_bytes`.
fn linear(
    members: &mut [PlannedParam],
    first: usize,
    b: usize,
    align: u64,
    size: u64,
    pieces: usize,
) -> Bucket {
    let mut cursor = 0u64;
    for p in members.iter_mut() {
        let offset = cursor.next_multiple_of(align);
        p.compute_offset = offset / size;
        cursor = offset + p.runtime_bytes;
    }
    let piece_bytes = cursor
        .div_ceil(pieces as u64)
        .next_multiple_of(MX_BLOCK)
        .max(MX_BLOCK);
    let piece_elements = piece_bytes / size;
    let encoding = if size == 4 {
        Encoding::F32
    } else {
        Encoding::Bf16
    };
    let views = (0..pieces)
        .map(|piece| {
            let (lo, hi) = (
                piece as u64 * piece_elements,
                (piece as u64 + 1) * piece_elements,
            );
            members
                .iter()
                .enumerate()
                .filter_map(|(k, p)| {
                    let (a, z) = (p.compute_offset, p.compute_offset + p.spec.numel());
                    let (s, e) = (a.max(lo), z.min(hi));
                    (s < e).then(|| UpdateView {
                        param: first + k,
                        bucket: b,
                        piece,
                        encoding,
                        span: Span::Elements(s - a..e - a),
                        master_offset: s - lo,
                        bytes: (s - lo) * size..(e - lo) * size,
                    })
                })
                .collect()
        })
        .collect();
    Bucket {
        params: first..first + members.len(),
        used_bytes: cursor,
        piece_bytes,
        piece_elements,
        compute_elements: pieces as u64 * piece_elements,
        views,
    }
}

/// A parameter of a tiled bucket as a run of atoms: tiles (square-block MXFP8) or bf16
/// elements, laid back to back by their encoded bytes.
struct Run {
    encoding: Encoding,
    /// Its first byte when the bucket's atoms are laid back to back.
    first: u64,
    /// Its encoded bytes.
    bytes: u64,
}

impl Run {
    fn end(&self) -> u64 {
        self.first + self.bytes
    }

    /// Encoded bytes of atoms `0..a`.
    fn bytes_before(&self, a: u64) -> u64 {
        match self.encoding.grid() {
            Some(grid) => grid.bytes_before(a),
            None => 2 * a,
        }
    }

    /// The atom edge nearest `bytes` into the run (the lower one on a tie).
    fn nearest_edge(&self, bytes: u64) -> u64 {
        match self.encoding.grid() {
            Some(grid) => grid.nearest_edge(bytes),
            None => (bytes / 2).min(self.bytes / 2),
        }
    }

    /// The atom edge at bucket position `at` (a cut: an atom edge of some run), clamped to
    /// the run.
    fn edge_at(&self, at: u64) -> u64 {
        self.nearest_edge(at.clamp(self.first, self.end()) - self.first)
    }

    fn span(&self, a0: u64, a1: u64) -> Span {
        match self.encoding {
            Encoding::Mxfp8 { .. } => Span::Tiles(a0..a1),
            _ => Span::Elements(a0..a1),
        }
    }
}

/// The tiled layout of one bucket of an MXFP8 plan (see the module docs); parameters start on
/// `align` bytes of the decoded (f32) compute buffer.
fn tiled(
    members: &mut [PlannedParam],
    first: usize,
    b: usize,
    align: u64,
    pieces: usize,
) -> Bucket {
    let mut runs = Vec::with_capacity(members.len());
    let (mut total, mut compute) = (0u64, 0u64);
    for p in members.iter_mut() {
        let encoding = match p.format {
            RuntimeFormat::Mxfp8 => p.encoding(),
            // An MXFP8 plan's fallbacks are bf16; a linear format never reaches here.
            _ => Encoding::Bf16,
        };
        let bytes = match encoding.grid() {
            Some(grid) => grid.encoded_bytes(),
            None => 2 * p.spec.numel(),
        };
        runs.push(Run {
            encoding,
            first: total,
            bytes,
        });
        total += bytes;
        p.compute_offset = compute.next_multiple_of(align / 4);
        compute = p.compute_offset + p.spec.numel();
    }
    // Cuts at `i · total / pieces`, moved to the nearest atom edge.
    let cut = |ideal: u64| -> u64 {
        match runs.iter().find(|r| ideal < r.end()) {
            None => total,
            Some(r) => r.first + r.bytes_before(r.nearest_edge(ideal - r.first)),
        }
    };
    let cuts: Vec<u64> = (0..=pieces as u64)
        .map(|i| cut((u128::from(i) * u128::from(total) / pieces as u128) as u64))
        .collect();
    let mut views: Vec<Vec<UpdateView>> = vec![Vec::new(); pieces];
    let (mut piece_bytes, mut piece_elements) = (0u64, 0u64);
    for (piece, list) in views.iter_mut().enumerate() {
        let (lo, hi) = (cuts[piece], cuts[piece + 1]);
        let (mut master_offset, mut used) = (0u64, 0u64);
        for (k, r) in runs.iter().enumerate() {
            if hi <= r.first || lo >= r.end() {
                continue;
            }
            let (a0, a1) = (r.edge_at(lo), r.edge_at(hi));
            if a0 >= a1 {
                continue;
            }
            let mut view = UpdateView {
                param: first + k,
                bucket: b,
                piece,
                encoding: r.encoding,
                span: r.span(a0, a1),
                master_offset,
                bytes: used..used,
            };
            // Each rectangle's data and scales start on a word; the view ends on one.
            let end = match view.rects().last() {
                Some((rect, _, scales)) => scales + (rect.encoded_bytes() - rect.len()),
                None => used + 2 * view.len(),
            };
            view.bytes = used..end.next_multiple_of(WORD);
            used = view.bytes.end;
            master_offset += view.len();
            list.push(view);
        }
        piece_bytes = piece_bytes.max(used);
        piece_elements = piece_elements.max(master_offset);
    }
    let piece_bytes = piece_bytes.next_multiple_of(MX_BLOCK).max(MX_BLOCK);
    Bucket {
        params: first..first + members.len(),
        used_bytes: total,
        piece_bytes,
        piece_elements,
        compute_elements: compute,
        views,
    }
}
