//! How this process was launched: rank, world size, local rank and the rendezvous address,
//! read from the launcher's environment variables.
//!
//! Variables set to an empty (or all-blank) string count as unset, except a nodelist (an empty
//! one is an error). The launchers, in the order
//! they are tried (the first that matches wins):
//!
//! 1. **torchrun** (or any PyTorch-style launch): `RANK` and `WORLD_SIZE` both set. Local rank:
//!    `LOCAL_RANK`, else the rank. Master: `MASTER_ADDR` with `MASTER_PORT` (default 29500, as
//!    torchrun's); no `MASTER_ADDR` → no master. Under torchrun's agent (`TORCHELASTIC_RUN_ID`
//!    set) the port is `MASTER_PORT + 1`: the agent's own store listens on `MASTER_PORT`.
//! 2. **Open MPI** (`mpirun`): `OMPI_COMM_WORLD_RANK` and `OMPI_COMM_WORLD_SIZE`; local rank
//!    `OMPI_COMM_WORLD_LOCAL_RANK` (else 0).
//! 3. **MPICH / Intel MPI** (Hydra, PMI): `PMI_RANK` and `PMI_SIZE`; local rank
//!    `MPI_LOCALRANKID` (else 0).
//!
//!    Under MPI the master is `MASTER_ADDR`/`MASTER_PORT` only when both are exported, else
//!    none: MPI launches agree on ids over MPI itself.
//! 4. **Slurm**, one task of an `srun` step: `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_STEP_ID`
//!    (or the older `SLURM_STEPID`); local rank `SLURM_LOCALID` (else 0). A batch script outside
//!    `srun` has `SLURM_PROCID` but no step id and is *not* a Slurm launch: start the ranks with
//!    `srun`. Slurm sets no master, so: host `MASTER_ADDR` if the job exported one, else the
//!    first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`) expanded
//!    ([`expand_nodelist`]); port `MASTER_PORT` if exported, else
//!    29500 + `SLURM_JOB_ID` % 10000 (so two jobs sharing a node do not collide), else 29500.
//!
//! [`RENDEZVOUS_PORT_ENV`] (`SSHSDP_RENDEZVOUS_PORT`), when set, is the port of any launch's
//! master.
//!
//! torchrun comes first because torchrun under `srun` also sees Slurm's variables; MPI comes
//! before Slurm because MPI under `srun` sets the PMI variables too. None of them → `Ok(None)`.
//!
//! Malformed values (non-numbers, a rank or local rank not below the world size, a world size
//! of 0, a port that is not a non-zero `u16`, an empty or malformed nodelist) are
//! [`CommError::InvalidArgument`] naming the variable and its value.

use std::fmt;

use super::nodelist::expand_nodelist;
use crate::{CommError, CommResult};

/// Overrides the rendezvous port of any launch (e.g. when the default one is taken).
pub const RENDEZVOUS_PORT_ENV: &str = "SSHSDP_RENDEZVOUS_PORT";

/// Whether torchrun's elastic agent started this process: it then serves a store of its own on
/// `MASTER_PORT` (`TORCHELASTIC_RUN_ID`, or `TORCHELASTIC_USE_AGENT_STORE`, is set).
fn torchrun_agent<F: Fn(&str) -> Option<String>>(vars: &Vars<F>) -> bool {
    vars.has("TORCHELASTIC_RUN_ID") || vars.has("TORCHELASTIC_USE_AGENT_STORE")
}

/// torchrun's default `MASTER_PORT`, and the base of the Slurm port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launcher that started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// torchrun, or any launch setting PyTorch's `RANK`/`WORLD_SIZE`.
    Torchrun,
    /// A task of a Slurm `srun` step.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH or Intel MPI (Hydra, PMI).
    Mpich,
}

impl Launcher {
    /// A short human name.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm srun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Mpich => "MPICH/Intel MPI",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where rank 0 serves the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MasterAddr {
    /// Host name or IP literal.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// In words, where host and port came from (for error messages).
    pub source: String,
}

impl MasterAddr {
    /// A master address given explicitly, `source` saying by whom.
    pub fn new(host: impl Into<String>, port: u16, source: impl Into<String>) -> Self {
        Self {
            host: host.into(),
            port,
            source: source.into(),
        }
    }
}

