//! Settings of [`crate::shard`].

use sshsdp_plan::{Mesh, PlanConfig, RuntimeFormat, Sharding};

use crate::error::HsdpError;

/// Where the buffers of a storage role live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Host memory (`Vec`s), read and written by the host collectives directly.
    #[default]
    Host,
    /// The device of the decorated backend `B` (`B` tensors): on a GPU backend, GPU memory;
    /// values cross to the host only where a host collective or codec needs them (staged).
    Device,
}

/// How gathered parameters reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// SS-HSDP: the all-gather writes the bucket buffer that parameters are views of; nothing is
    /// copied around the collective.
    ZeroCopy,
    /// The PyTorch FSDP2 data path, as a baseline on the same machinery: the local shard is
    /// copied into the all-gather input (copy-in) and every parameter is copied out of the
    /// gathered buffer into a tensor of its own (copy-out).
    Fsdp2Style,
}

/// What an update does when the global gradient norm is not finite (a NaN or infinite gradient
/// element on any rank). Every rank measures the same norm (summed in f64 over the update group),
/// so every rank takes the same branch and the ranks stay in step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NonFinitePolicy {
    /// The update returns [`HsdpError::NonFiniteGradient`] on every rank and applies nothing
    /// (the default: a NaN is a bug to look at, not a value to train on).
    #[default]
    Error,
    /// The update is skipped on every rank (the gradients are dropped, the weights and optimizer
    /// state stay as they were) and counted in `Counters::skipped_steps`; training goes on. What
    /// mixed-precision loss scalers do with an overflowing step.
    SkipStep,
}

/// A floating-point type of the mixed-precision policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// IEEE single precision.
    #[default]
    F32,
    /// bfloat16: f32's exponent range, 8 significant bits; half the bytes.
    Bf16,
    /// IEEE half precision (11 significant bits, largest value 65504), for devices without bf16
    /// (most wgpu adapters). Compute only: gradients are reduced in f32 or bf16. Without a loss
    /// scale small gradients underflow in f16; prefer bf16 where the device has it.
    F16,
}

impl Precision {
    /// Bytes of one value.
    pub fn bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The Burn dtype of this precision.
    pub fn dtype(self) -> burn_backend::FloatDType {
        match self {
            Precision::F32 => burn_backend::FloatDType::F32,
            Precision::Bf16 => burn_backend::FloatDType::BF16,
            Precision::F16 => burn_backend::FloatDType::F16,
        }
    }
}

/// Which floating-point types parameters compute in and gradients are reduced in — PyTorch
/// FSDP2's `MixedPrecisionPolicy` (`param_dtype`, `reduce_dtype`). The fp32 master weights and
/// the optimizer's state stay f32 whatever the policy; the runtime format (f32, bf16, MXFP8) is
/// what parameters are *stored and gathered* in, decoded into the compute type.
///
/// * `compute`: the dtype of every parameter tensor forward and backward see (views of the
///   gathered bucket, which is decoded into this type: an MXFP8 or bf16 runtime parameter is
///   exact in bf16). With a 16-bit compute dtype the model's activations follow its parameters'
///   dtype, so float inputs must be cast to it by the model (`Tensor::cast`); integer inputs
///   (token ids) need nothing. Needs a backend that computes in that dtype (bf16: burn-flex,
///   CUDA; f16: burn-flex, CUDA, wgpu where the adapter has `shader-f16`); `shard` rejects one
///   that does not, naming it.
/// * `reduce`: the dtype gradients cross the network in. Gradients are accumulated in f32 (over
///   the parameters of a bucket and over micro-batches), rounded to `reduce` for the
///   reduce-scatter and the replica all-reduce (each engine sums in f32 and rounds once), and
///   widened back to f32 for the update. [`Precision::Bf16`] halves the reduction bytes;
///   [`Precision::F16`] is refused here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MixedPrecision {
    /// dtype parameters compute in (default f32).
    pub compute: Precision,
    /// dtype gradients are reduced in (default f32).
    pub reduce: Precision,
}

impl MixedPrecision {
    /// Compute in `compute`, reduce in `reduce`.
    pub fn new(compute: Precision, reduce: Precision) -> Self {
        Self { compute, reduce }
    }
}

