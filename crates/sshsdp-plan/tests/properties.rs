//! Property tests over random model shapes, meshes, sharding modes and formats: coverage,
//! alignment, locality of re-derivation, splits, equal shards, bounded padding and determinism.

use proptest::prelude::*;
use sshsdp_plan::{
    DType, Encoding, Mesh, ParamSpec, Plan, PlanConfig, Role, RuntimeFormat, Sharding, Span,
    MX_BLOCK,
};

fn arb_shape() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        prop::collection::vec(1usize..300, 1),
        prop::collection::vec(1usize..200, 2),
        prop::collection::vec(1usize..12, 3),
    ]
}

fn arb_specs() -> impl Strategy<Value = Vec<ParamSpec>> {
    prop::collection::vec((arb_shape(), any::<bool>(), any::<bool>()), 1..24).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (shape, embed, elementwise))| {
                let name = if embed { "embed" } else { "proj" };
                let spec = ParamSpec::new(format!("layers.{i}.{name}.weight"), shape, DType::F32);
                if elementwise && spec.role == Role::Matrix {
                    spec.with_role(Role::Elementwise)
                } else {
                    spec
                }
            })
            .collect()
    })
}

fn arb_config() -> impl Strategy<Value = PlanConfig> {
    (
        1u64..60_000,
        prop_oneof![
            Just(RuntimeFormat::F32),
            Just(RuntimeFormat::Bf16),
            Just(RuntimeFormat::Mxfp8)
        ],
        prop_oneof![Just(32u64), Just(64), Just(256)],
        prop_oneof![
            Just(Sharding::Hierarchical),
            Just(Sharding::Hsdp),
            Just(Sharding::Ddp)
        ],
        0.0f64..2.0,
    )
        .prop_map(|(bucket, format, align, sharding, mx_pad)| PlanConfig {
            bucket_elements: bucket,
            runtime_format: format,
            align_bytes: align,
            sharding,
            mx_max_padding: mx_pad,
            ..PlanConfig::default()
        })
}

