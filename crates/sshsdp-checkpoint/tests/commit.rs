//! Saving as one atomic commit over all ranks (threads engine): round trip through the commit,
//! crashed saves ignored, one rank's failure failing every rank with nothing committed,
//! keep-last-K, and step labels never overwritten.

use crate::common;

use std::fs;
use std::path::Path;

use common::sharded::{masters_are, names, on_ranks, set_masters, snapshot, TestState};
use common::TempDir;
use sshsdp_checkpoint::{
    committed_steps, load, read_checkpoint, save, save_with, CheckpointError, Manifest,
    SaveOptions, WeightsOnly, MANIFEST_FILE,
};

fn steps(root: &Path) -> Vec<u64> {
    committed_steps(root)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// Saves the masters numbered `salt` as `step` at world 2 (every rank must succeed).
fn save_step(root: &Path, step: u64, salt: u32, options: &SaveOptions) {
    for dir in on_ranks(2, |_, rt| {
        set_masters(rt, salt);
        save_with(root, rt, &TestState::new(), step, options).unwrap()
    }) {
        assert_eq!(dir, root.join(format!("step-{step}")));
    }
}

/// Loads `path` at world `world` over masters numbered 99; returns each rank's step, or
/// panics unless every rank restored the masters numbered `salt` and the optimizer state.
fn load_expecting(path: &Path, world: usize, salt: u32) -> Vec<u64> {
    on_ranks(world, |_, rt| {
        set_masters(rt, 99);
        let mut state = TestState::new();
        let step = load(path, rt, &mut state).unwrap();
        assert!(masters_are(rt, salt), "masters restored bit-exact");
        assert!(state.restored(), "optimizer state restored");
        step
    })
}

#[test]
fn save_commits_and_load_round_trips_bit_exact() {
    let root = TempDir::new("commit-round-trip");
    let committed = on_ranks(2, |_, rt| {
        set_masters(rt, 1);
        let dir = save(&root.0, rt, &TestState::new(), 7).unwrap();
        assert!(masters_are(rt, 1), "saving leaves the masters as they were");
        dir
    });
    let step_dir = root.0.join("step-7");
    assert_eq!(committed, vec![step_dir.clone(), step_dir.clone()]);
    assert_eq!(
        names(&root.0),
        vec!["step-7"],
        "no temporary directory left"
    );
    // The manifest lists every rank's file with its true size and SHA-256.
    let (manifest, _) = Manifest::read(&step_dir).unwrap();
    assert_eq!((manifest.step, manifest.world), (7, 2));
    assert_eq!(manifest.plan_fingerprint.len(), 64);
    for f in &manifest.files {
        let bytes = fs::read(step_dir.join(&f.name)).unwrap();
        assert_eq!(f.size, bytes.len() as u64);
        assert_eq!(f.sha256, common::sha_hex(&bytes));
    }
    assert_eq!(
        names(&step_dir),
        vec![
            MANIFEST_FILE,
            "rank-00000-of-00002.safetensors",
            "rank-00001-of-00002.safetensors"
        ]
    );
    assert_eq!(read_checkpoint(&root.0).unwrap().len(), 2);
    // The root means the latest step; the step directory itself loads too; and the
    // checkpoint re-shards to other world sizes, bit-exact.
    assert_eq!(load_expecting(&root.0, 2, 1), vec![7, 7]);
    assert_eq!(load_expecting(&step_dir, 2, 1), vec![7, 7]);
    assert_eq!(load_expecting(&root.0, 3, 1), vec![7, 7, 7]);
    assert_eq!(load_expecting(&root.0, 1, 1), vec![7]);
}

#[test]
fn crashed_saves_are_never_loaded() {
    let root = TempDir::new("commit-crash");
    save_step(&root.0, 1, 1, &SaveOptions::default());
    let step1 = root.0.join("step-1");
    // A crash of step 2 between two ranks' files: a temporary directory with a partial file
    // and no manifest.
    let tmp = root.0.join("step-2.tmp");
    fs::create_dir(&tmp).unwrap();
    let file0 = fs::read(step1.join("rank-00000-of-00002.safetensors")).unwrap();
    fs::write(
        tmp.join("rank-00000-of-00002.safetensors"),
        &file0[..file0.len() / 2],
    )
    .unwrap();
    // A newer step directory whose manifest is missing (all files there): not committed.
    let step3 = root.0.join("step-3");
    fs::create_dir(&step3).unwrap();
    for name in names(&step1).iter().filter(|n| *n != MANIFEST_FILE) {
        fs::copy(step1.join(name), step3.join(name)).unwrap();
    }
    assert_eq!(steps(&root.0), vec![1]);
    // "Latest" skips both: the previous checkpoint loads.
    assert_eq!(load_expecting(&root.0, 2, 1), vec![1, 1]);
    // Named directly, an uncommitted directory is an error naming it; nothing is applied.
    for bad in [&step3, &tmp] {
        let errors = on_ranks(2, |_, rt| {
            set_masters(rt, 2);
            let e = load(bad, rt, &mut WeightsOnly).unwrap_err();
            assert!(masters_are(rt, 2), "nothing applied");
            e.to_string()
        });
        for e in errors {
            assert!(
                e.contains(&bad.display().to_string()) && e.contains(MANIFEST_FILE),
                "{e}"
            );
        }
    }
    // The next save of step 2 replaces the stale temporary directory and commits.
    save_step(&root.0, 2, 3, &SaveOptions::default());
    assert_eq!(steps(&root.0), vec![1, 2]);
    assert_eq!(load_expecting(&root.0, 2, 3), vec![2, 2]);
    assert!(!tmp.exists());
    // A root without any committed checkpoint is an error.
    let empty = TempDir::new("commit-empty");
    let errors = on_ranks(2, |_, rt| load(&empty.0, rt, &mut WeightsOnly).unwrap_err());
    assert!(errors
        .iter()
        .all(|e| matches!(e, CheckpointError::Missing { .. })));
}

#[test]
fn one_rank_failing_its_save_fails_every_rank_and_commits_nothing() {
    let root = TempDir::new("commit-fail");
    save_step(&root.0, 1, 1, &SaveOptions::default());
    let before = snapshot(&root.0.join("step-1"));
    // Rank 1's optimizer state cannot be exported: a real failure of rank 1 alone.
    let errors = on_ranks(2, |rank, rt| {
        set_masters(rt, 2);
        let mut state = TestState::new();
        state.fail_export = rank == 1;
        save(&root.0, rt, &state, 2).unwrap_err()
    });
    assert!(
        matches!(&errors[1], CheckpointError::Codec(m) if m.contains("injected")),
        "{}",
        errors[1]
    );
    match &errors[0] {
        CheckpointError::Ranks { failures, .. } => {
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].0, 1);
            assert!(failures[0].1.contains("injected"), "{}", failures[0].1);
        }
        other => panic!("rank 0: {other}"),
    }
    assert_eq!(
        names(&root.0),
        vec!["step-1"],
        "nothing committed or left over"
    );
    assert_eq!(snapshot(&root.0.join("step-1")), before);
    assert_eq!(load_expecting(&root.0, 2, 1), vec![1, 1]);

    // Rank 0 alone fails: the root is an existing regular file.
    let file_root = root.0.join("not-a-directory");
    fs::write(&file_root, b"keep me").unwrap();
    let errors = on_ranks(2, |_, rt| {
        save(&file_root, rt, &TestState::new(), 1).unwrap_err()
    });
    assert!(
        matches!(
            &errors[0],
            CheckpointError::Io { .. } | CheckpointError::Invalid(_)
        ),
        "{}",
        errors[0]
    );
    assert!(
        matches!(&errors[1], CheckpointError::Ranks { failures, .. } if failures[0].0 == 0),
        "{}",
        errors[1]
    );
    assert_eq!(fs::read(&file_root).unwrap(), b"keep me");
}

