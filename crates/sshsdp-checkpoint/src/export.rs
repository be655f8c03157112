//! From a sharded checkpoint to an ordinary Burn module and back: [`apply_full`] writes an
//! unsharded model ([`super::export_full`]'s output, keyed by module path) into any Burn module
//! of the same structure, which Burn's own recorders then save as an unsharded record. The other
//! way needs nothing special: load a Burn record into the unsharded module and shard it.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::{CheckpointError, FullModel};

/// `module` with every float parameter and module buffer replaced by the values `full` holds
/// at its path (ids and `require_grad` kept; [`crate::export_full`] includes the buffers).
/// Every one must be in `full` with the same shape, and `full` must hold nothing else. Meant
/// for a freshly built module (a `RunningState` update still held back would overwrite it).
pub fn apply_full<B: Backend, M: Module<B>>(
    module: M,
    full: &FullModel,
) -> Result<M, CheckpointError> {
    struct Writer<'a> {
        full: &'a FullModel,
        path: Vec<String>,
        seen: usize,
        error: Option<CheckpointError>,
    }
    impl<B: Backend> ModuleMapper<B> for Writer<'_> {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }

        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let path = self.path.join(".");
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.dims().to_vec();
            match self.full.get(&path) {
                Some((s, values))
                    if *s == shape && values.len() == shape.iter().product::<usize>() =>
                {
                    self.seen += 1;
                    let device = tensor.device();
                    let require_grad = tensor.is_require_grad();
                    let data = TensorData::new(values.clone(), shape);
                    let mut new = Tensor::<B, D>::from_data(data, &device);
                    if require_grad {
                        new = new.require_grad();
                    }
                    Param::from_mapped_value(id, new, mapper)
                }
                found => {
                    self.error
                        .get_or_insert(CheckpointError::Invalid(match found {
                            Some((s, _)) => format!(
                            "parameter '{path}' has shape {s:?} in the checkpoint and {shape:?} \
                             in the module"
                        ),
                            None => format!("the checkpoint has no parameter '{path}'"),
                        }));
                    Param::from_mapped_value(id, tensor, mapper)
                }
            }
        }
    }
    let mut writer = Writer {
        full,
        path: Vec::new(),
        seen: 0,
        error: None,
    };
    let module = module.map(&mut writer);
    if let Some(e) = writer.error {
        return Err(e);
    }
    if writer.seen != full.len() {
        return Err(CheckpointError::Invalid(format!(
            "the checkpoint holds {} parameters, the module {}",
            full.len(),
            writer.seen
        )));
    }
    Ok(module)
}
