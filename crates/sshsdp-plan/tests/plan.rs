//! Plan behaviour on hand-checked models: exact layouts, sharding modes, errors, fingerprints
//! and the saved form.

use sshsdp_plan::{
    DType, Mesh, ParamSpec, Plan, PlanConfig, PlanError, Role, RuntimeFormat, Sharding, Span,
};

fn tiny_model() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("embed.weight", vec![100, 64], DType::F32),
        ParamSpec::new("layers.0.norm.gamma", vec![64], DType::F32),
        ParamSpec::new("layers.0.attn.weight", vec![64, 64], DType::F32),
        ParamSpec::new("layers.0.mlp.weight", vec![64, 256], DType::F32),
        ParamSpec::new("layers.1.norm.gamma", vec![64], DType::F32),
        ParamSpec::new("layers.1.attn.weight", vec![64, 64], DType::F32),
        ParamSpec::new("lm_head.weight", vec![64, 100], DType::F32),
    ]
}

#[test]
fn exact_bf16_layout_on_two_ranks() {
    let config = PlanConfig::default().with_bucket_elements(10_000);
    let plan = Plan::build(tiny_model(), Mesh::flat(2).unwrap(), config).unwrap();
    // Natural path order, buckets closed before exceeding 10k elements.
    let paths: Vec<&str> = plan.params().iter().map(|p| p.spec.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "embed.weight",
            "layers.0.attn.weight",
            "layers.0.mlp.weight",
            "layers.0.norm.gamma",
            "layers.1.attn.weight",
            "layers.1.norm.gamma",
            "lm_head.weight"
        ]
    );
    let buckets: Vec<_> = plan.buckets().iter().map(|b| b.params.clone()).collect();
    assert_eq!(buckets, vec![0..1, 1..2, 2..3, 3..6, 6..7]);
    // Bucket 3: norm (128 B at 0), attn (8192 B at 128), norm (128 B at 8320).
    let b3 = &plan.buckets()[3];
    assert_eq!(b3.used_bytes, 8448);
    assert_eq!(b3.piece_bytes, 4224);
    let offsets: Vec<u64> = plan.params()[3..6]
        .iter()
        .map(|p| p.compute_offset)
        .collect();
    assert_eq!(offsets, vec![0, 64, 4160]);
    // The attn matrix straddles the two pieces: split, owned by a piece holding part of it.
    let attn = &plan.params()[4];
    assert_eq!(attn.spec.role, Role::Matrix);
    assert!(attn.split);
    // Piece 1 owns elements from byte 4224 on: attn elements (4224-128)/2 = 2048.. and the
    // second norm.
    let views = plan.piece_views(3, 1).unwrap();
    assert_eq!(views.len(), 2);
    assert_eq!(views[0].span, Span::Elements(2048..4096));
    assert_eq!(views[0].master_offset, 0);
    assert_eq!(views[0].bytes, 0..4096);
    // The second norm sits at element 4160 of the bucket, 4160 − 2112 into piece 1.
    assert_eq!(views[1].master_offset, 2048);
    assert_eq!(views[1].span, Span::Elements(0..64));
    assert_eq!(views[1].bytes, 4096..4224);
    assert_eq!(b3.piece_elements, 2112);
    assert_eq!(plan.update_views(1).unwrap().len(), 6);
    assert!(plan.fallbacks().is_empty());
}

#[test]
fn modes_shard_where_they_should() {
    let mesh = Mesh::new(2, 3).unwrap();
    let specs = tiny_model();
    let total: u64 = specs.iter().map(|s| s.numel()).sum();
    for (sharding, pieces, shards) in [
        (Sharding::Hierarchical, 6, 3),
        (Sharding::Hsdp, 3, 3),
        (Sharding::Ddp, 1, 1),
    ] {
        let plan = Plan::build(
            specs.clone(),
            mesh,
            PlanConfig::default().with_sharding(sharding),
        )
        .unwrap();
        assert_eq!(plan.pieces(), pieces);
        assert_eq!(plan.runtime_shards(), shards);
        let mem = plan.memory();
        let per_rank_master = mem.ranks[0].master;
        assert!(per_rank_master * pieces as u64 >= 4 * total);
        // Every rank's piece lies in its runtime shard; the replica group of a shard holds it.
        for rank in 0..6 {
            let piece = plan.piece_of(rank).unwrap();
            assert!(plan.ranks_of_piece(piece).unwrap().contains(&rank));
            assert_eq!(
                plan.runtime_shard_of(rank).unwrap(),
                piece / plan.pieces_per_shard()
            );
        }
    }
    // Hierarchical: the pieces of replica group {1, 4} (shard 1) are consecutive: 2 and 3.
    let plan = Plan::build(specs, mesh, PlanConfig::default()).unwrap();
    assert_eq!(plan.piece_of(1).unwrap(), 2);
    assert_eq!(plan.piece_of(4).unwrap(), 3);
    assert_eq!(plan.ranks_of_piece(3).unwrap(), vec![4]);
}