/// How to shard a model.
///
/// By default a bucket gathered in forward stays resident through backward and is released by
/// the update (FSDP2's `reshard_after_forward=False`: fastest, most memory).
/// [`HsdpConfig::with_reshard_after_forward`] releases each bucket when forward moves on to
/// the next one and gathers it again in backward (prefetched in reverse forward order on the
/// communication thread), releasing it again once its gradients are in: gathered memory stays
/// at about two buckets, for one more all-gather per bucket. Burn's autodiff saves the
/// parameter *handles* its backward needs (`linear`, `layer_norm`, …), so releasing really
/// frees the gathered buffers.
///
/// Backward gathers run inside Burn's autodiff, which holds its graph lock during backward and,
/// after any backward, locks every graph of the process in turn. They run on a communication
/// lane of their own that never waits behind replica-group work, so a rank blocked inside
/// backward waits only for shard-group peers in the same step (the argument is written out in
/// `lanes/`).
#[derive(Clone, Debug, PartialEq)]
pub struct HsdpConfig {
    /// The rank mesh; must cover the communicator's world.
    pub mesh: Mesh,
    /// Planner settings (bucket size, sharding mode, runtime format, …).
    pub plan: PlanConfig,
    /// Zero-copy (default) or the FSDP2-style copy-in/copy-out baseline.
    pub copy_mode: CopyMode,
    /// Release gathered buckets after their forward use and gather them again in backward.
    pub reshard_after_forward: bool,
    /// What an update does with a non-finite gradient (default: an error on every rank).
    pub non_finite: NonFinitePolicy,
    /// Where the fp32 master weights (and with them the optimizer's state) live.
    pub masters: Placement,
    /// Where gradients are accumulated before their reduction.
    pub grads: Placement,
    /// Where this rank's runtime shards live; `None` (default): on the device exactly where
    /// that saves transfers — the engine moves device memory itself (NCCL on the GPU of a
    /// CubeCL CUDA backend, or in-process ranks sharing a CubeCL device) and the masters are on
    /// the device — on the host otherwise.
    pub shards: Option<Placement>,
    /// The dtypes parameters compute in and gradients are reduced in (default f32 for both).
    pub precision: MixedPrecision,
    /// Record every collective's span for a Chrome trace (`HsdpRuntime::take_trace`).
    pub trace: bool,
    /// Run collectives on device buffers where the engine can move the decorated backend's
    /// device memory (default `true`): NCCL on the backend's GPU, or ranks of one process that
    /// share one CubeCL device (the threads engine's peers collectives). `false` stages them
    /// through host memory (the comparison baseline).
    pub device_collectives: bool,
}

