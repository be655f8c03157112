//! [`Plan::build`]: from parameter specs, a mesh and a config to the runtime layout, update
//! ownership and Newton–Schulz owners that every rank computes identically.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::layout::{self, Bucket, PlannedParam, UpdateView};
use crate::memory::{MemoryReport, RankMemory};
use crate::mesh::check_index;
use crate::owners;
use crate::{format, spec, Mesh, ParamSpec, PlanConfig, PlanError, Role, Sharding};

/// Version of the plan algorithm and its serialized form; part of the fingerprint. Version 4:
/// the layout of version 3 (square-block MXFP8 tiles cut at tile edges; version 2 had two 1×32
/// planes of 32-row bands) without the always-empty per-pass sections in its buckets, so its
/// fingerprints differ.
pub const PLAN_VERSION: u32 = 4;

/// The most elements all parameters of a plan may hold together: 2^48 (a hundred times the
/// largest models), so that every byte count the layout derives from them (at most 4 bytes per
/// element, plus tile scales and alignment) fits 64 bits.
pub const MAX_TOTAL_ELEMENTS: u64 = 1 << 48;

/// The most `pieces × parameters` a plan may lay out: 2^24, e.g. 16384 ranks × 1024
/// parameters, or 2^20 ranks × 16. The layout examines every parameter of a bucket for every
/// piece and keeps one view list per piece and bucket (24 bytes each), so this bounds both the
/// planning time (about a second at the limit) and its memory (about 400 MiB), whatever a plan
/// file claims; it is checked before anything is allocated.
pub const MAX_LAYOUT_VIEWS: u64 = 1 << 24;

/// SHA-256 of a plan's canonical serialization: equal on every rank that planned the same
/// model the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A parameter whose requested runtime format could not hold it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fallback {
    /// Parameter path.
    pub path: String,
    /// Why it fell back (it uses bf16 instead).
    pub reason: String,
}

/// The complete layout of a model over a mesh. See the crate docs for the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    mesh: Mesh,
    config: PlanConfig,
    pieces: usize,
    params: Vec<PlannedParam>,
    buckets: Vec<Bucket>,
    fallbacks: Vec<Fallback>,
    piece_load: Vec<u128>,
    fingerprint: Fingerprint,
}

/// What a saved plan file holds: the inputs and the fingerprint of their plan.
#[derive(Serialize, Deserialize)]
struct PlanFile {
    version: u32,
    mesh: Mesh,
    config: PlanConfig,
    specs: Vec<ParamSpec>,
    fingerprint: String,
}

impl Plan {
    /// Plans `specs` (in any order) over `mesh` with `config`.
    ///
    /// The specs are put in canonical order (execution order where given, then natural path
    /// order), so ranks that discovered parameters in different orders get the same plan.
    /// Sizes are checked before anything is allocated: at most [`MAX_TOTAL_ELEMENTS`] elements
    /// and [`MAX_LAYOUT_VIEWS`] pieces × parameters ([`PlanError::TooLarge`]).
    pub fn build(
        specs: impl IntoIterator<Item = ParamSpec>,
        mesh: Mesh,
        config: PlanConfig,
    ) -> Result<Self, PlanError> {
        config.validate()?;
        let mut specs: Vec<ParamSpec> = specs.into_iter().collect();
        if specs.is_empty() {
            return Err(PlanError::NoParameters);
        }
        let mut seen = HashSet::with_capacity(specs.len());
        for s in &specs {
            s.validate()?;
            if !seen.insert(s.path.as_str()) {
                return Err(PlanError::DuplicatePath(s.path.clone()));
            }
        }
        let elements: u128 = specs.iter().map(|s| u128::from(s.numel())).sum();
        if elements > u128::from(MAX_TOTAL_ELEMENTS) {
            return Err(PlanError::TooLarge {
                what: "the parameters' total element count",
                value: elements,
                limit: MAX_TOTAL_ELEMENTS.into(),
            });
        }
        let pieces = pieces_for(&mesh, config.sharding);
        let views = pieces as u128 * specs.len() as u128;
        if views > u128::from(MAX_LAYOUT_VIEWS) {
            return Err(PlanError::TooLarge {
                what: "pieces × parameters",
                value: views,
                limit: MAX_LAYOUT_VIEWS.into(),
            });
        }
        specs.sort_by(spec::canonical_cmp);

        let mut fallbacks = Vec::new();
        let resolved = specs
            .into_iter()
            .map(|s| {
                let (fmt, why) =
                    format::resolve_format(&s, config.runtime_format, config.mx_max_padding);
                if let Some(reason) = why {
                    fallbacks.push(Fallback {
                        path: s.path.clone(),
                        reason,
                    });
                }
                (s, fmt)
            })
            .collect();
        let (mut params, buckets) = layout::place(resolved, &config, pieces);
        let piece_load = owners::assign(&mut params, &buckets, pieces);
        let mut plan = Self {
            mesh,
            config,
            pieces,
            params,
            buckets,
            fallbacks,
            piece_load,
            fingerprint: Fingerprint([0; 32]),
        };
        plan.fingerprint = plan.compute_fingerprint();
        Ok(plan)
    }

