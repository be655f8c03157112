//! The gradient-sync stage: each final gradient autodiff hands over is accumulated into its
//! bucket's full fp32 gradient buffer; once every expected gradient of the bucket is in, the
//! bucket is reduced on the communication lanes (reduce-scatter in the shard group, then across
//! replicas) while backward goes on; the update collects the reduced pieces.
//!
//! Micro-batches of gradient accumulation reduce once each and add their pieces up.

use crate::codec::BucketCodec;
use crate::timeline::{Timeline, Track};
use crate::worker::{Reply, Worker};

/// One bucket's gradients in flight.
#[derive(Default)]
struct BucketGrads {
    /// The full-bucket gradient being accumulated (empty until the first gradient arrives).
    full: Vec<f32>,
    /// Gradients still expected in this backward.
    pending: usize,
    /// Reductions queued on the communication lanes.
    reductions: Vec<Reply>,
    /// This rank's reduced piece, summed over the micro-batches collected so far.
    piece: Vec<f32>,
}

/// Every bucket's gradients in flight.
pub(super) struct GradSync {
    buckets: Vec<BucketGrads>,
}

impl GradSync {
    /// Nothing in flight for `buckets` buckets.
    pub fn new(buckets: usize) -> Self {
        Self {
            buckets: (0..buckets).map(|_| BucketGrads::default()).collect(),
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

    /// Queues bucket `b`'s reduction to pieces of `piece_elems`; returns the bytes it reduces.
    pub fn reduce(&mut self, b: usize, worker: &Worker, piece_elems: usize) -> u64 {
        let full = std::mem::take(&mut self.buckets[b].full);
        let bytes = 4 * full.len() as u64;
        let reply = worker.reduce(full, piece_elems);
        self.buckets[b].reductions.push(reply);
        bytes
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
