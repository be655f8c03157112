//! Update units: the part of one parameter that lies in one of this rank's pieces.
//!
//! A piece is a contiguous run of a bucket's element space; the plan's update views say which
//! contiguous run of which parameter sits where in it. These slices are what optimizers step
//! (element-wise rules) or exchange (Muon's split matrices).

use std::ops::Range;

use burn::tensor::backend::Backend;
use sshsdp_backend::HsdpRuntime;
use sshsdp_plan::Role;

/// One parameter's slice in one piece.
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
    /// Positions of the slice in the parameter (row-major).
    pub in_param: Range<usize>,
    /// The parameter's optimizer role.
    pub role: Role,
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
            let first = view.elements.start as usize;
            units.push(UpdateUnit {
                param: view.param,
                piece,
                bucket,
                in_piece: at..at + view.len() as usize,
                in_param: first..first + view.len() as usize,
                role: plan.params()[view.param].spec.role,
            });
        }
    }
    units
}
