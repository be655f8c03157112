//! A committed checkpoint's manifest (`manifest.json`, written last by rank 0): the step, the
//! plan fingerprint, and every rank's shard file with its size and SHA-256. A step directory
//! is a checkpoint exactly when it holds a valid manifest; loading reads only the files the
//! manifest lists and checks each against it before parsing a byte.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::format::sha256_hex;
use crate::layout::{io_err, write_new_file};
use crate::{shard_file_name, CheckpointError, FORMAT_VERSION};

/// The manifest's file name in a committed step directory.
pub const MANIFEST_FILE: &str = "manifest.json";

const MANIFEST_FORMAT: &str = "sshsdp-checkpoint";
/// A manifest larger than this is refused before it is read (a million ranks fit).
const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// The manifest of a committed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `"sshsdp-checkpoint"`.
    pub format: String,
    /// The format version of the manifest and its shard files ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The training step saved.
    pub step: u64,
    /// The world size of the run that saved (the number of shard files).
    pub world: usize,
    /// The saving run's plan fingerprint (hex), to recognise a resume on the same plan.
    pub plan_fingerprint: String,
    /// Every rank's shard file, in rank order.
    pub files: Vec<ManifestFile>,
}

/// One rank's shard file in a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// The rank that wrote it.
    pub rank: usize,
    /// Its name in the step directory ([`shard_file_name`]).
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of its bytes, lowercase hex.
    pub sha256: String,
}

impl Manifest {
    /// The manifest of a checkpoint of `step` whose rank `r` wrote `files[r] = (size, sha256)`.
    pub fn new(step: u64, plan_fingerprint: String, files: &[(u64, String)]) -> Self {
        let world = files.len();
        Self {
            format: MANIFEST_FORMAT.to_owned(),
            version: FORMAT_VERSION,
            step,
            world,
            plan_fingerprint,
            files: files
                .iter()
                .enumerate()
                .map(|(rank, (size, sha256))| ManifestFile {
                    rank,
                    name: shard_file_name(rank, world),
                    size: *size,
                    sha256: sha256.clone(),
                })
                .collect(),
        }
    }

    /// Checks the manifest is well-formed: format and version, one file per rank in rank
    /// order under its canonical name, SHA-256 as 64 lowercase hex digits. `file` names the
    /// manifest in errors.
    pub fn validate(&self, file: &Path) -> Result<(), CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            file: file.to_path_buf(),
            reason,
        };
        if self.format != MANIFEST_FORMAT {
            return Err(corrupt(format!("format is not '{MANIFEST_FORMAT}'")));
        }
        if self.version != FORMAT_VERSION {
            return Err(CheckpointError::Version {
                file: file.to_path_buf(),
                found: self.version.to_string(),
                supported: FORMAT_VERSION,
            });
        }
        if self.world == 0 || self.files.len() != self.world {
            return Err(corrupt(format!(
                "{} files listed for world size {}",
                self.files.len(),
                self.world
            )));
        }
        for (rank, f) in self.files.iter().enumerate() {
            if f.rank != rank || f.name != shard_file_name(rank, self.world) {
                return Err(corrupt(format!(
                    "entry {rank} is rank {} file '{}', expected {}",
                    f.rank,
                    f.name,
                    shard_file_name(rank, self.world)
                )));
            }
            let hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
            if f.sha256.len() != 64 || !f.sha256.bytes().all(hex) {
                return Err(corrupt(format!(
                    "rank {rank}'s SHA-256 is not 64 hex digits"
                )));
            }
        }
        Ok(())
    }

    /// Reads and validates the manifest of the step directory `dir`; returns it with the
    /// SHA-256 of its bytes (ranks compare it to know they read the same checkpoint).
    pub fn read(dir: impl AsRef<Path>) -> Result<(Manifest, String), CheckpointError> {
        let path = dir.as_ref().join(MANIFEST_FILE);
        let meta = fs::symlink_metadata(&path).map_err(|_| CheckpointError::Missing {
            location: dir.as_ref().to_path_buf(),
            what: format!("{MANIFEST_FILE}: not a committed checkpoint"),
        })?;
        let bytes = read_regular(&path, &meta, MAX_MANIFEST_BYTES)?;
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Corrupt {
                file: path.clone(),
                reason: format!("invalid manifest: {e}"),
            })?;
        manifest.validate(&path)?;
        Ok((manifest, sha256_hex(&bytes)))
    }

    /// Writes the manifest as `dir/manifest.json`, a new file, synced.
    pub(crate) fn write_new(&self, dir: &Path) -> Result<PathBuf, CheckpointError> {
        let path = dir.join(MANIFEST_FILE);
        let mut json = serde_json::to_vec_pretty(self)
            .map_err(|e| CheckpointError::Invalid(format!("manifest JSON: {e}")))?;
        json.push(b'\n');
        write_new_file(&path, &json)?;
        Ok(path)
    }

    /// The bytes of rank `rank`'s file in the step directory `dir`, checked against the
    /// manifest: a regular file of the listed size (checked before reading) and SHA-256.
    pub fn read_file(&self, dir: &Path, rank: usize) -> Result<Vec<u8>, CheckpointError> {
        let entry = self.files.get(rank).ok_or_else(|| {
            CheckpointError::Invalid(format!("rank {rank} is not below {}", self.world))
        })?;
        let path = dir.join(&entry.name);
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if meta.len() != entry.size {
            return Err(CheckpointError::Corrupt {
                file: path,
                reason: format!("{} bytes, the manifest lists {}", meta.len(), entry.size),
            });
        }
        let bytes = read_regular(&path, &meta, entry.size)?;
        if sha256_hex(&bytes) != entry.sha256 {
            return Err(CheckpointError::Corrupt {
                file: path,
                reason: "SHA-256 differs from the manifest's".into(),
            });
        }
        Ok(bytes)
    }
}

