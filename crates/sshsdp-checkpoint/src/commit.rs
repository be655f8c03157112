//! Saving a checkpoint as one atomic commit over all ranks.
//!
//! A save of step N under `ROOT`, every rank calling [`save`] (each phase ends in an
//! agreement: every rank's verdict reaches every rank, and if one failed, all give up):
//!
//! 1. *prepare* — each rank builds its shard in memory; rank 0 refuses an existing
//!    `ROOT/step-N` ([`CheckpointError::Exists`]) and creates a fresh `ROOT/step-N.tmp/`
//!    (removing a stale one a crashed save left).
//! 2. *write* — each rank creates its file there (`create_new`: never through an existing
//!    file or symlink), writes and fsyncs it and the directory; its verdict carries the file's
//!    size and SHA-256.
//! 3. *commit* — rank 0 writes `manifest.json` (step, plan fingerprint, every file's size and
//!    SHA-256; written last, fsynced), renames `step-N.tmp` to `step-N` in one atomic rename,
//!    fsyncs `ROOT`, then applies keep-last-K. Every rank returns only after this agreement,
//!    when the commit is visible.
//!
//! On a failure before the rename rank 0 removes `step-N.tmp`; nothing is renamed and the
//! previous checkpoints are untouched. A crash at any point leaves at most a `step-N.tmp`
//! without a manifest, which loading never takes for a checkpoint.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::backend::Backend;
use sshsdp_backend::{HsdpRuntime, NamedParam};

use crate::agree::{agree, Verdict};
use crate::buffers::{buffer_slices, refuse_buffers, saved_buffers};
use crate::layout::{prepare_tmp, prune, publish, write_new_file};
use crate::runtime_io::build_shard;
use crate::{CheckpointError, Manifest, UnitState};

/// How [`save_with`] saves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveOptions {
    /// Keep-last-K: after a commit, the committed checkpoints older than the new one are
    /// deleted beyond the `K - 1` most recent (`Some(K)`, `K >= 1`); `None` keeps all.
    /// Newer steps, unfinished saves and other files are never touched. Default `Some(3)`.
    pub keep_last: Option<usize>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { keep_last: Some(3) }
    }
}

impl SaveOptions {
    /// These options keeping the last `keep` checkpoints (`None`: all).
    pub fn with_keep_last(mut self, keep: Option<usize>) -> Self {
        self.keep_last = keep;
        self
    }
}

/// Saves step `step` of the sharded model (every rank's fp32 masters, `optimizer`'s state
/// and `step`) as the committed checkpoint `root/step-{step}`, with the default
/// [`SaveOptions`] (keep the last 3). A collective call: every rank calls it with the same
/// `root` (on a file system all ranks share) and `step`. Returns the committed directory;
/// on `Err`, on every rank, no checkpoint was committed (except for an error of keep-last-K
/// after the commit, which says so). A newer committed step already in `root` stays the
/// latest, which `load(root)` picks.
///
/// A model with module buffers (BatchNorm's running statistics) is refused, on every rank,
/// before anything is written: save it with [`save_model`], which saves them too.
pub fn save<B: Backend>(
    root: impl AsRef<Path>,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    step: u64,
) -> Result<PathBuf, CheckpointError> {
    save_with(root, runtime, optimizer, step, &SaveOptions::default())
}

/// [`save`] with explicit options.
pub fn save_with<B: Backend>(
    root: impl AsRef<Path>,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    step: u64,
    options: &SaveOptions,
) -> Result<PathBuf, CheckpointError> {
    refuse_buffers(runtime, "save", "save_model")?;
    commit(
        root.as_ref(),
        runtime,
        optimizer,
        Ok(Vec::new()),
        step,
        options,
    )
}

/// [`save`] of a model with module buffers: also saves rank 0's buffers (read from `module`,
/// the sharded module, after folding in any update a `RunningState` holds back), which
/// [`crate::load_model`] restores on every rank at any world size. Call
/// `HsdpRuntime::broadcast_buffers` first to save buffers every rank agrees on. Works for
/// models without buffers too.
pub fn save_model<B: Backend, MB: Backend, M: Module<MB>>(
    root: impl AsRef<Path>,
    module: &M,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    step: u64,
) -> Result<PathBuf, CheckpointError> {
    save_model_with(
        root,
        module,
        runtime,
        optimizer,
        step,
        &SaveOptions::default(),
    )
}

