//! The NCCL engine: one rank per GPU, collectives on device memory through
//! [cudarc](https://docs.rs/cudarc)'s NCCL and CUDA driver bindings.
//!
//! # Two paths
//!
//! * **Device path** (what training uses): [`NcclComm::all_gather_in_place_dev`],
//!   [`NcclComm::all_gather_dev`], [`NcclComm::reduce_scatter_dev`],
//!   [`NcclComm::reduce_scatter_in_place_dev`], [`NcclComm::all_reduce_dev`] and
//!   [`NcclComm::broadcast_dev`] take cudarc device buffers ([`CudaSlice`], [`CudaView`],
//!   [`CudaViewMut`](cudarc::driver::CudaViewMut)) of a [`DeviceElement`] and *enqueue* the
//!   collective on the communicator's stream: they return once it is queued, and later work on
//!   that stream (or on buffers tracked by cudarc's events) sees the result. No copies are made;
//!   the in-place all-gather uses NCCL's in-place convention (`sendbuff = recvbuff + rank·count`)
//!   and the in-place reduce-scatter its mirror (`recvbuff = sendbuff + rank·count`).
//! * **Raw device path** (what the SS-HSDP runtime uses on CubeCL's CUDA buffers):
//!   [`DeviceCollective`](crate::DeviceCollective), reached through
//!   [`Collective::device`](crate::Collective::device), runs the same device-path methods on
//!   memory of another allocator named by address, then waits (bounded, as below) for the
//!   stream; ordering against the owner's work is the caller's.
//! * **Host path**: the [`Collective`](crate::Collective) implementation takes host slices, so
//!   it *stages*: it copies the input to device memory, runs the device method and copies the
//!   result back, then waits for the stream. It exists for the conformance suite and for small
//!   control messages (flags, loss scalars, step counters); bulk data should stay on the device.
//!   Asynchronous starts use the trait's synchronous defaults on this path.
//!
//! # Element types
//!
//! `f32` and `u8` are moved as `ncclFloat32` and `ncclUint8`. cudarc implements its traits for
//! `half::bf16` only behind its `f16` feature, which this crate does not enable, so device
//! buffers of bf16 are `CudaSlice<`[`Bf16Bits`]`>` (a `#[repr(transparent)]` `u16` with the
//! bf16 bit pattern; [`bf16_as_bits`] and [`bits_as_bf16`] reinterpret host slices for free).
//! The engine calls NCCL through cudarc's `result` level with `ncclBfloat16` for them, so
//! bf16 reductions are real bf16 reductions on the GPU, not byte moves.
//!
//! # Reductions
//!
//! [`ReduceOp::Sum`](crate::ReduceOp::Sum) is `ncclSum`. The device path sums only:
//! [`ReduceOp::Avg`](crate::ReduceOp::Avg) there is an argument error, and callers divide once
//! afterwards (the SS-HSDP runtime multiplies a reduced gradient piece by `1 / world` on its
//! lane). `ncclAvg` is not used at all: NCCL 2.28.9's `ncclAvg` reduce-scatter left the tail of
//! its output unwritten at one rank on an H200 (`docs/H200.md`). The host path runs `ncclSum`
//! and multiplies by `1 / size` once on the host after the copy back, which is exactly the
//! crate's definition of the average (sum, then one multiplication), so it matches the other
//! engines. `u8` may be summed on the device (NCCL wraps modulo 256).
//!
//! # Sub-communicators
//!
//! [`Collective::split`](crate::Collective::split) is `ncclCommSplit` (called through cudarc's
//! `sys` level: cudarc's `result::comm_split` wrapper is compiled only for CUDA 12.2–12.5).
//! NCCL orders the new ranks by `key`, then by old rank, as the trait asks. The child uses the
//! parent's device and stream.
//!
//! # Bootstrap
//!
//! All ranks of a world share one [`NcclUniqueId`] (128 opaque bytes made by one rank):
//!
//! * one process, one thread per GPU: [`NcclComm::run_threads`] (or make the id with
//!   [`NcclUniqueId::new`] and call [`NcclComm::from_id`] on every thread);
//! * several processes under MPI: [`NcclComm::from_collective`] broadcasts the id over any
//!   other engine (MPI: `broadcast::<u8>`);
//! * several processes without MPI (`torchrun`, `srun`, Kubernetes): [`NcclComm::from_launch`]
//!   reads the launcher's variables ([`crate::launch::LaunchEnv`]) and gets the id from rank
//!   0's TCP rendezvous; later ids (the runtime's lanes) go over that communicator itself;
//! * or move [`NcclUniqueId::as_bytes`] yourself and rebuild it with
//!   [`NcclUniqueId::from_bytes`].
//!
//! [`NcclComm`] is neither `Send` nor `Sync` (it owns a raw `ncclComm_t`): create it on the thread
//! that uses it. `ncclCommInitRank` blocks until every rank has joined.
//!
//! # Threads on one GPU
//!
//! A rank's lanes are threads, each with its own communicator on the rank's GPU. NCCL allows one
//! thread at a time to issue operations to the communicators of a device, so every enqueue
//! (collective, or group) holds that GPU's enqueue lock; waits do not (`enqueue.rs`). Peers
//! must be connected in `ncclCommInitRank`: [`NcclLanes`] requires `NCCL_RUNTIME_CONNECT=0` in
//! every rank's environment (the caller's; this crate never sets variables), so no enqueue
//! waits for a peer under the lock (`lanes.rs` has the argument and the memory it costs).
//!
//! # Failures
//!
//! Waits never block without a bound ([`NcclComm::synchronize`], and every host-path call,
//! which waits before it copies back): they poll the stream, NCCL's asynchronous error, the
//! rank's [`Liveness`] and a watchdog deadline ([`NCCL_TIMEOUT_ENV`], default
//! [`DEFAULT_NCCL_TIMEOUT`]), and on an error, an abort or a timeout call `ncclCommAbort` and
//! return the error. [`NcclLanes`] shares one liveness among a rank's lanes, and its
//! [`CommFactory::abort`](crate::CommFactory::abort) fails them all; once failed, every call
//! returns `Err` before it enqueues, so the rank stays in step with peers that fail the same
//! calls. See `watch.rs`.
//!
//! # Availability
//!
//! cudarc loads `libcuda` and `libnccl` at run time and *panics* when one is missing. [`probe`]
//! (and [`is_available`]) touch both libraries inside `catch_unwind` with a silent panic hook
//! (restored afterwards), check that every NCCL symbol this engine calls is present, initialise
//! the driver and count GPUs; any failure is [`CommError::Unavailable`](crate::CommError) with
//! the reason. Every constructor probes first, so no engine call panics for a missing library.
//! The result is computed once per process.
//!
//! NCCL ships as `libnccl.so.2` (for example in the Python package `nvidia-nccl-cu13`, under
//! `site-packages/nvidia/nccl/lib/`), while cudarc looks for `libnccl.so` (and `.so.1`,
//! `.so.<CUDA major>`, …, but not `.so.2`). Make a symlink in a directory on the library path:
//!
//! ```text
//! mkdir -p /tmp/nccl-lib
//! ln -sf "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib/libnccl.so.2" /tmp/nccl-lib/libnccl.so
//! export LD_LIBRARY_PATH=/tmp/nccl-lib:$LD_LIBRARY_PATH
//! ```

