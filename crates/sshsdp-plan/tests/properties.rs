//! Property tests over random model shapes, meshes, sharding modes and formats: coverage,
//! alignment, splits, equal shards, bounded padding and determinism.

use proptest::prelude::*;
use sshsdp_plan::{
    DType, Mesh, ParamSpec, Plan, PlanConfig, Role, RuntimeFormat, Selection, Sharding, MX_BLOCK,
    MX_TILE_BYTES,
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
        let mut elems: Vec<Vec<(u64, u64)>> = vec![Vec::new(); plan.params().len()];
        let mut tiles: Vec<Vec<(u64, u64)>> = vec![Vec::new(); plan.params().len()];
        let mut owned: Vec<u64> = vec![0; plan.params().len()];
        for b in 0..plan.buckets().len() {
            let bucket = &plan.buckets()[b];
            for piece in 0..plan.pieces() {
                let start = piece as u64 * bucket.piece_bytes;
                let end = start + bucket.piece_bytes;
                let mut master = 0;
                for v in plan.piece_views(b, piece).unwrap() {
                    prop_assert_eq!(v.master_offset, master, "master shard is contiguous");
                    master += v.elements;
                    owned[v.param] += v.elements;
                    // Re-derivation is local: the runtime bytes start in the owner's piece, and
                    // only an MX tile may run past its end.
                    prop_assert!(v.runtime_offset >= start && v.runtime_offset < end);
                    match v.selection {
                        Selection::Elements { start: a, len } => {
                            prop_assert!(v.runtime_offset + v.runtime_bytes <= end);
                            elems[v.param].push((a, len));
                        }
                        Selection::Tiles { start: a, len } => {
                            prop_assert!(v.runtime_offset + v.runtime_bytes < end + MX_TILE_BYTES);
                            tiles[v.param].push((a, len));
                        }
                    }
                }
            }
        }
        for (i, p) in plan.params().iter().enumerate() {
            let n = p.spec.numel();
            prop_assert_eq!(owned[i], n, "param {} owned elements", p.spec.path);
            let (ranges, total) = match p.format {
                RuntimeFormat::Mxfp8 => (&mut tiles[i], sshsdp_plan::MxGrid::of(&p.spec).tiles()),
                _ => (&mut elems[i], n),
            };
            ranges.sort();
            let mut next = 0;
            for &(a, len) in ranges.iter() {
                prop_assert_eq!(a, next, "gap or overlap in {}", p.spec.path);
                prop_assert!(len > 0);
                next = a + len;
            }
            prop_assert_eq!(next, total);
        }
    }

    #[test]
    fn runtime_layout_is_aligned_and_split_only_where_marked(specs in arb_specs(), mesh in arb_mesh(), config in arb_config()) {
        let plan = Plan::build(specs, mesh, config.clone()).unwrap();
        prop_assert_eq!(plan.pieces() % plan.runtime_shards(), 0);
        let mut split_tiles = 0;
        for (b, bucket) in plan.buckets().iter().enumerate() {
            prop_assert_eq!(bucket.piece_bytes % MX_BLOCK, 0);
            let buffer = plan.buffer_bytes(b);
            // Padding bound: alignment gaps (< align each) plus the tail (< 33 bytes a piece).
            let members = &plan.params()[bucket.params.clone()];
            let regions: u64 = members.iter().map(|p| p.bytes).sum();
            let bound = members.len() as u64 * config.align_bytes + plan.pieces() as u64 * (MX_BLOCK + 1);
            prop_assert!(buffer - regions < bound, "padding {} >= bound {}", buffer - regions, bound);
            let mut prev_end = 0;
            for p in members {
                prop_assert_eq!(p.offset % config.align_bytes, 0);
                prop_assert!(p.offset >= prev_end, "regions overlap");
                prev_end = p.offset + p.bytes;
                prop_assert!(prev_end <= buffer);
                let span = p.piece_span(bucket.piece_bytes);
                prop_assert_eq!(p.split, span.len() > 1);
                for piece in span.start + 1..span.end {
                    let rel = piece as u64 * bucket.piece_bytes - p.offset;
                    // No element and no MX block of 32 bytes is cut by a boundary.
                    let unit = p.format.element_bytes().unwrap_or(MX_BLOCK);
                    prop_assert_eq!(rel % unit, 0);
                    if p.format == RuntimeFormat::Mxfp8 && rel % MX_TILE_BYTES != 0 {
                        split_tiles += 1;
                    }
                }
                if p.spec.role == Role::Matrix {
                    let owner = p.ns_owner.expect("every matrix has a Newton–Schulz owner");
                    prop_assert!(owner < plan.pieces());
                    if !p.split {
                        prop_assert_eq!(owner, span.start, "a whole matrix is owned where it lies");
                    }
                } else {
                    prop_assert!(p.ns_owner.is_none());
                }
            }
        }
        let reported: usize = (0..plan.buckets().len()).map(|b| plan.split_tiles(b).unwrap().len()).sum();
        prop_assert_eq!(reported, split_tiles);
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
