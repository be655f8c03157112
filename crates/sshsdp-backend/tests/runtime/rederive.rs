//! Re-deriving runtime parameters from fp32 masters: the masters start as the module's fp32
//! values in every runtime format (never rounded), and after SGD steps every gathered parameter
//! is exactly the format's encoding of its updated master (bf16 rounding; square-block MXFP8 of
//! the whole matrix, by `sshsdp_mx`) on every rank and mesh; steps below the format's
//! resolution accumulate in the fp32 masters and reach the runtime values once they add up.

use sshsdp_backend::NamedParam;
use sshsdp_comm::Collective;
use sshsdp_plan::{Mesh, Plan, RuntimeFormat, Sharding};

use crate::common::models::{plain_net, sharded_net, Plane, GLOBAL};
use crate::common::*;

/// Meshes every check here runs on.
fn meshes() -> Vec<(Mesh, Sharding)> {
    vec![
        (flat(1), Sharding::Hierarchical),
        (flat(2), Sharding::Hierarchical),
        (flat(3), Sharding::Hierarchical),
        (flat(4), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        (Mesh::new(2, 2).unwrap(), Sharding::Ddp),
    ]
}

/// Per rank: its masters and gathered parameters after each of `steps` SGD steps (entry 0:
/// before any), and the plan.
type Trace = (Vec<Vec<(Vec<Master>, Vec<NamedParam>)>>, Plan);

fn trace(seed: u64, mesh: Mesh, sharding: Sharding, format: RuntimeFormat, steps: usize) -> Trace {
    let init = sharded_net(&plain_net(seed));
    let world = mesh.world_size();
    let ranks = on_ranks(world, |comm| {
        let rank = comm.rank();
        let (model, runtime) = shard_on(&init, config(mesh, sharding, format), comm);
        let mut out = vec![(masters(&runtime), gathered(&runtime))];
        for step in 0..steps {
            let _ = model.loss(step, my_rows(rank, world, GLOBAL)).backward();
            sgd(&runtime, 0.5).unwrap();
            out.push((masters(&runtime), gathered(&runtime)));
        }
        (out, runtime.plan().clone())
    });
    let plan = ranks[0].1.clone();
    (ranks.into_iter().map(|r| r.0).collect(), plan)
}

/// The full masters after step `step` from every rank's trace.
fn masters_at(
    ranks: &[Vec<(Vec<Master>, Vec<NamedParam>)>],
    plan: &Plan,
    step: usize,
) -> Vec<NamedParam> {
    let per_rank: Vec<Vec<Master>> = ranks.iter().map(|r| r[step].0.clone()).collect();
    full_masters(plan, &per_rank)
}

#[test]
fn masters_start_as_the_modules_fp32_values_in_every_format() {
    let init = sshsdp_backend::named_params(&plain_net(31)).unwrap();
    for (mesh, sharding) in meshes() {
        for format in [
            RuntimeFormat::F32,
            RuntimeFormat::Bf16,
            RuntimeFormat::Mxfp8,
        ] {
            let (ranks, plan) = trace(31, mesh, sharding, format, 0);
            let what = format!("{mesh} {sharding:?} {format:?}");
            assert_params(&what, &masters_at(&ranks, &plan, 0), &init, 0.0, 0.0);
        }
    }
}

#[test]
fn gathered_values_are_the_encoding_of_the_updated_masters() {
    let init = sshsdp_backend::named_params(&plain_net(32)).unwrap();
    for (mesh, sharding) in meshes() {
        for format in [RuntimeFormat::Bf16, RuntimeFormat::Mxfp8] {
            let (ranks, plan) = trace(32, mesh, sharding, format, 2);
            for step in 0..=2 {
                let masters = masters_at(&ranks, &plan, step);
                if step > 0 {
                    assert!(max_diff(&masters, &init) > 1e-3, "the masters moved");
                }
                let want = encoded_all(&plan, &masters);
                for (rank, r) in ranks.iter().enumerate() {
                    let what = format!("{mesh} {sharding:?} {format:?} step {step} rank {rank}");
                    assert_params(&what, &r[step].1, &want, 0.0, 0.0);
                }
            }
        }
    }
}

#[test]
fn f32_runtime_values_are_the_masters_themselves() {
    for (mesh, sharding) in meshes() {
        let (ranks, plan) = trace(33, mesh, sharding, RuntimeFormat::F32, 2);
        for step in 0..=2 {
            let masters = masters_at(&ranks, &plan, step);
            for (rank, r) in ranks.iter().enumerate() {
                let what = format!("{mesh} {sharding:?} step {step} rank {rank}");
                assert_params(&what, &r[step].1, &masters, 0.0, 0.0);
            }
        }
    }
}

/// Steps of `-lr` (the gradient of `Plane` is exactly 1) far below the runtime format's
/// resolution: each master must hold the exact f32 result of all of them, and the runtime
/// values follow the masters' encoding, moving only once the steps add up.
fn tiny_steps(format: RuntimeFormat, lr: f32, steps: usize) {
    let world = 2;
    let init = Plane::<B>::new(&Default::default());
    let start = sshsdp_backend::named_params(&init).unwrap();
    let ranks = on_ranks(world, |comm| {
        let (model, runtime) = shard_on(
            &init,
            config(flat(world), Sharding::Hierarchical, format),
            comm,
        );
        let mut written: Vec<Option<Vec<f32>>> = vec![None; runtime.plan().buckets().len()];
        let mut out = vec![(masters(&runtime), gathered(&runtime))];
        for _ in 0..steps {
            let _ = model.loss().backward();
            runtime
                .update(|bucket, master, grad| {
                    // The master handed in is bitwise what the last step wrote: the runtime
                    // re-derived its runtime bytes from it without rounding it.
                    if let Some(last) = &written[bucket] {
                        assert_eq!(last.as_slice(), &*master, "bucket {bucket}: master rounded");
                    }
                    master.iter_mut().zip(grad).for_each(|(m, g)| *m -= lr * g);
                    written[bucket] = Some(master.to_vec());
                    Ok(())
                })
                .unwrap();
            out.push((masters(&runtime), gathered(&runtime)));
        }
        (out, runtime.plan().clone())
    });
    let plan = ranks[0].1.clone();
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.0).collect();
    // The reference: the same f32 arithmetic on the initial values, step by step.
    let mut want = start.clone();
    for step in 0..=steps {
        if step > 0 {
            want.iter_mut()
                .for_each(|p| p.values.iter_mut().for_each(|v| *v -= lr));
        }
        let masters = masters_at(&ranks, &plan, step);
        assert_params(
            &format!("{format:?} masters after {step}"),
            &masters,
            &want,
            0.0,
            0.0,
        );
        let runtime = encoded_all(&plan, &masters);
        for (rank, r) in ranks.iter().enumerate() {
            let what = format!("{format:?} step {step} rank {rank}");
            assert_params(&what, &r[step].1, &runtime, 0.0, 0.0);
        }
    }
    // One step is below the resolution almost everywhere; all of them are not.
    let changed = |step: usize| {
        let (a, b) = (&ranks[0][0].1, &ranks[0][step].1);
        a.iter()
            .zip(b)
            .flat_map(|(x, y)| x.values.iter().zip(&y.values))
            .filter(|(u, v)| u != v)
            .count()
    };
    let total: usize = start.iter().map(|p| p.values.len()).sum();
    let (first, last) = (changed(1), changed(steps));
    assert!(
        first * 4 < total,
        "{format:?}: one step moved {first} of {total} runtime values"
    );
    assert!(
        last > 4 * first.max(1),
        "{format:?}: {steps} steps moved {last} (one: {first})"
    );
}

#[test]
fn bf16_steps_below_bf16s_resolution_accumulate_in_the_fp32_masters() {
    // bf16 keeps 8 significant bits: near 1, steps of 2^-8 and 2^-7; 1e-3 is below half of both.
    tiny_steps(RuntimeFormat::Bf16, 1e-3, 16);
}

#[test]
fn mxfp8_steps_below_e4m3s_resolution_accumulate_in_the_fp32_masters() {
    // E4M3 under the tile's scale of 2^-8 holds values near 1 in steps of 1/16 to 1/8; the
    // 32-vector falls back to bf16. One step of 4e-3 moves only values on a rounding tie (and
    // some bf16 ones); 24 of them move nearly all.
    tiny_steps(RuntimeFormat::Mxfp8, 4e-3, 24);
}
