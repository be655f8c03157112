//! The upload-queue micro-check (`scripts/device/h200.sh`, stage `uploads`): what a lane's
//! uploads cost in host memory on cubecl-cuda, with and without the flush the runtime makes
//! after each (`sshsdp-backend`'s `storage/cube/mod.rs`, `lane_upload`).
//!
//! cubecl-cuda keeps each upload's host copy in its stream's pending-drop queue until a kernel
//! launches on that stream or the client flushes. A thread that only uploads (a communication
//! lane) never launches one. This uploads `--count` buffers of `--mib` MiB from one such thread
//! (its own CubeCL stream; the main thread waits), once without and once with a flush after each
//! upload, and prints the process's resident memory after each upload and the growth per run.
//! Usage: `upload_queue [--count N] [--mib M]` (10 × 256 MiB by default). Exit status 0 when
//! the flushed run's growth stays under two uploads, 1 otherwise, 2 without a device.

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;

/// The process's resident set, bytes (Linux).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Uploads `count` copies of `data` from a new thread, flushing after each when `flush`; the
/// resident set after each upload, in MiB.
fn run(data: &'static [u8], count: usize, flush: bool) -> Vec<f64> {
    std::thread::spawn(move || {
        let client = CudaRuntime::client(&CudaDevice::new(0));
        let mut held = Vec::new();
        let mut after = Vec::new();
        for _ in 0..count {
            held.push(client.create_from_slice(data));
            if flush {
                client.flush().expect("flushing the stream");
            }
            after.push(rss() as f64 / (1 << 20) as f64);
        }
        // Everything uploaded has landed before the device buffers are dropped.
        cubecl::future::block_on(client.sync()).expect("syncing the stream");
        drop(held);
        after
    })
    .join()
    .expect("the uploading thread")
}

fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut count, mut mib) = (10usize, 256usize);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--count", Some(v)) => count = v,
            ("--mib", Some(v)) => mib = v,
            _ => {
                eprintln!("usage: upload_queue [--count N] [--mib M]");
                return std::process::ExitCode::from(2);
            }
        }
    }
    if std::panic::catch_unwind(|| CudaRuntime::client(&CudaDevice::new(0))).is_err() {
        eprintln!("no CUDA device (needs an NVIDIA GPU and its driver, libcuda.so)");
        return std::process::ExitCode::from(2);
    }
    let data: &'static [u8] = vec![7u8; mib << 20].leak();
    let mut growth = Vec::new();
    for flush in [false, true] {
        let before = rss() as f64 / (1 << 20) as f64;
        let after = run(data, count, flush);
        let grew = after.last().copied().unwrap_or(before) - before;
        let label = if flush {
            "with a flush"
        } else {
            "without a flush"
        };
        let steps: Vec<String> = after.iter().map(|m| format!("{m:.0}")).collect();
        println!("uploads {label}: RSS after each (MiB) {}", steps.join(" "));
        println!("uploads {label}: {count} × {mib} MiB grew RSS by {grew:.0} MiB");
        growth.push(grew);
    }
    let bounded = growth[1] < 2.0 * mib as f64 + 64.0;
    println!(
        "upload queue: {:.0} MiB held without a flush, {:.0} MiB with: {}",
        growth[0],
        growth[1],
        if bounded { "bounded" } else { "NOT bounded" }
    );
    std::process::ExitCode::from(if bounded { 0 } else { 1 })
}