    fn compute_fingerprint(&self) -> Fingerprint {
        let canonical = serde_json::to_vec(&(
            PLAN_VERSION,
            &self.mesh,
            &self.config,
            &self.params,
            &self.buckets,
        ))
        .expect("plan types serialize infallibly");
        Fingerprint(Sha256::digest(&canonical).into())
    }

    /// The fingerprint ranks compare at startup.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Checks a peer's fingerprint against ours.
    pub fn check_fingerprint(&self, peer: &Fingerprint) -> Result<(), PlanError> {
        if *peer == self.fingerprint {
            Ok(())
        } else {
            Err(PlanError::FingerprintMismatch {
                stored: peer.to_string(),
                rebuilt: self.fingerprint.to_string(),
            })
        }
    }

    /// The mesh planned for.
    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    /// The config planned with.
    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    /// Parameters in plan order.
    pub fn params(&self) -> &[PlannedParam] {
        &self.params
    }

    /// The index of the parameter at `path`.
    pub fn param_index(&self, path: &str) -> Option<usize> {
        self.params.iter().position(|p| p.spec.path == path)
    }

    /// Buckets in plan order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Parameters that fell back from the requested runtime format.
    pub fn fallbacks(&self) -> &[Fallback] {
        &self.fallbacks
    }

    /// Pieces per bucket: the size of the update group (world, shard group or 1).
    pub fn pieces(&self) -> usize {
        self.pieces
    }

    /// Runtime shards per bucket: the shard-group size, or 1 under DDP.
    pub fn runtime_shards(&self) -> usize {
        match self.config.sharding {
            Sharding::Ddp => 1,
            _ => self.mesh.shards(),
        }
    }

    /// Consecutive pieces forming one runtime shard.
    pub fn pieces_per_shard(&self) -> usize {
        self.pieces / self.runtime_shards()
    }

    /// Bytes of bucket `b`'s full buffer.
    pub fn buffer_bytes(&self, b: usize) -> u64 {
        self.buckets[b].piece_bytes * self.pieces as u64
    }

    /// The piece (update shard) `rank` owns.
    ///
    /// Hierarchical: piece `shard · replicas + replica`, so the pieces of the ranks in one
    /// replica group are consecutive and form that shard index's runtime shard. HSDP: piece
    /// `shard`. DDP: piece 0.
    pub fn piece_of(&self, rank: usize) -> Result<usize, PlanError> {
        let (replica, shard) = self.mesh.coords(rank)?;
        Ok(match self.config.sharding {
            Sharding::Hierarchical => shard * self.mesh.replicas() + replica,
            Sharding::Hsdp => shard,
            Sharding::Ddp => 0,
        })
    }

    /// The ranks holding `piece` (one rank, or a replica group / the world when replicated).
    pub fn ranks_of_piece(&self, piece: usize) -> Result<Vec<usize>, PlanError> {
        check_index("piece", piece, self.pieces)?;
        let m = self.mesh;
        Ok(match self.config.sharding {
            Sharding::Hierarchical => {
                vec![m.rank_of(piece % m.replicas(), piece / m.replicas())?]
            }
            Sharding::Hsdp => (0..m.replicas())
                .map(|r| m.rank_of(r, piece))
                .collect::<Result<_, _>>()?,
            Sharding::Ddp => (0..m.world_size()).collect(),
        })
    }

    /// The runtime shard `rank` keeps between steps.
    pub fn runtime_shard_of(&self, rank: usize) -> Result<usize, PlanError> {
        Ok(self.piece_of(rank)? / self.pieces_per_shard())
    }

    /// The update views of `piece` in bucket `b`: the parts of its parameters that piece holds,
    /// in parameter order.
    pub fn piece_views(&self, b: usize, piece: usize) -> Result<&[UpdateView], PlanError> {
        check_index("bucket", b, self.buckets.len())?;
        check_index("piece", piece, self.pieces)?;
        Ok(&self.buckets[b].views[piece])
    }

