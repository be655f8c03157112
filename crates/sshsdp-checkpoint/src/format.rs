//! The on-disk format of one rank's shard: a safetensors file.
//!
//! Every array of every slice is a 1-D `F32` tensor named `{path}|{start}|{end}|{array}`.
//! The safetensors metadata holds two strings: `sshsdp.header`, a JSON document (format
//! name and version, rank, world, plan JSON, scalars, and per slice its path, shape, range
//! and the SHA-256 of each array's little-endian bytes), and `sshsdp.header_sha256`, the
//! SHA-256 of that JSON text. Scalars are stored as Rust's shortest round-trip decimal
//! strings, so every `f64` (infinities and NaN included) comes back bit-exact (NaN
//! payloads aside).

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::hash::BuildHasher;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{shard_file_name, CheckpointError};

/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

const FORMAT_NAME: &str = "sshsdp-shard";
const HEADER_KEY: &str = "sshsdp.header";
const HEADER_SHA_KEY: &str = "sshsdp.header_sha256";
/// Separates the parts of a tensor name; forbidden in paths and array names.
const SEP: char = '|';

/// One rank's checkpoint shard.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardFile {
    /// The rank that wrote the shard, `< world`.
    pub rank: usize,
    /// The world size of the run that wrote the checkpoint.
    pub world: usize,
    /// The sharding plan, as JSON (opaque here; all shards of a checkpoint agree on it).
    pub plan_json: String,
    /// The slices the rank owns.
    pub slices: Vec<SliceEntry>,
    /// Per-shard scalars (e.g. `"step"`, optimizer scalars such as Adam's `time`).
    pub scalars: BTreeMap<String, f64>,
}

/// The arrays of one slice `[start, end)` of a parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceEntry {
    /// The parameter's module path (must not contain `|`).
    pub path: String,
    /// The parameter's full shape.
    pub shape: Vec<usize>,
    /// First element of the slice in the row-major flattened parameter.
    pub start: usize,
    /// End (exclusive) of the slice, `start <= end <= numel(shape)`.
    pub end: usize,
    /// Named arrays of length `end - start` (e.g. `"master"`, `"state.momentum.moment_1"`).
    pub arrays: BTreeMap<String, Vec<f32>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format: String,
    version: u32,
    rank: usize,
    world: usize,
    plan_json: String,
    scalars: BTreeMap<String, String>,
    slices: Vec<SliceHeader>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SliceHeader {
    path: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
    /// Array name -> hex SHA-256 of its little-endian bytes.
    arrays: BTreeMap<String, String>,
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

fn tensor_name(path: &str, start: usize, end: usize, array: &str) -> String {
    format!("{path}{SEP}{start}{SEP}{end}{SEP}{array}")
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn f32_to_le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(crate) fn io_err(file: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        file: file.to_path_buf(),
        source,
    }
}

/// Checks the structure shared by writing and reading: names, ranges, shapes, lengths, and
/// that no two slices of one parameter overlap. `Err` is the reason.
fn check_slices(slices: &[SliceEntry]) -> Result<(), String> {
    // Per path: its shape and the slices' ranges.
    type Ranges<'s> = (&'s [usize], Vec<(usize, usize)>);
    let mut by_path: HashMap<&str, Ranges<'_>> = HashMap::new();
    for s in slices {
        let what = format!("slice [{}, {}) of '{}'", s.start, s.end, s.path);
        if s.path.is_empty() || s.path.contains(SEP) {
            return Err(format!(
                "{what}: a path must be non-empty and free of '{SEP}'"
            ));
        }
        let n = numel(&s.shape).ok_or_else(|| format!("{what}: shape {:?} overflows", s.shape))?;
        if s.start > s.end || s.end > n {
            return Err(format!(
                "{what}: range outside the parameter's {n} elements (shape {:?})",
                s.shape
            ));
        }
        for (name, values) in &s.arrays {
            if name.is_empty() || name.contains(SEP) {
                return Err(format!(
                    "{what}: array name '{name}' must be non-empty and free of '{SEP}'"
                ));
            }
            if values.len() != s.end - s.start {
                return Err(format!(
                    "{what}: array '{name}' has {} values, expected {}",
                    values.len(),
                    s.end - s.start
                ));
            }
        }
        let entry = by_path
            .entry(&s.path)
            .or_insert_with(|| (&s.shape, Vec::new()));
        if entry.0 != s.shape.as_slice() {
            return Err(format!(
                "{what}: shape {:?} differs from {:?} given by another slice",
                s.shape, entry.0
            ));
        }
        entry.1.push((s.start, s.end));
    }
    for (path, (_, mut ranges)) in by_path {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            let ((s0, e0), (s1, e1)) = (w[0], w[1]);
            if w[0] == w[1] || s1 < e0 {
                return Err(format!(
                    "slices [{s0}, {e0}) and [{s1}, {e1}) of '{path}' overlap within one shard"
                ));
            }
        }
    }
    Ok(())
}

