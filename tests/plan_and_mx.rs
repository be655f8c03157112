//! The planner's MXFP8 regions and the codec's tiled layout agree, and owners re-deriving only
//! their own tiles rebuild exactly the bytes a whole-tensor encode writes.

use sshsdp::mx::{self, ElemFormat, MxShape, ScaleRule};
use sshsdp::plan::{DType, Mesh, ParamSpec, Plan, PlanConfig, RuntimeFormat, Selection};

#[test]
fn tile_constants_agree() {
    assert_eq!(sshsdp::plan::MX_TILE_BYTES as usize, mx::TILE_BYTES);
    assert_eq!(sshsdp::plan::MX_TILE as usize, mx::TILE);
    assert_eq!(sshsdp::plan::MX_BLOCK as usize, mx::BLOCK);
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 20_000) as f32 / 1000.0 - 10.0
        })
        .collect()
}

#[test]
fn owners_rederive_their_tiles_into_the_bucket_in_place() {
    let shapes = [
        vec![96, 64],
        vec![40, 60],
        vec![64],
        vec![33, 256],
        vec![128, 32],
    ];
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("layers.{i}.w"), s.clone(), DType::F32))
        .collect();
    let config = PlanConfig {
        mx_max_padding: 1.0,
        ..PlanConfig::default().with_format(RuntimeFormat::Mxfp8)
    };
    for world in [1, 3, 4, 7] {
        let plan = Plan::build(specs.clone(), Mesh::flat(world).unwrap(), config.clone()).unwrap();
        let data: Vec<Vec<f32>> = plan
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| values(i as u64 + 1, p.spec.numel() as usize))
            .collect();
        for (b, _) in plan.buckets().iter().enumerate() {
            let mut buffer = vec![0u8; plan.buffer_bytes(b) as usize];
            for piece in 0..plan.pieces() {
                for v in plan.piece_views(b, piece).unwrap() {
                    let p = &plan.params()[v.param];
                    let Selection::Tiles { start, len } = v.selection else {
                        assert_ne!(p.format, RuntimeFormat::Mxfp8);
                        continue;
                    };
                    let (rows, cols) = p.spec.matrix_dims();
                    let out = &mut buffer[v.runtime_offset as usize..][..v.runtime_bytes as usize];
                    mx::encode_tiled_range(
                        &data[v.param],
                        MxShape::new(rows as usize, cols as usize),
                        ElemFormat::E4M3,
                        ScaleRule::Rceil,
                        start as usize,
                        (start + len) as usize,
                        out,
                    )
                    .unwrap();
                }
            }
            for (i, p) in plan.params().iter().enumerate() {
                if p.bucket != b || p.format != RuntimeFormat::Mxfp8 {
                    continue;
                }
                let (rows, cols) = p.spec.matrix_dims();
                let shape = MxShape::new(rows as usize, cols as usize);
                assert_eq!(p.bytes as usize, mx::tiled_bytes(shape.rows, shape.cols));
                let mut whole = vec![0u8; p.bytes as usize];
                mx::encode_tiled(
                    &data[i],
                    shape,
                    ElemFormat::E4M3,
                    ScaleRule::Rceil,
                    &mut whole,
                )
                .unwrap();
                let region = &buffer[p.offset as usize..(p.offset + p.bytes) as usize];
                assert!(
                    region == &whole[..],
                    "world {world}: {} differs",
                    p.spec.path
                );
            }
        }
    }
}