fn arb_mesh() -> impl Strategy<Value = Mesh> {
    (1usize..4, 1usize..6).prop_map(|(r, s)| Mesh::new(r, s).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_element_is_owned_exactly_once(specs in arb_specs(), mesh in arb_mesh(), config in arb_config()) {
        let plan = Plan::build(specs, mesh, config).unwrap();
        let mut runs: Vec<Vec<(u64, u64)>> = vec![Vec::new(); plan.params().len()];
        let mut tiles: Vec<Vec<(u64, u64)>> = vec![Vec::new(); plan.params().len()];
        for (b, bucket) in plan.buckets().iter().enumerate() {
            prop_assert_eq!(bucket.views.len(), plan.pieces());
            for piece in 0..plan.pieces() {
                // Views tile the piece's elements in order, and its bytes in order, within the
                // piece: re-derivation never writes another piece's bytes.
                let (mut master, mut used) = (0, 0u64);
                for v in plan.piece_views(b, piece).unwrap() {
                    prop_assert_eq!((v.bucket, v.piece), (b, piece));
                    prop_assert!(v.master_offset >= master, "views overlap");
                    master = v.master_offset + v.len();
                    prop_assert!(master <= bucket.piece_elements);
                    prop_assert!(v.bytes.start >= used, "bytes overlap");
                    used = v.bytes.end;
                    prop_assert!(used <= bucket.piece_bytes);
                    let p = &plan.params()[v.param];
                    prop_assert_eq!(v.encoding, p.encoding());
                    match v.encoding {
                        Encoding::Mxfp8 { rows, cols } => {
                            // Whole tiles; rectangles on tile edges, word-aligned, in order.
                            let Span::Tiles(t) = &v.span else { panic!("MXFP8 views hold tiles") };
                            tiles[v.param].push((t.start, t.end));
                            prop_assert_eq!((rows, cols), p.spec.matrix_dims());
                            let mut at = v.bytes.start;
                            let mut bytes = 0;
                            for (rect, data, scales) in v.rects() {
                                prop_assert_eq!(rect.rows.start % 32, 0);
                                prop_assert_eq!(rect.cols.start % 32, 0);
                                prop_assert!(data >= at && data % 4 == 0 && scales % 4 == 0);
                                at = scales + (rect.encoded_bytes() - rect.len());
                                prop_assert!(scales >= data + rect.len() && at <= v.bytes.end);
                                bytes += rect.encoded_bytes();
                            }
                            prop_assert_eq!(v.encoded_bytes(), bytes);
                            prop_assert!(v.bytes.end - v.bytes.start < bytes + 3 * 8);
                        }
                        Encoding::F32 | Encoding::Bf16 => {
                            let size = if v.encoding == Encoding::F32 { 4 } else { 2 };
                            prop_assert_eq!(v.encoded_bytes(), size * v.len());
                            let held = v.bytes.end - v.bytes.start;
                            prop_assert!(held >= size * v.len() && held < size * v.len() + MX_BLOCK);
                        }
                    }
                    let mut at = v.master_offset;
                    for (run, master) in v.runs() {
                        prop_assert_eq!(master, at);
                        at += run.end - run.start;
                        runs[v.param].push((run.start, run.end - run.start));
                    }
                    prop_assert_eq!(at, v.master_offset + v.len());
                }
            }
        }
        for (i, p) in plan.params().iter().enumerate() {
            let ranges = &mut runs[i];
            ranges.sort();
            let mut next = 0;
            for &(a, len) in ranges.iter() {
                prop_assert_eq!(a, next, "gap or overlap in {}", p.spec.path);
                prop_assert!(len > 0);
                next = a + len;
            }
            prop_assert_eq!(next, p.spec.numel());
            let views = plan.param_views(i).unwrap().len();
            prop_assert_eq!(p.split, views > 1);
            // A matrix's views hold consecutive tile ranges.
            let t = &mut tiles[i];
            t.sort();
            prop_assert!(t.windows(2).all(|w| w[0].1 == w[1].0));
        }
    }

    #[test]
    fn pieces_are_balanced_and_owners_sit_where_matrices_lie(specs in arb_specs(), mesh in arb_mesh(), config in arb_config()) {
        let plan = Plan::build(specs, mesh, config.clone()).unwrap();
        prop_assert_eq!(plan.pieces() % plan.runtime_shards(), 0);
        for (b, bucket) in plan.buckets().iter().enumerate() {
            let members = &plan.params()[bucket.params.clone()];
            let encoded: u64 = members.iter().map(|p| p.runtime_bytes).sum();
            let covered: u64 = (0..plan.pieces()).map(|p| bucket.covered_bytes(p)).sum();
            prop_assert_eq!(covered, encoded);
            let padding = plan.buffer_bytes(b) - encoded;
            match config.runtime_format.element_bytes() {
                Some(_) => {
                    // Alignment gaps (< align each) plus the tail (< 33 bytes a piece).
                    prop_assert_eq!(bucket.piece_bytes % MX_BLOCK, 0);
                    let bound = members.len() as u64 * config.align_bytes + plan.pieces() as u64 * (MX_BLOCK + 1);
                    prop_assert!(padding < bound, "padding {} >= bound {}", padding, bound);
                }
                None => {
                    // Cuts move at most half an atom: every piece's bytes are within one tile
                    // (or bf16 element) of the mean, plus each view's word alignment.
                    let tile = members.iter().map(|p| match p.encoding().grid() {
                        Some(_) => 32 * 32 + 1,
                        None => 2,
                    }).max().unwrap();
                    for piece in 0..plan.pieces() {
                        prop_assert!(bucket.covered_bytes(piece) <= encoded / plan.pieces() as u64 + tile + 1);
                    }
                    let views = bucket.views.iter().map(Vec::len).max().unwrap_or(0) as u64;
                    prop_assert!(bucket.piece_bytes <= encoded / plan.pieces() as u64 + tile + 1 + views * 18 + MX_BLOCK);
                }
            }
            for (k, p) in members.iter().enumerate() {
                if p.spec.role == Role::Matrix {
                    let owner = p.ns_owner.expect("every matrix has a Newton–Schulz owner");
                    prop_assert!(owner < plan.pieces());
                    if !p.split {
                        let views = plan.param_views(bucket.params.start + k).unwrap();
                        prop_assert_eq!(owner, views[0].piece, "a whole matrix is owned where it lies");
                    }
                } else {
                    prop_assert!(p.ns_owner.is_none());
                }
            }
        }
        let total_cost: u128 = plan.params().iter().filter(|p| p.spec.role == Role::Matrix)
            .map(|p| { let (r, c) = p.spec.matrix_dims(); sshsdp_plan::newton_schulz_cost(r, c) }).sum();
        prop_assert_eq!(plan.owner_load().iter().sum::<u128>(), total_cost);
    }

    #[test]
    fn memory_sums_to_the_model(specs in arb_specs(), mesh in arb_mesh(), config in arb_config()) {
        let plan = Plan::build(specs, mesh, config.clone()).unwrap();
        let total: u64 = plan.params().iter().map(|p| p.spec.numel()).sum();
        let mem = plan.memory();
        prop_assert_eq!(mem.ranks.len(), mesh.world_size());
        let master_sum: u64 = match config.sharding {
            Sharding::Hierarchical => mem.ranks.iter().map(|m| m.master).sum(),
            Sharding::Hsdp => mem.ranks[..mesh.shards()].iter().map(|m| m.master).sum(),
            Sharding::Ddp => mem.ranks[0].master,
        };
        prop_assert_eq!(master_sum, 4 * total);
        for m in &mem.ranks {
            prop_assert_eq!(m.gradient_shard, m.master);
            prop_assert!(m.padding <= m.runtime_shard);
        }
    }

    #[test]
    fn any_discovery_order_gives_the_same_plan(specs in arb_specs(), mesh in arb_mesh(), config in arb_config(), seed in any::<u64>()) {
        let plan = Plan::build(specs.clone(), mesh, config.clone()).unwrap();
        let mut shuffled = specs;
        let mut state = seed | 1;
        for i in (1..shuffled.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            shuffled.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let again = Plan::build(shuffled, mesh, config).unwrap();
        prop_assert_eq!(plan.fingerprint(), again.fingerprint());
        prop_assert_eq!(&plan, &again);
    }
}
