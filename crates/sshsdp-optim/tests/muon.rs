//! Muon and Newton–Schulz on `NdArray` (f32) against the independent float64 vectors of
//! `tests/data/gen_muon_vectors.py`, plus properties of the implementation.
//!
//! Tolerances: the inputs are f32 values, so the only differences from the vectors are f32
//! rounding in the five quintic iterations (three matmuls each, sums of 24–40 products).
//! Small singular values grow by up to `a ≈ 3.44` per step, so rounding is amplified by at
//! most ~`3.44⁵ ≈ 500` from ~`1e-7`: a bound of `1e-4` on entries of order 0.1–0.5 leaves
//! a wide margin (the observed error is ~1e-6). A Muon step moves weights by
//! `lr·scale·O ≈ 0.02·1.7·0.5`, so the parameter error is ~`lr·scale` times that of `O`
//! plus f32 rounding of the weights (~1e-8): bounded by `1e-5`.

use burn::backend::NdArray;
use burn::optim::SimpleOptimizer;
use burn::tensor::{Tensor, TensorData};
use serde::Deserialize;
use sshsdp_optim::{
    newton_schulz, newton_schulz_batched, ns_flops, MatrixLayout, Muon, MuonConfig, MuonState,
    NsPrecision, UpdateScale,
};

type B = NdArray;

const NS_TOL: f32 = 1e-4;
const PARAM_TOL: f32 = 1e-5;

#[derive(Deserialize)]
struct Doc {
    ns: Vec<NsCase>,
    muon: MuonDoc,
}

#[derive(Deserialize)]
struct NsCase {
    name: String,
    rows: usize,
    cols: usize,
    steps: usize,
    g: Vec<f32>,
    o: Vec<f32>,
    sv_min: f64,
    sv_max: f64,
}

#[derive(Deserialize)]
struct MuonDoc {
    rows: usize,
    cols: usize,
    lr: f64,
    weight_decay: f64,
    momentum: f64,
    ns_steps: usize,
    w0: Vec<f32>,
    grads: Vec<Vec<f32>>,
    cases: Vec<MuonCase>,
}

#[derive(Deserialize)]
struct MuonCase {
    scale: String,
    layout: String,
    nesterov: bool,
    scale_value: f64,
    w: Vec<Vec<f32>>,
}

fn doc() -> Doc {
    let text = include_str!("data/muon_vectors.json");
    serde_json::from_str(text).expect("muon_vectors.json parses")
}

fn matrix(values: &[f32], rows: usize, cols: usize) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [rows, cols]),
        &Default::default(),
    )
}

fn values(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("f32 tensor")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn frobenius_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Eigenvalues of a symmetric `n x n` matrix (row-major, f64) by cyclic Jacobi rotations.
fn symmetric_eigenvalues(mut a: Vec<f64>, n: usize) -> Vec<f64> {
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum();
        if off < 1e-22 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let akp = a[k * n + p];
                    let akq = a[k * n + q];
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let apk = a[p * n + k];
                    let aqk = a[q * n + k];
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
        }
    }
    (0..n).map(|i| a[i * n + i]).collect()
}

/// Singular values of a wide (`rows <= cols`) row-major matrix from the eigenvalues of its
/// Gram matrix `O Oᵀ`.
fn singular_values(o: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    assert!(rows <= cols);
    let x: Vec<f64> = o.iter().map(|&v| v as f64).collect();
    let mut gram = vec![0.0; rows * rows];
    for i in 0..rows {
        for j in 0..rows {
            gram[i * rows + j] = (0..cols).map(|k| x[i * cols + k] * x[j * cols + k]).sum();
        }
    }
    symmetric_eigenvalues(gram, rows)
        .into_iter()
        .map(|e| e.max(0.0).sqrt())
        .collect()
}

#[test]
fn newton_schulz_matches_vectors() {
    for case in doc().ns {
        let o = newton_schulz(
            matrix(&case.g, case.rows, case.cols),
            case.steps,
            NsPrecision::F32,
        );
        assert_eq!(o.dims(), [case.rows, case.cols]);
        let diff = max_abs_diff(&values(o), &case.o);
        assert!(diff <= NS_TOL, "{}: max abs diff {diff:e}", case.name);
    }
}

