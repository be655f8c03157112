//! The host's run of a bucket's codec (`storage/codec.rs`): runtime units encoded from fp32
//! elements and decoded into the compute buffer in host memory, with `sshsdp-mx` for the
//! square-block MXFP8 rectangles (the device runs the same ops with the CubeCL kernels:
//! `storage/cube/codec.rs`).

use half::bf16;

use sshsdp_plan::RuntimeFormat;

use crate::error::HsdpError;
use crate::runtime_units::Elems;
use crate::storage::codec::{BucketCodec, CodecOp, MX_FORMAT};

impl BucketCodec {
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
    /// fp32 `master` (a copy for f32, whose runtime elements are the master's values).
    pub fn rederive(
        &self,
        shard: &mut Elems,
        slot: usize,
        piece: usize,
        master: &[f32],
    ) -> Result<(), HsdpError> {
        let units = slot * self.piece_units..(slot + 1) * self.piece_units;
        match shard {
            Elems::F32(v) => v[units].copy_from_slice(master),
            Elems::Bf16(v) => v[units]
                .iter_mut()
                .zip(master)
                .for_each(|(d, &m)| *d = bf16::from_f32(m)),
            Elems::U8(v) => self.encode_piece(piece, master, &mut v[units])?,
        }
        Ok(())
    }

    /// Encodes piece `p`'s views (tiled layout) from its fp32 elements.
    fn encode_piece(&self, p: usize, master: &[f32], out: &mut [u8]) -> Result<(), HsdpError> {
        out.fill(0);
        let err = |e: sshsdp_mx::MxError| HsdpError::Failed(format!("MXFP8 encode: {e}"));
        let (fmt, rule) = MX_FORMAT;
        for op in self.encode_ops(p).unwrap_or_default() {
            match op {
                CodecOp::Square {
                    shape,
                    values,
                    stride,
                    data,
                    scales,
                } => {
                    let src = &master[values..];
                    let (d, rest) = out[data..].split_at_mut(scales - data);
                    let d = &mut d[..shape.square_data_bytes()];
                    let s = &mut rest[..shape.square_scale_bytes()];
                    sshsdp_mx::encode_square(src, stride, shape, fmt, rule, d, s).map_err(err)?;
                }
                CodecOp::Bf16 { bytes, n, values } => {
                    let dst = &mut out[bytes..bytes + 2 * n];
                    for (d, &x) in dst.chunks_exact_mut(2).zip(&master[values..values + n]) {
                        d.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                    }
                }
            }
        }
        Ok(())
    }

    /// The compute buffer of a gathered bucket `full` (every piece).
    pub fn to_compute(&self, full: Elems) -> Result<Vec<f32>, HsdpError> {
        match full {
            Elems::F32(v) => Ok(v),
            Elems::Bf16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            Elems::U8(bytes) => self.decode(&bytes),
        }
    }

    /// Decodes a gathered tiled bucket (every piece).
    pub fn decode(&self, bytes: &[u8]) -> Result<Vec<f32>, HsdpError> {
        let ops = self.decode_ops(bytes.len())?;
        let mut out = vec![0f32; self.compute_elems()];
        for op in ops {
            match op {
                CodecOp::Square {
                    shape,
                    values,
                    stride,
                    data,
                    scales,
                } => {
                    let (d, s) = (
                        &bytes[data..data + shape.square_data_bytes()],
                        &bytes[scales..scales + shape.square_scale_bytes()],
                    );
                    sshsdp_mx::decode_square(d, s, shape, MX_FORMAT.0, &mut out[values..], stride)
                        .map_err(|e| HsdpError::Failed(format!("MXFP8 decode: {e}")))?;
                }
                CodecOp::Bf16 {
                    bytes: at,
                    n,
                    values,
                } => {
                    let src = &bytes[at..at + 2 * n];
                    for (d, s) in out[values..values + n].iter_mut().zip(src.chunks_exact(2)) {
                        *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
                    }
                }
            }
        }
        Ok(out)
    }
}
