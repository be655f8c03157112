//! A video-diffusion-style transformer (DiT) trained with SS-HSDP on synthetic clips.
//!
//! ```text
//! cargo run --release --example train_dit -- [--ranks N | --mesh RxS] [--steps N]
//!     [--optim muon|adamw] [--format bf16|f32|mxfp8] [--save DIR] [--resume DIR] ...
//! ```
//! Each clip is 8 frames of 16×16 grey pixels in `[-1, 1]`: one or two Gaussian blobs moving
//! and bouncing off the edges, or a drifting sinusoidal grating, with random sizes, speeds,
//! frequencies and phases, generated on the fly (every rank draws the same global batch from
//! the step's seed and keeps its rows). Frames are cut into 4×4 patches: 8 × 16 = 128
//! spatio-temporal tokens per clip under full attention. The model ([`sshsdp::models::Dit`])
//! predicts the noise added at a random diffusion time under a cosine schedule, conditioned on
//! the time through adaLN-Zero; the loss is the mean squared error of that prediction (1.0 for
//! a model that predicts nothing). The held-out loss uses fixed clips, times and noise, so its
//! curve is free of sampling noise. After training, DDIM draws two clips from noise; they are
//! printed as ASCII frames and written with two training clips to `samples.pgm`.
//! `runs/train_dit/` also receives `metrics.csv`, `loss.svg` and `loss.png`. Same engine, optimizer,
//! format and checkpoint options as `train_gpt`.

mod common;

use std::path::Path;
use std::process::ExitCode;

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use common::{parse_args, parse_num, Args, Compute, Defaults, Eval, Job, Rng, Task, Train};
use sshsdp::models::{Dit, DitConfig};

const USAGE: &str = "\
train_dit: a diffusion transformer trained with SS-HSDP on synthetic video clips

Usage: cargo run --release --example train_dit -- [OPTIONS]

Model and data:
  --width D            model width (default 128)
  --layers N           DiT blocks (default 4)
  --heads N            attention heads (default 4)
  --batch N            clips per global batch (default 8)
  --sample-steps N     DDIM steps when sampling after training (default 25; 0 skips it)
";

/// Clip geometry: 8 frames of 16×16, one channel, 4×4 patches.
const FRAMES: usize = 8;
const SIDE: usize = 16;
const PATCH: usize = 4;

/// Held-out clips (fixed).
const HELD_OUT: usize = 16;

/// The training job.
struct DitTask {
    config: DitConfig,
    batch: usize,
    seed: u64,
    sample_steps: usize,
}

/// One synthetic clip `[frames][SIDE][SIDE]` in `[-1, 1]`.
fn clip(rng: &mut Rng) -> Vec<f32> {
    let mut pixels = vec![0f32; FRAMES * SIDE * SIDE];
    let side = SIDE as f64;
    if rng.uniform() < 0.5 {
        // Gaussian blobs with constant velocity, bouncing off the edges.
        let blobs = 1 + rng.below(2);
        for _ in 0..blobs {
            let sigma = 1.2 + 1.3 * rng.uniform();
            let (mut x, mut y) = (
                2.0 + (side - 4.0) * rng.uniform(),
                2.0 + (side - 4.0) * rng.uniform(),
            );
            let (mut vx, mut vy) = (3.0 * rng.uniform() - 1.5, 3.0 * rng.uniform() - 1.5);
            for f in 0..FRAMES {
                for py in 0..SIDE {
                    for px in 0..SIDE {
                        let d2 = (px as f64 - x).powi(2) + (py as f64 - y).powi(2);
                        pixels[(f * SIDE + py) * SIDE + px] +=
                            (-d2 / (2.0 * sigma * sigma)).exp() as f32;
                    }
                }
                (x, y) = (x + vx, y + vy);
                if !(0.0..=side - 1.0).contains(&x) {
                    vx = -vx;
                    x = x.clamp(0.0, side - 1.0);
                }
                if !(0.0..=side - 1.0).contains(&y) {
                    vy = -vy;
                    y = y.clamp(0.0, side - 1.0);
                }
            }
        }
    } else {
        // A drifting grating: wave vector, temporal frequency and phase at random.
        let angle = std::f64::consts::PI * rng.uniform();
        let k = 0.4 + 0.8 * rng.uniform();
        let (kx, ky) = (k * angle.cos(), k * angle.sin());
        let omega = 1.2 * rng.uniform() - 0.6;
        let phase = 2.0 * std::f64::consts::PI * rng.uniform();
        for f in 0..FRAMES {
            for py in 0..SIDE {
                for px in 0..SIDE {
                    let v = kx * px as f64 + ky * py as f64 - omega * f as f64 + phase;
                    pixels[(f * SIDE + py) * SIDE + px] = (0.5 + 0.5 * v.sin()) as f32;
                }
            }
        }
    }
    pixels.iter().map(|p| 2.0 * p.min(1.0) - 1.0).collect()
}

