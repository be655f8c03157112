//! Bucket layouts: where a bucket's parameters sit in its fp32 *element space* (master weights
//! and gradients, cut into equal pieces, one per update shard) and in its *runtime units* (what
//! runtime shards hold and all-gathers move), and how one is encoded into the other and decoded
//! for compute.
//!
//! * **Linear** (f32 and bf16 runtime formats): the plan's layout. A parameter's elements are
//!   contiguous in the bucket and runtime unit `i` is element `i`; the gathered buffer *is* the
//!   compute buffer (f32) or is widened once (bf16), and parameters are views into it.
//! * **Banded** (MXFP8 runtime format): pieces are cut so that each re-derives its runtime bytes
//!   from its own master elements alone — MXFP8's column-wise blocks span 32 rows, which a flat
//!   element split would cut. An MXFP8 matrix `[rows, cols]` (its 2-D view) is a run of *bands*
//!   of 32 rows, each encoded as `sshsdp-mx`'s row-wise plane (blocks of 32 along columns, data
//!   then E8M0 scales) and column-wise plane (blocks of 32 along rows); a parameter that fell
//!   back to bf16 (see [`sshsdp_plan::Plan::fallbacks`]) is a run of little-endian bf16
//!   elements. The bucket is cut into pieces at the ideal positions `i · total / pieces` moved
//!   to the nearest band edge (any element edge in bf16), so pieces differ by at most one band
//!   and most matrices stay whole in one piece (which keeps Muon's orthogonalisation local).
//!   A piece's bytes are three sections, each padded to the largest piece's: row planes, bf16
//!   runs, column planes. Forward decodes the column planes and bf16, backward the row planes
//!   and bf16 ([`Phase`]), so with resharding after forward each pass gathers only its own
//!   sections ([`Sections`]: about half of bf16's bytes); otherwise the whole piece is gathered
//!   once and kept. A band's blocks are exactly the matrix's blocks, so the values equal
//!   encoding the whole matrix at any world size. Gathered bytes are decoded into a fresh f32
//!   buffer holding the parameters one after the other (the CPU analogue of dequantising in a
//!   GEMM's load stage).

use std::ops::Range;

use half::bf16;

use sshsdp_mx::{round_up32, ElemFormat, MxShape, ScaleRule, TILE};
use sshsdp_plan::{Plan, RuntimeFormat};

use crate::storage::Elems;
use crate::HsdpError;

/// The MXFP8 element format and scale rule of runtime parameters (E4M3, RCEIL as in cuBLAS and
/// Transformer Engine).
const MX_FORMAT: (ElemFormat, ScaleRule) = (ElemFormat::E4M3, ScaleRule::Rceil);

/// Which pass the parameters are materialised for; it picks the MXFP8 plane.
///
/// A Burn `Linear` weight is `[d_in, d_out]` and the forward GEMM `x · W` contracts over its
/// rows, so forward uses the **column-wise** plane (blocks of 32 along rows); the backward data
/// GEMM `dy · Wᵀ` contracts over its columns and uses the **row-wise** plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Forward pass (and evaluation).
    Forward,
    /// Backward pass.
    Backward,
}

/// A run of elements shared by a parameter (row-major) and its bucket's element space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First element in the bucket's element space (pieces one after the other).
    pub bucket: usize,
    /// First element in the parameter, row-major.
    pub param: usize,
    /// Number of elements.
    pub len: usize,
}

/// How a run of a parameter is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Codec {
    /// Little-endian bf16, two bytes per element.
    Bf16,
    /// MXFP8 tiles of whole bands of a matrix with `cols` columns.
    Mx { cols: usize },
}

impl Codec {
    /// Runtime bytes of one atom (the finest cut): a full band's two planes (32 rows, each
    /// block of 32 bytes with its scale byte), or one bf16 element.
    fn atom_units(self) -> usize {
        match self {
            Codec::Bf16 => 2,
            Codec::Mx { cols } => 33 * (round_up32(cols) + cols),
        }
    }

    /// Elements of atoms `[a0, a1)` of a parameter of `numel` elements.
    fn atom_elems(self, numel: usize, a0: usize, a1: usize) -> std::ops::Range<usize> {
        match self {
            Codec::Bf16 => a0..a1,
            Codec::Mx { cols } => (a0 * TILE * cols).min(numel)..(a1 * TILE * cols).min(numel),
        }
    }
}

