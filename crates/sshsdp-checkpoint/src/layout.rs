//! The checkpoint root on disk: step directory names, finding committed checkpoints, fresh
//! temporary directories, durable file creation and keep-last-K retention.
//!
//! ```text
//! ROOT/
//!   step-7/                 committed: shard files + manifest.json
//!   step-8/                 committed
//!   step-9.tmp/             a save in progress (or crashed): never loaded
//! ```

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::{CheckpointError, MANIFEST_FILE};

const STEP_PREFIX: &str = "step-";
const TMP_SUFFIX: &str = ".tmp";

pub(crate) fn io_err(file: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        file: file.to_path_buf(),
        source,
    }
}

/// The name of step `step`'s committed directory under a checkpoint root: `step-{step}`.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step}")
}

/// The name of step `step`'s directory while its save is in progress: `step-{step}.tmp`.
pub(crate) fn tmp_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step}{TMP_SUFFIX}")
}

/// Parses a name made by [`step_dir_name`] (exactly: `step-007`, `step-7.tmp` are not).
fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step = digits.parse().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// Whether `path` exists (as anything, a dangling symlink included).
fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// Whether `dir` holds a manifest file (a regular file, not a symlink).
fn has_manifest(dir: &Path) -> bool {
    fs::symlink_metadata(dir.join(MANIFEST_FILE)).is_ok_and(|m| m.is_file())
}

/// Whether the entry `dir` of a root is a real directory (not a symlink) holding a manifest.
fn is_committed(dir: &Path) -> bool {
    fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) && has_manifest(dir)
}

/// The committed checkpoints under `root` (directories `step-N` holding a manifest), by
/// ascending step. Anything else in `root` (unfinished `step-N.tmp` directories, `step-N`
/// directories without a manifest, symlinks, other files) is ignored.
pub fn committed_steps(root: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let root = root.as_ref();
    let mut steps = Vec::new();
    for entry in fs::read_dir(root).map_err(io_err(root))? {
        let entry = entry.map_err(io_err(root))?;
        let Some(step) = entry.file_name().to_str().and_then(parse_step_dir_name) else {
            continue;
        };
        let path = entry.path();
        if is_committed(&path) {
            steps.push((step, path));
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// The checkpoint directory `path` names: `path` itself when it holds a manifest (a committed
/// step directory), else the latest committed checkpoint under `path` taken as a root.
///
/// A directory that looks like a checkpoint but has no manifest (a crashed or unfinished
/// save: a `step-N` or `step-N.tmp` directory, or one holding shard files) is an error naming
/// it, never loaded.
pub fn resolve(path: impl AsRef<Path>) -> Result<PathBuf, CheckpointError> {
    let path = path.as_ref();
    // The path given may be a symlink (to a root or a step directory).
    let meta = fs::metadata(path).map_err(io_err(path))?;
    if meta.is_dir() && has_manifest(path) {
        return Ok(path.to_path_buf());
    }
    let uncommitted = || CheckpointError::Missing {
        location: path.to_path_buf(),
        what: format!(
            "{MANIFEST_FILE}: not a committed checkpoint (a crashed or unfinished save, or a \
             directory written before checkpoints had manifests)"
        ),
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let step_like = parse_step_dir_name(name).is_some()
        || name
            .strip_suffix(TMP_SUFFIX)
            .and_then(parse_step_dir_name)
            .is_some();
    if !meta.is_dir() || step_like || crate::checkpoint_dir_files(path).is_ok() {
        return Err(uncommitted());
    }
    match committed_steps(path)?.pop() {
        Some((_, dir)) => Ok(dir),
        None => Err(CheckpointError::Missing {
            location: path.to_path_buf(),
            what: format!(
                "committed checkpoints ({STEP_PREFIX}N directories holding a {MANIFEST_FILE})"
            ),
        }),
    }
}

/// Makes `dir`'s entries durable (a no-op where directories cannot be opened: not Unix).
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    if cfg!(unix) {
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(dir))?;
    }
    Ok(())
}

/// Checks that `dir` is a directory and not a symlink.
pub(crate) fn check_real_dir(dir: &Path) -> Result<(), CheckpointError> {
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(CheckpointError::Invalid(format!(
            "{} is not a directory (or is a symlink)",
            dir.display()
        )));
    }
    Ok(())
}

/// Creates the file `path`, which must not exist (never through an existing file or symlink:
/// `create_new` fails on any existing name, a dangling symlink included), writes `bytes` and
/// syncs it. If writing fails, the file it created is removed.
pub(crate) fn write_new_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err(path))?;
    let written = file.write_all(bytes).and_then(|()| file.sync_all());
    if let Err(e) = written {
        drop(file);
        let _ = fs::remove_file(path);
        return Err(io_err(path)(e));
    }
    Ok(())
}

