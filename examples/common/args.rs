//! Command-line options shared by the training examples.

use std::path::PathBuf;

use sshsdp::backend::{MixedPrecision, Placement, Precision};
use sshsdp::optim::MuonExchange;
use sshsdp::plan::{Mesh, RuntimeFormat};

/// Which optimizer steps the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimKind {
    /// Distributed Muon on hidden matrices, AdamW on embeddings, norms, biases and heads.
    Muon,
    /// AdamW on everything.
    AdamW,
}

/// Options every training example accepts (see [`COMMON_USAGE`]).
#[derive(Clone, Debug)]
pub struct Args {
    /// `--ranks N`: world size on the threads engine.
    pub ranks: Option<usize>,
    /// `--mesh RxS`: replicas × shards.
    pub mesh: Option<Mesh>,
    /// `--steps N`: optimizer steps in this invocation.
    pub steps: usize,
    /// `--optim muon|adamw`.
    pub optim: OptimKind,
    /// `--muon-exchange owner|all-reduce`: how Muon's split matrices travel.
    pub muon_exchange: MuonExchange,
    /// `--format bf16|f32|mxfp8`: runtime parameter format.
    pub format: RuntimeFormat,
    /// `--clip MAX_NORM` (`--clip 0` turns clipping off).
    pub clip: Option<f64>,
    /// `--lr LR`: peak learning rate (both optimizers).
    pub lr: f64,
    /// `--warmup N`: linear warm-up steps.
    pub warmup: usize,
    /// `--eval-every N`: steps between held-out evaluations (0: only at the end).
    pub eval_every: usize,
    /// `--out DIR`: where metrics, plot and samples go.
    pub out: PathBuf,
    /// `--save DIR`: write a sharded checkpoint at the end.
    pub save: Option<PathBuf>,
    /// `--resume DIR`: continue from a checkpoint (any world size or mesh).
    pub resume: Option<PathBuf>,
    /// `--init-from FILE`: initial weights from a safetensors file (each rank reads its shard).
    pub init_from: Option<PathBuf>,
    /// `--export FILE`: write the trained weights as one safetensors file at the end.
    pub export: Option<PathBuf>,
    /// `--seed N`: initial weights and data order.
    pub seed: u64,
    /// `--trace FILE`: write a Chrome trace of every rank's communication timeline.
    pub trace: Option<PathBuf>,
    /// `--backend flex|wgpu`: what the ranks compute on.
    pub backend: BackendKind,
    /// `--storage host|device`: where fp32 masters, optimizer state and gradient buckets live
    /// (default: the device on GPU backends, the host on burn-flex).
    pub storage: Placement,
    /// `--compute f32|bf16|f16` and `--reduce f32|bf16`: the mixed-precision policy.
    pub precision: MixedPrecision,
    /// `--nccl`: the runtime's collectives on NCCL lanes, bootstrapped over the launch engine.
    pub nccl: bool,
    /// `--unsharded`: the same job on plain Burn, one rank, nothing sharded (the baseline).
    pub unsharded: bool,
    /// `--no-fusion`: wgpu and CUDA without burn-fusion (`CubeBackend`), autotune still on.
    pub no_fusion: bool,
    /// `--staged`: collectives through host memory even where the engine can move the device's
    /// memory (the comparison path).
    pub staged: bool,
}

/// Parses a `--compute`/`--reduce` dtype.
fn parse_precision(flag: &str, value: &str) -> Result<Precision, String> {
    match value {
        "f32" => Ok(Precision::F32),
        "bf16" => Ok(Precision::Bf16),
        "f16" if flag == "--compute" => Ok(Precision::F16),
        v => Err(format!(
            "{flag} is f32 or bf16{}, not `{v}`",
            if flag == "--compute" { " or f16" } else { "" }
        )),
    }
}

