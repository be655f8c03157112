//! Helpers shared by the checkpoint tests: temp dirs, a deterministic generator, sharded test
//! models and hand-made (deliberately defective) shard files.

// Each test file uses its own subset of these helpers.
#![allow(dead_code)]

pub mod sharded;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::NdArray;
use serde_json::json;
use sha2::{Digest, Sha256};
use sshsdp_checkpoint::{
    CheckpointError, FullModel, ShardFile, SliceEntry, FORMAT_VERSION, MASTER,
};

/// The backend of the optimizer-state tests.
pub type B = NdArray;

/// A fresh, empty directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "sshsdp-checkpoint-{tag}-{}-{n}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A small deterministic generator (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// An unsharded model with a few parameter shapes, including a 1-element one.
pub fn model(rng: &mut Rng) -> FullModel {
    let shapes: [(&str, &[usize]); 5] = [
        ("embed.weight", &[7, 5]),
        ("layers.0.linear.weight", &[6, 4]),
        ("layers.0.linear.bias", &[4]),
        ("norm.gamma", &[1]),
        ("head.weight", &[33, 3]),
    ];
    shapes
        .iter()
        .map(|(path, shape)| {
            let n = numel(shape);
            (path.to_string(), (shape.to_vec(), rng.values(n)))
        })
        .collect()
}

