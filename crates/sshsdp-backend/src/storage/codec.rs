//! A bucket's codec: its fp32 element space (master weights and gradients, piece after piece)
//! encoded into runtime units (what runtime shards hold and all-gathers move) and decoded into
//! the compute buffer that parameters are views of — all following the plan's layout
//! ([`sshsdp_plan::Bucket`]: where every parameter's elements and bytes sit, piece by piece).
//! Nothing here decides a layout; it reads the plan's update views.
//!
//! * **Linear** (f32 and bf16 runtime formats): runtime unit `i` is element `i`; the gathered
//!   buffer *is* the compute buffer (f32) or is widened once (bf16).
//! * **Tiled** (MXFP8 runtime format): each view of a piece is encoded into its bytes in the
//!   piece: square-block MXFP8 of each of its rectangles (`sshsdp-mx`'s `encode_square`, from
//!   the piece's fp32 elements, where the rectangle is row-major), or little-endian bf16 for a
//!   parameter that fell back. One copy serves both passes: a Burn `Linear` weight is
//!   `[d_in, d_out]`, the forward GEMM `x · W` contracts over its rows and the backward data
//!   GEMM `dy · Wᵀ` over its columns, and a 32×32 tile's scale covers both directions' blocks,
//!   so forward and backward decode the same bytes: a gathered bucket is decoded once and its
//!   runtime bytes are not kept. Decoding writes each rectangle into its place of its
//!   parameter in a fresh f32 compute buffer (the CPU analogue of dequantising in a GEMM's load
//!   stage).

use sshsdp_mx::{ElemFormat, MxShape, ScaleRule};
use sshsdp_plan::{Encoding, Plan, RuntimeFormat, Span, UpdateView};

use crate::error::HsdpError;
use crate::runtime_units::Elems;
use crate::storage::device_tables::DeviceTables;

/// The MXFP8 element format and scale rule of runtime parameters (E4M3, RCEIL as in cuBLAS and
/// Transformer Engine).
pub(crate) const MX_FORMAT: (ElemFormat, ScaleRule) = (ElemFormat::E4M3, ScaleRule::Rceil);

/// A run of elements shared by a parameter (row-major) and its bucket's element space.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Segment {
    /// First element in the bucket's element space (pieces one after the other).
    bucket: usize,
    /// First element in the parameter, row-major.
    param: usize,
    /// Number of elements.
    len: usize,
}

#[derive(Clone, Debug)]
struct Member {
    shape: Vec<usize>,
    /// First element of the parameter in the compute buffer.
    compute_start: usize,
    segments: Vec<Segment>,
}

/// One bucket's codec (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct BucketCodec {
    pub(super) format: RuntimeFormat,
    pub(super) piece_elems: usize,
    /// Runtime units of one piece: elements (linear) or bytes (MXFP8).
    pub(super) piece_units: usize,
    compute_elems: usize,
    members: Vec<Member>,
    /// The plan's views of each piece.
    views: Vec<Vec<UpdateView>>,
    /// First member's plan index.
    first: usize,
    /// Its operations uploaded to devices, made on first use.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(super) device_tables: DeviceTables,
}

/// `u64` sizes from the plan as `usize` (the plan was built on this machine: they fit).
fn us(x: u64) -> usize {
    usize::try_from(x).expect("plan sizes fit in memory")
}

impl BucketCodec {
    /// The codec of bucket `b` of `plan`.
    pub fn new(plan: &Plan, b: usize) -> Self {
        let format = plan.config().runtime_format;
        let bucket = &plan.buckets()[b];
        let unit = format.element_bytes().unwrap_or(1);
        let piece_elems = us(bucket.piece_elements);
        let members = plan.params()[bucket.params.clone()]
            .iter()
            .map(|p| Member {
                shape: p.spec.shape.clone(),
                compute_start: us(p.compute_offset),
                segments: Vec::new(),
            })
            .collect();
        let mut codec = Self {
            format,
            piece_elems,
            piece_units: us(bucket.piece_bytes / unit),
            compute_elems: us(bucket.compute_elements),
            members,
            views: bucket.views.clone(),
            first: bucket.params.start,
            device_tables: DeviceTables::default(),
        };
        for v in bucket.views.iter().flatten() {
            for (run, master) in v.runs() {
                codec.members[v.param - codec.first].segments.push(Segment {
                    bucket: v.piece * piece_elems + us(master),
                    param: us(run.start),
                    len: us(run.end - run.start),
                });
            }
        }
        codec
    }

