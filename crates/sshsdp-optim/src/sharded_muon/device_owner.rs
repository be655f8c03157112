//! The owner all-to-all-v of split Muon matrices on device pieces
//! ([`MuonExchange::OwnerAllToAll`](super::MuonExchange), where the update group moves device
//! memory itself: [`UpdateGroup::all_to_all_on_device`]): each holder sends its slices to the
//! matrix's Newton–Schulz owner, which assembles the matrix with one indexed read of what
//! arrived, and sends each holder back its rows (one indexed read per holder). Each rank moves
//! about its own slices' size each way instead of every split matrix twice (the all-reduce
//! exchange, `device_exchange.rs`); the values are the same bit for bit (copies only).
//!
//! The index tensors depend on the layout and on which split matrices received a gradient:
//! they are uploaded once per such set and kept.

use std::collections::HashMap;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorPrimitive};
use sshsdp_backend::{HsdpError, HsdpRuntime, UpdateGroup};

use super::exchange::{count_exchange, owner, SplitMatrix};
use super::{MuonStepStats, ShardedMuon};
use crate::traffic::upload_indices;
use crate::UpdateUnit;

/// Which index tensor of the owner exchange: the owner's assembly of what arrived, or the rows
/// for one holder piece; with the split matrices of the step (plan indices).
pub(super) type OwnerIndexKey = (Option<usize>, Vec<usize>);

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// First half: this rank's slices `mine` (sorted by parameter) to their owners; returns the
    /// split matrices this rank owns, assembled and flat, in plan order.
    pub(super) fn send_to_owners_owner_device(
        &mut self,
        runtime: &HsdpRuntime<B>,
        group: &UpdateGroup<'_>,
        split: &[SplitMatrix],
        mine: &[(UpdateUnit, Tensor<B, 1>)],
        stats: &mut MuonStepStats,
    ) -> Result<Vec<(usize, Tensor<B, 1>)>, HsdpError> {
        let plan = runtime.plan();
        let me = group.piece();
        let mut send = vec![Vec::new(); group.pieces()];
        let mut send_counts = vec![0; group.pieces()];
        for (unit, u) in mine {
            let o = owner(plan, unit.param)?;
            send_counts[o] += unit.in_piece.len();
            send[o].push(u.clone().into_primitive().tensor());
        }
        let owned: Vec<&SplitMatrix> = split.iter().filter(|m| m.owner == me).collect();
        let mut expect = vec![0; group.pieces()];
        for m in &owned {
            for (q, r) in &m.holders {
                expect[*q] += r.len();
            }
        }
        count_exchange(stats, &send_counts, &expect, me);
        let (got, ranges) = group.exchange_tensor::<B>(send, &expect, &self.device)?;
        if owned.is_empty() {
            return Ok(Vec::new());
        }
        let got = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(got));
        let numel = |param: usize| plan.params()[param].spec.numel() as usize;
        let key = (None, split.iter().map(|m| m.param).collect::<Vec<_>>());
        let index = match self.owner_index.get(&key) {
            Some(index) => index.clone(),
            None => {
                // Where each element of the owned matrices (dense, plan order) arrived.
                let total: usize = owned.iter().map(|m| numel(m.param)).sum();
                let mut index = vec![-1i64; total];
                let mut at: Vec<usize> = ranges.iter().map(|r| r.start).collect();
                let mut base = 0;
                for m in &owned {
                    for (q, r) in &m.holders {
                        for (k, i) in r.clone().enumerate() {
                            index[base + i] = (at[*q] + k) as i64;
                        }
                        at[*q] += r.len();
                    }
                    base += numel(m.param);
                }
                if let Some(hole) = index.iter().position(|&i| i < 0) {
                    return Err(HsdpError::Failed(format!(
                        "owner exchange: element {hole} of the owned split matrices has no holder"
                    )));
                }
                let index = upload_indices::<B>(index, &self.device, &self.traffic);
                self.owner_index.insert(key, index.clone());
                index
            }
        };
        let dense = got.select(0, index);
        let mut base = 0;
        Ok(owned
            .iter()
            .map(|m| {
                let n = numel(m.param);
                base += n;
                (m.param, dense.clone().slice(base - n..base))
            })
            .collect())
    }

    /// Second half: the owned split matrices' results `owned` (flat, plan order) back to their
    /// holders; returns this rank's rows of each slice in `mine`.
    pub(super) fn return_to_holders_owner_device(
        &mut self,
        runtime: &HsdpRuntime<B>,
        group: &UpdateGroup<'_>,
        split: &[SplitMatrix],
        mine: &[(UpdateUnit, Tensor<B, 1>)],
        owned: Vec<Tensor<B, 1>>,
        stats: &mut MuonStepStats,
    ) -> Result<Vec<Tensor<B, 1>>, HsdpError> {
        let plan = runtime.plan();
        let me = group.piece();
        let params: Vec<usize> = split.iter().map(|m| m.param).collect();
        let owned_split: Vec<&SplitMatrix> = split.iter().filter(|m| m.owner == me).collect();
        if owned_split.len() != owned.len() {
            return Err(HsdpError::Failed(format!(
                "owner exchange: {} results for {} owned split matrices",
                owned.len(),
                owned_split.len()
            )));
        }
        let mut send = vec![Vec::new(); group.pieces()];
        let mut send_counts = vec![0; group.pieces()];
        if !owned.is_empty() {
            let dense = Tensor::cat(owned, 0);
            let numel = |param: usize| plan.params()[param].spec.numel() as usize;
            for (q, chunk) in send.iter_mut().enumerate() {
                // Holder `q`'s rows of every owned matrix, in plan order.
                let mut rows = Vec::new();
                let mut base = 0;
                for m in &owned_split {
                    for (_, r) in m.holders.iter().filter(|(p, _)| *p == q) {
                        rows.extend(r.clone().map(|i| (base + i) as i64));
                    }
                    base += numel(m.param);
                }
                if rows.is_empty() {
                    continue;
                }
                send_counts[q] = rows.len();
                let key = (Some(q), params.clone());
                let index = match self.owner_index.get(&key) {
                    Some(index) => index.clone(),
                    None => {
                        let index = upload_indices::<B>(rows, &self.device, &self.traffic);
                        self.owner_index.insert(key, index.clone());
                        index
                    }
                };
                chunk.push(dense.clone().select(0, index).into_primitive().tensor());
            }
        }
        let mut expect = vec![0; group.pieces()];
        for (unit, _) in mine {
            expect[owner(plan, unit.param)?] += unit.in_piece.len();
        }
        count_exchange(stats, &send_counts, &expect, me);
        let (got, ranges) = group.exchange_tensor::<B>(send, &expect, &self.device)?;
        let got = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(got));
        let mut at: Vec<usize> = ranges.iter().map(|r| r.start).collect();
        mine.iter()
            .map(|(unit, _)| {
                let o = owner(plan, unit.param)?;
                let n = unit.in_piece.len();
                at[o] += n;
                Ok(got.clone().slice(at[o] - n..at[o]))
            })
            .collect()
    }
}

/// The owner exchange's index tensors, kept across steps.
pub(super) type OwnerIndices<B> = HashMap<OwnerIndexKey, Tensor<B, 1, Int>>;
