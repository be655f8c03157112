//! Newton–Schulz orthogonalisation for Muon on the device: the quintic step `A = X·Xᵀ`,
//! `Bm = b·A + c·A·A`, `X ← a·X + Bm·X` as three strided GEMMs ([`crate::gemm`]), and the
//! whole `newton_schulz` of `sshsdp-optim` (normalisation by `‖G‖_F + 1e-7`, iteration on the
//! wide orientation, transpose back).
//!
//! [`NsPrecision::Bf16`] keeps every intermediate as a `bf16` value (`X`, `A`, `A·A`, `Bm`,
//! `Bm·X`, the new `X`, each rounded to nearest even, stored in `f32`) with `f32` accumulation
//! inside the GEMMs: the semantics of `sshsdp_optim`'s bf16 emulation, on any device (no
//! native bf16 arithmetic needed).

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::e4m3::round_bf16;
use crate::error::{check_size, product, to_u32, KernelError};
use crate::gemm::{gemm_impl, MatRef};

/// Quintic Newton–Schulz coefficients `(a, b, c)` (the same as `sshsdp_optim`).
pub const NS_COEFFICIENTS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);
/// The `eps` of the normalisation `X = G / (‖G‖_F + eps)`.
pub const NS_EPS: f32 = 1e-7;

/// Cubes of the sum-of-squares pass (each writes one partial sum).
const REDUCE_CUBES: u32 = 256;
/// Units per cube of the element-wise kernels.
const UNITS_1D: u32 = 256;

/// Partial sums of squares: cube `p` sums elements `p·256 + u (+ 65536·i)` into
/// `partial[p]` with a shared-memory tree.
#[cube(launch_unchecked)]
fn sum_squares_kernel(x: &Array<f32>, partial: &mut Array<f32>, len: u32) {
    let mut tree = SharedMemory::<f32>::new(256usize);
    let u = UNIT_POS;
    let mut i = CUBE_POS as u32 * 256 + u;
    let stride = CUBE_COUNT as u32 * 256;
    let mut s = 0.0f32;
    while i < len {
        let v = x[i as usize];
        s += v * v;
        i += stride;
    }
    tree[u as usize] = s;
    sync_cube();
    let mut half = 128u32;
    while half > 0 {
        if u < half {
            tree[u as usize] = tree[u as usize] + tree[(u + half) as usize];
        }
        sync_cube();
        half /= 2;
    }
    if u == 0 {
        partial[CUBE_POS] = tree[0];
    }
}

/// `norm[0] = sqrt(Σ partial) + eps` (one cube).
#[cube(launch_unchecked)]
fn finish_norm_kernel(partial: &Array<f32>, norm: &mut Array<f32>, eps: f32) {
    let mut tree = SharedMemory::<f32>::new(256usize);
    let u = UNIT_POS;
    tree[u as usize] = partial[u as usize];
    sync_cube();
    let mut half = 128u32;
    while half > 0 {
        if u < half {
            tree[u as usize] = tree[u as usize] + tree[(u + half) as usize];
        }
        sync_cube();
        half /= 2;
    }
    if u == 0 {
        norm[0] = f32::sqrt(tree[0]) + eps;
    }
}

/// `dst = src / norm[0]` (when `divide`), rounded to bf16 values (when `round`), transposed
/// (`dst[j·rows + i] = src[i·cols + j]`) when `transpose`.
#[cube(launch_unchecked)]
fn scale_transpose_kernel(
    src: &Array<f32>,
    norm: &Array<f32>,
    dst: &mut Array<f32>,
    rows: u32,
    cols: u32,
    #[comptime] transpose: bool,
    #[comptime] divide: bool,
    #[comptime] round: bool,
) {
    let len = rows * cols;
    let mut idx = CUBE_POS as u32 * 256 + UNIT_POS;
    let stride = CUBE_COUNT as u32 * 256;
    while idx < len {
        let mut v = src[idx as usize];
        if divide {
            v /= norm[0];
        }
        if round {
            v = round_bf16(v);
        }
        let mut o = idx;
        if transpose {
            o = (idx % cols) * rows + idx / cols;
        }
        dst[o as usize] = v;
        idx += stride;
    }
}

/// `out = p·u + q·w`, rounded to `bf16` values (the combinations of the bf16 iteration).
#[cube(launch_unchecked)]
fn axpby_bf16_kernel(
    u: &Array<f32>,
    w: &Array<f32>,
    out: &mut Array<f32>,
    p: f32,
    q: f32,
    len: u32,
) {
    let mut idx = CUBE_POS as u32 * 256 + UNIT_POS;
    let stride = CUBE_COUNT as u32 * 256;
    while idx < len {
        let i = idx as usize;
        out[i] = round_bf16(u[i] * p + w[i] * q);
        idx += stride;
    }
}

