//! The gradient-sync stage: each final gradient autodiff hands over is accumulated into its
//! bucket's full fp32 gradient buffer; once every expected gradient of the bucket is in, the
//! bucket is reduced on the communication lanes (reduce-scatter in the shard group, then across
//! replicas) while backward goes on; the update collects the reduced pieces.
//!
//! Micro-batches of gradient accumulation reduce once each and add their pieces up.
//!
//! Where a bucket's gradients are accumulated is the gradient role's placement: on the host
//! (each gradient read back as autodiff hands it over) or on the device (each member's gradient
//! kept as a `B` tensor, summed there over a backward's contributions). Device gradients on a
//! CubeCL backend are assembled into the full-bucket gradient on the device and reduced from
//! there (`storage/cube/reduce.rs`: by the engine on device memory, or staged through the host on the
//! lanes), and the piece comes back as a device tensor; on other backends they are read back
//! once per bucket — one concatenation, one transfer — for the host reduction.

use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use crate::config::Precision;
use crate::lanes::{Reply, Worker};
use crate::storage::download;
use crate::storage::{device_piece, device_reduce_job, reduces_on_device, BucketCodec, GradSource};
use crate::timeline::{Timeline, Track};
use crate::units::DeviceUnits;

/// One bucket's gradients in flight.
struct BucketGrads<B: Backend> {
    /// The full-bucket gradient being accumulated on the host (empty until the first gradient
    /// arrives).
    full: Vec<f32>,
    /// Per member, its gradient accumulated on the device (flattened), when gradients live
    /// there.
    on_device: Vec<Option<B::FloatTensorPrimitive>>,
    /// Gradients still expected in this backward.
    pending: usize,
    /// Reductions queued on the communication lanes.
    reductions: Vec<Reduction>,
    /// This rank's reduced piece, summed over the micro-batches collected so far.
    piece: PieceGrad<B>,
}

/// A reduction on its way: to a host piece, or to a piece in device memory.
enum Reduction {
    Host(Reply),
    Device(Reply<DeviceUnits>),
}

/// A reduced gradient piece (world-averaged, f32): on the host, or a 1-D tensor on `B`'s device.
pub(crate) enum PieceGrad<B: Backend> {
    /// Host values (empty: no gradient).
    Host(Vec<f32>),
    /// On the device.
    Device(B::FloatTensorPrimitive),
}

impl<B: Backend> PieceGrad<B> {
    /// Whether it holds no gradient.
    pub fn is_empty(&self) -> bool {
        matches!(self, PieceGrad::Host(v) if v.is_empty())
    }

    /// `self + other`, on the device if either is there.
    fn add(self, other: PieceGrad<B>) -> Result<PieceGrad<B>, String> {
        Ok(match (self, other) {
            (PieceGrad::Host(a), b) if a.is_empty() => b,
            (a, PieceGrad::Host(b)) if b.is_empty() => a,
            (PieceGrad::Host(mut a), PieceGrad::Host(b)) => {
                a.iter_mut().zip(&b).for_each(|(a, g)| *a += g);
                PieceGrad::Host(a)
            }
            (PieceGrad::Device(a), PieceGrad::Device(b)) => PieceGrad::Device(B::float_add(a, b)),
            (PieceGrad::Device(d), PieceGrad::Host(h))
            | (PieceGrad::Host(h), PieceGrad::Device(d)) => {
                let mut d = download::<B>(d).map_err(|e| e.to_string())?;
                d.iter_mut().zip(&h).for_each(|(a, g)| *a += g);
                PieceGrad::Host(d)
            }
        })
    }
}

/// Host↔device bytes a staged reduction moved (up, down).
pub(super) type Staged = (u64, u64);

impl<B: Backend> Default for BucketGrads<B> {
    fn default() -> Self {
        Self {
            full: Vec::new(),
            on_device: Vec::new(),
            pending: 0,
            reductions: Vec::new(),
            piece: PieceGrad::Host(Vec::new()),
        }
    }
}

/// Every bucket's gradients in flight.
pub(super) struct GradSync<B: Backend> {
    buckets: Vec<BucketGrads<B>>,
    /// Per parameter, whether a backward since the last update expected a gradient for it on
    /// this rank (frozen parameters and those a step's graph did not use never do).
    received: Vec<bool>,
    /// The dtype reductions move.
    reduce: Precision,
}

/// What reducing a bucket moved.
pub(super) struct Reduced {
    /// Bytes of the full-bucket gradient entering the reduction (in the reduction dtype).
    pub bytes: u64,
    /// Bytes read back from the device first, on the model thread (device gradients on a
    /// backend without a device reduction).
    pub staged: u64,
}

