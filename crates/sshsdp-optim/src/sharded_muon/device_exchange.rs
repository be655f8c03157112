//! The exchange of split Muon matrices on device pieces. [`MuonExchange::OwnerAllToAll`] (the
//! default) runs the owner all-to-all-v (`device_owner.rs`) on device buffers where the update
//! group moves device memory itself for it ([`UpdateGroup::all_to_all_on_device`]: the peers
//! engine), staged through the host where it moves neither collective's (engines on host
//! memory). Over NCCL, whose device all-to-all-v is not wired, and with
//! [`MuonExchange::AllReduce`], each holder writes its slice of every split matrix into one dense
//! device buffer of all of them (zeros elsewhere), one all-reduce over the update group on
//! device memory assembles them ([`UpdateGroup::all_reduce_sum_tensor`]: NCCL or the peers
//! engine, staged through the host only on engines that move host memory), the owners
//! orthogonalise theirs, and a second all-reduce of the results hands every holder its rows.
//! Sums of one value and zeros are exact, and the owner exchange only copies, so both are
//! bitwise the host exchanges' result. (The all-reduce moves the split matrices' size twice
//! where the owner exchange moves about a rank's own slices; the plan keeps split matrices to
//! at most one per piece boundary.)
//!
//! A slice's elements sit at ascending, possibly scattered positions of its matrix (MXFP8 cuts
//! pieces at tile edges): they are placed and taken with one indexed write and one indexed
//! read, by position tensors uploaded once per layout and kept.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorPrimitive};
use sshsdp_backend::{HsdpError, HsdpRuntime, UpdateGroup};

use super::exchange::{dense_offsets, split_matrices};
use super::{MuonExchange, MuonStepStats, ShardedMuon};
use crate::traffic::upload_indices;
use crate::UpdateUnit;

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// First half: this rank's slices `mine` (sorted by parameter) to their owners; returns the
    /// split matrices this rank owns, assembled and flat, in plan order.
    pub(super) fn send_to_owners_device(
        &mut self,
        runtime: &HsdpRuntime<B>,
        group: &UpdateGroup<'_>,
        mine: &[(UpdateUnit, Tensor<B, 1>)],
        stats: &mut MuonStepStats,
    ) -> Result<Vec<(usize, Tensor<B, 1>)>, HsdpError> {
        let plan = runtime.plan();
        let split = split_matrices(plan, group);
        if split.is_empty() {
            // The same plan on every rank: nobody exchanges.
            return Ok(Vec::new());
        }
        let (offsets, total) = dense_offsets(&split, plan);
        stats.exchanged_elements = total as u64;
        if self.owner_exchange(group) {
            return self.send_to_owners_owner_device(runtime, group, &split, mine, stats);
        }
        let mut dense = Tensor::<B, 1>::zeros([total], &self.device);
        for (unit, u) in mine {
            let at = self.positions(unit, offsets[&unit.param]);
            dense = dense.select_assign(0, at, u.clone(), IndexingUpdateOp::Add);
        }
        let all = self.sum_over_group(group, dense)?;
        let me = group.piece();
        Ok(split
            .iter()
            .filter(|m| m.owner == me)
            .map(|m| {
                let at = offsets[&m.param];
                let n = plan.params()[m.param].spec.numel() as usize;
                (m.param, all.clone().slice(at..at + n))
            })
            .collect())
    }

    /// Second half: the owned split matrices' results `owned` (flat, in the order
    /// [`Self::send_to_owners_device`] returned them) back to their holders; returns this
    /// rank's rows of each slice in `mine`.
    pub(super) fn return_to_holders_device(
        &mut self,
        runtime: &HsdpRuntime<B>,
        group: &UpdateGroup<'_>,
        mine: &[(UpdateUnit, Tensor<B, 1>)],
        owned: Vec<Tensor<B, 1>>,
        stats: &mut MuonStepStats,
    ) -> Result<Vec<Tensor<B, 1>>, HsdpError> {
        let plan = runtime.plan();
        let split = split_matrices(plan, group);
        if split.is_empty() {
            return Ok(Vec::new());
        }
        if self.owner_exchange(group) {
            return self.return_to_holders_owner_device(runtime, group, &split, mine, owned, stats);
        }
        let (offsets, _) = dense_offsets(&split, plan);
        let me = group.piece();
        // Every split matrix in plan order: this rank's results, zeros for the others'.
        let mut owned = owned.into_iter();
        let mut parts = Vec::with_capacity(split.len());
        for m in &split {
            let n = plan.params()[m.param].spec.numel() as usize;
            match m.owner == me {
                true => parts.push(owned.next().ok_or_else(|| {
                    HsdpError::Failed(format!("no result for owned split matrix {}", m.param))
                })?),
                false => parts.push(Tensor::<B, 1>::zeros([n], &self.device)),
            }
        }
        let dense = Tensor::cat(parts, 0);
        let all = self.sum_over_group(group, dense)?;
        Ok(mine
            .iter()
            .map(|(unit, _)| {
                let at = self.positions(unit, offsets[&unit.param]);
                all.clone().select(0, at)
            })
            .collect())
    }

    /// Whether split matrices travel by the owner all-to-all-v (else by all-reduce): as chosen,
    /// but where only the all-reduce moves device memory itself (NCCL), by all-reduce.
    fn owner_exchange(&self, group: &UpdateGroup<'_>) -> bool {
        let staged_only_here = group.all_reduce_on_device() && !group.all_to_all_on_device();
        self.exchange == MuonExchange::OwnerAllToAll && !staged_only_here
    }

    /// `dense` summed over the update group, on the device.
    fn sum_over_group(
        &self,
        group: &UpdateGroup<'_>,
        dense: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>, HsdpError> {
        let sum =
            group.all_reduce_sum_tensor::<B>(dense.into_primitive().tensor(), &self.device)?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(sum)))
    }

    /// The positions of `unit`'s elements in the dense buffer where its matrix starts at `base`
    /// (uploaded on first use, then kept).
    fn positions(&mut self, unit: &UpdateUnit, base: usize) -> Tensor<B, 1, Int> {
        if let Some(at) = self.positions.get(&(unit.param, base)) {
            return at.clone();
        }
        let at: Vec<i64> = unit.param_indices().map(|i| (base + i) as i64).collect();
        let at = upload_indices::<B>(at, &self.device, &self.traffic);
        self.positions.insert((unit.param, base), at.clone());
        at
    }
}
