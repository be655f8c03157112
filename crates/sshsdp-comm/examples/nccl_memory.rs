//! NCCL's GPU memory for the communicators an SS-HSDP rank makes, and the device a process
//! picks from its launcher's local rank.
//!
//! ```text
//! NCCL_RUNTIME_CONNECT=0 cargo run --release -p sshsdp-comm --features nccl --example nccl_memory
//! CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=3 ... --example nccl_memory -- --device-check
//! ```
//!
//! One process, world 1, on the GPU its local rank picks (`launch::local_device`). Prints the
//! drop in the GPU's free memory (`cuMemGetInfo`) across the creation of: one world
//! communicator; a split sharing its parent's resources (what `MeshComms` splits within a lane
//! now); a split with resources of its own (what it did before); and the runtime's whole set
//! (the lanes of `NcclLanes` with their mesh communicators). At world 1 NCCL has no peer, so its
//! per-peer buffers (the part that grows with the world: NVIDIA/nccl #864, #986) do not show:
//! this confirms what each communicator costs by itself and that sharing works, not the total
//! at world 8.
//!
//! `--device-check`: prints the launcher's local rank, the visible GPUs and the device chosen,
//! and joins a one-rank world there. Exit status 0 on success, 1 on a failure, 2 when the engine
//! is unavailable here.

use std::process::ExitCode;

use sshsdp_comm::hierarchy::MeshComms;
use sshsdp_comm::launch::{local_device, node_local_rank};
use sshsdp_comm::nccl::{self, NcclComm, NcclLanes, NcclUniqueId};
use sshsdp_comm::{CommError, CommFactory, CommResult};

const MIB: f64 = 1024.0 * 1024.0;

/// MiB that `make` took from GPU `device` while what it returns is alive.
fn cost<T>(device: usize, make: impl FnOnce() -> CommResult<T>) -> CommResult<(T, f64)> {
    let (before, _) = nccl::gpu_memory(device)?;
    let kept = make()?;
    let (after, _) = nccl::gpu_memory(device)?;
    Ok((kept, (before as f64 - after as f64) / MIB))
}

fn run(device_check: bool) -> CommResult<()> {
    let visible = nccl::device_count()?;
    let local = node_local_rank();
    let device = local_device(local.unwrap_or(0), visible)?;
    println!(
        "local rank {local:?}, {visible} visible GPU(s): device {device}; NCCL {}",
        nccl::nccl_version()?
    );
    let id = NcclUniqueId::new()?;
    if device_check {
        let comm = NcclComm::from_id(&id, 0, 1, device)?;
        println!("joined a one-rank world on GPU {}", comm.device());
        return Ok(());
    }
    let (_, total) = nccl::gpu_memory(device)?;
    println!("GPU {device}: {:.0} MiB in all", total as f64 / MIB);
    let (world, world_mib) = cost(device, || NcclComm::from_id(&id, 0, 1, device))?;
    println!("| world communicator (ncclCommInitRank) | {world_mib:.1} MiB |");
    let (shared, shared_mib) = cost(device, || world.split_comm(0, 0))?;
    println!("| split sharing its parent's resources (splitShare) | {shared_mib:.1} MiB |");
    drop(shared);
    let (own, own_mib) = cost(device, || split_with_own_resources(&world))?;
    println!("| split with resources of its own (before) | {own_mib:.1} MiB |");
    drop(own);
    // The runtime's set at world 1: three lanes (registration, shard, replica), each a world
    // communicator and the mesh groups that are not the world (none on a 1×1 mesh).
    let (lanes, lanes_mib) = cost(device, || {
        let factory = NcclLanes::from_collective(&world, device, 3)?;
        (0..3)
            .map(|lane| MeshComms::new(factory.connect(lane)?, 1, 1))
            .collect::<CommResult<Vec<_>>>()
    })?;
    let comms: usize = lanes.iter().map(|m| m.communicators()).sum();
    println!("| the runtime's lanes ({comms} communicators) | {lanes_mib:.1} MiB |");
    println!(
        "NCCL at world 1, launch communicator included: {:.1} MiB",
        world_mib + lanes_mib
    );
    Ok(())
}

/// `ncclCommSplit` with a null config (the child gets buffers of its own), as before.
fn split_with_own_resources(parent: &NcclComm) -> CommResult<Owned> {
    let mut child = std::mem::MaybeUninit::uninit();
    // SAFETY: `parent.raw()` is live on this thread with its context current (`gpu_memory`
    // bound it); `child` is written on success and read only then.
    unsafe {
        cudarc::nccl::sys::ncclCommSplit(
            parent.raw(),
            0,
            0,
            child.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(|e| CommError::Engine(format!("ncclCommSplit: {e:?}")))?;
        Ok(Owned(child.assume_init()))
    }
}

/// A raw communicator destroyed on drop.
struct Owned(cudarc::nccl::sys::ncclComm_t);

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommSplit above, not used after this.
        let _ = unsafe { cudarc::nccl::result::comm_destroy(self.0) };
    }
}

fn main() -> ExitCode {
    let device_check = std::env::args().any(|a| a == "--device-check");
    match run(device_check) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CommError::Unavailable(why)) => {
            eprintln!("NCCL unavailable here: {why}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