/// Part of one parameter held by one piece (banded layout).
#[derive(Clone, Debug)]
struct Chunk {
    /// Member index in the bucket.
    member: usize,
    codec: Codec,
    /// Elements of the parameter (row-major).
    elems: std::ops::Range<usize>,
    /// Offset in the piece's elements.
    elem_offset: usize,
    /// Bytes in the piece's row-plane, bf16 and column-plane sections (empty where unused).
    parts: [Range<usize>; 3],
}

/// A piece's runtime bytes are three sections: row-wise planes (backward), bf16 runs (both
/// passes) and column-wise planes (forward), so a pass can gather only what it decodes.
const ROW: usize = 0;
const BF16: usize = 1;
const COL: usize = 2;

/// Which sections of every piece a gather moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sections {
    /// The whole piece (both planes).
    All,
    /// What forward decodes: bf16 runs and column-wise planes.
    Forward,
    /// What backward decodes: row-wise planes and bf16 runs.
    Backward,
}

impl Sections {
    /// The sections one pass decodes.
    pub fn of(phase: Phase) -> Self {
        match phase {
            Phase::Forward => Sections::Forward,
            Phase::Backward => Sections::Backward,
        }
    }

    fn holds(self, section: usize) -> bool {
        match self {
            Sections::All => true,
            Sections::Forward => section != ROW,
            Sections::Backward => section != COL,
        }
    }
}

#[derive(Clone, Debug)]
struct ParamLayout {
    shape: Vec<usize>,
    /// First element of the parameter in the compute buffer.
    compute_start: usize,
    segments: Vec<Segment>,
}

/// One bucket's layout (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct BucketLayout {
    format: RuntimeFormat,
    pieces: usize,
    piece_elems: usize,
    piece_units: usize,
    /// Sizes of the row, bf16 and column sections of every piece (banded layout only).
    sections: [usize; 3],
    compute_elems: usize,
    params: Vec<ParamLayout>,
    /// Each piece's chunks (banded layout only).
    chunks: Vec<Vec<Chunk>>,
}

