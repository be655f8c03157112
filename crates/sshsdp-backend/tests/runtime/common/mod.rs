//! What every test of this binary shares: the backends, in-process worlds of ranks on the
//! threads engine, the few-line SGD every step runs through [`HsdpRuntime::update`], small
//! burn-nn models with their data, plain Burn's gradients for the reference step, the runtime
//! formats' rounding (from `sshsdp_mx` and `half`), and this rank's fp32 masters by parameter.

pub mod models;

use std::ops::Range;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use half::bf16;
use sshsdp_backend::{named_params, shard, Hsdp, HsdpConfig, HsdpError, HsdpRuntime, NamedParam};
use sshsdp_comm::threads::{ThreadComm, ThreadsConfig, ThreadsWorld};
use sshsdp_mx::{decode_square, encode_square, ElemFormat, MxShape, ScaleRule};
use sshsdp_plan::{Mesh, Plan, RuntimeFormat, Sharding};

/// The decorated backend.
pub type Inner = NdArray<f32>;
/// The sharded model's backend.
pub type B = Autodiff<Hsdp<Inner>>;
/// The unsharded reference: the same backend, never sharded, so every op runs on NdArray's
/// own kernels and parameters are ordinary tensors. (Plain `Autodiff<NdArray>` is not an
/// autodiff backend in this build: the crate turns on Burn's `distributed` feature, under which
/// `Autodiff<B>` needs `B: DistributedBackend`, which NdArray is not.)
pub type P = B;
/// One rank's runtime.
pub type Runtime = HsdpRuntime<Inner>;

/// The threads engine's timeout in tests that expect no failure: a hang fails the test with a
/// timeout error instead of blocking it.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Fail points are process-global: a test that configures one holds [`exclusive`] so that no
/// other test's ranks meet it; every other world holds [`shared`] while it runs.
static FAIL_POINTS: RwLock<()> = RwLock::new(());

/// Held by every world that configures no fail point.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    FAIL_POINTS.read().unwrap_or_else(|p| p.into_inner())
}

/// Held by a test that configures fail points, for as long as they are configured.
pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    FAIL_POINTS.write().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on `world` ranks (threads) with the engine `timeout`; each rank's result in rank
/// order. A rank's panic fails the test (naming the rank).
pub fn run_world<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ThreadComm) -> T + Sync,
) -> Vec<T> {
    ThreadsWorld::run(world, ThreadsConfig { timeout }, f)
        .expect("a threads world")
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|_| panic!("rank {rank} panicked")))
        .collect()
}

/// [`run_world`] with [`TIMEOUT`], shut out from the fail points ([`shared`]).
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
    let _guard = shared();
    run_world(world, TIMEOUT, f)
}

/// A flat mesh of `world` ranks.
pub fn flat(world: usize) -> Mesh {
    Mesh::flat(world).unwrap()
}

/// A config over `mesh` with `sharding` and small buckets (several buckets, parameters split
/// across pieces).
pub fn config(mesh: Mesh, sharding: Sharding, format: RuntimeFormat) -> HsdpConfig {
    HsdpConfig::new(mesh)
        .with_sharding(sharding)
        .with_format(format)
        .with_bucket_elements(700)
}

/// `init` sharded on this rank.
pub fn shard_on<M: Module<B>>(init: &M, config: HsdpConfig, comm: ThreadComm) -> (M, Runtime) {
    shard::<B, _, _>(init.clone(), config, comm, &Default::default()).expect("shard")
}

/// The few-line SGD: every master element of this rank's pieces moves by `-lr` times its
/// world-averaged gradient.
pub fn sgd(runtime: &Runtime, lr: f32) -> Result<(), HsdpError> {
    runtime.update(|_bucket, master, grad| {
        for (m, g) in master.iter_mut().zip(grad) {
            *m -= lr * g;
        }
        Ok(())
    })
}

/// Every parameter's gathered values, in plan order (the module's order).
pub fn gathered(runtime: &Runtime) -> Vec<NamedParam> {
    runtime
        .plan()
        .params()
        .iter()
        .map(|p| NamedParam {
            path: p.spec.path.clone(),
            shape: p.spec.shape.clone(),
            values: runtime.param_values(&p.spec.path).expect("param_values"),
        })
        .collect()
}

