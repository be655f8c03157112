//! The mixed-precision policy (`HsdpConfig::with_mixed_precision`, FSDP2's
//! `MixedPrecisionPolicy`) on burn-flex, which computes in bf16 on the CPU:
//!
//! * parameters are bf16 tensors, equal to the f32 views rounded (bit for bit for bf16 and
//!   MXFP8 runtime parameters, whose values are bf16 values);
//! * a small GPT trains in bf16 like it does in f32 (losses within bf16's rounding), flat and
//!   HSDP, with and without resharding, in every runtime format;
//! * bf16 gradient reduction moves half the bytes and trains like f32 reduction;
//! * f16 compute (for devices without bf16) trains too;
//! * a backend that cannot compute in bf16 (burn-ndarray) is refused by `shard`, naming it, and
//!   so is an f16 gradient reduction.

use crate::common;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_flex::Flex;
use half::bf16;
use sshsdp::backend::{init_seeded, shard, Hsdp, HsdpConfig, MixedPrecision, Precision};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::ShardedStep;
use sshsdp::plan::{Mesh, RuntimeFormat};

type A = Autodiff<Hsdp<Flex>>;

const STEPS: usize = 5;
/// Sequences per step over all ranks.
const GLOBAL: usize = 8;
const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 64,
    layers: 2,
    heads: 2,
    seq: 32,
};

/// The initial weights, drawn once (Burn's RNG is global and the tests run in parallel).
fn initial_record() -> &'static [(Vec<usize>, Vec<f32>)] {
    static RECORD: std::sync::OnceLock<Vec<(Vec<usize>, Vec<f32>)>> = std::sync::OnceLock::new();
    RECORD.get_or_init(|| common::record(&CONFIG, 5))
}

/// Every parameter tensor's dtype and values (as f32), in module order.
struct Views(Vec<(DType, Vec<f32>)>);

impl<B: Backend> ModuleVisitor<B> for Views {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let dtype = tensor.dtype();
        let values = tensor.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        self.0.push((dtype, values));
    }
}

/// One run: its format, mesh, resharding and policy.
#[derive(Clone, Copy, Debug)]
struct Case {
    format: RuntimeFormat,
    /// `(replicas, shards)`.
    mesh: (usize, usize),
    reshard: bool,
    precision: MixedPrecision,
}

impl Case {
    fn new(format: RuntimeFormat, compute: Precision, reduce: Precision) -> Self {
        Case {
            format,
            mesh: (1, 2),
            reshard: false,
            precision: MixedPrecision::new(compute, reduce),
        }
    }
}

/// What a run leaves.
struct Run {
    /// Losses of every rank's batch, averaged, per step.
    losses: Vec<f32>,
    /// Rank 0's parameter tensors before the first step.
    views: Vec<(DType, Vec<f32>)>,
    /// Rank 0's gradient bytes entering reductions in the last step.
    reduced_bytes: u64,
    /// Rank 0's bytes of parameters produced by decoding or casting in the last step (the
    /// whole run when it has no step).
    decoded_bytes: u64,
}

fn run(case: Case, steps: usize) -> Run {
    let record = initial_record();
    let world = case.mesh.0 * case.mesh.1;
    let rows = GLOBAL / world;
    let config = ThreadsConfig {
        timeout: Duration::from_secs(300),
    };
    let ranks = ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let model: Gpt<A> = common::loaded(&device, record, |d| CONFIG.init(d));
        let config = HsdpConfig::new(Mesh::new(case.mesh.0, case.mesh.1).unwrap())
            .with_format(case.format)
            .with_reshard_after_forward(case.reshard)
            .with_mixed_precision(case.precision);
        let (mut model, runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
        let mut views = Views(Vec::new());
        model.visit(&mut views);
        let mut counters = runtime.take_counters();
        let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let mut losses = Vec::new();
        for step in 0..steps {
            let loss = model.loss(common::tokens::<A>(
                &CONFIG,
                step,
                rank * rows,
                rows,
                &device,
            ));
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let _ = loss.backward();
            model = optim.step(1e-2, model, &runtime).unwrap();
            counters = runtime.take_counters();
        }
        (losses, views.0, counters)
    })
    .unwrap();
    let mut ranks: Vec<_> = ranks
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect();
    let losses = (0..steps)
        .map(|s| ranks.iter().map(|r| r.0[s]).sum::<f32>() / world as f32)
        .collect();
    let (_, views, counters) = ranks.swap_remove(0);
    Run {
        losses,
        views,
        reduced_bytes: counters.reduced_bytes,
        decoded_bytes: counters.decoded_bytes,
    }
}

