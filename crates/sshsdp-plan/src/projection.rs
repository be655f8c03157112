//! Projection of one training step's communication from a [`Plan`]: which collectives run, how
//! many bytes each moves, and how long they take on given links — to size a cluster before
//! having one.
//!
//! # What runs in a step (what `sshsdp-backend` does, bucket by bucket)
//!
//! With `S` ranks per shard group, `R` replicas and a bucket of `B` runtime bytes (the plan's
//! buffer, padding included) and `G` gradient bytes:
//!
//! * **forward gather** — all-gather of the runtime shards over the shard group (`B` bytes out;
//!   each rank receives `B − B/S`); none under DDP (the runtime shard is the whole bucket);
//! * **backward gather** — with resharding after forward, every bucket but the last one of
//!   forward is gathered again in backward (each bucket assumed used once in forward);
//! * **gradient reduction** — hierarchical: reduce-scatter of `G` over the shard group, then of
//!   `G/S` over the replica group; HSDP: reduce-scatter over the shard group, then all-reduce of
//!   `G/S` over the replica group; DDP: all-reduce of `G` over the world;
//! * **shard rebuild** (hierarchical only) — after the update, all-gather of the `B/S` runtime
//!   shard from its `R` re-derived pieces over the replica group;
//! * **Muon exchange** (when modelled) — distributed Muon assembles every split matrix for its
//!   Newton–Schulz owner with one all-reduce of all split matrices' fp32 updates over the update
//!   group and hands the results back with a second one (two all-reduces of
//!   `4 · Σ numel(split matrices)` bytes; matrices lying inside one piece move nothing).
//!
//! Every size comes from the plan's runtime layout, the one the runtime allocates: `B` is the
//! bucket's `pieces × piece_bytes` and `G` its `4 × pieces × piece_elements` (fp32 gradients,
//! padding included). With resharding after forward, an MXFP8 bucket whose runtime shard is one
//! piece gathers only the part of each piece that the pass decodes ([`crate::Part`]: forward the
//! bf16 and column-wise sections, backward the row-wise and bf16 sections — about half the bytes
//! each), and backward gathers *every* such bucket again, the last one of forward included (it
//! holds forward's plane only); without resharding both planes are gathered once and kept.
//! Gradient clipping's and the non-finite check's 8-byte all-gather of a norm is ignored.
//!
//! [`StepTraffic::gathered_bytes`] and [`StepTraffic::reduced_bytes`] use the runtime counters'
//! definitions (`sshsdp_backend::Counters`): bytes received by bucket all-gathers, and bytes of
//! full-bucket gradients entering reductions. The facade's `tests/projection.rs` checks them
//! against real runs at world 2 and 4 (exact equality).
//!
//! # Time model (an estimate, not a measurement)
//!
//! Ring collectives: an all-gather or reduce-scatter of `X` bytes over `n` ranks sends
//! `X·(n−1)/n` bytes per rank in `n−1` steps, an all-reduce twice that in `2(n−1)` steps;
//! time = wire bytes / bandwidth + steps · latency. A group whose ranks all sit in one node uses
//! the intra-node link, any other group the inter-node link (per rank, e.g. one NIC per GPU: a
//! ring across nodes runs at the slowest hop). Nothing overlaps: the step's communication time
//! is the sum, an upper bound on what is exposed when collectives overlap compute. Rings are
//! the conservative choice at large `n` (NCCL switches to trees for small messages, which this
//! model does not).

use serde::{Deserialize, Serialize};

use crate::{Mesh, Part, Plan, Role, Sharding};

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// All-gather: `bytes` is the full output; each rank contributes `bytes / ranks`.
    AllGather,
    /// Reduce-scatter: `bytes` is the full input; each rank keeps `bytes / ranks`.
    ReduceScatter,
    /// All-reduce of a `bytes` buffer.
    AllReduce,
}

/// The ranks a collective runs over (rank 0's group stands for all: the mesh is regular).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    /// One replica's ranks (`shards` consecutive ranks).
    Shard,
    /// The ranks with the same shard index across replicas (stride `shards`).
    Replica,
    /// Every rank.
    World,
}

/// What a collective is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Purpose {
    /// Bucket all-gather in forward.
    ForwardGather,
    /// Bucket all-gather again in backward (resharding after forward).
    BackwardGather,
    /// Gradient reduce-scatter / all-reduce.
    GradientReduction,
    /// All-gather of the re-derived runtime pieces across replicas after the update.
    ShardRebuild,
    /// Distributed Muon's two all-reduces of split matrices.
    MuonExchange,
}