impl BucketLayout {
    /// The layout of bucket `b` of `plan`.
    pub fn build(plan: &Plan, b: usize) -> Result<Self, HsdpError> {
        let format = plan.config().runtime_format;
        let bucket = &plan.buckets()[b];
        let members = &plan.params()[bucket.params.clone()];
        let pieces = plan.pieces();
        if let Some(size) = format.element_bytes() {
            let piece_elems = (bucket.piece_bytes / size) as usize;
            let params = members
                .iter()
                .map(|p| {
                    let start = (p.offset / size) as usize;
                    ParamLayout {
                        shape: p.spec.shape.clone(),
                        compute_start: start,
                        segments: vec![Segment {
                            bucket: start,
                            param: 0,
                            len: p.spec.numel() as usize,
                        }],
                    }
                })
                .collect();
            return Ok(Self {
                format,
                pieces,
                piece_elems,
                piece_units: piece_elems,
                sections: [0, piece_elems, 0],
                compute_elems: pieces * piece_elems,
                params,
                chunks: Vec::new(),
            });
        }
        // Each member as a run of atoms: its codec, atom count and first byte in the bucket.
        let mut runs = Vec::with_capacity(members.len());
        let (mut total, mut compute) = (0usize, 0usize);
        let mut params = Vec::with_capacity(members.len());
        for p in members {
            let numel = p.spec.numel() as usize;
            let (codec, atoms) = match p.format {
                RuntimeFormat::Mxfp8 => {
                    let (rows, cols) = p.spec.matrix_dims();
                    (
                        Codec::Mx {
                            cols: cols as usize,
                        },
                        (rows as usize).div_ceil(TILE),
                    )
                }
                RuntimeFormat::Bf16 => (Codec::Bf16, numel),
                RuntimeFormat::F32 => {
                    return Err(HsdpError::Unsupported(format!(
                        "{}: an f32 parameter in an MXFP8 plan",
                        p.spec.path
                    )))
                }
            };
            runs.push((codec, atoms, total, numel));
            total += atoms * codec.atom_units();
            params.push(ParamLayout {
                shape: p.spec.shape.clone(),
                compute_start: compute,
                segments: Vec::new(),
            });
            compute += numel;
        }
        // Cuts at `i · total / pieces`, moved to the nearest atom edge.
        let cut = |ideal: usize| -> usize {
            match runs.iter().find(|r| ideal < r.2 + r.1 * r.0.atom_units()) {
                None => total,
                Some(&(codec, _, first, _)) => {
                    let atom = codec.atom_units();
                    first + (ideal - first + atom / 2) / atom * atom
                }
            }
        };
        let cuts: Vec<usize> = (0..=pieces).map(|i| cut(i * total / pieces)).collect();
        let mut chunks = vec![Vec::new(); pieces];
        let (mut sections, mut piece_elems) = ([0usize; 3], 0usize);
        for (piece, list) in chunks.iter_mut().enumerate() {
            let (lo, hi) = (cuts[piece], cuts[piece + 1]);
            let (mut elem_offset, mut used) = (0usize, [0usize; 3]);
            for (member, &(codec, atoms, first, numel)) in runs.iter().enumerate() {
                let atom = codec.atom_units();
                let a0 = (lo.max(first) - first).div_ceil(atom).min(atoms);
                let a1 = (hi.max(first) - first).div_ceil(atom).min(atoms);
                if a0 >= a1 {
                    continue;
                }
                let elems = codec.atom_elems(numel, a0, a1);
                let mut sizes = [0usize; 3];
                match codec {
                    Codec::Bf16 => sizes[BF16] = 2 * elems.len(),
                    Codec::Mx { cols } => {
                        let shape = MxShape::new(elems.len() / cols, cols);
                        sizes[ROW] = shape.row_data_bytes() + shape.row_scale_bytes();
                        sizes[COL] = shape.col_data_bytes() + shape.col_scale_bytes();
                    }
                }
                let parts = std::array::from_fn(|i| used[i]..used[i] + sizes[i]);
                (0..3).for_each(|i| used[i] += sizes[i]);
                list.push(Chunk {
                    member,
                    codec,
                    elems: elems.clone(),
                    elem_offset,
                    parts,
                });
                elem_offset += elems.len();
            }
            (0..3).for_each(|i| sections[i] = sections[i].max(used[i]));
            piece_elems = piece_elems.max(elem_offset);
        }
        for (piece, list) in chunks.iter().enumerate() {
            for c in list {
                params[c.member].segments.push(Segment {
                    bucket: piece * piece_elems + c.elem_offset,
                    param: c.elems.start,
                    len: c.elems.len(),
                });
            }
        }
        Ok(Self {
            format,
            pieces,
            piece_elems,
            piece_units: sections.iter().sum(),
            sections,
            compute_elems: compute,
            params,
            chunks,
        })
    }

    /// The bytes of a piece that `which` moves.
    pub fn section_range(&self, which: Sections) -> Range<usize> {
        match which {
            Sections::All => 0..self.piece_units,
            Sections::Forward => self.sections[ROW]..self.piece_units,
            Sections::Backward => 0..self.sections[ROW] + self.sections[BF16],
        }
    }

    /// Where section `i` starts in a piece.
    fn section_start(&self, i: usize) -> usize {
        self.sections[..i].iter().sum()
    }

    /// fp32 elements of one piece (master weights and gradients).
    pub fn piece_elems(&self) -> usize {
        self.piece_elems
    }

    /// fp32 elements of the whole bucket (every piece).
    pub fn bucket_elems(&self) -> usize {
        self.pieces * self.piece_elems
    }

    /// Runtime units of the whole bucket that a gather of `which` returns.
    pub fn gathered_units(&self, which: Sections) -> usize {
        self.pieces * self.section_range(which).len()
    }

    /// Where member `k`'s elements sit in the bucket's element space.
    pub fn segments(&self, k: usize) -> &[Segment] {
        &self.params[k].segments
    }

    /// Member `k`'s first element in the compute buffer.
    pub fn compute_start(&self, k: usize) -> usize {
        self.params[k].compute_start
    }

