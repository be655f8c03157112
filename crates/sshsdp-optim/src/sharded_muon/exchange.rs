//! The exchange of split Muon matrices (cut by a piece boundary): each holder's rows to the
//! matrix's Newton–Schulz owner and the orthogonalised rows back, as described in the parent
//! module's docs.

use std::collections::HashMap;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use sshsdp_backend::{HsdpError, HsdpRuntime, UpdateGroup};

use sshsdp_plan::Role;

use super::{MuonExchange, MuonStepStats, ShardedMuon};
use crate::UpdateUnit;

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// First half of the exchange of split matrices: this rank's slices `mine` (sorted by
    /// parameter) go to their Newton–Schulz owners; returns the split matrices this rank owns,
    /// assembled from every holder's rows, in plan order.
    pub(super) fn send_to_owners<R: Backend>(
        &self,
        runtime: &HsdpRuntime<R>,
        group: &UpdateGroup<'_>,
        mine: &[(UpdateUnit, Vec<f32>)],
        stats: &mut MuonStepStats,
    ) -> Result<Vec<(usize, Vec<f32>)>, HsdpError> {
        let plan = runtime.plan();
        let split = split_matrices(plan, group);
        if split.is_empty() {
            // The same plan on every rank: nobody exchanges.
            return Ok(Vec::new());
        }
        let me = group.piece();
        let numel = |param: usize| plan.params()[param].spec.numel() as usize;
        stats.exchanged_elements = split.iter().map(|m| numel(m.param) as u64).sum();
        match self.exchange {
            MuonExchange::OwnerAllToAll => {
                let mut send = vec![Vec::new(); group.pieces()];
                for (unit, u) in mine {
                    send[owner(plan, unit.param)?].extend_from_slice(u);
                }
                let mut expect = vec![0; group.pieces()];
                for m in split.iter().filter(|m| m.owner == me) {
                    for (q, r) in &m.holders {
                        expect[*q] += r.len();
                    }
                }
                count_exchange(stats, &lens(&send), &expect, me);
                let got = group.exchange(send, &expect)?;
                let mut at = vec![0; group.pieces()];
                Ok(split
                    .iter()
                    .filter(|m| m.owner == me)
                    .map(|m| {
                        let mut u = vec![0f32; numel(m.param)];
                        for (q, r) in &m.holders {
                            u[r.clone()].copy_from_slice(&got[*q][at[*q]..at[*q] + r.len()]);
                            at[*q] += r.len();
                        }
                        (m.param, u)
                    })
                    .collect())
            }
            MuonExchange::AllReduce => {
                // Every split matrix dense in one buffer (each holder writes its rows), summed.
                let offsets = dense_offsets(&split, plan);
                let mut buf = vec![0f32; offsets.1];
                for (unit, u) in mine {
                    let base = offsets.0[&unit.param];
                    let at = unit.param_indices().map(|i| base + i);
                    at.zip(u).for_each(|(at, &x)| buf[at] = x);
                }
                let all = group.all_reduce_sum(buf)?;
                Ok(split
                    .iter()
                    .filter(|m| m.owner == me)
                    .map(|m| {
                        let at = offsets.0[&m.param];
                        (m.param, all[at..at + numel(m.param)].to_vec())
                    })
                    .collect())
            }
        }
    }

    /// Second half: the owned split matrices' results `owned` (plan order, as
    /// [`Self::send_to_owners`] returned them) go back to their holders; returns this rank's rows of
    /// each slice in `mine`.
    pub(super) fn return_to_holders<R: Backend>(
        &self,
        runtime: &HsdpRuntime<R>,
        group: &UpdateGroup<'_>,
        mine: &[(UpdateUnit, Vec<f32>)],
        owned: Vec<(usize, Vec<f32>)>,
        stats: &mut MuonStepStats,
    ) -> Result<Vec<Vec<f32>>, HsdpError> {
        let plan = runtime.plan();
        let split = split_matrices(plan, group);
        if split.is_empty() {
            return Ok(Vec::new());
        }
        let me = group.piece();
        match self.exchange {
            MuonExchange::OwnerAllToAll => {
                let holders: HashMap<usize, &SplitMatrix> =
                    split.iter().map(|m| (m.param, m)).collect();
                let mut back = vec![Vec::new(); group.pieces()];
                for (param, o) in &owned {
                    for (q, r) in &holders[param].holders {
                        back[*q].extend_from_slice(&o[r.clone()]);
                    }
                }
                let mut expect = vec![0; group.pieces()];
                for (unit, _) in mine {
                    expect[owner(plan, unit.param)?] += unit.in_piece.len();
                }
                count_exchange(stats, &lens(&back), &expect, me);
                let got = group.exchange(back, &expect)?;
                let mut at = vec![0; group.pieces()];
                mine.iter()
                    .map(|(unit, _)| {
                        let o = owner(plan, unit.param)?;
                        let rows = got[o][at[o]..at[o] + unit.in_piece.len()].to_vec();
                        at[o] += unit.in_piece.len();
                        Ok(rows)
                    })
                    .collect()
            }
            MuonExchange::AllReduce => {
                let offsets = dense_offsets(&split, plan);
                let mut buf = vec![0f32; offsets.1];
                for (param, o) in &owned {
                    let at = offsets.0[param];
                    buf[at..at + o.len()].copy_from_slice(o);
                }
                let all = group.all_reduce_sum(buf)?;
                Ok(mine
                    .iter()
                    .map(|(unit, _)| {
                        let at = offsets.0[&unit.param];
                        unit.param_indices().map(|i| all[at + i]).collect()
                    })
                    .collect())
            }
        }
    }
}

