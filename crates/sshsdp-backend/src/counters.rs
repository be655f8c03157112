//! What a step moved and copied, for benchmarks, the projection's cross-check and tests.

/// Bytes moved and copied since the last [`crate::HsdpRuntime::take_counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes received by bucket all-gathers (forward and backward).
    pub gathered_bytes: u64,
    /// Bytes of full-bucket gradients entering reductions, in the reduction dtype.
    pub reduced_bytes: u64,
    /// Parameter bytes copied outside collectives and re-derivation (0 on the zero-copy path).
    pub param_bytes_copied: u64,
    /// Gradient bytes copied from autodiff's tensors into bucket gradient buffers.
    pub grad_bytes_copied: u64,
    /// Bucket gathers.
    pub gathers: u64,
    /// Of those, gathers queued ahead of use (prefetched in the previous step's order).
    pub prefetched: u64,
    /// Gathers during backward (buckets released after forward and needed again).
    pub backward_gathers: u64,
    /// Most bytes of gathered (compute-dtype) buckets held at once.
    pub peak_resident_bytes: u64,
    /// Bytes of compute-dtype parameters produced by widening (bf16), decoding (MXFP8) or
    /// casting (a 16-bit compute dtype) gathered buckets; 0 where the gathered bucket is the
    /// compute buffer (f32 runtime parameters computed in f32, bf16 ones in bf16).
    pub decoded_bytes: u64,
    /// Bytes staged between the device and the host around host collectives and the host codec
    /// (device masters read back to re-derive runtime units; device gradients read back and
    /// reduced pieces uploaded by a staged reduction, on the lanes); 0 with host masters and
    /// gradients, and for gradients the engine reduces on device memory (NCCL).
    pub staged_bytes: u64,
    /// Bytes copied from the host into the decorated backend's tensors: gathered buckets (unless
    /// the backend takes the host buffer itself, as burn-ndarray does; on CubeCL backends the
    /// shard lane uploads them, and where NCCL gathers into device memory only this rank's part
    /// is uploaded), FSDP2-style copies out, and staging. On a GPU backend, host→device traffic.
    pub uploaded_bytes: u64,
    /// Bytes copied from the decorated backend's tensors to the host: gradients (unless read in
    /// place, as on burn-ndarray) and staging. On a GPU backend, device→host traffic.
    pub downloaded_bytes: u64,
    /// Reads of device memory by the host (each a wait for the device, unless issued ahead of
    /// its use, as a deferred step verdict is): gradients, staging, the gradient norm. 0 on
    /// backends whose tensors are host memory read in place (burn-ndarray).
    pub host_reads: u64,
    /// Host waits for a device queue to drain around device collectives (the peers engine:
    /// one when the buffers are readied, one before leaving, one more between reads and writes
    /// of a call in place; NCCL: one before each call, as CubeCL 0.10 gives no event to order
    /// its streams with NCCL's). 0 at world 1, which makes no collective.
    pub host_syncs: u64,
    /// Collective calls the communication lanes made (gathers, both stages of reductions,
    /// rebuilds, agreements, the optimizer's exchanges; each a call of the engine). A group of
    /// one rank makes none, so a step at world 1 makes none at all.
    pub collectives: u64,
    /// Updates skipped because the gradient was not finite
    /// ([`crate::NonFinitePolicy::SkipStep`]).
    pub skipped_steps: u64,
    /// Nanoseconds the model thread waited on collectives (gathers in forward and backward,
    /// reductions, the norm, rebuilds and the optimizer's exchanges): exposed communication.
    pub comm_wait_ns: u64,
    /// Nanoseconds the communication lanes spent running collectives (both lanes summed).
    pub comm_busy_ns: u64,
}