#[test]
fn keep_last_deletes_only_older_committed_checkpoints() {
    let root = TempDir::new("commit-keep");
    // Things that are not committed checkpoints, which retention must never touch.
    fs::write(root.0.join("notes.txt"), b"x").unwrap();
    fs::create_dir(root.0.join("step-0")).unwrap(); // no manifest
    fs::create_dir(root.0.join("step-01")).unwrap(); // not a canonical name
    fs::write(root.0.join("step-01").join(MANIFEST_FILE), b"{}").unwrap();
    fs::create_dir(root.0.join("step-9.tmp")).unwrap();
    let unrelated = ["notes.txt", "step-0", "step-01", "step-9.tmp"];
    let keep2 = SaveOptions::default().with_keep_last(Some(2));
    for step in 1..=4 {
        save_step(&root.0, step, step as u32, &keep2);
    }
    assert_eq!(steps(&root.0), vec![3, 4]);
    // A newer step kept with retention off, then an older one with keep 2: the newer stays,
    // and of the older ones only the one before the new step remains.
    save_step(
        &root.0,
        10,
        10,
        &SaveOptions::default().with_keep_last(None),
    );
    assert_eq!(steps(&root.0), vec![3, 4, 10]);
    save_step(&root.0, 5, 5, &keep2);
    assert_eq!(steps(&root.0), vec![4, 5, 10]);
    let mut want: Vec<String> = ["step-4", "step-5", "step-10"]
        .iter()
        .chain(&unrelated)
        .map(|s| s.to_string())
        .collect();
    want.sort();
    assert_eq!(names(&root.0), want);
    // The default keeps three: the new step and the two before it (step 10 is newer and
    // does not count).
    save_step(&root.0, 6, 6, &SaveOptions::default());
    assert_eq!(steps(&root.0), vec![4, 5, 6, 10]);
    save_step(&root.0, 7, 7, &SaveOptions::default());
    assert_eq!(steps(&root.0), vec![5, 6, 7, 10]);
    assert_eq!(load_expecting(&root.0, 2, 10), vec![10, 10]);
}