/// A split matrix: its owner and the rows each piece holds.
pub(super) struct SplitMatrix {
    /// Plan index.
    pub(super) param: usize,
    /// The piece that orthogonalises it.
    pub(super) owner: usize,
    /// `(piece, elements of the matrix)` of every holder, in piece order.
    pub(super) holders: Vec<(usize, std::ops::Range<usize>)>,
}

/// Every split Muon matrix of `plan` that received a gradient in this step, in plan order, with
/// its holders among the update group's pieces.
pub(super) fn split_matrices(
    plan: &sshsdp_plan::Plan,
    group: &UpdateGroup<'_>,
) -> Vec<SplitMatrix> {
    let pieces = group.pieces();
    plan.params()
        .iter()
        .enumerate()
        .filter(|(i, p)| p.spec.role == Role::Matrix && p.split && group.received_gradient(*i))
        .map(|(i, p)| {
            let views = &plan.buckets()[p.bucket].views;
            let holders = (0..pieces.min(views.len()))
                .flat_map(|q| {
                    views[q]
                        .iter()
                        .filter(|v| v.param == i)
                        .flat_map(|v| v.runs())
                        .map(move |(run, _)| (q, run.start as usize..run.end as usize))
                })
                .collect();
            SplitMatrix {
                param: i,
                owner: p.ns_owner.unwrap_or(usize::MAX),
                holders,
            }
        })
        .collect()
}

/// The plan's Newton–Schulz owner of split matrix `param`.
pub(super) fn owner(plan: &sshsdp_plan::Plan, param: usize) -> Result<usize, HsdpError> {
    plan.params()[param].ns_owner.ok_or_else(|| {
        HsdpError::Failed(format!("split matrix {param} has no Newton–Schulz owner"))
    })
}

/// Each split matrix's offset in a dense buffer of all of them (plan order), and its length.
pub(super) fn dense_offsets(
    split: &[SplitMatrix],
    plan: &sshsdp_plan::Plan,
) -> (HashMap<usize, usize>, usize) {
    let mut at = 0;
    let offsets = split
        .iter()
        .map(|m| {
            let here = at;
            at += plan.params()[m.param].spec.numel() as usize;
            (m.param, here)
        })
        .collect();
    (offsets, at)
}

/// Adds an exchange's off-rank elements to `stats`: `send[q]` elements go to piece `q`,
/// `expect[q]` come from it; this rank is piece `me`.
pub(super) fn count_exchange(
    stats: &mut MuonStepStats,
    send: &[usize],
    expect: &[usize],
    me: usize,
) {
    let others = |q: &usize| *q != me;
    stats.sent_elements += (0..send.len())
        .filter(others)
        .map(|q| send[q] as u64)
        .sum::<u64>();
    stats.received_elements += (0..expect.len())
        .filter(others)
        .map(|q| expect[q] as u64)
        .sum::<u64>();
}

/// Each chunk's length.
fn lens(chunks: &[Vec<f32>]) -> Vec<usize> {
    chunks.iter().map(Vec::len).collect()
}