mod comm;
mod device;
mod enqueue;
mod failure;
mod host;
mod id;
mod lanes;
mod launch;
mod probe;
mod raw;
mod watch;

use std::any::TypeId;
use std::ffi::CStr;

use cudarc::driver::{DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys;
use half::bf16;

pub use comm::NcclComm;
pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView};
pub use id::{NcclUniqueId, NCCL_UNIQUE_ID_BYTES};
pub use lanes::{connects_at_init, NcclLanes, RUNTIME_CONNECT_ENV};
pub use launch::{DEFAULT_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_ENV};
pub use probe::{device_count, gpu_memory, is_available, nccl_version, probe};
pub use watch::{
    startup_timeout_from_env, timeout_from_env, Liveness, DEFAULT_NCCL_STARTUP_TIMEOUT,
    DEFAULT_NCCL_TIMEOUT, NCCL_STARTUP_TIMEOUT_ENV, NCCL_TIMEOUT_ENV,
};

use crate::{CommError, Element, ElementKind};

/// The bit pattern of a `half::bf16`, as stored in device buffers.
///
/// cudarc implements [`DeviceRepr`] for `half::bf16` only behind its `f16` feature, so device
/// buffers of bf16 use this `#[repr(transparent)]` `u16` instead; collectives on it use
/// `ncclBfloat16`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16Bits(pub u16);