#[test]
fn newton_schulz_singular_values_in_band() {
    for case in doc().ns {
        let o = newton_schulz(
            matrix(&case.g, case.rows, case.cols),
            case.steps,
            NsPrecision::F32,
        );
        let (o, rows, cols) = if case.rows > case.cols {
            (o.transpose(), case.cols, case.rows)
        } else {
            (o, case.rows, case.cols)
        };
        let sv = singular_values(&values(o), rows, cols);
        let lo = sv.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = sv.iter().copied().fold(0.0, f64::max);
        // The quintic does not converge to exactly 1; five steps leave roughly [0.7, 1.2].
        assert!(lo >= 0.6 && hi <= 1.3, "{}: sv in [{lo}, {hi}]", case.name);
        assert!(
            (lo - case.sv_min).abs() < 1e-3,
            "{}: sv_min {lo}",
            case.name
        );
        assert!(
            (hi - case.sv_max).abs() < 1e-3,
            "{}: sv_max {hi}",
            case.name
        );
    }
}

#[test]
fn newton_schulz_transpose_symmetry() {
    for case in doc().ns {
        let g = matrix(&case.g, case.rows, case.cols);
        let direct = newton_schulz(g.clone(), case.steps, NsPrecision::F32);
        let via_t = newton_schulz(g.transpose(), case.steps, NsPrecision::F32).transpose();
        // Same arithmetic on the same wide matrix; only the memory layout of the matmul
        // operands may differ, so allow f32 rounding noise.
        let diff = max_abs_diff(&values(direct), &values(via_t));
        assert!(diff <= 1e-6, "{}: max abs diff {diff:e}", case.name);
    }
}

/// A batch of same-shape matrices (wide and tall, with a zero matrix among them) orthogonalised
/// at once equals each matrix alone within 1e-5, in f32 and in emulated bf16.
#[test]
fn batched_newton_schulz_equals_one_matrix_at_a_time() {
    for (rows, cols) in [(6, 10), (12, 5), (8, 8)] {
        let n = rows * cols;
        let mats: Vec<Vec<f32>> = (0..4)
            .map(|k| {
                (0..n)
                    .map(|i| {
                        if k == 2 {
                            0.0
                        } else {
                            ((i * 37 + k * 11) % 19) as f32 / 7.0 - 1.3
                        }
                    })
                    .collect()
            })
            .collect();
        for precision in [NsPrecision::F32, NsPrecision::Bf16] {
            let batch = Tensor::<B, 3>::from_data(
                TensorData::new(mats.concat(), [mats.len(), rows, cols]),
                &Default::default(),
            );
            let batched: Vec<f32> = newton_schulz_batched(batch, 5, precision)
                .into_data()
                .to_vec()
                .unwrap();
            for (k, m) in mats.iter().enumerate() {
                let alone = values(newton_schulz(matrix(m, rows, cols), 5, precision));
                let diff = max_abs_diff(&batched[k * n..(k + 1) * n], &alone);
                // Emulated bf16 rounds each intermediate: a last-bit difference in a wide
                // accumulation can flip one rounding, so allow one bf16 step there.
                let tol = if precision == NsPrecision::F32 {
                    1e-5
                } else {
                    1e-2
                };
                assert!(
                    diff <= tol,
                    "{rows}x{cols} {precision:?} matrix {k}: {diff:e}"
                );
            }
        }
    }
}

#[test]
fn newton_schulz_of_zero_is_zero() {
    let o = newton_schulz(matrix(&[0.0; 12], 3, 4), 5, NsPrecision::F32);
    assert!(values(o).iter().all(|&v| v == 0.0));
}

