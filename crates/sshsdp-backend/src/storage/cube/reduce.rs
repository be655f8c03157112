//! Gradient reductions of device-resident gradient buckets on CubeCL backends: the full-bucket
//! gradient is assembled on the device (the members' gradients at their places in the bucket's
//! element space, zeros between) and its reduction's two stages run on the two lanes, as host
//! reductions do (`lanes/`), in one of two ways:
//!
//! * **By the engine on device memory** (NCCL on `CubeBackend<CudaRuntime>`, or in-process
//!   ranks sharing the device: `exchange.rs`; where the runtime's gathers go to device memory
//!   too): reduce-scatter in the shard group, then across replicas, on CubeCL's buffers in the
//!   reduction dtype (the bf16 cast is Burn's kernel), summed, then divided once by the world
//!   size; no byte crosses to the host.
//! * **Staged**: the shard lane reads the f32 gradient back, the host collectives reduce it
//!   (rounded to the reduction dtype there, exactly as for host gradients), and the replica
//!   lane uploads the reduced piece. The transfers run on the lanes, overlapping backward.
//!
//! Either way the update gets the piece as a device tensor.

use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, DType};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use half::bf16;
use sshsdp_comm::{CommError, CommResult, ElementKind};
use sshsdp_plan::Sharding;

use super::adapter::{from_cube, to_cube, Inner};
use super::codec::{cube_tensor, CubeUnits};
use super::exchange::{CubeBuffers, Span};
use super::{for_each_runtime, is_cube, lane_client, lane_upload, stream_mark, word_buffer_len};
use crate::config::Precision;
use crate::error::HsdpError;
use crate::lanes::comm::MeshComm;
use crate::lanes::DeviceReduceJob;
use crate::runtime_units::{DeviceUnits, Elems};
use crate::storage::roles::GradSource;
use crate::storage::ReduceShape;
use crate::traffic::{Purpose, Traffic};
use std::sync::Arc;

/// The reduction job of `source` over `shards` shards into a piece of `piece_len` elements in
/// the reduction dtype `reduce` — by the engine on device memory for [`GradSource::Full`]
/// (`exchange.rs`), staged through the host for [`GradSource::Members`] — if
/// `B` is a CubeCL backend this build supports (`None` otherwise).
pub(crate) fn reduce_job_if_cube<B: Backend>(
    source: GradSource<B>,
    reduce: Precision,
    sharding: Sharding,
    shape: ReduceShape,
    traffic: &Arc<Traffic>,
) -> Option<Box<dyn DeviceReduceJob>> {
    for_each_runtime!(R => {
        if is_cube::<B, R>() {
            // The bucket's gradient buffer as backward left it: on fusion, its queued work is
            // drained here, once per completed bucket (never per gradient).
            let tensor = to_cube::<B, R>;
            let source = match source {
                GradSource::Full(full) => Source::Full(tensor(full)),
                GradSource::Members { cat, runs, full_len } => Source::Members {
                    cat: tensor(cat),
                    runs,
                    full_len,
                },
            };
            return Some(Box::new(CubeReduceJob::<R>::new(
                source, reduce, sharding, shape, traffic.clone(),
            )));
        }
    });
    None
}

/// [`GradSource`] on runtime `R`.
enum Source<R: CubeRuntime> {
    Full(CubeTensor<R>),
    Members {
        cat: CubeTensor<R>,
        runs: Vec<(usize, usize, usize)>,
        full_len: usize,
    },
}

/// The reduced piece `units` as an f32 tensor of `B` on `device` (a bf16 piece is widened by
/// Burn's cast kernel).
pub(crate) fn piece_tensor<B: Backend>(
    units: &DeviceUnits,
    device: &B::Device,
) -> Result<B::FloatTensorPrimitive, HsdpError> {
    for_each_runtime!(R => {
        if let (true, Some(cube)) = (is_cube::<B, R>(), units.buffer.downcast_ref::<CubeUnits<R>>()) {
            let tensor = |dtype| cube_tensor::<B, R>(cube, cube.handle.clone(), units.len, dtype, device);
            let piece = match units.kind {
                Elems::Bf16(_) => Inner::<R>::float_cast(tensor(DType::BF16), burn_backend::FloatDType::F32),
                _ => tensor(DType::F32),
            };
            return Ok(from_cube::<B, R>(piece));
        }
    });
    Err(HsdpError::Failed(
        "a reduced gradient in device memory of a runtime this build does not support".into(),
    ))
}

