//! The device check behind the `gpu_check` binaries: every kernel against the CPU
//! references on fresh random data, then throughput against a device-to-device copy
//! (quantise) and the `f32` GEMM of the same shape (MXFP8 matmul), generic over the runtime.

mod square;

use std::time::Instant;

use crate::{
    adamw_reference, adamw_step, dequantize_tiled, gemm, mx_matmul, ns_step, quantize_tiled,
    AdamWParams, InputDType, MatRef, NsPrecision, NsWorkspace, Plane, ScaleRule, NS_COEFFICIENTS,
};
use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::{decode_tiled, par::encode_tiled_par, tiled_bytes, ElemFormat, MxShape};

/// Word copy, the bandwidth reference (grid-stride).
#[cube(launch_unchecked)]
fn copy_kernel(src: &Array<u32>, dst: &mut Array<u32>, len: u32) {
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < len {
        dst[i as usize] = src[i as usize];
        i += stride;
    }
}

/// Problem sizes of a check run.
struct Sizes {
    q: (usize, usize),
    mm: (usize, usize, usize),
    ns: (usize, usize),
    adamw: usize,
    iters: usize,
}

impl Sizes {
    fn new(small: bool) -> Self {
        if small {
            Sizes {
                q: (256, 512),
                mm: (128, 128, 256),
                ns: (64, 192),
                adamw: 1 << 16,
                iters: 3,
            }
        } else {
            Sizes {
                q: (8192, 8192),
                mm: (4096, 4096, 4096),
                ns: (1024, 4096),
                adamw: 1 << 26,
                iters: 20,
            }
        }
    }
}

/// SplitMix64 random numbers.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Roughly normal values times `2^e`, `e` uniform in `[-emax, emax]`.
    fn wide(&mut self, n: usize, emax: i32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let s: f32 = (0..4)
                    .map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
                    .sum();
                let e = (self.next_u64() % (2 * emax as u64 + 1)) as i32 - emax;
                (s - 2.0) * 3f32.sqrt() * 2f32.powi(e)
            })
            .collect()
    }
}

/// The check context: client, table rows, failures.
struct Check<R: Runtime> {
    client: ComputeClient<R>,
    iters: usize,
    failures: usize,
}

impl<R: Runtime> Check<R> {
    /// Mean seconds per call of `f` after one warm-up call.
    fn time(&self, mut f: impl FnMut()) -> f64 {
        f();
        sync(&self.client);
        let t = Instant::now();
        for _ in 0..self.iters {
            f();
        }
        sync(&self.client);
        t.elapsed().as_secs_f64() / self.iters as f64
    }

    /// Records a check result.
    fn verdict(&mut self, name: &str, ok: bool, detail: String) {
        println!(
            "check  {name:<26} {:<4} {detail}",
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            self.failures += 1;
        }
    }

    fn upload(&self, v: &[f32]) -> Handle {
        self.client.create_from_slice(f32::as_bytes(v))
    }

    fn read_f32(&self, h: &Handle) -> Vec<f32> {
        f32::from_bytes(&self.client.read_one(h.clone()).expect("read back")).to_vec()
    }

    fn read_bytes(&self, h: &Handle) -> Vec<u8> {
        self.client.read_one(h.clone()).expect("read back").to_vec()
    }
}

/// Waits for the device.
fn sync<R: Runtime>(client: &ComputeClient<R>) {
    cubecl::future::block_on(client.sync()).expect("device sync");
}

/// Prints one table row.
fn row(kernel: &str, shape: &str, secs: f64, rate: String, reference: String) {
    println!(
        "perf   {kernel:<26} {shape:<16} {:>10.3} ms  {rate:<24} {reference}",
        secs * 1e3
    );
}

