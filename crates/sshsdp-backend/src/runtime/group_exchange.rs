//! The update group's all-to-all-v ([`UpdateGroup::exchange`] and its forms): each piece's
//! holder sends every other its chunk, on host memory or on the device (Muon's owner exchange
//! of split matrices).

use std::ops::Range;

use burn_backend::{Backend, FloatDType, Shape, Slice, TensorMetadata};

use super::pieces::UpdateGroup;
use crate::error::HsdpError;
use crate::lanes::{DeviceEngine, UpdateBuffer, UpdateReceived};
use crate::storage::{device_piece, device_update_job, download, upload};
use crate::timeline::Track;
use crate::traffic::Purpose;

impl UpdateGroup<'_> {
    /// Sends `send[p]` to the holder of piece `p` and returns, per piece `p`, the
    /// `recv_counts[p]` elements its holder sent this rank (one all-to-all-v over the update
    /// group; every rank calls it in the same order, and what piece `a` sends piece `b` must be
    /// what `b` expects from `a`, or it is an error on every rank). Chunks may be empty; only
    /// non-empty chunks between different ranks cross the network.
    pub fn exchange(
        &self,
        send: Vec<Vec<f32>>,
        recv_counts: &[usize],
    ) -> Result<Vec<Vec<f32>>, HsdpError> {
        let (recv, ranges) = self.exchange_flat(send, recv_counts)?;
        Ok(ranges.into_iter().map(|r| recv[r].to_vec()).collect())
    }

    /// [`Self::exchange`] without splitting what arrives: one buffer and, per piece `p`, the
    /// range of it that piece `p`'s holder sent (no second copy of the received elements).
    pub fn exchange_flat(
        &self,
        send: Vec<Vec<f32>>,
        recv_counts: &[usize],
    ) -> Result<(Vec<f32>, Vec<std::ops::Range<usize>>), HsdpError> {
        self.check_chunks(send.len(), recv_counts)?;
        if self.alone() {
            // A group of one: this rank's chunk for itself, no collective.
            let mine = send.into_iter().next().unwrap_or_default();
            if mine.len() != recv_counts.iter().sum::<usize>() {
                return Err(HsdpError::Failed(format!(
                    "exchange on one rank: {} elements sent, {} expected",
                    mine.len(),
                    recv_counts.iter().sum::<usize>()
                )));
            }
            let n = mine.len();
            return Ok((mine, std::iter::once(0..n).collect()));
        }
        let by_rank = self.pieces_by_rank();
        let send_counts: Vec<usize> = by_rank.iter().map(|&p| send[p].len()).collect();
        let rank_recv: Vec<usize> = by_rank.iter().map(|&p| recv_counts[p]).collect();
        let mut flat = Vec::with_capacity(send_counts.iter().sum());
        for &p in &by_rank {
            flat.extend_from_slice(&send[p]);
        }
        drop(send);
        match self.all_to_all(UpdateBuffer::Host(flat), send_counts, rank_recv)? {
            UpdateReceived::Host(recv) => Ok((recv, ranges_by_piece(&by_rank, recv_counts))),
            UpdateReceived::Device(_) => Err(HsdpError::Failed(
                "a host all-to-all came back in device memory".into(),
            )),
        }
    }

    /// Whether [`Self::exchange_tensor`] moves device memory itself: ranks of this process
    /// sharing a CubeCL device (the peers engine). Over NCCL the device all-to-all-v is not
    /// wired (nothing above world 1 could test it here) and an exchange of device tensors is
    /// staged through the host while [`Self::all_reduce_on_device`] holds: a device optimizer
    /// there exchanges by all-reduce instead, as `sshsdp_optim::ShardedMuon` does.
    pub fn all_to_all_on_device(&self) -> bool {
        self.engine_on_device && self.worker.device_engine() == Some(DeviceEngine::Peers)
    }

    /// Whether [`Self::all_reduce_sum_tensor`] moves device memory itself (NCCL, or the peers
    /// engine); elsewhere device tensors are staged through the host.
    pub fn all_reduce_on_device(&self) -> bool {
        self.engine_on_device
    }

    /// [`Self::exchange_flat`] of 1-D f32 tensors of the decorated backend `B` on `device`:
    /// `send[p]`, concatenated, goes to piece `p`'s holder; returns what arrived, as one tensor,
    /// and per piece `p` the range its holder sent. Moved by the engine in device memory where
    /// [`Self::all_to_all_on_device`], else staged through the host collectives (read back and
    /// uploaded: charged to the runtime's counters as staging). A group of one rank makes no
    /// collective and moves nothing; the tensors of all pieces are concatenated once.
    pub fn exchange_tensor<B: Backend>(
        &self,
        send: Vec<Vec<B::FloatTensorPrimitive>>,
        recv_counts: &[usize],
        device: &B::Device,
    ) -> Result<(B::FloatTensorPrimitive, Vec<Range<usize>>), HsdpError> {
        self.check_chunks(send.len(), recv_counts)?;
        let by_rank = self.pieces_by_rank();
        let numel = |ts: &[B::FloatTensorPrimitive]| -> usize {
            ts.iter().map(|t| t.shape().num_elements()).sum()
        };
        let send_counts: Vec<usize> = by_rank.iter().map(|&p| numel(&send[p])).collect();
        let rank_recv: Vec<usize> = by_rank.iter().map(|&p| recv_counts[p]).collect();
        let total_recv: usize = recv_counts.iter().sum();
        let mut send = send;
        let mut parts: Vec<B::FloatTensorPrimitive> = by_rank
            .iter()
            .flat_map(|&p| std::mem::take(&mut send[p]))
            .filter(|t| t.shape().num_elements() > 0)
            .collect();
        // At least one element: a rank that sends nothing still names a buffer.
        let flat = match parts.len() {
            0 => B::float_zeros(Shape::new([1]), device, FloatDType::F32),
            1 => parts.remove(0),
            _ => B::float_cat(parts, 0),
        };
        let ranges = ranges_by_piece(&by_rank, recv_counts);
        if self.alone() {
            let sent: usize = send_counts.iter().sum();
            if sent != total_recv {
                return Err(HsdpError::Failed(format!(
                    "exchange on one rank: {sent} elements sent, {total_recv} expected"
                )));
            }
            return Ok((B::float_slice(flat, &[Slice::from(0..sent)]), ranges));
        }
        let job = match self.all_to_all_on_device() {
            true => device_update_job::<B>(flat.clone(), Some(total_recv), self.traffic),
            false => None,
        };
        let buf = match job {
            Some(job) => UpdateBuffer::Device(job),
            None => {
                let mut host = download::<B>(flat, self.traffic, Purpose::Stage)?;
                host.truncate(send_counts.iter().sum());
                UpdateBuffer::Host(host)
            }
        };
        let tensor = match self.all_to_all(buf, send_counts, rank_recv)? {
            UpdateReceived::Device(units) if units.len == total_recv => {
                device_piece::<B>(&units, device)?
            }
            UpdateReceived::Host(recv) if recv.len() == total_recv => {
                upload::<B>(recv, device, self.traffic, Purpose::Stage)
            }
            _ => {
                return Err(HsdpError::Failed(
                    "an update-group all-to-all returned another length than expected".into(),
                ))
            }
        };
        Ok((tensor, ranges))
    }

    /// An error unless there are `chunks` chunks to send and a count to receive per piece.
    fn check_chunks(&self, chunks: usize, recv_counts: &[usize]) -> Result<(), HsdpError> {
        let pieces = self.piece_ranks.len();
        if chunks != pieces || recv_counts.len() != pieces {
            return Err(HsdpError::Failed(format!(
                "exchange: {chunks} chunks to send and {} counts for {pieces} pieces",
                recv_counts.len()
            )));
        }
        Ok(())
    }

    /// One all-to-all-v of `buf` over the update group (counts by update-group rank), waited
    /// for.
    fn all_to_all(
        &self,
        buf: UpdateBuffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Result<UpdateReceived, HsdpError> {
        let reply = self.worker.all_to_all_v(buf, send_counts, recv_counts);
        Ok(self
            .timeline
            .span(Track::Model, "wait optimizer all-to-all", None, || {
                reply.wait()
            })?)
    }

    /// The pieces in update-group rank order.
    fn pieces_by_rank(&self) -> Vec<usize> {
        let mut by_rank = vec![0; self.piece_ranks.len()];
        for (p, &r) in self.piece_ranks.iter().enumerate() {
            by_rank[r] = p;
        }
        by_rank
    }
}

/// Per piece, the range of the received buffer its holder sent (chunks arrive in rank order).
fn ranges_by_piece(by_rank: &[usize], recv_counts: &[usize]) -> Vec<Range<usize>> {
    let mut ranges = vec![0..0; by_rank.len()];
    let mut at = 0;
    for &p in by_rank {
        ranges[p] = at..at + recv_counts[p];
        at += recv_counts[p];
    }
    ranges
}
