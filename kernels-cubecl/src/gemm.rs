//! `f32` GEMM over strided operands: `C = alpha · op(A) · op(B) + beta · D`, `C` and `D`
//! row-major `[m, n]`. Any transposition is a choice of strides, which is how the
//! Newton–Schulz step forms `X·Xᵀ`, `A·A` and `B·X` from one kernel.
//!
//! Shared with the MXFP8 matmul ([`crate::matmul`]): the 64 x 64 output block per cube of
//! 16 x 16 units (4 x 4 outputs each, strided by 16) and the `K = 32` step through shared
//! memory (`[k][i]` with row stride 65, conflict-free for loads and reads).

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::e4m3::round_bf16;
use crate::error::{check_size, product, to_u32, KernelError};

/// Output rows per cube.
pub(crate) const BM: u32 = 64;
/// Output columns per cube.
pub(crate) const BN: u32 = 64;
/// Reduction step (one MX tile).
pub(crate) const BK: u32 = 32;
/// Row stride of the shared operand tiles `[BK][64 + 1]`.
pub(crate) const SMEM_LD: u32 = 65;
/// Units per cube side.
pub(crate) const UNITS: u32 = 16;

/// Accumulates one `BK` step: `acc[i·4 + j] += Σ_k a_s[k][ty + 16i] · b_s[k][tx + 16j]`.
#[cube]
pub(crate) fn block_fma(
    a_s: &SharedMemory<f32>,
    b_s: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    tx: u32,
    ty: u32,
) {
    let mut af = Array::<f32>::new(4usize);
    let mut bf = Array::<f32>::new(4usize);
    for kk in 0..BK {
        let row = kk * SMEM_LD;
        #[unroll]
        for i in 0..4u32 {
            af[i as usize] = a_s[(row + ty + 16 * i) as usize];
            bf[i as usize] = b_s[(row + tx + 16 * i) as usize];
        }
        #[unroll]
        for i in 0..4u32 {
            #[unroll]
            for j in 0..4u32 {
                acc[(i * 4 + j) as usize] += af[i as usize] * bf[j as usize];
            }
        }
    }
}

/// Loads the `64 x BK` block of a strided operand (`x(r, k) = src[r·rs + k·cs]`, rows from
/// `r0`, reduction index from `k0`) into `dst[k][r]`, zero outside `rows x k_len`.
/// `k_contig` picks the unit mapping that keeps global reads coalesced.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_strided(
    src: &Array<f32>,
    dst: &mut SharedMemory<f32>,
    r0: u32,
    k0: u32,
    rows: u32,
    k_len: u32,
    rs: u32,
    cs: u32,
    #[comptime] k_contig: bool,
) {
    let u = UNIT_POS;
    for l in 0..8u32 {
        let e = u + 256 * l;
        let mut rr = e % 64;
        let mut kk = e / 64;
        if k_contig {
            rr = e / 32;
            kk = e % 32;
        }
        let gr = r0 + rr;
        let gk = k0 + kk;
        let mut v = 0.0f32;
        if gr < rows && gk < k_len {
            v = src[(gr * rs + gk * cs) as usize];
        }
        dst[(kk * SMEM_LD + rr) as usize] = v;
    }
}

/// Writes the 4 x 4 accumulators: `c = alpha · acc (+ beta · d)`, inside `m x n` only,
/// rounded to `bf16` values when `round`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_block(
    acc: &Array<f32>,
    c: &mut Array<f32>,
    d: &Array<f32>,
    m: u32,
    n: u32,
    alpha: f32,
    beta: f32,
    #[comptime] has_d: bool,
    #[comptime] round: bool,
) {
    let i0 = CUBE_POS_Y * BM + UNIT_POS_Y;
    let j0 = CUBE_POS_X * BN + UNIT_POS_X;
    #[unroll]
    for i in 0..4u32 {
        #[unroll]
        for j in 0..4u32 {
            let gi = i0 + 16 * i;
            let gj = j0 + 16 * j;
            if gi < m && gj < n {
                let idx = (gi * n + gj) as usize;
                let mut v = alpha * acc[(i * 4 + j) as usize];
                if has_d {
                    v += beta * d[idx];
                }
                if round {
                    v = round_bf16(v);
                }
                c[idx] = v;
            }
        }
    }
}

/// Writes the 4 x 4 accumulators unscaled into `c`, inside `m x n` only.
#[cube]
pub(crate) fn store_plain(acc: &Array<f32>, c: &mut Array<f32>, m: u32, n: u32) {
    let i0 = CUBE_POS_Y * BM + UNIT_POS_Y;
    let j0 = CUBE_POS_X * BN + UNIT_POS_X;
    #[unroll]
    for i in 0..4u32 {
        #[unroll]
        for j in 0..4u32 {
            let gi = i0 + 16 * i;
            let gj = j0 + 16 * j;
            if gi < m && gj < n {
                c[(gi * n + gj) as usize] = acc[(i * 4 + j) as usize];
            }
        }
    }
}

