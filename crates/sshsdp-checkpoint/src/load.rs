//! Loading a committed checkpoint: all-or-nothing and collective.
//!
//! 1. *validate* — each rank resolves the checkpoint (a step directory, or a root meaning its
//!    latest committed step), reads the manifest, reads every shard file listed there checking
//!    its size (before reading) and SHA-256 against the manifest, parses and cross-checks the
//!    shards, checks the model (parameters, shapes, optimizer) and assembles all of its update
//!    units' values in memory. Nothing is applied yet.
//! 2. The ranks agree: if any rank failed, or the ranks resolved different checkpoints, every
//!    rank returns an error (naming the failing ranks and why) and no rank applies anything.
//! 3. *apply* — each rank imports its optimizer state and then, only if that succeeded,
//!    overwrites its masters; a final agreement makes every rank return the same verdict.
//!    (Should an optimizer refuse state the validation accepted, that rank keeps its masters
//!    and every rank returns an error, but the other ranks have applied theirs.)

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::backend::Backend;
use sshsdp_backend::{HsdpRuntime, NamedParam};
use sshsdp_optim::UpdateUnit;

use crate::agree::{agree, Verdict};
use crate::buffers::{assemble_buffers, refuse_buffers};
use crate::runtime_io::{apply, assemble_units, layout, UnitValues};
use crate::{resolve, CheckpointError, Coverage, Manifest, ShardFile, UnitState};

/// Loads a committed checkpoint — saved at any world size and mesh — into this rank's masters
/// and `optimizer`'s state; returns the saved step. `path` is a committed step directory
/// (`ROOT/step-N`) or a checkpoint root, meaning its latest committed step; a directory
/// without a manifest (a crashed save) is an error, never loaded. The checkpoint must hold
/// exactly this model's parameters with the same shapes.
///
/// A collective call: every rank calls it. All or nothing: every rank validates everything
/// before any rank touches its masters, and if one rank fails, every rank returns an error.
///
/// A model with module buffers is refused on every rank before anything is read: load it
/// with [`load_model`], which restores them too.
pub fn load<B: Backend>(
    path: impl AsRef<Path>,
    runtime: &HsdpRuntime<B>,
    optimizer: &mut impl UnitState,
) -> Result<u64, CheckpointError> {
    refuse_buffers(runtime, "load", "load_model")?;
    Ok(load_all(path.as_ref(), runtime, optimizer, Ok(()))?.0)
}

/// [`load`] of a model with module buffers: also sets `module`'s buffers (the sharded module)
/// on every rank to those the checkpoint holds (rank 0's at save time), whatever the world
/// size it was saved at. The buffers are validated with everything else and set only when the
/// masters were. Works for models without buffers too.
pub fn load_model<B: Backend, MB: Backend, M: Module<MB>>(
    path: impl AsRef<Path>,
    module: &mut M,
    runtime: &HsdpRuntime<B>,
    optimizer: &mut impl UnitState,
) -> Result<u64, CheckpointError> {
    // That `module` is the sharded one (it holds every buffer) is part of the validation.
    let readable = runtime
        .buffer_values(&*module)
        .map(drop)
        .map_err(CheckpointError::Runtime);
    let (step, buffers) = load_all(path.as_ref(), runtime, optimizer, readable)?;
    *module = runtime
        .set_buffer_values(module.clone(), &buffers)
        .map_err(CheckpointError::Runtime)?;
    Ok(step)
}

