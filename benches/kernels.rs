//! The fused ops of `sshsdp::kernels` against Burn's own, on burn-flex under
//! `Autodiff<Hsdp<Flex>>` (the examples' training backend): GELU and the last-dimension
//! softmax, forward alone and forward + backward, at the shapes one rank of `train_gpt --ranks
//! 2` meets (the MLP's `[8, 128, 512]` activations; the attention scores `[8, 4, 128, 128]`,
//! with the causal mask's −1e4 above the diagonal).
//!
//! Run with `cargo bench --bench kernels`. Each figure is the median of several repetitions;
//! "×" is Burn's time over the fused op's, and GB/s counts the f32 input bytes read once.

use std::hint::black_box;
use std::time::Duration;

mod common;

use burn::backend::Autodiff;
use burn::tensor::{activation, Distribution, Tensor};
use burn_flex::Flex;
use sshsdp::backend::Hsdp;
use sshsdp::kernels;

/// The examples' training backend.
type Train = Autodiff<Hsdp<Flex>>;

const REPS: usize = 15;

/// Median wall time of `REPS` runs of `f` (after one warm-up run).
fn median(f: impl FnMut()) -> Duration {
    common::median_time(REPS, f)
}

/// Time of `op` on `x`, forward only (`backward: false`) or forward and backward of
/// `Σ op(x)·w`.
fn time(
    x: &Tensor<Train, 4>,
    w: &Tensor<Train, 4>,
    backward: bool,
    op: impl Fn(Tensor<Train, 4>) -> Tensor<Train, 4>,
) -> Duration {
    median(|| {
        let x = x.clone().require_grad();
        let y = op(x.clone());
        if backward {
            let grads = (y * w.clone()).sum().backward();
            black_box(x.grad(&grads));
        } else {
            black_box(y.into_primitive());
        }
    })
}

fn row(
    name: &str,
    x: &Tensor<Train, 4>,
    fused: impl Fn(Tensor<Train, 4>) -> Tensor<Train, 4>,
    burn: impl Fn(Tensor<Train, 4>) -> Tensor<Train, 4>,
) {
    let device = Default::default();
    let w = Tensor::<Train, 4>::random(x.dims(), Distribution::Normal(0.0, 1.0), &device);
    let bytes = x.shape().num_elements() as f64 * 4.0;
    for backward in [false, true] {
        let t_fused = time(x, &w, backward, &fused);
        let t_burn = time(x, &w, backward, &burn);
        println!(
            "| {name} | {:?} | {} | {:.3} | {:.3} | {:.1} | {:.2}× |",
            x.dims(),
            if backward {
                "forward + backward"
            } else {
                "forward"
            },
            t_burn.as_secs_f64() * 1e3,
            t_fused.as_secs_f64() * 1e3,
            bytes / t_fused.as_secs_f64() / 1e9,
            t_burn.as_secs_f64() / t_fused.as_secs_f64(),
        );
    }
}

/// A host kernel writing its output slice.
type Kernel<'a> = dyn Fn(&mut [f32]) + 'a;

/// The host kernels on slices against a `copy_from_slice` of the same bytes.
fn raw_rows() {
    let n = 8 * 128 * 512;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
        .collect();
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 104_729) % 997) as f32 / 997.0)
        .collect();
    let mut out = vec![0.0f32; n];
    let copy = median(|| out.copy_from_slice(black_box(&x)));
    let kernels: [(&str, &Kernel); 4] = [
        ("gelu", &|o| kernels::host::gelu(&x, o)),
        ("gelu_backward", &|o| {
            kernels::host::gelu_backward(&x, &g, o)
        }),
        ("softmax_rows (128)", &|o| {
            kernels::host::softmax_rows(&x, 128, o)
        }),
        ("softmax_rows_backward (128)", &|o| {
            kernels::host::softmax_rows_backward(&x, &g, 128, o)
        }),
    ];
    println!("\nHost kernels on {n} f32 (one thread), against `copy_from_slice` of the input: {:.2} ms, {:.1} GB/s.\n", copy.as_secs_f64() * 1e3, n as f64 * 4.0 / copy.as_secs_f64() / 1e9);
    println!("| kernel | ms | ns / element | GB/s (input read once) | time / copy |");
    println!("|---|---|---|---|---|");
    for (name, kernel) in kernels {
        let t = median(|| kernel(black_box(&mut out)));
        println!(
            "| {name} | {:.3} | {:.2} | {:.1} | {:.2} |",
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() * 1e9 / n as f64,
            n as f64 * 4.0 / t.as_secs_f64() / 1e9,
            t.as_secs_f64() / copy.as_secs_f64()
        );
    }
}

fn main() {
    let ticks = common::cpu_ticks();
    let device = Default::default();
    println!(
        "Fused ops (`sshsdp::kernels`) against Burn's on `Autodiff<Hsdp<Flex>>`, one thread.\n"
    );
    println!("| op | shape | pass | Burn ms | fused ms | fused GB/s | × |");
    println!("|---|---|---|---|---|---|---|");

    let mlp = Tensor::<Train, 4>::random([8, 1, 128, 512], Distribution::Normal(0.0, 1.0), &device);
    row("GELU", &mlp, kernels::gelu, activation::gelu);

    let scores =
        Tensor::<Train, 4>::random([8, 4, 128, 128], Distribution::Normal(0.0, 2.0), &device);
    let above = Tensor::<Train, 2, burn::tensor::Bool>::tril_mask([128, 128], 0, &device);
    let scores = scores.mask_fill(above.unsqueeze::<4>(), -1e4);
    row("softmax (last dim)", &scores, kernels::softmax, |x| {
        activation::softmax(x, 3)
    });
    raw_rows();
    println!("\nMeanwhile {}.", common::others_share(ticks));
}