impl HsdpConfig {
    /// Sharding over `mesh` with the planner's defaults (hierarchical: runtime shards over the
    /// shard group, update pieces over the world) and f32 runtime parameters.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            plan: PlanConfig::default().with_format(RuntimeFormat::F32),
            copy_mode: CopyMode::ZeroCopy,
            reshard_after_forward: false,
            non_finite: NonFinitePolicy::Error,
            masters: Placement::Host,
            grads: Placement::Host,
            shards: None,
            precision: MixedPrecision::default(),
            trace: false,
            device_collectives: true,
        }
    }

    /// The same config with collectives on device buffers where the engine can move the
    /// backend's device memory (`true`, the default) or staged through host memory (`false`:
    /// the path of engines that move host memory only, kept for comparison). See
    /// [`HsdpConfig::device_collectives`].
    pub fn with_device_collectives(mut self, on_device: bool) -> Self {
        self.device_collectives = on_device;
        self
    }

    /// The same config recording a step timeline: every collective the lanes run and every wait
    /// of the model thread on one, as spans for [`crate::chrome_trace`] (fetched with
    /// `HsdpRuntime::take_trace`). The wait and busy *totals* are always counted
    /// ([`crate::Counters::comm_wait_ns`]); spans cost a little memory per collective.
    pub fn with_trace(mut self, trace: bool) -> Self {
        self.trace = trace;
        self
    }

    /// The same config with the fp32 masters in `placement`: [`Placement::Device`] keeps them as
    /// tensors on the decorated backend's device, so optimizers (given
    /// [`crate::PieceValues::Device`]) step them there with their state on the same device — on a
    /// GPU backend no master crosses PCIe for the update; each updated piece's runtime units are
    /// re-derived on the device and, unless the runtime shards are there too
    /// ([`HsdpConfig::with_shard_placement`]), read back once for the host shard. The masters
    /// are then kept apart from the runtime shard in every format, f32 included.
    pub fn with_master_placement(mut self, placement: Placement) -> Self {
        self.masters = placement;
        self
    }

    /// The same config accumulating gradients in `placement`: [`Placement::Host`] (default)
    /// reads each gradient back as autodiff hands it over; [`Placement::Device`] keeps each
    /// parameter's gradient as a tensor on the decorated backend's device (micro-batches summed
    /// there) and reads a bucket's gradients back in one transfer when it is reduced — on a GPU
    /// backend one transfer per bucket instead of one per parameter and micro-batch.
    pub fn with_grad_placement(mut self, placement: Placement) -> Self {
        self.grads = placement;
        self
    }

    /// The same config with the runtime shards in `placement` (instead of the default, see
    /// [`HsdpConfig::shards`]). [`Placement::Device`] keeps each shard in a CubeCL buffer of
    /// the decorated backend's device: an engine that moves device memory gathers from it and
    /// rebuilds it there, and each update's piece is encoded straight into it (no host copy of a
    /// shard in a step); an engine on host memory reads this rank's part back for each gather
    /// (correct, and it frees the host memory of the shards, but it moves more bytes). Needs a
    /// CubeCL backend, device masters ([`HsdpConfig::with_master_placement`]) and zero-copy mode.
    pub fn with_shard_placement(mut self, placement: Placement) -> Self {
        self.shards = Some(placement);
        self
    }

    /// The same config with the mixed-precision policy `precision` (see [`MixedPrecision`]).
    pub fn with_mixed_precision(mut self, precision: MixedPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// The same config with another policy for non-finite gradients.
    pub fn with_non_finite_policy(mut self, policy: NonFinitePolicy) -> Self {
        self.non_finite = policy;
        self
    }

    /// The same config with resharding after forward on or off (see the type's docs).
    pub fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    /// The same config with another sharding mode.
    pub fn with_sharding(mut self, sharding: Sharding) -> Self {
        self.plan.sharding = sharding;
        self
    }

    /// The same config with another copy mode.
    pub fn with_copy_mode(mut self, mode: CopyMode) -> Self {
        self.copy_mode = mode;
        self
    }

    /// The same config with another runtime format: `F32` (default), `Bf16` (half the
    /// runtime memory and all-gather bytes; fp32 master weights kept per piece) or `Mxfp8`
    /// (matrices as square-block MXFP8: E4M3 elements, one E8M0 scale per 32×32 tile, one
    /// copy that forward and backward both decode, about half of bf16's bytes; parameters the
    /// format cannot hold fall back to bf16 and are listed in `plan().fallbacks()`; fp32 masters
    /// kept per piece). See `sshsdp_plan::Bucket` for the tiled layout.
    pub fn with_format(mut self, format: RuntimeFormat) -> Self {
        self.plan.runtime_format = format;
        self
    }

    /// The same config with another bucket target (elements).
    pub fn with_bucket_elements(mut self, elements: u64) -> Self {
        self.plan.bucket_elements = elements;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), HsdpError> {
        if self.precision.reduce == Precision::F16 {
            return Err(HsdpError::Unsupported(
                "the mixed-precision policy reduces gradients in F16: gradients are reduced in \
                 F32 or Bf16 (F16 is a compute dtype only)"
                    .into(),
            ));
        }
        if self.shards == Some(Placement::Device) {
            if self.masters != Placement::Device {
                return Err(HsdpError::Unsupported(
                    "runtime shards on the device need the fp32 masters there too (each update \
                     encodes its piece from the device master): add \
                     .with_master_placement(Placement::Device)"
                        .into(),
                ));
            }
            if self.copy_mode != CopyMode::ZeroCopy {
                return Err(HsdpError::Unsupported(
                    "runtime shards on the device need zero-copy mode (the FSDP2-style baseline \
                     gathers into host memory)"
                        .into(),
                ));
            }
        }
        self.plan.validate().map_err(HsdpError::from)
    }
}
