//! A saved plan is untrusted input: `Plan::from_json` (and `Plan::build`, which it calls on the
//! file's inputs before anything is checked against the fingerprint) must answer `Ok` or `Err`
//! for any bytes — no panic, no overflow, no allocation sized by a number in the file.
//!
//! First deterministic regressions (each input once crashed or aborted the process), then
//! property tests with fixed case counts over arbitrary text and over mutated valid files.

use proptest::prelude::*;
use serde_json::{json, Value};
use sshsdp_plan::{
    DType, Mesh, ParamSpec, Plan, PlanConfig, PlanError, Role, RuntimeFormat, Sharding,
    MAX_ALIGN_BYTES, MAX_LAYOUT_VIEWS, MAX_TOTAL_ELEMENTS, MAX_WORLD_SIZE,
};

fn tiny_model() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("embed.weight", vec![100, 64], DType::F32),
        ParamSpec::new("layers.0.norm.gamma", vec![64], DType::F32),
        ParamSpec::new("layers.0.attn.weight", vec![64, 64], DType::F32),
        ParamSpec::new("layers.0.mlp.weight", vec![64, 256], DType::F32),
        ParamSpec::new("lm_head.weight", vec![64, 100], DType::F32),
    ]
}

/// A valid saved plan (2×2 mesh, MXFP8 with fallbacks, small buckets) as a JSON value.
fn valid_file() -> Value {
    let config = PlanConfig::default()
        .with_format(RuntimeFormat::Mxfp8)
        .with_bucket_elements(10_000);
    let plan = Plan::build(tiny_model(), Mesh::new(2, 2).unwrap(), config).unwrap();
    serde_json::from_str(&plan.to_json()).unwrap()
}

fn from_value(v: &Value) -> Result<Plan, PlanError> {
    Plan::from_json(&v.to_string())
}

fn spec_json(path: &str, shape: &[u64]) -> Value {
    json!({"path": path, "shape": shape, "dtype": "F32", "role": "Elementwise", "order": null})
}

// ---------------------------------------------------------------------------------------------
// Regressions.

/// `replicas × shards` = 2^40 fits a usize, so the mesh was accepted and every bucket allocated
/// one view list per piece: 2^40 of them (an allocation failure that aborts the process).
#[test]
fn a_huge_mesh_is_refused_before_allocating() {
    let mut file = valid_file();
    file["mesh"] = json!({"replicas": 1u64 << 20, "shards": 1u64 << 20});
    assert!(matches!(
        from_value(&file),
        Err(PlanError::InvalidMesh {
            replicas: 0x10_0000,
            shards: 0x10_0000
        })
    ));
    assert!(Mesh::new(1, MAX_WORLD_SIZE).is_ok());
    assert!(matches!(
        Mesh::new(2, MAX_WORLD_SIZE / 2 + 1),
        Err(PlanError::InvalidMesh { .. })
    ));
}

/// A mesh within bounds but with many parameters: pieces × parameters view lists and
/// layout work, refused up front.
#[test]
fn too_many_views_are_refused_before_allocating() {
    let mut file = valid_file();
    file["mesh"] = json!({"replicas": 1, "shards": MAX_WORLD_SIZE});
    file["config"]["bucket_elements"] = json!(1);
    let specs: Vec<Value> = (0..=MAX_LAYOUT_VIEWS / MAX_WORLD_SIZE as u64)
        .map(|i| spec_json(&format!("p{i}"), &[3]))
        .collect();
    file["specs"] = Value::Array(specs);
    assert!(matches!(from_value(&file), Err(PlanError::TooLarge { .. })));
}

/// An MXFP8 shape whose element count fits but whose padded planes overflow 64 bits:
/// `rows · cols_p` overflowed in `resolve_format` (a panic).
#[test]
fn an_mx_shape_whose_planes_overflow_is_refused() {
    let mut file = valid_file();
    file["specs"] = json!([spec_json("w", &[1 << 59, 2])]);
    assert!(matches!(from_value(&file), Err(PlanError::TooLarge { .. })));
}

