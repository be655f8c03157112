//! Runtime CPU dispatch: the portable kernels are written as auto-vectorisable loops and
//! `#[inline(always)]`, so instantiating them inside a function compiled with AVX2 doubles
//! the vector width without any intrinsics.

/// Evaluates `$e` inside a function compiled with AVX2 when the CPU supports it, else as is.
macro_rules! dispatch {
    ($e:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if ::std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: `with_avx2` only requires the CPU to support AVX2, checked above.
                unsafe { $crate::simd::with_avx2(|| $e) }
            } else {
                $e
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $e
        }
    }};
}
pub(crate) use dispatch;

/// Calls `f` from a function compiled with AVX2 enabled: `f` (called once) is inlined here
/// and vectorised for 256-bit registers.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
