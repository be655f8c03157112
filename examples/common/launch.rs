//! The engine (in-process threads; one process per rank under `mpirun`; or one process per
//! rank under `torchrun`/`srun` without MPI, meeting over NCCL) and the examples' entry point.

use std::process::ExitCode;

use burn::module::Module;
use burn::tensor::backend::Backend;
use sshsdp::backend::{init_seeded, param_shapes};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::plan::Mesh;

use super::*;

/// How the ranks run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Engine {
    /// One thread per rank in this process.
    Threads,
    /// One process per rank, launched by `mpirun`.
    #[cfg(feature = "mpi")]
    Mpi,
    /// One process per rank, launched by `torchrun` or `srun` (no MPI): NCCL over the launch's
    /// TCP rendezvous.
    Nccl(sshsdp::comm::launch::LaunchEnv),
}

/// A `torchrun`/`srun` launch (PyTorch's or Slurm's variables, no MPI), if this is one.
fn nccl_launch() -> Result<Option<sshsdp::comm::launch::LaunchEnv>, String> {
    use sshsdp::comm::launch::{LaunchEnv, Launcher};
    Ok(LaunchEnv::from_env()
        .map_err(|e| format!("reading the launcher's variables: {e}"))?
        .filter(|env| matches!(env.launcher, Launcher::Torchrun | Launcher::Slurm)))
}

/// The world size `mpirun` (Open MPI) or a PMI launcher (MPICH, Slurm) gave this process.
pub(crate) fn mpi_launch_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The engine and mesh of this run: MPI when launched by `mpirun`, threads otherwise.
pub fn engine_and_mesh(args: &Args, example: &str) -> Result<(Engine, Mesh), String> {
    let flat = |n| Mesh::flat(n).map_err(|e| e.to_string());
    match mpi_launch_size() {
        Some(size) => {
            #[cfg(feature = "mpi")]
            {
                let mesh = match args.mesh {
                    Some(m) => m,
                    None => flat(size)?,
                };
                if mesh.world_size() != size || args.ranks.is_some_and(|n| n != size) {
                    return Err(format!(
                        "launched as {size} MPI processes but asked for {} ranks; drop \
                         --ranks/--mesh or match mpirun -n",
                        args.ranks.unwrap_or(mesh.world_size())
                    ));
                }
                Ok((Engine::Mpi, mesh))
            }
            #[cfg(not(feature = "mpi"))]
            {
                let _ = (&args, flat);
                Err(format!(
                    "launched by mpirun ({size} processes) but built without MPI: \
                     cargo build --release --features mpi --example {example}"
                ))
            }
        }
        None => {
            if let Some(env) = nccl_launch()? {
                let size = env.world_size;
                let mesh = match args.mesh {
                    Some(m) => m,
                    None => flat(size)?,
                };
                if mesh.world_size() != size || args.ranks.is_some_and(|n| n != size) {
                    return Err(format!(
                        "launched by {} as {size} processes but asked for {} ranks; drop \
                         --ranks/--mesh or match the launch",
                        env.launcher,
                        args.ranks.unwrap_or(mesh.world_size())
                    ));
                }
                if !cfg!(feature = "nccl") || args.backend != BackendKind::Cuda {
                    return Err(format!(
                        "launched by {} ({size} processes, no MPI): the ranks meet over NCCL, \
                         which needs --backend cuda and a build with `--features cuda,nccl \
                         --example {example}`",
                        env.launcher
                    ));
                }
                return Ok((Engine::Nccl(env), mesh));
            }
            let mesh = match (args.mesh, args.ranks) {
                (Some(m), _) => m,
                (None, n) => flat(n.unwrap_or(2))?,
            };
            Ok((Engine::Threads, mesh))
        }
    }
}

/// Number of parameters of `model` (from their shapes: nothing is initialised; `shard` draws
/// the initial values on rank 0, one bucket at a time).
pub fn parameter_count<A: Backend, M: Module<A>>(model: &M) -> usize {
    param_shapes(model)
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum()
}