/// The 1×32 two-plane kernels (kept for `mx_matmul`'s operands) and the device copy; returns
/// the copy's GB/s.
fn quantize<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng, (rows, cols): (usize, usize)) -> f64 {
    let c = ck.client.clone();
    let x = rng.wide(rows * cols, 10);
    let shape = MxShape::new(rows, cols);
    let nbytes = tiled_bytes(rows, cols);
    let input = ck.upload(&x);
    let out = c.empty(nbytes);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
        quantize_tiled(&c, &input, InputDType::F32, rows, cols, rule, &out, 0).unwrap();
        let got = ck.read_bytes(&out);
        let mut want = vec![0u8; nbytes];
        encode_tiled_par(&x, shape, ElemFormat::E4M3, rule, &mut want, threads).unwrap();
        let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        ck.verdict(
            &format!("quantize {rule:?}"),
            bad == 0 && got.len() == nbytes,
            format!("{rows}x{cols}: {bad} of {nbytes} bytes differ from sshsdp-mx"),
        );
    }
    // dequantise: sample rows of both planes against decode_tiled of the same bytes
    let bytes = ck.read_bytes(&out);
    let deq = c.empty(rows * cols * 4);
    for plane in [Plane::Row, Plane::Col] {
        dequantize_tiled(&c, &out, 0, rows, cols, plane, &deq).unwrap();
        let got = ck.read_f32(&deq);
        let mut want = vec![0f32; rows * cols];
        decode_tiled(&bytes, shape, ElemFormat::E4M3, plane, &mut want).unwrap();
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        ck.verdict(
            &format!("dequantize {plane:?}"),
            bad == 0,
            format!("{rows}x{cols}: {bad} values differ from sshsdp-mx"),
        );
    }
    // throughput
    let words = (rows * cols) as u32;
    let dst = c.empty(rows * cols * 4);
    let cubes = words.div_ceil(256).clamp(1, 65_535);
    let t_copy = ck.time(|| unsafe {
        copy_kernel::launch_unchecked::<R>(
            &c,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(input.clone(), words as usize),
            ArrayArg::from_raw_parts(dst.clone(), words as usize),
            words,
        )
    });
    let copy_bytes = 2.0 * (rows * cols * 4) as f64;
    let copy_gbs = copy_bytes / t_copy / 1e9;
    row(
        "d2d copy (u32 kernel)",
        &format!("{:.1} MB", (rows * cols * 4) as f64 / 1e6),
        t_copy,
        format!("{copy_gbs:.1} GB/s"),
        String::new(),
    );
    let t_q = ck.time(|| {
        quantize_tiled(
            &c,
            &input,
            InputDType::F32,
            rows,
            cols,
            ScaleRule::Rceil,
            &out,
            0,
        )
        .unwrap()
    });
    let q_gbs = ((rows * cols * 4 + nbytes) as f64) / t_q / 1e9;
    row(
        "quantize f32->tiled",
        &format!("{rows}x{cols}"),
        t_q,
        format!("{q_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy (target >= 70%)", 100.0 * q_gbs / copy_gbs),
    );
    let t_d = ck.time(|| dequantize_tiled(&c, &out, 0, rows, cols, Plane::Row, &deq).unwrap());
    let d_gbs = ((rows * cols * 4 + nbytes / 2) as f64) / t_d / 1e9;
    row(
        "dequantize row plane",
        &format!("{rows}x{cols}"),
        t_d,
        format!("{d_gbs:.1} GB/s (rd+wr)"),
        format!("{:.0}% of copy", 100.0 * d_gbs / copy_gbs),
    );
    copy_gbs
}

/// `max |got - want| / (|A|·|B|ᵀ)` over sampled outputs of an NT product of row-major data.
#[allow(clippy::too_many_arguments)]
fn sampled_nt_error(
    got: &[f32],
    a: &[f32],
    b: &[f32],
    n: usize,
    k: usize,
    samples: &[(usize, usize)],
) -> f64 {
    samples
        .iter()
        .map(|&(i, j)| {
            let (mut s, mut sa) = (0f64, 0f64);
            for l in 0..k {
                let p = a[i * k + l] as f64 * b[j * k + l] as f64;
                s += p;
                sa += p.abs();
            }
            (got[i * n + j] as f64 - s).abs() / sa.max(1e-30)
        })
        .fold(0.0, f64::max)
}

