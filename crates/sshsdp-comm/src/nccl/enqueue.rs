//! One enqueue lock per GPU: NCCL allows one thread at a time to issue operations to the
//! communicators of one device, and a rank's lanes are threads with their own communicators
//! on the same GPU.
//!
//! Each enqueue (a collective, or a group from `ncclGroupStart` to `ncclGroupEnd`) holds its
//! GPU's lock; waits do not (they poll the stream and NCCL's asynchronous error, outside the
//! enqueue path), so a lane waiting on a slow collective never blocks another lane's enqueue.
//! The lock is per device rather than per process so that in-process ranks on different GPUs
//! (`NcclComm::run_threads`) never wait for each other here. An enqueue that connects peers
//! (NCCL's run-time connection, the first collective of a communicator) would wait for them
//! under the lock, while a peer's lane may wait for this process's other lane, itself waiting
//! for the lock: `NcclLanes` therefore requires NCCL to connect in `ncclCommInitRank`
//! (`NCCL_RUNTIME_CONNECT=0` in the caller's environment), outside any lock.

use std::sync::{Mutex, MutexGuard};

/// The locks, by GPU ordinal modulo their number (GPUs sharing one only serialise more).
static ENQUEUE_LOCKS: [Mutex<()>; 64] = [const { Mutex::new(()) }; 64];

/// The enqueue lock of GPU `device`, held until the guard is dropped.
pub(crate) fn enqueue_lock(device: usize) -> MutexGuard<'static, ()> {
    ENQUEUE_LOCKS[device % ENQUEUE_LOCKS.len()]
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn one_gpu_enqueues_one_at_a_time_and_gpus_do_not_wait_for_each_other() {
        // Ordinals far from other tests' (which use 0 and 1), so they never share a lock here.
        let held = enqueue_lock(40);
        // Another GPU's lock is free meanwhile.
        drop(enqueue_lock(41));
        let entered = Arc::new(AtomicBool::new(false));
        let seen = entered.clone();
        let other = std::thread::spawn(move || {
            let _guard = enqueue_lock(40);
            seen.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !entered.load(Ordering::SeqCst),
            "a second enqueue on the same GPU went in while the first held the lock"
        );
        drop(held);
        other.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
    }

    #[test]
    fn a_poisoned_lock_still_serialises() {
        let _ = std::thread::spawn(|| {
            let _guard = enqueue_lock(50);
            panic!("a panic while enqueuing");
        })
        .join();
        drop(enqueue_lock(50));
    }
}