/// Parameters that each fit but whose bytes together overflow the bucket cursor (a panic in
/// the linear layout).
#[test]
fn parameters_whose_sum_overflows_are_refused() {
    let mut file = valid_file();
    file["config"]["runtime_format"] = json!("F32");
    file["config"]["bucket_elements"] = json!(u64::MAX);
    let specs: Vec<Value> = (0..16)
        .map(|i| spec_json(&format!("p{i}"), &[1 << 58]))
        .collect();
    file["specs"] = Value::Array(specs);
    assert!(matches!(from_value(&file), Err(PlanError::TooLarge { .. })));
    // The bound itself: exactly at the limit is fine to validate, one more is not.
    let at = ParamSpec::new("a", vec![MAX_TOTAL_ELEMENTS as usize], DType::F32);
    let over = ParamSpec::new("b", vec![1], DType::F32);
    assert!(matches!(
        Plan::build([at, over], Mesh::flat(1).unwrap(), PlanConfig::default()),
        Err(PlanError::TooLarge { .. })
    ));
}

/// `align_bytes` = 2^63 is a multiple of 32, so it passed validation and the third region's
/// offset in a linear bucket overflowed (a panic).
#[test]
fn a_huge_alignment_is_refused() {
    let mut file = valid_file();
    file["config"]["align_bytes"] = json!(1u64 << 63);
    file["config"]["runtime_format"] = json!("F32");
    file["config"]["bucket_elements"] = json!(u64::MAX);
    assert!(matches!(
        from_value(&file),
        Err(PlanError::InvalidConfig(_))
    ));
    let config = PlanConfig {
        align_bytes: MAX_ALIGN_BYTES,
        ..PlanConfig::default()
    };
    assert!(Plan::build(tiny_model(), Mesh::flat(2).unwrap(), config.clone()).is_ok());
    let config = PlanConfig {
        align_bytes: MAX_ALIGN_BYTES + 32,
        ..config
    };
    assert!(matches!(
        Plan::build(tiny_model(), Mesh::flat(2).unwrap(), config),
        Err(PlanError::InvalidConfig(_))
    ));
}

/// Memory accounting of a plan read from a file: `prefetch_buckets + 1` and
/// `len · state_bytes` overflowed (panics in `Plan::memory`).
#[test]
fn memory_accounting_of_extreme_configs_does_not_overflow() {
    let config = PlanConfig {
        prefetch_buckets: usize::MAX,
        bucket_elements: 5_000,
        ..PlanConfig::default()
    };
    let plan = Plan::build(tiny_model(), Mesh::new(2, 2).unwrap(), config).unwrap();
    let plan = Plan::from_json(&plan.to_json()).unwrap();
    let report = plan.memory();
    let all: u64 = (0..plan.buckets().len())
        .map(|b| plan.buffer_bytes(b))
        .sum();
    assert_eq!(report.ranks[0].gathered_peak, all);

    let mut file = valid_file();
    file["config"]["optimizer"]["matrix_state_bytes"] = json!(u64::MAX);
    assert!(matches!(
        from_value(&file),
        Err(PlanError::InvalidConfig(_))
    ));
}

#[test]
fn the_limits_admit_real_models() {
    // A 2^20-rank hierarchical mesh over a few parameters, and a model of 2^40 elements.
    let specs = vec![
        ParamSpec::new("w", vec![1 << 20, 1 << 20], DType::Bf16).with_role(Role::Matrix),
        ParamSpec::new("b", vec![1 << 20], DType::Bf16),
    ];
    let mesh = Mesh::new(1 << 4, 1 << 6).unwrap();
    let plan = Plan::build(
        specs.clone(),
        mesh,
        PlanConfig::default().with_format(RuntimeFormat::Mxfp8),
    )
    .unwrap();
    assert_eq!(Plan::from_json(&plan.to_json()).unwrap(), plan);
    let plan = Plan::build(
        specs,
        Mesh::flat(MAX_WORLD_SIZE).unwrap(),
        PlanConfig::default().with_sharding(Sharding::Hsdp),
    )
    .unwrap();
    assert_eq!(plan.pieces(), MAX_WORLD_SIZE);
}