/// Whether bf16 training followed f32 training: every loss within 2 % (bf16 keeps 8
/// significant bits; the masters stay f32, so the runs do not drift apart over 5 steps), and
/// the loss fell.
fn assert_tracks(what: &str, bf16: &[f32], f32: &[f32]) {
    for (s, (a, b)) in bf16.iter().zip(f32).enumerate() {
        assert!(
            a.is_finite() && (a - b).abs() <= 0.02 * b.abs(),
            "{what}: step {s}: {a} in bf16 against {b} in f32 ({bf16:?} vs {f32:?})"
        );
    }
    assert!(bf16[bf16.len() - 1] < bf16[0] - 0.1, "{what}: {bf16:?}");
}

#[test]
fn bf16_compute_parameters_are_the_f32_views_rounded() {
    use Precision::{Bf16, F32};
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        let wide = run(Case::new(format, F32, F32), 0);
        let narrow = run(Case::new(format, Bf16, F32), 0);
        // Visiting the parameters gathered every bucket once. A bf16 bucket computed in bf16 is
        // its own compute buffer: nothing is decoded; the others are decoded into 2-byte values.
        let elements: u64 = narrow.views.iter().map(|(_, v)| v.len() as u64).sum();
        match format {
            RuntimeFormat::Bf16 => assert_eq!(narrow.decoded_bytes, 0),
            _ => assert!(narrow.decoded_bytes >= 2 * elements, "{format:?}"),
        }
        let (wide, narrow) = (wide.views, narrow.views);
        assert_eq!(wide.len(), narrow.len());
        for (p, ((wd, w), (nd, n))) in wide.iter().zip(&narrow).enumerate() {
            assert_eq!(
                (*wd, *nd),
                (DType::F32, DType::BF16),
                "{format:?} param {p}"
            );
            let rounded: Vec<u32> = w
                .iter()
                .map(|&v| bf16::from_f32(v).to_f32().to_bits())
                .collect();
            let bits: Vec<u32> = n.iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, rounded, "{format:?} param {p}");
            if format != RuntimeFormat::F32 {
                // bf16 and MXFP8 values are bf16 values: the bf16 view loses nothing.
                let exact: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits, exact, "{format:?} param {p}");
            }
        }
    }
}

#[test]
fn bf16_compute_trains_like_f32_compute() {
    use Precision::{Bf16, F32};
    let cases = [
        (RuntimeFormat::F32, (1, 2), false),
        (RuntimeFormat::Bf16, (2, 2), true),
        (RuntimeFormat::Mxfp8, (1, 2), true),
        (RuntimeFormat::Mxfp8, (2, 2), false),
    ];
    for (format, mesh, reshard) in cases {
        let case = |compute| Case {
            mesh,
            reshard,
            ..Case::new(format, compute, F32)
        };
        let wide = run(case(F32), STEPS).losses;
        let narrow = run(case(Bf16), STEPS).losses;
        let what = format!("{format:?} mesh {mesh:?} reshard {reshard}");
        assert_tracks(&what, &narrow, &wide);
    }
}

