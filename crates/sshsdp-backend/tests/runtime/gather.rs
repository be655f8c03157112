//! Gathering: after `shard`, every parameter's gathered values (`param_values`) are the
//! unsharded module's — exactly in f32, the format's rounding of them in bf16 and MXFP8 — at
//! world sizes 1 to 4, on flat, hierarchical and HSDP 2×2 meshes (and DDP), in both copy modes;
//! and a step's counters (gathers, bytes gathered, prefetches, copies, resident bytes) are the
//! plan's sizes.

use sshsdp_backend::{named_params, CopyMode, Counters, HsdpConfig, NamedParam};
use sshsdp_comm::Collective;
use sshsdp_plan::{Mesh, Plan, RuntimeFormat, Sharding};

use crate::common::models::{plain_net, sharded_net, GLOBAL};
use crate::common::*;

/// Each rank's gathered parameters right after `shard` with `config`.
fn gathered_after_shard(
    plain_seed: u64,
    config: &HsdpConfig,
) -> (Vec<NamedParam>, Vec<Vec<NamedParam>>, Plan) {
    let init = sharded_net(&plain_net(plain_seed));
    let world = config.mesh.world_size();
    let ranks = on_ranks(world, |comm| {
        let (_model, runtime) = shard_on(&init, config.clone(), comm);
        (gathered(&runtime), runtime.plan().clone())
    });
    let plan = ranks[0].1.clone();
    (
        named_params(&init).unwrap(),
        ranks.into_iter().map(|r| r.0).collect(),
        plan,
    )
}

#[test]
fn f32_parameters_gather_exactly_at_every_world_size_and_copy_mode() {
    for world in 1..=4 {
        for mode in [CopyMode::ZeroCopy, CopyMode::Fsdp2Style] {
            let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32)
                .with_copy_mode(mode);
            let (want, ranks, plan) = gathered_after_shard(1, &config);
            assert!(plan.buckets().len() > 1, "several buckets");
            assert!(
                world == 1 || plan.params().iter().any(|p| p.split),
                "world {world}: some parameter is split across pieces"
            );
            for (rank, got) in ranks.iter().enumerate() {
                assert_params(
                    &format!("world {world} {mode:?} rank {rank}"),
                    got,
                    &want,
                    0.0,
                    0.0,
                );
            }
        }
    }
}

#[test]
fn bf16_parameters_gather_as_their_bf16_rounding() {
    for world in 1..=4 {
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::Bf16);
        let (init, ranks, plan) = gathered_after_shard(2, &config);
        let want: Vec<NamedParam> = init
            .iter()
            .map(|p| NamedParam {
                values: p.values.iter().map(|&v| bf16_round(v)).collect(),
                ..p.clone()
            })
            .collect();
        assert!(
            max_diff(&want, &init) > 0.0,
            "bf16 rounds the initial values"
        );
        assert_eq!(encoded_all(&plan, &init), want);
        for (rank, got) in ranks.iter().enumerate() {
            assert_params(&format!("world {world} rank {rank}"), got, &want, 0.0, 0.0);
        }
    }
}

#[test]
fn mxfp8_parameters_gather_as_the_square_block_encoding_of_the_whole_matrix() {
    for world in 1..=4 {
        let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::Mxfp8);
        let (init, ranks, plan) = gathered_after_shard(3, &config);
        // The 32×32 matrices are MXFP8; vectors and the 32×8 head fall back to bf16.
        let format = |path: &str| plan.params()[plan.param_index(path).unwrap()].format;
        assert_eq!(format("embed.weight"), RuntimeFormat::Mxfp8);
        assert_eq!(format("up.weight"), RuntimeFormat::Mxfp8);
        assert_eq!(format("down.weight"), RuntimeFormat::Bf16);
        assert_eq!(format("norm.gamma"), RuntimeFormat::Bf16);
        assert_eq!(plan.fallbacks().len(), 5, "{:?}", plan.fallbacks());
        let want = encoded_all(&plan, &init);
        // E4M3 keeps 3 mantissa bits: the values moved by more than bf16 would move them, and
        // by at most the format's bound (1/17 relative on normal values under RCEIL, plus the
        // subnormal step of a tile's scale for the smallest ones).
        let mx = by_path(&want, "up.weight");
        let original = by_path(&init, "up.weight");
        let moved = mx
            .values
            .iter()
            .zip(&original.values)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            moved > mx.values.len() / 2,
            "MXFP8 rounds most elements: {moved}"
        );
        for (rank, got) in ranks.iter().enumerate() {
            assert_params(&format!("world {world} rank {rank}"), got, &want, 0.0, 0.0);
        }
    }
}

