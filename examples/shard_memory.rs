//! Peak host memory of every rank while `shard` registers a model, under MPI (one process per
//! rank, so each process's resident set is one rank's).
//!
//! ```text
//! cargo build --release --features mpi --example shard_memory
//! mpirun -n 4 target/release/examples/shard_memory --buckets 16 [--bucket-mib 16] [--format f32|bf16|mxfp8] [--eager]
//! mpirun -n 4 target/release/examples/shard_memory --buckets 16 --export model.safetensors
//! mpirun -n 4 target/release/examples/shard_memory --buckets 16 --import model.safetensors
//! ```
//! The model is `--buckets` buckets of `--bucket-mib` MiB (fp32), two lazy parameters per
//! bucket, as Burn's initialisers leave them. Each process resets its peak resident set
//! (`/proc/self/clear_refs`) just before a phase and reads it (`VmHWM`) after; rank 0 prints a
//! Markdown row per rank: the growth of the peak over the resident set before the phase,
//! against what the rank keeps plus two buckets. The phases: `shard` (from the lazy module),
//! then with `--export` the streaming export to a consolidated safetensors file (what it keeps:
//! nothing new); or `--import` alone (`Shard::from_source`: a file written by `--export`, the module
//! never initialised). The program exits non-zero if a rank grew by more than its bound +
//! 10 %. `--eager` initialises the whole module on every rank before `shard`, as every rank
//! had to before `shard` streamed (for comparison; no bound is checked then). Linux only
//! (`/proc`).

use std::process::ExitCode;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::Initializer;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sshsdp::backend::{shard, Hsdp, HsdpConfig, HsdpRuntime, Shard};
use sshsdp::checkpoint::{export_safetensors, SafetensorsSource};
use sshsdp::comm::mpi::{MpiComm, MpiSession};
use sshsdp::comm::Collective;
use sshsdp::plan::{Mesh, RuntimeFormat};

type B = Autodiff<Hsdp<NdArray<f32>>>;

/// Columns of every parameter.
const COLS: usize = 1024;
const MIB: f64 = 1024.0 * 1024.0;

/// A stack of lazily initialised matrices.
#[derive(Module, Debug)]
struct Stack<B: Backend> {
    weights: Vec<Param<Tensor<B, 2>>>,
}

/// The options.
struct Options {
    buckets: usize,
    bucket_mib: usize,
    format: RuntimeFormat,
    eager: bool,
    export: Option<String>,
    import: Option<String>,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        buckets: 4,
        bucket_mib: 16,
        format: RuntimeFormat::F32,
        eager: false,
        export: None,
        import: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} takes a value"));
        match a.as_str() {
            "--buckets" => o.buckets = value()?.parse().map_err(|e| format!("--buckets: {e}"))?,
            "--bucket-mib" => {
                o.bucket_mib = value()?.parse().map_err(|e| format!("--bucket-mib: {e}"))?
            }
            "--format" => {
                o.format = match value()?.as_str() {
                    "f32" => RuntimeFormat::F32,
                    "bf16" => RuntimeFormat::Bf16,
                    "mxfp8" => RuntimeFormat::Mxfp8,
                    f => return Err(format!("--format {f}: f32, bf16 or mxfp8")),
                }
            }
            "--eager" => o.eager = true,
            "--export" => o.export = Some(value()?),
            "--import" => o.import = Some(value()?),
            _ => return Err(format!("unknown argument {a}; see the file's header")),
        }
    }
    if o.buckets == 0 || o.bucket_mib == 0 {
        return Err("--buckets and --bucket-mib must be positive".into());
    }
    Ok(o)
}

/// A `/proc/self/status` field in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(field: &str) -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or(format!("no {field} in /proc/self/status"))
}

/// Initialises every parameter of `module` (the module then holds all its values).
fn initialise_all<M: Module<B>>(module: &M) {
    struct Init;
    impl ModuleVisitor<B> for Init {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Init);
}

/// Peak growth of the resident set while `f` runs: (RSS before, peak − before).
fn measure<T>(f: impl FnOnce() -> Result<T, String>) -> Result<(T, u64, u64), String> {
    let before = status_bytes("VmRSS")?;
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("resetting VmHWM: {e}"))?;
    let out = f()?;
    let peak = status_bytes("VmHWM")?;
    Ok((out, before, peak.saturating_sub(before)))
}

/// One phase on every rank: (RSS before, growth, runtime shard, masters, bound) in bytes.
type Row = [u64; 5];

