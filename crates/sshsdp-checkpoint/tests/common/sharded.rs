//! A small model sharded over a threads world, masters set to known values, and a test
//! optimizer state: for the collective save/load tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use sshsdp_backend::{shard, Hsdp, HsdpConfig, HsdpRuntime};
use sshsdp_checkpoint::{CheckpointError, EncodedState, UnitState};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_plan::Mesh;
use sshsdp_plan::UpdateUnit;

pub type Inner = NdArray<f32>;
/// The backend the model is sharded on.
pub type Hb = Autodiff<Hsdp<Inner>>;
pub type Runtime = HsdpRuntime<Inner>;

/// Two linear layers and a norm: parameters of several shapes over a few buckets.
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub a: Linear<B>,
    pub b: Linear<B>,
    pub norm: LayerNorm<B>,
}

/// The model every test shards (the same initial values in every call).
pub fn net() -> Net<Hb> {
    let device = Default::default();
    Net {
        a: LinearConfig::new(12, 20).init(&device),
        b: LinearConfig::new(20, 7).init(&device),
        norm: LayerNormConfig::new(7).init(&device),
    }
}

/// Runs `f(rank, runtime)` on every rank of a `world`-rank threads world holding the sharded
/// model; returns each rank's result.
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(usize, &Runtime) -> T + Sync) -> Vec<T> {
    let init = net();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(30),
    };
    ThreadsWorld::run(world, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let config = HsdpConfig::new(Mesh::flat(world).unwrap()).with_bucket_elements(100);
        let (_model, runtime) = shard::<Hb, _, _>(init.clone(), config, comm, &device).unwrap();
        f(rank, &runtime)
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// The master value of element `index` of parameter `param` in the masters numbered `salt`:
/// the same whatever the world size and sharding.
pub fn value(param: usize, index: usize, salt: u32) -> f32 {
    let h = (param as u64 * 7919 + index as u64 * 31 + u64::from(salt) * 104_729) % 2003;
    h as f32 / 500.0 - 2.0 + salt as f32 * 1e-3
}

/// Runs `f` on this rank's update units and their master slices.
fn with_units<R>(rt: &Runtime, f: impl FnOnce(&[UpdateUnit], &mut [&mut [f32]]) -> R) -> R {
    let mut out = None;
    rt.master_pieces(|pieces, _| {
        let units = rt
            .plan()
            .update_units(pieces.iter().map(|p| (p.bucket, p.index)))?;
        let mut masters = Vec::new();
        for p in pieces.iter_mut() {
            masters.push(p.host()?.0);
        }
        out = Some(f(&units, &mut masters));
        Ok(())
    })
    .unwrap();
    out.unwrap()
}

/// Sets this rank's masters to the values numbered `salt` ([`value`]).
pub fn set_masters(rt: &Runtime, salt: u32) {
    with_units(rt, |units, masters| {
        for u in units {
            let slice = &mut masters[u.piece][u.in_piece.clone()];
            for (v, i) in slice.iter_mut().zip(u.param_indices()) {
                *v = value(u.param, i, salt);
            }
        }
    })
}

/// Whether every master of this rank holds, bit for bit, the values numbered `salt`.
pub fn masters_are(rt: &Runtime, salt: u32) -> bool {
    with_units(rt, |units, masters| {
        !units.is_empty()
            && units.iter().all(|u| {
                masters[u.piece][u.in_piece.clone()]
                    .iter()
                    .zip(u.param_indices())
                    .all(|(v, i)| v.to_bits() == value(u.param, i, salt).to_bits())
            })
    })
}

/// A test optimizer state: unit `u`'s array `"m"` is `value(u.param, .., 100)` and its scalar
/// `"t"` is 5; it records what it imports, and can fail its export (a real failure of one
/// rank's save).
pub struct TestState {
    pub name: String,
    pub fail_export: bool,
    pub imported: Vec<(UpdateUnit, Option<EncodedState>)>,
    pub finished: bool,
}

impl TestState {
    pub fn new() -> Self {
        Self {
            name: "TestState".into(),
            fail_export: false,
            imported: Vec::new(),
            finished: false,
        }
    }

    fn state_of(unit: &UpdateUnit) -> EncodedState {
        let m = unit
            .param_indices()
            .map(|i| value(unit.param, i, 100))
            .collect();
        (
            BTreeMap::from([("m".to_owned(), m)]),
            BTreeMap::from([("t".to_owned(), 5.0)]),
        )
    }

    /// Whether the imported state is exactly what a save exported, for every unit.
    pub fn restored(&self) -> bool {
        self.finished
            && !self.imported.is_empty()
            && self.imported.iter().all(|(unit, state)| {
                let want = Self::state_of(unit);
                state.as_ref().is_some_and(|(arrays, scalars)| {
                    arrays["m"]
                        .iter()
                        .map(|v| v.to_bits())
                        .eq(want.0["m"].iter().map(|v| v.to_bits()))
                        && arrays.len() == 1
                        && *scalars == want.1
                })
            })
    }
}

impl UnitState for TestState {
    fn export_unit(&self, unit: &UpdateUnit) -> Result<Option<EncodedState>, CheckpointError> {
        if self.fail_export {
            return Err(CheckpointError::Codec("injected export failure".into()));
        }
        Ok(Some(Self::state_of(unit)))
    }

    fn import_unit(
        &mut self,
        unit: &UpdateUnit,
        state: Option<EncodedState>,
    ) -> Result<(), CheckpointError> {
        self.imported.push((unit.clone(), state));
        Ok(())
    }

    fn optimizer_name(&self) -> Option<String> {
        Some(self.name.clone())
    }

    fn finish_import(&mut self, _pieces: &[(usize, usize)]) -> Result<(), CheckpointError> {
        self.finished = true;
        Ok(())
    }
}

/// The names in `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Every file under `dir` with its bytes, sorted by path.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    files.sort();
    files
}
