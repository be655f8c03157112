//! A rank's part of a sharded model's checkpoint: its shard (the fp32 masters and the
//! optimizer state of its update units) and, when loading, its units' values assembled from
//! whichever old shards cover them and then applied. The collective protocols around these
//! are [`crate::save`] and [`crate::load`].
//!
//! Scalars of the optimizer state (Adam's step count) belong to one parameter; they are kept
//! under `{path}#{name}` in the shard's scalars, and ranks holding slices of the same
//! parameter must agree on them.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use sshsdp_backend::HsdpRuntime;

use crate::{with_prefix, CheckpointError, Coverage, EncodedState, ShardFile, SliceEntry, MASTER};
use sshsdp_plan::UpdateUnit;

/// Prefix of optimizer state arrays and scalars in a checkpoint.
const STATE: &str = "state.";
/// Prefix of the scalar naming the optimizer a checkpoint was saved with.
const OPTIMIZER: &str = "optimizer=";
/// The training step counter in a shard's scalars.
pub const STEP: &str = "step";

/// Optimizer state that can be saved and re-sharded per update unit (one slice of one
/// parameter on this rank).
pub trait UnitState {
    /// The state of `unit` (`None` before its first step); arrays have the unit's length.
    fn export_unit(&self, unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError>;
    /// Sets the state of `unit` (`None`: no state yet). Called for every unit of this rank,
    /// then [`UnitState::finish_import`].
    fn import_unit(
        &mut self,
        unit: &UpdateUnit,
        state: Option<EncodedState>,
    ) -> Result<(), CheckpointError>;
    /// What this state belongs to (e.g. the optimizer's type), recorded by [`crate::save`];
    /// [`crate::load`] refuses a checkpoint saved with another. `None` accepts any (weights
    /// only).
    fn optimizer_name(&self) -> Option<String> {
        None
    }

    /// After every unit was imported; `pieces` are this rank's `(bucket, piece length)`.
    fn finish_import(&mut self, pieces: &[(usize, usize)]) -> Result<(), CheckpointError> {
        let _ = pieces;
        Ok(())
    }
}

/// No optimizer state: a checkpoint of the weights alone.
pub struct WeightsOnly;

impl UnitState for WeightsOnly {
    fn export_unit(&self, _unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError> {
        Ok(None)
    }

    fn import_unit(
        &mut self,
        _unit: &UpdateUnit,
        _state: Option<EncodedState>,
    ) -> Result<(), CheckpointError> {
        Ok(())
    }
}

/// One bucket's fp32 master piece on this rank, as host elements.
struct MasterPiece<'a> {
    bucket: usize,
    index: usize,
    master: &'a mut [f32],
}

/// Runs `f` on every master piece (host slices; the runtime stages device masters) and carries
/// a checkpoint error out of the runtime's closure. A collective call: `f`'s error does not
/// fail the runtime's call, so every rank still completes it (the rebuild of the runtime
/// shards is a collective).
fn on_masters<B: Backend>(
    runtime: &HsdpRuntime<B>,
    f: impl FnOnce(&mut [MasterPiece<'_>]) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    let mut inner = None;
    let outer = runtime.master_pieces(|pieces, _| {
        let mut masters = Vec::with_capacity(pieces.len());
        for p in pieces.iter_mut() {
            let (bucket, index) = (p.bucket, p.index);
            let (master, _) = p.host()?;
            masters.push(MasterPiece {
                bucket,
                index,
                master,
            });
        }
        if let Err(e) = f(&mut masters) {
            inner = Some(e);
        }
        Ok(())
    });
    match (inner, outer) {
        (Some(e), _) => Err(e),
        (None, Err(e)) => Err(CheckpointError::Runtime(e)),
        (None, Ok(())) => Ok(()),
    }
}

/// This rank's shard of the checkpoint: fp32 masters, `optimizer`'s state and `step`. A
/// collective call (the runtime shards are rebuilt after reading the masters).
pub(crate) fn build_shard<B: Backend>(
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    step: u64,
) -> Result<ShardFile, CheckpointError> {
    let plan = runtime.plan();
    let mut slices = Vec::new();
    let mut scalars = BTreeMap::from([(STEP.to_string(), step as f64)]);
    if let Some(name) = optimizer.optimizer_name() {
        scalars.insert(format!("{OPTIMIZER}{name}"), 1.0);
    }
    on_masters(runtime, |pieces| {
        let units = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))
            .map_err(|e| CheckpointError::Runtime(e.into()))?;
        for unit in units {
            let spec = &plan.params()[unit.param].spec;
            let mut arrays = BTreeMap::from([(
                MASTER.to_string(),
                pieces[unit.piece].master[unit.in_piece.clone()].to_vec(),
            )]);
            if let Some((state_arrays, state_scalars)) = optimizer.export_unit(&unit)? {
                arrays.extend(with_prefix(state_arrays, STATE));
                for (name, value) in state_scalars {
                    scalars.insert(format!("{}#{STATE}{name}", spec.path), value);
                }
            }
            // One slice per row-major run of the unit, each with its part of every array.
            let mut at = 0;
            for run in &unit.runs {
                let part = |array: &Vec<f32>| array.get(at..at + run.len()).map(<[f32]>::to_vec);
                let arrays = arrays
                    .iter()
                    .map(|(name, array)| {
                        let values = part(array).ok_or_else(|| {
                            CheckpointError::Runtime(sshsdp_backend::HsdpError::Failed(format!(
                                "'{}': the optimizer's array '{name}' holds {} values for a \
                                 slice of {}",
                                spec.path,
                                array.len(),
                                unit.in_piece.len()
                            )))
                        })?;
                        Ok((name.clone(), values))
                    })
                    .collect::<Result<_, CheckpointError>>()?;
                slices.push(SliceEntry {
                    path: spec.path.clone(),
                    shape: spec.shape.clone(),
                    start: run.start,
                    end: run.end,
                    arrays,
                });
                at += run.len();
            }
        }
        Ok(())
    })?;
    Ok(ShardFile {
        rank: runtime.rank(),
        world: plan.mesh().world_size(),
        plan_json: plan.to_json(),
        slices,
        scalars,
    })
}

/// This rank's update units, in piece order. A collective call that changes nothing (the
/// runtime shards are rebuilt as they were).
pub(crate) fn layout<B: Backend>(
    runtime: &HsdpRuntime<B>,
) -> Result<Vec<UpdateUnit>, CheckpointError> {
    let mut units = Vec::new();
    on_masters(runtime, |pieces| {
        units = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))
            .map_err(|e| CheckpointError::Runtime(e.into()))?;
        Ok(())
    })?;
    Ok(units)
}