// ---------------------------------------------------------------------------------------------
// Properties.

/// Numbers a mutation puts in place of a number of the file.
fn extreme_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(2)),
        Just(json!(31)),
        Just(json!(1u64 << 20)),
        Just(json!(1u64 << 31)),
        Just(json!(1u64 << 32)),
        Just(json!(1u64 << 40)),
        Just(json!(1u64 << 53)),
        Just(json!(1u64 << 62)),
        Just(json!(1u64 << 63)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(0.5)),
        Just(json!(-0.0)),
        Just(json!(1e300)),
        Just(json!(-1e300)),
        Just(json!("NaN")),
        Just(json!(null)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|x| json!(x)),
    ]
}

/// Every number in `v`, as a JSON pointer.
fn number_pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Number(_) => out.push(at),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                number_pointers(item, format!("{at}/{i}"), out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                number_pointers(item, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 384,
        // Regressions are committed next to this file.
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::SourceParallel("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary text: an error, never a panic.
    #[test]
    fn arbitrary_text_never_panics(text in ".{0,400}") {
        prop_assert!(Plan::from_json(&text).is_err());
    }

    /// Arbitrary bytes (lossily decoded): an error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = Plan::from_json(&String::from_utf8_lossy(&bytes));
    }

    /// Up to four numbers of a valid file replaced by extreme values: `Ok` or `Err`, and a plan
    /// that loads answers its queries without panicking.
    #[test]
    fn mutated_numbers_never_panic(
        picks in prop::collection::vec((any::<prop::sample::Index>(), extreme_number()), 1..5)
    ) {
        let mut file = valid_file();
        let mut pointers = Vec::new();
        number_pointers(&file, String::new(), &mut pointers);
        for (index, value) in picks {
            let at = index.get(&pointers);
            *file.pointer_mut(at).unwrap() = value;
        }
        if let Ok(plan) = from_value(&file) {
            let _ = (plan.memory(), plan.stats(), plan.to_string());
        }
    }

    /// Mutated numbers with the fingerprint recomputed, so that plans the planner accepts load
    /// and are exercised through every query.
    #[test]
    fn mutated_numbers_with_fixed_fingerprint_never_panic(
        picks in prop::collection::vec((any::<prop::sample::Index>(), extreme_number()), 1..4)
    ) {
        let mut file = valid_file();
        let mut pointers = Vec::new();
        number_pointers(&file, String::new(), &mut pointers);
        for (index, value) in picks {
            let at = index.get(&pointers);
            *file.pointer_mut(at).unwrap() = value;
        }
        if let Err(PlanError::FingerprintMismatch { rebuilt, .. }) = from_value(&file) {
            file["fingerprint"] = json!(rebuilt);
            let plan = from_value(&file).unwrap();
            let _ = (plan.memory(), plan.stats(), plan.to_string());
            for rank in 0..plan.mesh().world_size().min(64) {
                let _ = plan.update_views(rank).unwrap();
            }
        }
    }

    /// A valid file's text with bytes flipped, removed, duplicated or truncated.
    #[test]
    fn mutated_text_never_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = serde_json::to_string_pretty(&valid_file()).unwrap().into_bytes();
        for (at, byte, kind) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match kind {
                0 => bytes[i] ^= byte | 1,
                1 => bytes[i] = byte,
                2 => {
                    bytes.remove(i);
                }
                _ => {
                    let b = bytes[i];
                    bytes.insert(i, b);
                }
            }
        }
        if truncate && !bytes.is_empty() {
            bytes.truncate(cut.index(bytes.len()));
        }
        let _ = Plan::from_json(&String::from_utf8_lossy(&bytes));
    }
}
