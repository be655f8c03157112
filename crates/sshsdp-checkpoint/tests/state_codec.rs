//! The optimizer state codec on Burn's SGD (momentum), Adam (AMSGrad) and AdamW states: exact
//! round trips, halves that step like the whole, re-assembly across world sizes.

use crate::common;

use std::collections::BTreeMap;

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::{Tensor, TensorData};
use sshsdp_checkpoint::{
    agreed_scalars, decode_state, encode_state, read_all, strip_prefix, with_prefix, CodecError,
    Coverage, ShardFile, SliceEntry, MASTER,
};

use common::*;

fn tensor(values: &[f32]) -> Tensor<B, 1> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Default::default(),
    )
}

fn values_of(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

type Arrays = BTreeMap<String, Vec<f32>>;
type Scalars = BTreeMap<String, f64>;

fn slice_arrays(arrays: &Arrays, range: std::ops::Range<usize>) -> Arrays {
    arrays
        .iter()
        .map(|(k, v)| (k.clone(), v[range.clone()].to_vec()))
        .collect()
}

/// Steps `opt` three times on a 10-element parameter, then checks that the state survives
/// encode/decode bit for bit, that the two halves of the state (decoded separately) step
/// like the whole, and that the halves written as a world-2 checkpoint re-assemble at
/// world 1 into a state that steps identically. Returns the encoded state.
fn check_state_codec<O: SimpleOptimizer<B>>(opt: &O) -> (Arrays, Scalars) {
    let device = Default::default();
    let mut rng = Rng(5);
    let n = 10;
    let lr = 0.01;
    let mut param = tensor(&rng.values(n));
    let mut state = None;
    for _ in 0..3 {
        let grad = tensor(&rng.values(n));
        (param, state) = opt.step(lr, param, grad, state);
    }
    let state: O::State<1> = state.expect("a stateful optimizer");
    let (arrays, scalars) = encode_state::<B, _>(state.clone()).unwrap();

    let grad = rng.values(n);
    let (p_ref, s_ref) = opt.step(lr, param.clone(), tensor(&grad), Some(state));
    let (p_ref, s_ref) = (
        values_of(p_ref),
        encode_state::<B, _>(s_ref.unwrap()).unwrap(),
    );

    // Whole state, decoded.
    let decoded: O::State<1> = decode_state::<B, _>(&arrays, &scalars, n, &device).unwrap();
    assert_eq!(
        encode_state::<B, _>(decoded.clone()).unwrap(),
        (arrays.clone(), scalars.clone())
    );
    let (p, s) = opt.step(lr, param.clone(), tensor(&grad), Some(decoded));
    assert_eq!(bits(&values_of(p)), bits(&p_ref));
    assert_eq!(encode_state::<B, _>(s.unwrap()).unwrap(), s_ref);

    // Halves stepped separately equal the whole step.
    let p_all = values_of(param.clone());
    let mut p_cat = Vec::new();
    let mut s_cat: Arrays = BTreeMap::new();
    for half in [0..5, 5..10] {
        let part: O::State<1> =
            decode_state::<B, _>(&slice_arrays(&arrays, half.clone()), &scalars, 5, &device)
                .unwrap();
        let (p, s) = opt.step(
            lr,
            tensor(&p_all[half.clone()]),
            tensor(&grad[half]),
            Some(part),
        );
        p_cat.extend(values_of(p));
        let (a, sc) = encode_state::<B, _>(s.unwrap()).unwrap();
        assert_eq!(sc, s_ref.1);
        for (k, v) in a {
            s_cat.entry(k).or_default().extend(v);
        }
    }
    assert_eq!(bits(&p_cat), bits(&p_ref));
    assert_eq!(s_cat, s_ref.0);

    // Through files: world 2 (halves, state under "state.") -> world 1.
    let dir = TempDir::new("state");
    for (rank, half) in [0..4, 4..10].into_iter().enumerate() {
        let mut arrays = with_prefix(slice_arrays(&arrays, half.clone()), "state.");
        arrays.insert(MASTER.into(), p_all[half.clone()].to_vec());
        let shard = ShardFile {
            rank,
            world: 2,
            plan_json: String::new(),
            slices: vec![SliceEntry {
                path: "p".into(),
                shape: vec![n],
                start: half.start,
                end: half.end,
                arrays,
            }],
            scalars: with_prefix(scalars.clone(), "state."),
        };
        shard.write_to_dir(&dir.0).unwrap();
    }
    let files = read_all(&dir.0).unwrap();
    let whole = Coverage::new(&files)
        .unwrap()
        .assemble_slice("p", 0, n)
        .unwrap();
    let state_scalars = strip_prefix(&agreed_scalars(&files).unwrap(), "state.");
    let restored: O::State<1> = decode_state::<B, _>(
        &strip_prefix(&whole.arrays, "state."),
        &state_scalars,
        n,
        &device,
    )
    .unwrap();
    let (p, s) = opt.step(
        lr,
        tensor(&whole.arrays[MASTER]),
        tensor(&grad),
        Some(restored),
    );
    assert_eq!(bits(&values_of(p)), bits(&p_ref));
    assert_eq!(encode_state::<B, _>(s.unwrap()).unwrap(), s_ref);

    (arrays, scalars)
}

#[test]
fn sgd_momentum_state_round_trips_and_reshards() {
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_nesterov(true)))
        .build::<B>();
    let (arrays, scalars) = check_state_codec(&sgd);
    assert_eq!(arrays.keys().collect::<Vec<_>>(), ["momentum.velocity"]);
    assert!(scalars.is_empty());
}

