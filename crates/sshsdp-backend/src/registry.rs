//! Process-wide map from Burn's `DistributedParamId` to the runtime and parameter it stands for.
//!
//! Autodiff reports gradients through static functions of the backend
//! (`DistributedBackend::submit_gradient_sync`), which carry only the gradient and its
//! `DistributedParams`; this map routes them to the right runtime. Several runtimes (one per
//! rank thread, or per sharded model) coexist, each with its own ids.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use burn_backend::distributed::{DistributedParamId, DistributedParams};
use burn_backend::Backend;

use crate::runtime::Runtime;
use crate::tensor::HsdpFloat;

type Entry = (Weak<dyn Any + Send + Sync>, usize);

fn map() -> &'static Mutex<HashMap<DistributedParamId, Entry>> {
    static MAP: OnceLock<Mutex<HashMap<DistributedParamId, Entry>>> = OnceLock::new();
    MAP.get_or_init(Default::default)
}

fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Registers every parameter of `runtime`; returns their ids, by plan index.
pub(crate) fn register<B: Backend>(runtime: &Arc<Runtime<B>>) -> Vec<DistributedParamId> {
    let weak: Weak<dyn Any + Send + Sync> = Arc::downgrade(runtime) as Weak<dyn Any + Send + Sync>;
    let base = next_id() << 32;
    let mut map = map().lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, (w, _)| w.strong_count() > 0);
    (0..runtime.plan().params().len())
        .map(|index| {
            let id = DistributedParamId::from(base | index as u64);
            map.insert(id, (weak.clone(), index));
            id
        })
        .collect()
}

thread_local! {
    /// What the backward running on this thread consumed: per runtime, the leaves to register
    /// again once it is over.
    static CONSUMED: RefCell<Vec<Box<dyn FnOnce()>>> = const { RefCell::new(Vec::new()) };
}

fn lookup<B: Backend>(id: &DistributedParamId) -> Option<(Arc<Runtime<B>>, usize)> {
    let map = map().lock().unwrap_or_else(|p| p.into_inner());
    let (weak, index) = map.get(id)?;
    let runtime = weak.upgrade()?.downcast::<Runtime<B>>().ok()?;
    Some((runtime, *index))
}

/// Start of a backward pass: tells each runtime which of its parameters will get a gradient.
pub(crate) fn begin_backward<B: Backend>(params: &[DistributedParams]) {
    let mut by_runtime: Vec<(Arc<Runtime<B>>, Vec<usize>)> = Vec::new();
    for p in params {
        if let Some((runtime, index)) = lookup::<B>(&p.param_id) {
            match by_runtime
                .iter_mut()
                .find(|(r, _)| Arc::ptr_eq(r, &runtime))
            {
                Some((_, list)) => list.push(index),
                None => by_runtime.push((runtime, vec![index])),
            }
        }
    }
    for (runtime, indices) in by_runtime {
        runtime.begin_backward(&indices);
        CONSUMED.with(|c| {
            c.borrow_mut()
                .push(Box::new(move || runtime.rearm_leaves(&indices)))
        });
    }
}

/// End of a backward pass on this thread (Burn has released its graph locks): registers the
/// parameter leaves it consumed again, so the module can run the next forward and backward as
/// it is.
pub(crate) fn end_backward() {
    let consumed = CONSUMED.with(|c| std::mem::take(&mut *c.borrow_mut()));
    for rearm in consumed {
        rearm();
    }
}

/// A parameter's final gradient.
pub(crate) fn submit_gradient<B: Backend>(grad: &mut HsdpFloat<B>, params: &DistributedParams) {
    if let Some((runtime, index)) = lookup::<B>(&params.param_id) {
        runtime.submit_gradient(index, grad.clone().resolve());
    }
}
