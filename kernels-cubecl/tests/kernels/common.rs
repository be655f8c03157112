//! Shared test helpers: the wgpu client (failing loudly without an adapter), a seeded PRNG,
//! upload/download of `u32`/`f32` buffers.

use burn::tensor::{Tensor, TensorData};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

/// The runtime the tests run on.
pub type R = WgpuRuntime;

/// A client on the default wgpu adapter; panics with what to install when there is none.
pub fn client() -> ComputeClient<R> {
    std::panic::catch_unwind(|| {
        let c = R::client(&WgpuDevice::default());
        // force adapter and device creation now
        let h = c.create_from_slice(u32::as_bytes(&[1u32]));
        let _ = c.read_one(h).expect("read back");
        c
    })
    .unwrap_or_else(|_| {
        panic!(
            "sshsdp-kernels tests need a wgpu adapter and found none. On Debian/Ubuntu \
             install Mesa's software Vulkan driver (lavapipe): `apt-get install -y \
             --no-install-recommends mesa-vulkan-drivers libvulkan1`, and set \
             XDG_RUNTIME_DIR to a 0700 directory (e.g. `mkdir -m 0700 -p /tmp/xdg && export \
             XDG_RUNTIME_DIR=/tmp/xdg`)."
        )
    })
}

/// SplitMix64: small, seeded, deterministic.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly normal (sum of 4 uniforms, centred, unit variance).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * 3f32.sqrt()
    }

    /// Normal values times `2^e` with `e` uniform in `[-emax, emax]` (wide dynamic range).
    pub fn wide(&mut self, emax: i32) -> f32 {
        let e = (self.next_u64() % (2 * emax as u64 + 1)) as i32 - emax;
        self.normal() * 2f32.powi(e)
    }

    /// `n` values from `f`.
    pub fn vec(&mut self, n: usize, mut f: impl FnMut(&mut Self) -> f32) -> Vec<f32> {
        (0..n).map(|_| f(self)).collect()
    }
}

/// Uploads `f32` values.
pub fn upload_f32(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(f32::as_bytes(v))
}

/// Uploads `u32` words.
pub fn upload_u32(c: &ComputeClient<R>, v: &[u32]) -> Handle {
    c.create_from_slice(u32::as_bytes(v))
}

/// Reads `f32` values.
pub fn read_f32(c: &ComputeClient<R>, h: &Handle) -> Vec<f32> {
    f32::from_bytes(&c.read_one(h.clone()).expect("read")).to_vec()
}

/// Reads `u32` words.
pub fn read_u32(c: &ComputeClient<R>, h: &Handle) -> Vec<u32> {
    u32::from_bytes(&c.read_one(h.clone()).expect("read")).to_vec()
}

/// Little-endian bytes of words.
pub fn words_to_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Words of little-endian bytes (length a multiple of 4). Lab tests only.
#[cfg(feature = "experimental")]
pub fn bytes_to_words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Row-major `C = A · Bᵀ` in `f64` (`A` `[m, k]`, `B` `[n, k]`), the matmul reference.
/// Lab tests only.
#[cfg(feature = "experimental")]
pub fn matmul_nt(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for l in 0..k {
                s += a[i * k + l] as f64 * b[j * k + l] as f64;
            }
            c[i * n + j] = s;
        }
    }
    c
}

/// The NdArray backend of the CPU references (burn-optim, `sshsdp-optim`).
pub type B = burn::backend::NdArray<f32>;

/// A `[rows, cols]` tensor of `v` on [`B`].
pub fn tensor(v: &[f32], rows: usize, cols: usize) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(v.to_vec(), [rows, cols]),
        &Default::default(),
    )
}

/// The values of `t`.
pub fn values(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// Largest `|a - b|` over equal-length slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