#[test]
fn adam_amsgrad_state_round_trips_and_reshards() {
    let adam = AdamConfig::new().with_amsgrad(true).build();
    let (arrays, scalars) = check_state_codec(&adam);
    assert_eq!(
        arrays.keys().collect::<Vec<_>>(),
        [
            "momentum.max_moment_2",
            "momentum.moment_1",
            "momentum.moment_2"
        ]
    );
    assert_eq!(scalars, BTreeMap::from([("momentum.time".to_owned(), 3.0)]));
}

#[test]
fn adamw_state_round_trips_and_reshards() {
    let adamw = AdamWConfig::new().with_weight_decay(0.1).build();
    let (arrays, scalars) = check_state_codec(&adamw);
    assert_eq!(
        arrays.keys().collect::<Vec<_>>(),
        ["momentum.moment_1", "momentum.moment_2"]
    );
    assert_eq!(scalars.keys().collect::<Vec<_>>(), ["momentum.time"]);
}

#[test]
fn state_codec_errors() {
    use burn::optim::{AdamState, AdamWState, SgdState};
    let device = Default::default();
    let adam = AdamConfig::new().build();

    // Stateless SGD: an empty encoding that decodes to "no momentum".
    let sgd = SgdConfig::new().build::<B>();
    let (_, state) = sgd.step(0.1, tensor(&[1.0, 2.0]), tensor(&[0.5, 0.5]), None);
    let (a, s) = encode_state::<B, _>(state.unwrap()).unwrap();
    assert!(a.is_empty() && s.is_empty());
    let back: SgdState<B, 1> = decode_state::<B, _>(&a, &s, 2, &device).unwrap();
    assert!(back.momentum.is_none());

    // Only 1-D states.
    let p2: Tensor<B, 2> = Tensor::from_data(TensorData::new(vec![1.0f32; 4], [2, 2]), &device);
    let (_, s2) =
        SimpleOptimizer::<B>::step(&adam, 0.1, p2.clone(), Tensor::ones([2, 2], &device), None);
    assert!(matches!(encode_state::<B, _>(s2.unwrap()), Err(CodecError(m)) if m.contains("1-D")));

    let (_, s1) =
        SimpleOptimizer::<B>::step(&adam, 0.1, tensor(&[1.0; 3]), tensor(&[1.0; 3]), None);
    let (arrays, scalars) = encode_state::<B, _>(s1.unwrap()).unwrap();
    let decode =
        |a: &Arrays, s: &Scalars, len| decode_state::<B, AdamState<B, 1>>(a, s, len, &device);
    decode(&arrays, &scalars, 3).unwrap();
    // Wrong length, missing array, missing scalar, non-integral or negative time, clashes.
    assert!(matches!(decode(&arrays, &scalars, 4), Err(CodecError(_))));
    let mut missing = arrays.clone();
    missing.remove("momentum.moment_2");
    assert!(matches!(decode(&missing, &scalars, 3), Err(CodecError(m)) if m.contains("moment_2")));
    assert!(
        matches!(decode(&arrays, &BTreeMap::new(), 3), Err(CodecError(m)) if m.contains("time"))
    );
    for bad in [1.5, -1.0, f64::NAN] {
        let s = BTreeMap::from([("momentum.time".to_owned(), bad)]);
        assert!(
            matches!(decode(&arrays, &s, 3), Err(CodecError(_))),
            "{bad}"
        );
    }
    let clash = BTreeMap::from([("momentum.moment_1".to_owned(), 1.0)]);
    assert!(matches!(decode(&arrays, &clash, 3), Err(CodecError(_))));
    // Unknown names are ignored; AdamW reads Adam's encoding (same layout).
    let mut extra = scalars.clone();
    extra.insert("momentum.unknown".into(), 1.0);
    extra.insert("other".into(), 2.0);
    decode(&arrays, &extra, 3).unwrap();
    decode_state::<B, AdamWState<B, 1>>(&arrays, &scalars, 3, &device).unwrap();
}
