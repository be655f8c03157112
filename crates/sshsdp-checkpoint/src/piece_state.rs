//! Checkpoints of [`ShardedOptimizer`], whose state is one record per bucket
//! piece: saving cuts each piece's state arrays into its units; loading assembles the units of
//! a piece back into one array per state field (padding elements zero) and decodes the record.

use std::collections::{BTreeMap, HashMap};

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use sshsdp_optim::{ShardedOptimizer, UpdateUnit};

use crate::{decode_state, encode_state, CheckpointError, EncodedState, UnitState};

/// A [`ShardedOptimizer`] with the buffers a load assembles piece states in.
pub struct PieceStates<'a, B: Backend, O: SimpleOptimizer<B>> {
    optimizer: &'a mut ShardedOptimizer<B, O>,
    pending: HashMap<usize, Pending>,
}

/// State arrays of one unit, by field name.
type UnitArrays = BTreeMap<String, Vec<f32>>;

/// The units of one piece read so far.
#[derive(Default)]
struct Pending {
    units: Vec<(std::ops::Range<usize>, UnitArrays)>,
    scalars: BTreeMap<String, f64>,
}

impl<'a, B: Backend, O: SimpleOptimizer<B>> PieceStates<'a, B, O> {
    /// Wraps `optimizer` for [`crate::save`] and [`crate::load`].
    pub fn new(optimizer: &'a mut ShardedOptimizer<B, O>) -> Self {
        Self {
            optimizer,
            pending: HashMap::new(),
        }
    }
}

impl<B: Backend, O: SimpleOptimizer<B>> UnitState for PieceStates<'_, B, O> {
    fn optimizer_name(&self) -> Option<String> {
        Some(format!("ShardedOptimizer<{}>", std::any::type_name::<O>()))
    }

    fn export_unit(&self, unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError> {
        let Some(state) = self.optimizer.piece_state(unit.bucket) else {
            return Ok(None);
        };
        let (arrays, scalars) = encode_state::<B, _>(state.clone())?;
        let arrays = arrays
            .into_iter()
            .map(|(name, values)| (name, values[unit.in_piece.clone()].to_vec()))
            .collect();
        Ok(Some((arrays, scalars)))
    }

    fn import_unit(
        &mut self,
        unit: &UpdateUnit,
        state: Option<EncodedState>,
    ) -> Result<(), CheckpointError> {
        let pending = self.pending.entry(unit.bucket).or_default();
        if let Some((arrays, scalars)) = state {
            pending.units.push((unit.in_piece.clone(), arrays));
            pending.scalars.extend(scalars);
        }
        Ok(())
    }

    fn finish_import(&mut self, pieces: &[(usize, usize)]) -> Result<(), CheckpointError> {
        for &(bucket, len) in pieces {
            let pending = self.pending.remove(&bucket).unwrap_or_default();
            if pending.units.is_empty() {
                self.optimizer.set_piece_state(bucket, None);
                continue;
            }
            let mut arrays: BTreeMap<String, Vec<f32>> = BTreeMap::new();
            for (range, unit_arrays) in pending.units {
                for (name, values) in unit_arrays {
                    arrays.entry(name).or_insert_with(|| vec![0.0; len])[range.clone()]
                        .copy_from_slice(&values);
                }
            }
            let device = self.optimizer.device().clone();
            let state = decode_state::<B, O::State<1>>(&arrays, &pending.scalars, len, &device)?;
            self.optimizer.set_piece_state(bucket, Some(state));
        }
        Ok(())
    }
}
