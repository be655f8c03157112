//! [`ShardedMuon`]'s step on host pieces (host masters, and `step_offloaded`'s CPU offload on
//! any runtime backend): momentum and the update in host loops, element-wise runs and
//! Newton–Schulz on the optimizer's backend (uploaded and read back: counted).

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sshsdp_backend::{HsdpError, HsdpRuntime, Piece, UpdateGroup};
use sshsdp_plan::{Role, UpdateUnit};

use super::{MuonStepStats, ShardedMuon};
use crate::adaptor::{step_with_state, Slice};
use crate::traffic::{read_values, upload_values};

/// A piece's host master and gradient slices.
struct HostPiece<'a> {
    master: &'a mut [f32],
    grad: &'a [f32],
}

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// One step on `runtime`'s pieces, as host views, whatever its backend.
    pub(super) fn step_host<R: Backend>(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        pieces: &mut [Piece<R>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        let start = self.traffic.peek();
        let all = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))?;
        let scale = self.clip.factor(group) as f32;
        // Element-wise runs, one joint state each (every unit passed: see `elementwise_blocks`).
        let mut host: Vec<HostPiece<'_>> = pieces
            .iter_mut()
            .map(|p| p.host().map(|(master, grad)| HostPiece { master, grad }))
            .collect::<Result<_, _>>()?;
        for (p, piece) in host.iter_mut().enumerate() {
            let mine: Vec<&UpdateUnit> = all.iter().filter(|u| u.piece == p).collect();
            let Some(bucket) = mine.first().map(|u| u.bucket) else {
                continue;
            };
            let blocks = self.elementwise_blocks(bucket, piece.master.len(), &mine, group)?;
            for mut block in blocks {
                let slice = Slice {
                    master: &mut piece.master[block.range.clone()],
                    grad: &piece.grad[block.range.clone()],
                    grad_scale: scale,
                };
                let state = block.state.take();
                block.state = step_with_state(
                    &self.elementwise,
                    state,
                    lr,
                    slice,
                    &self.device,
                    &self.traffic,
                )?;
                self.states.put(bucket, block);
            }
        }
        // A parameter without a gradient in this step (on any rank) is not stepped, its
        // momentum left alone, as Burn's optimizers do; every rank agrees.
        let matrices: Vec<&UpdateUnit> = all
            .iter()
            .filter(|u| u.role == Role::Matrix && group.received_gradient(u.param))
            .collect();
        let plan = runtime.plan();
        let mut stats = MuonStepStats::default();
        let mut split_updates = Vec::new();
        let mut owned_updates = Vec::new();
        for unit in matrices {
            let piece = &host[unit.piece];
            let grad: Vec<f32> = piece.grad[unit.in_piece.clone()]
                .iter()
                .map(|g| if scale != 1.0 { g * scale } else { *g })
                .collect();
            let u = self.momentum_update_host(unit.param, &grad)?;
            if plan.params()[unit.param].split {
                split_updates.push((unit.clone(), u));
            } else {
                owned_updates.push((unit.clone(), u));
            }
        }
        // Split matrices go to their owners (in plan order); every matrix this rank owns —
        // whole in its pieces or assembled — is orthogonalised here, same shapes together.
        split_updates.sort_by_key(|(unit, _)| unit.param);
        let assembled = self.send_to_owners(runtime, group, &split_updates, &mut stats)?;
        let whole = owned_updates.len();
        let (owned_units, owned_u): (Vec<UpdateUnit>, Vec<Vec<f32>>) =
            owned_updates.into_iter().unzip();
        let matrices: Vec<(usize, Vec<f32>)> = owned_units
            .iter()
            .map(|unit| unit.param)
            .zip(owned_u)
            .chain(assembled)
            .collect();
        stats.ns_local += matrices.len() as u64;
        stats.ns_split += (matrices.len() - whole) as u64;
        let mut orthogonal = self.orthogonalize_host(runtime, matrices)?;
        let split_results: Vec<(usize, Vec<f32>)> = orthogonal.split_off(whole);
        for (unit, (_, o)) in owned_units.iter().zip(orthogonal) {
            let master = &mut host[unit.piece].master[unit.in_piece.clone()];
            self.apply_host(lr, runtime, unit.param, master, &o);
        }
        // Each holder's rows of the results back.
        let rows =
            self.return_to_holders(runtime, group, &split_updates, split_results, &mut stats)?;
        for ((unit, _), o) in split_updates.iter().zip(rows) {
            let master = &mut host[unit.piece].master[unit.in_piece.clone()];
            self.apply_host(lr, runtime, unit.param, master, &o);
        }
        stats.host = self.traffic.peek().since(start);
        self.last = stats;
        Ok(())
    }

    /// Newton–Schulz of whole matrices' updates `(param, values)`, in order, on the optimizer's
    /// backend: same-shape matrices in one batched Newton–Schulz each
    /// ([`Self::with_megabatches`]), or one by one.
    fn orthogonalize_host<R: Backend>(
        &self,
        runtime: &HsdpRuntime<R>,
        matrices: Vec<(usize, Vec<f32>)>,
    ) -> Result<Vec<(usize, Vec<f32>)>, HsdpError> {
        let shape = |param: usize| {
            let s = &runtime.plan().params()[param].spec.shape;
            [s[0], s[1]]
        };
        let mut out: Vec<Option<Vec<f32>>> = vec![None; matrices.len()];
        for ([rows, cols], members) in self.batches(matrices.iter().map(|(p, _)| shape(*p))) {
            let n = rows * cols;
            if members.len() == 1 {
                let u = matrices[members[0]].1.clone();
                let u = upload_values::<B, 2>(u, [rows, cols], &self.device, &self.traffic);
                out[members[0]] = Some(read_values(self.muon.orthogonalize(u), &self.traffic)?);
                continue;
            }
            let mut values = Vec::with_capacity(members.len() * n);
            for &i in &members {
                values.extend_from_slice(&matrices[i].1);
            }
            let shape = [members.len(), rows, cols];
            let batch: Tensor<B, 3> =
                upload_values::<B, 3>(values, shape, &self.device, &self.traffic);
            let o = read_values(self.muon.orthogonalize_batch(batch), &self.traffic)?;
            for (k, &i) in members.iter().enumerate() {
                out[i] = Some(o[k * n..(k + 1) * n].to_vec());
            }
        }
        Ok(matrices
            .into_iter()
            .zip(out)
            .map(|((param, _), o)| (param, o.expect("every matrix is in a batch")))
            .collect())
    }

    /// Indices of matrices of `shapes` grouped into Newton–Schulz batches, in order of first
    /// appearance: same shapes together ([`Self::with_megabatches`]), or one by one.
    pub(super) fn batches(
        &self,
        shapes: impl Iterator<Item = [usize; 2]>,
    ) -> Vec<([usize; 2], Vec<usize>)> {
        let mut batches: Vec<([usize; 2], Vec<usize>)> = Vec::new();
        for (i, s) in shapes.enumerate() {
            match batches.iter_mut().find(|(b, _)| *b == s) {
                Some((_, members)) if self.megabatch => members.push(i),
                _ => batches.push((s, vec![i])),
            }
        }
        batches
    }

    /// `W ← W·(1 − lr·wd) − lr·scale·O` on one host slice.
    fn apply_host<R: Backend>(
        &self,
        lr: f64,
        runtime: &HsdpRuntime<R>,
        param: usize,
        master: &mut [f32],
        o: &[f32],
    ) {
        let (decay, step) = self.apply_factors(lr, runtime, param);
        master
            .iter_mut()
            .zip(o)
            .for_each(|(w, &o)| *w = *w * decay - o * step);
    }
}