#[test]
fn bf16_is_close_to_f32() {
    for case in doc().ns {
        let g = matrix(&case.g, case.rows, case.cols);
        let f = values(newton_schulz(g.clone(), case.steps, NsPrecision::F32));
        let h = values(newton_schulz(g, case.steps, NsPrecision::Bf16));
        // bf16 keeps 8 significant bits (unit roundoff 2^-9 ≈ 2e-3) and every intermediate
        // of the five iterations is rounded, with small singular directions amplified by up
        // to a ≈ 3.44 per step; the quintic does not contract errors (its singular values keep
        // oscillating in ~[0.7, 1.2]). Entries are up to ~0.5 (RMS ~0.15). Observed on these
        // inputs: max abs diff ≈ 1.6e-2, relative Frobenius diff ≈ 2.2e-2.
        let diff = max_abs_diff(&f, &h);
        assert!(
            diff <= 2e-2,
            "{}: bf16 vs f32 max abs diff {diff:e}",
            case.name
        );
        let rel = frobenius_diff(&f, &h) / frobenius_diff(&f, &vec![0.0; f.len()]);
        assert!(
            rel <= 3e-2,
            "{}: bf16 vs f32 relative diff {rel:e}",
            case.name
        );
        // The emulation really rounds: the result differs from f32 and is bf16-valued.
        assert!(
            diff > 0.0,
            "{}: bf16 result equals the f32 result",
            case.name
        );
        assert!(
            h.iter().all(|&v| half::bf16::from_f32(v).to_f32() == v),
            "{}: bf16 output not bf16-valued",
            case.name
        );
    }
}

#[test]
fn ns_flops_hand_checked() {
    // m = 24, n = 40: X Xᵀ 2·24·24·40 = 46080, A·A 2·24³ = 27648, Bm·X 46080;
    // 119808 per step, 599040 for five.
    assert_eq!(ns_flops(24, 40, 5), 599_040);
    assert_eq!(ns_flops(40, 24, 5), 599_040);
    // Square 3 x 3, one step: three matmuls of 2·27 = 54 flops.
    assert_eq!(ns_flops(3, 3, 1), 162);
    assert_eq!(ns_flops(16, 48, 0), 0);
}

fn parse_scale(s: &str) -> UpdateScale {
    match s {
        "spectral_ratio" => UpdateScale::SpectralRatio,
        "match_adamw" => UpdateScale::MatchAdamW,
        other => panic!("unknown scale {other}"),
    }
}

fn parse_layout(s: &str) -> MatrixLayout {
    match s {
        "input_output" => MatrixLayout::InputOutput,
        "output_input" => MatrixLayout::OutputInput,
        other => panic!("unknown layout {other}"),
    }
}

#[test]
fn muon_steps_match_vectors() {
    let doc = doc();
    let m = &doc.muon;
    for case in &m.cases {
        let muon = MuonConfig::new()
            .with_momentum(m.momentum)
            .with_nesterov(case.nesterov)
            .with_ns_steps(m.ns_steps)
            .with_weight_decay(m.weight_decay)
            .with_scale(parse_scale(&case.scale))
            .with_layout(parse_layout(&case.layout))
            .init();
        let label = format!("{}/{}/nesterov={}", case.scale, case.layout, case.nesterov);
        let scale = muon.update_scale([m.rows, m.cols]);
        assert!(
            (scale - case.scale_value).abs() < 1e-12,
            "{label}: scale {scale}"
        );

        let mut w = matrix(&m.w0, m.rows, m.cols);
        let mut state = None;
        for (step, (grad, expected)) in m.grads.iter().zip(&case.w).enumerate() {
            let (nw, ns) = muon.step_matrix(m.lr, w, matrix(grad, m.rows, m.cols), state);
            let diff = max_abs_diff(&values(nw.clone()), expected);
            assert!(
                diff <= PARAM_TOL,
                "{label} step {}: max abs diff {diff:e}",
                step + 1
            );
            w = nw;
            state = Some(ns);
        }
        assert_eq!(muon.ns_calls(), m.grads.len() as u64, "{label}");
    }
}