/// The backend of a run (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// burn-flex on the CPU ([`super::Flex`]).
    Flex,
    /// CubeCL's wgpu runtime (feature `wgpu`).
    Wgpu,
    /// CubeCL's CUDA runtime (feature `cuda`).
    Cuda,
}

impl BackendKind {
    /// The `--backend` value naming it.
    pub fn flag(self) -> &'static str {
        match self {
            BackendKind::Flex => "flex",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }

    /// One line for the summary (`fusion`: whether a GPU backend runs burn-fusion).
    pub fn describe(self, fusion: bool) -> &'static str {
        match (self, fusion) {
            (BackendKind::Flex, _) => "burn-flex (CPU, SIMD)",
            (BackendKind::Wgpu, true) => {
                "wgpu (Burn's default: fusion, autotune; lavapipe when there is no GPU)"
            }
            (BackendKind::Wgpu, false) => "wgpu (CubeCL without fusion, autotune on)",
            (BackendKind::Cuda, true) => "cuda (Burn's default: fusion, autotune)",
            (BackendKind::Cuda, false) => "cuda (CubeCL without fusion, autotune on)",
        }
    }
}

/// Per-example defaults of [`Args`].
pub struct Defaults {
    /// Optimizer steps.
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Steps between evaluations.
    pub eval_every: usize,
    /// Output directory.
    pub out: &'static str,
}

/// Help text of the options in [`Args`].
pub const COMMON_USAGE: &str = "\
Engine and sharding:
  --ranks N            in-process ranks (threads engine; default 2)
  --mesh RxS           R replicas x S shards (hierarchical: runtime shards over S, update
                       shards over all R*S ranks)
  Under mpirun (built with --features mpi) every process is one rank and the world size is
  mpirun's -n; --mesh may still split it into replicas x shards.
Optimization:
  --steps N            optimizer steps in this run
  --optim muon|adamw   muon: distributed Muon on hidden matrices + AdamW on the rest (default)
  --muon-exchange owner|all-reduce
                       how Muon's matrices cut by a piece boundary reach their Newton-Schulz
                       owner and back: an all-to-all-v of the holders' rows (default) or two
                       all-reduces of the whole matrices (the same update, bit for bit)
  --lr LR              peak learning rate of both optimizers (linear warm-up, cosine decay to 10%)
  --warmup N           warm-up steps
  --clip MAX_NORM      global gradient-norm clipping (default 1; 0 turns it off)
  --format FORMAT      runtime parameters: bf16 (default), f32 or mxfp8
  --seed N             initial weights and data order (default 0)
Backend:
  --backend flex|wgpu|cuda  flex: burn-flex on the CPU (default); wgpu: CubeCL's wgpu runtime
                       on the default adapter, each rank on it (build with --features wgpu; on
                       a machine without a GPU it runs on Mesa's lavapipe, slowly); cuda:
                       CubeCL's CUDA runtime, every in-process rank on GPU 0 (--features cuda;
                       in-process ranks sharing a device exchange its buffers directly, on
                       wgpu and cuda alike; --nccl for NCCL, one GPU per rank)
  --staged             collectives through host memory even where ranks share a device or
                       NCCL moves device memory (the comparison path)
  --no-fusion          wgpu and cuda without burn-fusion (CubeCL's CubeBackend; autotune on):
                       Burn's default GPU types (fusion and autotune on) otherwise
  --storage host|device  where fp32 masters, optimizer state and gradient buckets live
                       (default: device on wgpu and cuda, host on flex)
  --compute f32|bf16|f16  dtype parameters and activations compute in (default f32; fp32
                       masters either way; bf16 on flex and cuda, f16 where bf16 is missing)
  --reduce f32|bf16    dtype gradients are reduced in (default f32)
  --nccl               the runtime's collectives (gathers, reductions, rebuilds, Muon's
                       exchanges) over NCCL, one communicator per lane, bootstrapped over the
                       threads engine or MPI (--features nccl; one GPU per rank, the rank's
                       node-local index; host buffers staged through the GPU for now)
  --unsharded          the baseline: the same model, data and AdamW on plain Burn, one rank,
                       nothing sharded, f32, no clipping (--optim adamw); prints losses and
                       tokens/s to compare a sharded run's step time with