/// Number format of the iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum NsPrecision {
    /// Everything in `f32`.
    #[default]
    F32,
    /// Intermediates rounded to `bf16` values, `f32` accumulation (see the module docs).
    Bf16,
}

/// Cubes for an element-wise pass over `len` values (grid-stride beyond 65535 cubes).
fn grid_1d(len: usize) -> CubeCount {
    let cubes = (len as u64).div_ceil(UNITS_1D as u64).clamp(1, 65_535) as u32;
    CubeCount::Static(cubes, 1, 1)
}

/// Scratch buffers of [`ns_step`] for an `m x n` iterate.
#[derive(Debug, Clone)]
pub struct NsWorkspace {
    /// `A = X·Xᵀ`, `m x m`.
    pub gram: Handle,
    /// `Bm = b·A + c·A·A`, `m x m`.
    pub bm: Handle,
    /// `A·A` (`m x m`) and `Bm·X` (`m x n`): the bf16 iteration's separately rounded terms.
    pub bf16_terms: Option<(Handle, Handle)>,
}

impl NsWorkspace {
    /// Allocates the scratch for an `m x n` iterate in `precision` (an error when the sizes
    /// do not fit the kernels' 32-bit indexing).
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        m: usize,
        n: usize,
        precision: NsPrecision,
    ) -> Result<Self, KernelError> {
        let mm = to_u32("m * m", product("m * m", &[m, m])?)? as usize * 4;
        let mn = to_u32("m * n", product("m * n", &[m, n])?)? as usize * 4;
        Ok(Self {
            gram: client.empty(mm.max(4)),
            bm: client.empty(mm.max(4)),
            bf16_terms: (precision == NsPrecision::Bf16)
                .then(|| (client.empty(mm.max(4)), client.empty(mn.max(4)))),
        })
    }
}

/// One quintic Newton–Schulz step on the row-major `m x n` iterate `x` (`m <= n` is the
/// cheap orientation, any shape works): `out = a·X + (b·A + c·A·A)·X` with `A = X·Xᵀ`,
/// `(a, b, c)` = `coeffs`. `out` must not alias `x` or the workspace. With
/// [`NsPrecision::Bf16`] the workspace must have been made for it and `x` should hold `bf16`
/// values.
#[allow(clippy::too_many_arguments)]
pub fn ns_step<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Handle,
    m: usize,
    n: usize,
    coeffs: (f32, f32, f32),
    precision: NsPrecision,
    ws: &NsWorkspace,
    out: &Handle,
) -> Result<(), KernelError> {
    let (a, b, c) = coeffs;
    let mm_bytes = product("m * m", &[m, m, 4])?;
    let mn_bytes = product("m * n", &[m, n, 4])?;
    check_size("gram", &ws.gram, mm_bytes)?;
    check_size("bm", &ws.bm, mm_bytes)?;
    let xr = MatRef::row_major(x, n);
    let gram = MatRef::row_major(&ws.gram, m);
    let bm = MatRef::row_major(&ws.bm, m);
    match precision {
        NsPrecision::F32 => {
            // A = X·Xᵀ; Bm = c·A·A + b·A; X' = Bm·X + a·X
            let xt = MatRef::transposed(x, n);
            gemm_impl(
                client,
                (m, m, n),
                1.0,
                xr.clone(),
                xt,
                0.0,
                None,
                &ws.gram,
                false,
            )?;
            let g2 = gram.clone();
            gemm_impl(
                client,
                (m, m, m),
                c,
                gram,
                g2,
                b,
                Some(&ws.gram),
                &ws.bm,
                false,
            )?;
            gemm_impl(client, (m, n, m), 1.0, bm, xr, a, Some(x), out, false)
        }
        NsPrecision::Bf16 => {
            let Some((gram2, bmx)) = &ws.bf16_terms else {
                return Err(KernelError::Shape(
                    "NsPrecision::Bf16 needs a workspace made for it".into(),
                ));
            };
            check_size("gram2", gram2, mm_bytes)?;
            check_size("bmx", bmx, mn_bytes)?;
            let xt = MatRef::transposed(x, n);
            gemm_impl(
                client,
                (m, m, n),
                1.0,
                xr.clone(),
                xt,
                0.0,
                None,
                &ws.gram,
                true,
            )?;
            let g2 = gram.clone();
            gemm_impl(client, (m, m, m), 1.0, gram, g2, 0.0, None, gram2, true)?;
            axpby_bf16(client, &ws.gram, b, gram2, c, &ws.bm, m * m)?;
            gemm_impl(client, (m, n, m), 1.0, bm, xr, 0.0, None, bmx, true)?;
            axpby_bf16(client, x, a, bmx, 1.0, out, m * n)
        }
    }
}