// SAFETY: a plain `u16` (repr(transparent)): every bit pattern is valid and the layout is the
// device's 16-bit integer layout.
unsafe impl DeviceRepr for Bf16Bits {}
// SAFETY: all-zero bits are the bf16 value +0.0.
unsafe impl ValidAsZeroBits for Bf16Bits {}

impl From<bf16> for Bf16Bits {
    fn from(x: bf16) -> Self {
        Bf16Bits(x.to_bits())
    }
}

impl From<Bf16Bits> for bf16 {
    fn from(x: Bf16Bits) -> Self {
        bf16::from_bits(x.0)
    }
}

/// Reinterprets bf16 values as their device representation (no copy).
pub fn bf16_as_bits(s: &[bf16]) -> &[Bf16Bits] {
    // SAFETY: bf16 and Bf16Bits are both repr(transparent) wrappers of u16: same size,
    // alignment and validity; the lifetime is carried over.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

/// Reinterprets device-representation values as bf16 (no copy).
pub fn bits_as_bf16(s: &[Bf16Bits]) -> &[bf16] {
    // SAFETY: as in `bf16_as_bits`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

/// An element type of device buffers the engine moves: `f32`, `u8` and [`Bf16Bits`].
pub trait DeviceElement: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static {
    /// The element kind (which NCCL datatype is used).
    const KIND: ElementKind;
    /// The host element type with the same layout ([`Element`] of the host path).
    type Host: Element;
}

impl DeviceElement for f32 {
    const KIND: ElementKind = ElementKind::F32;
    type Host = f32;
}

impl DeviceElement for u8 {
    const KIND: ElementKind = ElementKind::U8;
    type Host = u8;
}

impl DeviceElement for Bf16Bits {
    const KIND: ElementKind = ElementKind::Bf16;
    type Host = bf16;
}

/// The NCCL datatype of an element kind.
fn nccl_dtype(kind: ElementKind) -> sys::ncclDataType_t {
    match kind {
        ElementKind::F32 => sys::ncclDataType_t::ncclFloat32,
        ElementKind::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        ElementKind::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

/// Reinterprets a host slice of `T` as the device representation `D`, when `D::Host` is `T`.
fn host_as_dev<T: Element, D: DeviceElement>(s: &[T]) -> Result<&[D], CommError> {
    check_same::<T, D>()?;
    // SAFETY: T is D::Host (checked by TypeId), and each DeviceElement has its host type's
    // layout: f32 = f32, u8 = u8, Bf16Bits = repr(transparent) u16 = bf16.
    Ok(unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) })
}

/// Mutable form of [`host_as_dev`].
fn host_as_dev_mut<T: Element, D: DeviceElement>(s: &mut [T]) -> Result<&mut [D], CommError> {
    check_same::<T, D>()?;
    // SAFETY: as in `host_as_dev`; every bit pattern of D is a valid T and vice versa.
    Ok(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) })
}

fn check_same<T: Element, D: DeviceElement>() -> Result<(), CommError> {
    if TypeId::of::<T>() != TypeId::of::<D::Host>()
        || std::mem::size_of::<T>() != std::mem::size_of::<D>()
    {
        return Err(CommError::InvalidArgument(format!(
            "the NCCL engine moves f32, half::bf16 and u8; {} is not one of them",
            std::any::type_name::<T>()
        )));
    }
    Ok(())
}

