//! Gradient reduction: after forward and backward on each rank's slice of the global batch, the
//! few-line SGD through `update` moves every parameter as plain Burn's gradient of the
//! global-batch mean loss would (bitwise at world 1, within 1e-6 relative beyond: the ranks'
//! means are averaged in another order than one device sums its batch), on flat, hierarchical,
//! HSDP and DDP meshes, with micro-batches accumulated, with gradients reduced in bf16 (within
//! bf16's rounding); frozen and unused parameters are handed zeros (or not handed at all) and
//! stay bitwise; a parameter one rank uses gets the world-averaged gradient; and
//! `last_grad_norm` is the global gradient's L2 norm.

use sshsdp_backend::{HsdpConfig, MixedPrecision, NamedParam, Precision};
use sshsdp_comm::Collective;
use sshsdp_plan::{Mesh, RuntimeFormat, Sharding};

use crate::common::models::{
    plain_branchy, plain_net, sharded_branchy, sharded_net, Net, GLOBAL, WIDTH,
};
use crate::common::*;

const LR: f32 = 0.5;
/// f32 tolerance where the reduction averages over ranks: relative to each parameter's largest
/// magnitude, and an absolute floor for parameters near zero (LayerNorm's beta starts at 0).
const REL: f32 = 1e-6;
const ABS: f32 = 1e-8;

/// One rank's outcome of a sharded run: its losses, the gradient norm before and after the
/// update, and every parameter gathered after it.
struct Ranked {
    losses: Vec<f32>,
    norm_before: Option<f64>,
    norm: Option<f64>,
    after: Vec<NamedParam>,
}

/// One SGD step of `init` sharded with `config`, each rank on its rows of the global batch in
/// `micro` micro-batches (each loss divided by `micro`: their gradients add up to the rows'
/// mean).
fn sharded_step(init: &Net<B>, config: &HsdpConfig, micro: usize) -> Vec<Ranked> {
    let world = config.mesh.world_size();
    on_ranks(world, |comm| {
        let rank = comm.rank();
        let (model, runtime) = shard_on(init, config.clone(), comm);
        let rows = my_rows(rank, world, GLOBAL);
        let per = rows.len() / micro;
        let losses = (0..micro)
            .map(|m| {
                let first = rows.start + m * per;
                let loss = model.loss(0, first..first + per) / micro as f32;
                let value = loss.clone().into_scalar();
                let _ = loss.backward();
                value
            })
            .collect();
        let norm_before = runtime.last_grad_norm();
        sgd(&runtime, LR).unwrap();
        Ranked {
            losses,
            norm_before,
            norm: runtime.last_grad_norm(),
            after: gathered(&runtime),
        }
    })
}

/// Checks every rank of a sharded step against plain Burn's step on the global batch.
fn check_against_plain(what: &str, ranks: &[Ranked], plain: &PlainStep, exact: bool) {
    let world = ranks.len() as f32;
    let loss: f32 = ranks
        .iter()
        .map(|r| r.losses.iter().sum::<f32>())
        .sum::<f32>()
        / world;
    assert!(
        (loss - plain.loss).abs() <= 1e-6 * plain.loss,
        "{what}: loss {loss} vs {}",
        plain.loss
    );
    for (rank, r) in ranks.iter().enumerate() {
        let what = format!("{what} rank {rank}");
        match exact {
            true => assert_params(&what, &r.after, &plain.after, 0.0, 0.0),
            false => assert_params(&what, &r.after, &plain.after, REL, ABS),
        }
    }
}

#[test]
fn one_sgd_step_moves_every_parameter_as_plain_burn_on_the_global_batch() {
    let init = plain_net(21);
    let before = sshsdp_backend::named_params(&init).unwrap();
    let plain = plain_sgd(&init, init.loss(0, 0..GLOBAL), LR);
    assert!(
        max_diff(&plain.after, &before) > 1e-2,
        "the step moves the weights"
    );
    assert!(
        plain.grads.iter().all(Option::is_some),
        "every parameter trains"
    );
    for world in 1..=4 {
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32);
        let ranks = sharded_step(&sharded_net(&init), &config, 1);
        check_against_plain(&format!("world {world}"), &ranks, &plain, world == 1);
    }
}

