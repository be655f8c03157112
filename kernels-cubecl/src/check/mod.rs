//! The device check behind the `gpu_check` binaries: the kernels against the CPU references
//! on fresh random data, then their throughput against a device-to-device copy, generic over
//! the runtime.
//!
//! Always built: the square-block MXFP8 codec the runtime calls (`square.rs`), its bucket
//! tables (`table.rs`: the one-launch decode, 16-bit targets included) and the fused AdamW. With the feature `experimental` also the lab kernels (`lab.rs`: the tiled layout, the
//! MXFP8 matmul against the `f32` GEMM of the same shape, Newton–Schulz); the device scripts
//! build the binaries with it (`scripts/gpu_check.sh`, `scripts/device/h200.sh`).

#[cfg(feature = "experimental")]
mod lab;
mod square;
mod table;

use std::time::Instant;

use crate::{adamw_reference, adamw_step, AdamWParams};
use cubecl::prelude::*;
use cubecl::server::Handle;

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
    #[cfg(feature = "experimental")]
    mm: (usize, usize, usize),
    #[cfg(feature = "experimental")]
    ns: (usize, usize),
    adamw: usize,
    iters: usize,
}

impl Sizes {
    fn new(small: bool) -> Self {
        if small {
            Sizes {
                q: (256, 512),
                #[cfg(feature = "experimental")]
                mm: (128, 128, 256),
                #[cfg(feature = "experimental")]
                ns: (64, 192),
                adamw: 1 << 16,
                iters: 3,
            }
        } else {
            Sizes {
                q: (8192, 8192),
                #[cfg(feature = "experimental")]
                mm: (4096, 4096, 4096),
                #[cfg(feature = "experimental")]
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

/// The device copy of a `rows × cols` `f32` buffer, the bandwidth reference of the codecs'
/// rows; returns its GB/s.
fn copy_rate<R: Runtime>(ck: &mut Check<R>, (rows, cols): (usize, usize)) -> f64 {
    let c = ck.client.clone();
    let words = (rows * cols) as u32;
    let (src, dst) = (c.empty(rows * cols * 4), c.empty(rows * cols * 4));
    let cubes = words.div_ceil(256).clamp(1, 65_535);
    // SAFETY: both buffers hold `words` words, and the kernel indexes below `len = words`.
    let t_copy = ck.time(|| unsafe {
        copy_kernel::launch_unchecked::<R>(
            &c,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(src.clone(), words as usize),
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
    copy_gbs
}

/// The fused AdamW step against [`adamw_reference`], then its GB/s.
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

/// Runs every check on `client` (the lab kernels' too with the feature `experimental`):
/// correctness against the CPU references on fresh random data (seeded by `seed`), then
/// timings, printed as a table. `small` picks sizes that a
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
    let copy_gbs = copy_rate(&mut ck, sizes.q);
    square::square(&mut ck, &mut rng, sizes.q, copy_gbs);
    table::tables(&mut ck, &mut rng);
    adamw(&mut ck, &mut rng, sizes.adamw);
    #[cfg(feature = "experimental")]
    {
        lab::tiled(&mut ck, &mut rng, sizes.q, copy_gbs);
        lab::matmul(&mut ck, &mut rng, sizes.mm);
        lab::newton_schulz(&mut ck, &mut rng, sizes.ns);
    }
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
