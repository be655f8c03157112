//! The gradient-sync stage: each final gradient autodiff hands over is accumulated into its
//! bucket's full fp32 gradient buffer; once every expected gradient of the bucket is in, the
//! bucket is reduced on the communication lanes (reduce-scatter in the shard group, then across
//! replicas) while backward goes on; the update collects the reduced pieces.
//!
//! Micro-batches of gradient accumulation reduce once each and add their pieces up.
//!
//! Where a bucket's gradients are accumulated is the gradient role's placement: on the host
//! (each gradient read back as autodiff hands it over) or on the device (each member's gradient
//! kept as a `B` tensor, summed there over a backward's contributions, and read back once per
//! bucket — one concatenation, one transfer — when the bucket is reduced).

use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use crate::codec::BucketCodec;
use crate::config::Precision;
use crate::storage::download;
use crate::timeline::{Timeline, Track};
use crate::worker::{Reply, Worker};

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
    reductions: Vec<Reply>,
    /// This rank's reduced piece, summed over the micro-batches collected so far.
    piece: Vec<f32>,
}

impl<B: Backend> Default for BucketGrads<B> {
    fn default() -> Self {
        Self {
            full: Vec::new(),
            on_device: Vec::new(),
            pending: 0,
            reductions: Vec::new(),
            piece: Vec::new(),
        }
    }
}

/// Every bucket's gradients in flight.
pub(super) struct GradSync<B: Backend> {
    buckets: Vec<BucketGrads<B>>,
    /// The dtype reductions move.
    reduce: Precision,
}

/// What reducing a bucket moved.
pub(super) struct Reduced {
    /// Bytes of the full-bucket gradient entering the reduction (in the reduction dtype).
    pub bytes: u64,
    /// Bytes read back from the device first (device gradients).
    pub staged: u64,
}

impl<B: Backend> GradSync<B> {
    /// Nothing in flight for `buckets` buckets, reduced in `reduce`.
    pub fn new(buckets: usize, reduce: Precision) -> Self {
        Self {
            buckets: (0..buckets).map(|_| BucketGrads::default()).collect(),
            reduce,
        }
    }

    /// A backward pass starts: `buckets` holds, per parameter that will receive a gradient,
    /// its bucket.
    pub fn begin(&mut self, buckets: impl IntoIterator<Item = usize>) {
        self.buckets.iter_mut().for_each(|b| b.pending = 0);
        for b in buckets {
            self.buckets[b].pending += 1;
        }
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

    /// Queues bucket `b`'s reduction; device gradients are read back first, in one transfer,
    /// into the bucket's element space.
    pub fn reduce(
        &mut self,
        b: usize,
        codec: &BucketCodec,
        worker: &Worker,
    ) -> Result<Reduced, String> {
        let bucket = &mut self.buckets[b];
        let mut staged = 0;
        let members: Vec<(usize, B::FloatTensorPrimitive)> = std::mem::take(&mut bucket.on_device)
            .into_iter()
            .enumerate()
            .filter_map(|(k, t)| t.map(|t| (k, t)))
            .collect();
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
        let bytes = self.reduce.bytes() * full.len() as u64;
        let reply = worker.reduce(b, full, self.reduce, codec.piece_elems());
        bucket.reductions.push(reply);
        Ok(Reduced { bytes, staged })
    }

    /// Waits for bucket `b`'s queued reductions and adds them into its piece; the first error.
    pub fn collect(&mut self, b: usize, timeline: &Timeline) -> Result<(), String> {
        let mut first_error = None;
        for reply in std::mem::take(&mut self.buckets[b].reductions) {
            match timeline.span(Track::Model, "wait reduction", Some(b), || reply.wait()) {
                Ok(piece) => {
                    let acc = &mut self.buckets[b].piece;
                    if acc.is_empty() {
                        *acc = piece;
                    } else {
                        acc.iter_mut().zip(&piece).for_each(|(a, g)| *a += g);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e.to_string());
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Bucket `b`'s reduced piece, taken (empty when it received no gradient).
    pub fn take_piece(&mut self, b: usize) -> Vec<f32> {
        std::mem::take(&mut self.buckets[b].piece)
    }
}
