//! Checkpoint files are untrusted input: every reader that parses bytes (shard files, the
//! manifest, the optimizer state codec, re-sharding of what was read) answers `Ok` or `Err`
//! for any bytes — no panic, no overflow, no allocation sized by a number in a file — and
//! temporary files are never opened through a name an attacker could prepare.
//!
//! First deterministic regressions (each input once crashed, aborted or was silently
//! accepted), then property tests with fixed case counts over arbitrary bytes and over files
//! the crate's own writer produced, mutated.

use crate::common;

use std::collections::BTreeMap;
use std::fs;

use burn::optim::{AdamConfig, AdamState, AdamWState, SgdState, SimpleOptimizer};
use burn::tensor::{Tensor, TensorData};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::{json, Value};
use sshsdp_checkpoint::{
    agreed_scalars, decode_state, encode_state, export_full, load, read_all, read_checkpoint, save,
    shard_file_name, CheckpointError, CodecError, Coverage, Manifest, ShardFile, SliceEntry,
    MANIFEST_FILE, MASTER,
};

use common::sharded::{on_ranks, set_masters, TestState};
use common::*;

type Arrays = BTreeMap<String, Vec<f32>>;
type Scalars = BTreeMap<String, f64>;

fn one_slice_shard(shape: Vec<usize>, start: usize, values: Vec<f32>) -> ShardFile {
    ShardFile {
        rank: 0,
        world: 1,
        plan_json: "{}".into(),
        slices: vec![SliceEntry {
            path: "w".into(),
            shape,
            start,
            end: start + values.len(),
            arrays: BTreeMap::from([(MASTER.to_owned(), values)]),
        }],
        scalars: BTreeMap::new(),
    }
}