impl DitTask {
    /// Clean tokens, times and noise of `clips` clips drawn from `rng`, as tensors.
    fn batch_tensors<K: Backend>(
        &self,
        rng: &mut Rng,
        clips: usize,
        t_of: impl Fn(usize, &mut Rng) -> f64,
    ) -> (Tensor<K, 3>, Tensor<K, 1>, Tensor<K, 3>) {
        let (n, pd) = (self.config.tokens(), self.config.patch_dim());
        let raw: Vec<f32> = (0..clips).flat_map(|_| clip(rng)).collect();
        let times: Vec<f32> = (0..clips).map(|i| t_of(i, rng) as f32).collect();
        let noise: Vec<f32> = (0..clips * n * pd).map(|_| rng.normal() as f32).collect();
        let device = Default::default();
        (
            Tensor::from_data(
                TensorData::new(self.config.patchify(&raw), [clips, n, pd]),
                &device,
            ),
            Tensor::from_data(TensorData::new(times, [clips]), &device),
            Tensor::from_data(TensorData::new(noise, [clips, n, pd]), &device),
        )
    }

    /// This rank's rows of a global batch of `global` clips drawn from `rng`: every rank
    /// draws all of them (cheap) and keeps its own, so the global batch is the same at any
    /// world size.
    fn rows<K: Backend>(
        &self,
        rng: &mut Rng,
        global: usize,
        rank: usize,
        world: usize,
        t_of: impl Fn(usize, &mut Rng) -> f64 + Copy,
    ) -> (Tensor<K, 3>, Tensor<K, 1>, Tensor<K, 3>) {
        let mine = common::my_rows(global, rank, world);
        let mut keep = None;
        for r in 0..world {
            let rows = common::my_rows(global, r, world);
            let offset = rows.start;
            let tensors = self.batch_tensors(rng, rows.len(), move |i, g| t_of(offset + i, g));
            if rows == mine {
                keep = Some(tensors);
            }
        }
        keep.expect("every rank has rows")
    }
}

impl Job for DitTask {
    fn name(&self) -> &str {
        "train_dit"
    }

    fn global_batch(&self) -> usize {
        self.batch
    }

    fn items_per_step(&self) -> usize {
        self.batch * self.config.tokens()
    }

    fn baseline(&self) -> Option<(f64, String)> {
        Some((1.0, "predicting no noise".into()))
    }
}

impl<I: Compute> Task<I> for DitTask {
    type Model = Dit<Train<I>>;

    fn init(&self, device: &I::Device) -> Dit<Train<I>> {
        self.config.init(device)
    }

    fn train_loss(
        &self,
        model: &Dit<Train<I>>,
        step: usize,
        rank: usize,
        world: usize,
    ) -> Tensor<Train<I>, 1> {
        let mut rng = Rng::new(self.seed, step as u64);
        let (x0, t, noise) =
            self.rows::<Train<I>>(&mut rng, self.batch, rank, world, |_, g| g.uniform());
        model.loss(x0, t, noise)
    }

    fn eval_loss(&self, model: &Dit<Train<I>>, rank: usize, world: usize) -> f32 {
        // Fixed clips, noise and times spread evenly over (0, 1).
        let mut rng = Rng::new(self.seed ^ 0x5eed, u64::MAX);
        let held = HELD_OUT.max(world) / world * world;
        let (x0, t, noise) = self.rows::<Eval<I>>(&mut rng, held, rank, world, move |i, _| {
            (i as f64 + 0.5) / held as f64
        });
        model.valid().loss(x0, t, noise).into_scalar().elem()
    }

    fn finish(
        &self,
        model: &Dit<Train<I>>,
        rank: usize,
        out: &Path,
        _broadcast: &mut dyn FnMut(&mut [f32]) -> Result<(), String>,
    ) -> Result<String, String> {
        if self.sample_steps == 0 {
            return Ok(String::new());
        }
        // Every rank samples the same clips from the same noise (the forward passes gather
        // the sharded parameters).
        let model = model.valid();
        let (n, pd) = (self.config.tokens(), self.config.patch_dim());
        let mut rng = Rng::new(self.seed, u64::MAX - 1);
        let noise: Vec<f32> = (0..2 * n * pd).map(|_| rng.normal() as f32).collect();
        let noise = Tensor::<Eval<I>, 3>::from_data(
            TensorData::new(noise, [2, n, pd]),
            &Default::default(),
        );
        let tokens: Vec<f32> = model
            .sample(noise, self.sample_steps)
            .into_data()
            .to_vec()
            .map_err(|e| format!("{e:?}"))?;
        let samples = self.config.unpatchify(&tokens);
        if rank != 0 {
            return Ok(String::new());
        }
        let mut real_rng = Rng::new(self.seed, u64::MAX - 2);
        let real: Vec<f32> = (0..2).flat_map(|_| clip(&mut real_rng)).collect();
        let path = out.join("samples.pgm");
        write_pgm(&path, &[&samples, &real])
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        let mut text = format!(
            "two clips sampled with {} DDIM steps (frames 0, 2, 4, 6; rows: sampled, sampled, \
             then two training clips in {}):\n",
            self.sample_steps,
            path.display()
        );
        for c in 0..2 {
            text.push_str(&ascii_frames(
                &samples[c * FRAMES * SIDE * SIDE..][..FRAMES * SIDE * SIDE],
            ));
            text.push('\n');
        }
        Ok(text)
    }
}

