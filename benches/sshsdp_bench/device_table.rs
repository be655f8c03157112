//! The `Hsdp<Wgpu>` table (feature `wgpu`): host against device storage of masters, optimizer
//! state, gradients and runtime shards, on burn-wgpu's default `Wgpu` (fusion, autotune) and on
//! `CubeBackend` without fusion, printed as Markdown.

use burn::backend::Autodiff;
use burn_wgpu::WgpuDevice;
use sshsdp::backend::{init_seeded, CopyMode, Hsdp, Placement};
use sshsdp::kernels::FusedOps;
use sshsdp::models::Gpt;
use sshsdp::plan::{RuntimeFormat, Sharding};

use crate::measure::{sharded, Row};
use crate::modes::Mode;
use crate::{CONFIG, WARMUP};

/// One row of the table: backend, world, format, storage, the measurement, the same backend's
/// host-storage seconds.
type TableRow = (
    &'static str,
    usize,
    RuntimeFormat,
    &'static str,
    Result<Row, String>,
    Option<f64>,
);

/// The `Hsdp<Wgpu>` table (feature `wgpu`): host against device storage of masters, AdamW state
/// and gradients, in f32 and MXFP8, at world 1 and 2 (ranks sharing the one device), on the
/// fused default and without fusion.
pub fn device_table(steps: usize) {
    type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>;
    let mut rows = rows_on::<burn_wgpu::Wgpu>("Wgpu (fusion)", steps);
    rows.extend(rows_on::<Unfused>("CubeBackend (no fusion)", steps));
    print_table(steps, rows);
}

/// The table's rows on backend `I`, labelled `backend`.
fn rows_on<I: FusedOps<Device = WgpuDevice>>(backend: &'static str, steps: usize) -> Vec<TableRow> {
    let device = WgpuDevice::default();
    let init: Gpt<Autodiff<Hsdp<I>>> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let mut rows = Vec::new();
    for world in [1, 2] {
        for format in [RuntimeFormat::F32, RuntimeFormat::Mxfp8] {
            let mut host_secs = None;
            let storages = [
                ("Host", Placement::Host, false, None),
                ("Host, AdamW on the CPU", Placement::Host, true, None),
                ("Device", Placement::Device, false, None),
                (
                    "Device, shards too",
                    Placement::Device,
                    false,
                    Some(Placement::Device),
                ),
            ];
            for (storage, placement, offload, shards) in storages {
                let mode = Mode {
                    name: "device table",
                    sharding: Sharding::Hierarchical,
                    copy: CopyMode::ZeroCopy,
                    format,
                    reshard: false,
                    replicas: 1,
                    storage: placement,
                    shards,
                    offload,
                    checkpointing: false,
                    baseline: "host storage",
                };
                eprintln!("Hsdp<{backend}> world {world}: {format:?}, {storage} storage");
                let row = sharded(&init, world, &mode, steps, &device);
                if storage == "Host" {
                    host_secs = row.as_ref().ok().map(|r| r.secs);
                }
                rows.push((backend, world, format, storage, row, host_secs));
            }
        }
    }
    rows
}

/// Prints `rows` as the Markdown table with its notes.
fn print_table(steps: usize, rows: Vec<TableRow>) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("\n## Hsdp<Wgpu>: host and device storage\n");
    println!(
        "Command: `cargo bench --bench sshsdp-bench --features wgpu` (`SSHSDP_BENCH_DEVICE_ONLY=1` \
         for this table alone). The same GPT and batch on `Autodiff<Hsdp<Wgpu>>` (CubeCL's wgpu \
         runtime on the default adapter: Mesa's lavapipe on a machine without a GPU; Burn's \
         default `Wgpu`, fusion and autotune on, and `CubeBackend` without fusion), AdamW, \
         flat mesh, threads engine with every rank on the one device; median of {steps} steps \
         after {WARMUP} warm-up. Host storage: fp32 masters and gradient buckets on the host, \
         AdamW (a Burn optimizer on the model's backend) and its state on the device; host with \
         AdamW on the CPU: the optimizer on NdArray over host views (`step_offloaded`), its \
         state off the device (FSDP2's CPU offload); device storage: masters, state and \
         gradients on the device, the runtime bytes re-derived there (MXFP8), runtime shards on the host; device, shards too: the runtime shards on the device as well (`with_shard_placement`: each gather reads this rank's part back, each update's piece stays on the device). The collectives are on the host in every row (the threads engine: the staged path; NCCL gathers from device shards with no host copy)."
    );
    println!(
        "\n| backend | world | format | storage | step ms | / host storage | to / from device MiB \
         per step | device MiB in use / reserved (max) | host heap peak MiB/rank |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (backend, world, format, storage, row, host_secs) in rows {
        match row {
            Ok(r) => {
                let ratio = host_secs.map_or("–".into(), |h| format!("{:.2}", r.secs / h));
                let memory = r.device_memory.map_or("n/a".into(), |(u, res)| {
                    format!("{:.1} / {:.1}", mib(u), mib(res))
                });
                println!(
                    "| {backend} | {world} | {format:?} | {storage} | {:.0} | {ratio} | {:.2} / \
                     {:.2} | {memory} | {:.0} |",
                    r.secs * 1e3,
                    mib(r.traffic.0),
                    mib(r.traffic.1),
                    r.peak_per_rank / (1024.0 * 1024.0),
                );
            }
            Err(reason) => {
                println!("| {backend} | {world} | {format:?} | {storage} | n/a: {reason} | | | | |")
            }
        }
    }
    println!(
        "\nto / from device: bytes uploaded to and read back from the device per step by rank 0 \
         (`Counters::uploaded_bytes` / `downloaded_bytes`). Device memory: CubeCL's \
         `memory_usage()` of the shared device (all ranks), sampled after each timed step's \
         forward and after its update, the most seen; CubeCL reports no peak between samples; \
         under fusion a released bucket returns to the pool when fusion's stream runs past its \
         views' drops. Times on lavapipe are no GPU figures: this table checks correctness and \
         bytes (equal with and without fusion)."
    );
}
