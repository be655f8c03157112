//! The projection's formulas and its traffic on hand-checked plans.

use super::*;
use crate::{DType, ParamSpec, PlanConfig, RuntimeFormat};

fn specs() -> Vec<ParamSpec> {
    (0..6)
        .flat_map(|l| {
            [
                ParamSpec::new(format!("l{l}.w"), vec![256, 512], DType::F32).with_order(2 * l),
                ParamSpec::new(format!("l{l}.norm"), vec![256], DType::F32).with_order(2 * l + 1),
            ]
        })
        .collect()
}

fn plan(replicas: usize, shards: usize, sharding: Sharding, format: RuntimeFormat) -> Plan {
    let config = PlanConfig::default()
        .with_sharding(sharding)
        .with_format(format)
        .with_bucket_elements(300_000);
    Plan::build(specs(), Mesh::new(replicas, shards).unwrap(), config).unwrap()
}

fn total(plan: &Plan, f: impl Fn(usize) -> u64) -> u64 {
    (0..plan.buckets().len()).map(f).sum()
}

#[test]
fn ring_formulas() {
    let c = Collective {
        purpose: Purpose::ForwardGather,
        kind: CollectiveKind::AllGather,
        group: GroupKind::Shard,
        ranks: 4,
        bytes: 4000,
    };
    assert_eq!(c.wire_bytes(), 3000.0);
    assert_eq!(c.ring_steps(), 3);
    let ar = Collective {
        kind: CollectiveKind::AllReduce,
        ..c
    };
    assert_eq!(ar.wire_bytes(), 6000.0);
    assert_eq!(ar.ring_steps(), 6);
    // 8 Gbit/s = 1e9 B/s, 1 µs per step.
    let links = Links::from_gbps(8, 8.0, 8.0, 1.0, 1.0);
    let mesh = Mesh::flat(4).unwrap();
    assert!((c.seconds(mesh, &links) - (3000.0 / 1e9 + 3e-6)).abs() < 1e-15);
    let alone = Collective { ranks: 1, ..c };
    assert_eq!(alone.seconds(mesh, &links), 0.0);
}

#[test]
fn groups_within_or_across_nodes() {
    let links = Links::from_gbps(8, 100.0, 10.0, 1.0, 5.0);
    let mesh = Mesh::new(4, 8).unwrap();
    assert!(links.within_node(mesh, GroupKind::Shard));
    assert!(!links.within_node(mesh, GroupKind::Replica));
    assert!(!links.within_node(mesh, GroupKind::World));
    assert_eq!(links.link_of(mesh, GroupKind::Shard).0, 100e9 / 8.0);
    assert_eq!(links.link_of(mesh, GroupKind::Replica).0, 10e9 / 8.0);
    let small = Mesh::new(2, 4).unwrap();
    assert!(links.within_node(small, GroupKind::World));
    assert!(links.within_node(small, GroupKind::Replica));
    let flat = Mesh::flat(16).unwrap();
    assert!(!links.within_node(flat, GroupKind::Shard));
}

#[test]
fn flat_sharding_gathers_and_reduces_every_bucket_once() {
    let plan = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Bf16);
    let t = StepTraffic::of(&plan, TrafficOptions::default());
    let buffers = total(&plan, |b| plan.buffer_bytes(b));
    assert_eq!(t.gathered_bytes(), buffers - buffers / 4);
    // bf16 runtime: one fp32 gradient element per 2-byte runtime element.
    assert_eq!(t.reduced_bytes(), 2 * buffers);
    assert_eq!(
        t.wire_bytes(Purpose::ForwardGather),
        (buffers * 3 / 4) as f64
    );
    // One replica: the replica reductions and rebuilds move nothing.
    let links = Links::from_gbps(8, 8.0, 8.0, 0.0, 0.0);
    let time = t.time(plan.mesh(), &links);
    assert_eq!(time.shard_rebuild, 0.0);
    let expected = (buffers * 3 / 4 + 2 * buffers * 3 / 4) as f64 / 1e9;
    assert!((time.total() - expected).abs() < 1e-12);
}

#[test]
fn resharding_gathers_all_but_the_last_bucket_again() {
    let plan = plan(1, 2, Sharding::Hierarchical, RuntimeFormat::F32);
    assert!(plan.buckets().len() > 2);
    let options = TrafficOptions {
        reshard_after_forward: true,
        ..Default::default()
    };
    let t = StepTraffic::of(&plan, options);
    let last = plan.buckets().len() - 1;
    let buffers = total(&plan, |b| plan.buffer_bytes(b));
    let again = buffers - plan.buffer_bytes(last);
    assert_eq!(t.gathered_bytes(), (buffers + again) / 2);
}