/// One update unit's values to load: its master slice and its optimizer state.
pub(crate) struct UnitValues {
    /// The unit's master weights.
    pub(crate) master: Vec<f32>,
    /// Its optimizer state (`None`: no state saved).
    pub(crate) state: Option<EncodedState>,
}

/// The checkpoint's values for each of `units` from the old shards `files` (read from
/// `dir`, indexed by `coverage`), checking that the checkpoint holds exactly this model's parameters and shapes and
/// `optimizer`'s state. Touches nothing; returns the values and the saved step.
pub(crate) fn assemble_units<B: Backend>(
    dir: &Path,
    (files, coverage): (&[ShardFile], &Coverage<'_>),
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    units: &[UpdateUnit],
) -> Result<(Vec<UnitValues>, u64), CheckpointError> {
    let plan = runtime.plan();
    let mismatch = |reason: String| CheckpointError::Mismatch {
        file: dir.to_path_buf(),
        reason,
    };
    for p in plan.params() {
        match coverage.shape(&p.spec.path) {
            Some(shape) if shape == p.spec.shape.as_slice() => {}
            Some(shape) => {
                return Err(mismatch(format!(
                    "parameter '{}' has shape {shape:?} in the checkpoint and {:?} in the model",
                    p.spec.path, p.spec.shape
                )))
            }
            None => {
                return Err(mismatch(format!(
                    "the checkpoint has no parameter '{}'",
                    p.spec.path
                )))
            }
        }
    }
    // (A model buffer held as a parameter was saved before buffers were told apart:
    // `assemble_buffers` reads it.)
    let is_buffer = |path: &str| runtime.buffers().iter().any(|b| b.path == path);
    if let Some((path, _)) = coverage
        .params()
        .find(|(path, _)| plan.param_index(path).is_none() && !is_buffer(path))
    {
        return Err(mismatch(format!(
            "the checkpoint's parameter '{path}' is not in the model"
        )));
    }
    let scalars = merged_scalars(files, dir)?;
    if let Some(ours) = optimizer.optimizer_name() {
        let saved: Vec<&str> = scalars
            .keys()
            .filter_map(|k| k.strip_prefix(OPTIMIZER))
            .collect();
        if saved.iter().any(|s| *s != ours) {
            return Err(mismatch(format!(
                "the checkpoint holds the state of {saved:?}, not of {ours}; load the weights \
                 alone with `WeightsOnly` to change optimizers"
            )));
        }
    }
    let step = scalars
        .get(STEP)
        .copied()
        .ok_or_else(|| mismatch("no step counter".into()))?;
    // Saved from a `u64`: a whole number in [0, 2^64). (An `as` cast would read NaN, -1 or 0.5
    // as some step silently.)
    if step.fract() != 0.0 || !(0.0..18_446_744_073_709_551_616.0).contains(&step) {
        return Err(mismatch(format!(
            "the step counter {step} is not a whole number of steps"
        )));
    }
    let mut values = Vec::with_capacity(units.len());
    for unit in units {
        let path = &plan.params()[unit.param].spec.path;
        // The unit's runs, one after the other (the order of its elements in the piece).
        let mut entry = coverage.assemble_slice(path, unit.runs[0].start, unit.runs[0].end)?;
        for run in &unit.runs[1..] {
            let next = coverage.assemble_slice(path, run.start, run.end)?;
            if next.arrays.len() != entry.arrays.len() {
                return Err(mismatch(format!(
                    "'{path}': elements {}..{} hold other arrays than the rest of the slice",
                    run.start, run.end
                )));
            }
            for (name, values) in next.arrays {
                entry
                    .arrays
                    .get_mut(&name)
                    .ok_or_else(|| mismatch(format!("'{path}': no array '{name}' elsewhere")))?
                    .extend(values);
            }
        }
        let master = entry
            .arrays
            .remove(MASTER)
            .ok_or_else(|| mismatch(format!("no master weights for '{path}'")))?;
        let arrays = crate::strip_prefix(&entry.arrays, STATE);
        let state_scalars = crate::strip_prefix(&scalars, &format!("{path}#{STATE}"));
        let state =
            (!arrays.is_empty() || !state_scalars.is_empty()).then_some((arrays, state_scalars));
        values.push(UnitValues { master, state });
    }
    Ok((values, step as u64))
}

/// Applies assembled values: imports every unit's optimizer state, then — only when all of
/// that succeeded — overwrites the masters. A collective call. `units` must be this rank's
/// ([`layout`]); an error leaves the masters untouched.
pub(crate) fn apply<B: Backend>(
    runtime: &HsdpRuntime<B>,
    optimizer: &mut impl UnitState,
    units: &[UpdateUnit],
    values: Vec<UnitValues>,
) -> Result<(), CheckpointError> {
    on_masters(runtime, |pieces| {
        let now = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))
            .map_err(|e| CheckpointError::Runtime(e.into()))?;
        if now != units || values.len() != units.len() {
            return Err(CheckpointError::Invalid(
                "this rank's pieces changed during the load".into(),
            ));
        }
        let mut masters = Vec::with_capacity(values.len());
        for (unit, v) in units.iter().zip(values) {
            optimizer.import_unit(unit, v.state)?;
            masters.push(v.master);
        }
        let lengths: Vec<(usize, usize)> =
            pieces.iter().map(|p| (p.bucket, p.master.len())).collect();
        optimizer.finish_import(&lengths)?;
        for (unit, master) in units.iter().zip(&masters) {
            let target = &mut pieces[unit.piece].master[unit.in_piece.clone()];
            if target.len() != master.len() {
                return Err(CheckpointError::Invalid(format!(
                    "unit of {} elements assembled with {}",
                    target.len(),
                    master.len()
                )));
            }
        }
        for (unit, master) in units.iter().zip(masters) {
            pieces[unit.piece].master[unit.in_piece.clone()].copy_from_slice(&master);
        }
        Ok(())
    })
}

/// Every shard's scalars in one map; a name held by several shards must have one value.
fn merged_scalars(
    files: &[ShardFile],
    dir: &Path,
) -> Result<BTreeMap<String, f64>, CheckpointError> {
    let mut merged = BTreeMap::new();
    for file in files {
        for (name, &value) in &file.scalars {
            if let Some(&seen) = merged.get(name) {
                if f64::to_bits(seen) != f64::to_bits(value) {
                    return Err(CheckpointError::Mismatch {
                        file: dir.join(file.file_name()),
                        reason: format!("scalar '{name}' is {value} here and {seen} elsewhere"),
                    });
                }
            } else {
                merged.insert(name.clone(), value);
            }
        }
    }
    Ok(merged)
}