impl ShardFile {
    /// The file name of this shard ([`shard_file_name`]).
    pub fn file_name(&self) -> String {
        shard_file_name(self.rank, self.world)
    }

    /// Checks the shard is well-formed: `rank < world`, names free of `|`, every slice in
    /// bounds with arrays of its length, and no two slices of a parameter overlapping or
    /// disagreeing on its shape. Errors name the shard's [file name](Self::file_name).
    pub fn validate(&self) -> Result<(), CheckpointError> {
        let invalid = |reason: String| CheckpointError::Mismatch {
            file: PathBuf::from(self.file_name()),
            reason,
        };
        if self.world == 0 || self.rank >= self.world {
            return Err(invalid(format!(
                "rank {} is not below world size {}",
                self.rank, self.world
            )));
        }
        check_slices(&self.slices).map_err(invalid)
    }

    /// The shard's file contents (safetensors bytes, as [`Self::write`] writes them). Refuses
    /// invalid shards ([`Self::validate`]).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CheckpointError> {
        self.validate()
            .map_err(|e| CheckpointError::Invalid(e.to_string()))?;

        let mut tensors = Vec::new();
        let mut slice_headers = Vec::with_capacity(self.slices.len());
        for s in &self.slices {
            let mut sums = BTreeMap::new();
            for (name, values) in &s.arrays {
                let bytes = f32_to_le_bytes(values);
                sums.insert(name.clone(), sha256_hex(&bytes));
                tensors.push((tensor_name(&s.path, s.start, s.end, name), bytes));
            }
            slice_headers.push(SliceHeader {
                path: s.path.clone(),
                shape: s.shape.clone(),
                start: s.start,
                end: s.end,
                arrays: sums,
            });
        }
        let header = Header {
            format: FORMAT_NAME.to_owned(),
            version: FORMAT_VERSION,
            rank: self.rank,
            world: self.world,
            plan_json: self.plan_json.clone(),
            scalars: self
                .scalars
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect(),
            slices: slice_headers,
        };
        let header_json = serde_json::to_string(&header)
            .map_err(|e| CheckpointError::Invalid(format!("header JSON: {e}")))?;
        let metadata = HashMap::from([
            (
                HEADER_SHA_KEY.to_owned(),
                sha256_hex(header_json.as_bytes()),
            ),
            (HEADER_KEY.to_owned(), header_json),
        ]);
        let views = tensors
            .iter()
            .map(|(name, bytes)| {
                let view = TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes)
                    .map_err(|e| CheckpointError::Invalid(format!("tensor '{name}': {e}")))?;
                Ok((name.as_str(), view))
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        safetensors::serialize(views, Some(metadata))
            .map_err(|e| CheckpointError::Invalid(format!("safetensors: {e}")))
    }

