//! The report of Muon's exchange of split matrices: the owner all-to-all against the two
//! all-reduces, measured bytes per rank against the projection and the bound.

use sshsdp::comm::threads::TrafficBytes;

use crate::measure::Row;

/// Muon's exchange of split matrices, old (two all-reduces) against new (owner all-to-all), at
/// each world: the bytes the engine moved for each rank in a training step above AdamW's step
/// on the same shards (which runs every other collective alike), and the optimizer-step time.
pub fn exchange_table(measured: &[(usize, [Row; 3])]) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!();
    println!(
        "Muon's exchange of split matrices (P: their f32 bytes; W: update-group size): bytes the \
         threads engine moved per step for each rank, above AdamW's step on the same shards; \
         group: all ranks' sent bytes; projected: `sshsdp::plan::projection`'s bytes for the \
         group; bound: 1.1 · 2·P·(W−1)/W for the whole group"
    );
    println!(
        "{:<6} {:<14} {:>9} {:>8} {:>22} {:>22} {:>12} {:>10} {:>10} {:>12} {:>8}",
        "world",
        "exchange",
        "step ms",
        "P MiB",
        "sent MiB per rank",
        "received MiB per rank",
        "group MiB",
        "projected",
        "/measured",
        "2P(W-1)/W",
        "≤ bound"
    );
    for (world, [adamw, new, old]) in measured {
        let w = *world as f64;
        let bound = 2.0 * new.split_bytes as f64 * (w - 1.0) / w;
        for (name, row, projected) in [
            ("all-reduce", old, old.projected.1),
            ("owner a2a", new, new.projected.0),
        ] {
            let above = |f: fn(&TrafficBytes) -> u64| -> Vec<u64> {
                row.traffic
                    .iter()
                    .zip(&adamw.traffic)
                    .map(|(m, a)| f(m) - f(a))
                    .collect()
            };
            let sent = above(|t| t.sent);
            let received = above(|t| t.received);
            let list = |v: &[u64]| {
                v.iter()
                    .map(|&b| format!("{:.2}", mib(b)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let group: u64 = sent.iter().sum();
            assert_eq!(
                group,
                received.iter().sum::<u64>(),
                "what is sent is received"
            );
            println!(
                "{:<6} {:<14} {:>9.1} {:>8.2} {:>22} {:>22} {:>12.2} {:>10.2} {:>10.4} {:>12.2} {:>8}",
                world,
                name,
                row.secs * 1e3,
                mib(row.split_bytes),
                list(&sent),
                list(&received),
                mib(group),
                projected / (1024.0 * 1024.0),
                projected / group as f64,
                bound / (1024.0 * 1024.0),
                if group as f64 <= 1.1 * bound {
                    "yes"
                } else {
                    "no"
                },
            );
        }
    }
}
