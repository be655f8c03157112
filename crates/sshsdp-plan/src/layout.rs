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
//! * **Banded** (MXFP8): an MXFP8 parameter is a run of 32-row bands ([`crate::format`]), a
//!   parameter that fell back to bf16 a run of bf16 elements. The bucket is cut at the ideal
//!   positions `i · total / pieces` moved to the nearest band (or element) edge, so pieces
//!   differ by at most one band and most matrices stay whole in one piece (which keeps Muon's
//!   orthogonalisation local). A piece's bytes are three [`Section`]s, each padded to the
//!   largest piece's: row-wise planes, bf16 runs, column-wise planes; every view's bytes in a
//!   section start on a 32-byte boundary (a plane's data, then its scales, then zero padding),
//!   so device kernels address them by whole words. Forward decodes the
//!   column-wise planes and bf16, backward the row-wise planes and bf16, so a pass can gather
//!   only its own sections ([`Part`]). Elements sit one piece after the other (each piece padded
//!   to the largest), and the decoded compute buffer holds the parameters back to back, each starting on
//!   `align_bytes`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::format::{self, mx_band_bytes, mx_col_plane_bytes, mx_row_plane_bytes, MX_BAND};
use crate::{ParamSpec, PlanConfig, RuntimeFormat, MX_BLOCK};

/// One of the three sections of a piece's runtime bytes (in this order in the piece).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Section {
    /// MXFP8 row-wise planes (decoded for backward).
    Row,
    /// Linear elements: f32 or bf16 (decoded for both passes).
    Linear,
    /// MXFP8 column-wise planes (decoded for forward).
    Col,
}

/// Which part of every piece a gather moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Part {
    /// The whole piece.
    All,
    /// What forward decodes: the linear and column-wise sections.
    Forward,
    /// What backward decodes: the row-wise and linear sections.
    Backward,
}

impl Part {
    /// Whether this part holds `section`.
    pub fn holds(self, section: Section) -> bool {
        match self {
            Part::All => true,
            Part::Forward => section != Section::Row,
            Part::Backward => section != Section::Col,
        }
    }
}

/// How a parameter's elements are encoded in runtime bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Encoding {
    /// Little-endian f32 elements.
    F32,
    /// Little-endian bf16 elements.
    Bf16,
    /// MXFP8 bands of a matrix with `cols` columns (row-wise and column-wise planes).
    Mxfp8 {
        /// Columns of the parameter's 2-D view.
        cols: u64,
    },
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
    /// Elements of the parameter (row-major): whole rows of whole bands for MXFP8.
    pub elements: Range<u64>,
    /// Position of the first element in the piece's fp32 elements (master and gradient).
    pub master_offset: u64,
    /// Bytes in the piece's row-wise section (MXFP8; empty otherwise).
    pub row: Range<u64>,
    /// Bytes in the piece's linear section (f32/bf16; empty for MXFP8).
    pub linear: Range<u64>,
    /// Bytes in the piece's column-wise section (MXFP8; empty otherwise).
    pub col: Range<u64>,
}

impl UpdateView {
    /// Number of elements.
    pub fn len(&self) -> u64 {
        self.elements.end - self.elements.start
    }

    /// Whether the view holds no element (never in a plan).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of `section` this view re-derives, relative to the section's start.
    pub fn bytes_in(&self, section: Section) -> Range<u64> {
        match section {
            Section::Row => self.row.clone(),
            Section::Linear => self.linear.clone(),
            Section::Col => self.col.clone(),
        }
    }

    /// Runtime bytes of the view over all sections, alignment padding included.
    pub fn runtime_bytes(&self) -> u64 {
        [&self.row, &self.linear, &self.col]
            .iter()
            .map(|r| r.end - r.start)
            .sum()
    }

    /// Bytes of the view's encoding in `section`, without alignment padding: the first
    /// `encoded_bytes(section)` bytes of [`Self::bytes_in`] (an MXFP8 plane's data, then its
    /// scales).
    pub fn encoded_bytes(&self, section: Section) -> u64 {
        match (self.encoding, section) {
            (Encoding::Mxfp8 { cols }, Section::Row) => mx_row_plane_bytes(self.len() / cols, cols),
            (Encoding::Mxfp8 { cols }, Section::Col) => mx_col_plane_bytes(self.len() / cols, cols),
            (Encoding::F32, Section::Linear) => 4 * self.len(),
            (Encoding::Bf16, Section::Linear) => 2 * self.len(),
            _ => 0,
        }
    }
}

