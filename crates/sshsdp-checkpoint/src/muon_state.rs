//! Checkpoints of [`ShardedMuon`]: one state per parameter slice (Muon's momentum for matrices,
//! the element-wise optimizer's record for the rest), saved and re-sharded per update unit.

use std::collections::BTreeMap;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use sshsdp_optim::{ParamState, ShardedMuon, UpdateUnit};
use sshsdp_plan::Role;

use crate::{decode_state, encode_state, CheckpointError, EncodedState, UnitState};

/// Name of a Muon momentum slice in a checkpoint's state arrays.
const MUON_MOMENTUM: &str = "muon.momentum";

impl<B: Backend, O: SimpleOptimizer<B>> UnitState for ShardedMuon<B, O> {
    fn optimizer_name(&self) -> Option<String> {
        Some(format!("ShardedMuon<{}>", std::any::type_name::<O>()))
    }

    fn export_unit(&self, unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError> {
        match self.param_state(unit.param)? {
            Some(ParamState::Momentum(m)) => {
                let arrays = BTreeMap::from([(MUON_MOMENTUM.to_string(), m)]);
                Ok(Some((arrays, BTreeMap::new())))
            }
            Some(ParamState::Elementwise(state)) => Ok(Some(encode_state::<B, _>(state)?)),
            None => Ok(None),
        }
    }

    fn import_unit(
        &mut self,
        unit: &UpdateUnit,
        state: Option<EncodedState>,
    ) -> Result<(), CheckpointError> {
        let (param, len) = (unit.param, unit.in_piece.len());
        let state = match state {
            None => None,
            Some((mut arrays, scalars)) => Some(match (arrays.remove(MUON_MOMENTUM), unit.role) {
                (Some(m), Role::Matrix) => ParamState::Momentum(m),
                (None, Role::Elementwise) => ParamState::Elementwise(
                    decode_state::<B, O::State<1>>(&arrays, &scalars, len, self.device())?,
                ),
                (Some(_), Role::Elementwise) => {
                    return Err(CheckpointError::RoleChanged {
                        param,
                        saved: "Muon momentum",
                        now: "element-wise",
                    })
                }
                (None, Role::Matrix) => {
                    return Err(CheckpointError::RoleChanged {
                        param,
                        saved: "element-wise optimizer",
                        now: "by Muon",
                    })
                }
            }),
        };
        Ok(self.set_param_state(param, state)?)
    }
}
