//! The planner's square-block MXFP8 layout and the reference codec agree: owners encoding only
//! their own tiles (from their own fp32 elements, in the piece's order), into their own bytes,
//! write exactly the whole matrix's encoding of those tiles.

use sshsdp::mx::{self, ElemFormat, MxShape, ScaleRule};
use sshsdp::plan::tiles::TileGrid;
use sshsdp::plan::{DType, Encoding, Mesh, ParamSpec, Plan, PlanConfig, RuntimeFormat};

#[test]
fn block_and_tile_constants_agree() {
    assert_eq!(sshsdp::plan::MX_BLOCK as usize, mx::BLOCK);
    assert_eq!(sshsdp::plan::tiles::TILE as usize, mx::TILE);
    for (rows, cols) in [(1, 1), (33, 7), (64, 65), (32, 256)] {
        let shape = MxShape::new(rows, cols);
        let grid = TileGrid::new(rows as u64, cols as u64);
        assert_eq!(grid.encoded_bytes() as usize, shape.square_bytes());
        assert_eq!(grid.tiles() as usize, shape.square_scale_bytes());
    }
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
        vec![70, 300],
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
    let (fmt, rule) = (ElemFormat::E4M3, ScaleRule::Rceil);
    let mut split_tiles = 0;
    for world in [1, 3, 4, 7, 16] {
        let plan = Plan::build(specs.clone(), Mesh::flat(world).unwrap(), config.clone()).unwrap();
        let data: Vec<Vec<f32>> = plan
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| values(i as u64 + 1, p.spec.numel() as usize))
            .collect();
        for (b, bucket) in plan.buckets().iter().enumerate() {
            // Each piece's owner gathers its fp32 elements in the piece's order (the views'
            // runs), then encodes each rectangle from them into its own piece.
            let mut buffer = vec![0u8; plan.buffer_bytes(b) as usize];
            for piece in 0..plan.pieces() {
                let base = piece * bucket.piece_bytes as usize;
                let mut master = vec![0f32; bucket.piece_elements as usize];
                for v in plan.piece_views(b, piece).unwrap() {
                    for (run, at) in v.runs() {
                        let (run, at) = (run.start as usize..run.end as usize, at as usize);
                        master[at..at + run.len()].copy_from_slice(&data[v.param][run]);
                    }
                }
                for v in plan.piece_views(b, piece).unwrap() {
                    let Encoding::Mxfp8 { .. } = v.encoding else {
                        assert_ne!(plan.params()[v.param].format, RuntimeFormat::Mxfp8);
                        continue;
                    };
                    let mut at = v.master_offset as usize;
                    let rects = v.rects();
                    split_tiles += usize::from(rects.len() > 1);
                    for (rect, d, s) in rects {
                        let shape = MxShape::new(rect.height() as usize, rect.width() as usize);
                        let (d, s) = (base + d as usize, base + s as usize);
                        let (data_bytes, rest) = buffer[d..].split_at_mut(s - d);
                        mx::encode_square(
                            &master[at..],
                            shape.cols,
                            shape,
                            fmt,
                            rule,
                            &mut data_bytes[..shape.square_data_bytes()],
                            &mut rest[..shape.square_scale_bytes()],
                        )
                        .unwrap();
                        at += shape.len();
                    }
                }
            }
            // Every rectangle's bytes are the whole matrix's bytes for those tiles.
            for i in bucket.params.clone() {
                let p = &plan.params()[i];
                if p.format != RuntimeFormat::Mxfp8 {
                    continue;
                }
                let (rows, cols) = p.spec.matrix_dims();
                let shape = MxShape::new(rows as usize, cols as usize);
                let mut whole_data = vec![0u8; shape.square_data_bytes()];
                let mut whole_scales = vec![0u8; shape.square_scale_bytes()];
                let (d, s) = (&mut whole_data, &mut whole_scales);
                mx::encode_square(&data[i], shape.cols, shape, fmt, rule, d, s).unwrap();
                let tc = shape.tile_cols();
                for v in plan.param_views(i).unwrap() {
                    let base = v.piece * bucket.piece_bytes as usize;
                    for (rect, d, s) in v.rects() {
                        let (d, s) = (base + d as usize, base + s as usize);
                        let (r0, c0) = (rect.rows.start as usize, rect.cols.start as usize);
                        let (h, w) = (rect.height() as usize, rect.width() as usize);
                        for r in 0..h {
                            let got = &buffer[d + r * w..d + (r + 1) * w];
                            let want = &whole_data[(r0 + r) * shape.cols + c0..][..w];
                            assert_eq!(got, want, "world {world}: {} row {}", p.spec.path, r0 + r);
                        }
                        let (th, tw) = (h.div_ceil(32), w.div_ceil(32));
                        for tr in 0..th {
                            let got = &buffer[s + tr * tw..s + (tr + 1) * tw];
                            let first = (r0 / 32 + tr) * tc + c0 / 32;
                            assert_eq!(got, &whole_scales[first..first + tw]);
                        }
                    }
                }
            }
        }
    }
    assert!(
        split_tiles > 0,
        "some views cut a band into several rectangles"
    );
}
