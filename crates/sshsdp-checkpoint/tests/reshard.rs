//! Sharded checkpoint files, re-sharding: across world sizes and HSDP replicas, to and from an
//! unsharded model.

use crate::common;

// Consolidated safetensors files: export from and import into a sharded model at any world
// size.
mod consolidated;

use std::collections::BTreeMap;

use sshsdp_checkpoint::{
    agreed_scalars, assemble, export_full, read_all, shard_full, CheckpointError, Coverage,
    FullModel, ShardFile, SliceEntry, MASTER,
};

use common::*;

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