/// [`save_model`] with explicit options.
pub fn save_model_with<B: Backend, MB: Backend, M: Module<MB>>(
    root: impl AsRef<Path>,
    module: &M,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    step: u64,
    options: &SaveOptions,
) -> Result<PathBuf, CheckpointError> {
    let buffers = saved_buffers(runtime, module);
    commit(root.as_ref(), runtime, optimizer, buffers, step, options)
}

/// The save's three phases; `buffers` are what this rank saves of the module's buffers (or
/// why it could not read them, which fails the prepare phase on every rank).
fn commit<B: Backend>(
    root: &Path,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    buffers: Result<Vec<NamedParam>, CheckpointError>,
    step: u64,
    options: &SaveOptions,
) -> Result<PathBuf, CheckpointError> {
    let lead = runtime.rank() == 0;

    // 1. prepare. Building the shard is itself collective: every rank does it first.
    let (tmp, target) = tmp_and_target(root, step);
    let mut created = false;
    // Collective: every rank builds its shard, whatever its buffers' verdict.
    let prepared = build_shard(runtime, optimizer, step);
    let prepared = prepared.and_then(|mut shard| {
        shard.slices.extend(buffer_slices(buffers?));
        if options.keep_last == Some(0) {
            return Err(CheckpointError::Invalid(
                "keep_last must keep at least the new checkpoint".into(),
            ));
        }
        if lead {
            prepare_tmp(root, step)?;
            created = true;
        }
        Ok(shard)
    });
    // Only the rank that created the temporary directory removes it, and only after every
    // rank is done with it (after an agreement).
    let cleanup = |e: CheckpointError| {
        if created {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        e
    };
    let verdict = Verdict::of(&prepared);
    let shard = agree(runtime, "save (prepare)", verdict, prepared)
        .map_err(cleanup)?
        .0;

    // 2. write.
    let written =
        injected("sshsdp::save", runtime.rank(), &tmp).and_then(|()| write_shard(&tmp, &shard));
    let mut verdict = Verdict::of(&written);
    if let Ok((size, digest)) = &written {
        verdict.size = *size;
        verdict.digest = *digest;
    }
    let (_, verdicts) = agree(runtime, "save (write)", verdict, written).map_err(cleanup)?;

    // 3. commit (rank 0), then the agreement that makes every rank wait for it.
    let committed = if lead {
        let files: Vec<(u64, String)> = verdicts.iter().map(|v| (v.size, hex(&v.digest))).collect();
        let manifest = Manifest::new(step, runtime.plan().fingerprint().to_string(), &files);
        let result = manifest
            .write_new(&tmp)
            .and_then(|_| publish(root, &tmp, &target));
        match result {
            Err(e) => Err(cleanup(e)),
            Ok(()) => match options.keep_last {
                Some(keep) => prune(root, step, keep).map(|_| ()).map_err(|e| {
                    CheckpointError::Invalid(format!(
                        "committed {} but keep-last-{keep} failed: {e}",
                        target.display()
                    ))
                }),
                None => Ok(()),
            },
        }
    } else {
        Ok(())
    };
    agree(runtime, "save (commit)", Verdict::of(&committed), committed)?;
    Ok(target)
}

/// `root/step-N.tmp` and `root/step-N`.
fn tmp_and_target(root: &Path, step: u64) -> (PathBuf, PathBuf) {
    (
        root.join(crate::layout::tmp_dir_name(step)),
        root.join(crate::step_dir_name(step)),
    )
}

/// Writes `shard` as a new file in the temporary directory `tmp` (which must be a real
/// directory), synced with the directory; returns the file's size and SHA-256.
fn write_shard(tmp: &Path, shard: &crate::ShardFile) -> Result<(u64, [u8; 32]), CheckpointError> {
    crate::layout::check_real_dir(tmp)?;
    let bytes = shard.to_bytes()?;
    write_new_file(&tmp.join(shard.file_name()), &bytes)?;
    crate::layout::sync_dir(tmp)?;
    Ok((bytes.len() as u64, Verdict::sha256(&bytes)))
}

fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fault injected at `point` on `rank` (tests only: see `sshsdp_comm::faults`), reported as
/// an I/O error on `file`.
pub(crate) fn injected(
    point: &'static str,
    rank: usize,
    file: &Path,
) -> Result<(), CheckpointError> {
    sshsdp_comm::faults::inject(point, rank).map_err(|msg| CheckpointError::Io {
        file: file.to_path_buf(),
        source: std::io::Error::other(msg),
    })
}