/// Rank 0's preparation of a save of `step` under `root`: creates `root` if needed, refuses a
/// step whose directory exists, and creates a fresh `step-N.tmp` (removing a stale one left by
/// a crashed save).
pub(crate) fn prepare_tmp(root: &Path, step: u64) -> Result<(), CheckpointError> {
    // The root may be a symlink to a directory; what is created in it may not.
    fs::create_dir_all(root).map_err(io_err(root))?;
    let target = root.join(step_dir_name(step));
    if exists(&target) {
        return Err(CheckpointError::Exists { dir: target });
    }
    let tmp = root.join(tmp_dir_name(step));
    match fs::symlink_metadata(&tmp) {
        // `remove_dir_all` does not follow symlinks.
        Ok(m) if m.is_dir() => fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?,
        Ok(_) => fs::remove_file(&tmp).map_err(io_err(&tmp))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&tmp)(e)),
    }
    fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    check_real_dir(&tmp)?;
    sync_dir(root)
}

/// Rank 0's commit: renames the complete `tmp` (manifest written last) to `target` and makes
/// the rename durable.
pub(crate) fn publish(root: &Path, tmp: &Path, target: &Path) -> Result<(), CheckpointError> {
    check_real_dir(tmp)?;
    sync_dir(tmp)?;
    // Checked again just before the rename: a rename onto an empty directory would replace it.
    if exists(target) {
        return Err(CheckpointError::Exists {
            dir: target.to_path_buf(),
        });
    }
    fs::rename(tmp, target).map_err(io_err(target))?;
    sync_dir(root)
}

/// Keep-last-K: deletes the committed checkpoints under `root` older than `step` beyond the
/// `keep - 1` most recent of them (`step`'s own is the K-th). Newer steps, uncommitted
/// directories and other files are never touched. Returns the directories deleted.
pub(crate) fn prune(root: &Path, step: u64, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let older: Vec<PathBuf> = committed_steps(root)?
        .into_iter()
        .filter(|(s, _)| *s < step)
        .map(|(_, dir)| dir)
        .collect();
    let surplus = older.len().saturating_sub(keep.saturating_sub(1));
    let doomed = older[..surplus].to_vec();
    for dir in &doomed {
        // The manifest first: an interrupted deletion leaves an uncommitted directory.
        fs::remove_file(dir.join(MANIFEST_FILE)).map_err(io_err(dir))?;
        fs::remove_dir_all(dir).map_err(io_err(dir))?;
    }
    if !doomed.is_empty() {
        sync_dir(root)?;
    }
    Ok(doomed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_dir_names_are_strict() {
        assert_eq!(step_dir_name(42), "step-42");
        assert_eq!(parse_step_dir_name("step-42"), Some(42));
        assert_eq!(parse_step_dir_name("step-0"), Some(0));
        for bad in [
            "step-042",
            "step-",
            "step-4.tmp",
            "step-+4",
            "Step-4",
            "step-99999999999999999999",
        ] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
        assert_eq!(tmp_dir_name(3), "step-3.tmp");
    }
}