    /// Writes the shard to `path` atomically: to a temporary file in the same directory,
    /// synced, then renamed over `path`. Refuses invalid shards ([`Self::validate`]). (A
    /// whole checkpoint is written by [`crate::save`], which commits all ranks' files at once.)
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), CheckpointError> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        // A fresh, unpredictable name; `create_new` never opens an existing file or symlink
        // there. A name someone else holds is left alone (neither followed nor removed) and
        // another one drawn.
        let mut attempts = 0;
        let tmp = loop {
            let tmp = temp_path(path);
            match crate::layout::write_new_file(&tmp, &bytes) {
                Ok(()) => break tmp,
                Err(CheckpointError::Io { source, .. })
                    if source.kind() == io::ErrorKind::AlreadyExists
                        && attempts + 1 < TEMP_ATTEMPTS =>
                {
                    attempts += 1
                }
                // `write_new_file` removed what it created.
                Err(e) => return Err(e),
            }
        };
        if let Err(e) = fs::rename(&tmp, path) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(path)(e));
        }
        // Make the rename durable; not every platform can sync a directory.
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            let _ = fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    }

    /// Writes the shard into `dir` under its [file name](Self::file_name), creating `dir` if
    /// needed; returns the file's path.
    pub fn write_to_dir(&self, dir: impl AsRef<Path>) -> Result<PathBuf, CheckpointError> {
        let dir = dir.as_ref();
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(self.file_name());
        self.write(&path)?;
        Ok(path)
    }

    /// Reads and validates a shard file. Never panics, whatever the bytes: every problem is
    /// an `Err` naming the file ([`CheckpointError::Corrupt`] for bad bytes, structure or
    /// checksums, or for something other than a regular file, [`CheckpointError::Version`]
    /// for another format version). Reads no more than the file's length.
    pub fn read(path: impl AsRef<Path>) -> Result<ShardFile, CheckpointError> {
        let path = path.as_ref();
        let bytes = read_file(path)?;
        Self::from_bytes(&bytes, path)
    }

    /// [`Self::read`] from bytes already in memory; `file` only names them in errors.
    pub fn from_bytes(bytes: &[u8], file: &Path) -> Result<ShardFile, CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            file: file.to_path_buf(),
            reason,
        };
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| corrupt(format!("not a valid safetensors file: {e}")))?;
        let (_, metadata) = SafeTensors::read_metadata(bytes)
            .map_err(|e| corrupt(format!("not a valid safetensors file: {e}")))?;
        let meta = metadata
            .metadata()
            .as_ref()
            .ok_or_else(|| corrupt("no metadata: not an SS-HSDP shard file".into()))?;
        let header_json = meta
            .get(HEADER_KEY)
            .ok_or_else(|| corrupt(format!("metadata lacks '{HEADER_KEY}'")))?;
        let header_sha = meta
            .get(HEADER_SHA_KEY)
            .ok_or_else(|| corrupt(format!("metadata lacks '{HEADER_SHA_KEY}'")))?;
        if let Some(key) = meta
            .keys()
            .find(|k| k.as_str() != HEADER_KEY && k.as_str() != HEADER_SHA_KEY)
        {
            return Err(corrupt(format!("unknown metadata key '{key}'")));
        }
        if sha256_hex(header_json.as_bytes()) != *header_sha {
            return Err(corrupt("header checksum mismatch".into()));
        }

        let value: serde_json::Value = serde_json::from_str(header_json)
            .map_err(|e| corrupt(format!("header is not JSON: {e}")))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT_NAME) {
            return Err(corrupt(format!("header format is not '{FORMAT_NAME}'")));
        }
        match value.get("version") {
            Some(v) if v.as_u64() == Some(u64::from(FORMAT_VERSION)) => {}
            found => {
                return Err(CheckpointError::Version {
                    file: file.to_path_buf(),
                    found: found.map_or_else(|| "(none)".to_owned(), |v| v.to_string()),
                    supported: FORMAT_VERSION,
                })
            }
        }
        let header: Header =
            serde_json::from_value(value).map_err(|e| corrupt(format!("invalid header: {e}")))?;

        let mut scalars = BTreeMap::new();
        for (name, text) in header.scalars {
            let v = text
                .parse::<f64>()
                .map_err(|e| corrupt(format!("scalar '{name}' = '{text}': {e}")))?;
            scalars.insert(name, v);
        }

        let mut expected_names = BTreeSet::new();
        let mut slices = Vec::with_capacity(header.slices.len());
        for sh in header.slices {
            let mut arrays = BTreeMap::new();
            for (name, sum) in sh.arrays {
                let tname = tensor_name(&sh.path, sh.start, sh.end, &name);
                let view = st
                    .tensor(&tname)
                    .map_err(|_| corrupt(format!("tensor '{tname}' is missing")))?;
                if view.dtype() != Dtype::F32 {
                    return Err(corrupt(format!(
                        "tensor '{tname}' has dtype {:?}, expected F32",
                        view.dtype()
                    )));
                }
                let len = sh.end.checked_sub(sh.start).ok_or_else(|| {
                    corrupt(format!(
                        "tensor '{tname}': start {} > end {}",
                        sh.start, sh.end
                    ))
                })?;
                if view.shape() != [len] {
                    return Err(corrupt(format!(
                        "tensor '{tname}' has shape {:?}, expected [{len}]",
                        view.shape()
                    )));
                }
                let data = view.data();
                if sha256_hex(data) != sum {
                    return Err(corrupt(format!("checksum mismatch in tensor '{tname}'")));
                }
                let values = data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<f32>>();
                expected_names.insert(tname);
                arrays.insert(name, values);
            }
            slices.push(SliceEntry {
                path: sh.path,
                shape: sh.shape,
                start: sh.start,
                end: sh.end,
                arrays,
            });
        }
        if let Some(extra) = st
            .names()
            .into_iter()
            .find(|n| !expected_names.contains(*n))
        {
            return Err(corrupt(format!(
                "tensor '{extra}' is not described by the header"
            )));
        }

        let shard = ShardFile {
            rank: header.rank,
            world: header.world,
            plan_json: header.plan_json,
            slices,
            scalars,
        };
        shard.validate().map_err(|e| match e {
            CheckpointError::Mismatch { reason, .. } => corrupt(reason),
            other => other,
        })?;
        Ok(shard)
    }
}