#[test]
fn two_by_two_meshes_and_copy_modes_step_as_plain_burn() {
    let init = plain_net(22);
    let plain = plain_sgd(&init, init.loss(0, 0..GLOBAL), LR);
    let mesh = Mesh::new(2, 2).unwrap();
    for sharding in [Sharding::Hierarchical, Sharding::Hsdp, Sharding::Ddp] {
        for reshard in [false, true] {
            let config = config(mesh, sharding, RuntimeFormat::F32)
                .with_copy_mode(sshsdp_backend::CopyMode::Fsdp2Style)
                .with_reshard_after_forward(reshard);
            let ranks = sharded_step(&sharded_net(&init), &config, 1);
            check_against_plain(
                &format!("{sharding:?} reshard {reshard}"),
                &ranks,
                &plain,
                false,
            );
        }
    }
}

#[test]
fn gradients_of_two_micro_batches_accumulate_into_the_global_batchs() {
    let init = plain_net(23);
    let plain = plain_sgd(&init, init.loss(0, 0..GLOBAL), LR);
    for world in [1, 2, 3] {
        for reshard in [false, true] {
            let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32)
                .with_reshard_after_forward(reshard);
            let ranks = sharded_step(&sharded_net(&init), &config, 2);
            assert_eq!(ranks[0].losses.len(), 2);
            check_against_plain(
                &format!("world {world} reshard {reshard}"),
                &ranks,
                &plain,
                false,
            );
        }
    }
}

#[test]
fn last_grad_norm_is_the_l2_norm_of_the_global_gradient_on_every_rank() {
    let init = plain_net(24);
    let want = plain_sgd(&init, init.loss(0, 0..GLOBAL), LR).grad_norm();
    assert!(want > 0.1, "{want}");
    let meshes = [
        (flat(1), Sharding::Hierarchical),
        (flat(2), Sharding::Hierarchical),
        (flat(3), Sharding::Hierarchical),
        (flat(4), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        (Mesh::new(2, 2).unwrap(), Sharding::Ddp),
    ];
    for (mesh, sharding) in meshes {
        let ranks = sharded_step(
            &sharded_net(&init),
            &config(mesh, sharding, RuntimeFormat::F32),
            1,
        );
        let first = ranks[0].norm.expect("measured by the update");
        assert!(
            (first - want).abs() <= 1e-6 * want,
            "{mesh} {sharding:?}: {first} vs {want}"
        );
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(r.norm_before, None, "rank {rank}: no update yet");
            // Bitwise the same on every rank (summed in the update group's rank order).
            assert_eq!(
                r.norm.map(f64::to_bits),
                Some(first.to_bits()),
                "{mesh} rank {rank}"
            );
        }
    }
}

#[test]
fn gradients_reduced_in_bf16_are_within_bf16s_rounding_and_half_the_bytes() {
    let init = plain_net(25);
    let plain = plain_sgd(&init, init.loss(0, 0..GLOBAL), LR);
    for world in [2, 4] {
        // Each rank's own gradient of the global mean (its rows' mean over the world size).
        let locals: Vec<PlainStep> = (0..world)
            .map(|r| {
                plain_sgd(
                    &init,
                    init.loss(0, my_rows(r, world, GLOBAL)) / world as f32,
                    LR,
                )
            })
            .collect();
        let run = |reduce: Precision| {
            let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32)
                .with_mixed_precision(MixedPrecision::new(Precision::F32, reduce));
            let init = sharded_net(&init);
            on_ranks(world, |comm| {
                let rank = comm.rank();
                let (model, runtime) = shard_on(&init, config.clone(), comm);
                let _ = model.loss(0, my_rows(rank, world, GLOBAL)).backward();
                sgd(&runtime, LR).unwrap();
                (gathered(&runtime), runtime.take_counters().reduced_bytes)
            })
        };
        let f32_run = run(Precision::F32);
        let bf16_run = run(Precision::Bf16);
        for ((got, half), (exact, full)) in bf16_run.iter().zip(&f32_run) {
            assert_eq!(
                2 * half,
                *full,
                "world {world}: bf16 halves the reduction's bytes"
            );
            assert!(
                max_diff(got, exact) > 0.0,
                "world {world}: bf16 rounds some gradient"
            );
            // Each rank's gradient is rounded to bf16 (relative 2^-9) and so is their sum:
            // the step is off by at most lr · 2^-8 · (Σ|g_r| + |g|), plus f32's rounding.
            for param in got {
                let g = plain.grad(&param.path).unwrap();
                let want = &by_path(&plain.after, &param.path).values;
                for (i, v) in param.values.iter().enumerate() {
                    let spread: f32 = locals
                        .iter()
                        .map(|l| l.grad(&param.path).unwrap()[i].abs())
                        .sum();
                    let bound = LR * (spread + g[i].abs()) / 256.0;
                    let want = want[i];
                    assert!(
                        (v - want).abs() <= bound + 1e-6 * want.abs() + ABS,
                        "world {world}: {}[{i}] = {v}, plain {want}, bound {bound}",
                        param.path
                    );
                }
            }
        }
    }
}

