//! Small helpers over the raw MPI interface: datatypes, operations, counts and error codes.

use std::any::TypeId;
use std::ffi::{c_char, c_int, c_void};

use half::bf16;
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;

use crate::{CommError, CommResult, Element};

/// `MPI_IN_PLACE` of the MPI library named by `MPI_Get_library_version`, if known.
pub(super) fn in_place_sentinel(library_version: &str) -> Option<*mut c_void> {
    if library_version.contains("Open MPI") {
        // Open MPI's mpi.h: `#define MPI_IN_PLACE ((void *) 1)`.
        Some(std::ptr::without_provenance_mut(1))
    } else if library_version.contains("MPICH") {
        // MPICH's mpi.h (and MVAPICH's, Intel MPI's): `#define MPI_IN_PLACE (void *) -1`.
        Some(std::ptr::without_provenance_mut(usize::MAX))
    } else {
        None
    }
}

/// The MPI datatype `T` moves as: `f32` → `MPI_FLOAT`, `bf16` → `MPI_UINT16_T` (its bit
/// pattern), `u8` → `MPI_UINT8_T`. Decided by `TypeId`, not by the safe [`Element::KIND`], so
/// a foreign type claiming a kind can never make MPI write bytes of the wrong size or validity.
pub(super) fn datatype<T: Element>(op: &str) -> CommResult<ffi::MPI_Datatype> {
    let id = TypeId::of::<T>();
    if id == TypeId::of::<f32>() {
        Ok(f32_datatype())
    } else if id == TypeId::of::<bf16>() {
        Ok(u16::equivalent_datatype().as_raw())
    } else if id == TypeId::of::<u8>() {
        Ok(u8::equivalent_datatype().as_raw())
    } else {
        Err(CommError::InvalidArgument(format!(
            "{op}: element type {} has no MPI datatype",
            std::any::type_name::<T>()
        )))
    }
}

pub(super) fn f32_datatype() -> ffi::MPI_Datatype {
    f32::equivalent_datatype().as_raw()
}

pub(super) fn i32_datatype() -> ffi::MPI_Datatype {
    i32::equivalent_datatype().as_raw()
}

pub(super) fn sum_op() -> ffi::MPI_Op {
    SystemOperation::sum().as_raw()
}

/// `buf` as `f32`s if `T` is `f32`.
pub(super) fn as_f32<T: 'static>(buf: &[T]) -> Option<&[f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: T is f32 (same TypeId), so this is the same slice at the same type.
        unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<f32>(), buf.len()) }
    })
}

/// `buf` as `f32`s if `T` is `f32`.
pub(super) fn as_f32_mut<T: 'static>(buf: &mut [T]) -> Option<&mut [f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: T is f32 (same TypeId), so this is the same slice at the same type, and the
        // exclusive borrow moves into the result.
        unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<f32>(), buf.len()) }
    })
}

/// An element count as MPI's `int`.
pub(super) fn mpi_count(op: &str, len: usize) -> CommResult<c_int> {
    c_int::try_from(len).map_err(|_| {
        CommError::InvalidArgument(format!(
            "{op}: {len} elements exceed MPI's int count; split the buffer"
        ))
    })
}

pub(super) fn engine(msg: &str) -> CommError {
    CommError::Engine(msg.into())
}

/// Turns an MPI return code into a result (the communicators use `MPI_ERRORS_RETURN`).
pub(super) fn check(call: &str, code: c_int) -> CommResult<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = [0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` holds MPI_MAX_ERROR_STRING characters as MPI_Error_string requires.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) };
    let msg = if ok == ffi::MPI_SUCCESS as c_int {
        let len = usize::try_from(len).unwrap_or(0).min(text.len());
        let bytes: Vec<u8> = text[..len].iter().map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        format!("error code {code}")
    };
    Err(CommError::Engine(format!("{call}: {msg}")))
}
