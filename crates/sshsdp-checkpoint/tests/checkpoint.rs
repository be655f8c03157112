//! Sharded checkpoint files: the format (exact round trips, every kind of corruption an
//! error and never a panic), re-sharding across world sizes and HSDP replicas, and the
//! optimizer state codec on Burn's SGD (momentum), Adam (AMSGrad) and AdamW states.

use std::collections::BTreeMap;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::NdArray;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::{Tensor, TensorData};
use serde_json::json;
use sha2::{Digest, Sha256};
use sshsdp_checkpoint::{
    agreed_scalars, assemble, checkpoint_dir_files, decode_state, encode_state, export_full,
    read_all, shard_file_name, shard_full, strip_prefix, with_prefix, CheckpointError, Coverage,
    FullModel, ShardFile, SliceEntry, FORMAT_VERSION, MASTER,
};

type B = NdArray;

// ---------------------------------------------------------------------------------------
// Helpers.

/// A fresh, empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
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
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// An unsharded model with a few parameter shapes, including a 1-element one.
fn model(rng: &mut Rng) -> FullModel {
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
fn random_cuts(n: usize, world: usize, rng: &mut Rng) -> Vec<std::ops::Range<usize>> {
    let mut cuts: Vec<usize> = (0..world - 1).map(|_| rng.below(n + 1)).collect();
    cuts.sort_unstable();
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(cuts)
        .chain(std::iter::once(n))
        .collect();
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The "optimizer state" arrays stored next to the master weights in the test shards.
fn state_of(master: &[f32]) -> BTreeMap<String, Vec<f32>> {
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
fn shard_model(full: &FullModel, world: usize, rng: &mut Rng, plan: &str) -> Vec<ShardFile> {
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

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Bit-exact equality of two shards (NaN-safe, unlike `PartialEq`).
fn assert_same_shard(a: &ShardFile, b: &ShardFile) {
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

fn sha_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A safetensors file built by hand (bypassing `ShardFile::write`'s validation) from a
/// header document and named tensors (`F32` unless the name ends in `#f64`); the header's
/// checksum is computed, so only the deliberate defect remains.
fn raw_file(header: &serde_json::Value, tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
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
const VALUES: [f32; 4] = [1.0, -2.0, 3.5, 0.25];

fn valid_header() -> serde_json::Value {
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

fn read_bytes(bytes: &[u8]) -> Result<ShardFile, CheckpointError> {
    ShardFile::from_bytes(bytes, Path::new("test.safetensors"))
}

fn corrupt_reason(result: Result<ShardFile, CheckpointError>) -> String {
    match result {
        Err(CheckpointError::Corrupt { reason, .. }) => reason,
        other => panic!("expected a Corrupt error, got {other:?}"),
    }
}

/// A small but complete shard with special values.
fn special_shard() -> ShardFile {
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

// ---------------------------------------------------------------------------------------
// Format.

#[test]
fn write_read_round_trip_is_exact() {
    let dir = TempDir::new("roundtrip");
    let shard = special_shard();
    let path = shard.write_to_dir(&dir.0).unwrap();
    assert_eq!(path, dir.0.join("rank-00001-of-00003.safetensors"));
    assert_same_shard(&ShardFile::read(&path).unwrap(), &shard);

    // Overwriting is atomic and leaves no temporary file behind.
    let mut second = shard.clone();
    second.scalars.insert("step".into(), 1235.0);
    second.write(&path).unwrap();
    assert_same_shard(&ShardFile::read(&path).unwrap(), &second);
    let names: Vec<_> = fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["rank-00001-of-00003.safetensors"]);

    // A file written by the safetensors crate is readable by other safetensors readers.
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 4);
    assert!(st.names().contains(&"a.weight|10|12|master"));
}

#[test]
fn write_refuses_invalid_shards() {
    let dir = TempDir::new("invalid");
    let good = special_shard();
    type Mutation = Box<dyn Fn(&mut ShardFile)>;
    let cases: Vec<(&str, Mutation)> = vec![
        ("rank >= world", Box::new(|s| s.rank = 3)),
        (
            "short array",
            Box::new(|s| {
                s.slices[0].arrays.get_mut(MASTER).unwrap().pop();
            }),
        ),
        ("end beyond numel", Box::new(|s| s.slices[1].end = 13)),
        ("start > end", Box::new(|s| s.slices[2].start = 1)),
        (
            "overlap",
            Box::new(|s| (s.slices[1].start, s.slices[1].end) = (8, 10)),
        ),
        (
            "duplicate",
            Box::new(|s| {
                let copy = s.slices[2].clone();
                s.slices.push(copy);
            }),
        ),
        (
            "shape disagreement",
            Box::new(|s| s.slices[1].shape = vec![4, 3]),
        ),
        (
            "'|' in a path",
            Box::new(|s| s.slices[2].path = "a|b".into()),
        ),
        (
            "'|' in an array name",
            Box::new(|s| {
                let v = s.slices[2].arrays.remove(MASTER).unwrap();
                s.slices[2].arrays.insert("x|y".into(), v);
            }),
        ),
    ];
    for (what, mutate) in cases {
        let mut shard = good.clone();
        mutate(&mut shard);
        match shard.write_to_dir(&dir.0) {
            Err(CheckpointError::Invalid(_)) => {}
            other => panic!("{what}: expected Invalid, got {other:?}"),
        }
    }
    assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 0, "nothing written");
}

#[test]
fn truncated_flipped_and_garbage_files_are_errors_never_panics() {
    let dir = TempDir::new("corrupt");
    let path = special_shard().write_to_dir(&dir.0).unwrap();
    let bytes = fs::read(&path).unwrap();
    let header_len = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;

    // Every truncation is a Corrupt error.
    for len in 0..bytes.len() {
        let result = catch_unwind(|| read_bytes(&bytes[..len]))
            .unwrap_or_else(|_| panic!("panicked on a file truncated to {len} bytes"));
        corrupt_reason(result);
    }
    // And on disk, through `read`.
    fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    corrupt_reason(ShardFile::read(&path));

    // A flipped bit anywhere: never a panic; in the payload, a checksum error.
    let mut rng = Rng(7);
    for pos in 0..bytes.len() {
        let mut flipped = bytes.clone();
        flipped[pos] ^= 1 << rng.below(8);
        let result = catch_unwind(AssertUnwindSafe(|| read_bytes(&flipped)))
            .unwrap_or_else(|_| panic!("panicked on a bit flip at byte {pos}"));
        if pos >= header_len {
            let reason = corrupt_reason(result);
            assert!(
                reason.contains("checksum mismatch in tensor"),
                "{pos}: {reason}"
            );
        } else if let Ok(shard) = result {
            // Only a flip that leaves the JSON meaning intact (e.g. in padding) may pass.
            assert_same_shard(&shard, &special_shard());
        }
    }

    // Random garbage, and garbage after a plausible length prefix.
    for n in 0..300 {
        let len = rng.below(600);
        let mut garbage: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if n % 2 == 1 && len > 8 {
            garbage[..8].copy_from_slice(&((len as u64 - 8) / 2).to_le_bytes());
            garbage[8] = b'{';
        }
        let result = catch_unwind(|| read_bytes(&garbage)).expect("panicked on garbage");
        assert!(result.is_err());
    }

    // Missing file: an I/O error naming the file.
    fs::remove_file(&path).unwrap();
    match ShardFile::read(&path) {
        Err(e @ CheckpointError::Io { .. }) => {
            assert!(
                e.to_string().contains("rank-00001-of-00003.safetensors"),
                "{e}"
            )
        }
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn hand_made_files_are_validated() {
    let master = || ("w|0|4|master", VALUES.to_vec());
    assert_eq!(
        read_bytes(&raw_file(&valid_header(), &[master()]))
            .unwrap()
            .slices[0]
            .arrays[MASTER],
        VALUES
    );

    // Another format version: a Version error.
    let mut header = valid_header();
    header["version"] = json!(FORMAT_VERSION + 1);
    match read_bytes(&raw_file(&header, &[master()])) {
        Err(CheckpointError::Version {
            found, supported, ..
        }) => {
            assert_eq!(
                (found, supported),
                ((FORMAT_VERSION + 1).to_string(), FORMAT_VERSION)
            )
        }
        other => panic!("expected Version, got {other:?}"),
    }

    let mutate = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut h = valid_header();
        f(&mut h);
        h
    };
    type Tensors = Vec<(&'static str, Vec<f32>)>;
    let cases: Vec<(&str, serde_json::Value, Tensors)> = vec![
        (
            "not our format",
            mutate(&|h| h["format"] = json!("other")),
            vec![master()],
        ),
        (
            "unknown field",
            mutate(&|h| h["extra"] = json!(1)),
            vec![master()],
        ),
        (
            "bad scalar",
            mutate(&|h| h["scalars"]["step"] = json!("three")),
            vec![master()],
        ),
        (
            "rank >= world",
            mutate(&|h| h["rank"] = json!(2)),
            vec![master()],
        ),
        ("missing tensor", valid_header(), vec![]),
        (
            "extra tensor",
            valid_header(),
            vec![master(), ("w|4|8|master", vec![0.0; 4])],
        ),
        (
            "dtype F64",
            valid_header(),
            vec![("w|0|4|master#f64", VALUES.to_vec())],
        ),
        (
            "length != end - start",
            mutate(&|h| h["slices"][0]["end"] = json!(5)),
            vec![("w|0|5|master", VALUES.to_vec())],
        ),
        (
            "end > numel",
            mutate(&|h| h["slices"][0]["shape"] = json!([3])),
            vec![master()],
        ),
        (
            "overflowing shape",
            mutate(&|h| h["slices"][0]["shape"] = json!([u64::MAX, 4])),
            vec![master()],
        ),
        (
            "overlapping slices of one path",
            mutate(&|h| {
                let mut second = h["slices"][0].clone();
                second["start"] = json!(2);
                second["end"] = json!(6);
                h["slices"].as_array_mut().unwrap().push(second);
            }),
            vec![master(), ("w|2|6|master", VALUES.to_vec())],
        ),
        (
            "duplicate slice",
            mutate(&|h| {
                let second = h["slices"][0].clone();
                h["slices"].as_array_mut().unwrap().push(second);
            }),
            vec![master()],
        ),
    ];
    for (what, header, tensors) in cases {
        let reason = corrupt_reason(read_bytes(&raw_file(&header, &tensors)));
        let expected = match what {
            "not our format" => "format is not",
            "unknown field" => "unknown field `extra`",
            "bad scalar" => "scalar 'step'",
            "rank >= world" => "not below world size",
            "missing tensor" => "is missing",
            "extra tensor" => "not described by the header",
            "dtype F64" => "dtype F64",
            "length != end - start" => "has shape [4], expected [5]",
            "end > numel" => "range outside",
            "overflowing shape" => "overflows",
            _ => "overlap within one shard",
        };
        assert!(reason.contains(expected), "{what}: {reason}");
    }

    // A plain safetensors file without our metadata.
    let plain = safetensors::serialize(
        [(
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0; 4])
                .unwrap(),
        )],
        None,
    )
    .unwrap();
    assert!(corrupt_reason(read_bytes(&plain)).contains("no metadata"));

    // An edited header whose checksum no longer matches.
    let mut bytes = raw_file(&valid_header(), &[master()]);
    let pattern = br#"\"step\":\"3\""#;
    let at = bytes
        .windows(pattern.len())
        .position(|w| w == pattern)
        .unwrap();
    bytes[at + pattern.len() - 3] = b'4';
    assert!(corrupt_reason(read_bytes(&bytes)).contains("header checksum"));
}

#[test]
fn read_all_checks_ranks_world_and_plan() {
    let mut rng = Rng(1);
    let full = model(&mut rng);
    let dir = TempDir::new("read-all");
    let shards = shard_model(&full, 3, &mut rng, r#"{"world": 3}"#);
    for s in &shards {
        s.write_to_dir(&dir.0).unwrap();
    }
    fs::write(dir.0.join("notes.txt"), "ignored").unwrap();
    let back = read_all(&dir.0).unwrap();
    assert_eq!(back.len(), 3);
    for (a, b) in back.iter().zip(&shards) {
        assert_same_shard(a, b);
    }
    let files = checkpoint_dir_files(&dir.0).unwrap();
    assert_eq!(files[2], dir.0.join(shard_file_name(2, 3)));

    // Rank 1 missing.
    let rank1 = dir.0.join(shard_file_name(1, 3));
    let saved = fs::read(&rank1).unwrap();
    fs::remove_file(&rank1).unwrap();
    match read_all(&dir.0) {
        Err(e @ CheckpointError::Missing { .. }) => {
            assert!(
                e.to_string().contains("rank-00001-of-00003.safetensors"),
                "{e}"
            )
        }
        other => panic!("expected Missing, got {other:?}"),
    }

    // Rank 0's file under rank 1's name.
    fs::copy(dir.0.join(shard_file_name(0, 3)), &rank1).unwrap();
    assert!(
        matches!(read_all(&dir.0), Err(CheckpointError::Mismatch { file, .. }) if file == rank1)
    );
    fs::write(&rank1, &saved).unwrap();
    read_all(&dir.0).unwrap();

    // Another plan in rank 2's file.
    let mut other = shards[2].clone();
    other.plan_json = r#"{"world": 3, "other": true}"#.into();
    other.write_to_dir(&dir.0).unwrap();
    match read_all(&dir.0) {
        Err(e @ CheckpointError::Mismatch { .. }) => {
            assert!(
                e.to_string().contains("rank-00002-of-00003") && e.to_string().contains("plan"),
                "{e}"
            )
        }
        other => panic!("expected Mismatch, got {other:?}"),
    }
    shards[2].write_to_dir(&dir.0).unwrap();

    // A stray file of another world size.
    let stray = ShardFile {
        rank: 0,
        world: 2,
        ..shards[0].clone()
    };
    let stray_path = stray.write_to_dir(&dir.0).unwrap();
    assert!(matches!(
        read_all(&dir.0),
        Err(CheckpointError::Mismatch { .. })
    ));
    fs::remove_file(stray_path).unwrap();

    // A corrupt file is reported by name.
    let mut bytes = fs::read(dir.0.join(shard_file_name(2, 3))).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    fs::write(dir.0.join(shard_file_name(2, 3)), bytes).unwrap();
    assert!(
        matches!(read_all(&dir.0), Err(CheckpointError::Corrupt { file, .. }) if file.ends_with(shard_file_name(2, 3)))
    );

    // An empty directory.
    let empty = TempDir::new("read-all-empty");
    assert!(matches!(
        read_all(&empty.0),
        Err(CheckpointError::Missing { .. })
    ));
    assert!(matches!(
        read_all(empty.0.join("absent")),
        Err(CheckpointError::Io { .. })
    ));
}

// ---------------------------------------------------------------------------------------
// Re-sharding.

#[test]
fn world4_checkpoint_reshards_to_world2_and_exports_the_model() {
    let mut rng = Rng(2);
    let full = model(&mut rng);
    let dir = TempDir::new("reshard");
    for shard in shard_model(&full, 4, &mut rng, "plan-4") {
        shard.write_to_dir(&dir.0).unwrap();
    }
    let old = read_all(&dir.0).unwrap();
    assert_eq!(export_full(&old).unwrap(), full);
    assert_eq!(agreed_scalars(&old).unwrap()["step"], 12.0);

    // World 2, cut at other points: every new slice equals the original values.
    let coverage = Coverage::new(&old).unwrap();
    assert_eq!(
        coverage
            .params()
            .map(|(p, s)| (p.to_owned(), s.to_vec()))
            .collect::<Vec<_>>(),
        full.iter()
            .map(|(p, (s, _))| (p.clone(), s.clone()))
            .collect::<Vec<_>>()
    );
    let mut new: Vec<ShardFile> = (0..2)
        .map(|rank| ShardFile {
            rank,
            world: 2,
            plan_json: "plan-2".into(),
            slices: Vec::new(),
            scalars: agreed_scalars(&old).unwrap(),
        })
        .collect();
    for _ in 0..5 {
        for (path, (shape, values)) in &full {
            for (rank, range) in random_cuts(values.len(), 2, &mut rng)
                .into_iter()
                .enumerate()
            {
                let slice = coverage
                    .assemble_slice(path, range.start, range.end)
                    .unwrap();
                let mut expected = state_of(&values[range.clone()]);
                expected.insert(MASTER.into(), values[range.clone()].to_vec());
                assert_eq!(slice.arrays, expected, "{path} {range:?}");
                assert_eq!(
                    coverage
                        .assemble(path, shape, range.start, range.end, MASTER)
                        .unwrap(),
                    values[range.clone()]
                );
                if new[rank].slices.iter().all(|s| s.path != *path) {
                    new[rank].slices.push(slice);
                }
            }
        }
    }
    let dir2 = TempDir::new("reshard-2");
    for s in &new {
        s.write_to_dir(&dir2.0).unwrap();
    }
    let reread = read_all(&dir2.0).unwrap();
    assert_eq!(export_full(&reread).unwrap(), full);
    assert_eq!(
        Coverage::new(&reread)
            .unwrap()
            .export_full("state.momentum.moment_1")
            .unwrap(),
        Coverage::new(&old)
            .unwrap()
            .export_full("state.momentum.moment_1")
            .unwrap()
    );

    // Import from the unsharded model, at world 3.
    let imported: Vec<ShardFile> = (0..3)
        .map(|rank| {
            let ranges: Vec<_> = full
                .iter()
                .map(|(path, (shape, _))| {
                    let n = numel(shape);
                    (path.as_str(), n * rank / 3..n * (rank + 1) / 3)
                })
                .collect();
            ShardFile {
                rank,
                world: 3,
                plan_json: "plan-3".into(),
                slices: shard_full(&full, ranges).unwrap(),
                scalars: BTreeMap::new(),
            }
        })
        .collect();
    assert_eq!(export_full(&imported).unwrap(), full);
    assert!(matches!(
        shard_full(&full, [("nope", 0..1)]),
        Err(CheckpointError::Missing { .. })
    ));
    assert!(matches!(
        shard_full(&full, [("norm.gamma", 0..2)]),
        Err(CheckpointError::Invalid(_))
    ));
}

/// HSDP: two replica groups of two shards each; the replicas cut the same parameters at
/// different points but hold identical values.
fn hsdp_shards(full: &FullModel, rng: &mut Rng) -> Vec<ShardFile> {
    let mut shards = Vec::new();
    for group in 0..2 {
        for (local, mut shard) in shard_model(full, 2, rng, "hsdp").into_iter().enumerate() {
            shard.rank = group * 2 + local;
            shard.world = 4;
            shards.push(shard);
        }
    }
    shards
}

#[test]
fn identical_replicas_are_accepted_conflicts_and_gaps_rejected() {
    let mut rng = Rng(3);
    let full = model(&mut rng);
    let shards = hsdp_shards(&full, &mut rng);
    assert_eq!(export_full(&shards).unwrap(), full);
    let (path, shape) = ("head.weight", [33usize, 3]);
    assert_eq!(
        assemble(&shards, path, &shape, 10, 90, MASTER).unwrap(),
        full[path].1[10..90]
    );

    // A replica that differs in one element (even only in the sign of zero).
    let mut bad = shards.clone();
    let slice = bad[3]
        .slices
        .iter_mut()
        .find(|s| s.path == path && s.end > s.start)
        .unwrap();
    let index = slice.start + (slice.end - slice.start) / 2;
    let value = &mut slice.arrays.get_mut(MASTER).unwrap()[index - slice.start];
    *value = if *value == 0.0 { -0.0 } else { *value * 1.5 };
    match assemble(&bad, path, &shape, 0, 99, MASTER) {
        Err(CheckpointError::Conflict {
            index: i,
            first_rank,
            second_rank,
            ..
        }) => {
            assert_eq!(i, index);
            assert!(first_rank < 2 && second_rank == 3 || first_rank == 3 && second_rank < 2);
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
    // The other arrays of that slice are still fine.
    assert!(assemble(&bad, path, &shape, 0, 99, "state.momentum.moment_1").is_ok());

    // A gap: only replica group 0, without rank 1's slice of the parameter.
    let mut gap = shards[..2].to_vec();
    let pos = gap[1].slices.iter().position(|s| s.path == path).unwrap();
    let (start, end) = (gap[1].slices[pos].start, gap[1].slices[pos].end);
    gap[1].slices.remove(pos);
    if start < end {
        match assemble(&gap, path, &shape, 0, 99, MASTER) {
            Err(CheckpointError::Uncovered {
                start: s, end: e, ..
            }) => assert_eq!((s, e), (start, end)),
            other => panic!("expected Uncovered, got {other:?}"),
        }
    }
    // A gap at the end of a parameter.
    let mut tail = shards[..2].to_vec();
    let is_last = |s: &SliceEntry| s.path == "embed.weight" && s.start < 35 && s.end == 35;
    let owner = usize::from(tail[1].slices.iter().any(is_last));
    let last = tail[owner].slices.iter_mut().find(|s| is_last(s)).unwrap();
    last.end = 34;
    last.arrays.values_mut().for_each(|v| {
        v.pop();
    });
    assert!(matches!(
        export_full(&tail),
        Err(CheckpointError::Uncovered {
            start: 34,
            end: 35,
            ..
        })
    ));

    // Requests that do not fit the checkpoint.
    assert!(matches!(
        assemble(&shards, path, &[99], 0, 1, MASTER),
        Err(CheckpointError::Mismatch { .. })
    ));
    assert!(matches!(
        assemble(&shards, "absent", &[1], 0, 1, MASTER),
        Err(CheckpointError::Missing { .. })
    ));
    assert!(matches!(
        assemble(&shards, path, &shape, 5, 100, MASTER),
        Err(CheckpointError::Invalid(_))
    ));
    assert!(matches!(
        assemble(&shards, path, &shape, 0, 99, "nope"),
        Err(CheckpointError::Missing { .. })
    ));

    // Shards that disagree on a parameter's shape.
    let mut reshaped = shards.clone();
    for s in reshaped[2].slices.iter_mut().filter(|s| s.path == path) {
        s.shape = vec![3, 33];
    }
    assert!(matches!(
        Coverage::new(&reshaped),
        Err(CheckpointError::Mismatch { .. })
    ));

    // Scalars that disagree.
    let mut steps = shards.clone();
    steps[1].scalars.insert("step".into(), 13.0);
    assert!(matches!(
        agreed_scalars(&steps),
        Err(CheckpointError::Mismatch { .. })
    ));
}

#[test]
fn coverage_indexes_thousands_of_parameters() {
    let mut rng = Rng(4);
    let full: FullModel = (0..3000)
        .map(|i| {
            let shape = vec![1 + rng.below(5), 1 + rng.below(7)];
            let values = rng.values(numel(&shape));
            (format!("layers.{i}.weight"), (shape, values))
        })
        .collect();
    let old = shard_model(&full, 8, &mut rng, "p");
    let start = std::time::Instant::now();
    let coverage = Coverage::new(&old).unwrap();
    for (path, (shape, values)) in &full {
        for range in random_cuts(values.len(), 3, &mut rng) {
            let got = coverage
                .assemble(path, shape, range.start, range.end, MASTER)
                .unwrap();
            assert_eq!(got, values[range]);
        }
    }
    assert_eq!(coverage.export_full(MASTER).unwrap(), full);
    // Generous: linear work is a few milliseconds; a quadratic index would take seconds.
    assert!(start.elapsed().as_secs_f64() < 3.0, "{:?}", start.elapsed());
}

// ---------------------------------------------------------------------------------------
// Optimizer state codec.

fn tensor(values: &[f32]) -> Tensor<B, 1> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Default::default(),
    )
}

fn values_of(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

type Arrays = BTreeMap<String, Vec<f32>>;
type Scalars = BTreeMap<String, f64>;

fn slice_arrays(arrays: &Arrays, range: std::ops::Range<usize>) -> Arrays {
    arrays
        .iter()
        .map(|(k, v)| (k.clone(), v[range.clone()].to_vec()))
        .collect()
}

/// Steps `opt` three times on a 10-element parameter, then checks that the state survives
/// encode/decode bit for bit, that the two halves of the state (decoded separately) step
/// like the whole, and that the halves written as a world-2 checkpoint re-assemble at
/// world 1 into a state that steps identically. Returns the encoded state.
fn check_state_codec<O: SimpleOptimizer<B>>(opt: &O) -> (Arrays, Scalars) {
    let device = Default::default();
    let mut rng = Rng(5);
    let n = 10;
    let lr = 0.01;
    let mut param = tensor(&rng.values(n));
    let mut state = None;
    for _ in 0..3 {
        let grad = tensor(&rng.values(n));
        (param, state) = opt.step(lr, param, grad, state);
    }
    let state: O::State<1> = state.expect("a stateful optimizer");
    let (arrays, scalars) = encode_state::<B, _>(state.clone()).unwrap();

    let grad = rng.values(n);
    let (p_ref, s_ref) = opt.step(lr, param.clone(), tensor(&grad), Some(state));
    let (p_ref, s_ref) = (
        values_of(p_ref),
        encode_state::<B, _>(s_ref.unwrap()).unwrap(),
    );

    // Whole state, decoded.
    let decoded: O::State<1> = decode_state::<B, _>(&arrays, &scalars, n, &device).unwrap();
    assert_eq!(
        encode_state::<B, _>(decoded.clone()).unwrap(),
        (arrays.clone(), scalars.clone())
    );
    let (p, s) = opt.step(lr, param.clone(), tensor(&grad), Some(decoded));
    assert_eq!(bits(&values_of(p)), bits(&p_ref));
    assert_eq!(encode_state::<B, _>(s.unwrap()).unwrap(), s_ref);

    // Halves stepped separately equal the whole step.
    let p_all = values_of(param.clone());
    let mut p_cat = Vec::new();
    let mut s_cat: Arrays = BTreeMap::new();
    for half in [0..5, 5..10] {
        let part: O::State<1> =
            decode_state::<B, _>(&slice_arrays(&arrays, half.clone()), &scalars, 5, &device)
                .unwrap();
        let (p, s) = opt.step(
            lr,
            tensor(&p_all[half.clone()]),
            tensor(&grad[half]),
            Some(part),
        );
        p_cat.extend(values_of(p));
        let (a, sc) = encode_state::<B, _>(s.unwrap()).unwrap();
        assert_eq!(sc, s_ref.1);
        for (k, v) in a {
            s_cat.entry(k).or_default().extend(v);
        }
    }
    assert_eq!(bits(&p_cat), bits(&p_ref));
    assert_eq!(s_cat, s_ref.0);

    // Through files: world 2 (halves, state under "state.") -> world 1.
    let dir = TempDir::new("state");
    for (rank, half) in [0..4, 4..10].into_iter().enumerate() {
        let mut arrays = with_prefix(slice_arrays(&arrays, half.clone()), "state.");
        arrays.insert(MASTER.into(), p_all[half.clone()].to_vec());
        let shard = ShardFile {
            rank,
            world: 2,
            plan_json: String::new(),
            slices: vec![SliceEntry {
                path: "p".into(),
                shape: vec![n],
                start: half.start,
                end: half.end,
                arrays,
            }],
            scalars: with_prefix(scalars.clone(), "state."),
        };
        shard.write_to_dir(&dir.0).unwrap();
    }
    let files = read_all(&dir.0).unwrap();
    let whole = Coverage::new(&files)
        .unwrap()
        .assemble_slice("p", 0, n)
        .unwrap();
    let state_scalars = strip_prefix(&agreed_scalars(&files).unwrap(), "state.");
    let restored: O::State<1> = decode_state::<B, _>(
        &strip_prefix(&whole.arrays, "state."),
        &state_scalars,
        n,
        &device,
    )
    .unwrap();
    let (p, s) = opt.step(
        lr,
        tensor(&whole.arrays[MASTER]),
        tensor(&grad),
        Some(restored),
    );
    assert_eq!(bits(&values_of(p)), bits(&p_ref));
    assert_eq!(encode_state::<B, _>(s.unwrap()).unwrap(), s_ref);

    (arrays, scalars)
}

#[test]
fn sgd_momentum_state_round_trips_and_reshards() {
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_nesterov(true)))
        .build::<B>();
    let (arrays, scalars) = check_state_codec(&sgd);
    assert_eq!(arrays.keys().collect::<Vec<_>>(), ["momentum.velocity"]);
    assert!(scalars.is_empty());
}

#[test]
fn adam_amsgrad_state_round_trips_and_reshards() {
    let adam = AdamConfig::new().with_amsgrad(true).build();
    let (arrays, scalars) = check_state_codec(&adam);
    assert_eq!(
        arrays.keys().collect::<Vec<_>>(),
        [
            "momentum.max_moment_2",
            "momentum.moment_1",
            "momentum.moment_2"
        ]
    );
    assert_eq!(scalars, BTreeMap::from([("momentum.time".to_owned(), 3.0)]));
}

#[test]
fn adamw_state_round_trips_and_reshards() {
    let adamw = AdamWConfig::new().with_weight_decay(0.1).build();
    let (arrays, scalars) = check_state_codec(&adamw);
    assert_eq!(
        arrays.keys().collect::<Vec<_>>(),
        ["momentum.moment_1", "momentum.moment_2"]
    );
    assert_eq!(scalars.keys().collect::<Vec<_>>(), ["momentum.time"]);
}

#[test]
fn state_codec_errors() {
    use burn::optim::{AdamState, AdamWState, SgdState};
    let device = Default::default();
    let adam = AdamConfig::new().build();

    // Stateless SGD: an empty encoding that decodes to "no momentum".
    let sgd = SgdConfig::new().build::<B>();
    let (_, state) = sgd.step(0.1, tensor(&[1.0, 2.0]), tensor(&[0.5, 0.5]), None);
    let (a, s) = encode_state::<B, _>(state.unwrap()).unwrap();
    assert!(a.is_empty() && s.is_empty());
    let back: SgdState<B, 1> = decode_state::<B, _>(&a, &s, 2, &device).unwrap();
    assert!(back.momentum.is_none());

    // Only 1-D states.
    let p2: Tensor<B, 2> = Tensor::from_data(TensorData::new(vec![1.0f32; 4], [2, 2]), &device);
    let (_, s2) =
        SimpleOptimizer::<B>::step(&adam, 0.1, p2.clone(), Tensor::ones([2, 2], &device), None);
    assert!(
        matches!(encode_state::<B, _>(s2.unwrap()), Err(CheckpointError::Codec(m)) if m.contains("1-D"))
    );

    let (_, s1) =
        SimpleOptimizer::<B>::step(&adam, 0.1, tensor(&[1.0; 3]), tensor(&[1.0; 3]), None);
    let (arrays, scalars) = encode_state::<B, _>(s1.unwrap()).unwrap();
    let decode =
        |a: &Arrays, s: &Scalars, len| decode_state::<B, AdamState<B, 1>>(a, s, len, &device);
    decode(&arrays, &scalars, 3).unwrap();
    // Wrong length, missing array, missing scalar, non-integral or negative time, clashes.
    assert!(matches!(
        decode(&arrays, &scalars, 4),
        Err(CheckpointError::Codec(_))
    ));
    let mut missing = arrays.clone();
    missing.remove("momentum.moment_2");
    assert!(
        matches!(decode(&missing, &scalars, 3), Err(CheckpointError::Codec(m)) if m.contains("moment_2"))
    );
    assert!(
        matches!(decode(&arrays, &BTreeMap::new(), 3), Err(CheckpointError::Codec(m)) if m.contains("time"))
    );
    for bad in [1.5, -1.0, f64::NAN] {
        let s = BTreeMap::from([("momentum.time".to_owned(), bad)]);
        assert!(
            matches!(decode(&arrays, &s, 3), Err(CheckpointError::Codec(_))),
            "{bad}"
        );
    }
    let clash = BTreeMap::from([("momentum.moment_1".to_owned(), 1.0)]);
    assert!(matches!(
        decode(&arrays, &clash, 3),
        Err(CheckpointError::Codec(_))
    ));
    // Unknown names are ignored; AdamW reads Adam's encoding (same layout).
    let mut extra = scalars.clone();
    extra.insert("momentum.unknown".into(), 1.0);
    extra.insert("other".into(), 2.0);
    decode(&arrays, &extra, 3).unwrap();
    decode_state::<B, AdamWState<B, 1>>(&arrays, &scalars, 3, &device).unwrap();
}
