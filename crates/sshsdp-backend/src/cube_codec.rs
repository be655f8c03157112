//! The MXFP8 decode of a gathered bucket on CubeCL backends: the gathered runtime bytes are
//! uploaded as they are (≈1.03 bytes per value for the pass's plane, 2 for bf16 runs) and the
//! band-plane kernels (`sshsdp_kernels::dequantize_plane`, `widen_bf16`) write the f32 compute
//! buffer on the device, following the same [`DecodeOp`]s as the host decode (bit-identical:
//! `tests` below and `kernels-cubecl/tests/kernels/planes.rs`). Uploading the host-decoded
//! buffer instead would move 4 bytes per value.

use std::any::Any;

use burn_backend::{Backend, DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use sshsdp_kernels::{dequantize_plane, widen_bf16, Plane, PlaneAt};
use sshsdp_plan::Part;

use crate::codec::{BucketCodec, DecodeOp, Phase};
use crate::cube_views::{for_each_runtime, is_cube, member_views};
use crate::views::Member;
use crate::HsdpError;

/// The parameters `members` of the gathered bytes `bytes` (the part `which` of every piece)
/// decoded for `phase` on `device`: views of one compute buffer — if `B` is a CubeCL backend
/// this build supports (`None` otherwise).
pub(crate) fn decode_views_if_cube<B: Backend>(
    codec: &BucketCodec,
    bytes: &[u8],
    which: Part,
    phase: Phase,
    members: &[Member],
    device: &B::Device,
) -> Option<Result<Vec<B::FloatTensorPrimitive>, HsdpError>> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            let bucket = decode::<B, R>(codec, bytes, which, phase, device);
            return Some(bucket.map(|bucket| member_views::<B, R>(bucket, members)));
        }
    });
    None
}

fn decode<B: Backend, R: CubeRuntime>(
    codec: &BucketCodec,
    bytes: &[u8],
    which: Part,
    phase: Phase,
    device: &B::Device,
) -> Result<B::FloatTensorPrimitive, HsdpError> {
    let ops = codec.decode_ops(bytes.len(), which, phase)?;
    let any: &dyn Any = device;
    let device: &R::Device = any.downcast_ref().expect("the type was checked");
    let client = R::client(device);
    // Whole words: the kernels read the buffer as u32.
    let mut padded = bytes.to_vec();
    padded.resize(bytes.len().next_multiple_of(4), 0);
    let src = client.create_from_slice(&padded);
    let n = codec.compute_elems();
    let out = client.empty(4 * n.max(1));
    let err = |e: sshsdp_kernels::KernelError| HsdpError::Failed(format!("MXFP8 decode: {e}"));
    for op in ops {
        match op {
            DecodeOp::Plane {
                row_plane,
                shape,
                dst,
                data,
                scales,
            } => {
                if data % 4 != 0 || scales % 4 != 0 {
                    return Err(HsdpError::Failed(format!(
                        "an MXFP8 plane at bytes {data}/{scales} is not word-aligned"
                    )));
                }
                let at = PlaneAt {
                    plane: if row_plane { Plane::Row } else { Plane::Col },
                    rows: shape.rows,
                    cols: shape.cols,
                    values_offset: dst,
                    data_word: data / 4,
                    scales_word: scales / 4,
                };
                dequantize_plane(&client, &src, at, &out).map_err(err)?;
            }
            DecodeOp::Bf16 { src: at, n, dst } => {
                widen_bf16(&client, &src, at, n, &out, dst).map_err(err)?;
            }
        }
    }
    let tensor =
        CubeTensor::<R>::new_contiguous(client, device.clone(), Shape::from([n]), out, DType::F32);
    let any: Box<dyn Any> = Box::new(tensor);
    Ok(*any
        .downcast::<B::FloatTensorPrimitive>()
        .expect("the type was checked"))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::storage::{download, Elems};
    use burn_cubecl::CubeBackend;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    use sshsdp_plan::{DType, Mesh, ParamSpec, Plan, PlanConfig, Role, RuntimeFormat};

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    /// Matrices (one not a multiple of 32 rows or columns) and a vector (a bf16 run).
    fn plan(world: usize) -> Plan {
        let specs = vec![
            ParamSpec::new("a.weight", vec![70, 96], DType::F32).with_role(Role::Matrix),
            ParamSpec::new("a.bias", vec![96], DType::F32),
            ParamSpec::new("b.weight", vec![256, 40], DType::F32).with_role(Role::Matrix),
        ];
        let mut config = PlanConfig::default().with_format(RuntimeFormat::Mxfp8);
        config.mx_max_padding = 1.0;
        Plan::build(specs, Mesh::flat(world).unwrap(), config).unwrap()
    }

    #[test]
    fn device_decode_is_bit_identical_to_the_host_decode() {
        let device = WgpuDevice::default();
        for world in [1, 3] {
            let plan = plan(world);
            for b in 0..plan.buckets().len() {
                let codec = BucketCodec::new(&plan, b);
                let mut space = vec![0f32; codec.bucket_elems()];
                let members = &plan.params()[plan.buckets()[b].params.clone()];
                for (k, p) in members.iter().enumerate() {
                    let n = p.spec.numel() as usize;
                    let values: Vec<f32> = (0..n)
                        .map(|i| ((i * 7919 + k * 31) % 1013) as f32 / 97.0 - 5.0)
                        .collect();
                    codec.place(k, &values, &mut space);
                }
                // Every piece encoded by its owner, the pieces one after the other.
                let pe = codec.piece_elems();
                let mut bytes = Vec::new();
                for p in 0..world {
                    let Elems::U8(piece) = codec
                        .encode(p, space[p * pe..(p + 1) * pe].to_vec())
                        .unwrap()
                    else {
                        panic!("MXFP8 buckets hold bytes")
                    };
                    bytes.extend(piece);
                }
                for phase in [Phase::Forward, Phase::Backward] {
                    for which in [Part::All, phase.part()] {
                        let range = codec.part_range(which);
                        let part: Vec<u8> = bytes
                            .chunks(codec.part_range(Part::All).len())
                            .flat_map(|piece| piece[range.clone()].to_vec())
                            .collect();
                        let host = codec.decode(&part, which, phase).unwrap();
                        let tensor =
                            decode::<B, WgpuRuntime>(&codec, &part, which, phase, &device).unwrap();
                        let dev = download::<B>(tensor).unwrap();
                        for (k, p) in members.iter().enumerate() {
                            let at = codec.compute_start(k);
                            let n = p.spec.numel() as usize;
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&dev[at..at + n]),
                                bits(&host[at..at + n]),
                                "world {world}, bucket {b}, {}, {phase:?}, {which:?}",
                                p.spec.path
                            );
                        }
                    }
                }
            }
        }
    }
}
