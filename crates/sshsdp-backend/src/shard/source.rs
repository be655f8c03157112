//! Initial values from elsewhere than the module (`Shard::from_source`): the [`ParamSource`] trait,
//! the checks that every planned parameter is there, and each rank's reads of its own runtime
//! shards (and of the module's buffers).

use burn::module::Module;
use sshsdp_plan::Plan;

use crate::backend_ext::ShardableBackend;
use crate::error::HsdpError;
use crate::hsdp_runtime::HsdpRuntime;

/// Initial values for [`crate::Shard::from_source`] read straight into each rank's shards instead of
/// from the module (e.g. a safetensors file, `sshsdp_checkpoint::SafetensorsSource`): each rank asks only
/// for the element ranges of its own runtime shard, so no rank ever holds the whole model.
pub trait ParamSource: Send + Sync {
    /// Whether the source has parameter `path` with `shape` in a dtype it can read; the error
    /// names the parameter and what differs. Called on every rank for every parameter before
    /// anything is read.
    fn check(&self, path: &str, shape: &[usize]) -> Result<(), String>;
    /// Elements `range` (row-major, flattened) of parameter `path`, as f32, into `out`
    /// (`range.len()` elements).
    fn read(
        &self,
        path: &str,
        range: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), String>;
}

/// `module` with each buffer `source` holds read from it (checked like a parameter); a buffer
/// the source lacks keeps the module's value (a file of weights alone, e.g. a Hugging Face
/// export without running statistics). Local: every rank reads the whole buffers.
pub(crate) fn buffers_from_source<B: ShardableBackend, M: Module<B>>(
    module: M,
    runtime: &HsdpRuntime<B::Inner>,
    source: &dyn ParamSource,
) -> Result<M, HsdpError> {
    let mut values = runtime.buffer_values(&module)?;
    for value in &mut values {
        if source.check(&value.path, &value.shape).is_ok() {
            let len = value.values.len();
            source
                .read(&value.path, 0..len, &mut value.values)
                .map_err(HsdpError::Unsupported)?;
        }
    }
    runtime.set_buffer_values(module, &values)
}

/// Every planned parameter is in `source` with its shape (the first that is not, named).
pub(crate) fn check_source(plan: &Plan, source: &dyn ParamSource) -> Result<(), HsdpError> {
    for p in plan.params() {
        source
            .check(&p.spec.path, &p.spec.shape)
            .map_err(HsdpError::Unsupported)?;
    }
    Ok(())
}

/// Runtime shard `shard` of bucket `b` (its pieces' fp32 elements, padding zero) read from
/// `source`: each piece's update views say which elements of which parameter sit where.
pub(crate) fn read_shard(
    plan: &Plan,
    b: usize,
    shard: usize,
    source: &dyn ParamSource,
) -> Result<Vec<f32>, String> {
    let bucket = &plan.buckets()[b];
    let piece_elems = bucket.piece_elements as usize;
    let pieces = plan.pieces_per_shard();
    let mut out = vec![0f32; pieces * piece_elems];
    for (i, views) in bucket.views[shard * pieces..(shard + 1) * pieces]
        .iter()
        .enumerate()
    {
        for view in views {
            let path = &plan.params()[view.param].spec.path;
            for (run, master) in view.runs() {
                let at = i * piece_elems + master as usize;
                let range = run.start as usize..run.end as usize;
                let len = range.len();
                source.read(path, range, &mut out[at..at + len])?;
            }
        }
    }
    Ok(out)
}
