//! `train_gpt`'s smoke tests: a tiny model for a few steps, checkpointed and resumed (run by
//! `cargo test`).

use super::*;

/// A tiny model on a slice of the corpus.
fn tiny_task() -> GptTask {
    let text: Vec<u8> = include_bytes!("../../data/corpus.txt")[..4000].to_vec();
    GptTask {
        config: GptConfig {
            vocab: 256,
            d_model: 32,
            layers: 1,
            heads: 2,
            seq: 16,
        },
        batch: 4,
        entropy: unigram_entropy(&text[..3600]),
        train: text[..3600].to_vec(),
        held_out: text[3600..].to_vec(),
        seed: 7,
        prompt: "The ".into(),
        sample_len: 8,
        temperature: 0.8,
    }
}

/// The tests' defaults (what `main` would take from the example).
fn tiny_defaults() -> Defaults {
    Defaults {
        steps: 1,
        lr: 3e-3,
        warmup: 1,
        eval_every: 0,
        out: "unused",
    }
}

/// 3 steps with `first` flags and a checkpoint, resumed for 3 more with `second` flags;
/// metrics, plot and sample land in the output directory.
fn save_and_resume(tag: &str, first: &[&str], second: &[&str]) {
    let dir = std::env::temp_dir().join(format!("train_gpt_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let task = tiny_task();
    let flags = |extra: &[&str]| {
        let mut v: Vec<String> = ["--steps", "3", "--eval-every", "2", "--out"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.push(dir.join("out").display().to_string());
        v.extend(extra.iter().map(|s| s.to_string()));
        parse_args(v, &tiny_defaults(), |_, _| Ok(false))
            .unwrap()
            .unwrap()
    };
    let ckpt = dir.join("ckpt").display().to_string();
    let first = [first, &["--save", &ckpt]].concat();
    let first = common::run(&task, &flags(&first)).unwrap().unwrap();
    assert_eq!(first.steps, 3);
    assert!(first.final_loss.is_finite());
    assert!(first.finish.starts_with("The "), "{}", first.finish);
    let second = [second, &["--resume", &ckpt]].concat();
    let second = common::run(&task, &flags(&second)).unwrap().unwrap();
    assert_eq!(second.first_step, 3);
    assert!(second.final_loss.is_finite());
    let csv = std::fs::read_to_string(dir.join("out/metrics.csv")).unwrap();
    assert_eq!(
        csv.lines().count(),
        1 + 3 + 3,
        "header and one row per step"
    );
    let svg = std::fs::read_to_string(dir.join("out/loss.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
    let png = std::fs::read(dir.join("out/loss.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000);
    assert!(dir.join("out/sample.txt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The whole pipeline: 3 steps on 2 ranks with a checkpoint, resumed on 1 rank.
#[test]
fn trains_saves_and_resumes_at_another_world_size() {
    save_and_resume("smoke", &["--ranks", "2"], &["--ranks", "1"]);
}

/// bf16 compute and bf16 gradient reduction, saved at 2 ranks and resumed in f32 at 1: a
/// checkpoint holds fp32 masters whatever the compute dtype.
#[test]
fn trains_in_bf16_and_resumes_in_f32() {
    save_and_resume(
        "bf16",
        &["--ranks", "2", "--compute", "bf16", "--reduce", "bf16"],
        &["--ranks", "1"],
    );
}

/// `--backend wgpu` with device storage (MXFP8), saved at 2 ranks and resumed on burn-flex
/// at 1 rank: a checkpoint does not depend on the backend it was written from.
#[cfg(feature = "wgpu")]
#[test]
fn trains_on_wgpu_and_resumes_on_flex() {
    save_and_resume(
        "wgpu",
        &["--ranks", "2", "--backend", "wgpu", "--format", "mxfp8"],
        &["--ranks", "1", "--backend", "flex", "--format", "mxfp8"],
    );
}

/// `--backend wgpu` (Burn's default `Wgpu`: fusion and autotune) and `--backend wgpu
/// --no-fusion` (`CubeBackend`) train alike: losses within 2e-3 relative (bf16 runtime; see
/// `tests/wgpu_backend/fusion.rs` for the tolerances).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_with_and_without_fusion_train_alike() {
    let dir = std::env::temp_dir().join(format!("train_gpt_fusion_{}", std::process::id()));
    let task = tiny_task();
    let run = |extra: &[&str]| {
        let out = dir.join("out").display().to_string();
        let mut v = vec![
            "--ranks",
            "2",
            "--backend",
            "wgpu",
            "--steps",
            "3",
            "--out",
            &out,
        ];
        v.extend_from_slice(extra);
        let args = parse_args(v.iter().map(|s| s.to_string()), &tiny_defaults(), |_, _| {
            Ok(false)
        });
        let args = args.unwrap().unwrap();
        assert_eq!(args.no_fusion, !extra.is_empty());
        common::run(&task, &args).unwrap().unwrap()
    };
    let fused = run(&[]);
    let unfused = run(&["--no-fusion"]);
    // The two ranks share the wgpu device: their collectives ran on its buffers.
    assert!(fused.collectives_on_device && unfused.collectives_on_device);
    for (a, b) in [
        (fused.first_loss, unfused.first_loss),
        (fused.last_loss, unfused.last_loss),
    ] {
        assert!((a - b).abs() <= 2e-3 * b.abs(), "fused {a} vs unfused {b}");
    }
    assert!(fused.last_loss < fused.first_loss);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--nccl` where NCCL or a GPU is missing (CI, this machine): an error naming `--nccl`
/// and the reason, on every rank, before any training — not a panic or a hang.
#[cfg(feature = "nccl")]
#[test]
fn nccl_without_a_gpu_is_a_clear_error() {
    if sshsdp::comm::nccl::is_available() {
        return; // a GPU machine: h200.sh runs --nccl for real
    }
    let dir = std::env::temp_dir().join(format!("train_gpt_nccl_{}", std::process::id()));
    let task = tiny_task();
    let out = dir.join("out").display().to_string();
    let args = ["--ranks", "2", "--nccl", "--steps", "1", "--out", &out];
    let args = parse_args(
        args.iter().map(|s| s.to_string()),
        &tiny_defaults(),
        |_, _| Ok(false),
    )
    .unwrap()
    .unwrap();
    let e = common::run(&task, &args).unwrap_err();
    assert!(e.contains("--nccl") && e.contains("unavailable"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Trained weights exported from 2 ranks start a 1-rank run (`--init-from`): its first
/// loss, on the first run's first batch, is the trained model's, below the untrained one;
/// and the file it exports in turn opens as a safetensors file of every parameter.
#[test]
fn exports_weights_and_starts_from_them_at_another_world_size() {
    let dir = std::env::temp_dir().join(format!("train_gpt_export_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let task = tiny_task();
    let defaults = tiny_defaults();
    let out = dir.join("out").display().to_string();
    let run = |extra: &[&str]| {
        let v = [&["--eval-every", "0", "--out", &out], extra].concat();
        let args = parse_args(v.iter().map(|s| s.to_string()), &defaults, |_, _| Ok(false));
        common::run(&task, &args.unwrap().unwrap())
            .unwrap()
            .unwrap()
    };
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let (a_s, b_s) = (a.display().to_string(), b.display().to_string());
    let trained = run(&["--ranks", "2", "--steps", "4", "--export", &a_s]);
    let resumed = run(&[
        "--ranks",
        "1",
        "--steps",
        "1",
        "--init-from",
        &a_s,
        "--export",
        &b_s,
    ]);
    assert!(
        resumed.first_loss < trained.first_loss - 0.05,
        "imported weights: {} vs untrained {}",
        resumed.first_loss,
        trained.first_loss
    );
    let source = sshsdp::checkpoint::SafetensorsSource::open(&b).unwrap();
    let model = common::Task::<common::Flex>::init(&task, &Default::default());
    let params = sshsdp::backend::param_shapes(&model);
    assert_eq!(source.names().count(), params.len());
    assert!(parse_args(
        ["--init-from", "x", "--resume", "y"]
            .iter()
            .map(|s| s.to_string()),
        &defaults,
        |_, _| Ok(false)
    )
    .is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--unsharded` (plain Burn, the step-time baseline) trains the very model a 1-rank
/// sharded run trains: same initial weights, data, schedule and AdamW, so with f32 runtime
/// parameters and no clipping the losses agree step for step.
#[test]
fn unsharded_baseline_trains_what_one_sharded_rank_trains() {
    // Other tests of this binary seed and draw in parallel: one that never stops draws here.
    let drawer = sshsdp::backend::ConcurrentDrawer::start::<common::Flex>();
    let dir = std::env::temp_dir().join(format!("train_gpt_plain_{}", std::process::id()));
    let task = tiny_task();
    let out = dir.join("out").display().to_string();
    let flags = |extra: &[&str]| {
        let v = [
            &["--optim", "adamw", "--steps", "3", "--eval-every", "0"][..],
            &["--out", &out],
            extra,
        ]
        .concat();
        parse_args(v.iter().map(|s| s.to_string()), &tiny_defaults(), |_, _| {
            Ok(false)
        })
        .unwrap()
        .unwrap()
    };
    let plain =
        common::train_unsharded::<common::Flex, _>(&task, &flags(&["--unsharded"])).unwrap();
    let sharded = flags(&["--ranks", "1", "--format", "f32", "--clip", "0"]);
    let sharded = common::run(&task, &sharded).unwrap().unwrap();
    assert_eq!(plain.len(), 3);
    for (what, a, b) in [
        ("first", plain[0], sharded.first_loss),
        ("last", plain[2], sharded.last_loss),
    ] {
        assert!(
            (a - b).abs() <= 1e-5,
            "{what} loss: unsharded {a} vs sharded {b}"
        );
    }
    assert!(plain[2] < plain[0], "it trains: {plain:?}");
    assert!(drawer.draws() > 0, "the drawer ran alongside");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_errors() {
    let defaults = Defaults {
        steps: 1,
        lr: 1e-3,
        warmup: 0,
        eval_every: 0,
        out: "x",
    };
    let parse =
        |v: &[&str]| parse_args(v.iter().map(|s| s.to_string()), &defaults, |_, _| Ok(false));
    assert!(parse(&["--ranks", "0"]).is_err());
    assert!(parse(&["--mesh", "2by2"]).is_err());
    assert!(parse(&["--ranks", "3", "--mesh", "2x2"]).is_err());
    assert!(parse(&["--format", "fp4"]).is_err());
    assert!(parse(&["--steps"]).is_err());
    assert!(parse(&["--bogus"]).is_err());
    assert!(parse(&["--backend", "tpu"]).is_err());
    assert!(parse(&["--storage", "disk"]).is_err());
    assert!(parse(&["--compute", "fp8"]).is_err());
    // f16 is a compute dtype only.
    assert!(parse(&["--reduce", "f16"]).is_err());
    let args = parse(&["--compute", "bf16", "--reduce", "bf16"])
        .unwrap()
        .unwrap();
    use sshsdp::backend::{MixedPrecision, Precision::Bf16};
    assert_eq!(args.precision, MixedPrecision::new(Bf16, Bf16));
    // Collectives on device memory where the engine can, unless --staged.
    assert!(!args.staged);
    assert!(parse(&["--staged"]).unwrap().unwrap().staged);
    // Without the feature, wgpu is an error naming it; with it, device storage by default.
    let wgpu = parse(&["--backend", "wgpu"]);
    if cfg!(feature = "wgpu") {
        let args = wgpu.unwrap().unwrap();
        assert_eq!(args.storage, sshsdp::backend::Placement::Device);
    } else {
        let e = wgpu.unwrap_err();
        assert!(e.contains("--features wgpu"), "{e}");
    }
    // `--nccl` names its feature when it is missing.
    let nccl = parse(&["--nccl"]);
    if cfg!(feature = "nccl") {
        assert!(nccl.unwrap().unwrap().nccl);
    } else {
        let e = nccl.unwrap_err();
        assert!(e.contains("`nccl` feature"), "{e}");
    }
    // `--unsharded` is one rank on Burn's AdamW in f32, and says what to drop.
    assert!(
        parse(&["--unsharded", "--optim", "adamw"])
            .unwrap()
            .unwrap()
            .unsharded
    );
    for bad in [
        &["--unsharded"][..],
        &["--unsharded", "--optim", "adamw", "--ranks", "2"],
        &["--unsharded", "--optim", "adamw", "--compute", "bf16"],
        &["--unsharded", "--optim", "adamw", "--save", "x"],
    ] {
        let e = parse(bad).unwrap_err();
        assert!(e.starts_with("--unsharded"), "{bad:?}: {e}");
    }
    assert!(parse(&["--help"]).unwrap().is_none());
    let args = parse(&["--mesh", "2x2", "--format", "f32", "--clip", "0"])
        .unwrap()
        .unwrap();
    assert_eq!(args.mesh.unwrap().world_size(), 4);
    assert_eq!(args.clip, None);
}