#[test]
fn saving_a_committed_step_again_is_an_error() {
    let root = TempDir::new("commit-exists");
    save_step(&root.0, 1, 1, &SaveOptions::default());
    let before = snapshot(&root.0.join("step-1"));
    let errors = on_ranks(2, |_, rt| {
        set_masters(rt, 2);
        save(&root.0, rt, &TestState::new(), 1).unwrap_err()
    });
    let dir = root.0.join("step-1");
    assert!(
        matches!(&errors[0], CheckpointError::Exists { dir: d } if *d == dir),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].to_string().contains("already exists"),
        "{}",
        errors[1]
    );
    assert_eq!(snapshot(&dir), before, "the committed files are untouched");
    assert_eq!(names(&root.0), vec!["step-1"]);
    assert_eq!(load_expecting(&root.0, 2, 1), vec![1, 1]);
}

/// A symlink planted at the temporary directory's predictable name is removed, never followed:
/// nothing is written into (or deleted from) its target.
#[cfg(unix)]
#[test]
fn a_symlink_at_the_temporary_name_is_not_followed() {
    let root = TempDir::new("commit-symlink");
    let victim = TempDir::new("commit-victim");
    fs::write(victim.0.join("precious"), b"x").unwrap();
    fs::create_dir(&root.0).ok();
    std::os::unix::fs::symlink(&victim.0, root.0.join("step-2.tmp")).unwrap();
    save_step(&root.0, 2, 2, &SaveOptions::default());
    assert_eq!(names(&victim.0), vec!["precious"]);
    assert_eq!(names(&root.0), vec!["step-2"]);
    assert!(!fs::symlink_metadata(root.0.join("step-2"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(load_expecting(&root.0, 2, 2), vec![2, 2]);
}
