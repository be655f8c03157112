//! Seeded initial weights that no other thread can disturb.
//!
//! Burn's backends keep one process-global RNG each (`NdArray`, `Flex`: a `static` behind a
//! mutex; `B::seed` replaces it). A seed fixes the draws that *follow* it, whichever thread makes
//! them: if another thread seeds or draws between a program's `B::seed(seed)` and the draws of
//! its model's initial weights, those weights change. Burn's parameters are lazy, so the draws
//! may come long after the seed (at the first forward, or while [`shard`](crate::shard) reads
//! them bucket by bucket) — a wide window. Tests running in parallel fall into it all the time;
//! so does a program that seeds, starts a data-loading or evaluation thread that draws, and only
//! then initialises its model.
//!
//! One process-wide lock closes the window: [`init_seeded`] seeds, builds the module and forces
//! every lazy parameter in module order (the order in which [`shard`](crate::shard) would draw
//! them) under the lock, so the weights depend on the seed alone. Every other seeding or drawing
//! that may run concurrently must take the same lock ([`with_burn_rng`]): a thread that draws
//! without it can still move a locked sequence's stream, as it can with any global RNG. The lock
//! is re-entrant on its thread, so the two nest.
//!
//! Lazy backends draw late: burn-fusion (Burn's default `Wgpu` and `Cuda`) queues a draw in the
//! calling thread's stream and consumes the inner backend's RNG only when that stream runs,
//! possibly after the lock is released and while another thread's seeded sequence runs (a flake
//! seen as two fused runs of one seed starting from different weights). So a draw made under the
//! lock is also *run* under it: [`init_seeded`] and [`ConcurrentDrawer`] end their locked part
//! with `B::sync`, which runs the calling thread's queued fusion work (a no-op wait elsewhere).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

/// The one lock that orders every seeding and drawing of Burn's RNGs in this process.
static BURN_RNG: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds [`BURN_RNG`] (so nested calls run without locking again).
    static HELD: Cell<bool> = const { Cell::new(false) };
}

/// Releases the lock and the thread's mark when dropped (also on a panic inside `f`).
struct Held {
    _guard: MutexGuard<'static, ()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.with(|held| held.set(false));
    }
}

/// Runs `f` while no other thread of the process seeds or draws from Burn's RNGs through this
/// lock: wrap any `B::seed` and any draw (`Tensor::random`, a lazy parameter's first use,
/// dropout) that may run alongside [`init_seeded`]. Re-entrant on the calling thread; a panic in
/// another holder does not poison it.
pub fn with_burn_rng<T>(f: impl FnOnce() -> T) -> T {
    if HELD.with(Cell::get) {
        return f();
    }
    let guard = BURN_RNG
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    HELD.with(|held| held.set(true));
    let _held = Held { _guard: guard };
    f()
}

/// The module `init` builds after seeding `B`'s RNG with `seed`, with every lazy parameter drawn
/// in module order, all under [`with_burn_rng`]: the same weights for the same seed whatever
/// other threads draw. The parameters are materialised here, so use it where the whole model
/// fits one process (tests, one-host runs, an unsharded baseline); a multi-process launch whose
/// rank 0 streams lazy parameters through [`shard`](crate::shard) draws nothing else in that
/// process and can seed and stay lazy.
pub fn init_seeded<B: Backend, M: Module<B>>(
    device: &B::Device,
    seed: u64,
    init: impl FnOnce(&B::Device) -> M,
) -> M {
    with_burn_rng(|| {
        B::seed(device, seed);
        let module = init(device);
        initialise_in_module_order(&module);
        // Lazy backends (fusion) run the queued draws now, while the RNG is still ours.
        if let Err(e) = B::sync(device) {
            log::warn!("synchronising the device after drawing initial weights: {e:?}");
        }
        module
    })
}