#[test]
fn f16_compute_trains_like_f32_compute() {
    use Precision::{F16, F32};
    let wide = run(Case::new(RuntimeFormat::Mxfp8, F32, F32), STEPS);
    let narrow = run(Case::new(RuntimeFormat::Mxfp8, F16, F32), STEPS);
    assert!(narrow.views.iter().all(|(d, _)| *d == DType::F16));
    assert_tracks("MXFP8 in f16", &narrow.losses, &wide.losses);
}

#[test]
fn bf16_reduction_moves_half_the_bytes_and_trains_alike() {
    use Precision::{Bf16, F32};
    for mesh in [(1, 2), (2, 2)] {
        let case = |reduce| Case {
            mesh,
            ..Case::new(RuntimeFormat::Mxfp8, Bf16, reduce)
        };
        let wide = run(case(F32), STEPS);
        let narrow = run(case(Bf16), STEPS);
        assert_eq!(
            2 * narrow.reduced_bytes,
            wide.reduced_bytes,
            "mesh {mesh:?}"
        );
        assert_tracks(&format!("mesh {mesh:?}"), &narrow.losses, &wide.losses);
    }
}

/// `shard`'s error for `precision` on one rank of `B`.
fn shard_error<B: Backend>(precision: MixedPrecision) -> String
where
    B::Device: Default,
{
    let errors = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
        type H<B> = Autodiff<Hsdp<B>>;
        let device = Default::default();
        let model: Gpt<H<B>> = CONFIG.init(&device);
        let config = HsdpConfig::new(Mesh::new(1, 1).unwrap()).with_mixed_precision(precision);
        shard::<H<B>, _, _>(model, config, comm, &device)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    errors[0].as_ref().unwrap().clone().expect("an error")
}

#[test]
fn policies_a_backend_or_the_network_cannot_run_are_refused_by_shard() {
    use Precision::{Bf16, F16, F32};
    let error = shard_error::<NdArray<f32>>(MixedPrecision::new(Bf16, F32));
    assert!(
        error.contains("ndarray") && error.contains("Bf16"),
        "{error}"
    );
    let error = shard_error::<Flex>(MixedPrecision::new(Bf16, F16));
    assert!(error.contains("reduces gradients in F16"), "{error}");
}

/// A model with float inputs (DiT) casts them to its parameters' dtype and returns its loss in
/// the inputs' dtype: bf16 compute on one rank gives an f32 loss near the f32 one.
#[test]
fn dit_casts_float_inputs_to_the_compute_dtype() {
    use sshsdp::models::{Dit, DitConfig};
    let cfg = DitConfig {
        frames: 2,
        channels: 1,
        height: 8,
        width: 8,
        patch: 4,
        d_model: 16,
        layers: 1,
        heads: 2,
    };
    let losses = |compute| {
        let out = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
            let device = Default::default();
            let model: Dit<A> = init_seeded(&device, 11, |d| cfg.init(d));
            let config = HsdpConfig::new(Mesh::new(1, 1).unwrap())
                .with_mixed_precision(MixedPrecision::new(compute, Precision::F32));
            let (model, _runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
            let shape = [2, cfg.tokens(), cfg.patch_dim()];
            let x0 = Tensor::<A, 3>::ones(shape, &device) * 0.5;
            let noise = Tensor::<A, 3>::ones(shape, &device) * 0.75;
            let t = Tensor::<A, 1>::from_floats([0.2, 0.7], &device);
            assert_eq!(model.compute_dtype(), compute.dtype().into());
            let loss = model.loss(x0, t, noise.clone());
            assert_eq!(loss.dtype(), DType::F32);
            let sample = model.sample(noise, 2);
            assert_eq!(sample.dtype(), DType::F32);
            loss.into_scalar().elem::<f32>()
        })
        .unwrap();
        out.into_iter().next().unwrap().unwrap()
    };
    let (wide, narrow) = (losses(Precision::F32), losses(Precision::Bf16));
    assert!(
        (wide - narrow).abs() <= 0.02 * wide.abs(),
        "{narrow} vs {wide}"
    );
}
