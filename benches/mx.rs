//! MXFP8 codec throughput: row-plane, column-plane and tiled encode, and decode, of a
//! 4096 x 4096 tensor (f32 and bf16 input), on one thread and on all cores, next to a
//! `copy_from_slice` of the same input bytes with the same thread count.
//!
//! Run with `cargo bench --bench mx`. GB/s counts the input tensor bytes (f32: 4 B/elem,
//! bf16: 2 B/elem; for decode, the f32 bytes written); each figure is the median of several
//! repetitions.

use half::bf16;
use sshsdp::mx::par::{
    decode_rows_par, decode_tiled_par, encode_cols_par, encode_rows_par, encode_tiled_par,
};
use sshsdp::mx::{ElemFormat, MxInput, MxShape, Plane, ScaleRule};
use std::hint::black_box;
use std::time::Duration;

mod common;

const ROWS: usize = 4096;
const COLS: usize = 4096;
const REPS: usize = 9;

/// Median wall time of `REPS` runs of `f` (after one warm-up run).
fn median(f: impl FnMut()) -> Duration {
    common::median_time(REPS, f)
}

/// `dst.copy_from_slice(src)` split over `threads` threads.
fn par_copy<T: Copy + Send + Sync>(src: &[T], dst: &mut [T], threads: usize) {
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, x) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(x));
        }
    });
}

/// Deterministic pseudo-Gaussian input (sum of uniforms), scaled per row.
fn input() -> Vec<f32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..ROWS * COLS)
        .map(|i| {
            let g = next() + next() + next() + next() - 2.0;
            g * (1 + i / COLS % 7) as f32
        })
        .collect()
}

/// Output buffers of every layout.
struct Bufs {
    rd: Vec<u8>,
    rs: Vec<u8>,
    cd: Vec<u8>,
    cs: Vec<u8>,
    tl: Vec<u8>,
    out: Vec<f32>,
}

/// One table row.
fn row(op: &str, input: &str, threads: usize, t: Duration, bytes: usize, memcpy_gbs: f64) {
    let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
    println!(
        "{op:<14} {input:<5} {threads:>7} {:>9.2} {gbs:>8.2} {memcpy_gbs:>10.2} {:>7.2}",
        t.as_secs_f64() * 1e3,
        gbs / memcpy_gbs
    );
}

/// Benchmarks every operation for one input type and thread count.
fn bench<T: MxInput + Default>(x: &[T], name: &str, threads: usize, b: &mut Bufs) {
    let s = MxShape::new(ROWS, COLS);
    let (f, r) = (ElemFormat::E4M3, ScaleRule::Rceil);
    let in_bytes = std::mem::size_of_val(x);
    let mut dst = vec![T::default(); x.len()];
    let t = median(|| par_copy(black_box(x), &mut dst, threads));
    black_box(&dst);
    let memcpy = in_bytes as f64 / t.as_secs_f64() / 1e9;
    row("memcpy", name, threads, t, in_bytes, memcpy);
    let t = median(|| {
        encode_rows_par(black_box(x), s, f, r, &mut b.rd, &mut b.rs, threads).unwrap();
        black_box(&b.rd);
    });
    row("encode rows", name, threads, t, in_bytes, memcpy);
    let t = median(|| {
        encode_cols_par(black_box(x), s, f, r, &mut b.cd, &mut b.cs, threads).unwrap();
        black_box(&b.cd);
    });
    row("encode cols", name, threads, t, in_bytes, memcpy);
    let t = median(|| {
        encode_tiled_par(black_box(x), s, f, r, &mut b.tl, threads).unwrap();
        black_box(&b.tl);
    });
    row("encode tiled", name, threads, t, in_bytes, memcpy);
    if name == "f32" {
        let t = median(|| {
            decode_rows_par(black_box(&b.rd), &b.rs, s, f, &mut b.out, threads).unwrap();
            black_box(&b.out);
        });
        row("decode rows", "->f32", threads, t, in_bytes, memcpy);
        let t = median(|| {
            decode_tiled_par(black_box(&b.tl), s, f, Plane::Row, &mut b.out, threads).unwrap();
            black_box(&b.out);
        });
        row("decode tiled", "->f32", threads, t, in_bytes, memcpy);
    }
}

fn main() {
    let ticks = common::cpu_ticks();
    let s = MxShape::new(ROWS, COLS);
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let x = input();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut b = Bufs {
        rd: vec![0; s.row_data_bytes()],
        rs: vec![0; s.row_scale_bytes()],
        cd: vec![0; s.col_data_bytes()],
        cs: vec![0; s.col_scale_bytes()],
        tl: vec![0; s.tiled_bytes()],
        out: vec![0.0; s.len()],
    };
    println!("MXFP8 E4M3 RCEIL, {ROWS}x{COLS}, median of {REPS}, {all} cores available");
    println!(
        "{:<14} {:<5} {:>7} {:>9} {:>8} {:>10} {:>7}",
        "op", "input", "threads", "ms", "GB/s", "memcpy", "ratio"
    );
    let mut counts = vec![1];
    if all > 1 {
        counts.push(all);
    }
    for &threads in &counts {
        bench(&x, "f32", threads, &mut b);
        bench(&xb, "bf16", threads, &mut b);
    }
    println!("\nMeanwhile {}.", common::others_share(ticks));
}