/// Both phases of a load; returns the step and the buffers to set. `local` is a check of
/// this rank's that fails its validation (every rank still takes part in every collective).
fn load_all<B: Backend>(
    path: &Path,
    runtime: &HsdpRuntime<B>,
    optimizer: &mut impl UnitState,
    local: Result<(), CheckpointError>,
) -> Result<(u64, Vec<NamedParam>), CheckpointError> {
    // Collective and infallible in content: every rank runs it before anything can fail.
    let units = layout(runtime)?;
    let prepared = local
        .and_then(|()| crate::commit::injected("sshsdp::load", runtime.rank(), path))
        .and_then(|()| prepare(path, runtime, &*optimizer, &units));
    let mut verdict = Verdict::of(&prepared);
    if let Ok(p) = &prepared {
        verdict.tag = p.step;
        verdict.digest = p.identity;
    }
    let (prepared, verdicts) = agree(runtime, "load (validate)", verdict, prepared)?;
    if let Some((rank, v)) = verdicts
        .iter()
        .enumerate()
        .find(|(_, v)| (v.tag, v.digest) != (verdicts[0].tag, verdicts[0].digest))
    {
        return Err(CheckpointError::Mismatch {
            file: prepared.dir,
            reason: format!(
                "the ranks resolved different checkpoints: rank 0 step {}, rank {rank} step {} \
                 (or another manifest); load a step directory, not a root being written to",
                verdicts[0].tag, v.tag
            ),
        });
    }
    let step = prepared.step;
    let applied = apply(runtime, optimizer, &units, prepared.values);
    agree(runtime, "load (apply)", Verdict::of(&applied), applied)?;
    Ok((step, prepared.buffers))
}

/// What a rank validated and assembled, ready to apply.
struct Prepared {
    dir: PathBuf,
    step: u64,
    /// Identifies the manifest read (the SHA-256 of its SHA-256).
    identity: [u8; 32],
    values: Vec<UnitValues>,
    /// The model's buffers.
    buffers: Vec<NamedParam>,
}

fn prepare<B: Backend>(
    path: &Path,
    runtime: &HsdpRuntime<B>,
    optimizer: &impl UnitState,
    units: &[UpdateUnit],
) -> Result<Prepared, CheckpointError> {
    let (dir, manifest, manifest_sha, files) = read_verified(path)?;
    let coverage = Coverage::new(&files)?;
    let (values, step) = assemble_units(&dir, (&files, &coverage), runtime, optimizer, units)?;
    let buffers = assemble_buffers(&dir, &coverage, runtime)?;
    if step != manifest.step {
        return Err(CheckpointError::Mismatch {
            file: dir,
            reason: format!(
                "the shards say step {step}, the manifest step {}",
                manifest.step
            ),
        });
    }
    Ok(Prepared {
        dir,
        step,
        identity: Verdict::sha256(manifest_sha.as_bytes()),
        values,
        buffers,
    })
}

/// Every shard of the committed checkpoint `path` names ([`resolve`]), in rank order, each
/// file checked against the manifest (size, SHA-256) and the shards against each other (rank,
/// world, plan). Not collective: for export ([`crate::export_full`]) and inspection.
pub fn read_checkpoint(path: impl AsRef<Path>) -> Result<Vec<ShardFile>, CheckpointError> {
    Ok(read_verified(path.as_ref())?.3)
}

/// [`read_checkpoint`], also returning the directory, its manifest and the manifest's
/// SHA-256.
fn read_verified(
    path: &Path,
) -> Result<(PathBuf, Manifest, String, Vec<ShardFile>), CheckpointError> {
    let dir = resolve(path)?;
    let (manifest, manifest_sha) = Manifest::read(&dir)?;
    let mut shards: Vec<ShardFile> = Vec::with_capacity(manifest.world);
    for (rank, entry) in manifest.files.iter().enumerate() {
        let bytes = manifest.read_file(&dir, rank)?;
        let file = dir.join(&entry.name);
        let shard = ShardFile::from_bytes(&bytes, &file)?;
        let mismatch = |reason: String| CheckpointError::Mismatch {
            file: file.clone(),
            reason,
        };
        if shard.rank != rank || shard.world != manifest.world {
            return Err(mismatch(format!(
                "the file says rank {} of {}, the manifest rank {rank} of {}",
                shard.rank, shard.world, manifest.world
            )));
        }
        if let Some(first) = shards.first() {
            if first.plan_json != shard.plan_json {
                return Err(mismatch("its plan JSON differs from rank 0's".into()));
            }
        }
        shards.push(shard);
    }
    Ok((dir, manifest, manifest_sha, shards))
}