#[test]
fn mxfp8_parameters_are_tiles_and_vectors_fall_back() {
    let plan = Plan::build(
        tiny_model(),
        Mesh::flat(4).unwrap(),
        PlanConfig::default().with_format(RuntimeFormat::Mxfp8),
    )
    .unwrap();
    let fallbacks: Vec<&str> = plan.fallbacks().iter().map(|f| f.path.as_str()).collect();
    // Vectors have no GEMM layout; 100 rows or columns pad to 128 (28 % > 12.5 %).
    assert_eq!(
        fallbacks,
        vec![
            "embed.weight",
            "layers.0.norm.gamma",
            "layers.1.norm.gamma",
            "lm_head.weight"
        ]
    );
    for p in plan.params() {
        let expected = if fallbacks.contains(&p.spec.path.as_str()) {
            RuntimeFormat::Bf16
        } else {
            RuntimeFormat::Mxfp8
        };
        assert_eq!(p.format, expected, "{}", p.spec.path);
    }
    // mlp [64, 256]: 16 tiles of 32 x 32, one byte per element and one scale per tile.
    let mlp = plan.param_index("layers.0.mlp.weight").unwrap();
    let p = &plan.params()[mlp];
    assert_eq!(p.runtime_bytes, 64 * 256 + 16);
    let views = plan.param_views(mlp).unwrap();
    let owned: u64 = views.iter().map(|v| v.len()).sum();
    assert_eq!(owned, 64 * 256);
    let mut next_tile = 0;
    for v in &views {
        // Whole tiles, one after the other; their rectangles start on tile edges.
        let Span::Tiles(tiles) = &v.span else {
            panic!("an MXFP8 view holds tiles")
        };
        assert_eq!(tiles.start, next_tile);
        next_tile = tiles.end;
        let rects = v.rects();
        assert!(!rects.is_empty() && rects.len() <= 3);
        let mut bytes = 0;
        for (rect, data, scales) in &rects {
            assert_eq!((rect.rows.start % 32, rect.cols.start % 32), (0, 0));
            // Word-addressable: data and scales start on 4 bytes, inside the view's bytes.
            assert!(data % 4 == 0 && scales % 4 == 0 && *scales >= data + rect.len());
            assert!(v.bytes.start <= *data && *scales < v.bytes.end);
            bytes += rect.encoded_bytes();
        }
        assert_eq!(v.encoded_bytes(), bytes);
        assert_eq!(v.len(), rects.iter().map(|(r, _, _)| r.len()).sum::<u64>());
    }
    assert_eq!(next_tile, 16);
    // A looser limit keeps the padded shapes in MXFP8.
    let loose = PlanConfig {
        mx_max_padding: 0.5,
        ..PlanConfig::default().with_format(RuntimeFormat::Mxfp8)
    };
    let plan = Plan::build(tiny_model(), Mesh::flat(4).unwrap(), loose).unwrap();
    assert_eq!(plan.fallbacks().len(), 2);
}

#[test]
fn errors_not_panics() {
    let mesh = Mesh::flat(2).unwrap();
    let cfg = PlanConfig::default;
    assert_eq!(
        Plan::build(Vec::new(), mesh, cfg()).unwrap_err(),
        PlanError::NoParameters
    );
    let dup = vec![
        ParamSpec::new("a", vec![4], DType::F32),
        ParamSpec::new("a", vec![8], DType::F32),
    ];
    assert_eq!(
        Plan::build(dup, mesh, cfg()).unwrap_err(),
        PlanError::DuplicatePath("a".into())
    );
    let bad_matrix = vec![ParamSpec::new("v", vec![4], DType::F32).with_role(Role::Matrix)];
    assert!(matches!(
        Plan::build(bad_matrix, mesh, cfg()),
        Err(PlanError::MatrixNot2d { .. })
    ));
    let zero = vec![ParamSpec::new("z", vec![4, 0], DType::F32)];
    assert!(matches!(
        Plan::build(zero, mesh, cfg()),
        Err(PlanError::ZeroSized { .. })
    ));
    for bad in [
        PlanConfig {
            bucket_elements: 0,
            ..cfg()
        },
        PlanConfig {
            align_bytes: 48,
            ..cfg()
        },
        PlanConfig {
            mx_max_padding: f64::NAN,
            ..cfg()
        },
    ] {
        assert!(matches!(
            Plan::build(tiny_model(), mesh, bad),
            Err(PlanError::InvalidConfig(_))
        ));
    }
    let plan = Plan::build(tiny_model(), mesh, cfg()).unwrap();
    assert!(plan.piece_views(99, 0).is_err());
    assert!(plan.piece_views(0, 2).is_err());
    assert!(plan.update_views(2).is_err());
    assert!(plan.ranks_of_piece(5).is_err());
}