    /// An empty run of the runtime units' type.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn empty_units(&self) -> Elems {
        match self.format {
            RuntimeFormat::F32 => Elems::F32(Vec::new()),
            RuntimeFormat::Bf16 => Elems::Bf16(Vec::new()),
            RuntimeFormat::Mxfp8 => Elems::U8(Vec::new()),
        }
    }

    /// fp32 elements of one piece (master weights and gradients).
    pub fn piece_elems(&self) -> usize {
        self.piece_elems
    }

    /// Runtime bytes of one piece.
    pub fn piece_bytes(&self) -> usize {
        self.piece_units * self.format.element_bytes().unwrap_or(1) as usize
    }

    /// Stores piece `piece_bytes` (runtime bytes, little-endian units, as the device encode
    /// reads them back) as the `slot`-th piece of `shard`.
    pub fn store_piece(
        &self,
        shard: &mut Elems,
        slot: usize,
        bytes: &[u8],
    ) -> Result<(), HsdpError> {
        if bytes.len() != self.piece_bytes() {
            return Err(HsdpError::Failed(format!(
                "an encoded piece of {} bytes, expected {}",
                bytes.len(),
                self.piece_bytes()
            )));
        }
        shard.write_at(slot * self.piece_units, &shard.units_from_le_bytes(bytes))?;
        Ok(())
    }

    /// fp32 elements of the whole bucket (every piece).
    pub fn bucket_elems(&self) -> usize {
        self.views.len() * self.piece_elems
    }

    /// Runtime units of the whole gathered bucket (every piece).
    pub fn gathered_units(&self) -> usize {
        self.views.len() * self.piece_units
    }

    /// Member `k`'s first element in the compute buffer.
    pub fn compute_start(&self, k: usize) -> usize {
        self.members[k].compute_start
    }

    /// Member `k`'s shape.
    pub fn shape(&self, k: usize) -> &[usize] {
        &self.members[k].shape
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Writes member `k`'s `values` (row-major) into the bucket element space `dst`.
    pub fn place(&self, k: usize, values: &[f32], dst: &mut [f32]) {
        for s in &self.members[k].segments {
            dst[s.bucket..s.bucket + s.len].copy_from_slice(&values[s.param..s.param + s.len]);
        }
    }

    /// Member `k`'s runs in the bucket element space, in order: `(first element in the bucket,
    /// first element in the parameter (row-major), length)`.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub fn segments(&self, k: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.members[k]
            .segments
            .iter()
            .map(|s| (s.bucket, s.param, s.len))
    }

    /// Adds member `k`'s gradient `values` (row-major) into the bucket element space `dst`.
    pub fn accumulate(&self, k: usize, values: &[f32], dst: &mut [f32]) {
        for s in &self.members[k].segments {
            dst[s.bucket..s.bucket + s.len]
                .iter_mut()
                .zip(&values[s.param..s.param + s.len])
                .for_each(|(d, v)| *d += v);
        }
    }

    /// How to encode piece `p` from its fp32 elements into its runtime bytes: one operation per
    /// rectangle of tiles or bf16 run, in piece order — what the host (`host/codec.rs`)
    /// and the device (`storage/cube/codec.rs`) both run. The bf16 runtime format is one run over the
    /// whole piece; `None` for f32, whose runtime elements are the fp32 elements themselves.
    /// Bytes not written by any operation are zero.
    pub fn encode_ops(&self, p: usize) -> Option<Vec<CodecOp>> {
        match self.format {
            RuntimeFormat::F32 => None,
            RuntimeFormat::Bf16 => Some(vec![CodecOp::Bf16 {
                bytes: 0,
                n: self.piece_elems,
                values: 0,
            }]),
            RuntimeFormat::Mxfp8 => {
                let mut ops = Vec::new();
                for v in &self.views[p] {
                    match v.encoding {
                        Encoding::Mxfp8 { .. } => {
                            let mut values = us(v.master_offset);
                            for (rect, data, scales) in v.rects() {
                                let shape = MxShape::new(us(rect.height()), us(rect.width()));
                                ops.push(CodecOp::Square {
                                    shape,
                                    values,
                                    stride: shape.cols,
                                    data: us(data),
                                    scales: us(scales),
                                });
                                values += shape.len();
                            }
                        }
                        Encoding::Bf16 | Encoding::F32 => ops.push(CodecOp::Bf16 {
                            bytes: us(v.bytes.start),
                            n: us(v.len()),
                            values: us(v.master_offset),
                        }),
                    }
                }
                Some(ops)
            }
        }
    }

    /// How to decode a gathered bucket (every piece) into the compute buffer: one operation per
    /// view, in bucket order — what the host (`host/codec.rs`, MXFP8) and the device
    /// (`storage/cube/codec.rs`, MXFP8 and bf16) both run. `gathered` is the gathered buffer's length in
    /// bytes, checked against the layout. The f32 format has nothing to decode (an error).
    pub fn decode_ops(&self, gathered: usize) -> Result<Vec<CodecOp>, HsdpError> {
        self.check_gathered(gathered)?;
        let unit = us(self.format.element_bytes().unwrap_or(1));
        let per_piece = unit * self.piece_units;
        let mut ops = Vec::new();
        for (p, views) in self.views.iter().enumerate() {
            let base = p * per_piece;
            for v in views {
                let member = &self.members[v.param - self.first];
                match v.encoding {
                    Encoding::Mxfp8 { cols, .. } => {
                        for (rect, data, scales) in v.rects() {
                            let first = rect.rows.start * cols + rect.cols.start;
                            ops.push(CodecOp::Square {
                                shape: MxShape::new(us(rect.height()), us(rect.width())),
                                values: member.compute_start + us(first),
                                stride: us(cols),
                                data: base + us(data),
                                scales: base + us(scales),
                            });
                        }
                    }
                    Encoding::Bf16 | Encoding::F32 => {
                        // A bf16 view is one row-major run.
                        let Span::Elements(run) = &v.span else {
                            continue;
                        };
                        ops.push(CodecOp::Bf16 {
                            bytes: base + us(v.bytes.start),
                            n: us(v.len()),
                            values: member.compute_start + us(run.start),
                        });
                    }
                }
            }
        }
        if self.format == RuntimeFormat::Bf16 {
            ops = coalesce_bf16(ops);
        }
        Ok(ops)
    }

    /// Whether a gathered buffer of `gathered` bytes can be decoded: the layout's length, and a
    /// format with an encoding.
    pub fn check_gathered(&self, gathered: usize) -> Result<(), HsdpError> {
        let unit = us(self.format.element_bytes().unwrap_or(1));
        if gathered != unit * self.gathered_units() || !self.encodes() {
            return Err(HsdpError::Failed(format!(
                "a gathered {:?} bucket of {gathered} bytes cannot be decoded (expected {})",
                self.format,
                unit * self.gathered_units()
            )));
        }
        Ok(())
    }

    /// Whether runtime units are an encoding of the fp32 elements ([`Self::encode_ops`] is
    /// `Some`): every format but f32.
    pub fn encodes(&self) -> bool {
        self.format != RuntimeFormat::F32
    }

    /// fp32 elements of the decoded compute buffer.
    pub fn compute_elems(&self) -> usize {
        self.compute_elems
    }
}

