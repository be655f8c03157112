//! Module buffers: float state a module keeps that is not a parameter — BatchNorm's running
//! mean and variance (Burn's `RunningState`), or any state a module builds the same way.
//!
//! **The rule.** Burn visits a buffer exactly as a frozen, initialised parameter (a
//! `Param::initialized(id, value)` with `require_grad` false), so its flags cannot tell them
//! apart. What can: a mapper may change a parameter's `ParamId` (the field is public and the
//! parameter keeps whatever the mapper returns), whereas a `RunningState` builds a fresh `Param`
//! for each visit from its own id and keeps only the tensor a mapper returns. [`buffer_specs`]
//! maps a clone of the module with fresh ids, without touching any value or initialising any
//! lazy parameter, and visits it: a float state that still reports its old id is a buffer.
//! Every `Param` is a parameter, frozen or not.
//!
//! Buffers are never planned, sharded or stepped: they stay in the module, per rank, updated by
//! the module's own forward (as FSDP2 keeps them). The runtime reads and writes them by path
//! for checkpoints, the safetensors export and [`crate::HsdpRuntime::broadcast_buffers`].
//!
//! A `RunningState`'s visitor reads a value one update behind (only `into_record` and `valid`
//! fold in the last update), so reads here first fold it in through `into_record` on a clone
//! (clones share the state), and writes do the same so that no pending update overwrites them.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::paths::{map_at, visit_at, MapAt, NamedParam, VisitAt};
use crate::error::HsdpError;

/// A module buffer every rank agreed on at `shard`: its module path and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BufferSpec {
    /// Module path, e.g. `blocks.0.norm.running_var`.
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
}

impl BufferSpec {
    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Each float state's path, id and shape (lazy shapes: nothing is initialised), module order.
struct Ids {
    seen: Vec<(String, ParamId, Vec<usize>)>,
}

impl<B: Backend> VisitAt<B> for Ids {
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
        let shape = param.lazy_shape().to_vec();
        self.seen.push((path.to_string(), param.id, shape));
    }
}

fn ids<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, ParamId, Vec<usize>)> {
    let mut ids = Ids { seen: Vec::new() };
    visit_at(module, &mut ids);
    ids.seen
}

/// Gives every parameter a fresh id and leaves everything else as it is.
struct FreshIds;

impl<B: Backend> ModuleMapper<B> for FreshIds {
    fn map_float<const D: usize>(&mut self, mut param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.id = ParamId::new();
        param
    }
}

/// The module's buffers (see the module docs for the rule), in module order, without
/// initialising any lazy parameter.
pub(crate) fn buffer_specs<B: Backend, M: Module<B>>(module: &M) -> Vec<BufferSpec> {
    let before = ids(module);
    let after = ids(&module.clone().map(&mut FreshIds));
    before
        .into_iter()
        .zip(after)
        .filter(|((path, id, _), (path_after, id_after, _))| path == path_after && id == id_after)
        .map(|((path, _, shape), _)| BufferSpec { path, shape })
        .collect()
}

/// Folds every `RunningState`'s pending updates into its value (clones share the state).
fn fold_pending_updates<B: Backend, M: Module<B>>(module: &M) {
    drop(module.clone().into_record());
}

/// Reads the buffers `specs` names from a module.
struct Reader<'a> {
    wanted: HashMap<&'a str, usize>,
    values: Vec<Option<Vec<f32>>>,
    error: Option<String>,
}

impl<B: Backend> VisitAt<B> for Reader<'_> {
    fn visit_float_at<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
        let Some(&k) = self.wanted.get(path) else {
            return;
        };
        match param.val().into_data().convert::<f32>().into_vec::<f32>() {
            Ok(values) => self.values[k] = Some(values),
            Err(e) => {
                self.error
                    .get_or_insert(format!("reading buffer `{path}`: {e:?}"));
            }
        }
    }
}

