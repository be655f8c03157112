//! The gradient stage of a bucket: each final gradient autodiff hands over is accumulated into
//! the bucket's full fp32 gradient buffer; once every expected gradient of the bucket is in, the
//! bucket is reduced on the communication lanes (reduce-scatter in the shard group, then across
//! replicas) while backward goes on; the update collects the reduced piece.
//!
//! Micro-batches of gradient accumulation reduce once each and add their pieces up.
//!
//! Where a bucket's gradients are accumulated is the gradient role's placement: on the host
//! (each gradient read back as autodiff hands it over) or on the device (each member's gradient
//! kept as a `B` tensor, summed there over a backward's contributions). Device gradients on a
//! CubeCL backend are assembled into the full-bucket gradient on the device and reduced from
//! there (`storage/cube/reduce.rs`: by the engine on device memory, or staged through the host
//! on the lanes), and the piece comes back as a device tensor; on other backends they are read
//! back once per bucket — one concatenation, one transfer — for the host reduction.

use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use super::{Bucket, BucketContext};
use crate::config::Precision;
use crate::lanes::Reply;
use crate::runtime_units::DeviceUnits;
use crate::storage::{
    device_piece, device_reduce_job, download, reduces_on_device, BucketCodec, F32Buf, GradSource,
    ReduceShape,
};
use crate::timeline::Track;
use crate::traffic::Purpose;

/// One bucket's gradients in flight.
pub(crate) struct BucketGrads<B: Backend> {
    /// The full-bucket gradient being accumulated on the host (empty until the first gradient
    /// arrives).
    full: Vec<f32>,
    /// Per member, its gradient accumulated on the device (flattened), when gradients live
    /// there.
    on_device: Vec<Option<B::FloatTensorPrimitive>>,
    /// Gradients still expected in this backward.
    pending: usize,
    /// Reductions queued on the communication lanes.
    reductions: Vec<Reduction<B>>,
    /// This rank's reduced piece, summed over the micro-batches collected so far (`None`: no
    /// gradient yet).
    piece: Option<F32Buf<B>>,
}

impl<B: Backend> Default for BucketGrads<B> {
    fn default() -> Self {
        Self {
            full: Vec::new(),
            on_device: Vec::new(),
            pending: 0,
            reductions: Vec::new(),
            piece: None,
        }
    }
}

/// A reduction on its way: to a host piece, or to a piece in device memory.
enum Reduction<B: Backend> {
    Host(Reply),
    Device(Reply<DeviceUnits>),
    /// Already reduced: this rank alone (world 1), its device gradient is the piece.
    Alone(F32Buf<B>),
}

impl<B: Backend> Bucket<B> {
    /// A backward pass starts that will hand this bucket `expected` gradients.
    pub fn expect_gradients(&mut self, expected: usize) {
        self.grads.pending = expected;
    }

    /// Gradients still expected in this backward.
    pub fn pending_gradients(&self) -> usize {
        self.grads.pending
    }

    /// Adds member `k`'s gradient `values` into the bucket's host buffer; `true` when it was the
    /// last one the bucket expected.
    pub fn accumulate(&mut self, k: usize, values: &[f32]) -> bool {
        let grads = &mut self.grads;
        if grads.full.is_empty() {
            grads.full = vec![0f32; self.codec.bucket_elems()];
        }
        self.codec.accumulate(k, values, &mut grads.full);
        grads.pending = grads.pending.saturating_sub(1);
        grads.pending == 0
    }

    /// Adds member `k`'s gradient `grad` into its device accumulator; `true` when it was the
    /// last one the bucket expected.
    pub fn accumulate_on_device(&mut self, k: usize, grad: B::FloatTensorPrimitive) -> bool {
        let grads = &mut self.grads;
        if grads.on_device.is_empty() {
            grads.on_device = vec![None; self.codec.len()];
        }
        let numel = grad.shape().num_elements();
        // Accumulated in f32 whatever the compute dtype (a bf16 gradient is widened).
        let grad = match grad.dtype() {
            DType::F32 => grad,
            _ => B::float_cast(grad, FloatDType::F32),
        };
        let flat = B::float_reshape(grad, [numel].into());
        grads.on_device[k] = Some(match grads.on_device[k].take() {
            Some(sum) => B::float_add(sum, flat),
            None => flat,
        });
        grads.pending = grads.pending.saturating_sub(1);
        grads.pending == 0
    }

