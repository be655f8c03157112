//! Measurements and outputs of a run: memory, number formatting, the metrics CSV, the loss
//! curves read back, and the Chrome trace of `--trace`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sshsdp::backend::Precision;
use sshsdp::plan::RuntimeFormat;

/// Resident set size of this process (all ranks of the threads engine), bytes.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// A count with a k/M suffix.
pub fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Throughput of a whole run without its warm-up: the first steps of a process tune (autotune
/// benchmarks each kernel shape once) and compile kernels (NVRTC, SPIR-V), so they are left out
/// of the rate a summary reports, and the summary says how many.
pub(crate) struct WarmRate {
    items_per_step: usize,
    /// Steps left out at the start.
    warmup: usize,
    /// Steps seen, and the seconds of those after the warm-up.
    seen: usize,
    warm_s: f64,
}

impl WarmRate {
    /// A rate over a run of `steps` steps of `items_per_step` items, leaving out the first fifth
    /// (1 to 5 steps; none in a run of fewer than 4 steps, where every step counts).
    pub(crate) fn new(items_per_step: usize, steps: usize) -> Self {
        let warmup = if steps < 4 {
            0
        } else {
            (steps / 5).clamp(1, 5)
        };
        Self {
            items_per_step,
            warmup,
            seen: 0,
            warm_s: 0.0,
        }
    }

    /// Records the next step, of `seconds`.
    pub(crate) fn push(&mut self, seconds: f64) {
        if self.seen >= self.warmup {
            self.warm_s += seconds;
        }
        self.seen += 1;
    }

    /// Steps left out at the start.
    pub(crate) fn warmup(&self) -> usize {
        self.warmup.min(self.seen)
    }

    /// Items per second over the steps after the warm-up.
    pub(crate) fn items_per_s(&self) -> f64 {
        let timed = self.seen.saturating_sub(self.warmup);
        self.items_per_step as f64 * timed as f64 / self.warm_s
    }
}

/// Throughput over the last (up to) 10 steps: what the progress line shows, free of the first
/// steps' kernel compilation once the run is longer than 10 steps.
pub(crate) struct RecentRate {
    items_per_step: usize,
    recent: std::collections::VecDeque<f64>,
}

impl RecentRate {
    const WINDOW: usize = 10;

    /// An empty window for steps of `items_per_step` items (tokens).
    pub(crate) fn new(items_per_step: usize) -> Self {
        Self {
            items_per_step,
            recent: std::collections::VecDeque::with_capacity(Self::WINDOW + 1),
        }
    }

    /// Records one step of `seconds`.
    pub(crate) fn push(&mut self, seconds: f64) {
        self.recent.push_back(seconds);
        if self.recent.len() > Self::WINDOW {
            self.recent.pop_front();
        }
    }

    /// Items per second over the window.
    pub(crate) fn items_per_s(&self) -> f64 {
        self.items_per_step as f64 * self.recent.len() as f64 / self.recent.iter().sum::<f64>()
    }
}

/// Name of a dtype as `--compute`/`--reduce` spell it.
pub fn precision_name(precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
        Precision::F16 => "f16",
    }
}

/// Name of a runtime format as `--format` spells it.
pub fn format_name(format: RuntimeFormat) -> &'static str {
    match format {
        RuntimeFormat::F32 => "f32",
        RuntimeFormat::Bf16 => "bf16",
        RuntimeFormat::Mxfp8 => "mxfp8",
    }
}

/// The metrics file: one row per step.
pub(crate) struct Metrics {
    file: BufWriter<File>,
}

impl Metrics {
    const HEADER: &'static str = "step,loss,eval_loss,lr,grad_norm,tokens_per_s,elapsed_s,\
                                  rss_mib,shard_mib,peak_gathered_mib,gathered_mib";

    pub(crate) fn create(path: &Path, append: bool) -> Result<Self, String> {
        let exists = path.exists();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| format!("creating {}: {e}", path.display()))?;
        let mut m = Metrics {
            file: BufWriter::new(file),
        };
        if !(append && exists) {
            m.line(Self::HEADER)?;
        }
        Ok(m)
    }

    pub(crate) fn line(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| format!("writing metrics: {e}"))
    }
}

/// `(step, loss)` points.
pub(crate) type Curve = Vec<(f64, f64)>;

/// Reads `step,loss,eval_loss` back from a metrics file (the whole history, across resumed
/// runs) for the plot.
pub(crate) fn read_curves(path: &Path) -> (Curve, Curve) {
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines().skip(1) {
        let mut cols = line.split(',');
        let (Some(step), Some(loss), Some(ev)) = (cols.next(), cols.next(), cols.next()) else {
            continue;
        };
        let Ok(step) = step.parse::<f64>() else {
            continue;
        };
        if let Ok(l) = loss.parse::<f64>() {
            train.push((step, l));
        }
        if let Ok(e) = ev.parse::<f64>() {
            eval.push((step, e));
        }
    }
    (train, eval)
}

/// The timeline spans the ranks of this process recorded (`--trace`).
pub(crate) fn trace_spans() -> std::sync::MutexGuard<'static, Vec<sshsdp::backend::Span>> {
    static SPANS: std::sync::Mutex<Vec<sshsdp::backend::Span>> = std::sync::Mutex::new(Vec::new());
    SPANS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes the spans this process's ranks recorded to `path` (`rank`: this process's rank under
/// MPI, whose ranks > 0 write `path.rank<r>`).
pub(crate) fn write_trace(path: &Path, rank: Option<usize>) -> Result<(), String> {
    let path = match rank {
        Some(r) if r > 0 => PathBuf::from(format!("{}.rank{r}", path.display())),
        _ => path.to_path_buf(),
    };
    let spans = std::mem::take(&mut *trace_spans());
    std::fs::write(&path, sshsdp::backend::chrome_trace(&spans))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    if rank.unwrap_or(0) == 0 {
        println!(
            "trace: {} spans written to {} (open it in https://ui.perfetto.dev)",
            spans.len(),
            path.display()
        );
    }
    Ok(())
}