#[test]
fn two_by_two_meshes_gather_the_module_in_every_sharding_and_format() {
    for sharding in [Sharding::Hierarchical, Sharding::Hsdp, Sharding::Ddp] {
        for format in [
            RuntimeFormat::F32,
            RuntimeFormat::Bf16,
            RuntimeFormat::Mxfp8,
        ] {
            for mode in [CopyMode::ZeroCopy, CopyMode::Fsdp2Style] {
                let config =
                    config(Mesh::new(2, 2).unwrap(), sharding, format).with_copy_mode(mode);
                let (init, ranks, plan) = gathered_after_shard(4, &config);
                let want = encoded_all(&plan, &init);
                for (rank, got) in ranks.iter().enumerate() {
                    let what = format!("{sharding:?} {format:?} {mode:?} rank {rank}");
                    assert_params(&what, got, &want, 0.0, 0.0);
                }
            }
        }
    }
}

/// Each rank's counters of `steps` SGD steps (taken after each step, before reading any
/// value) and the plan.
fn step_counters(config: &HsdpConfig, steps: usize) -> (Vec<Vec<Counters>>, Plan) {
    let init = sharded_net(&plain_net(5));
    let world = config.mesh.world_size();
    let ranks = on_ranks(world, |comm| {
        let rank = comm.rank();
        let (model, runtime) = shard_on(&init, config.clone(), comm);
        runtime.take_counters();
        let counters: Vec<Counters> = (0..steps)
            .map(|step| {
                let _ = model.loss(step, my_rows(rank, world, GLOBAL)).backward();
                sgd(&runtime, 0.1).unwrap();
                runtime.take_counters()
            })
            .collect();
        (counters, runtime.plan().clone())
    });
    let plan = ranks[0].1.clone();
    (ranks.into_iter().map(|r| r.0).collect(), plan)
}

/// Bytes of bucket `b`'s gathered buffer that come from other ranks: its whole buffer less
/// this rank's runtime shard, i.e. `buffer × (S − 1) / S`.
fn gathered_bytes(plan: &Plan, b: usize) -> u64 {
    let bytes = plan.buffer_bytes(b);
    bytes - bytes / plan.runtime_shards() as u64
}

#[test]
fn a_steps_counters_are_the_plans_sizes() {
    let meshes = [
        (flat(2), Sharding::Hierarchical),
        (flat(3), Sharding::Hierarchical),
        (flat(4), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
    ];
    for (mesh, sharding) in meshes {
        for format in [
            RuntimeFormat::F32,
            RuntimeFormat::Bf16,
            RuntimeFormat::Mxfp8,
        ] {
            let (ranks, plan) = step_counters(&config(mesh, sharding, format), 2);
            let what = format!("{mesh} {sharding:?} {format:?}");
            let buckets = plan.buckets().len() as u64;
            assert!(buckets > 2, "{what}: several buckets");
            let all = 0..plan.buckets().len();
            let gathered: u64 = all.clone().map(|b| gathered_bytes(&plan, b)).sum();
            // f32 gradients of every bucket, every piece (all parameters train).
            let reduced: u64 = plan
                .buckets()
                .iter()
                .map(|b| 4 * plan.pieces() as u64 * b.piece_elements)
                .sum();
            let resident: u64 = plan.buckets().iter().map(|b| 4 * b.compute_elements).sum();
            for (rank, steps) in ranks.iter().enumerate() {
                for (step, c) in steps.iter().enumerate() {
                    let what = format!("{what} rank {rank} step {step}: {c:?}");
                    // Each bucket gathered once in forward and kept through backward.
                    assert_eq!(c.gathers, buckets, "{what}");
                    assert_eq!(c.backward_gathers, 0, "{what}");
                    assert_eq!(c.gathered_bytes, gathered, "{what}");
                    // The first step has no recorded order to prefetch by; from the second on,
                    // every bucket is gathered ahead of use (the first at the end of the step
                    // before).
                    let prefetched = if step == 0 { 0 } else { buckets };
                    assert_eq!(c.prefetched, prefetched, "{what}");
                    assert_eq!(c.param_bytes_copied, 0, "{what}: zero-copy");
                    assert_eq!(c.reduced_bytes, reduced, "{what}");
                    assert_eq!(c.peak_resident_bytes, resident, "{what}");
                    // Only f32 runtime parameters need no widening or decoding.
                    let decoded = if format == RuntimeFormat::F32 {
                        0
                    } else {
                        resident
                    };
                    assert_eq!(c.decoded_bytes, decoded, "{what}");
                    assert_eq!(c.skipped_steps, 0, "{what}");
                }
            }
        }
    }
}

#[test]
fn fsdp2_style_copies_each_shard_in_and_each_parameter_out() {
    for world in [2, 3] {
        let base = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32);
        // The second step: a steady one (each step copies in the next step's first bucket,
        // prefetched at its end).
        let (zero, _) = step_counters(&base, 2);
        let (fsdp2, plan) = step_counters(&base.clone().with_copy_mode(CopyMode::Fsdp2Style), 2);
        // Copy-in: this rank's shard; copy-out: every parameter's f32 values.
        let copied: u64 = (0..plan.buckets().len())
            .map(|b| {
                let params = plan.buckets()[b].params.clone();
                let out: u64 = plan.params()[params]
                    .iter()
                    .map(|p| 4 * p.spec.numel())
                    .sum();
                plan.buffer_bytes(b) / plan.runtime_shards() as u64 + out
            })
            .sum();
        for (z, f) in zero.iter().zip(&fsdp2) {
            assert_eq!(f[1].param_bytes_copied, copied, "world {world}: {:?}", f[1]);
            assert_eq!(z[1].param_bytes_copied, 0);
            assert_eq!(
                f[1].gathered_bytes, z[1].gathered_bytes,
                "the same collectives"
            );
            assert_eq!(f[0].gathers, z[0].gathers);
        }
    }
}