/// One bucket's reduction on its way through the lanes.
struct CubeReduceJob<R: CubeRuntime> {
    client: ComputeClient<R>,
    /// The device of the gradient (for the engine path's final scaling).
    device: R::Device,
    /// The full-bucket gradient (engine path) or the members' concatenated gradients (staged).
    full: Handle,
    /// Elements of the bucket.
    full_len: usize,
    /// Staged path: where the concatenated values go in the bucket.
    runs: Vec<(usize, usize, usize)>,
    /// The dtype of the device buffers (f32, or bf16 on the engine's path with a bf16
    /// reduction).
    kind: ElementKind,
    /// The reduction dtype.
    reduce: Precision,
    /// Whether the engine reduces the device buffers itself (else: staged through the host).
    on_device: bool,
    /// Engine path: the stages whose group is one rank, which move nothing and are not run
    /// (their result buffer is their input buffer): the shard stage, the replica stage.
    alone: (bool, bool),
    /// Engine path: this rank's shard after the first stage (the full buffer itself under DDP).
    shard: Handle,
    shard_len: usize,
    /// Engine path: the piece after the second stage (the shard itself but when hierarchical).
    piece: Handle,
    piece_len: usize,
    /// Staged path: the first stage's result.
    host_shard: Option<Elems>,
    /// Engine path: a [`stream_mark`] made once the kernels writing `full` were queued (the
    /// job is made after them). `full`'s own stamp is its allocation's, and a lane that synced
    /// with the model stream after that allocation but before the writes (a gradient
    /// accumulated in place; under DDP no fresh buffer is in the first stage's ready call)
    /// would otherwise hand NCCL a buffer still being written.
    written: Option<Handle>,
    /// Charged with the staged path's moves.
    traffic: Arc<Traffic>,
}

impl<R: CubeRuntime> CubeReduceJob<R> {
    fn new(
        source: Source<R>,
        reduce: Precision,
        sharding: Sharding,
        shape: ReduceShape,
        traffic: Arc<Traffic>,
    ) -> Self {
        let (shards, piece_len) = (shape.shards, shape.piece_len);
        let (full, full_len, runs, on_device) = match source {
            // The runtime passes a full gradient only where the engine reduces device memory.
            Source::Full(full) => {
                let len = full.meta.shape().num_elements();
                (full, len, vec![(0, 0, len)], true)
            }
            Source::Members {
                cat,
                runs,
                full_len,
            } => (cat, full_len, runs, false),
        };
        let kind = match full.dtype {
            DType::BF16 => ElementKind::Bf16,
            _ => ElementKind::F32,
        };
        // The lanes read the gradient and upload the reduced piece through it.
        let client = lane_client(full.client.clone());
        let unit = if kind == ElementKind::Bf16 { 2 } else { 4 };
        let buffer = |len: usize| client.empty(word_buffer_len(unit * len));
        let shard_len = full_len / shards.max(1);
        // Under DDP the shard is the full gradient; a stage over one rank is not run, and its
        // result is its input: no buffer, no copy, no collective.
        let alone = match sharding {
            Sharding::Ddp => (true, false),
            Sharding::Hsdp | Sharding::Hierarchical => (shards == 1, shape.replicas == 1),
        };
        let (shard, piece) = match (on_device, sharding) {
            (false, _) | (true, Sharding::Ddp) => (full.handle.clone(), full.handle.clone()),
            (true, Sharding::Hsdp | Sharding::Hierarchical) => {
                let shard = match alone.0 {
                    true => full.handle.clone(),
                    false => buffer(shard_len),
                };
                let piece = match (sharding, alone.1) {
                    (Sharding::Hierarchical, false) => buffer(piece_len),
                    _ => shard.clone(),
                };
                (shard, piece)
            }
        };
        let written = on_device.then(|| stream_mark(&client));
        Self {
            device: full.device.clone(),
            full: full.handle,
            client,
            full_len,
            runs,
            kind,
            reduce,
            on_device,
            alone,
            shard,
            shard_len,
            piece,
            piece_len,
            host_shard: None,
            written,
            traffic,
        }
    }

    /// The buffers of a stage from `send` into `recv` (in place where they are one buffer).
    fn stage(&self, send: &Handle, recv: &Handle, in_place: bool) -> CubeBuffers<R> {
        let client = self.client.clone();
        let buffers = if in_place {
            CubeBuffers::in_place(client, self.kind, Span::of(recv.clone()))
        } else {
            CubeBuffers::apart(
                client,
                self.kind,
                Span::of(send.clone()),
                Span::of(recv.clone()),
            )
        };
        buffers.charging(&self.traffic)
    }

