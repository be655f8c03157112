//! Loading is all-or-nothing and collective (threads engine): a corrupted or resized file, or
//! a failure of one rank alone, makes every rank return an error with no master changed.

use crate::common;

use std::fs;
use std::path::Path;

use common::sharded::{masters_are, on_ranks, set_masters, TestState};
use common::TempDir;
use sshsdp_checkpoint::{load, save, CheckpointError};

const FILE1: &str = "rank-00001-of-00002.safetensors";

/// A root holding step 1 saved at world 2 from the masters numbered 1.
fn saved(tag: &str) -> TempDir {
    let root = TempDir::new(tag);
    on_ranks(2, |_, rt| {
        set_masters(rt, 1);
        save(&root.0, rt, &TestState::new(), 1).unwrap();
    });
    root
}

/// Loads `root` at `world` over masters numbered 2 with `state(rank)`; asserts that every
/// rank failed and kept its masters; returns the errors.
fn load_fails(
    root: &Path,
    world: usize,
    state: impl Fn(usize) -> TestState + Sync,
) -> Vec<CheckpointError> {
    on_ranks(world, |rank, rt| {
        set_masters(rt, 2);
        let mut state = state(rank);
        let e = load(root, rt, &mut state).expect_err("every rank fails");
        assert!(masters_are(rt, 2), "rank {rank}: masters unchanged");
        assert!(state.imported.is_empty(), "rank {rank}: no state imported");
        e
    })
}

#[test]
fn a_flipped_byte_fails_every_rank_and_changes_no_master() {
    let root = saved("load-flip");
    let file = root.0.join("step-1").join(FILE1);
    let mut bytes = fs::read(&file).unwrap();
    let original = bytes.clone();
    // In the data, past the header: only the manifest's SHA-256 can tell.
    let at = bytes.len() - 5;
    bytes[at] ^= 0x10;
    fs::write(&file, &bytes).unwrap();
    for world in [2, 3] {
        for e in load_fails(&root.0, world, |_| TestState::new()) {
            let text = e.to_string();
            assert!(
                matches!(e, CheckpointError::Corrupt { .. })
                    && text.contains(FILE1)
                    && text.contains("SHA-256"),
                "{text}"
            );
        }
    }
    // A file of another size is refused before it is read.
    let mut longer = original.clone();
    longer.push(0);
    fs::write(&file, &longer).unwrap();
    for e in load_fails(&root.0, 2, |_| TestState::new()) {
        assert!(e.to_string().contains("the manifest lists"), "{e}");
    }
    // Restored, it loads.
    fs::write(&file, &original).unwrap();
    on_ranks(2, |_, rt| {
        set_masters(rt, 2);
        assert_eq!(load(&root.0, rt, &mut TestState::new()).unwrap(), 1);
        assert!(masters_are(rt, 1));
    });
}

#[test]
fn a_tampered_manifest_is_refused() {
    let root = saved("load-manifest");
    let manifest = root.0.join("step-1").join("manifest.json");
    let text = fs::read_to_string(&manifest).unwrap();
    fs::write(&manifest, text.replace("\"world\": 2", "\"world\": 3")).unwrap();
    for e in load_fails(&root.0, 2, |_| TestState::new()) {
        assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e}");
    }
    fs::write(&manifest, "{ not json").unwrap();
    for e in load_fails(&root.0, 2, |_| TestState::new()) {
        assert!(e.to_string().contains("invalid manifest"), "{e}");
    }
}

/// Rank 1 alone cannot accept the checkpoint (it holds another optimizer's state): without
/// the agreement rank 0 would apply it; with it, no rank does.
#[test]
fn one_rank_failing_validation_fails_every_rank() {
    let root = saved("load-one-rank");
    let errors = load_fails(&root.0, 2, |rank| {
        let mut state = TestState::new();
        if rank == 1 {
            state.name = "OtherOptimizer".into();
        }
        state
    });
    let own = matches!(&errors[1], CheckpointError::Mismatch { reason, .. }
        if reason.contains("OtherOptimizer"));
    assert!(own, "{}", errors[1]);
    match &errors[0] {
        CheckpointError::Ranks { phase, failures } => {
            assert!(phase.contains("load"), "{phase}");
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].0, 1);
            assert!(
                failures[0].1.contains("OtherOptimizer"),
                "{}",
                failures[0].1
            );
        }
        other => panic!("rank 0: {other}"),
    }
}