#[test]
fn hierarchical_hsdp_and_ddp_differ_in_replica_traffic() {
    let links = Links::from_gbps(2, 800.0, 80.0, 0.0, 0.0);
    let hier = plan(2, 2, Sharding::Hierarchical, RuntimeFormat::Bf16);
    let hsdp = plan(2, 2, Sharding::Hsdp, RuntimeFormat::Bf16);
    let ddp = plan(2, 2, Sharding::Ddp, RuntimeFormat::Bf16);
    let (th, ts, td) = (
        StepTraffic::of(&hier, TrafficOptions::default()),
        StepTraffic::of(&hsdp, TrafficOptions::default()),
        StepTraffic::of(&ddp, TrafficOptions::default()),
    );
    // Replica step: hierarchical reduce-scatters (G/S)/2 per rank and re-gathers a quarter of
    // the runtime bytes; HSDP all-reduces (twice the reduce-scatter, no rebuild).
    let replica_rs: f64 = th
        .collectives
        .iter()
        .filter(|c| c.group == GroupKind::Replica && c.purpose == Purpose::GradientReduction)
        .map(Collective::wire_bytes)
        .sum();
    let replica_ar: f64 = ts
        .collectives
        .iter()
        .filter(|c| c.group == GroupKind::Replica)
        .map(Collective::wire_bytes)
        .sum();
    assert!(replica_rs > 0.0 && replica_rs <= replica_ar / 2.0 + 64.0);
    assert!(th.wire_bytes(Purpose::ShardRebuild) > 0.0);
    assert_eq!(ts.wire_bytes(Purpose::ShardRebuild), 0.0);
    // DDP: no gathers, one world all-reduce of every gradient.
    assert_eq!(td.gathered_bytes(), 0);
    let buffers = total(&ddp, |b| ddp.buffer_bytes(b));
    assert_eq!(td.reduced_bytes(), 2 * buffers);
    assert!(td.time(ddp.mesh(), &links).gradient_reduction > 0.0);
}

#[test]
fn muon_exchange_all_reduces_split_matrices_twice() {
    let plan = plan(1, 8, Sharding::Hierarchical, RuntimeFormat::F32);
    let split: u64 = plan
        .params()
        .iter()
        .filter(|p| p.spec.role == Role::Matrix && p.split)
        .map(|p| p.spec.numel())
        .sum();
    assert!(split > 0);
    let options = TrafficOptions {
        muon_exchange: Some(MuonExchange::AllReduce),
        ..Default::default()
    };
    let t = StepTraffic::of(&plan, options);
    let exchange: Vec<_> = t
        .collectives
        .iter()
        .filter(|c| c.purpose == Purpose::MuonExchange)
        .collect();
    assert_eq!(exchange.len(), 2);
    assert!(exchange
        .iter()
        .all(|c| c.bytes == 4 * split && c.ranks == 8));
    let without = StepTraffic::of(&plan, TrafficOptions::default());
    assert_eq!(without.wire_bytes(Purpose::MuonExchange), 0.0);
}

/// Owners are taken among a split matrix's holders where balance allows: the exchange stays
/// within the bound `2·P·(W−1)/W` (+10 %) at world 2, 4 and 8.
#[test]
fn the_owner_exchange_stays_within_its_bound() {
    for (w, layers) in [2, 4, 8].into_iter().flat_map(|w| [(w, 2), (w, 12)]) {
        // GPT-small shapes with 4M-element buckets (as `cargo bench --bench optim`, which has 2
        // layers): pieces cut many of its 768×768 and 768×3072 matrices.
        let shape = crate::presets::TransformerShape {
            layers,
            ..crate::presets::TransformerShape::gpt_small()
        };
        let config = PlanConfig::default().with_bucket_elements(4_000_000);
        let plan = Plan::build(shape.specs(DType::F32), Mesh::flat(w).unwrap(), config).unwrap();
        let split = SplitMatrices::of(&plan);
        let p = 4.0 * split.elements as f64;
        let moved = 2.0 * 4.0 * split.off_owner as f64;
        let bound = 2.0 * p * (w as f64 - 1.0) / w as f64;
        assert!(
            split.elements > 0,
            "world {w}, {layers} layers: no split matrix"
        );
        assert!(
            moved <= 1.1 * bound,
            "world {w}, {layers} layers: {moved} bytes against the bound {bound}"
        );
    }
}

