//! The main table: every mode at world 1, 2 and 4 on `Hsdp<NdArray>` against plain Burn and the
//! FSDP2-style baseline, printed as Markdown with the model, machine and column notes.

use sshsdp::backend::{init_seeded, named_params};
use sshsdp::models::Gpt;

use crate::common::{cpu_ticks, others_share};
use crate::machine::{first_line, load_average, matmul_ceiling, proc_field};
use crate::measure::{plain, sharded, Row};
use crate::modes::{MESH_MODES, MODES};
use crate::{Checkpointing, B, BATCH, BUCKET_ELEMENTS, CONFIG, D, LAYERS, SEQ, VOCAB, WARMUP};

/// A table row: world, mode, measurement (or why there is none), baseline step seconds.
type TableRow = (usize, &'static str, Result<Row, String>, Option<f64>);

/// The main table: `Hsdp<NdArray>` against plain Burn and the FSDP2-style baseline.
pub fn cpu_table(steps: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load_start = load_average();
    let ticks = cpu_ticks();
    let started = first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);

    let device = Default::default();
    let init: Gpt<B> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let params = named_params(&init).expect("parameters");
    // The same weights on the activation-checkpointing backend (the same seed, drawn whole the
    // same way, so Burn's RNG draws the same values).
    let init_checkpointing: Gpt<Checkpointing> = init_seeded(&device, 1, |d| CONFIG.init(d));
    let total: usize = params.iter().map(|p| p.values.len()).sum();
    let embeddings: usize = params
        .iter()
        .filter(|p| p.path.starts_with("embed.") || p.path.starts_with("pos."))
        .map(|p| p.values.len())
        .sum();
    let n = (total - embeddings) as f64;
    let tokens_per_step = (BATCH * SEQ) as f64;
    let model_flops = tokens_per_step * (6.0 * n + 12.0 * (LAYERS * D * SEQ) as f64);

    eprintln!("measuring the matmul ceiling");
    let (mm_one, mm_all) = matmul_ceiling(BATCH * SEQ, D, 4 * D, cores);
    let ceiling = mm_one.max(mm_all) * 1e9;

    let mut rows: Vec<TableRow> = Vec::new();
    eprintln!("world 1: plain Burn");
    let plain_row = plain(&init, steps);
    rows.push((1, "plain Burn", Ok(plain_row), None));
    for world in [1, 2, 4] {
        let mut done: Vec<(&str, Result<Row, String>)> = Vec::new();
        let modes = MODES.iter().chain(MESH_MODES.iter().filter(|_| world == 4));
        for mode in modes.clone() {
            eprintln!("world {world}: {}", mode.name);
            let row = if mode.checkpointing {
                sharded(&init_checkpointing, world, mode, steps, &device)
            } else {
                sharded(&init, world, mode, steps, &device)
            };
            done.push((mode.name, row));
        }
        let secs_of = |name: &str| {
            done.iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, r)| r.as_ref().ok())
                .map(|r| r.secs)
        };
        let baselines: Vec<Option<f64>> = modes.map(|m| secs_of(m.baseline)).collect();
        if world == 1 {
            rows[0].3 = secs_of("Fsdp2Style");
        }
        for ((name, row), baseline) in done.into_iter().zip(baselines) {
            rows.push((world, name, row, baseline));
        }
    }
    let load_end = load_average();
    let shares = others_share(ticks);

    let mib = |b: f64| b / (1024.0 * 1024.0);
    println!("## sshsdp-bench\n");
    println!("Command: `cargo bench --bench sshsdp-bench`");
    println!(
        "Machine: {} ({cores} cores), {} RAM; {}; load average {load_start} at start, \
         {load_end} at end ({shares}){}.\n",
        proc_field("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown CPU".into()),
        proc_field("/proc/meminfo", "MemTotal").unwrap_or_else(|| "unknown".into()),
        first_line("rustc", &["-V"]).unwrap_or_else(|| "rustc unknown".into()),
        started.map(|s| format!("; {s}")).unwrap_or_default(),
    );
    println!(
        "Model: GPT {LAYERS}×{D}, vocabulary {VOCAB}, sequence {SEQ}, global batch {BATCH} \
         ({:.2}M parameters, {:.2}M without embedding tables); AdamW; threads engine, flat mesh, \
         {BUCKET_ELEMENTS}-element buckets (2×2 rows: 2 replicas × 2 shards); median of {steps} \
         steps after {WARMUP} warm-up.",
        total as f64 / 1e6,
        n / 1e6
    );
    println!(
        "Model FLOPs per step {:.2} GFLOP (6·N·tokens + 12·L·d·T·tokens). Ceiling: NdArray f32 \
         matmul {}×{D}·{D}×{}: {mm_one:.1} GFLOP/s on one thread, {mm_all:.1} GFLOP/s with one \
         per core at once; MFU against {:.1} GFLOP/s.\n",
        model_flops / 1e9,
        BATCH * SEQ,
        4 * D,
        ceiling / 1e9
    );
    println!(
        "| world | mode | step ms | / Fsdp2Style | peak MiB/rank | all-gathered MiB | reduced MiB \
         | copied MiB | to / from backend MiB | exposed comm % of step | MFU | bytes = projection |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (world, name, row, baseline) in &rows {
        match row {
            Ok(r) => {
                let ratio = baseline.map_or("–".into(), |b| format!("{:.2}", r.secs / b));
                let check = match r.projection {
                    None => "–".to_string(),
                    Some((true, _, _)) => "yes".to_string(),
                    Some((false, g, red)) => format!(
                        "no: counters {:+.1}% / {:+.1}% against the plan's layout",
                        100.0 * (r.gathered as f64 / g.max(1) as f64 - 1.0),
                        100.0 * (r.reduced as f64 / red.max(1) as f64 - 1.0),
                    ),
                };
                println!(
                    "| {world} | {name} | {:.0} | {ratio} | {:.0} | {:.2} | {:.2} | {:.2} | \
                     {:.2} / {:.2} | {:.1}% | {:.1}% | {check} |",
                    r.secs * 1e3,
                    mib(r.peak_per_rank),
                    mib(r.gathered as f64),
                    mib(r.reduced as f64),
                    mib(r.copied as f64),
                    mib(r.traffic.0 as f64),
                    mib(r.traffic.1 as f64),
                    100.0 * r.exposed,
                    100.0 * model_flops / r.secs / ceiling,
                );
            }
            Err(reason) => {
                println!("| {world} | {name} | n/a: {reason} | | | | | | | | | |");
            }
        }
    }
    println!(
        "\nall-gathered: bytes received by bucket all-gathers; reduced: bytes of full-bucket fp32 \
         gradients entering reductions (reduce-scatter; all-reduce under Ddp); copied: parameter \
         bytes copied outside collectives (Fsdp2Style's copy-in/out, Ddp's replicated bucket); \
         to / from backend: bytes copied into and out of the backend's tensors (host↔device \
         traffic on a GPU; on NdArray the zero-copy rows hand buffers over without a copy, and \
         \"device storage\" keeps masters, AdamW state and gradients as backend tensors, \
         staged through the host for the host collectives); \
         all per step, rank 0; exposed comm: rank 0's model thread waiting on collectives. \
         / Fsdp2Style of reshard rows: against Fsdp2Style reshard; of 2×2 rows: against \
         Fsdp2Style HSDP 2×2."
    );
}