Output:
  --out DIR            metrics.csv, loss.svg, loss.png and samples (default runs/<example>/)
  --eval-every N       steps between held-out evaluations (0: at the end only)
  --save DIR           write a sharded checkpoint at the end
  --resume DIR         continue from a checkpoint written at any world size or mesh
  --init-from FILE     initial weights from a safetensors file (e.g. an --export; names are
                       module paths, shapes Burn's); each rank reads only its shard
  --export FILE        write the trained weights as one safetensors file (streamed bucket by
                       bucket through rank 0; plain Burn's SafetensorsStore loads it)
  --trace FILE         Chrome-trace JSON of every collective and every wait on one (open it in
                       Perfetto); under mpirun rank r > 0 writes FILE.rank<r>
  -h, --help           this help";

/// Parses a value of option `flag`.
pub fn parse_num<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e| format!("{flag}: `{value}` is not valid ({e})"))
}

/// Parses the command line: the options of [`Args`], and the example's own through `extra`
/// (called with each unknown flag and a function that takes its value; it returns `Ok(false)`
/// for flags it does not know). `Ok(None)` means `--help` was asked for.
pub fn parse_args(
    args: impl IntoIterator<Item = String>,
    defaults: &Defaults,
    mut extra: impl FnMut(&str, &mut dyn FnMut() -> Result<String, String>) -> Result<bool, String>,
) -> Result<Option<Args>, String> {
    let mut out = Args {
        ranks: None,
        mesh: None,
        steps: defaults.steps,
        optim: OptimKind::Muon,
        muon_exchange: MuonExchange::OwnerAllToAll,
        format: RuntimeFormat::Bf16,
        clip: Some(1.0),
        lr: defaults.lr,
        warmup: defaults.warmup,
        eval_every: defaults.eval_every,
        out: PathBuf::from(defaults.out),
        save: None,
        resume: None,
        init_from: None,
        export: None,
        seed: 0,
        trace: None,
        backend: BackendKind::Flex,
        storage: Placement::Host,
        precision: MixedPrecision::default(),
        nccl: false,
        unsharded: false,
        no_fusion: false,
        staged: false,
    };
    let mut storage = None;
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--ranks" => {
                let n: usize = parse_num(&flag, &value()?)?;
                if n == 0 {
                    return Err("--ranks must be at least 1".into());
                }
                out.ranks = Some(n);
            }
            "--mesh" => {
                let v = value()?;
                let (r, s) = v
                    .split_once('x')
                    .ok_or_else(|| format!("--mesh is REPLICASxSHARDS (e.g. 2x2), not `{v}`"))?;
                let mesh = Mesh::new(parse_num("--mesh", r)?, parse_num("--mesh", s)?)
                    .map_err(|e| format!("--mesh {v}: {e}"))?;
                out.mesh = Some(mesh);
            }
            "--steps" => {
                out.steps = parse_num(&flag, &value()?)?;
                if out.steps == 0 {
                    return Err("--steps must be at least 1".into());
                }
            }
            "--optim" => {
                out.optim = match value()?.as_str() {
                    "muon" => OptimKind::Muon,
                    "adamw" => OptimKind::AdamW,
                    o => return Err(format!("--optim is muon or adamw, not `{o}`")),
                }
            }
            "--format" => {
                out.format = match value()?.as_str() {
                    "bf16" => RuntimeFormat::Bf16,
                    "f32" => RuntimeFormat::F32,
                    "mxfp8" => RuntimeFormat::Mxfp8,
                    f => return Err(format!("--format is bf16, f32 or mxfp8, not `{f}`")),
                }
            }
            "--muon-exchange" => {
                out.muon_exchange = match value()?.as_str() {
                    "owner" => MuonExchange::OwnerAllToAll,
                    "all-reduce" => MuonExchange::AllReduce,
                    e => return Err(format!("--muon-exchange is owner or all-reduce, not `{e}`")),
                }
            }
            "--clip" => {
                let c: f64 = parse_num(&flag, &value()?)?;
                if !(c >= 0.0 && c.is_finite()) {
                    return Err(format!("--clip must be a finite norm >= 0, not {c}"));
                }
                out.clip = (c > 0.0).then_some(c);
            }
            "--lr" => {
                out.lr = parse_num(&flag, &value()?)?;
                if !(out.lr > 0.0 && out.lr.is_finite()) {
                    return Err(format!("--lr must be positive, not {}", out.lr));
                }
            }
            "--warmup" => out.warmup = parse_num(&flag, &value()?)?,
            "--eval-every" => out.eval_every = parse_num(&flag, &value()?)?,
            "--seed" => out.seed = parse_num(&flag, &value()?)?,
            "--out" => out.out = PathBuf::from(value()?),
            "--save" => out.save = Some(PathBuf::from(value()?)),
            "--resume" => out.resume = Some(PathBuf::from(value()?)),
            "--init-from" => out.init_from = Some(PathBuf::from(value()?)),
            "--export" => out.export = Some(PathBuf::from(value()?)),
            "--trace" => out.trace = Some(PathBuf::from(value()?)),
            "--backend" => {
                out.backend = match value()?.as_str() {
                    "flex" => BackendKind::Flex,
                    "wgpu" if cfg!(feature = "wgpu") => BackendKind::Wgpu,
                    "wgpu" => {
                        return Err("--backend wgpu needs the `wgpu` feature: cargo run \
                                    --release --features wgpu --example <name> -- --backend wgpu"
                            .into())
                    }
                    "cuda" if cfg!(feature = "cuda") => BackendKind::Cuda,
                    "cuda" => {
                        return Err("--backend cuda needs the `cuda` feature: cargo build \
                                    --release --features cuda --example <name>"
                            .into())
                    }
                    b => return Err(format!("--backend is flex, wgpu or cuda, not `{b}`")),
                }
            }
            "--storage" => {
                storage = Some(match value()?.as_str() {
                    "host" => Placement::Host,
                    "device" => Placement::Device,
                    s => return Err(format!("--storage is host or device, not `{s}`")),
                })
            }
            "--nccl" if cfg!(feature = "nccl") => out.nccl = true,
            "--nccl" => {
                return Err(
                    "--nccl needs the `nccl` feature: cargo build --release --features \
                            cuda,nccl --example <name>"
                        .into(),
                )
            }
            "--unsharded" => out.unsharded = true,
            "--no-fusion" => out.no_fusion = true,
            "--staged" => out.staged = true,
            "--compute" => out.precision.compute = parse_precision(&flag, &value()?)?,
            "--reduce" => out.precision.reduce = parse_precision(&flag, &value()?)?,
            other => {
                if !extra(other, &mut value)? {
                    return Err(format!("unknown option `{other}` (see --help)"));
                }
            }
        }
    }
    out.storage = storage.unwrap_or(match out.backend {
        BackendKind::Flex => Placement::Host,
        BackendKind::Wgpu | BackendKind::Cuda => Placement::Device,
    });
    if out.unsharded {
        super::check_unsharded_args(&out)?;
    }
    if out.init_from.is_some() && out.resume.is_some() {
        return Err("--init-from and --resume both set the weights: give one".into());
    }
    if let (Some(n), Some(mesh)) = (out.ranks, out.mesh) {
        if n != mesh.world_size() {
            return Err(format!(
                "--ranks {n} and --mesh {mesh} disagree (the mesh has {} ranks)",
                mesh.world_size()
            ));
        }
    }
    Ok(Some(out))
}