/// Draws every lazy float parameter of `module` now, in module order (the order in which
/// [`shard`](crate::shard)'s rank 0 draws them). Burn alone would draw each at its first use,
/// in forward order, so a sharded run and a plain-Burn run of the same seed would start from
/// different weights. Call it under [`with_burn_rng`] (as [`init_seeded`] does).
pub fn initialise_in_module_order<B: Backend, M: Module<B>>(module: &M) {
    module.visit(&mut InitialiseInModuleOrder);
}

/// A visitor that reads each float parameter once, which initialises a lazy one.
struct InitialiseInModuleOrder;

impl<B: Backend> ModuleVisitor<B> for InitialiseInModuleOrder {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

/// A thread that seeds and draws from `B`'s RNG in a loop, through [`with_burn_rng`], until
/// dropped: what other tests (or a user's data thread) do alongside a seeded run. A test that
/// depends on seeded weights keeps one running to prove that it does not depend on being alone.
pub struct ConcurrentDrawer {
    stop: Arc<AtomicBool>,
    draws: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl ConcurrentDrawer {
    /// Starts drawing on a new thread (each round: a fresh seed, then a 64×64 draw); returns once
    /// its first round has begun.
    pub fn start<B: Backend>() -> Self {
        let (stop, draws) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let thread = {
            let (stop, draws) = (stop.clone(), draws.clone());
            std::thread::spawn(move || {
                let device = B::Device::default();
                while !stop.load(Ordering::Relaxed) {
                    let round = draws.fetch_add(1, Ordering::Relaxed);
                    with_burn_rng(|| {
                        B::seed(&device, 1_000_003 + round);
                        let _ = Tensor::<B, 2>::random([64, 64], Distribution::Default, &device);
                        // Run the draw under the lock on lazy backends too (the module's docs).
                        let _ = B::sync(&device);
                    });
                    std::thread::yield_now();
                }
            })
        };
        // Returns once the thread is drawing: a caller that starts checking at once would
        // otherwise finish before a loaded machine first schedules it.
        while draws.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        Self {
            stop,
            draws,
            thread: Some(thread),
        }
    }

    /// How many rounds it has drawn so far (a test checks that it did run alongside).
    pub fn draws(&self) -> u64 {
        self.draws.load(Ordering::Relaxed)
    }
}

impl Drop for ConcurrentDrawer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::nn::{Linear, LinearConfig};

    type B = NdArray<f32>;

    fn weights(seed: u64) -> Vec<f32> {
        weights_on::<B>(seed)
    }

    fn weights_on<A: Backend>(seed: u64) -> Vec<f32> {
        let device = Default::default();
        let linear: Linear<A> = init_seeded(&device, seed, |d| LinearConfig::new(64, 64).init(d));
        linear.weight.val().into_data().to_vec().unwrap()
    }

    /// (A fused backend's draws are lazy: `tests/wgpu_backend/fusion.rs` checks them there.)
    #[test]
    fn seeded_weights_do_not_move_while_another_thread_draws() {
        seeded_weights_stay_put::<B>();
    }

    fn seeded_weights_stay_put<A: Backend>() {
        let expected = weights_on::<A>(7);
        let drawer = ConcurrentDrawer::start::<A>();
        let first = drawer.draws();
        // At least 50 checks, and on until the drawer has drawn 20 rounds alongside them.
        let mut checks = 0;
        while checks < 50 || (drawer.draws() < first + 20 && checks < 100_000) {
            assert_eq!(weights_on::<A>(7), expected);
            checks += 1;
        }
        assert!(drawer.draws() >= first + 20, "the drawer ran alongside");
        drop(drawer);
        assert_ne!(
            weights_on::<A>(8),
            expected,
            "another seed draws other weights"
        );
    }

    #[test]
    fn the_lock_nests_on_its_thread() {
        let nested = with_burn_rng(|| with_burn_rng(|| weights(3)));
        assert_eq!(nested, weights(3));
    }
}