    /// Queues the bucket's reduction; returns the bytes of the full-bucket gradient entering
    /// it (in the reduction dtype) and the gradient bytes read back from the device first.
    /// Device gradients on a CubeCL backend are assembled into the full-bucket gradient on the
    /// device and reduced from there (by the engine on device memory where it can: see
    /// `storage/cube/reduce.rs`); elsewhere they are read back first, in one transfer, into the
    /// bucket's element space.
    pub fn reduce(&mut self, ctx: &BucketContext<B>) -> Result<(u64, u64), String> {
        let (codec, reduce) = (&self.codec, ctx.reduce);
        let grads = &mut self.grads;
        let members: Vec<(usize, B::FloatTensorPrimitive)> = std::mem::take(&mut grads.on_device)
            .into_iter()
            .enumerate()
            .filter_map(|(k, t)| t.map(|t| (k, t)))
            .collect();
        if !members.is_empty() && grads.full.is_empty() && reduces_on_device::<B>() {
            if ctx.alone && ctx.engine_on_device {
                // World 1: the reduction of one rank's gradient is that gradient in the
                // reduction dtype (a bf16 reduction rounds it, as the engine would): no copy
                // into a send buffer, no lane job, no host wait.
                let full = full_on_device::<B>(codec, &members);
                let piece = match reduce {
                    Precision::Bf16 => {
                        B::float_cast(B::float_cast(full, FloatDType::BF16), FloatDType::F32)
                    }
                    _ => full,
                };
                let bytes = reduce.bytes() * codec.bucket_elems() as u64;
                grads
                    .reductions
                    .push(Reduction::Alone(F32Buf::Device(piece)));
                return Ok((bytes, 0));
            }
            let source = if ctx.engine_on_device {
                let full = full_on_device::<B>(codec, &members);
                GradSource::Full(match reduce {
                    Precision::Bf16 => B::float_cast(full, FloatDType::BF16),
                    _ => full,
                })
            } else {
                members_cat::<B>(codec, &members)
            };
            let shape = ReduceShape {
                replicas: ctx.replicas,
                shards: ctx.runtime_shards,
                piece_len: codec.piece_elems(),
            };
            if let Some(job) =
                device_reduce_job::<B>(source, reduce, ctx.sharding, shape, &ctx.traffic)
            {
                let bytes = reduce.bytes() * codec.bucket_elems() as u64;
                let reply = ctx.worker.reduce_on_device(self.index, job);
                grads.reductions.push(Reduction::Device(reply));
                return Ok((bytes, 0));
            }
        }
        let mut read_back = 0;
        if !members.is_empty() {
            let (ks, tensors): (Vec<usize>, Vec<_>) = members.into_iter().unzip();
            let values = download::<B>(B::float_cat(tensors, 0), &ctx.traffic, Purpose::Stage)
                .map_err(|e| e.to_string())?;
            read_back = 4 * values.len() as u64;
            let full = &mut grads.full;
            if full.is_empty() {
                *full = vec![0f32; codec.bucket_elems()];
            }
            let mut at = 0;
            for k in ks {
                let n = codec.shape(k).iter().product::<usize>();
                codec.accumulate(k, &values[at..at + n], full);
                at += n;
            }
        }
        let full = std::mem::take(&mut grads.full);
        let bytes = reduce.bytes() * full.len() as u64;
        let reply = ctx
            .worker
            .reduce(self.index, full, reduce, codec.piece_elems());
        grads.reductions.push(Reduction::Host(reply));
        Ok((bytes, read_back))
    }

