//! The main example: a GPT-style byte-level language model trained with SS-HSDP
//! (`Autodiff<Hsdp<Flex>>`, or `Autodiff<Hsdp<Wgpu>>` with `--backend wgpu`) on the public-domain corpus in `data/corpus.txt`.
//!
//! ```text
//! cargo run --release --example train_gpt -- [--ranks N | --mesh RxS] [--steps N]
//!     [--optim muon|adamw] [--format bf16|f32|mxfp8] [--save DIR] [--resume DIR] ...
//! cargo build --release --features mpi --example train_gpt
//! mpirun -n 2 target/release/examples/train_gpt            # one process per rank
//! ```
//! Defaults: 2 in-process ranks, distributed Muon on the hidden matrices and AdamW on
//! embeddings, norms, biases and the head, bf16 runtime parameters (fp32 masters), warm-up then
//! cosine decay, global gradient-norm clipping at 1. The last 10 % of the corpus is held out.
//! A progress bar shows the loss, tokens/s and memory; `runs/train_gpt/` receives
//! `metrics.csv` (one row per step), `loss.svg` and `loss.png` (the loss curve against the
//! corpus's byte unigram entropy, which is what a model that learned nothing about context
//! would reach) and `sample.txt` (text generated from `--prompt` after training). The run ends
//! with a one-screen summary (version, mesh, format, optimizer, losses, tokens/s, memory,
//! outputs) to paste into an issue. `--save` writes a sharded
//! checkpoint that `--resume` continues from at any rank count. `--backend wgpu` (build with
//! `--features wgpu`) trains on CubeCL's wgpu runtime with masters, optimizer state and
//! gradients on the device (`--storage host` keeps them on the host); collectives still go
//! through the host, and NCCL (GPUs) is not wired into this example yet.
//!
//! Backend: burn-flex. On this model at 2 ranks (bf16, Muon; width 128, 4 layers, context
//! 128, batch 16) `Hsdp<Flex>` (burn-flex 0.21 with SIMD) ran 1.59 s/step against 2.11 for
//! `Hsdp<NdArray>` (1.33×), at 1 rank 1.17 against 2.50 (2.1×), and at width 192 and 2 ranks
//! 2.27 against 2.97 (1.31×), although the decorator's zero-copy parameter views are specific
//! to NdArray. (Measured on a 2-core VM while other builds ran: absolute times are inflated.)
//! The model's GELU and softmax run `sshsdp::kernels`' vectorised fused ops on burn-flex
//! (+45–53 % tokens/s on top of that; docs/BENCHMARKS.md, "Against PyTorch").

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::process::ExitCode;

use burn::module::AutodiffModule;
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use common::{parse_args, parse_num, Args, Compute, Defaults, Eval, Job, Rng, Task, Train};
use sshsdp::models::{Gpt, GptConfig};

const USAGE: &str = "\
train_gpt: a byte-level GPT trained with SS-HSDP on data/corpus.txt

Usage: cargo run --release --example train_gpt -- [OPTIONS]

Model and data:
  --text FILE          training text (default data/corpus.txt; bytes are the tokens)
  --width D            model width (default 128)
  --layers N           decoder blocks (default 4)
  --heads N            attention heads (default 4)
  --seq N              context length (default 128)
  --batch N            sequences per global batch (default 16)