impl<B: Backend> GradSync<B> {
    /// Nothing in flight for `buckets` buckets of `params` parameters, reduced in `reduce`.
    pub fn new(buckets: usize, params: usize, reduce: Precision) -> Self {
        Self {
            buckets: (0..buckets).map(|_| BucketGrads::default()).collect(),
            received: vec![false; params],
            reduce,
        }
    }

    /// A backward pass starts: `params` holds each parameter that will receive a gradient,
    /// with its bucket.
    pub fn begin(&mut self, params: impl IntoIterator<Item = (usize, usize)>) {
        self.buckets.iter_mut().for_each(|b| b.pending = 0);
        for (param, b) in params {
            self.buckets[b].pending += 1;
            self.received[param] = true;
        }
    }

    /// Per parameter, whether it received a gradient on this rank since the last call (over
    /// every backward of a step's accumulation window); the window starts again.
    pub fn take_received(&mut self) -> Vec<bool> {
        let fresh = vec![false; self.received.len()];
        std::mem::replace(&mut self.received, fresh)
    }

    /// Adds member `k`'s gradient `values` into bucket `b`'s buffer; `true` when it was the
    /// last one the bucket expected.
    pub fn accumulate(&mut self, b: usize, codec: &BucketCodec, k: usize, values: &[f32]) -> bool {
        let bucket = &mut self.buckets[b];
        if bucket.full.is_empty() {
            bucket.full = vec![0f32; codec.bucket_elems()];
        }
        codec.accumulate(k, values, &mut bucket.full);
        bucket.pending = bucket.pending.saturating_sub(1);
        bucket.pending == 0
    }

    /// Adds member `k`'s gradient `grad` into its device accumulator (of the bucket's `members`
    /// members); `true` when it was the last one the bucket expected.
    pub fn accumulate_on_device(
        &mut self,
        b: usize,
        members: usize,
        k: usize,
        grad: B::FloatTensorPrimitive,
    ) -> bool {
        let bucket = &mut self.buckets[b];
        if bucket.on_device.is_empty() {
            bucket.on_device = vec![None; members];
        }
        let numel = grad.shape().num_elements();
        // Accumulated in f32 whatever the compute dtype (a bf16 gradient is widened).
        let grad = match grad.dtype() {
            DType::F32 => grad,
            _ => B::float_cast(grad, FloatDType::F32),
        };
        let flat = B::float_reshape(grad, [numel].into());
        bucket.on_device[k] = Some(match bucket.on_device[k].take() {
            Some(sum) => B::float_add(sum, flat),
            None => flat,
        });
        bucket.pending = bucket.pending.saturating_sub(1);
        bucket.pending == 0
    }

    /// Whether every bucket has all the gradients it expected.
    pub fn complete(&self) -> bool {
        self.buckets.iter().all(|b| b.pending == 0)
    }

    /// The first bucket still expecting gradients, and how many.
    pub fn waiting(&self) -> Option<(usize, usize)> {
        self.buckets
            .iter()
            .position(|b| b.pending > 0)
            .map(|b| (b, self.buckets[b].pending))
    }