/// One collective of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Collective {
    /// What it is for.
    pub purpose: Purpose,
    /// The operation.
    pub kind: CollectiveKind,
    /// Which ranks take part.
    pub group: GroupKind,
    /// How many ranks take part.
    pub ranks: usize,
    /// Logical size in bytes (see [`CollectiveKind`]).
    pub bytes: u64,
}

impl Collective {
    /// Bytes each rank sends (and receives) on a ring: `bytes·(n−1)/n`, twice that for an
    /// all-reduce.
    pub fn wire_bytes(&self) -> f64 {
        let n = self.ranks.max(1) as f64;
        let one_pass = self.bytes as f64 * (n - 1.0) / n;
        match self.kind {
            CollectiveKind::AllReduce => 2.0 * one_pass,
            _ => one_pass,
        }
    }

    /// Sequential ring steps: `n−1`, or `2(n−1)` for an all-reduce.
    pub fn ring_steps(&self) -> usize {
        let steps = self.ranks.saturating_sub(1);
        match self.kind {
            CollectiveKind::AllReduce => 2 * steps,
            _ => steps,
        }
    }

    /// Seconds on `links` for a collective over `mesh` (ring model, see the module docs).
    pub fn seconds(&self, mesh: Mesh, links: &Links) -> f64 {
        if self.ranks <= 1 {
            return 0.0;
        }
        let (bandwidth, latency) = links.link_of(mesh, self.group);
        self.wire_bytes() / bandwidth + self.ring_steps() as f64 * latency
    }
}

/// Which optional parts of a step to model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficOptions {
    /// Buckets are released after forward and gathered again in backward.
    pub reshard_after_forward: bool,
    /// Distributed Muon's exchange of split matrices is included.
    pub muon_exchange: bool,
}

/// Every collective of one training step of a plan, for one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepTraffic {
    /// The collectives in issue order (forward gathers, backward gathers, reductions, update).
    pub collectives: Vec<Collective>,
}

/// The sizes of one bucket that its collectives move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketBytes {
    /// Bytes of the full runtime buffer (`B`), a multiple of the update group's size.
    pub runtime: u64,
    /// Bytes a forward and a backward gather move when each pass gathers only what it decodes
    /// (MXFP8 with one piece per runtime shard); `None` when a gather moves the whole buffer.
    pub per_pass: Option<(u64, u64)>,
    /// fp32 elements of the full-bucket gradient (`G / 4`), a multiple of the update group's
    /// size.
    pub gradient_elements: u64,
}

impl BucketBytes {
    /// Every bucket of `plan`, sized as the plan lays it out.
    pub fn of_plan(plan: &Plan) -> Vec<Self> {
        let pieces = plan.pieces() as u64;
        plan.buckets()
            .iter()
            .map(|bucket| {
                let part = |p: Part| {
                    let r = bucket.part_range(p);
                    pieces * (r.end - r.start)
                };
                Self {
                    runtime: pieces * bucket.piece_bytes,
                    per_pass: (bucket.has_planes() && plan.pieces_per_shard() == 1)
                        .then(|| (part(Part::Forward), part(Part::Backward))),
                    gradient_elements: pieces * bucket.piece_elements,
                }
            })
            .collect()
    }
}

impl StepTraffic {
    /// The collectives `plan`'s runtime issues in one step (see the module docs).
    pub fn of(plan: &Plan, options: TrafficOptions) -> Self {
        let split: u64 = plan
            .params()
            .iter()
            .filter(|p| p.spec.role == Role::Matrix && p.split)
            .map(|p| p.spec.numel())
            .sum();
        Self::from_buckets(
            plan.mesh(),
            plan.config().sharding,
            &BucketBytes::of_plan(plan),
            split,
            options,
        )
    }