/// What one plain-Burn SGD step on `model` with `loss`'s gradient gives.
pub struct PlainStep {
    /// The loss.
    pub loss: f32,
    /// Each parameter after the step (unchanged where it got no gradient), module order.
    pub after: Vec<NamedParam>,
    /// Each parameter's gradient (`None`: none), module order.
    pub grads: Vec<Option<Vec<f32>>>,
}

impl PlainStep {
    /// The gradient of the parameter at `path` (`None`: it got none).
    pub fn grad(&self, path: &str) -> Option<&[f32]> {
        let i = self
            .after
            .iter()
            .position(|p| p.path == path)
            .expect("a parameter");
        self.grads[i].as_deref()
    }

    /// The L2 norm of the gradient, summed in f64.
    pub fn grad_norm(&self) -> f64 {
        self.grads
            .iter()
            .flatten()
            .flatten()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt()
    }
}

/// One SGD step of plain Burn: backward of `loss` on `model`, then `w - lr * g` per element.
pub fn plain_sgd<M: Module<P>>(model: &M, loss: Tensor<P, 1>, lr: f32) -> PlainStep {
    struct Grads<'a> {
        grads: &'a <P as AutodiffBackend>::Gradients,
        out: Vec<Option<Vec<f32>>>,
    }
    impl ModuleVisitor<P> for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<P, D>>) {
            let grad = param.val().grad(self.grads);
            self.out
                .push(grad.map(|g| g.into_data().convert::<f32>().to_vec().unwrap()));
        }
    }
    let value = loss.clone().into_scalar();
    let grads = loss.backward();
    let mut visitor = Grads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut visitor);
    let before = named_params(model).unwrap();
    assert_eq!(before.len(), visitor.out.len());
    let after = before
        .into_iter()
        .zip(&visitor.out)
        .map(|(mut p, g)| {
            if let Some(g) = g {
                p.values.iter_mut().zip(g).for_each(|(w, g)| *w -= lr * g);
            }
            p
        })
        .collect();
    PlainStep {
        loss: value,
        after,
        grads: visitor.out,
    }
}

/// Asserts that `got` equals `want` parameter by parameter (matched by path), each element
/// within `rel` times the parameter's largest magnitude in `want`, plus `abs`; `rel = abs = 0`
/// asks for bitwise equality.
pub fn assert_params(what: &str, got: &[NamedParam], want: &[NamedParam], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for g in got {
        let w = by_path(want, &g.path);
        assert_eq!(g.shape, w.shape, "{what}: {}", g.path);
        assert_eq!(g.values.len(), w.values.len(), "{what}: {}", g.path);
        let scale = w.values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tolerance = rel * scale + abs;
        for (i, (a, b)) in g.values.iter().zip(&w.values).enumerate() {
            let ok = if rel == 0.0 && abs == 0.0 {
                a.to_bits() == b.to_bits()
            } else {
                (a - b).abs() <= tolerance
            };
            assert!(
                ok,
                "{what}: {}[{i}] = {a}, expected {b} (tolerance {tolerance})",
                g.path
            );
        }
    }
}

/// The largest element-wise difference between two parameter lists (matched by path).
pub fn max_diff(a: &[NamedParam], b: &[NamedParam]) -> f32 {
    a.iter()
        .flat_map(|x| {
            let y = by_path(b, &x.path);
            x.values.iter().zip(&y.values).map(|(u, v)| (u - v).abs())
        })
        .fold(0.0, f32::max)
}

/// The parameter at `path`.
pub fn by_path<'a>(params: &'a [NamedParam], path: &str) -> &'a NamedParam {
    params
        .iter()
        .find(|p| p.path == path)
        .unwrap_or_else(|| panic!("no parameter {path}"))
}