/// A linear bf16 bucket's decode ops as one run wherever they lie on the same line (element `e`
/// of the compute buffer at byte `2e + c` of the gathered buffer, for one `c`): what the plan's
/// linear layout gives every view of a bucket (its compute offsets are its element offsets), so
/// the whole bucket is one kernel launch instead of one per view. The run also widens the
/// padding between views, which no member reads (in a linear bucket only bf16 runs write the
/// compute buffer).
fn coalesce_bf16(ops: Vec<CodecOp>) -> Vec<CodecOp> {
    let mut out: Vec<CodecOp> = Vec::with_capacity(ops.len());
    for op in ops {
        if let (
            Some(CodecOp::Bf16 { bytes, n, values }),
            CodecOp::Bf16 {
                bytes: next_bytes,
                n: next_n,
                values: next_values,
            },
        ) = (out.last_mut(), op)
        {
            let same_line = next_bytes as i128 - 2 * next_values as i128
                == *bytes as i128 - 2 * *values as i128;
            if same_line && next_values >= *values + *n {
                *n = next_values + next_n - *values;
                continue;
            }
        }
        out.push(op);
    }
    out
}

/// One step of a piece's encode or of a gathered bucket's decode: an MXFP8 rectangle or a bf16 run
/// between f32 values (a piece's fp32 elements, or the compute buffer) and runtime bytes (a
/// piece, or the gathered buffer). Positions are bytes and f32 elements of those buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CodecOp {
    /// Square-block MXFP8 of the `shape` rectangle whose row `r` is the f32 values
    /// `values + r · stride ..` (a piece's rectangle is contiguous, `stride` its width; in the
    /// compute buffer `stride` is its matrix's width).
    Square {
        /// Rows and columns of the rectangle.
        shape: MxShape,
        /// First f32 element.
        values: usize,
        /// f32 elements from one row's start to the next.
        stride: usize,
        /// First data byte (`rows · cols` bytes, row-major).
        data: usize,
        /// First scale byte (one per 32×32 tile, row-major).
        scales: usize,
    },
    /// `n` f32 values from `values` on as little-endian bf16 from byte `bytes` on.
    Bf16 {
        /// First byte.
        bytes: usize,
        /// Number of values.
        n: usize,
        /// First f32 element.
        values: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use sshsdp_plan::{DType, Mesh, ParamSpec, PlanConfig, Role, Sharding};

    fn plan(world: usize, format: RuntimeFormat) -> Plan {
        let specs = vec![
            ParamSpec::new("a.weight", vec![70, 96], DType::F32).with_role(Role::Matrix),
            ParamSpec::new("a.bias", vec![96], DType::F32),
            ParamSpec::new("b.weight", vec![256, 64], DType::F32).with_role(Role::Matrix),
        ];
        let mut config = PlanConfig::default()
            .with_format(format)
            .with_sharding(Sharding::Hierarchical);
        config.mx_max_padding = 1.0;
        Plan::build(specs, Mesh::flat(world).unwrap(), config).unwrap()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// Every bucket encoded piece by piece at `world` pieces and decoded again.
    fn round_trip(world: usize) -> Vec<Vec<f32>> {
        let plan = plan(world, RuntimeFormat::Mxfp8);
        let mut out = Vec::new();
        for b in 0..plan.buckets().len() {
            let codec = BucketCodec::new(&plan, b);
            let mut space = vec![0f32; codec.bucket_elems()];
            let members = &plan.params()[plan.buckets()[b].params.clone()];
            for (k, p) in members.iter().enumerate() {
                codec.place(k, &values(p.spec.numel() as usize, k as u32), &mut space);
            }
            let Elems::U8(bytes) = codec.encode(0, space).unwrap() else {
                panic!("MXFP8 buckets hold bytes")
            };
            let compute = codec.decode(&bytes).unwrap();
            for (k, p) in members.iter().enumerate() {
                let at = codec.compute_start(k);
                out.push(compute[at..at + p.spec.numel() as usize].to_vec());
            }
        }
        out
    }

    /// A linear bf16 bucket decodes in one run (one kernel launch on the device) at every world
    /// size, and every member gets its bf16-rounded values as a decode view by view gives them.
    #[test]
    fn linear_bf16_buckets_decode_in_one_run() {
        for world in [1, 2, 3] {
            let plan = plan(world, RuntimeFormat::Bf16);
            for b in 0..plan.buckets().len() {
                let codec = BucketCodec::new(&plan, b);
                let gathered = 2 * codec.gathered_units();
                let ops = codec.decode_ops(gathered).unwrap();
                assert_eq!(ops.len(), 1, "world {world}, bucket {b}: {ops:?}");
                let mut space = vec![0f32; codec.bucket_elems()];
                let members = &plan.params()[plan.buckets()[b].params.clone()];
                for (k, p) in members.iter().enumerate() {
                    codec.place(k, &values(p.spec.numel() as usize, k as u32), &mut space);
                }
                let Elems::Bf16(units) = codec.encode(0, space).unwrap() else {
                    panic!("bf16 buckets hold bf16")
                };
                let bytes: Vec<u8> = units.iter().flat_map(|u| u.to_le_bytes()).collect();
                let compute = codec.decode(&bytes).unwrap();
                for (k, p) in members.iter().enumerate() {
                    let at = codec.compute_start(k);
                    let want: Vec<f32> = values(p.spec.numel() as usize, k as u32)
                        .iter()
                        .map(|&v| bf16::from_f32(v).to_f32())
                        .collect();
                    assert_eq!(compute[at..at + want.len()], want[..], "world {world}");
                }
            }
        }
    }

    #[test]
    fn tiled_mxfp8_decodes_the_same_at_every_world_size() {
        let one = round_trip(1);
        for world in [2, 3, 4, 8] {
            assert_eq!(round_trip(world), one, "world {world}");
        }
    }

    #[test]
    fn tiled_mxfp8_matches_the_reference_codec_and_bf16_fallback() {
        let plan = plan(4, RuntimeFormat::Mxfp8);
        let decoded = round_trip(4);
        let mut i = 0;
        for b in 0..plan.buckets().len() {
            for (k, p) in plan.params()[plan.buckets()[b].params.clone()]
                .iter()
                .enumerate()
            {
                let v = values(p.spec.numel() as usize, k as u32);
                let expect: Vec<f32> = match p.encoding() {
                    Encoding::Mxfp8 { rows, cols } => {
                        // The whole matrix's square-block encoding, in one piece.
                        let shape = MxShape::new(rows as usize, cols as usize);
                        let mut data = vec![0u8; shape.square_data_bytes()];
                        let mut scales = vec![0u8; shape.square_scale_bytes()];
                        let (fmt, rule) = MX_FORMAT;
                        sshsdp_mx::encode_square(
                            &v,
                            shape.cols,
                            shape,
                            fmt,
                            rule,
                            &mut data,
                            &mut scales,
                        )
                        .unwrap();
                        let mut out = vec![0f32; v.len()];
                        sshsdp_mx::decode_square(&data, &scales, shape, fmt, &mut out, shape.cols)
                            .unwrap();
                        out
                    }
                    _ => v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
                };
                assert_eq!(decoded[i], expect, "{}", p.spec.path);
                i += 1;
            }
        }
        assert!(plan.fallbacks().iter().any(|f| f.path == "a.bias"));
    }

    #[test]
    fn the_plans_rectangle_sizes_are_the_reference_codecs() {
        let plan = plan(3, RuntimeFormat::Mxfp8);
        let mut seen = 0;
        for v in plan.buckets().iter().flat_map(|b| b.views.iter().flatten()) {
            for (rect, data, scales) in v.rects() {
                let shape = MxShape::new(us(rect.height()), us(rect.width()));
                assert_eq!(rect.encoded_bytes() as usize, shape.square_bytes());
                assert!(us(scales) >= us(data) + shape.square_data_bytes());
                assert!(us(scales) + shape.square_scale_bytes() <= us(v.bytes.end));
                assert!(data % 4 == 0 && scales % 4 == 0);
                seen += 1;
            }
        }
        assert!(seen >= 3, "every matrix view holds rectangles");
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
                    let codec = BucketCodec::new(&plan, b);
                    let mut seen = vec![0u8; codec.bucket_elems()];
                    for k in 0..codec.len() {
                        let numel: usize = codec.shape(k).iter().product();
                        let segments = &codec.members[k].segments;
                        let covered: usize = segments.iter().map(|s| s.len).sum();
                        assert_eq!(covered, numel);
                        for s in segments {
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
}