/// Runs `task` with `args` on the backend `args.backend` names.
pub fn run<T: Tasks>(task: &T, args: &Args) -> Result<Option<Report>, String> {
    match args.backend {
        BackendKind::Flex => run_on::<Flex, T>(task, args),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu if args.no_fusion => run_on::<WgpuUnfused, T>(task, args),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => run_on::<Wgpu, T>(task, args),
        #[cfg(not(feature = "wgpu"))]
        BackendKind::Wgpu => Err("--backend wgpu needs the `wgpu` feature".into()),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda if args.no_fusion => run_on::<CudaUnfused, T>(task, args),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => run_on::<Cuda, T>(task, args),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err("--backend cuda needs the `cuda` feature".into()),
    }
}

/// Whether `I`'s default device can hold and read back a tensor: GPU runtimes load their driver
/// at run time and panic when it or the device is missing (cudarc without libcuda, wgpu without
/// an adapter), which would surface as "rank 0 panicked"; this turns it into an error naming
/// the backend.
fn device_works<I: Compute>(backend: BackendKind) -> Result<(), String> {
    // The first panic message of any thread during the probe (the runtime's own device thread
    // panics with the reason; the caller only sees the channel it left closed).
    let first = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let hook = std::panic::take_hook();
    let record = first.clone();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "no reason given".into());
        if let Ok(mut first) = record.lock() {
            first.get_or_insert(message);
        }
    }));
    let probe = std::panic::catch_unwind(|| {
        let device = I::Device::default();
        burn::tensor::Tensor::<I, 1>::zeros([1], &device).into_data()
    });
    std::panic::set_hook(hook);
    probe.map(|_| ()).map_err(|_| {
        let why = first
            .lock()
            .ok()
            .and_then(|m| m.clone())
            .unwrap_or_else(|| "no reason given".into());
        format!(
            "--backend {} has no usable device here ({why}); --backend flex runs on the CPU",
            backend.flag()
        )
    })
}

