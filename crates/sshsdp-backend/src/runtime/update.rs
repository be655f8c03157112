//! The update stage: the reduced gradient pieces are collected, the global gradient norm is
//! measured on every rank alike (and a non-finite one stops the step everywhere), the
//! optimizer steps this rank's pieces, each piece's runtime bytes are re-derived from its fp32
//! master (bf16 cast or MXFP8 quantisation) and the runtime shards rebuilt across replicas.

use std::sync::Arc;

use burn_backend::Backend;

use super::grad_sync::PieceGrad;
use super::pieces::{Piece, PieceValues, UpdateGroup, Views};
use super::rederive::{finish_rebuild, rederive_piece};
use super::step_agreement::{global_grad_norm, norm_message_len};
use super::{Runtime, State};
use crate::config::NonFinitePolicy;
use crate::storage::{download, upload, MasterBuf, ShardBuf};
use crate::HsdpError;

/// Hands this rank's pieces to `step` as `views` — those with a gradient, or every bucket's
/// with empty gradients (as host slices) when `all_buckets` (checkpoints reading or writing
/// masters) — then re-derives and rebuilds the runtime shards and ends the step.
pub(super) fn run<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    all_buckets: bool,
    views: Views,
    step: impl FnOnce(&mut [Piece<'_, B>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
) -> Result<(), HsdpError> {
    if let Some((b, pending)) = st.grads.waiting() {
        let failure = format!(
            "bucket {b} is still waiting for {pending} gradients: finish backward before stepping"
        );
        rt.record_failure(st, failure);
    }
    for b in 0..st.storage.len() {
        match st.grads.collect(b, &rt.timeline, &rt.materialiser.device) {
            Ok((up, down)) => {
                let c = &mut st.counters;
                c.staged_bytes += up + down;
                c.uploaded_bytes += up;
                c.downloaded_bytes += down;
                c.grad_bytes_copied += down;
            }
            Err(e) => rt.record_failure(st, e),
        }
    }
    if let Some(f) = st.failure.clone() {
        // The update's first collective is still made (it fails at once: see `worker::run`), so
        // that peers that have not met the failure yet meet it here and return from this same
        // call: the gradient norm, or the verdict when there is no norm (all buckets). Only the
        // first: peers stop at it too, so a second would wait for them in vain.
        if all_buckets {
            let _ = rt.gather_world(st, "step verdict", vec![1]);
        } else {
            let _ = rt
                .worker
                .gather_world_bytes("gradient norm", vec![0; norm_message_len(rt)])
                .wait();
        }
        return Err(HsdpError::Failed(f));
    }
    let grads: Vec<(usize, PieceGrad<B>)> = (0..st.storage.len())
        .map(|b| {
            let g = if all_buckets {
                PieceGrad::Host(Vec::new())
            } else {
                st.grads.take_piece(b)
            };
            (b, g)
        })
        .filter(|(_, g)| all_buckets || !g.is_empty())
        .collect();
    let (grad_norm, received) = if all_buckets {
        (0.0, Vec::new())
    } else {
        let (norm, received) = global_grad_norm(rt, st, &grads)?;
        st.last_grad_norm = Some(norm);
        if !norm.is_finite() {
            // Every rank measured the same norm: every rank drops this step's gradients and
            // applies nothing, so masters and runtime shards stay as they were.
            drop(grads);
            rt.end_step(st)?;
            return match rt.non_finite {
                NonFinitePolicy::Error => Err(HsdpError::NonFiniteGradient { norm }),
                NonFinitePolicy::SkipStep => {
                    st.counters.skipped_steps += 1;
                    Ok(())
                }
            };
        }
        (norm, received)
    };
    let piece = rt.plan.piece_of(rt.world_rank)?;
    let device = &rt.materialiser.device;
    // Device masters the caller wants as host slices: staged to the host for the step.
    let host_views = all_buckets || views == Views::Host;
    let mut staged: Vec<Option<Vec<f32>>> = vec![None; st.storage.len()];
    if host_views {
        for &(b, _) in &grads {
            if let Some(MasterBuf::Device(t)) = &st.storage[b].master {
                let t = t.clone();
                let values =
                    download::<B>(t).inspect_err(|e| rt.record_failure(st, e.to_string()))?;
                st.counters.staged_bytes += 4 * values.len() as u64;
                st.counters.downloaded_bytes += 4 * values.len() as u64;
                staged[b] = Some(values);
            }
        }
    }
    // Each gradient where its master is: on the host for host slices, on the device for
    // device masters.
    let grads: Vec<(usize, PieceGrad<B>)> = grads
        .into_iter()
        .map(|(b, g)| {
            let device_master = matches!(st.storage[b].master, Some(MasterBuf::Device(_)));
            let on_device = device_master && staged[b].is_none();
            match (g, on_device) {
                (PieceGrad::Device(t), false) => {
                    let values =
                        download::<B>(t).inspect_err(|e| rt.record_failure(st, e.to_string()))?;
                    st.counters.staged_bytes += 4 * values.len() as u64;
                    st.counters.downloaded_bytes += 4 * values.len() as u64;
                    Ok((b, PieceGrad::Host(values)))
                }
                (PieceGrad::Host(values), true) => {
                    st.counters.staged_bytes += 4 * values.len() as u64;
                    st.counters.uploaded_bytes += 4 * values.len() as u64;
                    Ok((b, PieceGrad::Device(upload::<B>(values, device))))
                }
                (g, _) => Ok((b, g)),
            }
        })
        .collect::<Result<_, HsdpError>>()?;
    let stepped = {
        let State { storage, .. } = &mut *st;
        let mut grads_iter = grads.iter().peekable();
        let mut pieces = Vec::with_capacity(grads.len());
        for ((b, bucket), staged) in storage.iter_mut().enumerate().zip(&mut staged) {
            let Some((_, grad)) = grads_iter.next_if(|(gb, _)| *gb == b) else {
                continue;
            };
            let values = match (&mut bucket.master, staged, grad) {
                (Some(MasterBuf::Device(master)), None, PieceGrad::Device(grad)) => {
                    PieceValues::Device {
                        master,
                        grad: grad.clone(),
                    }
                }
                (_, _, PieceGrad::Device(_)) => {
                    return Err(HsdpError::Failed(format!(
                        "bucket {b}: a device gradient for a host master"
                    )))
                }
                (_, Some(master), PieceGrad::Host(grad)) => PieceValues::Host { master, grad },
                (Some(MasterBuf::Host(master)), None, PieceGrad::Host(grad)) => {
                    PieceValues::Host { master, grad }
                }
                (Some(MasterBuf::Device(_)), None, PieceGrad::Host(_)) => {
                    return Err(HsdpError::Failed(format!(
                        "bucket {b}: a host gradient for a device master"
                    )))
                }
                (None, None, PieceGrad::Host(grad)) => {
                    // f32 with host masters: the piece's runtime elements, its place in the shard.
                    let pe = rt.codecs[b].piece_elems();
                    let range = rt.piece_in_shard * pe..(rt.piece_in_shard + 1) * pe;
                    let ShardBuf::Host(shard) = &mut bucket.shard else {
                        return Err(HsdpError::Failed(format!(
                            "bucket {b}: a device shard without a device master"
                        )));
                    };
                    let elements = Arc::make_mut(shard)
                        .as_f32_mut()
                        .ok_or_else(|| HsdpError::Failed("no fp32 master elements".into()))?;
                    PieceValues::Host {
                        master: &mut elements[range],
                        grad,
                    }
                }
            };
            pieces.push(Piece {
                bucket: b,
                start: piece * rt.codecs[b].piece_elems(),
                values,
            });
        }
        let group = UpdateGroup {
            worker: &rt.worker,
            timeline: &rt.timeline,
            piece,
            piece_ranks: piece_ranks(&rt.plan)?,
            grad_norm,
            received,
        };
        sshsdp_comm::faults::inject("sshsdp::update", rt.world_rank)
            .map_err(HsdpError::Failed)
            .and_then(|()| step(&mut pieces, &group))
    };
    // A failed step (one of its collectives failed, or the optimizer's own error) is recorded
    // first: that aborts the engine, so a peer of the update group still inside one of the
    // step's collectives fails at once instead of waiting for this rank.
    if let Err(e) = &stepped {
        rt.record_failure(st, e.to_string());
    }
    // Every rank learns whether every rank's step succeeded (one byte each, over the world), so
    // a failure in one update group (under HSDP each replica steps on its own) is an error on
    // every rank in this same call, and no rank goes on to re-derive and rebuild alone. Made
    // after a failure too: the engine fails it at once, carrying the failure to the ranks that
    // wait in it.
    let verdicts = rt.gather_world(st, "step verdict", vec![u8::from(stepped.is_err())]);
    let failed: Vec<usize> = match &verdicts {
        Ok(v) => v
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0)
            .map(|(r, _)| r)
            .collect(),
        Err(_) => Vec::new(),
    };
    stepped?;
    verdicts?;
    if !failed.is_empty() {
        let failure = format!("the optimizer step failed on ranks {failed:?}");
        rt.record_failure(st, failure.clone());
        return Err(HsdpError::Failed(failure));
    }
    // Re-derive each updated piece's runtime units and rebuild the shards across replicas.
    let mut rebuilds = Vec::new();
    for &(b, _) in &grads {
        match rederive_piece(rt, st, b, piece, staged[b].take()) {
            Ok(rebuild) => rebuilds.push((b, rebuild)),
            Err(e) => {
                // Recorded first: that aborts the engine, so peers already waiting in this
                // step's rebuilds fail at once instead of waiting for this rank.
                rt.record_failure(st, e.to_string());
                return Err(e);
            }
        }
    }
    for (b, rebuild) in rebuilds {
        match finish_rebuild(rt, st, b, rebuild) {
            Ok(shard) => st.storage[b].shard = shard,
            Err(e) => {
                rt.record_failure(st, e.to_string());
                return Err(e);
            }
        }
    }
    rt.end_step(st)?;
    if !all_buckets {
        // A whole step (forward, backward, update, rebuild) ran on every rank: each compiled
        // its kernels, so engines with a start-up bound tighten their waits now.
        rt.lanes.startup_done();
    }
    Ok(())
}

/// The update-group rank holding each piece of `plan`: the world rank when hierarchical, the
/// shard-group rank (the shard index) under HSDP, rank 0 under DDP.
fn piece_ranks(plan: &sshsdp_plan::Plan) -> Result<Vec<usize>, HsdpError> {
    (0..plan.pieces())
        .map(|p| match plan.config().sharding {
            sshsdp_plan::Sharding::Hierarchical => Ok(plan.ranks_of_piece(p)?[0]),
            sshsdp_plan::Sharding::Hsdp | sshsdp_plan::Sharding::Ddp => Ok(p),
        })
        .collect()
}
