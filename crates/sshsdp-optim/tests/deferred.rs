//! The device step without a mid-step host read: at world 1 with device masters,
//! `ShardedOptimizer` steps before the step's non-finite verdict is read and the
//! commit settles it (`Verdict::AtCommit`); and its state is held per segment (one joint state
//! per piece whose units all step).
//!
//! * stepping before the verdict gives bitwise the weights of reading it first
//!   (`with_verdict(Verdict::BeforeStep)`);
//! * a non-finite step read at commit applies nothing — masters, AdamW's moments and step
//!   count: the run equals one that never saw the poisoned batch — is counted as skipped, or is
//!   the `NonFiniteGradient` error under the default policy;
//! * the optimizer holds one joint state per piece; per-unit states read out of it and set into
//!   a fresh optimizer (what a checkpoint does) are joined again at the next step, and the run
//!   goes on bitwise as if never interrupted.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamW, AdamWConfig};
use common::{batches, rows, seeded, TinyLm};
use sshsdp_backend::{
    named_params, shard, Hsdp, HsdpConfig, HsdpError, HsdpRuntime, NamedParam, NonFinitePolicy,
    Placement, Verdict,
};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_optim::{ShardedOptimizer, ShardedStep};
use sshsdp_plan::Mesh;

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;
type Optimizer = ShardedOptimizer<Inner, AdamW>;

/// What a run gives back: each step's outcome, the final weights, skipped steps, and the
/// optimizer's joint states at the end.
struct Run {
    outcomes: Vec<Result<(), HsdpError>>,
    weights: Vec<NamedParam>,
    skipped: u64,
    segments: usize,
}

/// AdamW steps at world 1 with device masters over `batches` (index into a fixed list), the
/// loss of step `poison.0` multiplied by `poison.1`; the verdict read before each step when
/// `verdict_first`; the global norm clipped to `clip`.
fn run(
    steps: &[usize],
    poison: Option<(usize, f32)>,
    policy: NonFinitePolicy,
    verdict_first: bool,
    clip: Option<f64>,
) -> Run {
    let data = batches(4, 2);
    let init: TinyLm<B> = seeded(5);
    ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(1).unwrap())
            .with_bucket_elements(1500)
            .with_master_placement(Placement::Device)
            .with_grad_placement(Placement::Device)
            .with_non_finite_policy(policy);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut adamw: Optimizer = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        if verdict_first {
            adamw = adamw.with_verdict(Verdict::BeforeStep);
        }
        if let Some(max_norm) = clip {
            adamw = adamw.with_grad_clipping(max_norm);
        }
        let mut outcomes = Vec::new();
        for (at, &b) in steps.iter().enumerate() {
            let mut loss = model.loss(rows::<B>(&data[b], 0, 2, &device));
            if let Some((_, factor)) = poison.filter(|(step, _)| *step == at) {
                loss = loss * factor;
            }
            let _ = loss.backward();
            let keep = model.clone();
            match adamw.step(0.01, model, &runtime) {
                Ok(m) => {
                    model = m;
                    outcomes.push(Ok(()));
                }
                Err(e) => {
                    model = keep;
                    outcomes.push(Err(e));
                }
            }
        }
        Run {
            outcomes,
            weights: named_params(&model).unwrap(),
            skipped: runtime.take_counters().skipped_steps,
            segments: adamw.segments(),
        }
    })
    .unwrap()
    .pop()
    .unwrap()
    .expect("the rank did not panic")
}

#[test]
fn stepping_before_the_verdict_is_read_gives_the_same_weights() {
    let deferred = run(&[0, 1, 2], None, NonFinitePolicy::Error, false, None);
    let first = run(&[0, 1, 2], None, NonFinitePolicy::Error, true, None);
    assert!(deferred.outcomes.iter().all(Result::is_ok));
    assert_eq!(deferred.weights, first.weights);
}

#[test]
fn a_non_finite_step_read_at_commit_applies_nothing() {
    let without = run(&[0, 2, 3], None, NonFinitePolicy::SkipStep, false, None);
    for poison in [f32::NAN, f32::INFINITY] {
        let skipped = run(
            &[0, 1, 2, 3],
            Some((1, poison)),
            NonFinitePolicy::SkipStep,
            false,
            None,
        );
        assert!(
            skipped.outcomes.iter().all(Result::is_ok),
            "{:?}",
            skipped.outcomes
        );
        assert_eq!(skipped.skipped, 1);
        // Masters, moments and AdamW's step count as if batch 1 had never been seen.
        assert_eq!(skipped.weights, without.weights, "poison {poison}");

        let failed = run(
            &[0, 1, 2, 3],
            Some((1, poison)),
            NonFinitePolicy::Error,
            false,
            None,
        );
        match &failed.outcomes[1] {
            Err(HsdpError::NonFiniteGradient { norm }) => assert!(!norm.is_finite()),
            other => panic!("poison {poison}: step 1 gave {other:?}"),
        }
        assert!(failed.outcomes[2].is_ok() && failed.outcomes[3].is_ok());
        assert_eq!(failed.skipped, 0);
        assert_eq!(failed.weights, without.weights, "poison {poison}");
    }
}

