//! How faithfully each MXFP8 weight layout holds real weights: square-block (one scale per 32×32
//! tile, the runtime's `--format mxfp8`) against the finer 1×32 blocks (the row-wise plane that
//! backward's `dy · Wᵀ` reads and the column-wise plane that forward's `x · W` reads).
//!
//! ```text
//! cargo run --release --example train_gpt -- --format f32 --export runs/gpt.safetensors
//! cargo run --release --example mx_fidelity -- runs/gpt.safetensors [MORE.safetensors]
//! ```
//!
//! For every matrix of the file that the runtime would hold in MXFP8 (`resolve_format` with the
//! default padding limit), E4M3 with RCEIL scales: the RMS relative error
//! `sqrt(Σ(x − q)² / Σx²)`, the worst 32×32 tile's RMS relative error, and the share of nonzero
//! weights encoded as an E4M3 subnormal or zero (exponent bits 0: flushed, or with fewer than 3
//! mantissa bits left). Prints one markdown table per file and the element-weighted totals.

use std::path::PathBuf;

use sshsdp::backend::ParamSource;
use sshsdp::checkpoint::SafetensorsSource;
use sshsdp::mx::{self, ElemFormat, MxShape, ScaleRule};
use sshsdp::plan::{resolve_format, DType, ParamSpec, PlanConfig, RuntimeFormat};

const FMT: ElemFormat = ElemFormat::E4M3;
const RULE: ScaleRule = ScaleRule::Rceil;

/// One layout's error on one matrix.
#[derive(Clone, Copy, Default)]
struct Fidelity {
    /// Σ(x − q)².
    err2: f64,
    /// Σx².
    sig2: f64,
    /// The worst tile's RMS relative error.
    worst_tile: f64,
    /// Nonzero weights stored as an E4M3 subnormal or zero.
    small: u64,
    /// Nonzero weights.
    nonzero: u64,
}

impl Fidelity {
    fn rms(&self) -> f64 {
        (self.err2 / self.sig2.max(f64::MIN_POSITIVE)).sqrt()
    }

    fn small_share(&self) -> f64 {
        self.small as f64 / self.nonzero.max(1) as f64
    }

    fn add(&mut self, other: &Fidelity) {
        self.err2 += other.err2;
        self.sig2 += other.sig2;
        self.worst_tile = self.worst_tile.max(other.worst_tile);
        self.small += other.small;
        self.nonzero += other.nonzero;
    }
}

/// The error of decoded `q` against `x` (`rows × cols`), with `byte(r, c)` the element's byte.
fn fidelity(x: &[f32], q: &[f32], shape: MxShape, byte: impl Fn(usize, usize) -> u8) -> Fidelity {
    let mut f = Fidelity::default();
    let mut tiles = vec![(0f64, 0f64); shape.n_tiles()];
    for r in 0..shape.rows {
        for c in 0..shape.cols {
            let (a, b) = (x[r * shape.cols + c] as f64, q[r * shape.cols + c] as f64);
            let tile = &mut tiles[(r / 32) * shape.tile_cols() + c / 32];
            tile.0 += (a - b) * (a - b);
            tile.1 += a * a;
            if a != 0.0 {
                f.nonzero += 1;
                f.small += u64::from(byte(r, c) & 0x78 == 0);
            }
        }
    }
    for (err2, sig2) in tiles {
        f.err2 += err2;
        f.sig2 += sig2;
        if sig2 > 0.0 {
            f.worst_tile = f.worst_tile.max((err2 / sig2).sqrt());
        }
    }
    f
}