/// `shard` through its file bytes: what a reader gets.
fn reread(shard: &ShardFile) -> ShardFile {
    read_bytes(&shard.to_bytes().unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Regressions.

/// A file may claim a parameter of 2^62 elements while holding four of them: assembling the
/// whole parameter allocated `numel` values before finding the gap (a capacity-overflow panic;
/// at 2^40 an allocation failure that aborts the process). Coverage is now checked first.
#[test]
fn a_huge_claimed_shape_is_uncovered_not_allocated() {
    for numel in [1usize << 62, 1 << 40] {
        let shard = reread(&one_slice_shard(vec![numel], 0, vec![1.0; 4]));
        match export_full(std::slice::from_ref(&shard)) {
            Err(CheckpointError::Uncovered { start, end, .. }) => {
                assert_eq!((start, end), (4, numel))
            }
            other => panic!("expected Uncovered, got {other:?}"),
        }
        let coverage = Coverage::new(std::slice::from_ref(&shard)).unwrap();
        assert!(matches!(
            coverage.assemble("w", &[numel], 2, numel, MASTER),
            Err(CheckpointError::Uncovered { start: 4, .. })
        ));
        assert_eq!(
            coverage.assemble("w", &[numel], 1, 3, MASTER).unwrap(),
            [1.0; 2]
        );
    }
}

/// A slice may cover a huge range with no arrays at all (nothing to check their lengths
/// against): the range is covered, but not for the array asked, which must be found missing
/// before anything of the range's size is allocated.
#[test]
fn a_huge_slice_without_the_array_is_missing_not_allocated() {
    let mut shard = one_slice_shard(vec![1 << 62], 0, vec![]);
    shard.slices[0].end = 1 << 62;
    shard.slices[0].arrays.clear();
    let shard = reread(&shard);
    assert!(matches!(
        export_full(std::slice::from_ref(&shard)),
        Err(CheckpointError::Missing { .. })
    ));
    let coverage = Coverage::new(std::slice::from_ref(&shard)).unwrap();
    assert!(matches!(
        coverage.assemble_slice("w", 0, 1 << 62),
        Ok(SliceEntry { ref arrays, .. }) if arrays.is_empty()
    ));
}

/// A state name of a million dotted components built a tree a million levels deep, whose
/// recursive drop overflowed the stack (the process died with SIGSEGV).
#[test]
fn deeply_nested_state_names_are_refused() {
    let device = Default::default();
    let deep = format!("{}x", "a.".repeat(1_000_000));
    let scalars = Scalars::from([(deep.clone(), 1.0)]);
    let result = decode_state::<B, AdamState<B, 1>>(&Arrays::new(), &scalars, 3, &device);
    assert!(matches!(result, Err(CodecError(_))), "{:?}", result.err());
    let arrays = Arrays::from([(deep, vec![0.0; 3])]);
    let result = decode_state::<B, AdamState<B, 1>>(&arrays, &Scalars::new(), 3, &device);
    assert!(matches!(result, Err(CodecError(_))), "{:?}", result.err());
}

/// A real Adam state after three steps, encoded.
fn adam_state() -> (Arrays, Scalars) {
    let device = Default::default();
    let adam = AdamConfig::new().build();
    let tensor = |v: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(v, [3]), &device);
    let mut param = tensor(vec![0.5, -1.0, 2.0]);
    let mut state = None;
    for i in 0..3 {
        (param, state) = SimpleOptimizer::<B>::step(
            &adam,
            0.1,
            param,
            tensor(vec![0.1 * i as f32, 1.0, -3.0]),
            state,
        );
    }
    encode_state::<B, _>(state.unwrap()).unwrap()
}

/// `encode_state` refuses integers beyond 2^53 (not exact in the `f64` scalars), but decoding
/// took any integral scalar below 2^64: Adam's `time` = 2^60 came back as a step count whose
/// bias correction (`beta.powi(time as i32)`) divides by zero.
#[test]
fn state_integers_beyond_2_pow_53_are_refused() {
    let device = Default::default();
    let (arrays, mut scalars) = adam_state();
    assert_eq!(scalars["momentum.time"], 3.0);
    for (time, ok) in [
        (9_007_199_254_740_992.0, true),
        (9_007_199_254_740_994.0, false),
        (1_152_921_504_606_846_976.0, false),
        (-1.0, false),
        (0.5, false),
    ] {
        scalars.insert("momentum.time".into(), time);
        let result = decode_state::<B, AdamState<B, 1>>(&arrays, &scalars, 3, &device);
        assert_eq!(result.is_ok(), ok, "time {time}: {:?}", result.err());
    }
}

/// The step counter of a shard file is an `f64`: 0.5, -1 or NaN read as step 0 (an `as` cast)
/// and matched a manifest of step 0, so a corrupt counter loaded silently.
#[test]
fn a_step_counter_that_is_not_a_whole_number_is_refused() {
    let root = TempDir::new("untrusted-step");
    on_ranks(2, |_, rt| {
        set_masters(rt, 1);
        save(&root.0, rt, &TestState::new(), 0).unwrap();
    });
    let dir = root.0.join("step-0");
    for bad in [0.5, -1.0, f64::NAN] {
        let mut manifest: Manifest =
            serde_json::from_slice(&fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
        for entry in &mut manifest.files {
            let path = dir.join(&entry.name);
            let mut shard = ShardFile::read(&path).unwrap();
            shard.scalars.insert("step".into(), bad);
            let bytes = shard.to_bytes().unwrap();
            fs::write(&path, &bytes).unwrap();
            (entry.size, entry.sha256) = (bytes.len() as u64, sha_hex(&bytes));
        }
        fs::write(
            dir.join(MANIFEST_FILE),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
        for e in on_ranks(2, |_, rt| load(&root.0, rt, &mut TestState::new())) {
            assert!(
                matches!(&e, Err(CheckpointError::Mismatch { reason, .. })
                    if reason.contains("step")),
                "step {bad}: {e:?}"
            );
        }
    }
}

/// The temporary name of `ShardFile::write` was `.{name}.tmp-{pid}-{counter}`: anyone able to
/// write the directory could create those names first (here as symlinks to a file of theirs)
/// and make every write fail. The names are now unpredictable; the prepared links are neither
/// followed nor removed.
#[cfg(unix)]
#[test]
fn temporary_names_cannot_be_prepared() {
    let dir = TempDir::new("untrusted-tmp");
    let victim = dir.0.join("victim");
    fs::write(&victim, b"keep").unwrap();
    let shard = special_shard();
    let name = shard.file_name();
    let pid = std::process::id();
    for n in 0..4096 {
        let link = dir.0.join(format!(".{name}.tmp-{pid}-{n}"));
        std::os::unix::fs::symlink(&victim, link).unwrap();
    }
    let path = shard.write_to_dir(&dir.0).unwrap();
    assert_same_shard(&ShardFile::read(&path).unwrap(), &shard);
    shard.write(&path).unwrap();
    assert_eq!(fs::read(&victim).unwrap(), b"keep");
    let entries = fs::read_dir(&dir.0).unwrap().count();
    assert_eq!(entries, 4096 + 2, "links, victim and the shard file");
}

/// `ShardFile::read` (and `read_all`, which uses it) read whatever the name led to with
/// `fs::read`: a shard name linked to `/dev/zero` (length 0, endless reads) grew a buffer until
/// memory ran out. Only regular files are read now, and no more than their length.
#[cfg(unix)]
#[test]
fn only_regular_files_are_read_as_shards() {
    let dir = TempDir::new("untrusted-devzero");
    let link = dir.0.join(shard_file_name(0, 1));
    std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
    for result in [
        ShardFile::read(&link),
        read_all(&dir.0).map(|_| special_shard()),
    ] {
        assert!(
            matches!(&result, Err(CheckpointError::Corrupt { reason, .. })
                if reason.contains("not a regular file")),
            "{result:?}"
        );
    }
    assert!(ShardFile::read(&dir.0).is_err());
    // A regular file behind a symlink is still read.
    let path = special_shard().write_to_dir(&dir.0).unwrap();
    let other = dir.0.join("elsewhere");
    std::os::unix::fs::symlink(&path, &other).unwrap();
    assert_same_shard(&ShardFile::read(&other).unwrap(), &special_shard());
}

// ---------------------------------------------------------------------------------------------
// Mutation helpers.

/// A file's header document and tensors `(name, dtype, shape, bytes)`.
type Parts = (
    Value,
    Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
);

fn split(bytes: &[u8]) -> Parts {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let header = serde_json::from_str(&meta.metadata().as_ref().unwrap()["sshsdp.header"]).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    (header, tensors)
}

/// The file of `parts`, with the header's checksum recomputed.
fn join(parts: &Parts) -> Vec<u8> {
    let (header, tensors) = parts;
    let text = header.to_string();
    let metadata = std::collections::HashMap::from([
        ("sshsdp.header_sha256".to_owned(), sha_hex(text.as_bytes())),
        ("sshsdp.header".to_owned(), text),
    ]);
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .filter_map(|(name, dtype, shape, data)| {
            Some((
                name.as_str(),
                TensorView::new(*dtype, shape.clone(), data).ok()?,
            ))
        })
        .collect();
    safetensors::serialize(views, Some(metadata)).unwrap()
}

/// Values a mutation puts in place of a node of a JSON document.
fn extreme_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(3)),
        Just(json!(1u64 << 32)),
        Just(json!(1u64 << 40)),
        Just(json!(1u64 << 53)),
        Just(json!(1u64 << 62)),
        Just(json!(u64::MAX)),
        Just(json!(u64::MAX - 1)),
        Just(json!(i64::MIN)),
        Just(json!(0.5)),
        Just(json!(1e300)),
        Just(json!(null)),
        Just(json!("")),
        Just(json!("a|b")),
        Just(json!("NaN")),
        Just(json!("-inf")),
        Just(json!("1e400")),
        Just(json!([])),
        Just(json!([1u64 << 40])),
        Just(json!([1u64 << 62, 4])),
        Just(json!([u64::MAX, u64::MAX])),
        Just(json!({})),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|x| json!(x)),
        "[a-z.|]{0,6}".prop_map(|s| json!(s)),
    ]
}