/// Every rank's row, on rank 0 (an all-gather).
fn gather_rows(report: &MpiComm, row: Row, world: usize) -> Result<Vec<Row>, String> {
    let send: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut recv = vec![0u8; send.len() * world];
    report
        .all_gather(&send, &mut recv)
        .map_err(|e| e.to_string())?;
    Ok(recv
        .chunks(40)
        .map(|r| {
            let mut row = [0u64; 5];
            for (v, b) in row.iter_mut().zip(r.chunks(8)) {
                *v = u64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
            row
        })
        .collect())
}

/// Prints a phase's table (rank 0); whether every rank stayed within its bound + 10 %.
fn print_rows(phase: &str, rows: &[Row]) -> bool {
    println!("\n{phase}:\n");
    println!("| rank | RSS before MiB | peak growth MiB | runtime shard MiB | masters MiB | bound MiB | growth / bound |");
    println!("|---|---|---|---|---|---|---|");
    let mut within = true;
    for (r, v) in rows.iter().enumerate() {
        let ratio = v[1] as f64 / v[4] as f64;
        within &= ratio <= 1.10;
        println!(
            "| {r} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {ratio:.3} |",
            v[0] as f64 / MIB,
            v[1] as f64 / MIB,
            v[2] as f64 / MIB,
            v[3] as f64 / MIB,
            v[4] as f64 / MIB,
        );
    }
    within
}

fn run() -> Result<bool, String> {
    let o = options()?;
    let mpi = MpiSession::init().map_err(|e| e.to_string())?;
    let comm = mpi.world().map_err(|e| e.to_string())?;
    let report = comm.split(0, comm.rank()).map_err(|e| e.to_string())?;
    let (rank, world) = (comm.rank(), comm.size());
    let device = Default::default();
    B::seed(&device, 1);

    let bucket_elems = o.bucket_mib * (1 << 20) / 4;
    let rows = bucket_elems / 2 / COLS;
    let two_buckets = 2 * 4 * bucket_elems as u64;
    let model = || Stack::<B> {
        weights: (0..2 * o.buckets)
            .map(|_| {
                Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                }
                .init([rows, COLS], &device)
            })
            .collect(),
    };
    let config = HsdpConfig::new(Mesh::flat(world).map_err(|e| e.to_string())?)
        .with_bucket_elements(bucket_elems as u64)
        .with_format(o.format);
    let kept = |rt: &HsdpRuntime<NdArray<f32>>| (rt.shard_bytes(), rt.master_bytes());

    let mut phases: Vec<(String, Vec<Row>, bool)> = Vec::new();
    let (runtime, phase) = if let Some(file) = &o.import {
        let source = SafetensorsSource::open(file).map_err(|e| e.to_string())?;
        let ((_model, runtime), before, growth) = measure(|| {
            Shard::new(config)
                .from_source(&source)
                .run::<B, _, _>(model(), comm, &device)
                .map_err(|e| e.to_string())
        })?;
        (
            runtime,
            (
                format!("import of {file} (Shard::from_source)"),
                before,
                growth,
            ),
        )
    } else {
        let ((_model, runtime), before, growth) = measure(|| {
            let model = model();
            if o.eager {
                initialise_all(&model);
            }
            shard::<B, _, _>(model, config, comm, &device).map_err(|e| e.to_string())
        })?;
        let how = if o.eager {
            "module initialised whole first"
        } else {
            "lazy module"
        };
        (runtime, (format!("shard ({how})"), before, growth))
    };
    let (shard_bytes, master_bytes) = kept(&runtime);
    let bound = shard_bytes + master_bytes + two_buckets;
    let row = [phase.1, phase.2, shard_bytes, master_bytes, bound];
    phases.push((phase.0, gather_rows(&report, row, world)?, !o.eager));
    if let Some(file) = &o.export {
        let ((), before, growth) = measure(|| {
            export_safetensors(&runtime, std::path::Path::new(file)).map_err(|e| e.to_string())
        })?;
        // The export keeps nothing: its bound is two buckets.
        let row = [before, growth, shard_bytes, master_bytes, two_buckets];
        phases.push((
            format!("export to {file} (bound: 2 buckets)"),
            gather_rows(&report, row, world)?,
            true,
        ));
    }
    drop(runtime);

    let mut within = true;
    if rank == 0 {
        let model_mib = (2 * o.buckets * rows * COLS * 4) as f64 / MIB;
        println!(
            "{model_mib:.0} MiB model ({} buckets of {} MiB, {:?} runtime) over {world} MPI ranks",
            o.buckets, o.bucket_mib, o.format,
        );
        for (phase, rows, checked) in &phases {
            within &= print_rows(phase, rows) || !checked;
        }
        println!("\nbound = runtime shard + masters + 2 buckets (fp32); growth = peak RSS during the phase - RSS before");
    }
    let mut verdict = [u8::from(!within)];
    report
        .broadcast(&mut verdict, 0)
        .map_err(|e| e.to_string())?;
    Ok(verdict[0] == 0)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("a rank's peak memory exceeded its bound + 10 %");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("shard_memory: {e}");
            ExitCode::FAILURE
        }
    }
}
