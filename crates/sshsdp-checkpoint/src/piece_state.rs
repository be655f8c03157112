//! Checkpoints of [`ShardedOptimizer`], whose state is one record per update unit (a
//! parameter's part of this rank's piece): saving writes each unit's state arrays and scalars;
//! loading decodes each unit's record from its arrays, re-sharded to the unit's new extent.
//!
//! Checkpoints written when the optimizer kept one record per piece hold the same thing — each
//! unit's slice of the piece's arrays, and the piece's scalars (the step count every unit of the
//! piece shared) — so they load unchanged.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use sshsdp_optim::{ShardedOptimizer, UpdateUnit};

use crate::{decode_state, encode_state, CheckpointError, EncodedState, UnitState};

/// A [`ShardedOptimizer`] as [`crate::save`] and [`crate::load`] read and write it.
pub struct PieceStates<'a, B: Backend, O: SimpleOptimizer<B>> {
    optimizer: &'a mut ShardedOptimizer<B, O>,
}

impl<'a, B: Backend, O: SimpleOptimizer<B>> PieceStates<'a, B, O> {
    /// Wraps `optimizer` for [`crate::save`] and [`crate::load`].
    pub fn new(optimizer: &'a mut ShardedOptimizer<B, O>) -> Self {
        Self { optimizer }
    }
}

impl<B: Backend, O: SimpleOptimizer<B>> UnitState for PieceStates<'_, B, O> {
    fn optimizer_name(&self) -> Option<String> {
        Some(format!("ShardedOptimizer<{}>", std::any::type_name::<O>()))
    }

    fn export_unit(&self, unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError> {
        match self.optimizer.param_state(unit.param)? {
            Some(state) => Ok(Some(encode_state::<B, _>(state)?)),
            None => Ok(None),
        }
    }

    fn import_unit(
        &mut self,
        unit: &UpdateUnit,
        state: Option<EncodedState>,
    ) -> Result<(), CheckpointError> {
        let state = match state {
            None => None,
            Some((arrays, scalars)) => {
                let len = unit.in_piece.len();
                let device = self.optimizer.device().clone();
                Some(decode_state::<B, O::State<1>>(
                    &arrays, &scalars, len, &device,
                )?)
            }
        };
        Ok(self.optimizer.set_param_state(unit.param, state)?)
    }
}