/// An NCCL error as a [`CommError::Engine`], with NCCL's message.
fn nccl_error(op: &str, e: NcclError, comm: Option<sys::ncclComm_t>) -> CommError {
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string (or
    // null); the symbol was checked present by `probe`, which every constructor runs first.
    let what = unsafe { cstr(sys::ncclGetErrorString(e.0)) };
    // SAFETY: `comm` is a live communicator of this rank; ncclGetLastError returns a
    // NUL-terminated string owned by NCCL (or null).
    let last = comm
        .map(|c| unsafe { cstr(sys::ncclGetLastError(c)) })
        .filter(|s| !s.is_empty())
        .map(|s| format!(" ({s})"))
        .unwrap_or_default();
    CommError::Engine(format!("{op}: NCCL {:?}: {what}{last}", e.0))
}

/// Copies a C string owned by a library into a `String` (empty for null).
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the call.
unsafe fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: caller guarantees a valid NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// A CUDA driver error as a [`CommError::Engine`].
fn cuda_error(op: &str, e: DriverError) -> CommError {
    CommError::Engine(format!("{op}: CUDA {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Collective, CommError};

    #[test]
    fn probe_returns_without_panicking() {
        // Either answer is fine; it must not panic, and both calls must agree.
        let a = is_available();
        let b = is_available();
        assert_eq!(a, b);
        assert_eq!(a, probe().is_ok());
        if let Err(e) = probe() {
            assert!(matches!(e, CommError::Unavailable(_)), "{e:?}");
        }
    }

    #[test]
    fn construction_when_unavailable_is_an_error() {
        if is_available() {
            // A machine with a GPU and NCCL: a one-rank world must work instead.
            let id = NcclUniqueId::new().expect("unique id");
            let comm = NcclComm::from_id(&id, 0, 1, 0).expect("one-rank world");
            assert_eq!((comm.rank(), comm.size()), (0, 1));
            return;
        }
        assert!(matches!(
            NcclUniqueId::new(),
            Err(CommError::Unavailable(_))
        ));
        let id = NcclUniqueId::from_bytes(&[0u8; NCCL_UNIQUE_ID_BYTES]).unwrap();
        assert!(matches!(
            NcclComm::from_id(&id, 0, 1, 0),
            Err(CommError::Unavailable(_))
        ));
        let out = NcclComm::run_threads(&[0], |c| c.rank()).map(|_| ());
        assert!(matches!(out, Err(CommError::Unavailable(_))));
        assert!(matches!(device_count(), Err(CommError::Unavailable(_))));
    }

    #[test]
    fn unique_id_bytes_round_trip_and_length_check() {
        let mut bytes = [0u8; NCCL_UNIQUE_ID_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes(), &bytes);
        assert!(matches!(
            NcclUniqueId::from_bytes(&bytes[..5]),
            Err(CommError::InvalidArgument(_))
        ));
    }

    #[test]
    fn bf16_bits_reinterpret() {
        let v = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        let bits = bf16_as_bits(&v);
        assert_eq!(bits[0], Bf16Bits(bf16::from_f32(1.5).to_bits()));
        assert_eq!(bits_as_bf16(bits), &v);
        assert_eq!(bf16::from(Bf16Bits::from(v[1])), v[1]);
    }

    #[test]
    fn host_casts_check_types() {
        let x = [1f32, 2.0];
        assert!(host_as_dev::<f32, f32>(&x).is_ok());
        assert!(matches!(
            host_as_dev::<f32, u8>(&x),
            Err(CommError::InvalidArgument(_))
        ));
    }

    #[cfg(feature = "threads")]
    #[test]
    fn from_collective_over_threads_reports_unavailability_on_every_rank() {
        if is_available() {
            return;
        }
        let out = crate::threads::ThreadsWorld::run(
            3,
            crate::threads::ThreadsConfig::default(),
            |boot| NcclComm::from_collective(&boot, boot.rank()).map(|_| ()),
        )
        .unwrap();
        for r in out {
            assert!(matches!(r.unwrap(), Err(CommError::Unavailable(_))));
        }
    }
}
