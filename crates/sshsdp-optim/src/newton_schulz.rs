//! Quintic Newton–Schulz orthogonalisation: the matrix step of Muon.
//!
//! Given a matrix `G` with singular value decomposition `U S Vᵀ`, the iteration drives every
//! singular value towards (roughly) one, returning approximately `U Vᵀ` — the nearest
//! semi-orthogonal matrix — without an SVD:
//!
//! ```text
//! X ← G / (‖G‖_F + 1e-7)            (all singular values now ≤ 1)
//! if rows > cols: X ← Xᵀ            (iterate on the wide orientation: X Xᵀ is the small Gram)
//! repeat `steps` times:
//!     A  = X Xᵀ
//!     Bm = b·A + c·A·A
//!     X  = a·X + Bm·X
//! if transposed: X ← Xᵀ
//! ```
//!
//! with `(a, b, c) = (3.4445, −4.7750, 2.0315)` ([`NS_COEFFICIENTS`]). These coefficients
//! maximise the slope at zero (small singular values grow by up to `a` per step) at the
//! price of not converging exactly: after 5 steps the singular values land roughly in
//! `[0.7, 1.2]`, which is what Muon wants (an update of unit spectral scale, not an exact
//! polar factor).

use burn::tensor::{backend::Backend, DType, FloatDType, Tensor, TensorData};
use half::bf16;

/// Quintic Newton–Schulz coefficients `(a, b, c)` (Keller Jordan's Muon).
pub const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// The `eps` of the normalisation `X = G / (‖G‖_F + eps)` (keeps an all-zero `G` at zero).
pub const NS_EPS: f64 = 1e-7;

/// Number format of the Newton–Schulz iterations.
///
/// The normalisation `G / (‖G‖_F + eps)` is always done in the input's own float type; the
/// choice applies to `X` and the products of the `steps` iterations. The result is returned
/// in the input's float type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NsPrecision {
    /// Iterate in the input's float type (f32 for master weights).
    #[default]
    F32,
    /// Iterate in bfloat16, as Muon is usually run on GPUs (the iteration is stable in bf16).
    ///
    /// Where the backend supports bf16 arithmetic (`B::supports_dtype(device, BF16)`, e.g.
    /// CUDA) `X` is cast with `Tensor::cast(FloatDType::BF16)` and every op runs natively.
    /// Where it does not (e.g. `NdArray`, which has no bf16 tensors) bf16 is **emulated**: the
    /// ops run in the input's float type and `X`, `A`, `A·A`, `Bm`, `Bm·X` and the new `X` are
    /// each rounded to the nearest bf16 value (round-to-nearest-even via `half::bf16`, a host
    /// round trip through `TensorData`). That models bf16 storage of every intermediate with
    /// wide accumulation inside each matmul, which is how bf16 GEMMs behave on tensor cores;
    /// it is a reference for tests, not a fast path.
    Bf16,
}

/// Orthogonalises `g` with `steps` quintic Newton–Schulz iterations (see the module docs).
///
/// Shape-preserving: the result has `g`'s shape and float type. Tall matrices
/// (`rows > cols`) are iterated on their transpose, so `newton_schulz(gᵀ) = newton_schulz(g)ᵀ`.
/// An all-zero `g` maps to all zeros.
pub fn newton_schulz<B: Backend>(
    g: Tensor<B, 2>,
    steps: usize,
    precision: NsPrecision,
) -> Tensor<B, 2> {
    let [rows, cols] = g.dims();
    let transposed = rows > cols;
    let g = if transposed { g.transpose() } else { g };
    let out_dtype: FloatDType = g.dtype().into();

    let norm = g.clone().powi_scalar(2).sum().sqrt().add_scalar(NS_EPS);
    let x = g.div(norm.unsqueeze::<2>());

    let x = iterate_in(x, steps, precision, out_dtype);

    if transposed {
        x.transpose()
    } else {
        x
    }
}

