//! Shared helpers for the integration tests: a tiny seeded generator (no extra deps).

#![allow(dead_code)]

use sshsdp_mx::ElemFormat;

/// xorshift64* generator.
pub struct Rng(u64);

impl Rng {
    /// A generator from a non-zero seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn gauss(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// A finite, non-NaN element value of `fmt` (decoded from a random byte).
    pub fn representable(&mut self, fmt: ElemFormat) -> f32 {
        loop {
            let v = fmt.decode(self.next_u64() as u8);
            if v.is_finite() {
                return v;
            }
        }
    }
}

/// `n` Gaussian values times `scale`.
pub fn gauss_vec(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.gauss() * scale) as f32).collect()
}

/// Bitwise equality that treats all NaNs as equal.
pub fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits())
}

/// Shapes exercised by the layout tests (many not divisible by 32).
pub const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (33, 7),
    (64, 65),
    (32, 32),
    (7, 100),
    (95, 33),
    (0, 5),
    (3, 0),
];