fn matmul<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng, (m, n, k): (usize, usize, usize)) {
    let c = ck.client.clone();
    let a = rng.wide(m * k, 4);
    let b = rng.wide(n * k, 4);
    let (ha, hb) = (ck.upload(&a), ck.upload(&b));
    let (wa, wb) = (tiled_bytes(m, k) / 4, tiled_bytes(n, k) / 4);
    let bucket = c.empty((wa + wb) * 4);
    quantize_tiled(&c, &ha, InputDType::F32, m, k, ScaleRule::Rceil, &bucket, 0).unwrap();
    quantize_tiled(
        &c,
        &hb,
        InputDType::F32,
        n,
        k,
        ScaleRule::Rceil,
        &bucket,
        wa,
    )
    .unwrap();
    let out = c.empty(m * n * 4);
    mx_matmul(&c, m, n, k, &bucket, 0, &bucket, wa, &out).unwrap();
    let got = ck.read_f32(&out);
    // reference: dequantised row planes (decoded on the CPU), sampled outputs in f64
    let bytes = ck.read_bytes(&bucket);
    let mut ad = vec![0f32; m * k];
    let mut bd = vec![0f32; n * k];
    decode_tiled(
        &bytes[..wa * 4],
        MxShape::new(m, k),
        ElemFormat::E4M3,
        Plane::Row,
        &mut ad,
    )
    .unwrap();
    decode_tiled(
        &bytes[wa * 4..],
        MxShape::new(n, k),
        ElemFormat::E4M3,
        Plane::Row,
        &mut bd,
    )
    .unwrap();
    let samples: Vec<(usize, usize)> = (0..512)
        .map(|_| (rng.next_u64() as usize % m, rng.next_u64() as usize % n))
        .collect();
    let err = sampled_nt_error(&got, &ad, &bd, n, k, &samples);
    ck.verdict(
        "mx_matmul vs CPU",
        err <= 1e-5,
        format!("{m}x{n}x{k}: max rel err {err:.2e} over 512 sampled outputs (tol 1e-5)"),
    );
    // f32 GEMM of the same shape (same kernel skeleton, f32 operands)
    let out32 = c.empty(m * n * 4);
    let gemm_nt = || {
        gemm(
            &c,
            m,
            n,
            k,
            1.0,
            MatRef::row_major(&ha, k),
            MatRef::transposed(&hb, k),
            0.0,
            None,
            &out32,
        )
        .unwrap()
    };
    gemm_nt();
    let got32 = ck.read_f32(&out32);
    let err32 = sampled_nt_error(&got32, &a, &b, n, k, &samples);
    ck.verdict(
        "gemm f32 vs CPU",
        err32 <= 1e-5,
        format!("{m}x{n}x{k}: max rel err {err32:.2e}"),
    );
    let flops = 2.0 * (m * n * k) as f64;
    let t32 = ck.time(gemm_nt);
    let t_mx = ck.time(|| mx_matmul(&c, m, n, k, &bucket, 0, &bucket, wa, &out).unwrap());
    row(
        "gemm f32 (reference)",
        &format!("{m}x{n}x{k}"),
        t32,
        format!("{:.2} TFLOP/s", flops / t32 / 1e12),
        String::new(),
    );
    row(
        "mx_matmul (deq. in load)",
        &format!("{m}x{n}x{k}"),
        t_mx,
        format!("{:.2} TFLOP/s", flops / t_mx / 1e12),
        format!("{:.2}x the f32 GEMM", t32 / t_mx),
    );
}

fn newton_schulz<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng, (m, n): (usize, usize)) {
    let c = ck.client.clone();
    let x0 = rng.wide(m * n, 0);
    let norm = x0.iter().map(|v| (v * v) as f64).sum::<f64>().sqrt() as f32;
    let x: Vec<f32> = x0.iter().map(|v| v / norm).collect();
    let hx = ck.upload(&x);
    let out = c.empty(m * n * 4);
    let ws = NsWorkspace::new(&c, m, n, NsPrecision::F32).unwrap();
    ns_step(&c, &hx, m, n, NS_COEFFICIENTS, NsPrecision::F32, &ws, &out).unwrap();
    let got = ck.read_f32(&out);
    // reference: Gram in f64, then sampled outputs
    let (a, b, cc) = NS_COEFFICIENTS;
    let mut gram = vec![0f64; m * m];
    for i in 0..m {
        for j in i..m {
            let s: f64 = (0..n)
                .map(|l| x[i * n + l] as f64 * x[j * n + l] as f64)
                .sum();
            gram[i * m + j] = s;
            gram[j * m + i] = s;
        }
    }
    let mut err = 0f64;
    for _ in 0..64 {
        let (i, j) = (rng.next_u64() as usize % m, rng.next_u64() as usize % n);
        let bm_row: Vec<f64> = (0..m)
            .map(|l| {
                let aa: f64 = (0..m).map(|q| gram[i * m + q] * gram[q * m + l]).sum();
                b as f64 * gram[i * m + l] + cc as f64 * aa
            })
            .collect();
        let want = a as f64 * x[i * n + j] as f64
            + (0..m).map(|l| bm_row[l] * x[l * n + j] as f64).sum::<f64>();
        err = err.max((got[i * n + j] as f64 - want).abs());
    }
    ck.verdict(
        "ns_step vs CPU",
        err <= 1e-4,
        format!("{m}x{n}: max abs err {err:.2e} over 64 sampled outputs (tol 1e-4)"),
    );
    let flops = (4 * m * m * n + 2 * m * m * m) as f64;
    let t =
        ck.time(|| ns_step(&c, &hx, m, n, NS_COEFFICIENTS, NsPrecision::F32, &ws, &out).unwrap());
    let bytes = (4 * (3 * m * n + 4 * m * m)) as f64;
    row(
        "ns_step (3 f32 GEMMs)",
        &format!("{m}x{n}"),
        t,
        format!("{:.2} TFLOP/s", flops / t / 1e12),
        format!("{:.1} GB/s", bytes / t / 1e9),
    );
}

