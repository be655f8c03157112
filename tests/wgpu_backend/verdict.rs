//! The device step at world 1 on wgpu (fused and not): the gradient norm stays on the device and
//! its read is awaited at commit (`Verdict::AtCommit`, what `ShardedOptimizer` asks without
//! clipping), and the world-1 gather and reduction move nothing. A step whose gradient is not
//! finite applies nothing — masters, AdamW's moments and step count, runtime shards: the run
//! equals, bitwise, one that never saw that batch — and reading the verdict before the step
//! (`with_verdict(Verdict::BeforeStep)`) gives bitwise the same weights.

use burn::backend::Autodiff;
use burn::optim::AdamWConfig;
use burn::tensor::ElementConversion;
use sshsdp::backend::{shard, Hsdp, HsdpConfig, NonFinitePolicy, Placement, Verdict};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::kernels::FusedOps;
use sshsdp::models::Gpt;
use sshsdp::optim::{ShardedOptimizer, ShardedStep};
use sshsdp::plan::{Mesh, RuntimeFormat};

use crate::harness::{initial_record, weights, Wgpu, WgpuUnfused, CONFIG, GLOBAL};

/// Rank 0's weights after AdamW steps on the batches `batches` at world 1 with device masters,
/// gradients and shards; the loss of the batch at position `poison` multiplied by NaN; the
/// skipped steps; `first` reads the verdict before each step.
fn train<I: FusedOps>(batches: &[usize], poison: Option<usize>, first: bool) -> (Vec<Vec<f32>>, u64)
where
    I::Device: Default,
{
    let record = initial_record();
    let device = I::Device::default();
    let out = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        type A<I> = Autodiff<Hsdp<I>>;
        let model: Gpt<A<I>> = crate::common::loaded(&device, record, |d| CONFIG.init(d));
        let config = HsdpConfig::new(Mesh::flat(1).unwrap())
            .with_format(RuntimeFormat::Bf16)
            .with_master_placement(Placement::Device)
            .with_grad_placement(Placement::Device)
            .with_shard_placement(Placement::Device)
            .with_non_finite_policy(NonFinitePolicy::SkipStep);
        let (mut model, runtime) = shard::<A<I>, _, _>(model, config, comm, &device).unwrap();
        let mut adamw = ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
        if first {
            adamw = adamw.with_verdict(Verdict::BeforeStep);
        }
        for (at, &batch) in batches.iter().enumerate() {
            let tokens = crate::common::tokens::<A<I>>(&CONFIG, batch, 0, GLOBAL, &device);
            let mut loss = model.loss(tokens);
            if poison == Some(at) {
                loss = loss * f32::NAN;
            }
            let _: f32 = loss.clone().into_scalar().elem();
            let _ = loss.backward();
            model = adamw.step(1e-2, model, &runtime).unwrap();
        }
        (weights(&runtime), runtime.take_counters().skipped_steps)
    });
    out.unwrap().pop().unwrap().expect("the rank did not panic")
}

fn check<I: FusedOps>(what: &str)
where
    I::Device: Default,
{
    let plain = train::<I>(&[0, 2, 3], None, false);
    let poisoned = train::<I>(&[0, 1, 2, 3], Some(1), false);
    assert_eq!(poisoned.1, 1, "{what}: one step skipped");
    assert_eq!(plain.1, 0);
    assert!(
        poisoned.0 == plain.0,
        "{what}: the skipped step changed something"
    );
    let first = train::<I>(&[0, 2, 3], None, true);
    assert!(
        first.0 == plain.0,
        "{what}: the verdict read first gives other weights"
    );
}

#[test]
fn a_non_finite_step_read_at_commit_applies_nothing_on_wgpu() {
    check::<Wgpu>("fused");
    check::<WgpuUnfused>("without fusion");
}