/// A matrix cut 30 / 70 by the only piece boundary, with nothing else to balance: its owner
/// is the piece holding 70 % of it (plain LPT took the lowest index, moving 70 % each way).
#[test]
fn a_split_matrix_is_owned_by_its_biggest_holder_when_balance_allows() {
    let specs = vec![
        ParamSpec::new("norm", vec![4000], DType::F32).with_order(0),
        ParamSpec::new("w", vec![100, 100], DType::F32).with_order(1),
    ];
    let config = PlanConfig::default().with_bucket_elements(1_000_000);
    let plan = Plan::build(specs, Mesh::flat(2).unwrap(), config).unwrap();
    let w = &plan.params()[1];
    assert!(w.split, "the boundary cuts the matrix");
    let rows_in = |piece: usize| -> u64 {
        plan.buckets()[w.bucket].views[piece]
            .iter()
            .filter(|v| v.param == 1)
            .map(|v| v.len())
            .sum()
    };
    assert!(rows_in(1) > rows_in(0), "{} vs {}", rows_in(1), rows_in(0));
    assert_eq!(w.ns_owner, Some(1));
    assert_eq!(SplitMatrices::of(&plan).off_owner, rows_in(0));
}

#[test]
fn the_owner_exchange_moves_the_rows_outside_each_owner_twice() {
    let plan = plan(1, 8, Sharding::Hierarchical, RuntimeFormat::F32);
    let split = SplitMatrices::of(&plan);
    assert!(split.elements > 0 && split.off_owner > 0 && split.off_owner < split.elements);
    let options = TrafficOptions {
        muon_exchange: Some(MuonExchange::OwnerAllToAll),
        ..Default::default()
    };
    let t = StepTraffic::of(&plan, options);
    let exchange: Vec<_> = t
        .collectives
        .iter()
        .filter(|c| c.purpose == Purpose::MuonExchange)
        .collect();
    assert_eq!(exchange.len(), 2);
    for c in &exchange {
        assert_eq!(
            (c.kind, c.bytes, c.ranks),
            (CollectiveKind::AllToAll, 4 * split.off_owner, 8)
        );
        assert_eq!(c.group_bytes(), (4 * split.off_owner) as f64);
    }
    // Within the bound 2·P·(W−1)/W for P bytes of split matrices, and far below the all-reduce.
    let p = 4.0 * split.elements as f64;
    let owner: f64 = exchange.iter().map(|c| c.group_bytes()).sum();
    assert!(owner <= 2.0 * p * 7.0 / 8.0, "{owner} vs {p}");
    let all_reduce = StepTraffic::of(
        &plan,
        TrafficOptions {
            muon_exchange: Some(MuonExchange::AllReduce),
            ..Default::default()
        },
    );
    let dense: f64 = all_reduce
        .collectives
        .iter()
        .filter(|c| c.purpose == Purpose::MuonExchange)
        .map(|c| c.group_bytes())
        .sum();
    assert!(owner < dense / 2.0, "{owner} vs {dense}");
}

#[test]
fn square_block_mxfp8_gathers_about_half_of_bf16() {
    let bf16 = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Bf16);
    let mx = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Mxfp8);
    let (tb, tm) = (
        StepTraffic::of(&bf16, TrafficOptions::default()),
        StepTraffic::of(&mx, TrafficOptions::default()),
    );
    // One byte per element and one scale per 32 x 32 tile, against bf16's two bytes; pieces
    // padded to the largest (at most one tile more than another).
    let ratio = tm.gathered_bytes() as f64 / tb.gathered_bytes() as f64;
    assert!(ratio > 0.5 && ratio < 0.52, "{ratio}");
    // fp32 gradients either way: the real elements, plus (MXFP8) pieces padded to the
    // largest, which holds at most one tile (plus a few bf16 elements) more than another.
    let elements: u64 = specs().iter().map(|s| s.numel()).sum();
    assert!(tm.reduced_bytes() >= 4 * elements);
    let buckets = mx.buckets().len() as u64;
    assert!(tm.reduced_bytes() <= 4 * (elements + buckets * 4 * 2 * 1024));
}

#[test]
fn square_block_mxfp8_with_resharding_gathers_the_one_copy_again() {
    let (bf16, mx) = (
        plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Bf16),
        plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Mxfp8),
    );
    let options = TrafficOptions {
        reshard_after_forward: true,
        ..Default::default()
    };
    let (whole, again) = (
        StepTraffic::of(&mx, TrafficOptions::default()),
        StepTraffic::of(&mx, options),
    );
    // Backward gathers the same copy forward did (every bucket but the last, still resident):
    // no per-pass planes, and still about half of bf16's bytes.
    let ratio = again.gathered_bytes() as f64 / whole.gathered_bytes() as f64;
    assert!(ratio > 1.0 && ratio < 2.0, "{ratio}");
    let bf16_again = StepTraffic::of(&bf16, options).gathered_bytes() as f64;
    let ratio = again.gathered_bytes() as f64 / bf16_again;
    assert!(ratio > 0.5 && ratio < 0.52, "{ratio}");
}