/// The strided `f32` GEMM kernel (see the module docs).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemm_kernel(
    a: &Array<f32>,
    b: &Array<f32>,
    d: &Array<f32>,
    c: &mut Array<f32>,
    m: u32,
    n: u32,
    k: u32,
    a_rs: u32,
    a_cs: u32,
    b_ks: u32,
    b_ns: u32,
    alpha: f32,
    beta: f32,
    #[comptime] a_k_contig: bool,
    #[comptime] b_k_contig: bool,
    #[comptime] has_d: bool,
    #[comptime] round: bool,
) {
    let mut a_s = SharedMemory::<f32>::new(32 * 65usize);
    let mut b_s = SharedMemory::<f32>::new(32 * 65usize);
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16u32 {
        acc[i as usize] = 0.0;
    }
    let i0 = CUBE_POS_Y * BM;
    let j0 = CUBE_POS_X * BN;
    let mut k0 = 0u32;
    while k0 < k {
        load_strided(a, &mut a_s, i0, k0, m, k, a_rs, a_cs, a_k_contig);
        load_strided(b, &mut b_s, j0, k0, n, k, b_ns, b_ks, b_k_contig);
        sync_cube();
        block_fma(&a_s, &b_s, &mut acc, UNIT_POS_X, UNIT_POS_Y);
        sync_cube();
        k0 += BK;
    }
    store_block(&acc, c, d, m, n, alpha, beta, has_d, round);
}

/// A strided view of an `f32` matrix operand: element `(r, k)` at `r * row_stride + k *
/// col_stride` (in elements) of the handle.
#[derive(Debug, Clone)]
pub struct MatRef<'a> {
    /// The buffer.
    pub handle: &'a Handle,
    /// Element stride between rows.
    pub row_stride: usize,
    /// Element stride between columns.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `[rows, cols]` matrix.
    pub fn row_major(handle: &'a Handle, cols: usize) -> Self {
        Self {
            handle,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns (`(r, k)` reads `[k, r]`).
    pub fn transposed(handle: &'a Handle, cols: usize) -> Self {
        Self {
            handle,
            row_stride: 1,
            col_stride: cols,
        }
    }

    /// Bytes spanned by a `rows x cols` view (an error when that overflows).
    fn span_bytes(&self, what: &'static str, rows: usize, cols: usize) -> Result<u64, KernelError> {
        if rows == 0 || cols == 0 {
            return Ok(0);
        }
        let last_row = product(what, &[rows - 1, self.row_stride])?;
        let last_col = product(what, &[cols - 1, self.col_stride])?;
        last_row
            .checked_add(last_col)
            .and_then(|v| v.checked_add(1))
            .and_then(|v| v.checked_mul(4))
            .ok_or(KernelError::TooLarge {
                what,
                value: u64::MAX,
            })
    }
}

/// `C = alpha · A · B + beta · D` in `f32`: `A` is `m x k` and `B` is `k x n` (both strided
/// views, [`MatRef`]; for `B` the view's "rows" are the `k` index), `C` and `D` row-major
/// `[m, n]`. `d = None` means `beta = 0` (`D` is not read). `C` must not alias an input.
#[allow(clippy::too_many_arguments)]
pub fn gemm<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    d: Option<&Handle>,
    c: &Handle,
) -> Result<(), KernelError> {
    gemm_impl(client, (m, n, k), alpha, a, b, beta, d, c, false)
}

/// [`gemm`] with the output optionally rounded to `bf16` values (`round`), for iterations
/// that keep their intermediates in `bf16`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_impl<R: Runtime>(
    client: &ComputeClient<R>,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    d: Option<&Handle>,
    c: &Handle,
    round: bool,
) -> Result<(), KernelError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let a_span = a.span_bytes("a span", m, k)?;
    let b_span = b.span_bytes("b span", k, n)?;
    let mn = product("m * n", &[m, n])?;
    check_size("a", a.handle, a_span)?;
    check_size("b", b.handle, b_span)?;
    check_size("c", c, mn * 4)?;
    if let Some(d) = d {
        check_size("d", d, mn * 4)?;
    }
    to_u32("a span", a_span / 4)?;
    to_u32("b span", b_span / 4)?;
    to_u32("m * n", mn)?;
    let [k32, a_rows, a_cols, b_rows, b_cols] = [
        ("k", k),
        ("a row stride", a.row_stride),
        ("a column stride", a.col_stride),
        ("b row stride", b.row_stride),
        ("b column stride", b.col_stride),
    ]
    .map(|(what, v)| to_u32(what, v as u64));
    let (k32, a_rows, a_cols, b_rows, b_cols) = (k32?, a_rows?, a_cols?, b_rows?, b_cols?);
    let len = |h: &Handle| h.size_in_used() as usize / 4;
    let d_handle = d.unwrap_or(a.handle);
    let count = CubeCount::Static((n as u32).div_ceil(BN), (m as u32).div_ceil(BM), 1);
    // SAFETY: every index is below the view spans and `m * n`, checked above.
    unsafe {
        gemm_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_2d(UNITS, UNITS),
            ArrayArg::from_raw_parts(a.handle.clone(), len(a.handle)),
            ArrayArg::from_raw_parts(b.handle.clone(), len(b.handle)),
            ArrayArg::from_raw_parts(d_handle.clone(), len(d_handle)),
            ArrayArg::from_raw_parts(c.clone(), len(c)),
            m as u32,
            n as u32,
            k32,
            a_rows,
            a_cols,
            b_rows,
            b_cols,
            alpha,
            beta,
            a.col_stride == 1,
            b.row_stride == 1,
            d.is_some(),
            round,
        );
    }
    Ok(())
}
