//! Input element types accepted by the encoders.

use half::bf16;

/// A value type the encoders read: converted to `f32` exactly before quantisation.
pub trait MxInput: Copy + Send + Sync {
    /// Exact conversion to `f32`.
    fn to_f32(self) -> f32;
}

impl MxInput for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl MxInput for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the upper half of an f32: a shift is exact (NaN payloads included).
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}
