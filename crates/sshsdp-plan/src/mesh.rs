//! The device mesh: `replicas × shards` ranks, rank = replica · shards + shard.
//!
//! A *shard group* is the set of ranks of one replica (the fast links, e.g. one node): runtime
//! parameters are sharded over it. A *replica group* is the set of ranks holding the same shard
//! index across replicas: gradients are reduced over it after the shard-group reduce-scatter.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// The most ranks a [`Mesh`] may span: 2^20, far beyond any cluster, yet small enough that the
/// per-rank and per-piece tables a plan keeps stay in memory. A mesh read from a file is held to
/// it before anything is sized by it.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// A two-level mesh of ranks: `replicas` copies of a `shards`-way sharded model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    replicas: usize,
    shards: usize,
}

impl Mesh {
    /// A mesh of `replicas × shards` ranks; both must be at least 1 and their product at most
    /// [`MAX_WORLD_SIZE`].
    pub fn new(replicas: usize, shards: usize) -> Result<Self, PlanError> {
        let world = replicas.checked_mul(shards);
        if replicas == 0 || shards == 0 || world.is_none_or(|w| w > MAX_WORLD_SIZE) {
            return Err(PlanError::InvalidMesh { replicas, shards });
        }
        Ok(Self { replicas, shards })
    }

    /// A fully sharded mesh (one replica) over `world` ranks.
    pub fn flat(world: usize) -> Result<Self, PlanError> {
        Self::new(1, world)
    }

    /// Number of replicas (size of a replica group).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Number of shards (size of a shard group).
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        self.replicas * self.shards
    }

    /// Checks that this mesh covers exactly `world` ranks.
    pub fn check_world_size(&self, world: usize) -> Result<(), PlanError> {
        if self.world_size() == world {
            Ok(())
        } else {
            Err(PlanError::MeshWorldMismatch {
                replicas: self.replicas,
                shards: self.shards,
                world,
            })
        }
    }

    /// `(replica, shard)` coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Result<(usize, usize), PlanError> {
        self.check_rank(rank)?;
        Ok((rank / self.shards, rank % self.shards))
    }

    /// The rank at `(replica, shard)`.
    pub fn rank_of(&self, replica: usize, shard: usize) -> Result<usize, PlanError> {
        check_index("replica", replica, self.replicas)?;
        check_index("shard", shard, self.shards)?;
        Ok(replica * self.shards + shard)
    }

    /// Ranks of `rank`'s shard group (same replica), in shard order.
    pub fn shard_group(&self, rank: usize) -> Result<Vec<usize>, PlanError> {
        let (replica, _) = self.coords(rank)?;
        Ok((0..self.shards)
            .map(|s| replica * self.shards + s)
            .collect())
    }

    /// Ranks of `rank`'s replica group (same shard index), in replica order.
    pub fn replica_group(&self, rank: usize) -> Result<Vec<usize>, PlanError> {
        let (_, shard) = self.coords(rank)?;
        Ok((0..self.replicas)
            .map(|r| r * self.shards + shard)
            .collect())
    }

    fn check_rank(&self, rank: usize) -> Result<(), PlanError> {
        check_index("rank", rank, self.world_size())
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.replicas, self.shards)
    }
}

pub(crate) fn check_index(what: &'static str, index: usize, bound: usize) -> Result<(), PlanError> {
    if index < bound {
        Ok(())
    } else {
        Err(PlanError::OutOfRange { what, index, bound })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_rank_formula() {
        let mesh = Mesh::new(2, 3).unwrap();
        assert_eq!(mesh.world_size(), 6);
        assert_eq!(mesh.coords(4).unwrap(), (1, 1));
        assert_eq!(mesh.rank_of(1, 1).unwrap(), 4);
        assert_eq!(mesh.shard_group(4).unwrap(), vec![3, 4, 5]);
        assert_eq!(mesh.replica_group(4).unwrap(), vec![1, 4]);
        for rank in 0..6 {
            let (r, s) = mesh.coords(rank).unwrap();
            assert_eq!(mesh.rank_of(r, s).unwrap(), rank);
            assert!(mesh.shard_group(rank).unwrap().contains(&rank));
            assert!(mesh.replica_group(rank).unwrap().contains(&rank));
        }
    }

    #[test]
    fn bad_meshes_are_errors() {
        assert!(matches!(
            Mesh::new(0, 4),
            Err(PlanError::InvalidMesh { .. })
        ));
        assert!(matches!(
            Mesh::new(2, 0),
            Err(PlanError::InvalidMesh { .. })
        ));
        let mesh = Mesh::new(2, 2).unwrap();
        assert!(mesh.check_world_size(4).is_ok());
        assert!(matches!(
            mesh.check_world_size(3),
            Err(PlanError::MeshWorldMismatch { world: 3, .. })
        ));
        assert!(matches!(mesh.coords(4), Err(PlanError::OutOfRange { .. })));
        assert!(mesh.rank_of(0, 2).is_err());
    }
}