/// One collective's worth of parameters and the geometry of its buffers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Indices into [`crate::Plan::params`] of this bucket's parameters, in layout order.
    pub params: Range<usize>,
    /// Runtime bytes of the parameters' encodings (alignment gaps included in linear layouts).
    pub used_bytes: u64,
    /// Runtime bytes of one piece (its sections together); the buffer is
    /// `pieces × piece_bytes`.
    pub piece_bytes: u64,
    /// Bytes of each piece's row-wise, linear and column-wise sections (in that order).
    pub sections: [u64; 3],
    /// fp32 elements of one piece (master weights and gradients), padding included.
    pub piece_elements: u64,
    /// fp32 elements of the decoded compute buffer of the whole bucket.
    pub compute_elements: u64,
    /// Each piece's views, in parameter order.
    pub views: Vec<Vec<UpdateView>>,
}

impl Bucket {
    /// Bytes of `section` in a piece.
    pub fn section_bytes(&self, section: Section) -> u64 {
        self.sections[section as usize]
    }

    /// Where `section` starts in a piece.
    pub fn section_start(&self, section: Section) -> u64 {
        self.sections[..section as usize].iter().sum()
    }

    /// The bytes of every piece that a gather of `part` moves.
    pub fn part_range(&self, part: Part) -> Range<u64> {
        match part {
            Part::All => 0..self.piece_bytes,
            Part::Forward => self.section_start(Section::Linear)..self.piece_bytes,
            Part::Backward => 0..self.section_start(Section::Col),
        }
    }

    /// Whether forward and backward decode different bytes (MXFP8 planes), so a pass may
    /// gather only its own part.
    pub fn has_planes(&self) -> bool {
        self.sections[Section::Row as usize] + self.sections[Section::Col as usize] > 0
    }

    /// Bytes of `piece` holding parameter encodings (the rest is padding: alignment, and
    /// pieces padded to equal size).
    pub fn covered_bytes(&self, piece: usize) -> u64 {
        let sections = [Section::Row, Section::Linear, Section::Col];
        self.views[piece]
            .iter()
            .map(|v| sections.iter().map(|&s| v.encoded_bytes(s)).sum::<u64>())
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
    /// Bytes of its runtime encoding (both planes for MXFP8).
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
            RuntimeFormat::Mxfp8 => Encoding::Mxfp8 {
                cols: self.spec.matrix_dims().1,
            },
        }
    }
}

/// Groups `specs` (already in plan order, formats resolved) into buckets and lays each out.
pub(crate) fn place(
    specs: Vec<(ParamSpec, RuntimeFormat)>,
    config: &PlanConfig,
    pieces: usize,
) -> (Vec<PlannedParam>, Vec<Bucket>) {
    let mut groups: Vec<Vec<(ParamSpec, RuntimeFormat)>> = Vec::new();
    let mut elements = 0u64;
    for (spec, fmt) in specs {
        let numel = spec.numel();
        if groups.is_empty() || (elements > 0 && elements + numel > config.bucket_elements) {
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
            None => banded(members, first, b, config.align_bytes, pieces),
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
                        elements: s - a..e - a,
                        master_offset: s - lo,
                        row: 0..0,
                        linear: (s - lo) * size..(e - lo) * size,
                        col: 0..0,
                    })
                })
                .collect()
        })
        .collect();
    Bucket {
        params: first..first + members.len(),
        used_bytes: cursor,
        piece_bytes,
        sections: [0, piece_bytes, 0],
        piece_elements,
        compute_elements: pieces as u64 * piece_elements,
        views,
    }
}

/// A parameter of a banded bucket as a run of atoms (bands or bf16 elements).
struct Run {
    encoding: Encoding,
    atoms: u64,
    /// Its first byte when the bucket's atoms are laid back to back.
    first: u64,
    numel: u64,
}

impl Run {
    /// Bytes of one atom: a full band's two planes, or one bf16 element.
    fn atom_bytes(&self) -> u64 {
        match self.encoding {
            Encoding::Mxfp8 { cols } => mx_band_bytes(cols),
            _ => 2,
        }
    }

