//! Consolidated safetensors files: streaming export from a sharded model, sharded import
//! (`Shard::from_source` + `SafetensorsSource`) at any world size, plain Burn loading an export, and
//! clear errors for files that do not fit the model.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::sharded::{masters_are, net, on_ranks, set_masters, value, Hb, Net};
use crate::common::TempDir;
use burn::backend::NdArray;
use burn::nn::{LayerNormConfig, LinearConfig};
use burn_store::{ModuleSnapshot, SafetensorsStore};
use sshsdp_backend::{named_params, HsdpConfig, HsdpError, ParamSource, Shard};
use sshsdp_checkpoint::{export_safetensors, CheckpointError, SafetensorsSource};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::Collective;
use sshsdp_plan::{Mesh, RuntimeFormat, Sharding};

/// Counts the elements a rank reads.
struct Counting<'a> {
    inner: &'a SafetensorsSource,
    read: AtomicUsize,
}

impl ParamSource for Counting<'_> {
    fn check(&self, path: &str, shape: &[usize]) -> Result<(), String> {
        self.inner.check(path, shape)
    }

    fn read(
        &self,
        path: &str,
        range: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), String> {
        self.read.fetch_add(range.len(), Ordering::Relaxed);
        self.inner.read(path, range, out)
    }
}

/// The configuration of a run on `mesh` in `format`.
fn config(mesh: Mesh, sharding: Sharding, format: RuntimeFormat) -> HsdpConfig {
    HsdpConfig::new(mesh)
        .with_bucket_elements(100)
        .with_sharding(sharding)
        .with_format(format)
}