#[test]
fn ddp_copies_the_replicated_buckets_instead_of_gathering() {
    let (ranks, plan) = step_counters(&config(flat(2), Sharding::Ddp, RuntimeFormat::F32), 1);
    let buffers: u64 = (0..plan.buckets().len())
        .map(|b| plan.buffer_bytes(b))
        .sum();
    assert_eq!(plan.runtime_shards(), 1);
    for steps in &ranks {
        let c = &steps[0];
        assert_eq!(c.gathers, 0, "{c:?}");
        assert_eq!(c.gathered_bytes, 0, "{c:?}");
        assert_eq!(c.param_bytes_copied, buffers, "{c:?}");
    }
}

#[test]
fn resharding_after_forward_gathers_again_in_backward_and_steps_alike() {
    let init = sharded_net(&plain_net(6));
    let world = 2;
    let run = |reshard: bool| {
        on_ranks(world, |comm| {
            let rank = comm.rank();
            let config = config(flat(world), Sharding::Hierarchical, RuntimeFormat::F32)
                .with_reshard_after_forward(reshard);
            let (model, runtime) = shard_on(&init, config, comm);
            let mut counters = Vec::new();
            for step in 0..2 {
                runtime.take_counters();
                let _ = model.loss(step, my_rows(rank, world, GLOBAL)).backward();
                sgd(&runtime, 0.1).unwrap();
                counters.push(runtime.take_counters());
            }
            let plan = runtime.plan();
            let largest = (0..plan.buckets().len())
                .map(|b| 4 * plan.buckets()[b].compute_elements)
                .max();
            let first = &plan.params()[plan.buckets()[0].params.clone()];
            assert_eq!(
                first.len(),
                1,
                "the embedding has the first bucket to itself"
            );
            assert_eq!(first[0].spec.path, "embed.weight");
            (
                gathered(&runtime),
                counters,
                plan.buckets().len() as u64,
                largest.unwrap(),
            )
        })
    };
    let kept = run(false);
    let released = run(true);
    for ((v0, c0, buckets, _), (v1, c1, _, largest)) in kept.iter().zip(&released) {
        assert_params("reshard vs keep", v1, v0, 0.0, 0.0);
        for (k, r) in c0.iter().zip(c1) {
            // Backward gathers again every bucket whose values it needs except the last of
            // forward (still resident): not the embedding's (its own bucket, the first), whose
            // backward scatters the output gradient by token and never reads the table.
            assert_eq!(r.backward_gathers, buckets - 2, "{r:?}");
            assert_eq!(r.gathers, k.gathers + buckets - 2, "{r:?} vs {k:?}");
            // About two buckets resident at once instead of all.
            assert!(r.peak_resident_bytes <= 2 * largest, "{r:?}");
            assert!(
                r.peak_resident_bytes < k.peak_resident_bytes,
                "{r:?} vs {k:?}"
            );
        }
    }
}
