//! `Hsdp` over burn-fusion: `Autodiff<Hsdp<Wgpu>>` with Burn's default `Wgpu` (fusion and
//! autotune on) against the same jobs without fusion and against plain Burn on the same fused
//! type (a fused run's checkpoint resuming without fusion and on NdArray: `storage.rs`).
//!
//! Tolerances. Fusion changes which kernels run, not the arithmetic of each value: its
//! element-wise kernels keep f32 intermediates in registers (the same roundings as f32 buffers),
//! but its reductions and fused matmul epilogues may sum in another order, and plain Burn averages
//! the global batch in one reduction where two ranks reduce halves. So f32 losses agree within
//! 1e-5 relative (the bound the NdArray comparisons use), and bf16 and MXFP8 within 2e-3: one ulp
//! in a master can move a value across a rounding boundary of the runtime format. Weights are
//! compared by their relative L2 distance over all parameters: AdamW divides by the square root
//! of the second moment, so a parameter whose gradient is nearly zero can move by up to the
//! learning rate on a last-bit difference; the bound (1e-4 in f32, 5e-3 in the 16-bit and 8-bit
//! formats) is far below a training step's own change (about 1e-2 relative).

use std::collections::BTreeMap;
use std::time::Duration;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamWConfig;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use sshsdp::backend::{init_seeded, shard, ConcurrentDrawer, HsdpConfig, Placement};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::models::Gpt;
use sshsdp::optim::ShardedOptimizer;
use sshsdp::plan::{Mesh, RuntimeFormat};

use crate::harness::*;
use sshsdp::optim::ShardedStep;

/// The loss and weight tolerances of a format (see the module's documentation).
fn tolerances(format: RuntimeFormat) -> (f32, f64) {
    match format {
        RuntimeFormat::F32 => (1e-5, 1e-4),
        _ => (2e-3, 5e-3),
    }
}

/// Asserts `a`'s losses within `tolerance` (relative) of `b`'s.
fn assert_losses_close(a: &[f32], b: &[f32], tolerance: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tolerance * y.abs(),
            "{what} step {step}: {x} vs {y} ({a:?} vs {b:?})"
        );
    }
}

/// World 1, 2 and a 2×2 mesh, every runtime format, host and device storage (device runtime
/// shards too): each pair of mesh × format and of format × storage appears.
fn cases() -> Vec<Case> {
    use Placement::{Device, Host};
    use RuntimeFormat::{Bf16, Mxfp8, F32};
    let (one, flat, hsdp) = ((1, 1), (1, 2), (2, 2));
    [
        (one, F32, Host, None),
        (one, Mxfp8, Device, Some(Device)),
        (flat, Bf16, Device, None),
        (flat, F32, Device, Some(Device)),
        (flat, Mxfp8, Host, None),
        (hsdp, Mxfp8, Device, None),
        (hsdp, Bf16, Host, None),
        (hsdp, F32, Device, None),
    ]
    .into_iter()
    .map(|(mesh, format, storage, shards)| Case {
        mesh,
        reshard: mesh == hsdp,
        placement: (storage, storage),
        shards,
        ..Case::new(format)
    })
    .collect()
}

#[test]
fn fused_wgpu_trains_like_wgpu_without_fusion() {
    for case in cases() {
        let none = Checkpoints::default();
        let fused = run::<Wgpu>(case, 0..STEPS, none, Default::default());
        let unfused = run::<WgpuUnfused>(case, 0..STEPS, none, Default::default());
        let (losses, weights) = tolerances(case.format);
        let what = format!("{case:?}");
        assert_losses_close(&fused.losses, &unfused.losses, losses, &what);
        let distance = relative_distance(&fused.weights_by_path(), &unfused.weights_by_path());
        eprintln!(
            "{what}\n  fused {:?}\n  unfused {:?}\n  weights {distance:.2e}",
            fused.losses, unfused.losses
        );
        assert!(distance <= weights, "{what}: weights {distance:e} apart");
        assert!(
            fused.losses[STEPS - 1] < fused.losses[0],
            "{what}: {fused:?}"
        );
        // The same bytes move and the same bytes are held: fusion changes no counter.
        assert_eq!(fused.traffic, unfused.traffic, "{what}");
        assert_eq!(fused.master_bytes, unfused.master_bytes, "{what}");
        assert_eq!(fused.shards, unfused.shards, "{what}");
        assert_eq!(fused.gathered, unfused.gathered, "{what}");
    }
}

