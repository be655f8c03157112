//! Shared by the benches: a global allocator that counts the process's live and peak heap
//! bytes, so each bench can report peak memory next to its timings; the median of timings; and
//! the share of the cores other processes used during a run (a busy machine skews timings).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live and peak heap bytes of the process.
struct Counting;

/// Live heap bytes.
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Most live heap bytes since the last reset (store `LIVE` into it to reset).
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded to the system allocator with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median wall time of `reps` runs of `f`, after one warm-up run.
#[allow(dead_code)] // not every bench times closures
pub fn median_time(reps: usize, mut f: impl FnMut()) -> std::time::Duration {
    f();
    let times = (0..reps)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    std::time::Duration::from_secs_f64(median(times))
}

/// CPU clock ticks since boot: (all cores' total, all cores' busy, this process's own).
pub fn cpu_ticks() -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let total: u64 = cpu.iter().take(8).sum();
    let idle = cpu.get(3)? + cpu.get(4)?;
    let own = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<u64> = own
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    Some((total, total - idle, fields.iter().sum()))
}

/// Share of the cores' time that other processes used between two `cpu_ticks` readings.
pub fn others_share(start: Option<(u64, u64, u64)>) -> String {
    match (start, cpu_ticks()) {
        (Some((t0, b0, o0)), Some((t1, b1, o1))) if t1 > t0 => {
            let others = (b1 - b0).saturating_sub(o1 - o0);
            format!(
                "other processes used {:.0}% of the cores' time, this bench {:.0}%",
                100.0 * others as f64 / (t1 - t0) as f64,
                100.0 * (o1 - o0) as f64 / (t1 - t0) as f64
            )
        }
        _ => "CPU shares unknown (no /proc)".into(),
    }
}