#[test]
fn one_joint_state_per_piece() {
    let trained = run(&[0, 1], None, NonFinitePolicy::Error, false, None);
    let buckets = {
        let init: TinyLm<B> = seeded(5);
        ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
            let config = HsdpConfig::new(Mesh::flat(1).unwrap()).with_bucket_elements(1500);
            let (_, runtime): (_, HsdpRuntime<Inner>) =
                shard::<B, _, _>(init.clone(), config, comm, &Default::default()).unwrap();
            runtime.plan().buckets().len()
        })
        .unwrap()
        .pop()
        .unwrap()
        .unwrap()
    };
    assert!(buckets > 1);
    assert_eq!(trained.segments, buckets);
}

#[test]
fn unit_states_read_out_and_set_back_join_and_continue_bitwise() {
    let data = batches(4, 2);
    let init: TinyLm<B> = seeded(5);
    let out = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        let device = Default::default();
        let config = HsdpConfig::new(Mesh::flat(1).unwrap())
            .with_bucket_elements(1500)
            .with_master_placement(Placement::Device)
            .with_grad_placement(Placement::Device);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut adamw: Optimizer = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        for batch in &data[..2] {
            let _ = model.loss(rows::<B>(batch, 0, 2, &device)).backward();
            model = adamw.step(0.01, model, &runtime).unwrap();
        }
        // Every unit's state out of the joint ones, into a fresh optimizer.
        let mut resumed: Optimizer = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        for param in 0..runtime.plan().params().len() {
            let state = adamw.param_state(param).unwrap();
            assert!(state.is_some(), "param {param} has stepped");
            resumed.set_param_state(param, state).unwrap();
        }
        assert_eq!(resumed.segments(), 0, "loose until the next step");
        let _ = model.loss(rows::<B>(&data[2], 0, 2, &device)).backward();
        let model = resumed.step(0.01, model, &runtime).unwrap();
        (named_params(&model).unwrap(), resumed.segments())
    });
    let (weights, segments) = out.unwrap().pop().unwrap().unwrap();
    let straight = run(&[0, 1, 2], None, NonFinitePolicy::Error, false, None);
    assert_eq!(
        segments, straight.segments,
        "joined again: one state per piece"
    );
    assert_eq!(weights, straight.weights);
}

/// Clipping where the verdict is read at commit happens on the device (the factor formed in
/// f32): within an f32 rounding of the factor of reading the verdict first (the factor in f64),
/// and a non-finite clipped step still applies nothing.
#[test]
fn clipping_on_the_device_follows_clipping_on_the_host() {
    // A norm small enough that every step clips.
    let clip = Some(0.05);
    let deferred = run(&[0, 1, 2], None, NonFinitePolicy::Error, false, clip);
    let first = run(&[0, 1, 2], None, NonFinitePolicy::Error, true, clip);
    let unclipped = run(&[0, 1, 2], None, NonFinitePolicy::Error, false, None);
    let distance = |a: &[NamedParam], b: &[NamedParam]| {
        let (mut d, mut n) = (0f64, 0f64);
        for (a, b) in a.iter().zip(b) {
            for (x, y) in a.values.iter().zip(&b.values) {
                d += (*x as f64 - *y as f64).powi(2);
                n += (*y as f64).powi(2);
            }
        }
        (d / n).sqrt()
    };
    assert!(distance(&deferred.weights, &first.weights) < 1e-6);
    assert!(
        distance(&unclipped.weights, &first.weights) > 1e-4,
        "the steps clipped"
    );
    let without = run(&[0, 2, 3], None, NonFinitePolicy::SkipStep, false, clip);
    let skipped = run(
        &[0, 1, 2, 3],
        Some((1, f32::NAN)),
        NonFinitePolicy::SkipStep,
        false,
        clip,
    );
    assert_eq!(skipped.skipped, 1);
    assert_eq!(skipped.weights, without.weights);
}
