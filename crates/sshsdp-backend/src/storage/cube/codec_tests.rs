//! The CubeCL codec (`codec.rs`) against the host codec, bit for bit: decode of gathered
//! buckets (f32, and straight into f16 against Burn's cast), encode of pieces with special
//! values, on wgpu (lavapipe in CI).

use super::adapter::Inner;
use super::codec::*;
use super::{client_of, padded_to_words};
use crate::config::Precision;
use crate::runtime_units::Elems;
use crate::storage::codec::BucketCodec;
use crate::storage::roles::download;
use crate::traffic::{Purpose, Traffic};
use burn_backend::ops::FloatTensorOps;
use burn_backend::FloatDType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use sshsdp_plan::{DType, Mesh, ParamSpec, Plan, PlanConfig, Role, RuntimeFormat};

type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Matrices (one not a multiple of 32 rows or columns) and a vector (a bf16 run in MXFP8).
fn plan_in(world: usize, format: RuntimeFormat) -> Plan {
    let specs = vec![
        ParamSpec::new("a.weight", vec![70, 96], DType::F32).with_role(Role::Matrix),
        ParamSpec::new("a.bias", vec![96], DType::F32),
        ParamSpec::new("b.weight", vec![256, 40], DType::F32).with_role(Role::Matrix),
    ];
    let mut config = PlanConfig::default().with_format(format);
    config.mx_max_padding = 1.0;
    Plan::build(specs, Mesh::flat(world).unwrap(), config).unwrap()
}

/// Runtime units as little-endian bytes.
fn le_bytes(units: &Elems) -> Vec<u8> {
    match units {
        Elems::U8(bytes) => bytes.clone(),
        Elems::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Elems::F32(_) => unreachable!("not an f32 plan"),
    }
}

#[test]
fn device_decode_is_bit_identical_to_the_host_decode() {
    let device = WgpuDevice::default();
    for format in [RuntimeFormat::Mxfp8, RuntimeFormat::Bf16] {
        for world in [1, 3] {
            let plan = plan_in(world, format);
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
                let pieces: Vec<Elems> = (0..world)
                    .map(|p| {
                        codec
                            .encode(p, space[p * pe..(p + 1) * pe].to_vec())
                            .unwrap()
                    })
                    .collect();
                // What a gather returns: every piece, one after the other.
                let gathered = match &pieces[0] {
                    Elems::U8(_) => Elems::U8(pieces.iter().flat_map(le_bytes).collect()),
                    Elems::Bf16(_) => Elems::Bf16(
                        pieces
                            .iter()
                            .flat_map(|p| match p {
                                Elems::Bf16(v) => v.clone(),
                                _ => unreachable!(),
                            })
                            .collect(),
                    ),
                    Elems::F32(_) => unreachable!("not an f32 plan"),
                };
                // The host path: the decode for MXFP8, the widening for bf16.
                let host = codec.to_compute(gathered.clone()).unwrap();
                let tensor =
                    decode::<B, WgpuRuntime>(&codec, le_bytes(&gathered), &device).unwrap();
                let dev = download::<B>(tensor, &Traffic::default(), Purpose::Data).unwrap();
                for (k, p) in members.iter().enumerate() {
                    let at = codec.compute_start(k);
                    let n = p.spec.numel() as usize;
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&dev[at..at + n]),
                        bits(&host[at..at + n]),
                        "{format:?}, world {world}, bucket {b}, {}",
                        p.spec.path
                    );
                }
            }
        }
    }
}