/// Imports `file` into `model` over `mesh` (a threads world of its size) and runs `f(rank,
/// runtime, elements read)` on every rank; or every rank's error.
fn import<T: Send>(
    file: &Path,
    model: Net<Hb>,
    config: HsdpConfig,
    f: impl Fn(usize, &crate::common::sharded::Runtime, usize) -> T + Sync,
) -> Vec<Result<T, HsdpError>> {
    let world = config.mesh.world_size();
    let threads = ThreadsConfig {
        timeout: Duration::from_secs(30),
    };
    ThreadsWorld::run(world, threads, |comm| {
        let rank = comm.rank();
        let source = SafetensorsSource::open(file).unwrap();
        let counting = Counting {
            inner: &source,
            read: AtomicUsize::new(0),
        };
        let device = Default::default();
        let (_model, runtime) = Shard::new(config.clone())
            .from_source(&counting)
            .run::<Hb, _, _>(model.clone(), comm, &device)?;
        Ok(f(rank, &runtime, counting.read.load(Ordering::Relaxed)))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// Exports the model with masters numbered 3 from a world of `world` ranks.
fn export_from(world: usize, file: &Path) {
    let file = file.to_path_buf();
    for r in on_ranks(world, |_, rt| {
        set_masters(rt, 3);
        export_safetensors(rt, &file)
    }) {
        r.unwrap();
    }
}

/// An export imports bit-exactly at every world size, mesh, sharding and runtime format, and
/// the import exported again is the same file byte for byte; each rank reads only its shard.
#[test]
fn export_and_import_round_trip_bit_exactly_at_any_world_size() {
    let dir = TempDir::new("consolidated");
    let first = dir.0.join("model.safetensors");
    export_from(2, &first);
    let bytes = std::fs::read(&first).unwrap();
    let total: usize = named_params(&net())
        .unwrap()
        .iter()
        .map(|p| p.values.len())
        .sum();
    let runs = [
        (
            Mesh::flat(1).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::F32,
        ),
        (
            Mesh::flat(3).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::Bf16,
        ),
        (
            Mesh::flat(4).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::F32,
        ),
        (
            Mesh::new(2, 2).unwrap(),
            Sharding::Hsdp,
            RuntimeFormat::Mxfp8,
        ),
        (
            Mesh::new(2, 2).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::Bf16,
        ),
    ];
    for (i, (mesh, sharding, format)) in runs.into_iter().enumerate() {
        let again = dir.0.join(format!("again-{i}.safetensors"));
        let results = import(
            &first,
            net(),
            config(mesh, sharding, format),
            |_, rt, read| (masters_are(rt, 3), read, export_safetensors(rt, &again)),
        );
        let what = format!("{mesh:?} {sharding:?} {format:?}");
        for r in results {
            let (exact, read, exported) = r.unwrap();
            assert!(exact, "{what}: the masters are the exported values");
            exported.unwrap();
            if mesh.world_size() > 1 {
                assert!(
                    read < total,
                    "{what}: a rank read {read} of {total} elements"
                );
            }
            assert!(read > 0, "{what}");
        }
        assert_eq!(
            std::fs::read(&again).unwrap(),
            bytes,
            "{what}: the same file"
        );
    }
}

/// Plain Burn loads an export into the unsharded module (burn-store's safetensors loader).
#[test]
fn plain_burn_loads_an_export() {
    let dir = TempDir::new("consolidated-burn");
    let file = dir.0.join("model.safetensors");
    export_from(4, &file);
    let device = Default::default();
    let mut plain: Net<NdArray<f32>> = Net {
        a: LinearConfig::new(12, 20).init(&device),
        b: LinearConfig::new(20, 7).init(&device),
        norm: LayerNormConfig::new(7).init(&device),
    };
    let mut store = SafetensorsStore::from_file(&file);
    let applied = plain.load_from(&mut store).unwrap();
    assert!(applied.errors.is_empty(), "{applied:?}");
    for (param, p) in named_params(&plain).unwrap().iter().enumerate() {
        for (i, v) in p.values.iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                value(param, i, 3).to_bits(),
                "{} [{i}]",
                p.path
            );
        }
    }
}

/// Every rank's error, as text.
fn errors(results: Vec<Result<(), HsdpError>>) -> Vec<String> {
    results
        .into_iter()
        .map(|r| r.expect_err("the import must fail").to_string())
        .collect()
}

/// A file that does not fit the model is an error on every rank naming the parameter: a
/// missing tensor, another shape, a dtype that is not a float.
#[test]
fn a_file_that_does_not_fit_the_model_is_an_error_on_every_rank() {
    let dir = TempDir::new("consolidated-errors");
    let file = dir.0.join("model.safetensors");
    export_from(1, &file);
    let flat2 = || {
        config(
            Mesh::flat(2).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::F32,
        )
    };

    // Missing: the names mapped to ones the file does not have.
    let results = ThreadsWorld::run(2, ThreadsConfig::default(), |comm| {
        let source = SafetensorsSource::open(&file)
            .unwrap()
            .with_names(|p| format!("model.{p}"));
        Shard::new(flat2())
            .from_source(&source)
            .run::<Hb, _, _>(net(), comm, &Default::default())
            .map(|_| ())
    })
    .unwrap();
    for e in errors(results.into_iter().map(|r| r.unwrap()).collect()) {
        assert!(e.contains("'a.weight'") || e.contains("rank"), "{e}");
    }

    // Another shape.
    let device = Default::default();
    let wider = Net::<Hb> {
        a: LinearConfig::new(12, 21).init(&device),
        b: LinearConfig::new(21, 7).init(&device),
        norm: LayerNormConfig::new(7).init(&device),
    };
    let e = errors(import(&file, wider, flat2(), |_, _, _| ()));
    assert!(
        e[0].contains("'a.weight'") && e[0].contains("[12, 21]"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("'a.weight'") || e[1].contains("rank 0"),
        "{}",
        e[1]
    );

    // A dtype that is not a float: the same file with `a.bias` as I32.
    let bad = dir.0.join("int.safetensors");
    let params = named_params(&net()).unwrap();
    let data: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = params
        .iter()
        .map(|p| {
            let dtype = if p.path == "a.bias" {
                safetensors::Dtype::I32
            } else {
                safetensors::Dtype::F32
            };
            let bytes = p.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (p.path.clone(), bytes, dtype, p.shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, bytes, dtype, shape)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &bad).unwrap();
    let e = errors(import(&bad, net(), flat2(), |_, _, _| ()));
    assert!(
        e[0].contains("'a.bias'") && e[0].contains("I32"),
        "{}",
        e[0]
    );
}

/// Truncated files and absurd headers are refused when opened, before any data is read.
#[test]
fn corrupt_files_are_refused_when_opened() {
    let dir = TempDir::new("consolidated-corrupt");
    let file = dir.0.join("model.safetensors");
    export_from(1, &file);
    let bytes = std::fs::read(&file).unwrap();
    let cases: [(&str, Vec<u8>); 4] = [
        ("truncated", bytes[..bytes.len() - 4].to_vec()),
        ("empty", Vec::new()),
        ("huge header", {
            let mut b = bytes.clone();
            b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            b
        }),
        ("garbage header", {
            let mut b = bytes.clone();
            b[8..16].copy_from_slice(b"not json");
            b
        }),
    ];
    for (what, content) in cases {
        let path = dir.0.join(format!("{what}.safetensors"));
        std::fs::write(&path, content).unwrap();
        match SafetensorsSource::open(&path) {
            Err(CheckpointError::Corrupt { file, reason }) => {
                assert_eq!(file, path, "{what}: {reason}");
            }
            Err(e) => panic!("{what}: {e}"),
            Ok(_) => panic!("{what}: opened"),
        }
    }
}

/// Rank 0 failing to write (here: no such directory) is an error on every rank, and no file
/// is left behind.
#[test]
fn a_failed_export_is_an_error_on_every_rank() {
    let dir = TempDir::new("consolidated-fail");
    let file = dir.0.join("no-such-dir").join("model.safetensors");
    let results = on_ranks(3, |_, rt| export_safetensors(rt, &file));
    for (rank, r) in results.into_iter().enumerate() {
        let e = r.expect_err("the export must fail").to_string();
        if rank == 0 {
            assert!(e.contains("no-such-dir"), "{e}");
        } else {
            assert!(e.contains("rank 0"), "{e}");
        }
    }
    assert!(!dir.0.join("no-such-dir").exists());
}

/// Import → change the masters (as an update would) → export → import elsewhere: the second
/// import holds the changed values, bit for bit.
#[test]
fn an_imported_model_updated_and_exported_imports_with_its_new_values() {
    let dir = TempDir::new("consolidated-update");
    let (first, updated) = (dir.0.join("a.safetensors"), dir.0.join("b.safetensors"));
    export_from(4, &first);
    let flat = |n| {
        config(
            Mesh::flat(n).unwrap(),
            Sharding::Hierarchical,
            RuntimeFormat::Bf16,
        )
    };
    for r in import(&first, net(), flat(2), |_, rt, _| {
        let before = masters_are(rt, 3);
        set_masters(rt, 4);
        (before, export_safetensors(rt, &updated))
    }) {
        let (before, exported) = r.unwrap();
        assert!(before);
        exported.unwrap();
    }
    for r in import(&updated, net(), flat(3), |_, rt, _| masters_are(rt, 4)) {
        assert!(r.unwrap(), "the updated values, bit for bit");
    }
}