/// Runs `task` on backend `I` with `args` on the engine the launch calls for; returns rank 0's
/// report (`None` on the other MPI processes).
pub fn run_on<I: Compute, T: Task<I>>(task: &T, args: &Args) -> Result<Option<Report>, String> {
    device_works::<I>(args.backend)?;
    if args.unsharded {
        return train_unsharded(task, args).map(|_| None);
    }
    let (engine, mesh) = engine_and_mesh(args, task.name())?;
    let world = mesh.world_size();
    if task.global_batch() % world != 0 {
        return Err(format!(
            "the global batch of {} does not split over {world} ranks",
            task.global_batch()
        ));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    // The initial model, on the device of the rank that makes it (every MPI process makes its
    // own: on its own GPU under `--nccl`). One process per rank draws nothing else, so its
    // parameters stay lazy: rank 0 draws them bucket by bucket while `shard` streams them. In
    // one process the ranks' threads share Burn's RNG, so the model is drawn whole first, under
    // the process's RNG lock (`init_seeded`): the same weights whatever else draws meanwhile.
    match engine {
        Engine::Threads => {
            let device = rank_device::<I>(args, 0)?;
            let init = init_seeded::<Train<I>, _>(&device, args.seed, |d| task.init(d));
            println!(
                "{}: {:.2}M parameters, {world} in-process ranks (mesh {mesh}), {} runtime \
                 parameters, {} steps",
                task.name(),
                parameter_count(&init) as f64 / 1e6,
                format_name(args.format),
                args.steps
            );
            let results = ThreadsWorld::run(world, ThreadsConfig::default(), |comm| {
                train_rank(task, args, mesh, comm, &init)
            })
            .map_err(|e| e.to_string())?;
            let mut report = None;
            for (rank, r) in results.into_iter().enumerate() {
                match r {
                    Ok(Ok(Some(r))) => report = Some(r),
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => {
                        return Err(if rank == 0 {
                            e
                        } else {
                            format!("rank {rank}: {e}")
                        })
                    }
                    Err(_) => return Err(format!("rank {rank} panicked")),
                }
            }
            if let Some(path) = &args.trace {
                write_trace(path, None)?;
            }
            Ok(report)
        }
        #[cfg(feature = "mpi")]
        Engine::Mpi => {
            let mpi = sshsdp::comm::mpi::MpiSession::init().map_err(|e| e.to_string())?;
            let comm = mpi.world().map_err(|e| e.to_string())?;
            let what = format!("{world} MPI processes");
            process_rank(task, args, mesh, comm, &what)
        }
        Engine::Nccl(env) => {
            #[cfg(feature = "nccl")]
            {
                // The launch communicator is NCCL's: every rank's GPU is its local rank's.
                let args = &Args {
                    nccl: true,
                    ..args.clone()
                };
                let comm = sshsdp::comm::nccl::NcclComm::from_launch(&env)
                    .map_err(|e| format!("joining the {} launch: {e}", env.launcher))?;
                let what = format!(
                    "{world} processes launched by {} (NCCL, rendezvous at {})",
                    env.launcher,
                    env.master
                        .as_ref()
                        .map_or("none: one rank".to_string(), |m| format!(
                            "{m}: {}",
                            m.source
                        ))
                );
                process_rank(task, args, mesh, comm, &what)
            }
            #[cfg(not(feature = "nccl"))]
            {
                let _ = env;
                Err("an NCCL launch needs the `nccl` feature".into())
            }
        }
    }
}

/// One process's rank of a multi-process launch (MPI, or NCCL under torchrun/srun): draws its
/// own initial model on its device (its parameters stay lazy: rank 0 draws them bucket by
/// bucket while `shard` streams them), trains, writes its trace.
#[cfg(any(feature = "mpi", feature = "nccl"))]
fn process_rank<I: Compute, T: Task<I>, C: LaunchComm>(
    task: &T,
    args: &Args,
    mesh: Mesh,
    comm: C,
    what: &str,
) -> Result<Option<Report>, String> {
    let device = launch_device::<I, C>(args, &comm)?;
    Train::<I>::seed(&device, args.seed);
    let init = task.init(&device);
    if comm.rank() == 0 {
        println!(
            "{}: {:.2}M parameters, {what} (mesh {mesh}), {} runtime parameters, {} steps",
            task.name(),
            parameter_count(&init) as f64 / 1e6,
            format_name(args.format),
            args.steps
        );
    }
    let rank = comm.rank();
    let report = train_rank(task, args, mesh, comm, &init)?;
    if let Some(path) = &args.trace {
        write_trace(path, Some(rank))?;
    }
    Ok(report)
}

/// An example's whole `main`: `setup` parses the command line (`Ok(None)` after `--help`,
/// which prints `usage`), `banner` describes the data, [`run`] trains, and `finish` prints what
/// is particular to the example after the common report. Errors print one line and exit 1.
pub fn main<T: Tasks>(
    usage: &str,
    setup: impl FnOnce() -> Result<Option<(T, Args)>, String>,
    banner: impl FnOnce(&T),
    finish: impl FnOnce(&T, &Report),
) -> ExitCode {
    // The runtime's NCCL lanes need peers connected at init (sshsdp-comm `nccl/lanes.rs`).
    // NCCL reads the variable from the environment once; set here, first thing in `main`,
    // while this process has one thread (setting it later, from a library, would race other
    // threads' reads: undefined behaviour with glibc). A value the user exported is kept.
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
    let (task, args) = match setup() {
        Ok(Some(x)) => x,
        Ok(None) => {
            println!("{usage}\n{COMMON_USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    banner(&task);
    match run(&task, &args) {
        Ok(Some(report)) => {
            finish(&task, &report);
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