/// The current values of the module's buffers `specs`, in their order, each checked against
/// its spec's shape. Local: reads this rank's module only.
pub(crate) fn read_buffers<B: Backend, M: Module<B>>(
    module: &M,
    specs: &[BufferSpec],
) -> Result<Vec<NamedParam>, HsdpError> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    fold_pending_updates(module);
    let mut reader = Reader {
        wanted: index(specs),
        values: vec![None; specs.len()],
        error: None,
    };
    visit_at(module, &mut reader);
    if let Some(e) = reader.error {
        return Err(HsdpError::Unsupported(e));
    }
    specs
        .iter()
        .zip(reader.values)
        .map(|(spec, values)| match values {
            Some(values) if values.len() == spec.numel() => Ok(NamedParam {
                path: spec.path.clone(),
                shape: spec.shape.clone(),
                values,
            }),
            Some(values) => Err(HsdpError::Unsupported(format!(
                "buffer `{}` holds {} values; it was {:?} at shard",
                spec.path,
                values.len(),
                spec.shape
            ))),
            None => Err(missing(&spec.path)),
        })
        .collect()
}

/// Writes values into the buffers at their paths.
struct Writer<'a> {
    values: HashMap<&'a str, &'a NamedParam>,
    written: usize,
    error: Option<String>,
}

impl<B: Backend> MapAt<B> for Writer<'_> {
    fn map_float_at<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        let Some(new) = self.values.get(path) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        if tensor.dims().as_slice() != new.shape.as_slice() {
            self.error.get_or_insert(format!(
                "buffer `{path}` has shape {:?} in the module and {:?} in the values given",
                tensor.dims(),
                new.shape
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        self.written += 1;
        let data = TensorData::new(new.values.clone(), new.shape.clone());
        let value = Tensor::<B, D>::from_data(data, &tensor.device());
        Param::from_mapped_value(id, value, mapper)
    }
}

/// The module with the buffers `specs` names set to `values` (one per spec, by path). Local.
pub(crate) fn write_buffers<B: Backend, M: Module<B>>(
    module: M,
    specs: &[BufferSpec],
    values: &[NamedParam],
) -> Result<M, HsdpError> {
    let given: HashMap<&str, &NamedParam> = values.iter().map(|v| (v.path.as_str(), v)).collect();
    if let Some(v) = values
        .iter()
        .find(|v| !specs.iter().any(|s| s.path == v.path))
    {
        return Err(HsdpError::Unsupported(format!(
            "`{}` is not a buffer of this model",
            v.path
        )));
    }
    if let Some(s) = specs.iter().find(|s| !given.contains_key(s.path.as_str())) {
        return Err(HsdpError::Unsupported(format!(
            "no value given for buffer `{}`",
            s.path
        )));
    }
    if let Some(v) = values
        .iter()
        .find(|v| v.values.len() != v.shape.iter().product::<usize>())
    {
        return Err(HsdpError::Unsupported(format!(
            "buffer `{}`: {} values for shape {:?}",
            v.path,
            v.values.len(),
            v.shape
        )));
    }
    if specs.is_empty() {
        return Ok(module);
    }
    fold_pending_updates(&module);
    let mut writer = Writer {
        values: given,
        written: 0,
        error: None,
    };
    let module = map_at(module, &mut writer);
    match writer.error {
        Some(e) => Err(HsdpError::Unsupported(e)),
        None if writer.written != specs.len() => Err(HsdpError::Unsupported(format!(
            "the module holds {} of the model's {} buffers",
            writer.written,
            specs.len()
        ))),
        None => Ok(module),
    }
}

fn index(specs: &[BufferSpec]) -> HashMap<&str, usize> {
    specs
        .iter()
        .enumerate()
        .map(|(k, s)| (s.path.as_str(), k))
        .collect()
}

fn missing(path: &str) -> HsdpError {
    HsdpError::Unsupported(format!(
        "the module has no buffer `{path}`: it is not the module that was sharded"
    ))
}
