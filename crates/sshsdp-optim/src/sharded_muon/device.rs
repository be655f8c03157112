//! [`ShardedMuon`]'s step on device pieces, on the runtime's own backend: nothing is read back
//! and nothing uploaded (but a checkpoint's momentum, once, and the split slices' positions,
//! once per layout). Element-wise runs step as one optimizer chain each; momentum, Nesterov, the
//! decay and the apply are tensor operations per matrix slice; Newton–Schulz is batched by
//! shape; split matrices travel on device buffers (`device_exchange.rs`); each piece's new
//! master is put together once from its stepped ranges and the untouched ones (padding,
//! parameters without a gradient). The masters handed out are never written: a verdict read at
//! commit can put them back.

use std::ops::Range;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use sshsdp_backend::{HsdpError, HsdpRuntime, Piece, PieceValues, UpdateGroup};
use sshsdp_plan::{Role, UpdateUnit};

use super::{MuonStepStats, Saved, ShardedMuon};
use crate::segments::range_of;

/// A piece's stepped ranges and their new master values.
type Stepped<B> = Vec<(Range<usize>, Tensor<B, 1>)>;

impl<B: Backend, O: SimpleOptimizer<B>> ShardedMuon<B, O> {
    /// One step on device pieces (see the module docs).
    pub(super) fn step_device(
        &mut self,
        lr: f64,
        runtime: &HsdpRuntime<B>,
        pieces: &mut [Piece<B>],
        group: &UpdateGroup<'_>,
    ) -> Result<(), HsdpError> {
        let start = self.traffic.peek();
        if group.grad_norm().is_none() {
            // The verdict is read at commit: keep what this step replaces (tensor handles).
            self.before = Some(Saved {
                states: self.states.clone(),
                momentum: self.momentum.clone(),
            });
        }
        let scale = self.clip.factor(group);
        let all = runtime
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))?;
        let mut masters = Vec::with_capacity(pieces.len());
        let mut grads = Vec::with_capacity(pieces.len());
        for piece in pieces.iter() {
            let PieceValues::Device { master, grad } = &piece.values else {
                return Err(HsdpError::Failed(format!(
                    "bucket {}'s piece is on the host while others are on the device",
                    piece.bucket
                )));
            };
            let master = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(master.clone()));
            let mut grad = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(grad.clone()));
            if scale != 1.0 {
                // The same f32 product as the host path's `g * scale`.
                grad = grad.mul_scalar(scale as f32);
            }
            masters.push(master);
            grads.push(grad);
        }
        let mut stepped: Vec<Stepped<B>> = vec![Vec::new(); pieces.len()];
        // Element-wise runs: one optimizer chain each.
        for (p, piece) in pieces.iter().enumerate() {
            let mine: Vec<&UpdateUnit> = all.iter().filter(|u| u.piece == p).collect();
            let blocks = self.elementwise_blocks(piece.bucket, piece.len(), &mine, group)?;
            for mut block in blocks {
                let range = block.range.clone();
                let (param, state) = self.elementwise.step(
                    lr,
                    range_of(&masters[p], &range),
                    range_of(&grads[p], &range),
                    block.state.take(),
                );
                block.state = state;
                self.states.put(piece.bucket, block);
                stepped[p].push((range, param));
            }
        }
        // Matrices: momentum here, then Newton–Schulz on their owners.
        let plan = runtime.plan();
        let mut split = Vec::new();
        let mut owned = Vec::new();
        for unit in all
            .iter()
            .filter(|u| u.role == Role::Matrix && group.received_gradient(u.param))
        {
            let grad = range_of(&grads[unit.piece], &unit.in_piece);
            let u = self.momentum_update_device(unit.param, grad);
            if plan.params()[unit.param].split {
                split.push((unit.clone(), u));
            } else {
                owned.push((unit.clone(), u));
            }
        }
        split.sort_by_key(|(unit, _)| unit.param);
        let mut stats = MuonStepStats::default();
        let assembled = self.send_to_owners_device(runtime, group, &split, &mut stats)?;
        let whole = owned.len();
        let matrices: Vec<(usize, Tensor<B, 1>)> = owned
            .iter()
            .map(|(unit, u)| (unit.param, u.clone()))
            .chain(assembled)
            .collect();
        stats.ns_local += matrices.len() as u64;
        stats.ns_split += (matrices.len() - whole) as u64;
        let mut orthogonal = self.orthogonalize_device(runtime, matrices);
        let split_results = orthogonal.split_off(whole);
        for ((unit, _), o) in owned.iter().zip(orthogonal) {
            let new = self.apply_device(lr, runtime, unit, &masters[unit.piece], o);
            stepped[unit.piece].push((unit.in_piece.clone(), new));
        }
        let rows =
            self.return_to_holders_device(runtime, group, &split, split_results, &mut stats)?;
        for ((unit, _), o) in split.iter().zip(rows) {
            let new = self.apply_device(lr, runtime, unit, &masters[unit.piece], o);
            stepped[unit.piece].push((unit.in_piece.clone(), new));
        }
        // Each piece's new master, put together once.
        for ((piece, master), parts) in pieces.iter_mut().zip(masters).zip(stepped) {
            if parts.is_empty() {
                continue;
            }
            let new = assemble(master, parts).into_primitive().tensor();
            if let PieceValues::Device { master, .. } = &mut piece.values {
                *master = new;
            }
        }
        stats.host = self.traffic.peek().since(start);
        self.last = stats;
        Ok(())
    }

    /// Newton–Schulz of whole matrices' updates `(param, flat values)`, in order, on the device:
    /// same-shape matrices in one batched Newton–Schulz each ([`Self::with_megabatches`]).
    /// Returns each result flat (row-major).
    fn orthogonalize_device(
        &self,
        runtime: &HsdpRuntime<B>,
        matrices: Vec<(usize, Tensor<B, 1>)>,
    ) -> Vec<Tensor<B, 1>> {
        let shape = |param: usize| {
            let s = &runtime.plan().params()[param].spec.shape;
            [s[0], s[1]]
        };
        let mut out: Vec<Option<Tensor<B, 1>>> = vec![None; matrices.len()];
        for ([rows, cols], members) in self.batches(matrices.iter().map(|(p, _)| shape(*p))) {
            let n = rows * cols;
            if members.len() == 1 {
                let u = matrices[members[0]].1.clone().reshape([rows, cols]);
                out[members[0]] = Some(self.muon.orthogonalize(u).reshape([n]));
                continue;
            }
            let batch = members
                .iter()
                .map(|&i| matrices[i].1.clone().reshape([rows, cols]))
                .collect();
            let o = self.muon.orthogonalize_batch(Tensor::stack::<3>(batch, 0));
            for (k, &i) in members.iter().enumerate() {
                out[i] = Some(o.clone().slice(k..k + 1).reshape([n]));
            }
        }
        out.into_iter()
            .map(|o| o.expect("every matrix is in a batch"))
            .collect()
    }

    /// `W ← W·(1 − lr·wd) − lr·scale·O` on `unit`'s slice of `master` (the same f32 operations
    /// as the host path's).
    fn apply_device(
        &self,
        lr: f64,
        runtime: &HsdpRuntime<B>,
        unit: &UpdateUnit,
        master: &Tensor<B, 1>,
        o: Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        let (decay, step) = self.apply_factors(lr, runtime, unit.param);
        range_of(master, &unit.in_piece)
            .mul_scalar(decay)
            .sub(o.mul_scalar(step))
    }
}

/// `master` with its ranges in `parts` replaced (ranges disjoint): one concatenation of the new
/// ranges and the untouched ones between them, or the one new tensor when it covers the piece.
fn assemble<B: Backend>(master: Tensor<B, 1>, mut parts: Stepped<B>) -> Tensor<B, 1> {
    let len = master.dims()[0];
    parts.sort_by_key(|(range, _)| range.start);
    let mut out = Vec::with_capacity(2 * parts.len() + 1);
    let mut at = 0;
    for (range, values) in parts {
        if at < range.start {
            out.push(master.clone().slice(at..range.start));
        }
        at = range.end;
        out.push(values);
    }
    if at < len {
        out.push(master.slice(at..len));
    }
    match out.len() {
        1 => out.pop().expect("one part"),
        _ => Tensor::cat(out, 0),
    }
}
