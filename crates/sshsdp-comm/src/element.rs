//! Element types collectives move: `f32`, `bf16` and `u8` (MXFP8 planes and scales).

use std::fmt::Debug;

use half::bf16;

/// Tag of an element type, for matching arguments across ranks and for engines' datatypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementKind {
    /// `f32`.
    F32,
    /// `half::bf16`.
    Bf16,
    /// `u8` (raw bytes: MXFP8 elements and E8M0 scales).
    U8,
}

impl ElementKind {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            ElementKind::F32 => 4,
            ElementKind::Bf16 => 2,
            ElementKind::U8 => 1,
        }
    }
}

/// A type collectives can move.
pub trait Element: Copy + Default + PartialEq + Debug + Send + Sync + 'static {
    /// The tag of this type.
    const KIND: ElementKind;
}

/// A type collectives can reduce. Reductions accumulate in `f32` in rank order and round once,
/// so every rank gets bitwise the same result.
pub trait Reducible: Element {
    /// Widen to the accumulator.
    fn to_acc(self) -> f32;
    /// Round the accumulator back.
    fn from_acc(acc: f32) -> Self;
}

impl Element for f32 {
    const KIND: ElementKind = ElementKind::F32;
}

impl Element for bf16 {
    const KIND: ElementKind = ElementKind::Bf16;
}

impl Element for u8 {
    const KIND: ElementKind = ElementKind::U8;
}

impl Reducible for f32 {
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_acc(acc: f32) -> Self {
        acc
    }
}

impl Reducible for bf16 {
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(acc: f32) -> Self {
        bf16::from_f32(acc)
    }
}

/// Reduction of a reduce-scatter or all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks (sum, then one multiplication by `1 / size`).
    Avg,
}

impl ReduceOp {
    /// The factor applied to the sum for a group of `size` ranks.
    pub fn scale(self, size: usize) -> f32 {
        match self {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / size as f32,
        }
    }
}