    /// Member `k`'s shape.
    pub fn shape(&self, k: usize) -> &[usize] {
        &self.params[k].shape
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether forward and backward decode different values (MXFP8 planes), so a gathered
    /// bucket's runtime bytes are kept while it is resident.
    pub fn has_planes(&self) -> bool {
        self.chunks
            .iter()
            .flatten()
            .any(|c| matches!(c.codec, Codec::Mx { .. }))
    }

    /// Writes member `k`'s `values` (row-major) into the bucket element space `dst`.
    pub fn place(&self, k: usize, values: &[f32], dst: &mut [f32]) {
        for s in self.segments(k) {
            dst[s.bucket..s.bucket + s.len].copy_from_slice(&values[s.param..s.param + s.len]);
        }
    }

    /// Adds member `k`'s gradient `values` (row-major) into the bucket element space `dst`.
    pub fn accumulate(&self, k: usize, values: &[f32], dst: &mut [f32]) {
        for s in self.segments(k) {
            dst[s.bucket..s.bucket + s.len]
                .iter_mut()
                .zip(&values[s.param..s.param + s.len])
                .for_each(|(d, v)| *d += v);
        }
    }

    /// Encodes the element space of consecutive pieces `first..` (`values`, whole pieces) into
    /// runtime units.
    pub fn encode(&self, first: usize, values: Vec<f32>) -> Result<Elems, HsdpError> {
        Ok(match self.format {
            RuntimeFormat::F32 => Elems::F32(values),
            RuntimeFormat::Bf16 => Elems::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            RuntimeFormat::Mxfp8 => {
                let n = values.len() / self.piece_elems.max(1);
                let mut out = vec![0u8; n * self.piece_units];
                for i in 0..n {
                    let master = &values[i * self.piece_elems..(i + 1) * self.piece_elems];
                    let units = &mut out[i * self.piece_units..(i + 1) * self.piece_units];
                    self.encode_piece(first + i, master, units)?;
                }
                Elems::U8(out)
            }
        })
    }

    /// Re-derives the runtime units of piece `piece`, the `slot`-th piece of `shard`, from its
    /// fp32 `master` (nothing for f32, whose master elements are the runtime elements).
    pub fn rederive(
        &self,
        shard: &mut Elems,
        slot: usize,
        piece: usize,
        master: &[f32],
    ) -> Result<(), HsdpError> {
        let units = slot * self.piece_units..(slot + 1) * self.piece_units;
        match shard {
            Elems::F32(v) => debug_assert_eq!(&v[units], master),
            Elems::Bf16(v) => v[units]
                .iter_mut()
                .zip(master)
                .for_each(|(d, &m)| *d = bf16::from_f32(m)),
            Elems::U8(v) => self.encode_piece(piece, master, &mut v[units])?,
        }
        Ok(())
    }

    /// Encodes piece `p`'s chunks (banded layout) from its fp32 elements.
    fn encode_piece(&self, p: usize, master: &[f32], out: &mut [u8]) -> Result<(), HsdpError> {
        out.fill(0);
        let (row_start, bf16_start, col_start) = (0, self.sections[ROW], self.section_start(COL));
        let err = |e: sshsdp_mx::MxError| HsdpError::Failed(format!("MXFP8 encode: {e}"));
        for c in &self.chunks[p] {
            let src = &master[c.elem_offset..c.elem_offset + c.elems.len()];
            match c.codec {
                Codec::Bf16 => {
                    let dst = &mut out[bf16_start + c.parts[BF16].start..][..c.parts[BF16].len()];
                    for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
                        d.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                    }
                }
                Codec::Mx { cols } => {
                    let shape = MxShape::new(src.len() / cols, cols);
                    let (fmt, rule) = MX_FORMAT;
                    let row = &mut out[row_start + c.parts[ROW].start..][..c.parts[ROW].len()];
                    let (data, scales) = row.split_at_mut(shape.row_data_bytes());
                    sshsdp_mx::encode_rows(src, shape, fmt, rule, data, scales).map_err(err)?;
                    let col = &mut out[col_start + c.parts[COL].start..][..c.parts[COL].len()];
                    let (data, scales) = col.split_at_mut(shape.col_data_bytes());
                    sshsdp_mx::encode_cols(src, shape, fmt, rule, data, scales).map_err(err)?;
                }
            }
        }
        Ok(())
    }

    /// The compute buffer of a gathered bucket `full` for `phase`, and `full` itself when it
    /// must be kept to decode the other plane later ([`Self::has_planes`]). `decoded` is set
    /// when the buffer was converted (not f32 already).
    pub fn to_compute(
        &self,
        full: Elems,
        which: Sections,
        phase: Phase,
    ) -> Result<(Vec<f32>, Option<Elems>), HsdpError> {
        match full {
            Elems::F32(v) => Ok((v, None)),
            Elems::Bf16(v) => Ok((v.iter().map(|x| x.to_f32()).collect(), None)),
            Elems::U8(bytes) => {
                let compute = self.decode(&bytes, which, phase)?;
                let keep = self.has_planes() && which == Sections::All;
                Ok((compute, keep.then_some(Elems::U8(bytes))))
            }
        }
    }