/// `Branchy`'s frozen layer and the one its loss uses only where asked.
const FROZEN: [&str; 2] = ["frozen.weight", "frozen.bias"];
const ODD: [&str; 2] = ["odd.weight", "odd.bias"];

#[test]
fn frozen_and_unused_parameters_are_handed_zeros_or_nothing_and_stay_bitwise() {
    let init = plain_branchy(26);
    let start = sshsdp_backend::named_params(&init).unwrap();
    let plain = plain_sgd(&init, init.loss(0, 0..4, false, 0.0), LR);
    for path in FROZEN.iter().chain(&ODD) {
        assert!(
            plain.grad(path).is_none(),
            "plain Burn: no gradient for {path}"
        );
    }
    let layer = (WIDTH * WIDTH + WIDTH) as u64;
    // One `Linear` per bucket (the unused one alone, never reduced), or the unused one sharing
    // the head's bucket (reduced: zeros for it). The frozen one always has its own bucket.
    for bucket_elements in [layer, 4 * layer] {
        for world in [1, 2] {
            let config = HsdpConfig::new(flat(world)).with_bucket_elements(bucket_elements);
            let init = sharded_branchy(&init);
            let ranks = on_ranks(world, |comm| {
                let rank = comm.rank();
                let (model, runtime) = shard_on(&init, config.clone(), comm);
                let plan = runtime.plan();
                let piece = plan.piece_of(rank).unwrap();
                let index = |paths: [&str; 2]| paths.map(|p| plan.param_index(p).unwrap());
                let (frozen, odd) = (index(FROZEN), index(ODD));
                let rows = my_rows(rank, world, 4);
                let _ = model.loss(0, rows, false, 0.0).backward();
                let mut handed = Vec::new();
                runtime
                    .update(|bucket, master, grad| {
                        handed.push(bucket);
                        for v in plan.piece_views(bucket, piece).unwrap() {
                            assert!(!frozen.contains(&v.param), "a frozen parameter's bucket");
                            if odd.contains(&v.param) {
                                for (run, at) in v.runs() {
                                    let at =
                                        at as usize..at as usize + (run.end - run.start) as usize;
                                    assert!(grad[at].iter().all(|&g| g == 0.0), "unused: zeros");
                                }
                            }
                        }
                        master.iter_mut().zip(grad).for_each(|(m, g)| *m -= LR * g);
                        Ok(())
                    })
                    .unwrap();
                let bucket_of = |p: usize| plan.params()[p].bucket;
                (
                    gathered(&runtime),
                    handed,
                    bucket_of(frozen[0]),
                    bucket_of(odd[0]),
                    plan.buckets().len(),
                )
            });
            for (rank, (after, handed, frozen, odd, buckets)) in ranks.iter().enumerate() {
                let what =
                    format!("{bucket_elements} elements per bucket, world {world}, rank {rank}");
                assert!(!handed.contains(frozen), "{what}: frozen bucket handed");
                let odd_alone = bucket_elements == layer;
                assert_eq!(handed.contains(odd), !odd_alone, "{what}: {handed:?}");
                assert_eq!(handed.len(), buckets - 1 - usize::from(odd_alone), "{what}");
                for path in FROZEN.iter().chain(&ODD) {
                    assert_eq!(
                        by_path(after, path),
                        by_path(&start, path),
                        "{what}: bitwise unchanged"
                    );
                }
                match world {
                    1 => assert_params(&what, after, &plain.after, 0.0, 0.0),
                    _ => assert_params(&what, after, &plain.after, REL, ABS),
                }
            }
        }
    }
}