    /// Queues bucket `b`'s reduction. Device gradients on a CubeCL backend are assembled into
    /// the full-bucket gradient on the device and reduced from there (by the engine on device
    /// memory where `engine_on_device`: see `storage/cube/reduce.rs`); elsewhere they are read back
    /// first, in one transfer, into the bucket's element space.
    pub fn reduce(
        &mut self,
        b: usize,
        codec: &BucketCodec,
        worker: &Worker,
        (sharding, shards, engine_on_device): (sshsdp_plan::Sharding, usize, bool),
    ) -> Result<Reduced, String> {
        let reduce = self.reduce;
        let bucket = &mut self.buckets[b];
        let mut staged = 0;
        let members: Vec<(usize, B::FloatTensorPrimitive)> = std::mem::take(&mut bucket.on_device)
            .into_iter()
            .enumerate()
            .filter_map(|(k, t)| t.map(|t| (k, t)))
            .collect();
        if !members.is_empty() && bucket.full.is_empty() && reduces_on_device::<B>() {
            let source = if engine_on_device {
                let full = full_on_device::<B>(codec, &members);
                GradSource::Full(match reduce {
                    Precision::Bf16 => B::float_cast(full, FloatDType::BF16),
                    _ => full,
                })
            } else {
                members_cat::<B>(codec, &members)
            };
            let shape = (shards, codec.piece_elems());
            if let Some(job) = device_reduce_job::<B>(source, reduce, sharding, shape) {
                let bytes = reduce.bytes() * codec.bucket_elems() as u64;
                bucket
                    .reductions
                    .push(Reduction::Device(worker.reduce_on_device(b, job)));
                return Ok(Reduced { bytes, staged });
            }
        }
        if !members.is_empty() {
            let (ks, tensors): (Vec<usize>, Vec<_>) = members.into_iter().unzip();
            let values = download::<B>(B::float_cat(tensors, 0)).map_err(|e| e.to_string())?;
            staged = 4 * values.len() as u64;
            let full = &mut bucket.full;
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
        let full = std::mem::take(&mut bucket.full);
        let bytes = reduce.bytes() * full.len() as u64;
        let reply = worker.reduce(b, full, reduce, codec.piece_elems());
        bucket.reductions.push(Reduction::Host(reply));
        Ok(Reduced { bytes, staged })
    }

    /// Waits for bucket `b`'s queued reductions and adds them into its piece (device pieces
    /// as tensors on `device`); the host↔device bytes of staged reductions, or the first
    /// error.
    pub fn collect(
        &mut self,
        b: usize,
        timeline: &Timeline,
        device: &B::Device,
    ) -> Result<Staged, String> {
        let mut first_error = None;
        let mut staged = (0, 0);
        for reduction in std::mem::take(&mut self.buckets[b].reductions) {
            let wait =
                |name| timeline.span(Track::Model, name, Some(b), || reduction_wait(reduction));
            let piece = match wait("wait reduction") {
                Ok(Arrived::Host(piece)) => Ok(PieceGrad::Host(piece)),
                Ok(Arrived::Device(units)) => {
                    staged.0 += units.uploaded;
                    staged.1 += units.downloaded;
                    device_piece::<B>(&units, device)
                        .map(PieceGrad::Device)
                        .map_err(|e| e.to_string())
                }
                Err(e) => Err(e),
            };
            match piece {
                Ok(piece) => {
                    let acc =
                        std::mem::replace(&mut self.buckets[b].piece, PieceGrad::Host(Vec::new()));
                    match acc.add(piece) {
                        Ok(sum) => self.buckets[b].piece = sum,
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(staged), Err)
    }

    /// Bucket `b`'s reduced piece, taken (empty when it received no gradient).
    pub fn take_piece(&mut self, b: usize) -> PieceGrad<B> {
        std::mem::replace(&mut self.buckets[b].piece, PieceGrad::Host(Vec::new()))
    }
}

/// A completed reduction's piece.
enum Arrived {
    Host(Vec<f32>),
    Device(DeviceUnits),
}

fn reduction_wait(reduction: Reduction) -> Result<Arrived, String> {
    match reduction {
        Reduction::Host(reply) => reply.wait().map(Arrived::Host),
        Reduction::Device(reply) => reply.wait().map(Arrived::Device),
    }
    .map_err(|e| e.to_string())
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
/// `members` (member index, flattened gradient), assembled on their device: each member's runs
/// at their places, zeros between (one concatenation).
fn full_on_device<B: Backend>(
    codec: &BucketCodec,
    members: &[(usize, B::FloatTensorPrimitive)],
) -> B::FloatTensorPrimitive {
    use burn_backend::Slice;
    let device = B::float_device(&members[0].1);
    let zeros = |n: usize| B::float_zeros([n].into(), &device, FloatDType::F32);
    // Every run of every member, by its place in the bucket.
    let mut runs: Vec<(usize, usize, usize, usize)> = members
        .iter()
        .enumerate()
        .flat_map(|(i, (k, _))| {
            codec
                .segments(*k)
                .map(move |(at, from, len)| (at, i, from, len))
        })
        .collect();
    runs.sort_unstable();
    let mut parts = Vec::with_capacity(2 * runs.len() + 1);
    let mut next = 0;
    for (at, i, from, len) in runs {
        if at > next {
            parts.push(zeros(at - next));
        }
        let grad = &members[i].1;
        let whole = from == 0 && len == grad.shape().num_elements();
        parts.push(if whole {
            grad.clone()
        } else {
            let slice = Slice::new(from as isize, Some((from + len) as isize), 1);
            B::float_slice(grad.clone(), &[slice])
        });
        next = at + len;
    }
    let total = codec.bucket_elems();
    if total > next {
        parts.push(zeros(total - next));
    }
    B::float_cat(parts, 0)
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::storage::upload;
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
                        (k, upload::<B>(g, &device))
                    })
                    .collect();
                if members.is_empty() {
                    continue;
                }
                let full = download::<B>(full_on_device::<B>(&codec, &members)).unwrap();
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
                let cat = download::<B>(cat).unwrap();
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