/// Every node of `v` below the root, as JSON pointers.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    if !at.is_empty() {
        out.push(at.clone());
    }
    match v {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                pointers(item, format!("{at}/{i}"), out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                pointers(
                    item,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        _ => {}
    }
}

/// `doc` with the nodes `picks` chooses replaced.
fn mutate(doc: &mut Value, picks: Vec<(prop::sample::Index, Value)>) {
    for (index, value) in picks {
        let mut all = Vec::new();
        pointers(doc, String::new(), &mut all);
        if all.is_empty() {
            return;
        }
        let at = index.get(&all).clone();
        if let Some(node) = doc.pointer_mut(&at) {
            *node = value;
        }
    }
}

/// Structural edits of the tensors (checksums in the header fixed where the edit keeps the
/// name), so the reader's later checks are reached.
#[derive(Clone, Debug)]
enum TensorEdit {
    FlipData(prop::sample::Index, u8),
    Drop(prop::sample::Index),
    Rename(prop::sample::Index, String),
    Reshape(prop::sample::Index, Vec<usize>),
}

fn tensor_edit() -> impl Strategy<Value = TensorEdit> {
    prop_oneof![
        (any::<prop::sample::Index>(), 1u8..).prop_map(|(i, b)| TensorEdit::FlipData(i, b)),
        any::<prop::sample::Index>().prop_map(TensorEdit::Drop),
        (any::<prop::sample::Index>(), "[a-z.|0-9]{0,12}")
            .prop_map(|(i, n)| TensorEdit::Rename(i, n)),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(0usize..9, 0..3)
        )
            .prop_map(|(i, s)| TensorEdit::Reshape(i, s)),
    ]
}

