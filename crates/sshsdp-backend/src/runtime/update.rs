//! The update stage: the reduced gradient pieces are collected, the global gradient norm is
//! measured on every rank alike (and a non-finite one stops the step everywhere), the
//! optimizer steps this rank's pieces, each piece's runtime bytes are re-derived from its fp32
//! master (bf16 cast or MXFP8 quantisation) and the runtime shards rebuilt across replicas.

use std::ops::Range;
use std::sync::Arc;

use burn_backend::Backend;

use super::{Runtime, State};
use crate::config::NonFinitePolicy;
use crate::timeline::{Timeline, Track};
use crate::worker::Worker;
use crate::HsdpError;

/// One bucket's piece on this rank during an update.
pub struct Piece<'a> {
    /// The bucket.
    pub bucket: usize,
    /// Position of the piece's first element in the bucket's element space (the plan's update
    /// views of the piece say where parameters sit in it).
    pub start: usize,
    /// fp32 master weights of the piece (padding elements included), updated in place.
    pub master: &'a mut [f32],
    /// World-averaged gradient of the piece.
    pub grad: &'a [f32],
}

/// The collectives an optimizer may run during an update, over the *update group*: the ranks
/// whose pieces make up a bucket (the world when hierarchical, the shard group under HSDP, this
/// rank alone under DDP).
pub struct UpdateGroup<'a> {
    pub(super) worker: &'a Worker,
    pub(super) timeline: &'a Timeline,
    pub(super) piece: usize,
    pub(super) grad_norm: f64,
}

impl UpdateGroup<'_> {
    /// Element-wise sum of `buf` over the update group (every rank calls it, in the same order).
    pub fn all_reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, HsdpError> {
        let reply = self.worker.all_reduce(buf);
        Ok(self
            .timeline
            .span(Track::Model, "wait optimizer all-reduce", None, || {
                reply.wait()
            })?)
    }

    /// This rank's piece index (what the plan's `ns_owner` refers to).
    pub fn piece(&self) -> usize {
        self.piece
    }

    /// The L2 norm of the whole model's world-averaged gradient (every piece of the update
    /// group, summed in f64; the same on every rank). Always finite here: a non-finite gradient
    /// never reaches an optimizer (see [`NonFinitePolicy`]). 0 when handing out masters only.
    pub fn grad_norm(&self) -> f64 {
        self.grad_norm
    }
}

/// Hands this rank's pieces to `step` — those with a gradient, or every bucket's with empty
/// gradients when `all_buckets` (checkpoints reading or writing masters) — then re-derives and
/// rebuilds the runtime shards and ends the step.
pub(super) fn run<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    all_buckets: bool,
    step: impl FnOnce(&mut [Piece<'_>], &UpdateGroup<'_>) -> Result<(), HsdpError>,
) -> Result<(), HsdpError> {
    if let Some((b, pending)) = st.grads.waiting() {
        return Err(HsdpError::Failed(format!(
            "bucket {b} is still waiting for {pending} gradients: finish backward before stepping"
        )));
    }
    for b in 0..st.storage.len() {
        if let Err(e) = st.grads.collect(b, &rt.timeline) {
            st.failure.get_or_insert(e);
        }
    }
    if let Some(f) = &st.failure {
        return Err(HsdpError::Failed(f.clone()));
    }
    let grads: Vec<(usize, Vec<f32>)> = (0..st.storage.len())
        .map(|b| {
            let g = if all_buckets {
                Vec::new()
            } else {
                st.grads.take_piece(b)
            };
            (b, g)
        })
        .filter(|(_, g)| all_buckets || !g.is_empty())
        .collect();
    let grad_norm = if all_buckets {
        0.0
    } else {
        let norm = global_grad_norm(rt, st, &grads)?;
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
        norm
    };
    let piece = rt.plan.piece_of(rt.world_rank)?;
    {
        let ranges: Vec<Range<usize>> = (0..st.storage.len())
            .map(|b| {
                let pe = rt.codecs[b].piece_elems();
                rt.piece_in_shard * pe..(rt.piece_in_shard + 1) * pe
            })
            .collect();
        let mut grads_iter = grads.iter().peekable();
        let mut pieces = Vec::with_capacity(grads.len());
        for (b, bucket) in st.storage.iter_mut().enumerate() {
            let Some((_, grad)) = grads_iter.next_if(|(gb, _)| *gb == b) else {
                continue;
            };
            let master: &mut [f32] = match &mut bucket.master {
                Some(master) => master,
                None => {
                    // f32: the piece's runtime elements (`ranges`: its place in the shard).
                    let shard = Arc::make_mut(&mut bucket.shard);
                    let elements = shard
                        .as_f32_mut()
                        .ok_or_else(|| HsdpError::Failed("no fp32 master elements".into()))?;
                    &mut elements[ranges[b].clone()]
                }
            };
            pieces.push(Piece {
                bucket: b,
                start: piece * rt.codecs[b].piece_elems(),
                master,
                grad,
            });
        }
        let group = UpdateGroup {
            worker: &rt.worker,
            timeline: &rt.timeline,
            piece,
            grad_norm,
        };
        step(&mut pieces, &group)?;
    }
    // Re-derive each updated piece's runtime units and rebuild the shards across replicas.
    let mut rebuilds = Vec::new();
    for &(b, _) in &grads {
        let bucket = &mut st.storage[b];
        let shard = Arc::make_mut(&mut bucket.shard);
        if let Some(master) = &bucket.master {
            rt.codecs[b].rederive(shard, rt.piece_in_shard, piece, master)?;
        }
        let empty = Arc::new(shard.zeros_like(0));
        let shard = std::mem::replace(&mut bucket.shard, empty);
        let shard = Arc::try_unwrap(shard).unwrap_or_else(|shared| (*shared).clone());
        rebuilds.push((b, rt.worker.rebuild(shard)));
    }
    for (b, reply) in rebuilds {
        match rt.wait(b, "wait rebuild", reply) {
            Ok(shard) => st.storage[b].shard = Arc::new(shard),
            Err(e) => {
                st.failure = Some(e.to_string());
                return Err(e.into());
            }
        }
    }
    rt.end_step(st)
}

/// The L2 norm of the world-averaged gradient, from this rank's pieces `grads`: each rank's
/// sum of squares in f64, all-gathered over the update group (whose pieces make up every bucket
/// once) and summed in rank order, so every rank gets bitwise the same norm. NaN or infinite
/// when any gradient element is (squares of finite f32 values cannot overflow f64).
fn global_grad_norm<B: Backend>(
    rt: &Runtime<B>,
    st: &mut State<B>,
    grads: &[(usize, Vec<f32>)],
) -> Result<f64, HsdpError> {
    let local: f64 = grads
        .iter()
        .flat_map(|(_, g)| g.iter())
        .map(|&g| f64::from(g) * f64::from(g))
        .sum();
    let reply = rt.worker.gather_bytes(local.to_le_bytes().to_vec());
    let norm = rt
        .timeline
        .span(Track::Model, "wait gradient norm", None, || reply.wait());
    let all = match norm {
        Ok(all) => all,
        Err(e) => {
            st.failure = Some(e.to_string());
            return Err(e.into());
        }
    };
    let total: f64 = all
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .sum();
    Ok(total.sqrt())
}