#[test]
fn a_parameter_only_one_rank_uses_gets_the_world_averaged_gradient() {
    let init = plain_branchy(27);
    for world in [2, 3] {
        let rows = |r: usize| r * 2..r * 2 + 2;
        // The global loss: the mean of the ranks' losses, only rank 0's through `odd`.
        let loss = (0..world)
            .map(|r| init.loss(1, rows(r), r == 0, 0.0))
            .reduce(|a, b| a + b)
            .unwrap()
            / world as f32;
        let plain = plain_sgd(&init, loss, LR);
        assert!(plain.grad(ODD[0]).is_some());
        // `odd` shares its bucket with `head`, which every rank uses: every rank gathers and
        // reduces the same buckets (the documented limit: docs/YOUR_MODEL.md).
        let layer = (WIDTH * WIDTH + WIDTH) as u64;
        let config = HsdpConfig::new(flat(world)).with_bucket_elements(4 * layer);
        let init = sharded_branchy(&init);
        let ranks = on_ranks(world, |comm| {
            let rank = comm.rank();
            let (model, runtime) = shard_on(&init, config.clone(), comm);
            let _ = model.loss(1, rows(rank), rank == 0, 0.0).backward();
            sgd(&runtime, LR).unwrap();
            gathered(&runtime)
        });
        for (rank, after) in ranks.iter().enumerate() {
            let what = format!("world {world} rank {rank}");
            assert_params(&what, after, &plain.after, REL, ABS);
        }
    }
}

/// Collective calls per step, from the runtime's counters: none at world 1 (every group is one
/// rank); above it, a group of one rank (the replica group of a flat mesh, the shard group of
/// an `R×1` mesh) makes no call, so a mesh pays only for the groups that have peers. Each
/// step's count is the gathers over a shard group of peers, one call per reduction stage over
/// peers per bucket, one rebuild per bucket where a hierarchical replica group has peers, and
/// the step's agreements over the world (the gradient norm and the step verdict: the same on
/// every mesh above world 1).
#[test]
fn a_group_of_one_rank_makes_no_collective_call() {
    let init = sharded_net(&plain_net(29));
    let mut agreements = None;
    for (mesh, sharding) in [
        ((1, 1), Sharding::Hierarchical),
        ((1, 2), Sharding::Hierarchical),
        ((2, 1), Sharding::Hierarchical),
        ((2, 1), Sharding::Hsdp),
        ((2, 1), Sharding::Ddp),
        ((2, 2), Sharding::Hierarchical),
        ((2, 2), Sharding::Hsdp),
    ] {
        let config = config(
            Mesh::new(mesh.0, mesh.1).unwrap(),
            sharding,
            RuntimeFormat::F32,
        );
        let world = config.mesh.world_size();
        let runs = on_ranks(world, |comm| {
            let rank = comm.rank();
            let (model, runtime) = shard_on(&init, config.clone(), comm);
            let rows = my_rows(rank, world, GLOBAL);
            let buckets = runtime.plan().buckets().len() as u64;
            let mut steps = Vec::new();
            for step in 0..3 {
                let _ = model.loss(step, rows.clone()).backward();
                sgd(&runtime, LR).unwrap();
                let c = runtime.take_counters();
                steps.push((c.collectives, c.gathers));
            }
            (buckets, steps)
        });
        let what = format!("{mesh:?} {sharding:?}");
        let (replicas, shards) = mesh;
        for (rank, (buckets, steps)) in runs.into_iter().enumerate() {
            for (step, (calls, gathers)) in steps.into_iter().enumerate() {
                let what = format!("{what} rank {rank} step {step}");
                if world == 1 {
                    assert_eq!(calls, 0, "{what}");
                    continue;
                }
                let peers = |n: usize| u64::from(n > 1);
                let sharded = sharding != Sharding::Ddp;
                let stages = match sharding {
                    Sharding::Ddp => 1,
                    _ => peers(shards) + peers(replicas),
                };
                let rebuilds = match sharding {
                    Sharding::Hierarchical => peers(replicas),
                    _ => 0,
                };
                let moved =
                    gathers * peers(shards) * u64::from(sharded) + buckets * (stages + rebuilds);
                assert!(calls > moved, "{what}: {calls} calls, {moved} moving bytes");
                let agreed = calls - moved;
                if step == 0 {
                    // The first step also carries the lanes' start-up agreements.
                    continue;
                }
                // The agreements are the same on every mesh and step above world 1.
                assert_eq!(*agreements.get_or_insert(agreed), agreed, "{what}");
            }
        }
    }
    assert_eq!(agreements, Some(2), "the norm and the verdict");
}