fn edit_tensors(parts: &mut Parts, edit: TensorEdit) {
    let (header, tensors) = parts;
    if tensors.is_empty() {
        return;
    }
    match edit {
        TensorEdit::FlipData(i, b) => {
            let at = i.index(tensors.len());
            let t = &mut tensors[at];
            if t.3.is_empty() {
                return;
            }
            let old = sha_hex(&t.3);
            let at = (b as usize) % t.3.len();
            t.3[at] ^= b;
            let new = sha_hex(&t.3);
            *header = serde_json::from_str(&header.to_string().replace(&old, &new)).unwrap();
        }
        TensorEdit::Drop(i) => {
            let at = i.index(tensors.len());
            tensors.remove(at);
        }
        TensorEdit::Rename(i, name) => {
            // (Two tensors of one name would make the safetensors writer panic.)
            if tensors.iter().all(|t| t.0 != name) {
                let at = i.index(tensors.len());
                tensors[at].0 = name
            }
        }
        TensorEdit::Reshape(i, shape) => {
            let at = i.index(tensors.len());
            tensors[at].2 = shape
        }
    }
}

/// What a reader's caller does with a shard it accepted: index it, re-assemble everything.
fn use_shards(shards: &[ShardFile]) {
    if let Ok(coverage) = Coverage::new(shards) {
        let params: Vec<(&str, &[usize])> = coverage.params().collect();
        for (path, shape) in params {
            let numel = shape.iter().product::<usize>();
            let _ = coverage.assemble(path, shape, 0, numel, MASTER);
            let _ = coverage.assemble_slice(path, numel / 2, numel);
        }
    }
    let _ = export_full(shards);
    let _ = agreed_scalars(shards);
}

/// The shards of a small checkpoint (world 2) as the writer makes them.
fn writer_shards() -> Vec<ShardFile> {
    let mut rng = Rng(11);
    shard_model(&model(&mut rng), 2, &mut rng, "{\"plan\": 1}")
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary bytes, alone or after a valid safetensors length prefix: never a panic.
    #[test]
    fn shard_reader_takes_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        prefix in any::<bool>(),
    ) {
        let bytes = if prefix {
            let mut b = (bytes.len() as u64).saturating_sub(8).to_le_bytes().to_vec();
            b.extend(&bytes);
            b
        } else {
            bytes
        };
        prop_assert!(read_bytes(&bytes).is_err());
    }

    /// A writer's file with bytes flipped, set or cut off anywhere: never a panic.
    #[test]
    fn shard_reader_takes_damaged_files(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = special_shard().to_bytes().unwrap();
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] ^= b;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(shard) = read_bytes(&bytes) {
            use_shards(&[shard]);
        }
    }

    /// A writer's file whose header has nodes replaced and whose tensors are edited, with the
    /// checksums made to match: the reader and re-sharding answer without panicking or
    /// allocating by the claimed sizes.
    #[test]
    fn shard_reader_takes_mutated_headers(
        which in 0usize..3,
        picks in prop::collection::vec((any::<prop::sample::Index>(), extreme_value()), 0..4),
        edits in prop::collection::vec(tensor_edit(), 0..3),
    ) {
        let shards = writer_shards();
        let original = match which {
            0 => special_shard(),
            i => shards[i - 1].clone(),
        };
        let mut parts = split(&original.to_bytes().unwrap());
        mutate(&mut parts.0, picks);
        for edit in edits {
            edit_tensors(&mut parts, edit);
        }
        if let Ok(shard) = read_bytes(&join(&parts)) {
            let mut all = shards.clone();
            all[shard.rank % 2] = shard.clone();
            use_shards(&[shard]);
            use_shards(&all);
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// `manifest.json` of arbitrary bytes: never a panic.
    #[test]
    fn manifest_reader_takes_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let dir = TempDir::new("untrusted-manifest-bytes");
        fs::write(dir.0.join(MANIFEST_FILE), &bytes).unwrap();
        prop_assert!(Manifest::read(&dir.0).is_err());
        prop_assert!(read_checkpoint(&dir.0).is_err());
    }

    /// A committed checkpoint (the writer's shard files and a manifest listing them) whose
    /// manifest has nodes replaced, or one of whose shards has a mutated header (checksums and
    /// manifest made to match): reading it answers without panicking.
    #[test]
    fn checkpoint_reader_takes_mutated_checkpoints(
        in_manifest in any::<bool>(),
        rank in 0usize..2,
        picks in prop::collection::vec((any::<prop::sample::Index>(), extreme_value()), 1..4),
    ) {
        let dir = TempDir::new("untrusted-checkpoint");
        let mut files = Vec::new();
        for shard in writer_shards() {
            let mut bytes = shard.to_bytes().unwrap();
            if !in_manifest && shard.rank == rank {
                let mut parts = split(&bytes);
                mutate(&mut parts.0, picks.clone());
                bytes = join(&parts);
            }
            fs::write(dir.0.join(shard.file_name()), &bytes).unwrap();
            files.push((bytes.len() as u64, sha_hex(&bytes)));
        }
        let mut manifest = serde_json::to_value(Manifest::new(7, "00".repeat(32), &files)).unwrap();
        if in_manifest {
            mutate(&mut manifest, picks);
        }
        fs::write(dir.0.join(MANIFEST_FILE), manifest.to_string()).unwrap();
        if let Ok(shards) = read_checkpoint(&dir.0) {
            use_shards(&shards);
        }
    }
}