impl fmt::Display for MasterAddr {
    /// `host:port`, with an IPv6 literal in brackets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') && !self.host.starts_with('[') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// This process's place in the job, as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which launcher's variables were read.
    pub launcher: Launcher,
    /// Global rank, below `world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this node.
    pub local_rank: usize,
    /// The rendezvous address, where one is known.
    pub master: Option<MasterAddr>,
}

/// A variable lookup that treats blank values as unset.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn number(&self, name: &str) -> CommResult<Option<u64>> {
        self.get(name)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| bad(name, &v, "is not a non-negative integer"))
            })
            .transpose()
    }

    fn index(&self, name: &str) -> CommResult<Option<usize>> {
        self.get(name)
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|_| bad(name, &v, "is not a non-negative integer"))
            })
            .transpose()
    }

    fn port(&self, name: &str) -> CommResult<Option<u16>> {
        self.get(name)
            .map(|v| match v.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(bad(name, &v, "is not a TCP port (1-65535)")),
            })
            .transpose()
    }
}

fn bad(name: &str, value: &str, why: &str) -> CommError {
    CommError::InvalidArgument(format!("{name}={value:?} {why}"))
}

impl LaunchEnv {
    /// Reads the launch from the process environment; see the module doc for the rules.
    pub fn from_env() -> CommResult<Option<LaunchEnv>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the launch from a variable lookup (`get(name)` → value), so tests need not touch
    /// the real environment. `Ok(None)`: no known launcher's variables are set.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> CommResult<Option<LaunchEnv>> {
        let port = Vars(&get).port(RENDEZVOUS_PORT_ENV)?;
        let mut env = Self::from_launcher_vars(get)?;
        if let (Some(port), Some(master)) = (port, env.as_mut().and_then(|e| e.master.as_mut())) {
            master.port = port;
            master.source = format!("{}, port from {RENDEZVOUS_PORT_ENV}", master.source);
        }
        Ok(env)
    }

    /// [`LaunchEnv::from_vars`] before [`RENDEZVOUS_PORT_ENV`] is applied.
    fn from_launcher_vars(get: impl Fn(&str) -> Option<String>) -> CommResult<Option<LaunchEnv>> {
        let vars = Vars(get);
        if vars.has("RANK") && vars.has("WORLD_SIZE") {
            let (rank, world_size) = rank_and_size(&vars, "RANK", "WORLD_SIZE")?;
            let local_rank = local(&vars, "LOCAL_RANK", world_size, rank)?;
            let master = match vars.get("MASTER_ADDR") {
                None => None,
                Some(host) => Some(match vars.port("MASTER_PORT")? {
                    // torchrun's agent serves its own store on MASTER_PORT: the next port.
                    Some(port) if torchrun_agent(&vars) => MasterAddr::new(
                        host,
                        port.checked_add(1).ok_or_else(|| {
                            bad("MASTER_PORT", &port.to_string(), "leaves no next port")
                        })?,
                        "MASTER_ADDR, MASTER_PORT + 1 (torchrun's agent serves its own \
                         store on MASTER_PORT)",
                    ),
                    Some(port) => MasterAddr::new(host, port, "MASTER_ADDR/MASTER_PORT"),
                    None => MasterAddr::new(
                        host,
                        DEFAULT_MASTER_PORT,
                        "MASTER_ADDR, with torchrun's default port 29500 (MASTER_PORT unset)",
                    ),
                }),
            };
            return Ok(Some(LaunchEnv {
                launcher: Launcher::Torchrun,
                rank,
                world_size,
                local_rank,
                master,
            }));
        }
        let mpi = [
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            (Launcher::Mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ];
        for (launcher, rank_var, size_var, local_var) in mpi {
            if vars.has(rank_var) && vars.has(size_var) {
                let (rank, world_size) = rank_and_size(&vars, rank_var, size_var)?;
                let local_rank = local(&vars, local_var, world_size, 0)?;
                let master = match (vars.get("MASTER_ADDR"), vars.port("MASTER_PORT")?) {
                    (Some(host), Some(port)) => {
                        Some(MasterAddr::new(host, port, "MASTER_ADDR/MASTER_PORT"))
                    }
                    _ => None,
                };
                return Ok(Some(LaunchEnv {
                    launcher,
                    rank,
                    world_size,
                    local_rank,
                    master,
                }));
            }
        }
        let step = vars.has("SLURM_STEP_ID") || vars.has("SLURM_STEPID");
        if vars.has("SLURM_PROCID") && vars.has("SLURM_NTASKS") && step {
            let (rank, world_size) = rank_and_size(&vars, "SLURM_PROCID", "SLURM_NTASKS")?;
            let local_rank = local(&vars, "SLURM_LOCALID", world_size, 0)?;
            let master = slurm_master(&vars)?;
            return Ok(Some(LaunchEnv {
                launcher: Launcher::Slurm,
                rank,
                world_size,
                local_rank,
                master,
            }));
        }
        Ok(None)
    }
}

