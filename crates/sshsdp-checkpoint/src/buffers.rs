//! Module buffers in checkpoints and exports (BatchNorm's running statistics: see
//! `sshsdp_backend::HsdpRuntime::buffers`). Rank 0's values are saved, each buffer whole as
//! one slice holding a [`BUFFER`] array alone; every rank reads them back, at any world size.
//! Models with buffers are saved, loaded and exported through the calls that take the module
//! (`save_model`, `load_model`, `export_model`); the others refuse them rather than lose them.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use sshsdp_backend::{HsdpRuntime, NamedParam};

use crate::{CheckpointError, Coverage, SliceEntry, BUFFER, MASTER};

/// An error when the model has buffers: `call`, which does not take the module, would lose
/// them; `instead` names the call that saves them. The same on every rank (the ranks agreed on
/// the buffers at `shard`), so returning before any collective keeps them in step.
pub(crate) fn refuse_buffers<B: Backend>(
    runtime: &HsdpRuntime<B>,
    call: &str,
    instead: &str,
) -> Result<(), CheckpointError> {
    match runtime.buffers() {
        [] => Ok(()),
        buffers => Err(CheckpointError::Invalid(format!(
            "the model has {} module buffer(s) (`{}`, …), which `{call}` cannot reach without \
             the module: use `{instead}`, which takes the module",
            buffers.len(),
            buffers[0].path
        ))),
    }
}

/// The buffers' values this rank contributes: rank 0's, read from `module`; no other rank's.
pub(crate) fn saved_buffers<B: Backend, MB: Backend, M: Module<MB>>(
    runtime: &HsdpRuntime<B>,
    module: &M,
) -> Result<Vec<NamedParam>, CheckpointError> {
    if runtime.rank() != 0 {
        return Ok(Vec::new());
    }
    runtime
        .buffer_values(module)
        .map_err(CheckpointError::Runtime)
}

/// One slice per buffer, whole, holding its values as a [`BUFFER`] array.
pub(crate) fn buffer_slices(values: Vec<NamedParam>) -> Vec<SliceEntry> {
    values
        .into_iter()
        .map(|v| SliceEntry {
            path: v.path,
            start: 0,
            end: v.values.len(),
            shape: v.shape,
            arrays: [(BUFFER.to_string(), v.values)].into(),
        })
        .collect()
}

/// The model's buffers as the checkpoint in `dir` holds them, checked both ways (every
/// buffer of the model, with its shape; no buffer the model lacks). A checkpoint written
/// before buffers were told apart from parameters holds them as parameters ([`MASTER`]
/// arrays), which are read alike.
pub(crate) fn assemble_buffers<B: Backend>(
    dir: &Path,
    coverage: &Coverage<'_>,
    runtime: &HsdpRuntime<B>,
) -> Result<Vec<NamedParam>, CheckpointError> {
    let mismatch = |reason: String| CheckpointError::Mismatch {
        file: dir.to_path_buf(),
        reason,
    };
    if let Some((path, _)) = coverage
        .buffers()
        .find(|(path, _)| !runtime.buffers().iter().any(|b| b.path == *path))
    {
        return Err(mismatch(format!(
            "the checkpoint's buffer '{path}' is not a buffer of the model"
        )));
    }
    runtime
        .buffers()
        .iter()
        .map(|spec| match coverage.shape(&spec.path) {
            None => Err(mismatch(format!(
                "the checkpoint has no buffer '{}' (saved without the module?)",
                spec.path
            ))),
            Some(shape) if shape != spec.shape.as_slice() => Err(mismatch(format!(
                "buffer '{}' has shape {shape:?} in the checkpoint and {:?} in the model",
                spec.path, spec.shape
            ))),
            Some(_) => {
                let array = if coverage.is_buffer(&spec.path) {
                    BUFFER
                } else {
                    MASTER
                };
                let values = coverage.assemble(&spec.path, &spec.shape, 0, spec.numel(), array)?;
                Ok(NamedParam {
                    path: spec.path.clone(),
                    shape: spec.shape.clone(),
                    values,
                })
            }
        })
        .collect()
}
