//! Update units: the part of one parameter that lies in one of this rank's pieces.
//!
//! A piece is a contiguous run of a bucket's element space; a parameter sits in it as one or more
//! segments (one in the f32/bf16 runtime formats, one band or chunk per piece in MXFP8), each a
//! contiguous run of the parameter, so a piece holds at most one contiguous slice of each
//! parameter per segment. These slices are what optimizers step (element-wise rules) or exchange
//! (Muon's split matrices).

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
/// order.
pub fn units_of<B: Backend>(
    runtime: &HsdpRuntime<B>,
    pieces: impl IntoIterator<Item = (usize, usize, usize)>,
) -> Vec<UpdateUnit> {
    let plan = runtime.plan();
    let mut units = Vec::new();
    for (piece, (bucket, start, len)) in pieces.into_iter().enumerate() {
        let end = start + len;
        for param in plan.buckets()[bucket].params.clone() {
            for segment in runtime.param_segments(param) {
                let lo = segment.bucket.max(start);
                let hi = (segment.bucket + segment.len).min(end);
                if lo >= hi {
                    continue;
                }
                let in_param = segment.param + lo - segment.bucket;
                units.push(UpdateUnit {
                    param,
                    piece,
                    bucket,
                    in_piece: lo - start..hi - start,
                    in_param: in_param..in_param + (hi - lo),
                    role: plan.params()[param].spec.role,
                });
            }
        }
    }
    units
}
