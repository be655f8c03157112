//! MXFP8 runtime parameters: a small GPT whose matrices are held, gathered and computed from as
//! square-block MXFP8 (E4M3 elements, one E8M0 scale per 32×32 tile, one copy for both passes)
//! while its fp32 masters are stepped, trains like the bf16 run and the same at every world size.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use sshsdp::backend::{init_seeded, named_params, shard, Counters, Hsdp, HsdpConfig, HsdpRuntime};
use sshsdp::checkpoint;
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::comm::Collective;
use sshsdp::models::{Gpt, GptConfig};
use sshsdp::optim::ShardedOptimizer;
use sshsdp::optim::ShardedStep;
use sshsdp::optim::{MuonConfig, ShardedMuon};
use sshsdp::plan::Span;
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

type Inner = NdArray<f32>;
type B = Autodiff<Hsdp<Inner>>;

const BATCH: usize = 8;
/// Every matrix is a multiple of 32 on both sides, so all of them are MXFP8.
const CONFIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 64,
    layers: 2,
    heads: 4,
    seq: 16,
};

/// Rows `first..first + rows` of step `step`'s batch: each next token is `7·t + 3 + r` with `r`
/// drawn from four values, so the loss floor is ln 4 ≈ 1.386 and runs are compared where the
/// model still has something to learn.
fn tokens(step: usize, first: usize, rows: usize) -> Tensor<B, 2, Int> {
    let w = CONFIG.seq + 1;
    let hash = |x: usize| (x as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    let mut data = Vec::with_capacity(rows * w);
    for row in first..first + rows {
        let seed = step * 1_000 + row;
        let mut t = hash(seed) as usize % CONFIG.vocab;
        for j in 0..w {
            data.push(t as i64);
            t = (t * 7 + 3 + hash(seed * 64 + j + 1) as usize % 4) % CONFIG.vocab;
        }
    }
    Tensor::from_data(TensorData::new(data, [rows, w]), &Default::default())
}

fn init() -> Gpt<B> {
    // Drawn whole (every copy shares the same materialised values), under the RNG lock.
    init_seeded(&Default::default(), 3, |d| CONFIG.init(d))
}

#[derive(Clone, Copy, PartialEq)]
enum Opt {
    AdamW,
    Muon,
}

struct Run {
    losses: Vec<f32>,
    counters: Counters,
    master_bytes: u64,
    shard_bytes: u64,
    mx_params: usize,
    fallbacks: Vec<String>,
}

fn train(
    init: &Gpt<B>,
    mesh: Mesh,
    sharding: Sharding,
    format: RuntimeFormat,
    opt: Opt,
    steps: usize,
    reshard: bool,
) -> Vec<Run> {
    let world = mesh.world_size();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(mesh)
            .with_sharding(sharding)
            .with_format(format)
            .with_reshard_after_forward(reshard)
            .with_bucket_elements(20_000);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut adamw = ShardedOptimizer::new(AdamWConfig::new().build(), device);
        let mut muon =
            ShardedMuon::new(MuonConfig::new().init(), AdamWConfig::new().build(), device);
        let local = BATCH / world;
        let mut losses = Vec::new();
        let mut counters = Counters::default();
        for step in 0..steps {
            let loss = model.loss(tokens(step, rank * local, local));
            losses.push(loss.clone().into_scalar());
            let _ = loss.backward();
            model = match opt {
                Opt::AdamW => adamw.step(1e-2, model, &runtime).unwrap(),
                Opt::Muon => muon.step(2e-2, model, &runtime).unwrap(),
            };
            if step == 0 {
                counters = runtime.take_counters();
            }
        }
        let plan = runtime.plan();
        Run {
            losses,
            counters,
            master_bytes: runtime.master_bytes(),
            shard_bytes: runtime.shard_bytes(),
            mx_params: plan
                .params()
                .iter()
                .filter(|p| p.format == RuntimeFormat::Mxfp8)
                .count(),
            fallbacks: plan.fallbacks().iter().map(|f| f.path.clone()).collect(),
        }
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

fn mean_losses(runs: &[Run]) -> Vec<f32> {
    let n = runs.len() as f32;
    (0..runs[0].losses.len())
        .map(|s| runs.iter().map(|r| r.losses[s]).sum::<f32>() / n)
        .collect()
}

/// The training test: after the same steps, the MXFP8 run's loss is within 2 % of the
/// bf16 run's, and it learned.
#[test]
fn mxfp8_training_tracks_bf16_within_two_percent() {
    const STEPS: usize = 30;
    let init = init();
    let mesh = Mesh::flat(2).unwrap();
    let run = |format| {
        train(
            &init,
            mesh,
            Sharding::Hierarchical,
            format,
            Opt::AdamW,
            STEPS,
            false,
        )
    };
    let (mx, bf) = (run(RuntimeFormat::Mxfp8), run(RuntimeFormat::Bf16));
    let (mx_losses, bf_losses) = (mean_losses(&mx), mean_losses(&bf));
    let tail = |l: &[f32]| l[STEPS - 3..].iter().sum::<f32>() / 3.0;
    let (m, b) = (tail(&mx_losses), tail(&bf_losses));
    eprintln!(
        "loss over the last 3 steps: MXFP8 {m:.4}, bf16 {b:.4} (step 0: {:.4})",
        mx_losses[0]
    );
    assert!((m - b).abs() <= 0.02 * b, "MXFP8 {m} vs bf16 {b}");
    assert!(m < 0.75 * mx_losses[0], "did not learn: {mx_losses:?}");
    // Every block-aligned matrix (embeddings included) is MXFP8; vectors and the 16-row position
    // table fell back to bf16, each reported.
    let params = named_params(&init).unwrap();
    let aligned = params
        .iter()
        .filter(|p| p.shape.len() == 2 && p.shape.iter().all(|d| d % 32 == 0))
        .count();
    assert_eq!(mx[0].mx_params, aligned);
    assert_eq!(mx[0].fallbacks.len(), params.len() - aligned);
    // fp32 masters of half the model on each rank, kept apart from the runtime bytes.
    let elements: usize = params.iter().map(|p| p.values.len()).sum();
    assert!(mx[0].master_bytes >= 2 * elements as u64);
    assert!(mx[0].master_bytes <= 2 * elements as u64 + 64 * 1024);
    // One copy travels: 1 + 1/1024 bytes per matrix value against bf16's 2 (plus pieces padded
    // to the largest, at most one tile more, on this small model).
    let ratio = mx[0].counters.gathered_bytes as f64 / bf[0].counters.gathered_bytes as f64;
    eprintln!("gathered bytes per step, MXFP8/bf16: {ratio:.3}");
    assert!(
        (0.5..0.56).contains(&ratio),
        "gathered MXFP8/bf16 = {ratio}"
    );
    assert!(mx[0].counters.decoded_bytes > 0);
    assert!(mx[0].shard_bytes > 0 && mx[0].counters.param_bytes_copied == 0);
}

/// 32×32 tiles encode to the same bytes at every world size, so distributed Muon
/// over MXFP8 runtime parameters follows the same losses at world 1, 2, 4 and over 2×2 meshes
/// (up to gradient reduction order).
#[test]
fn mxfp8_trains_the_same_at_every_world_size_with_muon() {
    const STEPS: usize = 6;
    let init = init();
    let one = mean_losses(&train(
        &init,
        Mesh::flat(1).unwrap(),
        Sharding::Hierarchical,
        RuntimeFormat::Mxfp8,
        Opt::Muon,
        STEPS,
        false,
    ));
    assert!(one[STEPS - 1] < one[0], "{one:?}");
    for (mesh, sharding) in [
        (Mesh::flat(2).unwrap(), Sharding::Hierarchical),
        (Mesh::flat(4).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
    ] {
        let losses = mean_losses(&train(
            &init,
            mesh,
            sharding,
            RuntimeFormat::Mxfp8,
            Opt::Muon,
            STEPS,
            false,
        ));
        for (step, (a, b)) in losses.iter().zip(&one).enumerate() {
            assert!(
                (a - b).abs() <= 2e-3 * b.abs(),
                "{mesh} {sharding:?} step {step}: {a} vs {b}"
            );
        }
    }
}

/// Resharding after forward, backward gathers the same one copy again (no per-pass planes):
/// about half of bf16's bytes, and exactly the same training as keeping the bucket resident.
#[test]
fn mxfp8_with_resharding_gathers_the_one_copy_again() {
    const STEPS: usize = 4;
    let init = init();
    let mesh = Mesh::flat(2).unwrap();
    let run = |format, reshard| {
        train(
            &init,
            mesh,
            Sharding::Hierarchical,
            format,
            Opt::Muon,
            STEPS,
            reshard,
        )
    };
    let again = run(RuntimeFormat::Mxfp8, true);
    let resident = run(RuntimeFormat::Mxfp8, false);
    let bf16 = run(RuntimeFormat::Bf16, true);
    for (a, b) in again.iter().zip(&resident) {
        assert_eq!(a.losses, b.losses);
    }
    let ratio = again[0].counters.gathered_bytes as f64 / bf16[0].counters.gathered_bytes as f64;
    eprintln!("gathered bytes per step with resharding, MXFP8/bf16: {ratio:.3}");
    assert!((0.5..0.56).contains(&ratio), "MXFP8/bf16 = {ratio}");
    assert!(again[0].counters.backward_gathers > 0);
}

/// What one rank of [`resume`] saw: the masters after loading (or after the first steps), the
/// losses of the steps after that, and whether its plan cut a matrix inside a band.
struct Resumed {
    masters: Vec<Vec<u32>>,
    losses: Vec<f32>,
    cut_inside_a_band: bool,
}

/// Whether some MXFP8 view of `runtime`'s plan starts or ends inside a band (a tile cut that the
/// 32-row bands of the two-plane layout could not make).
fn cut_inside_a_band(runtime: &HsdpRuntime<Inner>) -> bool {
    let plan = runtime.plan();
    let views = plan.buckets().iter().flat_map(|b| b.views.iter().flatten());
    views
        .into_iter()
        .any(|v| match (&v.span, v.encoding.grid()) {
            (Span::Tiles(t), Some(grid)) => {
                let edge = |x: u64| x % grid.tile_cols() == 0;
                !edge(t.start) || !edge(t.end)
            }
            _ => false,
        })
}

/// Steps `steps` of rank `rank`'s batches (of `local` rows) with `muon`; returns the model and
/// the losses.
fn muon_steps(
    mut model: Gpt<B>,
    steps: std::ops::Range<usize>,
    (rank, local): (usize, usize),
    muon: &mut ShardedMuon<Inner, burn::optim::AdamW>,
    runtime: &HsdpRuntime<Inner>,
) -> (Gpt<B>, Vec<f32>) {
    let mut losses = Vec::new();
    for step in steps {
        let loss = model.loss(tokens(step, rank * local, local));
        losses.push(loss.clone().into_scalar());
        let _ = loss.backward();
        model = muon.step(2e-2, model, runtime).unwrap();
    }
    (model, losses)
}

/// MXFP8 with distributed Muon over `mesh` (small buckets: tile cuts inside matrices): either
/// steps `0..2`, a checkpoint in `dir` and an export to `file`, or a load of that checkpoint
/// and an export to `file`; then steps `2..4`.
fn resume(
    init: &Gpt<B>,
    mesh: Mesh,
    dir: &std::path::Path,
    file: &std::path::Path,
    load: bool,
) -> Vec<Resumed> {
    let world = mesh.world_size();
    let threads = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    ThreadsWorld::run(world, threads, |comm| {
        let device = Default::default();
        // 12 rows split evenly over 2, 3 and 4 ranks: the same global batch at every world.
        let at = (comm.rank(), 12 / world);
        let config = HsdpConfig::new(mesh)
            .with_format(RuntimeFormat::Mxfp8)
            .with_bucket_elements(6_000);
        let (mut model, runtime) = shard::<B, _, _>(init.clone(), config, comm, &device).unwrap();
        let mut muon =
            ShardedMuon::new(MuonConfig::new().init(), AdamWConfig::new().build(), device);
        if load {
            assert_eq!(checkpoint::load(dir, &runtime, &mut muon).unwrap(), 2);
        } else {
            model = muon_steps(model, 0..2, at, &mut muon, &runtime).0;
        }
        let masters = runtime
            .plan()
            .params()
            .iter()
            .map(|p| {
                let values = runtime.param_values(&p.spec.path).unwrap();
                values.iter().map(|x| x.to_bits()).collect()
            })
            .collect();
        if !load {
            checkpoint::save(dir, &runtime, &muon, 2).unwrap();
        }
        checkpoint::export_safetensors(&runtime, file).unwrap();
        let (_, losses) = muon_steps(model, 2..4, at, &mut muon, &runtime);
        Resumed {
            masters,
            losses,
            cut_inside_a_band: cut_inside_a_band(&runtime),
        }
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// Tile cuts inside matrices and checkpoints: saved at world 3, a checkpoint (masters, Muon
/// momentum, AdamW state) loads at world 2 and 4 with the masters bit for bit, training goes on
/// as the world-3 run does (up to reduction order), and the consolidated safetensors export is
/// the same file from every world size.
#[test]
fn mxfp8_checkpoints_reshard_across_tile_cuts() {
    let init = init();
    let tmp = std::env::temp_dir().join(format!("sshsdp-mx-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let (dir, saved) = (tmp.join("ckpt"), tmp.join("world3.safetensors"));
    let three = resume(&init, Mesh::flat(3).unwrap(), &dir, &saved, false);
    assert!(
        three[0].cut_inside_a_band,
        "world 3 cuts a matrix inside a band"
    );
    let mean = |runs: &[Resumed], i: usize| {
        runs.iter().map(|r| r.losses[i]).sum::<f32>() / runs.len() as f32
    };
    for world in [2, 4] {
        let file = tmp.join(format!("world{world}.safetensors"));
        let runs = resume(&init, Mesh::flat(world).unwrap(), &dir, &file, true);
        assert!(
            runs[0].cut_inside_a_band,
            "world {world} cuts a matrix inside a band"
        );
        assert_eq!(runs[0].masters, three[0].masters, "world {world}: masters");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            std::fs::read(&saved).unwrap(),
            "world {world}: the same export"
        );
        for i in 0..2 {
            let (got, want) = (mean(&runs, i), mean(&three, i));
            assert!(
                (got - want).abs() <= 1e-4 * want,
                "world {world} step {}: {got} vs {want}",
                2 + i
            );
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