/// In f32 the decorator adds no rounding: sharded training on the fused type follows plain
/// Burn on the same type (unsharded, the global batch, Burn's AdamW) at every mesh, with host
/// and device storage.
#[test]
fn fused_wgpu_in_f32_trains_like_plain_burn_on_the_same_type() {
    let (plain_losses, plain_weights) = plain_burn::<Wgpu>(STEPS, Default::default());
    for case in cases()
        .into_iter()
        .filter(|c| c.format == RuntimeFormat::F32)
    {
        let sharded = run::<Wgpu>(case, 0..STEPS, Checkpoints::default(), Default::default());
        let what = format!("{case:?}");
        let (losses, weights) = tolerances(case.format);
        assert_losses_close(&sharded.losses, &plain_losses, losses, &what);
        let distance = relative_distance(&sharded.weights_by_path(), &plain_weights);
        eprintln!("{what}: weights {distance:.2e} from plain Burn");
        assert!(
            distance <= weights,
            "{what}: weights {distance:e} from plain Burn"
        );
    }
}

/// Collects every float parameter's current value, times one: a fused operation queued on the
/// parameter's view (without autodiff), not run until read.
struct Probe<B: AutodiffBackend>(Vec<Tensor<B::InnerBackend, 1>>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Probe<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0
            .push(param.val().inner().mul_scalar(1.0).reshape([-1]));
    }
}

type A = Autodiff<sshsdp::backend::Hsdp<Wgpu>>;

/// A registered view's buffer is never rewritten: operations queued on parameter views before
/// an update read the values before it, and the parameters read after it have moved.
#[test]
fn parameter_views_queued_before_an_update_read_the_values_before_it() {
    for (format, storage) in [
        (RuntimeFormat::F32, Placement::Device),
        (RuntimeFormat::Mxfp8, Placement::Device),
        (RuntimeFormat::Bf16, Placement::Host),
    ] {
        let config = ThreadsConfig {
            timeout: Duration::from_secs(300),
        };
        ThreadsWorld::run(1, config, |comm| {
            let device = Default::default();
            let record = initial_record();
            let model: Gpt<A> = crate::common::loaded(&device, record, |d| CONFIG.init(d));
            let mut config = HsdpConfig::new(Mesh::new(1, 1).unwrap())
                .with_format(format)
                .with_master_placement(storage)
                .with_grad_placement(storage);
            if storage == Placement::Device {
                config = config.with_shard_placement(storage);
            }
            let (mut model, runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
            let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device.clone());
            for step in 0..2 {
                let tokens = crate::common::tokens::<A>(&CONFIG, step, 0, GLOBAL, &device);
                let _ = model.loss(tokens).backward();
                let before = read_weights(&model);
                let mut probe = Probe::<A>(Vec::new());
                model.visit(&mut probe);
                model = optim.step(1e-2, model, &runtime).unwrap();
                let after = read_weights(&model);
                assert_ne!(before, after, "{format:?}: the update moved the weights");
                // Module order, as `named_params` walks it.
                assert_eq!(before.len(), probe.0.len());
                let paths = sshsdp::backend::named_params(&model).unwrap();
                for (param, queued) in paths.iter().zip(probe.0) {
                    let values: TensorData = queued.into_data();
                    let values = values.convert::<f32>().into_vec::<f32>().unwrap();
                    assert_eq!(values, before[&param.path], "{format:?} {}", param.path);
                }
            }
        })
        .unwrap()
        .into_iter()
        .for_each(|r| r.expect("rank panicked"));
    }
}

/// burn-fusion queues draws and runs them when its stream runs, possibly after the RNG lock is
/// released: `init_seeded` runs them under it, so a fused model's seeded initial weights do not
/// move while another thread seeds and draws (two fused runs of one seed once started from
/// different weights when the example's tests ran side by side).
#[test]
fn seeded_initial_weights_on_fused_wgpu_do_not_move_while_another_thread_draws() {
    let weights = |seed| {
        let device = Default::default();
        let model: Gpt<Autodiff<Wgpu>> = init_seeded(&device, seed, |d| CONFIG.init(d));
        read_weights(&model)
    };
    let expected = weights(5);
    let drawer = ConcurrentDrawer::start::<Wgpu>();
    let first = drawer.draws();
    let mut checks = 0;
    while checks < 10 || (drawer.draws() < first + 10 && checks < 1000) {
        assert!(weights(5) == expected, "check {checks}: the weights moved");
        checks += 1;
    }
    assert!(drawer.draws() >= first + 10, "the drawer ran alongside");
}

/// Every parameter's values by path.
fn read_weights<B: burn::tensor::backend::Backend>(model: &Gpt<B>) -> BTreeMap<String, Vec<f32>> {
    let named = sshsdp::backend::named_params(model).unwrap();
    named.into_iter().map(|p| (p.path, p.values)).collect()
}