/// Square-block, 1×32 row-wise and 1×32 column-wise fidelity of the matrix `x`.
fn measure(x: &[f32], shape: MxShape) -> Result<[Fidelity; 3], String> {
    let e = |e: mx::MxError| e.to_string();
    let mut q = vec![0f32; x.len()];
    let mut d = vec![0u8; shape.square_data_bytes()];
    let mut s = vec![0u8; shape.square_scale_bytes()];
    mx::encode_square(x, shape.cols, shape, FMT, RULE, &mut d, &mut s).map_err(e)?;
    mx::decode_square(&d, &s, shape, FMT, &mut q, shape.cols).map_err(e)?;
    let square = fidelity(x, &q, shape, |r, c| d[r * shape.cols + c]);

    let mut d = vec![0u8; shape.row_data_bytes()];
    let mut s = vec![0u8; shape.row_scale_bytes()];
    mx::encode_rows(x, shape, FMT, RULE, &mut d, &mut s).map_err(e)?;
    mx::decode_rows(&d, &s, shape, FMT, &mut q).map_err(e)?;
    let rows = fidelity(x, &q, shape, |r, c| d[r * shape.cols_p() + c]);

    let mut d = vec![0u8; shape.col_data_bytes()];
    let mut s = vec![0u8; shape.col_scale_bytes()];
    mx::encode_cols(x, shape, FMT, RULE, &mut d, &mut s).map_err(e)?;
    mx::decode_cols(&d, &s, shape, FMT, &mut q).map_err(e)?;
    let cols = fidelity(x, &q, shape, |r, c| d[c * shape.rows_p() + r]);
    Ok([square, rows, cols])
}

/// One table row's cells: RMS relative error, worst tile, subnormal-or-zero share, each for
/// square blocks / 1×32 rows / 1×32 columns.
fn cells(f: &[Fidelity; 3]) -> String {
    let three = |g: &dyn Fn(&Fidelity) -> f64, digits: usize| {
        f.iter()
            .map(|x| format!("{:.digits$}%", 100.0 * g(x)))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    [
        three(&Fidelity::rms, 3),
        three(&|x| x.worst_tile, 2),
        three(&Fidelity::small_share, 3),
    ]
    .join(" | ")
}

fn report(path: &PathBuf) -> Result<[Fidelity; 3], String> {
    let source = SafetensorsSource::open(path).map_err(|e| e.to_string())?;
    let mut names: Vec<String> = source.names().map(str::to_string).collect();
    names.sort();
    let limit = PlanConfig::default().mx_max_padding;
    println!("\n{}\n", path.display());
    println!(
        "| matrix | shape | RMS rel. error: 32×32 / 1×32 rows / 1×32 cols | worst tile: 32×32 \
         / rows / cols | subnormal or zero: 32×32 / rows / cols |"
    );
    println!("|---|---|---|---|---|");
    let mut total = [Fidelity::default(); 3];
    for name in names {
        let shape = source.shape(&name)?.to_vec();
        let spec = ParamSpec::new(name.clone(), shape.clone(), DType::F32);
        if resolve_format(&spec, RuntimeFormat::Mxfp8, limit).0 != RuntimeFormat::Mxfp8 {
            continue;
        }
        let (rows, cols) = spec.matrix_dims();
        let mx_shape = MxShape::new(rows as usize, cols as usize);
        let mut x = vec![0f32; mx_shape.len()];
        source.read(&name, 0..x.len(), &mut x)?;
        let f = measure(&x, mx_shape)?;
        println!("| {name} | {rows}×{cols} | {} |", cells(&f));
        total.iter_mut().zip(&f).for_each(|(t, f)| t.add(f));
    }
    println!("| **all** | | {} |", cells(&total));
    Ok(total)
}

fn main() -> std::process::ExitCode {
    let files: Vec<PathBuf> = std::env::args().skip(1).map(PathBuf::from).collect();
    if files.is_empty() || files.iter().any(|f| f.as_os_str() == "--help") {
        eprintln!("usage: mx_fidelity FILE.safetensors [MORE.safetensors] (see the module docs)");
        return std::process::ExitCode::from(2);
    }
    for file in &files {
        if let Err(e) = report(file) {
            eprintln!("mx_fidelity: {}: {e}", file.display());
            return std::process::ExitCode::FAILURE;
        }
    }
    std::process::ExitCode::SUCCESS
}