/// `out = round_bf16(p·u + q·w)` over `len` values.
fn axpby_bf16<R: Runtime>(
    client: &ComputeClient<R>,
    u: &Handle,
    p: f32,
    w: &Handle,
    q: f32,
    out: &Handle,
    len: usize,
) -> Result<(), KernelError> {
    let bytes = product("len", &[len, 4])?;
    for (what, h) in [("u", u), ("w", w), ("out", out)] {
        check_size(what, h, bytes)?;
    }
    let len32 = to_u32("len", len as u64)?;
    // SAFETY: indices are below `len`, checked against the three handles above.
    unsafe {
        axpby_bf16_kernel::launch_unchecked::<R>(
            client,
            grid_1d(len),
            CubeDim::new_1d(UNITS_1D),
            ArrayArg::from_raw_parts(u.clone(), len),
            ArrayArg::from_raw_parts(w.clone(), len),
            ArrayArg::from_raw_parts(out.clone(), len),
            p,
            q,
            len32,
        );
    }
    Ok(())
}

/// Muon's orthogonalisation of the row-major `rows x cols` matrix `g` into `out` (same
/// shape), as `sshsdp_optim::newton_schulz(g, steps, precision)`: `X = G / (‖G‖_F + 1e-7)`
/// (rounded to bf16 for [`NsPrecision::Bf16`]), transposed when `rows > cols`, `steps`
/// quintic steps, transposed back.
pub fn newton_schulz<R: Runtime>(
    client: &ComputeClient<R>,
    g: &Handle,
    rows: usize,
    cols: usize,
    steps: usize,
    precision: NsPrecision,
    out: &Handle,
) -> Result<(), KernelError> {
    let len32 = to_u32("rows * cols", product("rows * cols", &[rows, cols])?)?;
    let len = len32 as usize;
    if len == 0 {
        return Ok(());
    }
    check_size("g", g, len as u64 * 4)?;
    check_size("out", out, len as u64 * 4)?;
    let transposed = rows > cols;
    let (m, n) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let words = |h: &Handle| h.size_in_used() as usize / 4;
    let partial = client.empty(REDUCE_CUBES as usize * 4);
    let norm = client.empty(4);
    let bytes = len * 4;
    let mut x = client.empty(bytes);
    let mut next = client.empty(bytes);
    let dim = CubeDim::new_1d(UNITS_1D);
    // SAFETY (all launches below): indices are below `len` (checked against every handle
    // above or freshly allocated with `len` values), `REDUCE_CUBES` and 1.
    unsafe {
        sum_squares_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(REDUCE_CUBES, 1, 1),
            dim,
            ArrayArg::from_raw_parts(g.clone(), words(g)),
            ArrayArg::from_raw_parts(partial.clone(), REDUCE_CUBES as usize),
            len32,
        );
        finish_norm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            dim,
            ArrayArg::from_raw_parts(partial.clone(), REDUCE_CUBES as usize),
            ArrayArg::from_raw_parts(norm.clone(), 1),
            NS_EPS,
        );
        scale_transpose_kernel::launch_unchecked::<R>(
            client,
            grid_1d(len),
            dim,
            ArrayArg::from_raw_parts(g.clone(), words(g)),
            ArrayArg::from_raw_parts(norm.clone(), 1),
            ArrayArg::from_raw_parts(x.clone(), len),
            rows as u32,
            cols as u32,
            transposed,
            true,
            precision == NsPrecision::Bf16,
        );
    }
    let ws = NsWorkspace::new(client, m, n, precision)?;
    for _ in 0..steps {
        ns_step(client, &x, m, n, NS_COEFFICIENTS, precision, &ws, &next)?;
        core::mem::swap(&mut x, &mut next);
    }
    // SAFETY: as above; `x` holds `m x n = len` values.
    unsafe {
        scale_transpose_kernel::launch_unchecked::<R>(
            client,
            grid_1d(len),
            dim,
            ArrayArg::from_raw_parts(x.clone(), len),
            ArrayArg::from_raw_parts(norm.clone(), 1),
            ArrayArg::from_raw_parts(out.clone(), words(out)),
            m as u32,
            n as u32,
            transposed,
            false,
            false,
        );
    }
    Ok(())
}
