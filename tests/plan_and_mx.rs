//! The planner's MXFP8 band layout and the reference codec agree: owners encoding only their
//! own bands, into their own sections, write exactly the bytes of the whole matrix's planes.

use sshsdp::mx::{self, ElemFormat, MxShape, ScaleRule};
use sshsdp::plan::{
    mx_col_plane_bytes, mx_row_plane_bytes, DType, Encoding, Mesh, ParamSpec, Plan, PlanConfig,
    RuntimeFormat, Section,
};

#[test]
fn block_constants_agree() {
    assert_eq!(sshsdp::plan::MX_BLOCK as usize, mx::BLOCK);
    assert_eq!(sshsdp::plan::MX_BAND as usize, mx::BLOCK);
    for (rows, cols) in [(1, 1), (33, 7), (64, 65), (32, 256)] {
        let shape = MxShape::new(rows, cols);
        let (r, c) = (rows as u64, cols as u64);
        assert_eq!(
            mx_row_plane_bytes(r, c) as usize,
            shape.row_data_bytes() + shape.row_scale_bytes()
        );
        assert_eq!(
            mx_col_plane_bytes(r, c) as usize,
            shape.col_data_bytes() + shape.col_scale_bytes()
        );
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
fn owners_rederive_their_bands_into_the_bucket_in_place() {
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
    let (fmt, rule) = (ElemFormat::E4M3, ScaleRule::Rceil);
    for world in [1, 3, 4, 7] {
        let plan = Plan::build(specs.clone(), Mesh::flat(world).unwrap(), config.clone()).unwrap();
        let data: Vec<Vec<f32>> = plan
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| values(i as u64 + 1, p.spec.numel() as usize))
            .collect();
        for (b, bucket) in plan.buckets().iter().enumerate() {
            // Each piece's owner encodes its own views into its own piece.
            let mut buffer = vec![0u8; plan.buffer_bytes(b) as usize];
            for piece in 0..plan.pieces() {
                let base = piece * bucket.piece_bytes as usize;
                for v in plan.piece_views(b, piece).unwrap() {
                    let Encoding::Mxfp8 { cols } = v.encoding else {
                        assert_ne!(plan.params()[v.param].format, RuntimeFormat::Mxfp8);
                        continue;
                    };
                    let cols = cols as usize;
                    let src = &data[v.param][v.elements.start as usize..v.elements.end as usize];
                    let shape = MxShape::new(src.len() / cols, cols);
                    let at = |s: Section| {
                        let r = v.bytes_in(s);
                        let start = base + (bucket.section_start(s) + r.start) as usize;
                        start..start + (r.end - r.start) as usize
                    };
                    let row = &mut buffer[at(Section::Row)];
                    let (data_row, rest) = row.split_at_mut(shape.row_data_bytes());
                    let scales_row = &mut rest[..shape.row_scale_bytes()];
                    mx::encode_rows(src, shape, fmt, rule, data_row, scales_row).unwrap();
                    let col = &mut buffer[at(Section::Col)];
                    let (data_col, rest) = col.split_at_mut(shape.col_data_bytes());
                    let scales_col = &mut rest[..shape.col_scale_bytes()];
                    mx::encode_cols(src, shape, fmt, rule, data_col, scales_col).unwrap();
                }
            }
            // Every band's bytes are the whole matrix's bytes for those rows.
            for i in bucket.params.clone() {
                let p = &plan.params()[i];
                if p.format != RuntimeFormat::Mxfp8 {
                    continue;
                }
                let (rows, cols) = p.spec.matrix_dims();
                let shape = MxShape::new(rows as usize, cols as usize);
                let mut row_data = vec![0u8; shape.row_data_bytes()];
                let mut row_scales = vec![0u8; shape.row_scale_bytes()];
                mx::encode_rows(&data[i], shape, fmt, rule, &mut row_data, &mut row_scales)
                    .unwrap();
                let mut col_data = vec![0u8; shape.col_data_bytes()];
                let mut col_scales = vec![0u8; shape.col_scale_bytes()];
                mx::encode_cols(&data[i], shape, fmt, rule, &mut col_data, &mut col_scales)
                    .unwrap();
                for v in plan.param_views(i).unwrap() {
                    let base = v.piece * bucket.piece_bytes as usize;
                    let (cols, cp) = (shape.cols, shape.cols_p());
                    let r0 = v.elements.start as usize / cols;
                    let band = MxShape::new(v.len() as usize / cols, cols);
                    // Row-wise plane: rows r0.. of the data and scales.
                    let row_start = base + v.row.start as usize;
                    let got =
                        &buffer[row_start..row_start + v.row.end as usize - v.row.start as usize];
                    let (got_data, got_scales) = got.split_at(band.row_data_bytes());
                    assert_eq!(
                        got_data,
                        &row_data[r0 * cp..r0 * cp + band.row_data_bytes()]
                    );
                    let sb = cp / 32;
                    let (got_scales, padding) = got_scales.split_at(band.row_scale_bytes());
                    assert_eq!(got_scales, &row_scales[r0 * sb..r0 * sb + got_scales.len()]);
                    assert!(padding.iter().all(|&b| b == 0) && padding.len() < 32);
                    // Column-wise plane: for each column, rows r0.. of its blocks.
                    let col_start =
                        base + (bucket.section_start(Section::Col) + v.col.start) as usize;
                    let got = &buffer[col_start..col_start + (v.col.end - v.col.start) as usize];
                    let (got_data, got_scales) = got.split_at(band.col_data_bytes());
                    let (rp, brp) = (shape.rows_p(), band.rows_p());
                    for c in 0..cols {
                        assert_eq!(
                            &got_data[c * brp..(c + 1) * brp],
                            &col_data[c * rp + r0..c * rp + r0 + brp],
                            "world {world}: {} column {c}",
                            p.spec.path
                        );
                        let (n, m) = (brp / 32, rp / 32);
                        assert_eq!(
                            &got_scales[c * n..(c + 1) * n],
                            &col_scales[c * m + r0 / 32..c * m + r0 / 32 + n]
                        );
                    }
                }
            }
        }
    }
}