/// `world` consecutive ranges covering `0..n`, cut at random points (some may be empty).
pub fn random_cuts(n: usize, world: usize, rng: &mut Rng) -> Vec<std::ops::Range<usize>> {
    let mut cuts: Vec<usize> = (0..world - 1).map(|_| rng.below(n + 1)).collect();
    cuts.sort_unstable();
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(cuts)
        .chain(std::iter::once(n))
        .collect();
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The "optimizer state" arrays stored next to the master weights in the test shards.
pub fn state_of(master: &[f32]) -> BTreeMap<String, Vec<f32>> {
    BTreeMap::from([
        (
            "state.momentum.moment_1".to_owned(),
            master.iter().map(|v| v * 0.5).collect(),
        ),
        (
            "state.momentum.moment_2".to_owned(),
            master.iter().map(|v| v * v).collect(),
        ),
    ])
}

/// Shards of `full` for `world` ranks, each parameter cut at its own random points; every
/// slice holds "master" and two state arrays. Also returns each rank's ranges.
pub fn shard_model(full: &FullModel, world: usize, rng: &mut Rng, plan: &str) -> Vec<ShardFile> {
    let mut shards: Vec<ShardFile> = (0..world)
        .map(|rank| ShardFile {
            rank,
            world,
            plan_json: plan.to_owned(),
            slices: Vec::new(),
            scalars: BTreeMap::from([("step".to_owned(), 12.0), ("adam.time".to_owned(), 12.0)]),
        })
        .collect();
    for (path, (shape, values)) in full {
        for (rank, range) in random_cuts(values.len(), world, rng)
            .into_iter()
            .enumerate()
        {
            let master = values[range.clone()].to_vec();
            let mut arrays = state_of(&master);
            arrays.insert(MASTER.to_owned(), master);
            shards[rank].slices.push(SliceEntry {
                path: path.clone(),
                shape: shape.clone(),
                start: range.start,
                end: range.end,
                arrays,
            });
        }
    }
    shards
}

pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Bit-exact equality of two shards (NaN-safe, unlike `PartialEq`).
pub fn assert_same_shard(a: &ShardFile, b: &ShardFile) {
    assert_eq!(
        (a.rank, a.world, &a.plan_json),
        (b.rank, b.world, &b.plan_json)
    );
    let scalar_bits = |s: &BTreeMap<String, f64>| {
        s.iter()
            .map(|(k, v)| (k.clone(), v.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(scalar_bits(&a.scalars), scalar_bits(&b.scalars));
    assert_eq!(a.slices.len(), b.slices.len());
    for (x, y) in a.slices.iter().zip(&b.slices) {
        assert_eq!(
            (&x.path, &x.shape, x.start, x.end),
            (&y.path, &y.shape, y.start, y.end)
        );
        let arrays = |s: &SliceEntry| {
            s.arrays
                .iter()
                .map(|(k, v)| (k.clone(), bits(v)))
                .collect::<Vec<_>>()
        };
        assert_eq!(arrays(x), arrays(y));
    }
}

pub fn sha_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A safetensors file built by hand (bypassing `ShardFile::write`'s validation) from a
/// header document and named tensors (`F32` unless the name ends in `#f64`); the header's
/// checksum is computed, so only the deliberate defect remains.
pub fn raw_file(header: &serde_json::Value, tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
    use safetensors::tensor::{Dtype, TensorView};
    let header_json = header.to_string();
    let metadata = std::collections::HashMap::from([
        (
            "sshsdp.header_sha256".to_owned(),
            sha_hex(header_json.as_bytes()),
        ),
        ("sshsdp.header".to_owned(), header_json),
    ]);
    let data: Vec<(String, Dtype, Vec<u8>, usize)> = tensors
        .iter()
        .map(|(name, values)| match name.strip_suffix("#f64") {
            Some(name) => {
                let bytes = values
                    .iter()
                    .flat_map(|v| f64::from(*v).to_le_bytes())
                    .collect();
                (name.to_owned(), Dtype::F64, bytes, values.len())
            }
            None => (
                (*name).to_owned(),
                Dtype::F32,
                le_bytes(values),
                values.len(),
            ),
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = data
        .iter()
        .map(|(name, dtype, bytes, n)| {
            (
                name.as_str(),
                TensorView::new(*dtype, vec![*n], bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, Some(metadata)).unwrap()
}

/// A valid header for one slice `w[0..4)` of shape `[8]` with array "master" = `VALUES`.
pub const VALUES: [f32; 4] = [1.0, -2.0, 3.5, 0.25];

pub fn valid_header() -> serde_json::Value {
    json!({
        "format": "sshsdp-shard",
        "version": FORMAT_VERSION,
        "rank": 0,
        "world": 2,
        "plan_json": "{}",
        "scalars": {"step": "3"},
        "slices": [{
            "path": "w", "shape": [8], "start": 0, "end": 4,
            "arrays": {"master": sha_hex(&le_bytes(&VALUES))}
        }]
    })
}

pub fn read_bytes(bytes: &[u8]) -> Result<ShardFile, CheckpointError> {
    ShardFile::from_bytes(bytes, Path::new("test.safetensors"))
}

pub fn corrupt_reason(result: Result<ShardFile, CheckpointError>) -> String {
    match result {
        Err(CheckpointError::Corrupt { reason, .. }) => reason,
        other => panic!("expected a Corrupt error, got {other:?}"),
    }
}

/// A small but complete shard with special values.
pub fn special_shard() -> ShardFile {
    ShardFile {
        rank: 1,
        world: 3,
        plan_json: r#"{"plan": [1, 2, "x|y"], "unicode": "é"}"#.to_owned(),
        slices: vec![
            SliceEntry {
                path: "a.weight".into(),
                shape: vec![3, 4],
                start: 2,
                end: 9,
                arrays: BTreeMap::from([
                    (
                        MASTER.to_owned(),
                        vec![
                            f32::NAN,
                            -0.0,
                            f32::INFINITY,
                            f32::MIN_POSITIVE / 8.0,
                            1e30,
                            -1.5,
                            7.0,
                        ],
                    ),
                    ("state.velocity".to_owned(), vec![0.1; 7]),
                ]),
            },
            SliceEntry {
                path: "a.weight".into(),
                shape: vec![3, 4],
                start: 10,
                end: 12,
                arrays: BTreeMap::from([(MASTER.to_owned(), vec![f32::NEG_INFINITY, 2.0])]),
            },
            SliceEntry {
                path: "empty.bias".into(),
                shape: vec![0],
                start: 0,
                end: 0,
                arrays: BTreeMap::from([(MASTER.to_owned(), vec![])]),
            },
        ],
        scalars: BTreeMap::from([
            ("step".to_owned(), 1234.0),
            ("nan".to_owned(), f64::NAN),
            ("neg_zero".to_owned(), -0.0),
            ("tiny".to_owned(), 5e-324),
            ("third".to_owned(), 1.0 / 3.0),
            ("inf".to_owned(), f64::NEG_INFINITY),
        ]),
    }
}