/// Reads the regular file `path` (whose metadata is `meta`) of at most `limit` bytes,
/// allocating no more than the checked size.
fn read_regular(path: &Path, meta: &fs::Metadata, limit: u64) -> Result<Vec<u8>, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: path.to_path_buf(),
        reason,
    };
    if !meta.is_file() {
        return Err(corrupt(
            "not a regular file (a symlink or directory)".into(),
        ));
    }
    if meta.len() > limit {
        return Err(corrupt(format!(
            "{} bytes, at most {limit} expected",
            meta.len()
        )));
    }
    let len = usize::try_from(meta.len()).map_err(|_| corrupt("too large".into()))?;
    let mut bytes = Vec::with_capacity(len);
    fs::File::open(path)
        .and_then(|f| f.take(limit.saturating_add(1)).read_to_end(&mut bytes))
        .map_err(io_err(path))?;
    if bytes.len() as u64 != meta.len() {
        return Err(corrupt(format!(
            "changed while read: {} bytes, then {}",
            meta.len(),
            bytes.len()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let sha = "ab".repeat(32);
        Manifest::new(9, "00".repeat(32), &[(10, sha.clone()), (20, sha)])
    }

    #[test]
    fn valid_manifest_round_trips() {
        let m = manifest();
        m.validate(Path::new("m")).unwrap();
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<Manifest>(&json).unwrap(), m);
        assert_eq!(m.files[1].name, shard_file_name(1, 2));
    }

    #[test]
    fn malformed_manifests_are_refused() {
        let p = Path::new("m");
        let mut m = manifest();
        m.files.swap(0, 1);
        assert!(m.validate(p).is_err());
        let mut m = manifest();
        m.files[0].name = "../../etc/passwd".into();
        assert!(m.validate(p).is_err());
        let mut m = manifest();
        m.world = 3;
        assert!(m.validate(p).is_err());
        let mut m = manifest();
        m.files[1].sha256 = "AB".repeat(32);
        assert!(m.validate(p).is_err());
        let mut m = manifest();
        m.version += 1;
        assert!(matches!(
            m.validate(p),
            Err(CheckpointError::Version { .. })
        ));
        let mut json = serde_json::to_value(manifest()).unwrap();
        json["extra"] = 1.into();
        assert!(serde_json::from_value::<Manifest>(json).is_err());
    }
}
