//! The step timeline: how long the model thread waited on collectives (exposed communication)
//! and how long the communication lanes were busy running them — always counted (two clock
//! reads per collective) — and, when [`crate::HsdpConfig::with_trace`] is on, every such span
//! recorded for a Chrome trace ([`chrome_trace`]; open the file in Perfetto or
//! `chrome://tracing`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::Serialize;

/// The thread a span ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Track {
    /// The rank's model thread (forward, backward, the optimizer), waiting on a collective.
    Model,
    /// The shard lane: all-gathers and shard-group reductions.
    ShardLane,
    /// The replica lane: replica-group reductions, rebuilds, the update group's exchanges.
    ReplicaLane,
}

/// One span of a rank's timeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Span {
    /// The rank.
    pub rank: usize,
    /// Where it ran.
    pub track: Track,
    /// What it was (e.g. "all-gather", "wait gather").
    pub name: &'static str,
    /// The bucket, when the span is about one.
    pub bucket: Option<usize>,
    /// Microseconds since the process's first timeline was created.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// The process-wide origin of span times, shared by every rank of the process.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// One rank's timeline: counters of waiting and busy time, and recorded spans when tracing.
pub(crate) struct Timeline {
    rank: usize,
    trace: bool,
    wait_ns: AtomicU64,
    busy_ns: AtomicU64,
    spans: Mutex<Vec<Span>>,
}

impl Timeline {
    /// A timeline for `rank`, recording spans when `trace`.
    pub fn new(rank: usize, trace: bool) -> Self {
        epoch();
        Self {
            rank,
            trace,
            wait_ns: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            spans: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` as a span of `track`: the model thread waiting (exposed communication) or a
    /// lane running a collective (busy).
    pub fn span<T>(
        &self,
        track: Track,
        name: &'static str,
        bucket: Option<usize>,
        f: impl FnOnce() -> T,
    ) -> T {
        let start = Instant::now();
        let out = f();
        let elapsed = start.elapsed();
        let counter = match track {
            Track::Model => &self.wait_ns,
            Track::ShardLane | Track::ReplicaLane => &self.busy_ns,
        };
        counter.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        if self.trace {
            let span = Span {
                rank: self.rank,
                track,
                name,
                bucket,
                start_us: start.duration_since(epoch()).as_secs_f64() * 1e6,
                dur_us: elapsed.as_secs_f64() * 1e6,
            };
            self.spans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(span);
        }
        out
    }

    /// Nanoseconds the model thread waited and the lanes were busy since the last call, reset.
    pub fn take_times(&self) -> (u64, u64) {
        (
            self.wait_ns.swap(0, Ordering::Relaxed),
            self.busy_ns.swap(0, Ordering::Relaxed),
        )
    }

    /// The spans recorded since the last call (none unless tracing).
    pub fn take_spans(&self) -> Vec<Span> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A Chrome trace (the JSON object format of the Trace Event Format) of `spans`, one process
/// per rank and one thread per track, for Perfetto or `chrome://tracing`.
pub fn chrome_trace(spans: &[Span]) -> String {
    let tid = |t: Track| match t {
        Track::Model => 0,
        Track::ShardLane => 1,
        Track::ReplicaLane => 2,
    };
    let mut events = Vec::with_capacity(spans.len() + 8);
    let mut ranks: Vec<usize> = spans.iter().map(|s| s.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for &rank in &ranks {
        events.push(serde_json::json!({
            "ph": "M", "name": "process_name", "pid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        for (track, name) in [
            (Track::Model, "model thread (waits)"),
            (Track::ShardLane, "shard lane"),
            (Track::ReplicaLane, "replica lane"),
        ] {
            events.push(serde_json::json!({
                "ph": "M", "name": "thread_name", "pid": rank, "tid": tid(track),
                "args": { "name": name },
            }));
        }
    }
    for s in spans {
        let mut event = serde_json::json!({
            "ph": "X", "name": s.name, "cat": "comm", "pid": s.rank, "tid": tid(s.track),
            "ts": s.start_us, "dur": s.dur_us,
        });
        if let Some(b) = s.bucket {
            event["args"] = serde_json::json!({ "bucket": b });
        }
        events.push(event);
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_waits_and_busy_time_and_trace_as_chrome_json() {
        let timeline = Timeline::new(3, true);
        let x = timeline.span(Track::Model, "wait gather", Some(1), || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            7
        });
        assert_eq!(x, 7);
        timeline.span(Track::ShardLane, "all-gather", None, || ());
        let (wait, _busy) = timeline.take_times();
        assert!(wait >= 2_000_000, "{wait} ns");
        assert_eq!(timeline.take_times().0, 0);
        let spans = timeline.take_spans();
        assert_eq!(spans.len(), 2);
        assert!(spans[0].dur_us >= 2000.0);
        let json: serde_json::Value = serde_json::from_str(&chrome_trace(&spans)).unwrap();
        let events = json["traceEvents"].as_array().unwrap();
        let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(complete.len(), 2);
        assert_eq!(complete[0]["pid"], 3);
        assert_eq!(complete[0]["args"]["bucket"], 1);
        // Untraced timelines count but keep nothing.
        let quiet = Timeline::new(0, false);
        quiet.span(Track::Model, "wait", None, || ());
        assert!(quiet.take_spans().is_empty());
    }
}
