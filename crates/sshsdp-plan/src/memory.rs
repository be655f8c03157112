//! Per-rank memory accounting by category, printable as a table.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Bytes one rank holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMemory {
    /// Persistent runtime shard (its pieces of every bucket, padding included).
    pub runtime_shard: u64,
    /// Full bucket buffers alive at once while gathering (current + prefetched).
    pub gathered_peak: u64,
    /// fp32 master weights owned.
    pub master: u64,
    /// Optimizer state owned.
    pub optimizer_state: u64,
    /// fp32 gradient shard (reduce-scatter output).
    pub gradient_shard: u64,
    /// Workspace of the largest split matrix this rank orthogonalises (gathered fp32 update
    /// and its Newton–Schulz result).
    pub matrix_gather: u64,
    /// Of `runtime_shard`, bytes that are alignment or tail padding.
    pub padding: u64,
}

impl RankMemory {
    /// Persistent plus peak bytes (padding is already inside `runtime_shard`).
    pub fn total(&self) -> u64 {
        self.runtime_shard
            + self.gathered_peak
            + self.master
            + self.optimizer_state
            + self.gradient_shard
            + self.matrix_gather
    }

    fn categories(&self) -> [(&'static str, u64); 8] {
        [
            ("runtime shard", self.runtime_shard),
            ("gathered buffers (peak)", self.gathered_peak),
            ("fp32 master", self.master),
            ("optimizer state", self.optimizer_state),
            ("gradient shard", self.gradient_shard),
            ("matrix gather (Muon)", self.matrix_gather),
            ("  of which padding", self.padding),
            ("total", self.total()),
        ]
    }
}

/// Memory of every rank of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// One entry per rank, by rank.
    pub ranks: Vec<RankMemory>,
}

impl MemoryReport {
    /// The rank with the largest total.
    pub fn max_rank(&self) -> (usize, RankMemory) {
        self.ranks
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|(_, m)| m.total())
            .unwrap_or_default()
    }
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.ranks.len().max(1) as f64;
        writeln!(
            f,
            "{:<26} {:>14} {:>14} {:>14}",
            "per-rank memory (MiB)", "min", "mean", "max"
        )?;
        let rows = RankMemory::default().categories().len();
        for row in 0..rows {
            let values: Vec<u64> = self.ranks.iter().map(|m| m.categories()[row].1).collect();
            let name = RankMemory::default().categories()[row].0;
            let min = values.iter().copied().min().unwrap_or(0) as f64;
            let max = values.iter().copied().max().unwrap_or(0) as f64;
            let mean = values.iter().sum::<u64>() as f64 / n;
            writeln!(
                f,
                "{:<26} {:>14.2} {:>14.2} {:>14.2}",
                name,
                mib(min),
                mib(mean),
                mib(max)
            )?;
        }
        Ok(())
    }
}
