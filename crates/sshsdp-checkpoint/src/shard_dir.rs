//! A checkpoint directory's shard files: their names (`rank-NNNNN-of-NNNNN.safetensors`), the
//! listing that checks exactly ranks `0..world` are there, and reading them all.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::format::io_err;
use crate::{CheckpointError, ShardFile};

/// The file name of `rank`'s shard in a checkpoint written by `world` ranks:
/// `rank-{rank:05}-of-{world:05}.safetensors`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// Parses a name made by [`shard_file_name`] (exactly: other names are not shard files).
fn parse_shard_file_name(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("rank-")?.strip_suffix(".safetensors")?;
    let (rank, world) = rest.split_once("-of-")?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(rank) || !all_digits(world) {
        return None;
    }
    let (rank, world) = (rank.parse().ok()?, world.parse().ok()?);
    (shard_file_name(rank, world) == name).then_some((rank, world))
}

/// The shard files of the checkpoint in `dir`, in rank order, checking that exactly ranks
/// `0..world` are present for a single world size. Only names made by [`shard_file_name`]
/// count (temporary files and anything else are ignored).
pub fn checkpoint_dir_files(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, CheckpointError> {
    let dir = dir.as_ref();
    let mut found: BTreeMap<usize, BTreeMap<usize, PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        if let Some((rank, world)) = name.to_str().and_then(parse_shard_file_name) {
            found.entry(world).or_default().insert(rank, entry.path());
        }
    }
    let mut worlds = found.into_iter();
    let Some((world, mut ranks)) = worlds.next() else {
        return Err(CheckpointError::Missing {
            location: dir.to_path_buf(),
            what: "shard files (rank-NNNNN-of-NNNNN.safetensors)".into(),
        });
    };
    if let Some((other, files)) = worlds.next() {
        let file = files.into_values().next().unwrap_or_default();
        return Err(CheckpointError::Mismatch {
            file,
            reason: format!("shard files of world sizes {world} and {other} in one directory"),
        });
    }
    if let Some((_, file)) = ranks.range(world..).next() {
        return Err(CheckpointError::Mismatch {
            file: file.clone(),
            reason: format!("rank is not below the world size {world}"),
        });
    }
    (0..world)
        .map(|rank| {
            ranks.remove(&rank).ok_or_else(|| CheckpointError::Missing {
                location: dir.to_path_buf(),
                what: format!("rank {rank}'s file {}", shard_file_name(rank, world)),
            })
        })
        .collect()
}

/// Reads every shard of the checkpoint in `dir` ([`checkpoint_dir_files`]), in rank order,
/// checking that each file's own rank and world match its name and that all agree on the
/// plan JSON. (A committed step directory reads better with [`crate::read_checkpoint`],
/// which also checks every file against the manifest.)
pub fn read_all(dir: impl AsRef<Path>) -> Result<Vec<ShardFile>, CheckpointError> {
    let paths = checkpoint_dir_files(dir)?;
    let world = paths.len();
    let mut shards: Vec<ShardFile> = Vec::with_capacity(world);
    for (rank, path) in paths.into_iter().enumerate() {
        let shard = ShardFile::read(&path)?;
        if shard.rank != rank || shard.world != world {
            return Err(CheckpointError::Mismatch {
                file: path,
                reason: format!(
                    "the file says rank {} of {}, its name rank {rank} of {world}",
                    shard.rank, shard.world
                ),
            });
        }
        if let Some(first) = shards.first() {
            if first.plan_json != shard.plan_json {
                return Err(CheckpointError::Mismatch {
                    file: path,
                    reason: format!(
                        "its plan JSON differs from rank 0's ({} vs {} bytes)",
                        shard.plan_json.len(),
                        first.plan_json.len()
                    ),
                });
            }
        }
        shards.push(shard);
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_round_trip_and_are_strict() {
        assert_eq!(shard_file_name(3, 16), "rank-00003-of-00016.safetensors");
        assert_eq!(
            parse_shard_file_name(&shard_file_name(3, 16)),
            Some((3, 16))
        );
        assert_eq!(
            parse_shard_file_name(&shard_file_name(123_456, 200_000)),
            Some((123_456, 200_000))
        );
        for bad in [
            "rank-3-of-16.safetensors",
            "rank-00003-of-00016.safetensors.tmp",
            ".rank-00003-of-00016.safetensors.tmp-1-0",
            "rank-+0003-of-00016.safetensors",
            "rank--of-00016.safetensors",
        ] {
            assert_eq!(parse_shard_file_name(bad), None, "{bad}");
        }
    }
}
