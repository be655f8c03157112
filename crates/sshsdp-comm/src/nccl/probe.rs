//! Finding out, without panicking, whether `libcuda`, `libnccl` and a GPU are there.
//!
//! cudarc's dynamic loader panics when a library (or a symbol) cannot be loaded. The probe
//! touches each library inside `catch_unwind` under a silent panic hook, so nothing is printed,
//! and then checks each NCCL symbol the engine calls, so later calls cannot panic either. The
//! outcome is computed once per process and cached.
//!
//! The panic hook is process-wide: while the probe runs (once, a few milliseconds), a panic on
//! another thread would print nothing. The previous hook is restored afterwards.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl_result, sys as nccl_sys};

use crate::{CommError, CommResult};

/// The NCCL functions the engine calls; all must be present for the engine to be available.
const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitRank",
    "ncclCommSplit",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclAllReduce",
    "ncclBroadcast",
];

/// What the probe found: the NCCL version code and the number of GPUs.
#[derive(Clone, Debug)]
struct Found {
    nccl_version: i32,
    devices: usize,
}

static PROBE: OnceLock<Result<Found, String>> = OnceLock::new();

/// Serialises hook swapping with any other probe-like code in this module.
static HOOK_LOCK: Mutex<()> = Mutex::new(());

/// Runs `f`, turning a panic into `Err(message)`, with the panic message silenced.
fn quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    let _lock = HOOK_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let previous = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let out = panic::catch_unwind(AssertUnwindSafe(f));
    panic::set_hook(previous);
    out.map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        // cudarc's message lists every file name it tried; keep its first sentence.
        match msg.find(" - searched for library names") {
            Some(cut) => msg[..cut].to_string(),
            None => msg,
        }
    })
}

fn run_probe() -> Result<Found, String> {
    // (NCCL_RUNTIME_CONNECT is the caller's to set, never set here: `lanes.rs`.)
    // 1. libcuda: load it (cudarc panics if it cannot), then initialise and count devices.
    let devices = quietly(|| {
        // SAFETY: `culib` only loads the library (dlopen) into a process-wide OnceLock.
        unsafe { cudarc::driver::sys::culib() };
        CudaContext::device_count()
    })
    .map_err(|why| {
        format!(
            "the CUDA driver library could not be loaded ({why}); is an NVIDIA driver \
             installed, with libcuda.so or libcuda.so.1 on the library path?"
        )
    })?
    .map_err(|e| format!("the CUDA driver failed to initialise or count devices: {e}"))?;
    let devices = usize::try_from(devices).unwrap_or(0);
    if devices == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }

    // 2. libnccl: load it, check every symbol the engine calls, read the version.
    let missing = quietly(|| {
        // SAFETY: `culib` loads the library into a process-wide OnceLock; `get` only looks a
        // symbol up (the function-pointer type is not called here).
        let lib = unsafe { nccl_sys::culib() };
        NCCL_SYMBOLS
            .iter()
            .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
    })
    .map_err(|why| {
        format!(
            "the NCCL library could not be loaded ({why}); cudarc looks for libnccl.so, while \
             NCCL ships libnccl.so.2 (e.g. in the Python package nvidia-nccl-cu13, under \
             site-packages/nvidia/nccl/lib/): create a symlink libnccl.so -> libnccl.so.2 in a \
             directory on LD_LIBRARY_PATH"
        )
    })?;
    if !missing.is_empty() {
        return Err(format!(
            "the NCCL library lacks {missing:?}; this engine needs NCCL 2.18 or newer"
        ));
    }
    let nccl_version = quietly(nccl_result::get_nccl_version)
        .map_err(|why| format!("ncclGetVersion panicked: {why}"))?
        .map_err(|e| format!("ncclGetVersion failed: {e:?}"))?;
    Ok(Found {
        nccl_version,
        devices,
    })
}

fn found() -> CommResult<&'static Found> {
    PROBE
        .get_or_init(run_probe)
        .as_ref()
        .map_err(|why| CommError::Unavailable(format!("nccl: {why}")))
}

/// Checks that the CUDA driver, a GPU and a usable NCCL library are present, without panicking.
///
/// Returns [`CommError::Unavailable`] with the reason otherwise. Computed once per process.
pub fn probe() -> CommResult<()> {
    found().map(|_| ())
}

/// Whether the NCCL engine can run here (see [`probe`] for the reason when it cannot).
pub fn is_available() -> bool {
    probe().is_ok()
}

/// The NCCL library's version code (for example `22805` for 2.28.5).
pub fn nccl_version() -> CommResult<i32> {
    found().map(|f| f.nccl_version)
}

/// Number of visible GPUs.
pub fn device_count() -> CommResult<usize> {
    found().map(|f| f.devices)
}

/// Free and total bytes of GPU `device`'s memory (`cuMemGetInfo` in its primary context): what
/// NCCL's communicators cost shows as the drop in `free` across their creation (nothing else may
/// allocate meanwhile).
pub fn gpu_memory(device: usize) -> CommResult<(usize, usize)> {
    probe()?;
    let ctx = CudaContext::new(device)
        .map_err(|e| CommError::Engine(format!("CudaContext::new({device}): {e}")))?;
    ctx.mem_get_info()
        .map_err(|e| CommError::Engine(format!("cuMemGetInfo on GPU {device}: {e}")))
}
