//! Sharded checkpoint files, the format: exact round trips, and every kind of corruption an
//! error, never a panic.

use crate::common;

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};

use serde_json::json;
use sshsdp_checkpoint::{
    checkpoint_dir_files, read_all, shard_file_name, CheckpointError, ShardFile, FORMAT_VERSION,
    MASTER,
};

use common::*;

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