    /// Engine path, after both stages: the piece holds the world's *sum* (the device
    /// collectives only sum: NCCL 2.28.9's `ncclAvg` reduce-scatter left an output's tail
    /// unwritten, `docs/H200.md`); one multiplication by `1 / world` makes it the average, as
    /// the host engines define it (sum, then one multiplication). Queued on this lane's stream
    /// and flushed, as a lane upload is, so the model thread's reads are ordered after it.
    fn average(&mut self, world: usize) {
        if world <= 1 {
            return;
        }
        let dtype = match self.kind {
            ElementKind::Bf16 => DType::BF16,
            _ => DType::F32,
        };
        let piece = CubeTensor::<R>::new_contiguous(
            self.client.clone(),
            self.device.clone(),
            burn_backend::Shape::from([self.piece_len]),
            self.piece.clone(),
            dtype,
        );
        let scaled = Inner::<R>::float_mul_scalar(piece, (1.0 / world as f64).into());
        self.piece = scaled.handle;
        if let Err(e) = self.client.flush() {
            log::warn!("flushing a lane's stream after averaging a gradient piece: {e:?}");
        }
    }
}

impl<R: CubeRuntime> DeviceReduceJob for CubeReduceJob<R> {
    fn within_shard_group(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()> {
        if self.on_device {
            // Under DDP, or a shard group of one, the shard is the full gradient: nothing moves.
            if self.alone.0 {
                return Ok(());
            }
            let mut bufs = self
                .stage(&self.full, &self.shard, false)
                .after(self.written.clone());
            return comm.reduce_within_shard_group_device(sharding, &mut bufs, self.shard_len);
        }
        // Only the members' values cross (padding stays behind), placed on the host.
        let bytes = self
            .client
            .read_one(self.full.clone())
            .map_err(|e| CommError::Engine(format!("reading gradients back: {e:?}")))?;
        let cat: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        self.traffic.download(4 * cat.len() as u64, Purpose::Stage);
        let mut values = vec![0f32; self.full_len];
        for &(at, from, len) in &self.runs {
            values[at..at + len].copy_from_slice(&cat[from..from + len]);
        }
        // Rounded to the reduction dtype as the host path rounds (`lanes/`).
        let full = match self.reduce {
            Precision::Bf16 => Elems::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            _ => Elems::F32(values),
        };
        self.host_shard = Some(comm.reduce_within_shard_group(sharding, full)?);
        Ok(())
    }

    fn across_replicas(&mut self, comm: &dyn MeshComm, sharding: Sharding) -> CommResult<()> {
        if self.on_device {
            // A reduce-scatter across replicas when hierarchical; in place otherwise; nothing
            // over a replica group of one (the shard is the piece).
            if !self.alone.1 {
                let in_place = sharding != Sharding::Hierarchical;
                let mut bufs = self
                    .stage(&self.shard, &self.piece, in_place)
                    .after(self.written.clone());
                comm.reduce_across_replicas_device(sharding, &mut bufs, self.piece_len)?;
            }
            self.average(comm.world_size());
            return Ok(());
        }
        let shard = self
            .host_shard
            .take()
            .ok_or_else(|| CommError::Engine("the first reduction stage left no shard".into()))?;
        let piece: Vec<f32> = match comm.reduce_across_replicas(sharding, shard, self.piece_len)? {
            Elems::F32(piece) => piece,
            Elems::Bf16(piece) => piece.iter().map(|g| g.to_f32()).collect(),
            Elems::U8(_) => {
                return Err(CommError::Mismatch(
                    "a gradient reduction returned bytes".into(),
                ))
            }
        };
        self.piece_len = piece.len();
        self.kind = ElementKind::F32;
        self.traffic.upload(4 * piece.len() as u64, Purpose::Stage);
        self.piece = lane_upload(&self.client, &Elems::F32(piece).word_bytes());
        Ok(())
    }

    fn into_piece(self: Box<Self>) -> DeviceUnits {
        let job = *self;
        DeviceUnits {
            len: job.piece_len,
            kind: match job.kind {
                ElementKind::Bf16 => Elems::Bf16(Vec::new()),
                _ => Elems::F32(Vec::new()),
            },
            narrowed: None,
            buffer: Box::new(CubeUnits::<R>::new(job.client, job.piece)),
        }
    }
}