fn adamw<R: Runtime>(ck: &mut Check<R>, rng: &mut Rng, len: usize) {
    let c = ck.client.clone();
    let mut p = rng.wide(len, 2);
    let g = rng.wide(len, 4);
    let (mut m, mut v) = (vec![0f32; len], vec![0f32; len]);
    let (hp, hg) = (ck.upload(&p), ck.upload(&g));
    let (hm, hv) = (ck.upload(&m), ck.upload(&v));
    let params = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    adamw_step(&c, &hp, &hg, &hm, &hv, len, &params).unwrap();
    adamw_reference(&mut p, &g, &mut m, &mut v, &params);
    let got = ck.read_f32(&hp);
    let err = got
        .iter()
        .zip(&p)
        .map(|(a, b)| ((a - b).abs() / b.abs().max(1e-3)) as f64)
        .fold(0.0, f64::max);
    ck.verdict(
        "adamw vs CPU",
        err <= 1e-6,
        format!("{len} values: max rel err {err:.2e} (tol 1e-6)"),
    );
    let t = ck.time(|| adamw_step(&c, &hp, &hg, &hm, &hv, len, &params).unwrap());
    // reads p, g, m, v; writes p, m, v
    let bytes = (7 * 4 * len) as f64;
    row(
        "adamw (fused)",
        &format!("{len}"),
        t,
        format!("{:.1} GB/s", bytes / t / 1e9),
        String::new(),
    );
}

/// Runs every check on `client`: correctness against the CPU references on fresh random
/// data (seeded by `seed`), then timings, printed as a table. `small` picks sizes that a
/// software device (lavapipe) finishes in seconds. Returns the number of failed checks.
pub fn run<R: Runtime>(client: ComputeClient<R>, small: bool, seed: u64) -> usize {
    let sizes = Sizes::new(small);
    println!(
        "gpu_check: runtime {}, seed {seed}, {} sizes",
        R::name(&client),
        if small { "small" } else { "full" }
    );
    let mut ck = Check {
        client,
        iters: sizes.iters,
        failures: 0,
    };
    let mut rng = Rng(seed);
    let copy_gbs = quantize(&mut ck, &mut rng, sizes.q);
    square::square(&mut ck, &mut rng, sizes.q, copy_gbs);
    matmul(&mut ck, &mut rng, sizes.mm);
    newton_schulz(&mut ck, &mut rng, sizes.ns);
    adamw(&mut ck, &mut rng, sizes.adamw);
    ck.failures
}

/// Creates a client on `device`, turning the runtime's panic when there is no device into
/// an error message (the first panic message seen, on any thread).
pub fn try_client<R: Runtime>(device: &R::Device) -> Result<ComputeClient<R>, String> {
    use std::sync::{Arc, Mutex};
    let first: Arc<Mutex<Option<String>>> = Arc::default();
    let seen = first.clone();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let mut slot = seen.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            *slot = Some(msg);
        }
    }));
    let client = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let c = R::client(device);
        sync(&c);
        c
    }));
    std::panic::set_hook(hook);
    client.map_err(|_| {
        first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| "runtime initialisation panicked".into())
    })
}

/// The `gpu_check` binaries' whole `main` on runtime `R`: parses `--small` and `--seed N`
/// (default: the clock), runs [`run`] on the default device and maps the outcome to the exit
/// status (0 all passed, 1 a check failed, 2 no device: `no_device` says what is missing).
pub fn main<R: Runtime>(no_device: &str) -> std::process::ExitCode {
    use std::process::ExitCode;
    let args: Vec<String> = std::env::args().collect();
    let small = args.iter().any(|a| a == "--small");
    let seed = args
        .iter()
        .position(|a| a == "--seed")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    match try_client::<R>(&Default::default()) {
        Err(why) => {
            eprintln!("gpu_check: {no_device}\n  ({why})");
            ExitCode::from(2)
        }
        Ok(client) => match run(client, small, seed) {
            0 => {
                println!("gpu_check: all checks passed");
                ExitCode::SUCCESS
            }
            n => {
                println!("gpu_check: {n} check(s) FAILED");
                ExitCode::from(1)
            }
        },
    }
}
