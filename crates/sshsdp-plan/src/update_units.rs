//! Update units: the part of one parameter that lies in one piece — the update layout every
//! optimizer and checkpoint reads, made here from the plan's update views ([`UpdateView`]).
//!
//! A piece is a contiguous run of a bucket's element space; the plan's update views say which
//! elements of which parameter sit where in it. A unit is one view: a contiguous range of the
//! piece's elements holding, in order, the parameter's row-major runs (one for f32/bf16 views; an
//! MXFP8 view's tiles are up to one run per row of a partial band). Units are what optimizers
//! step (element-wise rules on the contiguous range), exchange (Muon's split matrices, placed by
//! their runs) and checkpoints save (one slice per run, keyed by its row-major element range).
//! A rank's piece holds at most one view of each parameter, so optimizer state keyed by
//! parameter is one record per unit.

use std::ops::Range;

use crate::layout::UpdateView;
use crate::{Plan, PlanError, Role};

/// The part of one parameter that lies in one piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpdateUnit {
    /// Index of the parameter in the plan.
    pub param: usize,
    /// Position of the piece in the list the units were made from (the pieces an update
    /// hands out, in order).
    pub piece: usize,
    /// The bucket the piece belongs to.
    pub bucket: usize,
    /// Positions of the slice in the piece's master and gradient.
    pub in_piece: Range<usize>,
    /// Its elements in the parameter: ascending row-major runs, whose concatenation is
    /// `in_piece`'s order.
    pub runs: Vec<Range<usize>>,
    /// The parameter's optimizer role.
    pub role: Role,
}

impl UpdateUnit {
    /// The unit of `view`, the `piece`-th of a list of pieces.
    fn of(plan: &Plan, view: &UpdateView, piece: usize) -> Self {
        let at = view.master_offset as usize;
        UpdateUnit {
            param: view.param,
            piece,
            bucket: view.bucket,
            in_piece: at..at + view.len() as usize,
            runs: view
                .runs()
                .into_iter()
                .map(|(run, _)| run.start as usize..run.end as usize)
                .collect(),
            role: plan.params()[view.param].spec.role,
        }
    }

    /// Its elements' indices in the parameter (row-major), in the order of `in_piece`.
    pub fn param_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.runs.iter().flat_map(|r| r.clone())
    }
}

impl Plan {
    /// The units of `pieces` — `(bucket, piece index)`, as an update hands its pieces out —
    /// piece by piece in parameter order.
    pub fn update_units(
        &self,
        pieces: impl IntoIterator<Item = (usize, usize)>,
    ) -> Result<Vec<UpdateUnit>, PlanError> {
        let mut units = Vec::new();
        for (at, (bucket, piece)) in pieces.into_iter().enumerate() {
            for view in self.piece_views(bucket, piece)? {
                units.push(UpdateUnit::of(self, view, at));
            }
        }
        Ok(units)
    }
}