/// [`newton_schulz`] of a batch of same-shape matrices `g` `[batch, rows, cols]` at once: each
/// matrix normalised by its own Frobenius norm, then every product of the iteration one batched
/// matmul (fewer, larger kernels — Muon's "megabatches" of same-shape matrices on one owner).
/// Equal to orthogonalising each matrix alone up to the matmuls' summation order.
pub fn newton_schulz_batched<B: Backend>(
    g: Tensor<B, 3>,
    steps: usize,
    precision: NsPrecision,
) -> Tensor<B, 3> {
    let [_, rows, cols] = g.dims();
    let transposed = rows > cols;
    let g = if transposed { g.swap_dims(1, 2) } else { g };
    let out_dtype: FloatDType = g.dtype().into();

    let norm = g
        .clone()
        .powi_scalar(2)
        .sum_dim(2)
        .sum_dim(1)
        .sqrt()
        .add_scalar(NS_EPS);
    let x = g.div(norm);

    let x = iterate_in(x, steps, precision, out_dtype);

    if transposed {
        x.swap_dims(1, 2)
    } else {
        x
    }
}

/// The `steps` iterations in `precision`, returning `out_dtype` (see [`NsPrecision`]).
fn iterate_in<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    steps: usize,
    precision: NsPrecision,
    out_dtype: FloatDType,
) -> Tensor<B, D> {
    match precision {
        NsPrecision::F32 => iterate(x, steps, &|t| t),
        NsPrecision::Bf16 => {
            let device = x.device();
            if B::supports_dtype(&device, DType::BF16) {
                iterate(x.cast(FloatDType::BF16), steps, &|t| t).cast(out_dtype)
            } else {
                iterate(round_bf16(x), steps, &round_bf16)
            }
        }
    }
}

/// The `steps` iterations on a wide (or square) `x` (or a batch of them: `transpose` and
/// `matmul` act on the last two dimensions); `round` is applied to every intermediate (the
/// identity, or bf16 emulation).
fn iterate<B: Backend, const D: usize>(
    mut x: Tensor<B, D>,
    steps: usize,
    round: &dyn Fn(Tensor<B, D>) -> Tensor<B, D>,
) -> Tensor<B, D> {
    let (a, b, c) = NS_COEFFICIENTS;
    for _ in 0..steps {
        let gram = round(x.clone().matmul(x.clone().transpose()));
        let gram2 = round(gram.clone().matmul(gram.clone()));
        let bm = round(gram.mul_scalar(b).add(gram2.mul_scalar(c)));
        let bmx = round(bm.matmul(x.clone()));
        x = round(x.mul_scalar(a).add(bmx));
    }
    x
}

/// Rounds every element to the nearest bf16 value (ties to even), keeping the tensor's float
/// type and device. Host round trip: for emulation on backends without bf16 only.
fn round_bf16<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let device = t.device();
    let dtype = t.dtype();
    let shape = t.shape();
    let values: Vec<f32> = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("converted TensorData holds f32");
    let rounded: Vec<f32> = values
        .into_iter()
        .map(|v| bf16::from_f32(v).to_f32())
        .collect();
    Tensor::from_data(TensorData::new(rounded, shape), (&device, dtype))
}

/// Floating-point operations of [`newton_schulz`] on a `rows x cols` matrix, counting
/// `2·m·n·k` per `m x k` by `k x n` matmul and ignoring element-wise work.
///
/// With `m = min(rows, cols)` and `n = max(rows, cols)` each step costs `X Xᵀ = 2·m·m·n`,
/// `A·A = 2·m·m·m` and `Bm·X = 2·m·m·n`, i.e. `steps · (4·m²·n + 2·m³)`: `steps` times the
/// planner's [`sshsdp_plan::newton_schulz_cost`], which balances Muon's matrix owners.
pub fn ns_flops(rows: usize, cols: usize, steps: usize) -> u64 {
    let per_step = sshsdp_plan::newton_schulz_cost(rows as u64, cols as u64);
    (steps as u128 * per_step) as u64
}