/// Frames 0, 2, 4, 6 of one clip side by side in ASCII shades.
fn ascii_frames(clip: &[f32]) -> String {
    const SHADES: &[u8] = b" .:-=+*#%@";
    let mut s = String::new();
    for y in 0..SIDE {
        for f in (0..FRAMES).step_by(2) {
            for x in 0..SIDE {
                let v = (clip[(f * SIDE + y) * SIDE + x] + 1.0) / 2.0;
                let i = (v.clamp(0.0, 1.0) * (SHADES.len() - 1) as f32).round() as usize;
                s.push(SHADES[i] as char);
            }
            s.push_str("  ");
        }
        s.push('\n');
    }
    s
}

/// Writes clips as a binary PGM: one row of frames per clip, 4× enlarged, 2-pixel gaps.
fn write_pgm(path: &Path, groups: &[&[f32]]) -> std::io::Result<()> {
    let (scale, gap) = (4, 2);
    let cell = SIDE * scale + gap;
    let clips: Vec<&[f32]> = groups
        .iter()
        .flat_map(|g| g.chunks(FRAMES * SIDE * SIDE))
        .collect();
    let (w, h) = (FRAMES * cell + gap, clips.len() * cell + gap);
    let mut img = vec![255u8; w * h];
    for (row, clip) in clips.iter().enumerate() {
        for f in 0..FRAMES {
            for y in 0..SIDE * scale {
                for x in 0..SIDE * scale {
                    let v = clip[(f * SIDE + y / scale) * SIDE + x / scale];
                    let byte = ((v + 1.0) / 2.0 * 255.0).clamp(0.0, 255.0) as u8;
                    img[(gap + row * cell + y) * w + gap + f * cell + x] = byte;
                }
            }
        }
    }
    let mut bytes = format!("P5\n{w} {h}\n255\n").into_bytes();
    bytes.extend(img);
    std::fs::write(path, bytes)
}

fn setup() -> Result<Option<(DitTask, Args)>, String> {
    let (mut width, mut layers, mut heads, mut batch, mut sample_steps) = (128, 4, 4, 8, 25);
    let defaults = Defaults {
        steps: 250,
        lr: 2e-3,
        warmup: 20,
        eval_every: 25,
        out: "runs/train_dit",
    };
    let args = parse_args(std::env::args().skip(1), &defaults, |flag, value| {
        match flag {
            "--width" => width = parse_num(flag, &value()?)?,
            "--layers" => layers = parse_num(flag, &value()?)?,
            "--heads" => heads = parse_num(flag, &value()?)?,
            "--batch" => batch = parse_num(flag, &value()?)?,
            "--sample-steps" => sample_steps = parse_num(flag, &value()?)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let Some(args) = args else {
        return Ok(None);
    };
    if layers == 0 || batch == 0 {
        return Err("--layers and --batch must be at least 1".into());
    }
    let config = DitConfig {
        frames: FRAMES,
        channels: 1,
        height: SIDE,
        width: SIDE,
        patch: PATCH,
        d_model: width,
        layers,
        heads,
    };
    config.validate()?;
    let task = DitTask {
        config,
        batch,
        seed: args.seed,
        sample_steps,
    };
    Ok(Some((task, args)))
}

fn main() -> ExitCode {
    common::main(
        USAGE,
        setup,
        |task: &DitTask| {
            println!(
                "clips: {FRAMES} frames of {SIDE}x{SIDE}, {PATCH}x{PATCH} patches: {} tokens of {} values",
                task.config.tokens(),
                task.config.patch_dim()
            )
        },
        |task, report| {
            if !report.finish.is_empty() {
                println!("{}", report.finish);
            }
            let c = &task.config;
            let model = format!(
                "DiT, width {}, {} layers, {} heads, {} tokens per clip, batch {}",
                c.d_model,
                c.layers,
                c.heads,
                c.tokens(),
                task.batch
            );
            common::print_summary("train_dit", &model, report, task.baseline().as_ref());
        },
    )
}
