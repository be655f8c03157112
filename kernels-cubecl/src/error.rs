//! Errors of the host API: buffer sizes and index ranges are checked before every launch.

/// Why a kernel was not launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A buffer is smaller than the kernel needs.
    #[error("buffer `{what}` holds {got} bytes, the kernel needs {needed}")]
    BufferTooSmall {
        /// Which argument.
        what: &'static str,
        /// Bytes needed (offset included).
        needed: u64,
        /// Bytes the handle holds.
        got: u64,
    },
    /// An index or size does not fit the kernels' 32-bit indexing.
    #[error("{what} = {value} does not fit the kernels' 32-bit indexing")]
    TooLarge {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A shape argument is invalid (e.g. mismatched inner dimensions).
    #[error("invalid shape: {0}")]
    Shape(String),
}

/// Checks that `handle` holds at least `needed` bytes.
pub(crate) fn check_size(
    what: &'static str,
    handle: &cubecl::server::Handle,
    needed: u64,
) -> Result<(), KernelError> {
    let got = handle.size_in_used();
    if got < needed {
        Err(KernelError::BufferTooSmall { what, needed, got })
    } else {
        Ok(())
    }
}

/// Converts `value` to `u32` for kernel indexing, or errors.
pub(crate) fn to_u32(what: &'static str, value: u64) -> Result<u32, KernelError> {
    u32::try_from(value).map_err(|_| KernelError::TooLarge { what, value })
}

/// The product of `factors` (sizes a launch computes), or [`KernelError::TooLarge`] when it
/// overflows 64 bits: never a wrapped size that a buffer check would wrongly accept.
pub(crate) fn product(what: &'static str, factors: &[usize]) -> Result<u64, KernelError> {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f as u64))
        .ok_or(KernelError::TooLarge {
            what,
            value: u64::MAX,
        })
}

/// The shape `[rows, cols]` once it is checked to fit in memory, or `None` when it is empty (the
/// kernels then have nothing to do).
pub(crate) fn checked_shape(
    rows: usize,
    cols: usize,
) -> Result<Option<sshsdp_mx::MxShape>, KernelError> {
    let shape = sshsdp_mx::MxShape::new(rows, cols);
    shape
        .validate()
        .map_err(|e| KernelError::Shape(e.to_string()))?;
    Ok((!shape.is_empty()).then_some(shape))
}