    fn end(&self) -> u64 {
        self.first + self.atoms * self.atom_bytes()
    }

    /// Elements of atoms `[a0, a1)`.
    fn elements(&self, a0: u64, a1: u64) -> Range<u64> {
        match self.encoding {
            Encoding::Mxfp8 { cols } => {
                (a0 * MX_BAND * cols).min(self.numel)..(a1 * MX_BAND * cols).min(self.numel)
            }
            _ => a0..a1,
        }
    }
}

/// The banded layout of one bucket of an MXFP8 plan (see the module docs); parameters start on
/// `align` bytes of the decoded (f32) compute buffer.
fn banded(
    members: &mut [PlannedParam],
    first: usize,
    b: usize,
    align: u64,
    pieces: usize,
) -> Bucket {
    let mut runs = Vec::with_capacity(members.len());
    let (mut total, mut compute) = (0u64, 0u64);
    for p in members.iter_mut() {
        let numel = p.spec.numel();
        let encoding = match p.format {
            RuntimeFormat::Mxfp8 => p.encoding(),
            // An MXFP8 plan's fallbacks are bf16; a linear format never reaches here.
            _ => Encoding::Bf16,
        };
        let atoms = match encoding {
            Encoding::Mxfp8 { .. } => p.spec.matrix_dims().0.div_ceil(MX_BAND),
            _ => numel,
        };
        let run = Run {
            encoding,
            atoms,
            first: total,
            numel,
        };
        total = run.end();
        runs.push(run);
        p.compute_offset = compute.next_multiple_of(align / 4);
        compute = p.compute_offset + numel;
    }
    // Cuts at `i · total / pieces`, moved to the nearest atom edge.
    let cut = |ideal: u64| -> u64 {
        match runs.iter().find(|r| ideal < r.end()) {
            None => total,
            Some(r) => {
                let atom = r.atom_bytes();
                r.first + (ideal - r.first + atom / 2) / atom * atom
            }
        }
    };
    let cuts: Vec<u64> = (0..=pieces as u64)
        .map(|i| cut(i * total / pieces as u64))
        .collect();
    let mut views: Vec<Vec<UpdateView>> = vec![Vec::new(); pieces];
    let (mut sections, mut piece_elements) = ([0u64; 3], 0u64);
    for (piece, list) in views.iter_mut().enumerate() {
        let (lo, hi) = (cuts[piece], cuts[piece + 1]);
        let (mut master_offset, mut used) = (0u64, [0u64; 3]);
        for (k, r) in runs.iter().enumerate() {
            let atom = r.atom_bytes();
            let a0 = (lo.max(r.first) - r.first).div_ceil(atom).min(r.atoms);
            let a1 = (hi.max(r.first) - r.first).div_ceil(atom).min(r.atoms);
            if a0 >= a1 {
                continue;
            }
            let elements = r.elements(a0, a1);
            let len = elements.end - elements.start;
            let mut sizes = [0u64; 3];
            match r.encoding {
                Encoding::Mxfp8 { cols } => {
                    sizes[Section::Row as usize] = mx_row_plane_bytes(len / cols, cols);
                    sizes[Section::Col as usize] = mx_col_plane_bytes(len / cols, cols);
                }
                _ => sizes[Section::Linear as usize] = 2 * len,
            }
            // Every view's bytes start on a 32-byte boundary of their section, so a device
            // kernel addresses each plane's data and scales by whole words.
            let sizes = sizes.map(|n| n.next_multiple_of(MX_BLOCK));
            let at = |s: Section| used[s as usize]..used[s as usize] + sizes[s as usize];
            list.push(UpdateView {
                param: first + k,
                bucket: b,
                piece,
                encoding: r.encoding,
                elements,
                master_offset,
                row: at(Section::Row),
                linear: at(Section::Linear),
                col: at(Section::Col),
            });
            (0..3).for_each(|i| used[i] += sizes[i]);
            master_offset += len;
        }
        (0..3).for_each(|i| sections[i] = sections[i].max(used[i]));
        piece_elements = piece_elements.max(master_offset);
    }
    Bucket {
        params: first..first + members.len(),
        used_bytes: total,
        piece_bytes: sections.iter().sum(),
        sections,
        piece_elements,
        compute_elements: compute,
        views,
    }
}