    /// Waits for the bucket's queued reductions and adds them into its piece (device pieces as
    /// tensors on the device); the first error.
    pub fn collect(&mut self, ctx: &BucketContext<B>) -> Result<(), String> {
        let mut first_error = None;
        let b = self.index;
        for reduction in std::mem::take(&mut self.grads.reductions) {
            let arrived =
                ctx.timeline.span(
                    Track::Model,
                    "wait reduction",
                    Some(b),
                    || match reduction {
                        Reduction::Host(reply) => {
                            reply.wait().map(F32Buf::Host).map_err(|e| e.to_string())
                        }
                        Reduction::Device(reply) => {
                            reply.wait().map_err(|e| e.to_string()).and_then(|units| {
                                device_piece::<B>(&units, &ctx.device)
                                    .map(F32Buf::Device)
                                    .map_err(|e| e.to_string())
                            })
                        }
                        Reduction::Alone(piece) => Ok(piece),
                    },
                );
            let summed = arrived.and_then(|piece| match self.grads.piece.take() {
                None => Ok(piece),
                Some(acc) => acc.add(piece, &ctx.traffic).map_err(|e| e.to_string()),
            });
            match summed {
                Ok(sum) => self.grads.piece = Some(sum),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The reduced piece, taken (`None` when the bucket received no gradient).
    pub fn take_grad(&mut self) -> Option<F32Buf<B>> {
        self.grads.piece.take()
    }
}

/// The device gradients `members` (member index, flattened f32 gradient) one after the other,
/// with where their runs go in the bucket (the staged reduction reads back only these).
fn members_cat<B: Backend>(
    codec: &BucketCodec,
    members: &[(usize, B::FloatTensorPrimitive)],
) -> GradSource<B> {
    let mut runs = Vec::new();
    let mut offset = 0;
    for (k, grad) in members {
        runs.extend(
            codec
                .segments(*k)
                .map(|(at, from, len)| (at, offset + from, len)),
        );
        offset += grad.shape().num_elements();
    }
    let tensors = members.iter().map(|(_, t)| t.clone()).collect();
    GradSource::Members {
        cat: B::float_cat(tensors, 0),
        runs,
        full_len: codec.bucket_elems(),
    }
}

/// The full-bucket gradient (f32, the bucket's element space) of the device gradients
/// `members` (member index, flattened gradient), assembled on their device: one zero-filled
/// buffer, each member's runs written at their places (one launch per run; a concatenation
/// would add a zero-fill and a copy per gap).
fn full_on_device<B: Backend>(
    codec: &BucketCodec,
    members: &[(usize, B::FloatTensorPrimitive)],
) -> B::FloatTensorPrimitive {
    use burn_backend::Slice;
    let device = B::float_device(&members[0].1);
    let range =
        |from: usize, len: usize| [Slice::new(from as isize, Some((from + len) as isize), 1)];
    let mut full = B::float_zeros([codec.bucket_elems()].into(), &device, FloatDType::F32);
    for (k, grad) in members {
        for (at, from, len) in codec.segments(*k) {
            let whole = from == 0 && len == grad.shape().num_elements();
            let part = if whole {
                grad.clone()
            } else {
                B::float_slice(grad.clone(), &range(from, len))
            };
            full = B::float_slice_assign(full, &range(at, len), part);
        }
    }
    full
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::storage::upload;
    use crate::traffic::{Purpose, Traffic};
    use burn_cubecl::CubeBackend;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    use sshsdp_plan::{DType, Mesh, ParamSpec, Plan, PlanConfig, Role, RuntimeFormat};

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    /// The full-bucket gradient assembled on the device (the engine's reduction input) and the
    /// members' runs the staged reduction places on the host are both the host accumulation's
    /// bucket, bit for bit: members cut by piece boundaries, padding, a member without gradient.
    #[test]
    fn device_gradient_buckets_match_the_host_accumulation() {
        let device = WgpuDevice::default();
        let specs = vec![
            ParamSpec::new("a.weight", vec![70, 96], DType::F32).with_role(Role::Matrix),
            ParamSpec::new("a.bias", vec![96], DType::F32),
            ParamSpec::new("b.weight", vec![256, 40], DType::F32).with_role(Role::Matrix),
            ParamSpec::new("c.bias", vec![13], DType::F32),
        ];
        for (world, format) in [(1, RuntimeFormat::F32), (3, RuntimeFormat::Mxfp8)] {
            let mut config = PlanConfig::default().with_format(format);
            config.mx_max_padding = 1.0;
            let plan = Plan::build(specs.clone(), Mesh::flat(world).unwrap(), config).unwrap();
            for b in 0..plan.buckets().len() {
                let codec = BucketCodec::new(&plan, b);
                let mut host = vec![0f32; codec.bucket_elems()];
                // Every member but the second has a gradient.
                let members: Vec<(usize, _)> = (0..codec.len())
                    .filter(|&k| k != 1)
                    .map(|k| {
                        let n: usize = codec.shape(k).iter().product();
                        let g: Vec<f32> = (0..n)
                            .map(|i| (i * 31 + k * 7) as f32 * 0.25 - 9.0)
                            .collect();
                        codec.accumulate(k, &g, &mut host);
                        (
                            k,
                            upload::<B>(g, &device, &Traffic::default(), Purpose::Data),
                        )
                    })
                    .collect();
                if members.is_empty() {
                    continue;
                }
                let full = download::<B>(
                    full_on_device::<B>(&codec, &members),
                    &Traffic::default(),
                    Purpose::Data,
                )
                .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&full),
                    bits(&host),
                    "world {world}, bucket {b}: assembled"
                );
                let crate::storage::GradSource::Members {
                    cat,
                    runs,
                    full_len,
                } = members_cat::<B>(&codec, &members)
                else {
                    unreachable!("members_cat gives members")
                };
                let cat = download::<B>(cat, &Traffic::default(), Purpose::Data).unwrap();
                let mut placed = vec![0f32; full_len];
                for (at, from, len) in runs {
                    placed[at..at + len].copy_from_slice(&cat[from..from + len]);
                }
                assert_eq!(
                    bits(&placed),
                    bits(&host),
                    "world {world}, bucket {b}: staged runs"
                );
            }
        }
    }
}