    /// The collectives of one step over `mesh` for buckets of the given sizes (in forward
    /// order), with `split_matrix_elements` elements of matrices split across pieces (Muon's
    /// exchange). [`StepTraffic::of`] takes all of it from a plan; this is for sizes measured
    /// or scaled otherwise.
    pub fn from_buckets(
        mesh: Mesh,
        sharding: Sharding,
        buckets: &[BucketBytes],
        split_matrix_elements: u64,
        options: TrafficOptions,
    ) -> Self {
        let (r, s, world) = (mesh.replicas(), mesh.shards(), mesh.world_size());
        let mut collectives = Vec::new();
        let mut push = |purpose, kind, group, ranks, bytes| {
            collectives.push(Collective {
                purpose,
                kind,
                group,
                ranks,
                bytes,
            })
        };
        use CollectiveKind::*;
        use GroupKind::*;
        use Purpose::*;
        if sharding != Sharding::Ddp {
            let reshard = options.reshard_after_forward;
            for b in buckets {
                let bytes = match b.per_pass {
                    Some((forward, _)) if reshard => forward,
                    _ => b.runtime,
                };
                push(ForwardGather, AllGather, Shard, s, bytes);
            }
            if reshard {
                // The last bucket of forward is the first of backward: it stays resident, unless
                // forward gathered only its own plane.
                for (i, b) in buckets.iter().enumerate().rev() {
                    match b.per_pass {
                        Some((_, backward)) => push(BackwardGather, AllGather, Shard, s, backward),
                        None if i + 1 < buckets.len() => {
                            push(BackwardGather, AllGather, Shard, s, b.runtime)
                        }
                        None => {}
                    }
                }
            }
        }
        for b in buckets.iter().rev() {
            let g = 4 * b.gradient_elements;
            match sharding {
                Sharding::Hierarchical => {
                    push(GradientReduction, ReduceScatter, Shard, s, g);
                    push(GradientReduction, ReduceScatter, Replica, r, g / s as u64);
                }
                Sharding::Hsdp => {
                    push(GradientReduction, ReduceScatter, Shard, s, g);
                    push(GradientReduction, AllReduce, Replica, r, g / s as u64);
                }
                Sharding::Ddp => push(GradientReduction, AllReduce, World, world, g),
            }
        }
        if sharding == Sharding::Hierarchical {
            for b in buckets {
                push(ShardRebuild, AllGather, Replica, r, b.runtime / s as u64);
            }
        }
        if options.muon_exchange {
            let (group, ranks) = match sharding {
                Sharding::Hierarchical => (World, world),
                Sharding::Hsdp => (Shard, s),
                Sharding::Ddp => (World, 1),
            };
            if split_matrix_elements > 0 && ranks > 1 {
                let bytes = 4 * split_matrix_elements;
                push(MuonExchange, AllReduce, group, ranks, bytes);
                push(MuonExchange, AllReduce, group, ranks, bytes);
            }
        }
        Self { collectives }
    }

    /// Bytes received by bucket all-gathers in forward and backward: the runtime's
    /// `Counters::gathered_bytes` (`B − B/S` per gather).
    pub fn gathered_bytes(&self) -> u64 {
        self.collectives
            .iter()
            .filter(|c| matches!(c.purpose, Purpose::ForwardGather | Purpose::BackwardGather))
            .map(|c| c.bytes - c.bytes / c.ranks as u64)
            .sum()
    }

    /// Bytes of full-bucket gradients entering reductions: the runtime's
    /// `Counters::reduced_bytes` (the first reduction of each bucket, `G`).
    pub fn reduced_bytes(&self) -> u64 {
        let first_level = |c: &&Collective| {
            c.purpose == Purpose::GradientReduction && c.group != GroupKind::Replica
        };
        self.collectives
            .iter()
            .filter(first_level)
            .map(|c| c.bytes)
            .sum()
    }

    /// Bytes each rank sends on a ring for collectives of `purpose`.
    pub fn wire_bytes(&self, purpose: Purpose) -> f64 {
        self.collectives
            .iter()
            .filter(|c| c.purpose == purpose)
            .map(Collective::wire_bytes)
            .sum()
    }

    /// Seconds of communication by purpose on `links` (nothing overlapped).
    pub fn time(&self, mesh: Mesh, links: &Links) -> CommTime {
        let mut t = CommTime::default();
        for c in &self.collectives {
            let secs = c.seconds(mesh, links);
            match c.purpose {
                Purpose::ForwardGather => t.forward_gather += secs,
                Purpose::BackwardGather => t.backward_gather += secs,
                Purpose::GradientReduction => t.gradient_reduction += secs,
                Purpose::ShardRebuild => t.shard_rebuild += secs,
                Purpose::MuonExchange => t.muon_exchange += secs,
            }
        }
        t
    }
}

/// Seconds of one step's communication, by purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CommTime {
    /// Forward bucket all-gathers.
    pub forward_gather: f64,
    /// Backward bucket all-gathers (resharding after forward).
    pub backward_gather: f64,
    /// Gradient reduce-scatters and all-reduces.
    pub gradient_reduction: f64,
    /// Replica all-gathers rebuilding runtime shards after the update.
    pub shard_rebuild: f64,
    /// Distributed Muon's exchange of split matrices.
    pub muon_exchange: f64,
}