/// A bucket decoded straight into f16 (one launch) is bitwise the f32 decode cast by
/// Burn's cast kernel (what the decode was followed by before).
#[test]
fn decoding_into_f16_equals_decoding_into_f32_then_casting() {
    let device = WgpuDevice::default();
    for format in [RuntimeFormat::Mxfp8, RuntimeFormat::Bf16] {
        let plan = plan_in(2, format);
        for b in 0..plan.buckets().len() {
            let codec = BucketCodec::new(&plan, b);
            let pe = codec.piece_elems();
            let gathered: Vec<u8> = (0..2)
                .flat_map(|p| {
                    let master = (0..pe)
                        .map(|i| ((i * 7919 + p * 13) % 1013) as f32 / 7.0 - 70.0)
                        .collect();
                    le_bytes(&codec.encode(p, master).unwrap())
                })
                .collect();
            let client = client_of::<B, WgpuRuntime>(&device);
            let len = gathered.len();
            let units = CubeUnits::<WgpuRuntime>::new(
                client.clone(),
                client.create_from_slice(&padded_to_words(gathered)),
            );
            let decode = |compute| {
                decode_buffer::<B, WgpuRuntime>(&codec, &units, len, &device, compute).unwrap()
            };
            let cast = Inner::<WgpuRuntime>::float_cast(decode(Precision::F32), FloatDType::F16);
            let direct = decode(Precision::F16);
            assert_eq!(direct.dtype, burn_backend::DType::F16);
            let bits = |t: CubeTensor<WgpuRuntime>| client.read_one(t.handle).unwrap().to_vec();
            let n = 2 * codec.compute_elems();
            let (cast, direct) = (bits(cast), bits(direct));
            assert!(
                cast[..n] == direct[..n],
                "{format:?}, bucket {b}: the direct f16 decode differs from the cast"
            );
        }
    }
}

#[test]
fn device_encode_is_bit_identical_to_the_host_encode() {
    use crate::storage::roles::upload;
    let device = WgpuDevice::default();
    // Ordinary values with specials mixed in: NaN (signalling too), ±inf, ±0, subnormals,
    // bf16 rounding ties and the largest finite f32.
    let specials = [
        f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        f32::from_bits(1),
        f32::from_bits(0x3F80_8000),
        f32::MAX,
    ];
    let value = |i: usize, with_specials: bool| {
        if with_specials && i % 97 == 5 {
            specials[(i / 97) % specials.len()]
        } else {
            ((i * 7919) % 1013) as f32 / 97.0 - 5.0
        }
    };
    for format in [RuntimeFormat::Mxfp8, RuntimeFormat::Bf16] {
        for world in [1, 3] {
            let plan = plan_in(world, format);
            for b in 0..plan.buckets().len() {
                let codec = BucketCodec::new(&plan, b);
                let pe = codec.piece_elems();
                for piece in 0..world {
                    for with_specials in [false, true] {
                        let master: Vec<f32> = (0..pe)
                            .map(|i| value(i + piece * 13, with_specials))
                            .collect();
                        let host = le_bytes(&codec.encode(piece, master.clone()).unwrap());
                        let tensor =
                            upload::<B>(master, &device, &Traffic::default(), Purpose::Data);
                        let dev =
                            encode_piece_if_cube::<B>(&codec, piece, &tensor, &Traffic::default())
                                .expect("a CubeCL backend and an encoded format")
                                .unwrap();
                        let what = format!(
                            "{format:?}, world {world}, bucket {b}, piece {piece}, \
                             specials {with_specials}"
                        );
                        assert_eq!(dev.len(), host.len(), "{what}");
                        if let Some(i) = (0..dev.len()).find(|&i| dev[i] != host[i]) {
                            panic!("{what}: byte {i}: device {} host {}", dev[i], host[i]);
                        }
                        // Stored as the host would have stored it.
                        let mut shard = codec.encode(0, vec![0.0; world * pe]).unwrap();
                        let mut want = shard.clone();
                        codec.store_piece(&mut shard, piece, &dev).unwrap();
                        let values = (0..pe).map(|i| value(i + piece * 13, with_specials));
                        codec
                            .rederive(&mut want, piece, piece, &values.collect::<Vec<_>>())
                            .unwrap();
                        assert!(format!("{shard:?}") == format!("{want:?}"), "{what}");
                    }
                }
            }
        }
    }
    // The f32 format has no encoding: its runtime elements are the masters.
    let codec = BucketCodec::new(&plan_in(1, RuntimeFormat::F32), 0);
    let tensor = upload::<B>(
        vec![0.0; codec.piece_elems()],
        &device,
        &Traffic::default(),
        Purpose::Data,
    );
    assert!(encode_piece_if_cube::<B>(&codec, 0, &tensor, &Traffic::default()).is_none());
}
