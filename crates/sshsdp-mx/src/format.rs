//! Element formats (E4M3, E5M2) and scale rules (RCEIL, FLOOR): the public enums and the
//! compile-time constants the kernels are monomorphised over.

/// FP8 element format of an MX tensor (OCP Microscaling v1.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ElemFormat {
    /// E4M3 ("fn" variant): bias 7, max normal 448, subnormals down to 2^-9, no infinity,
    /// NaN is `0x7F`/`0xFF`.
    #[default]
    E4M3,
    /// E5M2: bias 15, max normal 57344, subnormals down to 2^-16, IEEE-style ±inf and NaN.
    E5M2,
}

/// How the E8M0 block scale is derived from the block's largest magnitude `amax`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScaleRule {
    /// `scale = 2^ceil(log2(amax / max_elem))` (cuBLAS / Transformer Engine): no element
    /// ever saturates.
    #[default]
    Rceil,
    /// `scale = 2^(floor(log2(amax)) - emax_elem)` (OCP reference): the largest elements
    /// may saturate to ±max_elem.
    Floor,
}

impl ElemFormat {
    /// Largest finite magnitude of the format.
    pub const fn max_normal(self) -> f32 {
        match self {
            ElemFormat::E4M3 => E4m3::MAX,
            ElemFormat::E5M2 => E5m2::MAX,
        }
    }

    /// Smallest positive normal magnitude of the format.
    pub const fn min_normal(self) -> f32 {
        match self {
            ElemFormat::E4M3 => E4m3::MIN_NORMAL,
            ElemFormat::E5M2 => E5m2::MIN_NORMAL,
        }
    }

    /// Exponent of the largest power of two the format holds (`emax_elem`: 8 or 15).
    pub const fn emax(self) -> i32 {
        match self {
            ElemFormat::E4M3 => E4m3::EMAX as i32,
            ElemFormat::E5M2 => E5m2::EMAX as i32,
        }
    }

    /// The byte this crate writes for NaN elements (`0x7F` for E4M3, `0x7E` for E5M2).
    pub const fn nan_byte(self) -> u8 {
        match self {
            ElemFormat::E4M3 => E4m3::NAN,
            ElemFormat::E5M2 => E5m2::NAN,
        }
    }

    /// Encodes one (already scaled) value: round-to-nearest-even, saturating to ±max
    /// (infinities included), NaN to [`ElemFormat::nan_byte`]; the sign of zero is kept.
    pub fn encode(self, v: f32) -> u8 {
        if v.is_nan() {
            return self.nan_byte();
        }
        match self {
            ElemFormat::E4M3 => encode_elem::<E4m3>(v, 1.0),
            ElemFormat::E5M2 => encode_elem::<E5m2>(v, 1.0),
        }
    }

    /// Decodes one element byte exactly to `f32`.
    #[inline]
    pub fn decode(self, b: u8) -> f32 {
        self.lut()[b as usize]
    }

    /// The 256-entry byte-to-value table of the format.
    #[inline]
    pub(crate) fn lut(self) -> &'static [f32; 256] {
        match self {
            ElemFormat::E4M3 => &E4M3_LUT,
            ElemFormat::E5M2 => &E5M2_LUT,
        }
    }
}

/// Compile-time description of an element format (private: the kernels are generic over it).
pub(crate) trait Spec {
    /// Mantissa bits.
    const MBITS: u32;
    /// Exponent of the largest power of two (8 / 15).
    const EMAX: u32;
    /// Largest finite value.
    const MAX: f32;
    /// Smallest positive normal value.
    const MIN_NORMAL: f32;
    /// `2^(q + 23)` where `2^q` is the subnormal spacing: adding it rounds a subnormal
    /// magnitude to that spacing in hardware (round-to-nearest-even).
    const SUB_MAGIC: f32;
    /// `(127 - bias) << MBITS`: rebias subtrahend for the normal path.
    const EXP_OFFSET: u32;
    /// NaN byte written by this crate.
    const NAN: u8;
    /// Right shift from f32 mantissa to element mantissa.
    const SHIFT: u32 = 23 - Self::MBITS;
    /// Half an element ulp minus one, in f32 mantissa units.
    const HALF_M1: u32 = (1 << (Self::SHIFT - 1)) - 1;
}

/// E4M3 constants.
pub(crate) struct E4m3;
/// E5M2 constants.
pub(crate) struct E5m2;

impl Spec for E4m3 {
    const MBITS: u32 = 3;
    const EMAX: u32 = 8;
    const MAX: f32 = 448.0;
    const MIN_NORMAL: f32 = 0.015625; // 2^-6
    const SUB_MAGIC: f32 = 16384.0; // 2^(-9 + 23)
    const EXP_OFFSET: u32 = (127 - 7) << 3;
    const NAN: u8 = 0x7F;
}

impl Spec for E5m2 {
    const MBITS: u32 = 2;
    const EMAX: u32 = 15;
    const MAX: f32 = 57344.0;
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    const SUB_MAGIC: f32 = 128.0; // 2^(-16 + 23)
    const EXP_OFFSET: u32 = (127 - 15) << 2;
    const NAN: u8 = 0x7E;
}

/// Encodes `x * inv` (finite, or ±inf which saturates) to an element byte; branch-free so
/// that loops over a block vectorise. NaN is NOT handled here (NaN blocks are filled
/// separately).
#[inline(always)]
pub(crate) fn encode_elem<S: Spec>(x: f32, inv: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    // |x| * 2^-k is exact (power-of-two scale, no overflow for the scales we pick).
    let a = (f32::from_bits(bits & 0x7FFF_FFFF) * inv).min(S::MAX);
    let ab = a.to_bits();
    // Normal path: RNE on the bits, then rebias the exponent.
    let norm = (ab.wrapping_add(S::HALF_M1 + ((ab >> S::SHIFT) & 1)) >> S::SHIFT)
        .wrapping_sub(S::EXP_OFFSET);
    // Subnormal path: let the FPU round to the subnormal spacing.
    let sub = (a + S::SUB_MAGIC)
        .to_bits()
        .wrapping_sub(S::SUB_MAGIC.to_bits());
    let code = if a < S::MIN_NORMAL { sub } else { norm };
    code as u8 | sign
}

/// Builds the exact decode table of a format.
const fn build_lut(mbits: u32, bias: i32, has_inf: bool) -> [f32; 256] {
    let mut t = [0f32; 256];
    let sub_quantum = f32::from_bits(((127 + 1 - bias - mbits as i32) as u32) << 23);
    let all_exp = (1u32 << (7 - mbits)) - 1;
    let mut i = 0;
    while i < 256 {
        let mag = (i & 0x7F) as u32;
        let e = mag >> mbits;
        let m = mag & ((1 << mbits) - 1);
        let v = if has_inf && e == all_exp {
            if m == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else if !has_inf && mag == 0x7F {
            f32::NAN
        } else if e == 0 {
            m as f32 * sub_quantum
        } else {
            f32::from_bits((((e as i32 - bias + 127) as u32) << 23) | (m << (23 - mbits)))
        };
        t[i] = if i & 0x80 != 0 { -v } else { v };
        i += 1;
    }
    t
}

/// E4M3 byte-to-value table.
static E4M3_LUT: [f32; 256] = build_lut(3, 7, false);
/// E5M2 byte-to-value table.
static E5M2_LUT: [f32; 256] = build_lut(2, 15, true);