impl CommTime {
    /// All of it, nothing overlapped.
    pub fn total(&self) -> f64 {
        self.forward_gather
            + self.backward_gather
            + self.gradient_reduction
            + self.shard_rebuild
            + self.muon_exchange
    }
}

/// Link bandwidths and latencies of a cluster of equal nodes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// Ranks (GPUs) per node.
    pub ranks_per_node: usize,
    /// Bytes per second each rank sends within a node.
    pub intra_bytes_per_s: f64,
    /// Bytes per second each rank sends to other nodes.
    pub inter_bytes_per_s: f64,
    /// Seconds per ring step within a node.
    pub intra_latency_s: f64,
    /// Seconds per ring step across nodes.
    pub inter_latency_s: f64,
}

impl Links {
    /// Links from bandwidths in Gbit/s per rank and latencies in microseconds.
    pub fn from_gbps(
        ranks_per_node: usize,
        intra_gbps: f64,
        inter_gbps: f64,
        intra_latency_us: f64,
        inter_latency_us: f64,
    ) -> Self {
        Self {
            ranks_per_node: ranks_per_node.max(1),
            intra_bytes_per_s: intra_gbps * 1e9 / 8.0,
            inter_bytes_per_s: inter_gbps * 1e9 / 8.0,
            intra_latency_s: intra_latency_us * 1e-6,
            inter_latency_s: inter_latency_us * 1e-6,
        }
    }

    /// Whether rank 0's `group` of `mesh` lies within one node.
    pub fn within_node(&self, mesh: Mesh, group: GroupKind) -> bool {
        let last_rank = match group {
            GroupKind::Shard => mesh.shards() - 1,
            GroupKind::Replica => (mesh.replicas() - 1) * mesh.shards(),
            GroupKind::World => mesh.world_size() - 1,
        };
        last_rank < self.ranks_per_node
    }

    /// `(bytes per second, seconds per step)` of the link `group` runs over.
    pub fn link_of(&self, mesh: Mesh, group: GroupKind) -> (f64, f64) {
        if self.within_node(mesh, group) {
            (self.intra_bytes_per_s, self.intra_latency_s)
        } else {
            (self.inter_bytes_per_s, self.inter_latency_s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, ParamSpec, PlanConfig, RuntimeFormat};

    fn specs() -> Vec<ParamSpec> {
        (0..6)
            .flat_map(|l| {
                [
                    ParamSpec::new(format!("l{l}.w"), vec![256, 512], DType::F32).with_order(2 * l),
                    ParamSpec::new(format!("l{l}.norm"), vec![256], DType::F32)
                        .with_order(2 * l + 1),
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
            muon_exchange: true,
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

    #[test]
    fn mxfp8_with_both_planes_gathers_about_as_much_as_bf16() {
        let bf16 = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Bf16);
        let mx = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Mxfp8);
        let (tb, tm) = (
            StepTraffic::of(&bf16, TrafficOptions::default()),
            StepTraffic::of(&mx, TrafficOptions::default()),
        );
        // Both planes with their scales: 2 · 33/32 bytes per element against bf16's 2.
        let ratio = tm.gathered_bytes() as f64 / tb.gathered_bytes() as f64;
        assert!(ratio > 1.0 && ratio < 66.0 / 64.0 + 0.01, "{ratio}");
        // fp32 gradients either way: the real elements, plus (MXFP8) pieces padded to the
        // largest, which holds at most one band (32 × 512 elements) more than another.
        let elements: u64 = specs().iter().map(|s| s.numel()).sum();
        assert!(tm.reduced_bytes() >= 4 * elements);
        let buckets = mx.buckets().len() as u64;
        assert!(tm.reduced_bytes() <= 4 * (elements + buckets * 4 * 32 * 512));
    }

    #[test]
    fn mxfp8_with_resharding_gathers_each_pass_its_own_plane() {
        let mx = plan(1, 4, Sharding::Hierarchical, RuntimeFormat::Mxfp8);
        let options = TrafficOptions {
            reshard_after_forward: true,
            ..Default::default()
        };
        let (whole, split) = (
            StepTraffic::of(&mx, TrafficOptions::default()),
            StepTraffic::of(&mx, options),
        );
        // Forward and backward each gather about half of both planes, every bucket.
        let ratio = split.gathered_bytes() as f64 / whole.gathered_bytes() as f64;
        assert!(ratio > 0.95 && ratio < 1.1, "{ratio}");
        let backward = split
            .collectives
            .iter()
            .filter(|c| c.purpose == Purpose::BackwardGather)
            .count();
        assert_eq!(backward, mx.buckets().len());
    }
}
