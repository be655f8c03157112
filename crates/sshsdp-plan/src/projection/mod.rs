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
//! * **Muon exchange** (when modelled, [`MuonExchange`]) — distributed Muon brings every split
//!   matrix to its Newton–Schulz owner and the result back. [`MuonExchange::OwnerAllToAll`]
//!   (the default): two all-to-all-v over the update group, each moving the fp32 rows that lie
//!   outside the owner's piece (`4 · Σ (numel − owner's rows)` bytes in the whole group, about
//!   `2·P·(W−1)/W` over both for `P` bytes of split matrices); [`MuonExchange::AllReduce`]: two
//!   all-reduces of `4 · Σ numel(split matrices)` bytes. Matrices inside one piece move nothing.
//!
//! Every size comes from the plan's runtime layout, the one the runtime allocates: `B` is the
//! bucket's `pieces × piece_bytes` and `G` its `4 × pieces × piece_elements` (fp32 gradients,
//! padding included). Every format of the plan serves both passes with the same bytes
//! (square-block MXFP8 included), so a gather moves the whole piece; with resharding after
//! forward, backward gathers every bucket again but the last one of forward.
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

use crate::{Mesh, Plan, Role, Sharding};

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// All-gather: `bytes` is the full output; each rank contributes `bytes / ranks`.
    AllGather,
    /// Reduce-scatter: `bytes` is the full input; each rank keeps `bytes / ranks`.
    ReduceScatter,
    /// All-reduce of a `bytes` buffer.
    AllReduce,
    /// All-to-all with per-peer counts: `bytes` is what the group's ranks send each other in
    /// all (their own chunks excluded).
    AllToAll,
}

/// How distributed Muon exchanges the matrices that piece boundaries split (what
/// `sshsdp_optim::ShardedMuon` runs, and what the projection models).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MuonExchange {
    /// Two all-to-all-v per step: each holder sends its rows of a split matrix to the matrix's
    /// Newton–Schulz owner only, and the owner sends each holder its rows of the result (about
    /// `2·P·(W−1)/W` bytes in the whole update group for `P` bytes of split matrices).
    #[default]
    OwnerAllToAll,
    /// Two dense all-reduces of every split matrix over the update group (each rank moves about
    /// `4·P·(W−1)/W`): the earlier exchange, kept as a baseline.
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
    /// Distributed Muon's exchange of split matrices (two all-to-all-v or two all-reduces).
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
    /// all-reduce; for an all-to-all, the group's bytes over its ranks (an even spread: owners
    /// are balanced by Newton–Schulz work, not bytes, so the busiest rank may send more).
    pub fn wire_bytes(&self) -> f64 {
        let n = self.ranks.max(1) as f64;
        let one_pass = self.bytes as f64 * (n - 1.0) / n;
        match self.kind {
            CollectiveKind::AllReduce => 2.0 * one_pass,
            CollectiveKind::AllToAll => self.bytes as f64 / n,
            _ => one_pass,
        }
    }

    /// Bytes all the group's ranks send in all ([`Self::wire_bytes`] times the ranks).
    pub fn group_bytes(&self) -> f64 {
        self.wire_bytes() * self.ranks.max(1) as f64
    }

    /// Sequential steps: `n−1` on a ring (or pairwise for an all-to-all), `2(n−1)` for an
    /// all-reduce.
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
    /// Distributed Muon's exchange of split matrices, when it is modelled.
    pub muon_exchange: Option<MuonExchange>,
}

/// The matrices a plan's piece boundaries split, as Muon's exchange moves them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitMatrices {
    /// Their elements.
    pub elements: u64,
    /// Of those, the elements outside their Newton–Schulz owner's piece (what the owner
    /// all-to-all moves each way).
    pub off_owner: u64,
}

impl SplitMatrices {
    /// The split Muon matrices of `plan`.
    pub fn of(plan: &Plan) -> Self {
        let mut out = Self::default();
        for (i, p) in plan.params().iter().enumerate() {
            if p.spec.role != Role::Matrix || !p.split {
                continue;
            }
            out.elements += p.spec.numel();
            let views = &plan.buckets()[p.bucket].views;
            out.off_owner += views
                .iter()
                .enumerate()
                .filter(|&(q, _)| Some(q) != p.ns_owner)
                .flat_map(|(_, vs)| vs.iter().filter(|v| v.param == i))
                .map(|v| v.len())
                .sum::<u64>();
        }
        out
    }
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
            .map(|bucket| Self {
                runtime: pieces * bucket.piece_bytes,
                gradient_elements: pieces * bucket.piece_elements,
            })
            .collect()
    }
}

impl StepTraffic {
    /// The collectives `plan`'s runtime issues in one step (see the module docs).
    pub fn of(plan: &Plan, options: TrafficOptions) -> Self {
        Self::from_buckets(
            plan.mesh(),
            plan.config().sharding,
            &BucketBytes::of_plan(plan),
            SplitMatrices::of(plan),
            options,
        )
    }

    /// The collectives of one step over `mesh` for buckets of the given sizes (in forward
    /// order), with `split` the matrices split across pieces (Muon's exchange).
    /// [`StepTraffic::of`] takes all of it from a plan; this is for sizes measured or scaled
    /// otherwise.
    pub fn from_buckets(
        mesh: Mesh,
        sharding: Sharding,
        buckets: &[BucketBytes],
        split: SplitMatrices,
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
                push(ForwardGather, AllGather, Shard, s, b.runtime);
            }
            if reshard {
                // The last bucket of forward is the first of backward: it stays resident.
                for b in buckets.iter().rev().skip(1) {
                    push(BackwardGather, AllGather, Shard, s, b.runtime);
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
        if let Some(exchange) = options.muon_exchange {
            let (group, ranks) = match sharding {
                Sharding::Hierarchical => (World, world),
                Sharding::Hsdp => (Shard, s),
                Sharding::Ddp => (World, 1),
            };
            if split.elements > 0 && ranks > 1 {
                let (kind, bytes) = match exchange {
                    self::MuonExchange::OwnerAllToAll => (AllToAll, 4 * split.off_owner),
                    self::MuonExchange::AllReduce => (AllReduce, 4 * split.elements),
                };
                push(MuonExchange, kind, group, ranks, bytes);
                push(MuonExchange, kind, group, ranks, bytes);
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
mod tests;
