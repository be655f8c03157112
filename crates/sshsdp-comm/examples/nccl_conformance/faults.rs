//! The failure semantics of the NCCL engine on a real communicator: a wait behind a stream that
//! never drains times out near its limit and aborts the communicator, and later calls fail.

use sshsdp_comm::conformance::Outcome;
use sshsdp_comm::nccl::NcclComm;
use sshsdp_comm::{Collective, CommError, ReduceOp};

/// How long after the wait starts the blocked stream is released (from another thread): past
/// the wait's limit, within the check's bound (ten limits).
const RELEASE_AFTER_LIMITS: u32 = 4;

/// A host function queued on a stream: the stream waits, as behind a collective whose peer
/// never arrives, until the flag it points to is set.
unsafe extern "C" fn block_until_released(flag: *mut std::ffi::c_void) {
    // SAFETY: `flag` is the `AtomicBool` of an `Arc` kept alive by `fault_checks` until the
    // stream has drained (it synchronises the stream before dropping its handle).
    let flag = unsafe { &*(flag as *const std::sync::atomic::AtomicBool) };
    while !flag.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// The failure semantics on a real communicator (last: it aborts `c`). A stream blocked by a
/// host function (`cuLaunchHostFunc`) that waits for a flag stands in for a peer that never
/// arrives: the bounded wait must time out near its limit and abort the communicator, and a
/// later call must fail before it enqueues.
///
/// `ncclCommAbort` frees the communicator's memory and synchronises, which cannot finish while
/// the stream is blocked (NVIDIA/nccl#549, #829): a thread started before the wait sets the
/// flag after [`RELEASE_AFTER_LIMITS`] limits, so the abort returns a little after that instead
/// of hanging. (A stream memory wait, `cuStreamWaitValue32`, was the first stand-in: the H200's
/// CUDA 13 driver refused it with `CUDA_ERROR_INVALID_VALUE`.)
pub(crate) fn fault_checks(mut c: NcclComm, out: &mut Vec<(String, Outcome)>) {
    use cudarc::driver::sys as cu;
    use std::sync::atomic::{AtomicBool, Ordering};
    let limit = std::time::Duration::from_millis(500);
    c.set_timeout(limit);
    let released = std::sync::Arc::new(AtomicBool::new(false));
    // SAFETY: the host function only reads the flag, which outlives the queued call (see
    // `block_until_released`); it makes no CUDA call.
    let queued = unsafe {
        cu::cuLaunchHostFunc(
            c.stream().cu_stream(),
            Some(block_until_released),
            std::sync::Arc::as_ptr(&released) as *mut std::ffi::c_void,
        )
    };
    let release = {
        let released = released.clone();
        std::thread::spawn(move || {
            std::thread::sleep(limit * RELEASE_AFTER_LIMITS);
            released.store(true, Ordering::Release);
        })
    };
    let start = std::time::Instant::now();
    let waited = c.synchronize();
    let took = start.elapsed();
    println!("fault check: the stuck wait returned after {took:?} ({waited:?})");
    let timed_out = match (&queued, &waited) {
        (cu::cudaError_enum::CUDA_SUCCESS, Err(CommError::Timeout { .. }))
            if took >= limit && took < limit * 10 =>
        {
            Ok(())
        }
        _ => Err(format!(
            "queue {queued:?}, wait {waited:?} after {took:?} (limit {limit:?})"
        )),
    };
    out.push(("fault: stuck stream times out".into(), timed_out));
    let mut one = vec![0f32; 4];
    let later = match c.all_reduce(&mut one, ReduceOp::Sum) {
        Err(CommError::PeerFailed(_)) => Ok(()),
        other => Err(format!("after the abort a call returned {other:?}")),
    };
    out.push(("fault: calls after abort fail".into(), later));
    let joined = release.join();
    // The stream drains once the flag is set; the flag may be dropped only after that.
    let drained = c.stream().synchronize();
    let released = match (joined, drained) {
        (Ok(()), Ok(())) => Ok(()),
        (joined, drained) => Err(format!(
            "releasing the stream: thread {joined:?}, stream {drained:?}"
        )),
    };
    out.push(("fault: blocked stream released".into(), released));
}
