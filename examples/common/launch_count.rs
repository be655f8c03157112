//! Kernel launches per step, read from CubeCL's own profiling log after a run made with
//! `CUBECL_DEBUG_OPTION=profile-full CUBECL_DEBUG_LOG=<file> SSHSDP_LAUNCH_MARKS=1` (what
//! `scripts/count_launches` sets): every kernel execution is one log line, and the runtime
//! launches a marker kernel at the start and the end of each update. Profiling synchronises
//! after every kernel, so such a run counts launches and times nothing.

use std::time::Duration;

/// Launches of one steady step, summed over the ranks sharing the device.
#[derive(Clone, Copy, Debug)]
pub struct LaunchCount {
    /// From one update's start to the next one's (a whole step: forward, backward, update).
    pub per_step: u64,
    /// Inside the update (the optimizer, re-derivation and rebuilds; from after the gradient
    /// norm is issued to the end of the commit).
    pub update: u64,
}

/// The count of the last whole step in the profiling log, when the run was made for it (see
/// the module docs; `None` otherwise, or with fewer than two updates); `world` ranks mark each
/// update.
pub fn launch_count(world: usize) -> Option<LaunchCount> {
    let profiling = std::env::var("CUBECL_DEBUG_OPTION").is_ok_and(|o| o.contains("profile"));
    let marks = std::env::var("SSHSDP_LAUNCH_MARKS").is_ok_and(|v| v == "1");
    let path = std::env::var("CUBECL_DEBUG_LOG").ok()?;
    if !profiling || !marks {
        return None;
    }
    // The log is written by CubeCL's logger task: wait until it stops growing.
    let mut text = String::new();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let now = std::fs::read_to_string(&path).ok()?;
        if now.len() == text.len() {
            break;
        }
        text = now;
    }
    count(&text, world)
}

/// Kind of a profiling log line.
#[derive(PartialEq)]
enum Line {
    Begin,
    End,
    Kernel,
}

/// [`launch_count`] on the log's text.
fn count(text: &str, world: usize) -> Option<LaunchCount> {
    let lines: Vec<Line> = text
        .lines()
        .filter(|l| is_execution(l))
        .map(|l| {
            if l.contains("sshsdp_mark_update_begin") {
                Line::Begin
            } else if l.contains("sshsdp_mark_update_end") {
                Line::End
            } else {
                Line::Kernel
            }
        })
        .collect();
    let begins: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i] == Line::Begin)
        .collect();
    // The last two updates' first marks (every rank marks each update).
    let (from, to) = match begins.len() / world {
        n if n >= 2 => (begins[(n - 2) * world], begins[(n - 1) * world]),
        _ => return None,
    };
    let window = &lines[from..to];
    let per_step = window.iter().filter(|l| **l == Line::Kernel).count() as u64;
    let mut depth = 0usize;
    let mut update = 0u64;
    for line in window {
        match line {
            Line::Begin => depth += 1,
            Line::End => depth = depth.saturating_sub(1),
            Line::Kernel if depth > 0 => update += 1,
            Line::Kernel => {}
        }
    }
    Some(LaunchCount { per_step, update })
}

/// Whether `line` is one kernel execution: `| <duration> | <kernel>...`.
fn is_execution(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('|') else {
        return false;
    };
    let Some((duration, _)) = rest.split_once('|') else {
        return false;
    };
    let duration = duration.trim();
    let number = duration.trim_end_matches(|c: char| c.is_alphabetic() || c == 'µ');
    number != duration && !number.is_empty() && number.parse::<f64>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_last_whole_step() {
        let log = "| 1.0µs | a\n| 2ms | sshsdp_mark_update_begin\n| 1ns | opt\n\
                   | 1µs | sshsdp_mark_update_end\n| 3µs | fwd\n| 3µs | bwd\n\
                   | 2ms | sshsdp_mark_update_begin\n| 1µs | opt\n| 1µs | opt\n\
                   | 1µs | sshsdp_mark_update_end\n| 3µs | fwd\nnot a line\n\
                   | 2ms | sshsdp_mark_update_begin\n";
        let c = count(log, 1).unwrap();
        // The last whole step: from the second start mark to the third (opt, opt, fwd).
        assert_eq!((c.per_step, c.update), (3, 2));
        assert!(count(log, 2).is_none());
    }
}
