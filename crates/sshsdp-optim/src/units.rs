//! Update units: the part of one parameter that lies in one of this rank's pieces.
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

use burn::tensor::backend::Backend;
use sshsdp_backend::HsdpRuntime;
use sshsdp_plan::Role;

/// The part of one parameter that lies in one piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpdateUnit {
    /// Index of the parameter in the plan.
    pub param: usize,
    /// Index of the piece among the pieces handed to the update.
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
    /// Its elements' indices in the parameter (row-major), in the order of `in_piece`.
    pub fn param_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.runs.iter().flat_map(|r| r.clone())
    }
}

/// The units of the pieces `(bucket, first element, length)`, piece by piece in parameter
/// order: the plan's update views of each piece.
pub fn units_of<B: Backend>(
    runtime: &HsdpRuntime<B>,
    pieces: impl IntoIterator<Item = (usize, usize, usize)>,
) -> Vec<UpdateUnit> {
    let plan = runtime.plan();
    let mut units = Vec::new();
    for (piece, (bucket, start, len)) in pieces.into_iter().enumerate() {
        let b = &plan.buckets()[bucket];
        let piece_elements = b.piece_elements as usize;
        let index = start / piece_elements.max(1);
        debug_assert_eq!(len, piece_elements);
        for view in &b.views[index] {
            let at = view.master_offset as usize;
            let runs: Vec<Range<usize>> = view
                .runs()
                .into_iter()
                .map(|(run, _)| run.start as usize..run.end as usize)
                .collect();
            units.push(UpdateUnit {
                param: view.param,
                piece,
                bucket,
                in_piece: at..at + view.len() as usize,
                runs,
                role: plan.params()[view.param].spec.role,
            });
        }
    }
    units
}