Sampling after training:
  --prompt TEXT        prompt (default \"The Lion \")
  --sample-len N       bytes to generate (default 400; 0 skips sampling)
  --temperature T      softmax temperature (default 0.8; 0 is greedy)
";

/// The training job: corpus, model shape, sampling options.
struct GptTask {
    config: GptConfig,
    batch: usize,
    train: Vec<u8>,
    held_out: Vec<u8>,
    entropy: f64,
    seed: u64,
    prompt: String,
    sample_len: usize,
    temperature: f64,
}

/// Byte unigram entropy of `text`, nats.
fn unigram_entropy(text: &[u8]) -> f64 {
    let mut counts = [0usize; 256];
    text.iter().for_each(|&b| counts[b as usize] += 1);
    let n = text.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

impl GptTask {
    /// `rows` windows of `seq + 1` bytes as a token tensor.
    fn tokens<K: Backend>(&self, windows: Vec<i64>, rows: usize) -> Tensor<K, 2, Int> {
        let width = self.config.seq + 1;
        Tensor::from_data(TensorData::new(windows, [rows, width]), &Default::default())
    }
}

impl Job for GptTask {
    fn name(&self) -> &str {
        "train_gpt"
    }

    fn global_batch(&self) -> usize {
        self.batch
    }

    fn items_per_step(&self) -> usize {
        self.batch * self.config.seq
    }

    fn baseline(&self) -> Option<(f64, String)> {
        Some((self.entropy, "byte unigram entropy".into()))
    }
}

impl<I: Compute> Task<I> for GptTask {
    type Model = Gpt<Train<I>>;

    fn init(&self, device: &I::Device) -> Gpt<Train<I>> {
        self.config.init(device)
    }

    fn train_loss(
        &self,
        model: &Gpt<Train<I>>,
        step: usize,
        rank: usize,
        world: usize,
    ) -> Tensor<Train<I>, 1> {
        // Every rank draws the same global batch (random windows of the training text) and
        // keeps its rows.
        let width = self.config.seq + 1;
        let mut rng = common::Rng::new(self.seed, step as u64);
        let starts: Vec<usize> = (0..self.batch)
            .map(|_| rng.below(self.train.len() - width))
            .collect();
        let rows = common::my_rows(self.batch, rank, world);
        let n = rows.len();
        let windows = starts[rows]
            .iter()
            .flat_map(|&s| self.train[s..s + width].iter().map(|&b| b as i64))
            .collect();
        model.loss(self.tokens(windows, n))
    }

    fn eval_loss(&self, model: &Gpt<Train<I>>, rank: usize, world: usize) -> f32 {
        // Fixed windows spread evenly over the held-out text.
        let width = self.config.seq + 1;
        let span = self.held_out.len() - width;
        let rows = common::my_rows(self.batch, rank, world);
        let n = rows.len();
        let windows = rows
            .flat_map(|r| {
                let s = r * span / self.batch.max(1);
                self.held_out[s..s + width].iter().map(|&b| b as i64)
            })
            .collect();
        model
            .valid()
            .loss(self.tokens::<Eval<I>>(windows, n))
            .into_scalar()
            .elem()
    }

    fn finish(
        &self,
        model: &Gpt<Train<I>>,
        rank: usize,
        out: &Path,
        broadcast: &mut dyn FnMut(&mut [f32]) -> Result<(), String>,
    ) -> Result<String, String> {
        if self.sample_len == 0 {
            return Ok(String::new());
        }
        // Every rank runs the same forward passes (they gather the sharded parameters); rank 0
        // draws each byte and broadcasts it.
        let model = model.valid();
        let mut text: Vec<u8> = self.prompt.bytes().collect();
        let mut rng = Rng::new(self.seed, u64::MAX);
        let context = model.max_seq();
        for _ in 0..self.sample_len {
            let window = &text[text.len().saturating_sub(context)..];
            let input: Vec<i64> = window.iter().map(|&b| b as i64).collect();
            let len = input.len();
            let input = Tensor::<Eval<I>, 2, Int>::from_data(
                TensorData::new(input, [1, len]),
                &Default::default(),
            );
            let logits = model
                .logits(input)
                .slice([0..1, len - 1..len])
                .flatten::<1>(0, 2);
            let mut next = [0f32];
            if rank == 0 {
                next[0] = if self.temperature <= 0.0 {
                    logits.argmax(0).into_scalar().elem::<f32>()
                } else {
                    let probs: Vec<f32> = softmax(logits / self.temperature, 0)
                        .into_data()
                        // In the compute dtype (`--compute`).
                        .convert::<f32>()
                        .to_vec()
                        .map_err(|e| format!("{e:?}"))?;
                    let mut u = rng.uniform() as f32;
                    let mut pick = probs.len() - 1;
                    for (i, p) in probs.iter().enumerate() {
                        if u < *p {
                            pick = i;
                            break;
                        }
                        u -= p;
                    }
                    pick as f32
                };
            }
            broadcast(&mut next)?;
            text.push(next[0] as u8);
        }
        let text = String::from_utf8_lossy(&text).into_owned();
        if rank == 0 {
            let path = out.join("sample.txt");
            std::fs::write(&path, &text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        Ok(text)
    }
}

fn setup() -> Result<Option<(GptTask, Args)>, String> {
    let mut text_path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/corpus.txt").to_string();
    let (mut width, mut layers, mut heads, mut seq, mut batch) = (128, 4, 4, 128, 16);
    let mut prompt = "The Lion ".to_string();
    let (mut sample_len, mut temperature) = (400, 0.8f64);
    let defaults = Defaults {
        steps: 400,
        lr: 4e-3,
        warmup: 20,
        eval_every: 50,
        out: "runs/train_gpt",
    };
    let args = parse_args(std::env::args().skip(1), &defaults, |flag, value| {
        match flag {
            "--text" => text_path = value()?,
            "--width" => width = parse_num(flag, &value()?)?,
            "--layers" => layers = parse_num(flag, &value()?)?,
            "--heads" => heads = parse_num(flag, &value()?)?,
            "--seq" => seq = parse_num(flag, &value()?)?,
            "--batch" => batch = parse_num(flag, &value()?)?,
            "--prompt" => prompt = value()?,
            "--sample-len" => sample_len = parse_num(flag, &value()?)?,
            "--temperature" => temperature = parse_num(flag, &value()?)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let Some(args) = args else {
        return Ok(None);
    };
    if width == 0 || heads == 0 || width % heads != 0 {
        return Err(format!("--width {width} does not split into {heads} heads"));
    }
    if layers == 0 || seq < 2 || batch == 0 {
        return Err("--layers, --batch must be at least 1 and --seq at least 2".into());
    }
    if temperature.is_nan() || temperature < 0.0 {
        return Err(format!("--temperature must be >= 0, not {temperature}"));
    }
    let text = std::fs::read(&text_path).map_err(|e| format!("reading {text_path}: {e}"))?;
    let split = text.len() * 9 / 10;
    if text.len() - split < 2 * (seq + 1) {
        return Err(format!(
            "{text_path} ({} bytes) is too short for a held-out tenth of {} bytes",
            text.len(),
            2 * (seq + 1)
        ));
    }
    let task = GptTask {
        config: GptConfig {
            vocab: 256,
            d_model: width,
            layers,
            heads,
            seq,
        },
        batch,
        entropy: unigram_entropy(&text[..split]),
        train: text[..split].to_vec(),
        held_out: text[split..].to_vec(),
        seed: args.seed,
        prompt,
        sample_len,
        temperature,
    };
    Ok(Some((task, args)))
}

fn main() -> ExitCode {
    common::main(
        USAGE,
        setup,
        |task: &GptTask| {
            println!(
                "corpus: {} training + {} held-out bytes; byte unigram entropy {:.3} nats",
                task.train.len(),
                task.held_out.len(),
                task.entropy
            )
        },
        |task, report| {
            if !report.finish.is_empty() {
                println!(
                    "--- sample (temperature {}) ---\n{}\n---",
                    task.temperature, report.finish
                );
            }
            let c = &task.config;
            let model = format!(
                "byte-level GPT, width {}, {} layers, {} heads, context {}, batch {}",
                c.d_model, c.layers, c.heads, c.seq, task.batch
            );
            common::print_summary("train_gpt", &model, report, task.baseline().as_ref());
        },
    )
}

#[cfg(test)]
mod tests;