    /// All update views of `rank`'s piece, bucket by bucket.
    pub fn update_views(&self, rank: usize) -> Result<Vec<&UpdateView>, PlanError> {
        let piece = self.piece_of(rank)?;
        Ok(self
            .buckets
            .iter()
            .flat_map(|b| b.views[piece].iter())
            .collect())
    }

    /// The views of parameter `index`, piece by piece (one unless the parameter is split).
    pub fn param_views(&self, index: usize) -> Result<Vec<&UpdateView>, PlanError> {
        check_index("parameter", index, self.params.len())?;
        Ok(self.buckets[self.params[index].bucket]
            .views
            .iter()
            .flatten()
            .filter(|v| v.param == index)
            .collect())
    }

    /// Newton–Schulz cost assigned to each piece.
    pub fn owner_load(&self) -> &[u128] {
        &self.piece_load
    }

    /// Summary numbers: sizes, padding, splits and owner balance.
    pub fn stats(&self) -> PlanStats {
        let region_bytes: u64 = self.params.iter().map(|p| p.runtime_bytes).sum();
        let buffer_bytes: u64 = (0..self.buckets.len()).map(|b| self.buffer_bytes(b)).sum();
        let costs: Vec<u128> = self.params.iter().map(owners::param_cost).collect();
        let total_cost: u128 = costs.iter().sum();
        let mean = total_cost as f64 / self.pieces as f64;
        let ratio = |x: f64| if mean > 0.0 { x / mean } else { 1.0 };
        let max_load = self.piece_load.iter().copied().max().unwrap_or(0) as f64;
        let max_unit = costs.iter().copied().max().unwrap_or(0) as f64;
        let matrices = self.params.iter().filter(|p| p.spec.role == Role::Matrix);
        PlanStats {
            params: self.params.len(),
            buckets: self.buckets.len(),
            elements: self.params.iter().map(|p| p.spec.numel()).sum(),
            region_bytes,
            buffer_bytes,
            padding_bytes: buffer_bytes - region_bytes,
            matrices: matrices.clone().count(),
            split_matrices: matrices.clone().filter(|p| p.split).count(),
            split_matrices_owned_locally: self
                .buckets
                .iter()
                .flat_map(|b| b.views.iter().flatten())
                .filter(|v| {
                    let p = &self.params[v.param];
                    p.split && p.spec.role == Role::Matrix && p.ns_owner == Some(v.piece)
                })
                .count(),
            fallbacks: self.fallbacks.len(),
            owner_load_max_over_mean: ratio(max_load),
            owner_load_lower_bound: ratio(max_unit.max(mean)),
        }
    }