#[test]
fn update_scale_rules_and_layouts() {
    let scale = |s, l, shape| {
        MuonConfig::new()
            .with_scale(s)
            .with_layout(l)
            .init()
            .update_scale(shape)
    };
    use MatrixLayout::*;
    use UpdateScale::*;
    let r3 = 3f64.sqrt();
    // Burn Linear [d_input = 16, d_output = 48]: fan_out / fan_in = 3.
    assert!((scale(SpectralRatio, InputOutput, [16, 48]) - r3).abs() < 1e-12);
    assert_eq!(scale(SpectralRatio, InputOutput, [48, 16]), 1.0);
    // [d_output, d_input]: the same shapes mean the opposite fans.
    assert_eq!(scale(SpectralRatio, OutputInput, [16, 48]), 1.0);
    assert!((scale(SpectralRatio, OutputInput, [48, 16]) - r3).abs() < 1e-12);
    // Square: 1 either way.
    assert_eq!(scale(SpectralRatio, InputOutput, [32, 32]), 1.0);
    // MatchAdamW: 0.2·sqrt(max dim), independent of the layout.
    let m = 0.2 * 48f64.sqrt();
    for layout in [InputOutput, OutputInput] {
        for shape in [[16, 48], [48, 16]] {
            assert!((scale(MatchAdamW, layout, shape) - m).abs() < 1e-12);
        }
    }
}

#[test]
fn config_defaults_follow_the_design() {
    let c = MuonConfig::new();
    assert_eq!(c.momentum, 0.95);
    assert!(c.nesterov);
    assert_eq!(c.ns_steps, 5);
    assert_eq!(c.ns_precision, NsPrecision::F32);
    assert_eq!(c.weight_decay, 0.0);
    assert_eq!(c.scale, UpdateScale::SpectralRatio);
    assert_eq!(c.layout, MatrixLayout::InputOutput);
}

#[test]
fn weight_decay_is_decoupled() {
    // A zero gradient orthogonalises to zero, leaving only W·(1 − lr·wd).
    let muon = MuonConfig::new().with_weight_decay(0.5).init();
    let w0: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
    let (w, _) = muon.step_matrix(0.1, matrix(&w0, 3, 4), matrix(&[0.0; 12], 3, 4), None);
    let expected: Vec<f32> = w0.iter().map(|v| v * 0.95).collect();
    assert!(max_abs_diff(&values(w), &expected) <= 1e-6);
}

#[test]
fn simple_optimizer_equals_step_matrix() {
    let doc = doc();
    let m = &doc.muon;
    let muon = MuonConfig::new()
        .with_weight_decay(m.weight_decay)
        .with_scale(UpdateScale::MatchAdamW)
        .init();
    let clone = muon.clone();

    let mut w_direct = matrix(&m.w0, m.rows, m.cols);
    let mut s_direct: Option<MuonState<B, 2>> = None;
    let mut w_simple = matrix(&m.w0, m.rows, m.cols);
    let mut s_simple: Option<MuonState<B, 2>> = None;
    for grad in &m.grads {
        let g = matrix(grad, m.rows, m.cols);
        let (w, s) = muon.step_matrix(m.lr, w_direct, g.clone(), s_direct);
        (w_direct, s_direct) = (w, Some(s));
        let (w, s) = SimpleOptimizer::<B>::step(&clone, m.lr, w_simple, g, s_simple);
        (w_simple, s_simple) = (w, s);
        let s = s_simple.clone().expect("Muon always returns a state");
        let s = <Muon as SimpleOptimizer<B>>::to_device(s, &Default::default());
        s_simple = Some(s);
    }
    assert_eq!(values(w_direct), values(w_simple));
    assert_eq!(
        values(s_direct.unwrap().momentum),
        values(s_simple.unwrap().momentum)
    );
    // Clones share the counters: two steps on each path.
    assert_eq!(muon.ns_calls(), 4);
    let stats = clone.ns_stats();
    assert_eq!(stats.calls, 4);
    assert_eq!(stats.flops, 4 * ns_flops(m.rows, m.cols, 5));
    muon.reset_ns_stats();
    assert_eq!(clone.ns_calls(), 0);
}

#[test]
#[should_panic(expected = "Muon steps 2-D matrices only")]
fn simple_optimizer_rejects_vectors() {
    let muon = MuonConfig::new().init();
    let device = Default::default();
    let bias = Tensor::<B, 1>::from_floats([0.1, 0.2, 0.3], &device);
    let grad = Tensor::<B, 1>::from_floats([1.0, 1.0, 1.0], &device);
    let _ = SimpleOptimizer::<B>::step(&muon, 0.01, bias, grad, None);
}