fn rank_and_size<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    rank_var: &str,
    size_var: &str,
) -> CommResult<(usize, usize)> {
    let world_size = vars.index(size_var)?.unwrap_or(0);
    if world_size == 0 {
        return Err(bad(
            size_var,
            &vars.get(size_var).unwrap_or_default(),
            "must be at least 1",
        ));
    }
    let rank = vars.index(rank_var)?.unwrap_or(0);
    if rank >= world_size {
        let why = format!("is not below {size_var}={world_size}");
        return Err(bad(rank_var, &rank.to_string(), &why));
    }
    Ok((rank, world_size))
}

fn local<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    var: &str,
    world_size: usize,
    default: usize,
) -> CommResult<usize> {
    match vars.index(var)? {
        None => Ok(default),
        Some(l) if l < world_size => Ok(l),
        Some(l) => Err(bad(
            var,
            &l.to_string(),
            &format!("is not below the world size {world_size}"),
        )),
    }
}

fn slurm_master<F: Fn(&str) -> Option<String>>(vars: &Vars<F>) -> CommResult<Option<MasterAddr>> {
    let (host, host_source) = if let Some(host) = vars.get("MASTER_ADDR") {
        (host, "MASTER_ADDR exported in the job".to_string())
    } else {
        let Some((var, list)) = ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
            .into_iter()
            .find_map(|var| (vars.0)(var).map(|list| (var, list)))
        else {
            return Ok(None);
        };
        let hosts = expand_nodelist(&list)
            .map_err(|e| bad(var, &list, &format!("is not a Slurm nodelist ({e})")))?;
        let Some(first) = hosts.into_iter().next() else {
            return Err(bad(var, &list, "names no host"));
        };
        let source = format!("first host of {var} ({list} → {first})");
        (first, source)
    };
    let (port, port_source) = if let Some(port) = vars.port("MASTER_PORT")? {
        (port, "port from MASTER_PORT".to_string())
    } else if let Some(job) = vars.number("SLURM_JOB_ID")? {
        // 29500 + 9999 < 65536; the modulus is below 10000, so the cast is lossless.
        let port = DEFAULT_MASTER_PORT + (job % 10_000) as u16;
        let source = format!(
            "port 29500 + SLURM_JOB_ID % 10000 (job {job} → {port}; jobs sharing a node differ)"
        );
        (port, source)
    } else {
        (
            DEFAULT_MASTER_PORT,
            "default port 29500 (no MASTER_PORT or SLURM_JOB_ID)".to_string(),
        )
    };
    Ok(Some(MasterAddr::new(
        host,
        port,
        format!("{host_source}, {port_source}"),
    )))
}

/// The node-local rank from `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`
/// or `SLURM_LOCALID`: the first of them that is set to a number (others are skipped).
pub fn node_local_rank_from(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let vars = Vars(get);
    [
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .into_iter()
    .find_map(|var| vars.get(var)?.parse().ok())
}

/// [`node_local_rank_from`] over the process environment.
pub fn node_local_rank() -> Option<usize> {
    node_local_rank_from(|name| std::env::var(name).ok())
}

/// The GPU (index among the `visible` ones) a process with this local rank uses:
/// `local_rank % visible`. So when each process sees one GPU (`srun --gpus-per-task=1`, or a
/// container per process) every rank uses its device 0; with 8 visible, local rank 3 uses 3.
pub fn local_device(local_rank: usize, visible: usize) -> CommResult<usize> {
    if visible == 0 {
        return Err(CommError::Unavailable(format!(
            "no GPU is visible to this process (local rank {local_rank}): check \
             CUDA_VISIBLE_DEVICES and the job's GPU request"
        )));
    }
    Ok(local_rank % visible)
}