    /// Decodes a gathered banded bucket holding sections `which` of every piece, for `phase`.
    pub fn decode(
        &self,
        bytes: &[u8],
        which: Sections,
        phase: Phase,
    ) -> Result<Vec<f32>, HsdpError> {
        let plane = match phase {
            Phase::Forward => COL,
            Phase::Backward => ROW,
        };
        if bytes.len() != self.gathered_units(which) || !which.holds(plane) {
            return Err(HsdpError::Failed(format!(
                "a gathered MXFP8 bucket of {} bytes ({which:?}) cannot be decoded for {phase:?}",
                bytes.len(),
            )));
        }
        let range = self.section_range(which);
        let at = |section: usize, part: &Range<usize>| {
            self.section_start(section) - range.start + part.start
        };
        let mut out = vec![0f32; self.compute_elems];
        for (p, list) in self.chunks.iter().enumerate() {
            let piece = &bytes[p * range.len()..(p + 1) * range.len()];
            for c in list {
                let first = self.params[c.member].compute_start + c.elems.start;
                let dst = &mut out[first..first + c.elems.len()];
                match c.codec {
                    Codec::Bf16 => {
                        let src = &piece[at(BF16, &c.parts[BF16])..][..c.parts[BF16].len()];
                        for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                            *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
                        }
                    }
                    Codec::Mx { cols } => {
                        let shape = MxShape::new(c.elems.len() / cols, cols);
                        let src = &piece[at(plane, &c.parts[plane])..][..c.parts[plane].len()];
                        let fmt = MX_FORMAT.0;
                        let decoded = if plane == ROW {
                            let (data, scales) = src.split_at(shape.row_data_bytes());
                            sshsdp_mx::decode_rows(data, scales, shape, fmt, dst)
                        } else {
                            let (data, scales) = src.split_at(shape.col_data_bytes());
                            sshsdp_mx::decode_cols(data, scales, shape, fmt, dst)
                        };
                        decoded.map_err(|e| HsdpError::Failed(format!("MXFP8 decode: {e}")))?;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Columns of member `k`'s MXFP8 view, when it is MXFP8.
    #[cfg(test)]
    fn mx_cols(&self, k: usize) -> Option<usize> {
        self.chunks
            .iter()
            .flatten()
            .find(|c| c.member == k)
            .and_then(|c| match c.codec {
                Codec::Mx { cols } => Some(cols),
                Codec::Bf16 => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sshsdp_mx::{Plane, TILE_BYTES};
    use sshsdp_plan::{DType, Mesh, ParamSpec, PlanConfig, Role, Sharding};

    fn plan(world: usize, format: RuntimeFormat) -> Plan {
        let specs = vec![
            ParamSpec::new("a.weight", vec![70, 96], DType::F32).with_role(Role::Matrix),
            ParamSpec::new("a.bias", vec![96], DType::F32),
            ParamSpec::new("b.weight", vec![256, 64], DType::F32).with_role(Role::Matrix),
        ];
        let config = PlanConfig::default()
            .with_format(format)
            .with_sharding(Sharding::Hierarchical);
        let mut config = config;
        config.mx_max_padding = 1.0;
        Plan::build(specs, Mesh::flat(world).unwrap(), config).unwrap()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// Every bucket encoded piece by piece at `world` pieces and decoded again.
    fn round_trip(world: usize, phase: Phase) -> Vec<Vec<f32>> {
        let plan = plan(world, RuntimeFormat::Mxfp8);
        let mut out = Vec::new();
        for b in 0..plan.buckets().len() {
            let layout = BucketLayout::build(&plan, b).unwrap();
            let mut space = vec![0f32; layout.bucket_elems()];
            let members = &plan.params()[plan.buckets()[b].params.clone()];
            for (k, p) in members.iter().enumerate() {
                layout.place(k, &values(p.spec.numel() as usize, k as u32), &mut space);
            }
            let Elems::U8(bytes) = layout.encode(0, space).unwrap() else {
                panic!("MXFP8 buckets hold bytes")
            };
            let compute = layout.decode(&bytes, Sections::All, phase).unwrap();
            // A pass's own sections decode to the same values.
            let range = layout.section_range(Sections::of(phase));
            let part: Vec<u8> = bytes
                .chunks(layout.piece_units)
                .flat_map(|piece| piece[range.clone()].to_vec())
                .collect();
            let own = layout.decode(&part, Sections::of(phase), phase).unwrap();
            assert_eq!(own, compute);
            for (k, p) in members.iter().enumerate() {
                let at = layout.compute_start(k);
                out.push(compute[at..at + p.spec.numel() as usize].to_vec());
            }
        }
        out
    }

    #[test]
    fn banded_mxfp8_decodes_the_same_at_every_world_size() {
        for phase in [Phase::Forward, Phase::Backward] {
            let one = round_trip(1, phase);
            for world in [2, 3, 4, 8] {
                assert_eq!(round_trip(world, phase), one, "world {world}, {phase:?}");
            }
        }
    }

    #[test]
    fn banded_mxfp8_matches_the_reference_codec_and_bf16_fallback() {
        let plan = plan(4, RuntimeFormat::Mxfp8);
        let decoded = round_trip(4, Phase::Forward);
        let mut i = 0;
        for b in 0..plan.buckets().len() {
            let layout = BucketLayout::build(&plan, b).unwrap();
            for (k, p) in plan.params()[plan.buckets()[b].params.clone()]
                .iter()
                .enumerate()
            {
                let v = values(p.spec.numel() as usize, k as u32);
                let expect: Vec<f32> = match layout.mx_cols(k) {
                    Some(cols) => {
                        let shape = MxShape::new(v.len() / cols, cols);
                        let mut bytes = vec![0u8; shape.n_tiles() * TILE_BYTES];
                        let (fmt, rule) = MX_FORMAT;
                        sshsdp_mx::encode_tiled(&v, shape, fmt, rule, &mut bytes).unwrap();
                        let mut out = vec![0f32; v.len()];
                        sshsdp_mx::decode_tiled(&bytes, shape, fmt, Plane::Col, &mut out).unwrap();
                        out
                    }
                    None => v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
                };
                assert_eq!(decoded[i], expect, "{}", p.spec.path);
                i += 1;
            }
        }
        assert!(plan.fallbacks().iter().any(|f| f.path == "a.bias"));
    }

    #[test]
    fn segments_cover_each_parameter_once() {
        for format in [
            RuntimeFormat::F32,
            RuntimeFormat::Bf16,
            RuntimeFormat::Mxfp8,
        ] {
            for world in [1, 2, 4] {
                let plan = plan(world, format);
                for b in 0..plan.buckets().len() {
                    let layout = BucketLayout::build(&plan, b).unwrap();
                    let mut seen = vec![0u8; layout.bucket_elems()];
                    for k in 0..layout.len() {
                        let numel: usize = layout.shape(k).iter().product();
                        let covered: usize = layout.segments(k).iter().map(|s| s.len).sum();
                        assert_eq!(covered, numel);
                        for s in layout.segments(k) {
                            seen[s.bucket..s.bucket + s.len]
                                .iter_mut()
                                .for_each(|x| *x += 1);
                        }
                    }
                    assert!(seen.iter().all(|&x| x <= 1), "{format:?} world {world}");
                }
            }
        }
    }

    #[test]
    fn banded_pieces_are_balanced_and_keep_most_matrices_whole() {
        let specs: Vec<ParamSpec> = (0..8)
            .flat_map(|i| {
                [
                    ParamSpec::new(format!("l{i}.weight"), vec![128, 96], DType::F32),
                    ParamSpec::new(format!("l{i}.bias"), vec![96], DType::F32),
                ]
            })
            .collect();
        let config = PlanConfig::default()
            .with_format(RuntimeFormat::Mxfp8)
            .with_bucket_elements(1 << 30);
        let plan = Plan::build(specs, Mesh::flat(4).unwrap(), config).unwrap();
        assert_eq!(plan.buckets().len(), 1);
        let layout = BucketLayout::build(&plan, 0).unwrap();
        let band = Codec::Mx { cols: 96 }.atom_units();
        let total: usize = layout
            .chunks
            .iter()
            .flatten()
            .map(|c| c.parts.iter().map(|r| r.len()).sum::<usize>())
            .sum();
        assert!(
            layout.piece_units <= total / 4 + band,
            "{} vs {total}",
            layout.piece_units
        );
        let split = (0..layout.len())
            .filter(|&k| layout.segments(k).len() > 1)
            .count();
        // At most one parameter crosses each of the three cuts.
        assert!(split <= 3, "{split} parameters split");
    }
}