    /// Per-rank memory by category.
    pub fn memory(&self) -> MemoryReport {
        let opt = self.config.optimizer;
        let mut per_piece = vec![RankMemory::default(); self.pieces];
        for bucket in &self.buckets {
            for (piece, mem) in per_piece.iter_mut().enumerate() {
                for v in &bucket.views[piece] {
                    let role = self.params[v.param].spec.role;
                    mem.master += 4 * v.len();
                    mem.gradient_shard += 4 * v.len();
                    mem.optimizer_state += v.len()
                        * match role {
                            Role::Matrix => opt.matrix_state_bytes,
                            Role::Elementwise => opt.elementwise_state_bytes,
                        };
                }
                mem.padding += bucket.piece_bytes - bucket.covered_bytes(piece);
            }
        }
        for p in self.params.iter().filter(|p| p.split) {
            if let Some(owner) = p.ns_owner {
                let need = 2 * 4 * p.spec.numel();
                per_piece[owner].matrix_gather = per_piece[owner].matrix_gather.max(need);
            }
        }
        let shard_bytes: u64 = self
            .buckets
            .iter()
            .map(|b| b.piece_bytes * self.pieces_per_shard() as u64)
            .sum();
        let gathered_peak = if self.runtime_shards() > 1 {
            let window = self.config.prefetch_buckets.saturating_add(1);
            let sizes: Vec<u64> = (0..self.buckets.len())
                .map(|b| self.buffer_bytes(b))
                .collect();
            sizes
                .windows(window.min(sizes.len()))
                .map(|w| w.iter().sum())
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let ranks = (0..self.mesh.world_size())
            .map(|rank| {
                let piece = self.piece_of(rank).expect("rank in mesh");
                let shard = piece / self.pieces_per_shard();
                let first = shard * self.pieces_per_shard();
                let mut m = per_piece[piece];
                m.padding = per_piece[first..first + self.pieces_per_shard()]
                    .iter()
                    .map(|x| x.padding)
                    .sum();
                m.runtime_shard = shard_bytes;
                m.gathered_peak = gathered_peak;
                m
            })
            .collect();
        MemoryReport { ranks }
    }

    /// Serializes the plan's inputs and fingerprint as JSON (for checkpoints).
    pub fn to_json(&self) -> String {
        let file = PlanFile {
            version: PLAN_VERSION,
            mesh: self.mesh,
            config: self.config.clone(),
            specs: self.params.iter().map(|p| p.spec.clone()).collect(),
            fingerprint: self.fingerprint.to_string(),
        };
        serde_json::to_string_pretty(&file).expect("plan file serializes infallibly")
    }

    /// Reads a plan saved by [`Plan::to_json`]: re-plans from the stored inputs (nothing in
    /// the file is trusted) and checks the result against the stored fingerprint.
    pub fn from_json(json: &str) -> Result<Self, PlanError> {
        let file: PlanFile =
            serde_json::from_str(json).map_err(|e| PlanError::Corrupt(e.to_string()))?;
        if file.version != PLAN_VERSION {
            let why = if file.version == 3 {
                "it was written by an older build whose layout is the same but whose \
                 fingerprints differ (its buckets still listed empty per-pass sections); \
                 save the plan again with this build"
            } else if file.version < PLAN_VERSION {
                "it was written by an older build; this one lays MXFP8 out as square-block \
                 32x32 tiles cut at tile edges, no longer as 1x32 planes of 32-row bands"
            } else {
                "it was written by a newer build"
            };
            return Err(PlanError::Corrupt(format!(
                "plan version {} is not supported (this build reads version {PLAN_VERSION}): \
                 {why}",
                file.version
            )));
        }
        let mesh = Mesh::new(file.mesh.replicas(), file.mesh.shards())?;
        let plan = Self::build(file.specs, mesh, file.config)?;
        if plan.fingerprint.to_string() != file.fingerprint {
            return Err(PlanError::FingerprintMismatch {
                stored: file.fingerprint,
                rebuilt: plan.fingerprint.to_string(),
            });
        }
        Ok(plan)
    }
}

fn pieces_for(mesh: &Mesh, sharding: Sharding) -> usize {
    match sharding {
        Sharding::Hierarchical => mesh.world_size(),
        Sharding::Hsdp => mesh.shards(),
        Sharding::Ddp => 1,
    }
}

/// Summary numbers of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStats {
    /// Parameters.
    pub params: usize,
    /// Buckets.
    pub buckets: usize,
    /// Real elements over all parameters.
    pub elements: u64,
    /// Bytes of every parameter's runtime encoding (MX block padding included).
    pub region_bytes: u64,
    /// Bytes of all bucket buffers.
    pub buffer_bytes: u64,
    /// `buffer_bytes − region_bytes`: alignment gaps and the padding of pieces to equal size.
    pub padding_bytes: u64,
    /// `Matrix` parameters.
    pub matrices: usize,
    /// `Matrix` parameters spanning several pieces (gathered for Newton–Schulz).
    pub split_matrices: usize,
    /// Split matrices whose Newton–Schulz owner already holds part of them.
    pub split_matrices_owned_locally: usize,
    /// Parameters that fell back from the requested runtime format.
    pub fallbacks: usize,
    /// Largest piece's Newton–Schulz load over the mean load.
    pub owner_load_max_over_mean: f64,
    /// The best any whole-matrix assignment can do: max(largest matrix, mean) / mean.
    pub owner_load_lower_bound: f64,
}

impl PlanStats {
    /// Padding as a fraction of the buffers.
    pub fn padding_ratio(&self) -> f64 {
        self.padding_bytes as f64 / self.buffer_bytes.max(1) as f64
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.stats();
        writeln!(
            f,
            "plan {} over mesh {} ({:?}, {:?} runtime), fingerprint {}",
            s.params,
            self.mesh,
            self.config.sharding,
            self.config.runtime_format,
            &self.fingerprint.to_string()[..16]
        )?;
        writeln!(
            f,
            "  {} buckets, {} elements, {:.1} MiB of buffers, padding {:.3}%",
            s.buckets,
            s.elements,
            s.buffer_bytes as f64 / (1024.0 * 1024.0),
            s.padding_ratio() * 100.0
        )?;
        writeln!(
            f,
            "  {} matrices ({} split, {} of them owned where a part lies), {} format fallbacks",
            s.matrices, s.split_matrices, s.split_matrices_owned_locally, s.fallbacks
        )?;
        write!(
            f,
            "  Newton–Schulz owner load max/mean {:.3} (lower bound {:.3})",
            s.owner_load_max_over_mean, s.owner_load_lower_bound
        )
    }
}
