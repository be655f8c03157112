//! Fault injection (fail points; threads engine with a 2 s timeout): a fault on rank 1 at each
//! stage of a training run — shard, forward gather, backward reduce, update, save, load — must
//! be an error on every rank in the same stage, within 1 s (long before the timeout), never a
//! hang and never a success on some ranks. Prints each rank's time to the error.
//!
//! Fail points are process-global (`fail::FailScenario` serialises the tests of this file); the
//! point's argument picks the rank (`sshsdp_comm::faults`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use common::sharded::{net, Hb, TestState};
use common::TempDir;
use sshsdp_backend::{shard, HsdpConfig, HsdpError, Views};
use sshsdp_checkpoint::{load, save};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_plan::Mesh;

const WORLD: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(2);
/// The bound on every rank's time to the error (the issue's: within 1 s, without a timeout).
const BOUND: Duration = Duration::from_secs(1);

/// Where a rank's run ended: the stage whose call returned an error (`"done"` if none), the
/// error, and how long that stage took (for the gather and reduce faults, which surface at the
/// update, from the start of the forward pass).
#[derive(Debug)]
struct Ended {
    stage: &'static str,
    error: String,
    after: Duration,
}

/// One small training step and a checkpoint round trip on every rank, with `point` (if any)
/// failing on rank 1.
fn run(point: Option<&'static str>) -> Vec<Ended> {
    let scenario = fail::FailScenario::setup();
    if let Some(point) = point {
        fail::cfg(point, "return(1)").unwrap();
    }
    let init = net();
    let root = TempDir::new("faults");
    let ended = ThreadsWorld::run(WORLD, ThreadsConfig { timeout: TIMEOUT }, |comm| {
        run_rank(&init, comm, &root.0)
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("no rank panics"))
    .collect();
    scenario.teardown();
    ended
}

fn run_rank(
    init: &common::sharded::Net<Hb>,
    comm: sshsdp_comm::threads::ThreadComm,
    root: &Path,
) -> Ended {
    let device = Default::default();
    let ended = |stage, error: String, start: Instant| Ended {
        stage,
        error,
        after: start.elapsed(),
    };
    let start = Instant::now();
    let config = HsdpConfig::new(Mesh::flat(WORLD).unwrap()).with_bucket_elements(100);
    let (model, runtime) = match shard::<Hb, _, _>(init.clone(), config, comm, &device) {
        Ok(sharded) => sharded,
        Err(e) => return ended("shard", e.to_string(), start),
    };
    let start = Instant::now();
    let x = Tensor::<Hb, 2>::ones([4, 12], &device);
    let y = model.norm.forward(model.b.forward(model.a.forward(x)));
    let _ = y.sum().backward();
    let stepped = runtime.update_pieces(Views::Host, |pieces, _| {
        for piece in pieces.iter_mut() {
            let (master, grad) = piece.host()?;
            master.iter_mut().zip(grad).for_each(|(m, g)| *m -= 0.1 * g);
        }
        Ok::<(), HsdpError>(())
    });
    if let Err(e) = stepped {
        return ended("update", e.to_string(), start);
    }
    let start = Instant::now();
    if let Err(e) = save(root, &runtime, &TestState::new(), 1) {
        return ended("save", e.to_string(), start);
    }
    let start = Instant::now();
    if let Err(e) = load(root.join("step-1"), &runtime, &mut TestState::new()) {
        return ended("load", e.to_string(), start);
    }
    ended("done", String::new(), start)
}

/// Runs with `point` failing on rank 1 and checks that every rank ended in `stage` with an
/// error within [`BOUND`]; prints the times.
fn fault_at(point: &'static str, stage: &str) {
    let ended = run(Some(point));
    for (rank, e) in ended.iter().enumerate() {
        println!(
            "{point:<16} rank {rank}: error in {:<6} after {:>7.1?}: {}",
            e.stage, e.after, e.error
        );
    }
    for (rank, e) in ended.iter().enumerate() {
        assert_eq!(e.stage, stage, "rank {rank}: {e:?}");
        assert!(
            !e.error.contains("timed out"),
            "rank {rank} waited for the timeout: {e:?}"
        );
        assert!(e.after < BOUND, "rank {rank} took {:?}: {e:?}", e.after);
    }
    assert!(
        ended[1].error.contains("injected fault"),
        "rank 1 reports its own fault: {:?}",
        ended[1]
    );
}

#[test]
fn without_a_fault_every_stage_succeeds() {
    for (rank, e) in run(None).iter().enumerate() {
        assert_eq!(e.stage, "done", "rank {rank}: {e:?}");
    }
}

#[test]
fn a_fault_in_shard_is_an_error_on_every_rank() {
    fault_at("sshsdp::shard", "shard");
}

#[test]
fn a_fault_in_a_forward_gather_is_an_error_on_every_rank() {
    fault_at("sshsdp::gather", "update");
}

#[test]
fn a_fault_in_a_backward_reduction_is_an_error_on_every_rank() {
    fault_at("sshsdp::reduce", "update");
}

#[test]
fn a_fault_in_the_update_is_an_error_on_every_rank() {
    fault_at("sshsdp::update", "update");
}

#[test]
fn a_fault_in_save_is_an_error_on_every_rank() {
    fault_at("sshsdp::save", "save");
}

#[test]
fn a_fault_in_load_is_an_error_on_every_rank() {
    fault_at("sshsdp::load", "load");
}