/// `v` rounded to bf16 (round to nearest even) and widened back.
pub fn bf16_round(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Parameter `index` of `plan` with fp32 `values` as its runtime format holds it: exact (f32),
/// rounded to bf16 (bf16 and MXFP8 fallbacks), or square-block MXFP8 (E4M3 elements, one
/// RCEIL E8M0 scale per 32×32 tile of the whole matrix) decoded, by `sshsdp_mx`.
pub fn encoded(plan: &Plan, index: usize, values: &[f32]) -> Vec<f32> {
    let p = &plan.params()[index];
    match p.format {
        RuntimeFormat::F32 => values.to_vec(),
        RuntimeFormat::Bf16 => values.iter().map(|&v| bf16_round(v)).collect(),
        RuntimeFormat::Mxfp8 => {
            let (rows, cols) = p.spec.matrix_dims();
            let shape = MxShape::new(rows as usize, cols as usize);
            let mut data = vec![0u8; shape.square_data_bytes()];
            let mut scales = vec![0u8; shape.square_scale_bytes()];
            let fmt = ElemFormat::E4M3;
            encode_square(
                values,
                shape.cols,
                shape,
                fmt,
                ScaleRule::Rceil,
                &mut data,
                &mut scales,
            )
            .unwrap();
            let mut out = vec![0f32; values.len()];
            decode_square(&data, &scales, shape, fmt, &mut out, shape.cols).unwrap();
            out
        }
    }
}

/// `params` (plan order) as `plan`'s runtime formats hold them ([`encoded`]).
pub fn encoded_all(plan: &Plan, params: &[NamedParam]) -> Vec<NamedParam> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            assert_eq!(plan.params()[i].spec.path, p.path);
            NamedParam {
                values: encoded(plan, i, &p.values),
                ..p.clone()
            }
        })
        .collect()
}

/// One master element this rank holds: (parameter index, element index, value).
pub type Master = (usize, usize, f32);

/// This rank's fp32 masters, read through `master_pieces` (a collective call) and placed by
/// the plan's update views of this rank's piece.
pub fn masters(runtime: &Runtime) -> Vec<Master> {
    let plan = runtime.plan();
    let piece = plan.piece_of(runtime.rank()).unwrap();
    let mut out = Vec::new();
    runtime
        .master_pieces(|pieces, _| {
            for p in pieces.iter_mut() {
                let elements = plan.buckets()[p.bucket].piece_elements as usize;
                assert_eq!(p.start, piece * elements, "bucket {}", p.bucket);
                assert_eq!(p.len(), elements, "bucket {}", p.bucket);
                let views = plan.piece_views(p.bucket, piece)?;
                let (master, grad) = p.host()?;
                assert!(grad.is_empty(), "masters only");
                for v in views {
                    for (run, at) in v.runs() {
                        let at = at as usize;
                        for (k, e) in run.enumerate() {
                            out.push((v.param, e as usize, master[at + k]));
                        }
                    }
                }
            }
            Ok(())
        })
        .expect("master_pieces");
    out
}

/// Every parameter's fp32 masters (plan order) put together from the ranks' `masters`: every
/// element must be held by some rank, and ranks holding the same element (replicas) agree.
pub fn full_masters(plan: &Plan, ranks: &[Vec<Master>]) -> Vec<NamedParam> {
    let mut out: Vec<(NamedParam, Vec<bool>)> = plan
        .params()
        .iter()
        .map(|p| {
            let n = p.spec.numel() as usize;
            let param = NamedParam {
                path: p.spec.path.clone(),
                shape: p.spec.shape.clone(),
                values: vec![0.0; n],
            };
            (param, vec![false; n])
        })
        .collect();
    for (rank, masters) in ranks.iter().enumerate() {
        for &(param, e, v) in masters {
            let (p, seen) = &mut out[param];
            if seen[e] {
                assert_eq!(
                    p.values[e].to_bits(),
                    v.to_bits(),
                    "rank {rank}: {}[{e}]",
                    p.path
                );
            }
            p.values[e] = v;
            seen[e] = true;
        }
    }
    out.into_iter()
        .map(|(p, seen)| {
            assert!(
                seen.iter().all(|&s| s),
                "{}: every element has a master",
                p.path
            );
            p
        })
        .collect()
}

/// `rows` of `step`'s global batch on this rank of `world` ranks splitting `global` rows.
pub fn my_rows(rank: usize, world: usize, global: usize) -> Range<usize> {
    let local = global / world;
    rank * local..(rank + 1) * local
}