/// Names a decoded state may hold: the real ones, near misses, and anything.
fn state_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("momentum.moment_1".to_owned()),
        Just("momentum.moment_2".to_owned()),
        Just("momentum.time".to_owned()),
        Just("momentum.velocity".to_owned()),
        Just("weight_decay.x".to_owned()),
        Just("momentum".to_owned()),
        Just("momentum.moment_1.0".to_owned()),
        Just("momentum.0".to_owned()),
        Just(String::new()),
        Just("0".to_owned()),
        "[a-z0-9_.]{0,16}",
    ]
}

fn scalar_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(1.0),
        Just(-1.0),
        Just(0.5),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(9_007_199_254_740_992.0),
        Just(18_446_744_073_709_551_616.0),
        Just(1e300),
        any::<f64>(),
    ]
}

fn decode_all(arrays: &Arrays, scalars: &Scalars, len: usize) {
    let device = Default::default();
    let _ = decode_state::<B, AdamState<B, 1>>(arrays, scalars, len, &device);
    let _ = decode_state::<B, AdamWState<B, 1>>(arrays, scalars, len, &device);
    let _ = decode_state::<B, SgdState<B, 1>>(arrays, scalars, len, &device);
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary names, lengths and values: decoding any optimizer's state never panics.
    #[test]
    fn state_decoder_takes_arbitrary_input(
        arrays in prop::collection::btree_map(
            state_name(), prop::collection::vec(any::<f32>(), 0..5), 0..4),
        scalars in prop::collection::btree_map(state_name(), scalar_value(), 0..4),
        len in 0usize..5,
    ) {
        decode_all(&arrays, &scalars, len);
    }

    /// A real Adam state with names changed, entries dropped and scalars replaced.
    #[test]
    fn state_decoder_takes_mutated_states(
        renames in prop::collection::vec((any::<prop::sample::Index>(), state_name()), 0..3),
        values in prop::collection::vec((any::<prop::sample::Index>(), scalar_value()), 0..3),
        drop in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let (mut arrays, mut scalars) = adam_state();
        for (i, name) in renames {
            let keys: Vec<String> = arrays.keys().chain(scalars.keys()).cloned().collect();
            let key = i.get(&keys);
            if let Some(v) = arrays.remove(key) {
                arrays.insert(name, v);
            } else if let Some(v) = scalars.remove(key) {
                scalars.insert(name, v);
            }
        }
        for (i, v) in values {
            let keys: Vec<String> = scalars.keys().cloned().collect();
            if !keys.is_empty() {
                scalars.insert(i.get(&keys).clone(), v);
            }
        }
        if let Some(i) = drop {
            let keys: Vec<String> = arrays.keys().cloned().collect();
            if !keys.is_empty() {
                arrays.remove(i.get(&keys));
            }
        }
        decode_all(&arrays, &scalars, 3);
    }
}

#[test]
fn the_mutation_helpers_round_trip() {
    // `split`/`join` reproduce a readable file, so mutations start from a valid one.
    let shard = special_shard();
    let again = read_bytes(&join(&split(&shard.to_bytes().unwrap()))).unwrap();
    assert_same_shard(&again, &shard);
}