/// The bytes of the regular file `path` (a symlink to one is followed), no more than its
/// length: a device or FIFO (say a shard name linked to `/dev/zero`, whose length is 0 but
/// whose reads never end) is refused before it is opened, and a file that grows while read is
/// an error rather than an allocation without bound.
fn read_file(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: path.to_path_buf(),
        reason,
    };
    let not_regular = || corrupt("not a regular file".into());
    if !fs::metadata(path).map_err(io_err(path))?.is_file() {
        return Err(not_regular());
    }
    let file = fs::File::open(path).map_err(io_err(path))?;
    // Checked again on the handle: the name may have been replaced in between.
    let meta = file.metadata().map_err(io_err(path))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    let len = usize::try_from(meta.len()).map_err(|_| corrupt("too large".into()))?;
    let mut bytes = Vec::with_capacity(len);
    io::Read::read_to_end(&mut io::Read::take(file, meta.len() + 1), &mut bytes)
        .map_err(io_err(path))?;
    if bytes.len() != len {
        return Err(corrupt(format!(
            "changed while read: {len} bytes, then {}",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Names [`ShardFile::write`] draws for its temporary file before giving up (each one taken
/// already means someone else created it).
const TEMP_ATTEMPTS: usize = 16;

/// A fresh temporary path next to `path` (same directory, so the rename is atomic):
/// `.{name}.tmp-{pid}-{nonce}`, the nonce 64 random bits (the standard library's per-process
/// random hash keys over a counter and the time), so nobody can create the name first.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let nonce = RandomState::new().hash_one((n, now));
    let name = path
        .file_name()
        .map_or_else(|| "shard".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp-{}-{nonce:016x}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_slices_rejects_overlaps_and_bad_lengths() {
        let s = |start, end, len| SliceEntry {
            path: "w".into(),
            shape: vec![4, 5],
            start,
            end,
            arrays: BTreeMap::from([("master".into(), vec![0.0; len])]),
        };
        assert!(check_slices(&[s(0, 5, 5), s(5, 20, 15)]).is_ok());
        assert!(check_slices(&[s(0, 5, 5), s(4, 20, 16)]).is_err());
        assert!(check_slices(&[s(0, 5, 5), s(0, 5, 5)]).is_err());
        assert!(check_slices(&[s(3, 3, 0), s(3, 3, 0)]).is_err());
        assert!(check_slices(&[s(0, 5, 4)]).is_err());
        assert!(check_slices(&[s(0, 21, 21)]).is_err());
        assert!(check_slices(&[s(6, 5, 0)]).is_err());
    }
}