#[test]
fn fingerprints_tell_plans_apart() {
    let mesh = Mesh::flat(4).unwrap();
    let a = Plan::build(tiny_model(), mesh, PlanConfig::default()).unwrap();
    let mut reversed = tiny_model();
    reversed.reverse();
    let b = Plan::build(reversed, mesh, PlanConfig::default()).unwrap();
    assert!(a.check_fingerprint(&b.fingerprint()).is_ok());
    let mut other = tiny_model();
    other[2].shape = vec![64, 65];
    let c = Plan::build(other, mesh, PlanConfig::default()).unwrap();
    assert!(matches!(
        a.check_fingerprint(&c.fingerprint()),
        Err(PlanError::FingerprintMismatch { .. })
    ));
    let d = Plan::build(
        tiny_model(),
        Mesh::new(2, 2).unwrap(),
        PlanConfig::default(),
    )
    .unwrap();
    assert_ne!(a.fingerprint(), d.fingerprint());
}

#[test]
fn saved_plans_round_trip_and_corruption_is_an_error() {
    let plan = Plan::build(
        tiny_model(),
        Mesh::new(2, 2).unwrap(),
        PlanConfig::default().with_format(RuntimeFormat::Mxfp8),
    )
    .unwrap();
    let json = plan.to_json();
    assert_eq!(Plan::from_json(&json).unwrap(), plan);

    assert!(matches!(
        Plan::from_json(&json[..json.len() / 2]),
        Err(PlanError::Corrupt(_))
    ));
    assert!(matches!(
        Plan::from_json("not json"),
        Err(PlanError::Corrupt(_))
    ));
    // An edited shape still parses but no longer matches the stored fingerprint.
    let edited = json.replacen("256", "255", 1);
    assert!(matches!(
        Plan::from_json(&edited),
        Err(PlanError::FingerprintMismatch { .. })
    ));
    // A zero mesh or invalid spec inside the file is rejected by validation, not a panic.
    let zero_mesh = json.replacen("\"replicas\": 2", "\"replicas\": 0", 1);
    assert!(matches!(
        Plan::from_json(&zero_mesh),
        Err(PlanError::InvalidMesh { .. })
    ));
    let future = json.replacen("\"version\": 4", "\"version\": 99", 1);
    assert!(matches!(
        Plan::from_json(&future),
        Err(PlanError::Corrupt(_))
    ));
    // A plan of the 1x32 two-plane MXFP8 layout (version 2) is refused, saying why.
    let old = json.replacen("\"version\": 4", "\"version\": 2", 1);
    let err = Plan::from_json(&old).unwrap_err().to_string();
    assert!(
        err.contains("version 2") && err.contains("square-block"),
        "{err}"
    );
    // Version 3 had the same layout but other fingerprints: save the plan again.
    let old = json.replacen("\"version\": 4", "\"version\": 3", 1);
    let err = Plan::from_json(&old).unwrap_err().to_string();
    assert!(
        err.contains("version 3") && err.contains("save the plan again"),
        "{err}"
    );
}

#[test]
fn summaries_print() {
    let plan = Plan::build(
        tiny_model(),
        Mesh::new(2, 2).unwrap(),
        PlanConfig::default(),
    )
    .unwrap();
    let text = plan.to_string();
    assert!(text.contains("mesh 2x2"), "{text}");
    let table = plan.memory().to_string();
    for row in [
        "runtime shard",
        "fp32 master",
        "optimizer state",
        "padding",
        "total",
    ] {
        assert!(table.contains(row), "{table}");
    }
}

#[test]
fn frozen_parameters_get_buckets_of_their_own_and_plans_without_them_are_unchanged() {
    let config = PlanConfig::default().with_bucket_elements(100_000);
    let mesh = Mesh::flat(2).unwrap();
    let plain = Plan::build(tiny_model(), mesh, config.clone()).unwrap();
    assert_eq!(plain.buckets().len(), 1, "everything fits one bucket");
    // Explicitly not frozen: the same plan, fingerprint and saved form as before the field.
    let unfrozen = tiny_model().into_iter().map(|s| s.with_frozen(false));
    let same = Plan::build(unfrozen, mesh, config.clone()).unwrap();
    assert_eq!(same.fingerprint(), plain.fingerprint());
    assert!(!plain.to_json().contains("frozen"));
    // The two layers.0 matrices frozen: consecutive in plan order, so one bucket between two.
    let frozen = tiny_model()
        .into_iter()
        .map(|s| {
            let frozen = s.path.starts_with("layers.0.") && s.path.ends_with(".weight");
            s.with_frozen(frozen)
        })
        .collect::<Vec<_>>();
    let plan = Plan::build(frozen, mesh, config).unwrap();
    let buckets: Vec<_> = plan.buckets().iter().map(|b| b.params.clone()).collect();
    assert_eq!(buckets, vec![0..1, 1..3, 3..7]);
    for (b, bucket) in plan.buckets().iter().enumerate() {
        let frozen = plan.params()[bucket.params.clone()]
            .iter()
            .map(|p| p.spec.frozen);
        let all_same = frozen.clone().all(|f| f == (b == 1));
        assert!(all_same, "bucket {b} mixes frozen and trainable parameters");
    }
    assert_ne!(plan.fingerprint(), plain.fingerprint());
    // The flag survives the saved form.
    let back = Plan::from_json(&plan.to_json()).unwrap();
    assert_eq!(back.fingerprint(), plan.fingerprint());
}
