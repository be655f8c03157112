//! Storage placement: fp32 masters and gradient accumulators on the decorated backend's device
//! (`with_master_placement`, `with_grad_placement`; NdArray's "device" is host memory behind
//! Burn tensors) train bitwise like host ones through the host-slice `update`, with the staging
//! counted; and `shard_bytes`, `master_bytes` and `device_master_bytes` are the plan's sizes.

use sshsdp_backend::{HsdpConfig, NamedParam, Placement};
use sshsdp_comm::Collective;
use sshsdp_plan::{Mesh, Plan, RuntimeFormat, Sharding};

use crate::common::models::{plain_net, sharded_net, Net, GLOBAL};
use crate::common::*;

const STEPS: usize = 3;
const MICRO: usize = 2;

/// What a placed run leaves on each rank.
#[derive(Debug, PartialEq)]
struct Placed {
    losses: Vec<f32>,
    after: Vec<NamedParam>,
    masters: Vec<Master>,
    norm: f64,
    staged_bytes: u64,
}

/// [`STEPS`] SGD steps of [`MICRO`] micro-batches each with masters and gradients placed as
/// given.
fn placed(
    init: &Net<B>,
    config: HsdpConfig,
    (master_at, grad_at): (Placement, Placement),
) -> Vec<Placed> {
    let world = config.mesh.world_size();
    let config = config
        .with_master_placement(master_at)
        .with_grad_placement(grad_at);
    on_ranks(world, |comm| {
        let rank = comm.rank();
        let (model, runtime) = shard_on(init, config.clone(), comm);
        assert!(!runtime.shards_on_device(), "NdArray: host shards");
        assert!(
            !runtime.collectives_on_device(),
            "NdArray: host collectives"
        );
        let rows = my_rows(rank, world, GLOBAL);
        let per = rows.len() / MICRO;
        let (mut losses, mut staged_bytes) = (Vec::new(), 0);
        runtime.take_counters();
        for step in 0..STEPS {
            for m in 0..MICRO {
                let first = rows.start + m * per;
                let loss = model.loss(step, first..first + per) / MICRO as f32;
                losses.push(loss.clone().into_scalar());
                let _ = loss.backward();
            }
            sgd(&runtime, 0.5).unwrap();
            staged_bytes += runtime.take_counters().staged_bytes;
        }
        Placed {
            losses,
            after: gathered(&runtime),
            masters: masters(&runtime),
            norm: runtime.last_grad_norm().unwrap(),
            staged_bytes,
        }
    })
}

/// Bytes of fp32 masters one rank keeps: its piece of every bucket.
fn piece_bytes(plan: &Plan) -> u64 {
    plan.buckets().iter().map(|b| 4 * b.piece_elements).sum()
}

#[test]
fn device_masters_and_gradients_step_bitwise_like_host_ones() {
    use Placement::{Device, Host};
    let plain = plain_net(41);
    let init = sharded_net(&plain);
    let param_bytes: u64 = sshsdp_backend::named_params(&plain)
        .unwrap()
        .iter()
        .map(|p| 4 * p.values.len() as u64)
        .sum();
    let world = 2;
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        let config = config(flat(world), Sharding::Hierarchical, format);
        let host = placed(&init, config.clone(), (Host, Host));
        assert!(
            host[0].losses[4] < host[0].losses[0],
            "{format:?} trains: {:?}",
            host[0].losses
        );
        let masters = placed(&init, config.clone(), (Device, Host));
        let grads = placed(&init, config.clone(), (Host, Device));
        let both = placed(&init, config.clone(), (Device, Device));
        let device_masters = on_ranks(world, |comm| {
            let config = config.clone().with_master_placement(Device);
            let (_model, runtime) = shard_on(&init, config, comm);
            runtime.device_master_bytes()
        });
        for (rank, h) in host.iter().enumerate() {
            let what = format!("{format:?} rank {rank}");
            assert_eq!(h.staged_bytes, 0, "{what}: host placement stages nothing");
            for (name, run) in [("masters", &masters), ("grads", &grads), ("both", &both)] {
                let r = &run[rank];
                assert_eq!(r.losses, h.losses, "{what} {name}");
                assert_params(&format!("{what} {name}"), &r.after, &h.after, 0.0, 0.0);
                assert_eq!(r.masters, h.masters, "{what} {name}: masters bitwise");
                // NdArray's device gradients are reduced on the host (not a CubeCL backend), so
                // the norm is summed in f64 from the same pieces either way.
                assert_eq!(r.norm.to_bits(), h.norm.to_bits(), "{what} {name}: norm");
            }
            // Host views of device masters: each step stages every master out and back; device
            // gradients: each micro-batch's gradients are read back once for the reduction.
            let on_device = device_masters[rank];
            assert!(on_device > 0);
            let steps = STEPS as u64;
            assert_eq!(masters[rank].staged_bytes, steps * 2 * on_device, "{what}");
            let grads_read = steps * MICRO as u64 * param_bytes;
            assert_eq!(grads[rank].staged_bytes, grads_read, "{what}");
            assert_eq!(
                both[rank].staged_bytes,
                steps * 2 * on_device + grads_read,
                "{what}"
            );
        }
    }
}

#[test]
fn device_placement_on_hsdp_and_ddp_meshes_steps_bitwise_like_host() {
    use Placement::{Device, Host};
    let init = sharded_net(&plain_net(42));
    for sharding in [Sharding::Hsdp, Sharding::Ddp] {
        for format in [RuntimeFormat::F32, RuntimeFormat::Mxfp8] {
            let config = config(Mesh::new(2, 2).unwrap(), sharding, format);
            let host = placed(&init, config.clone(), (Host, Host));
            let device = placed(&init, config, (Device, Device));
            for (rank, (h, d)) in host.iter().zip(&device).enumerate() {
                let what = format!("{sharding:?} {format:?} rank {rank}");
                assert_params(&what, &d.after, &h.after, 0.0, 0.0);
                assert_eq!(d.masters, h.masters, "{what}");
            }
        }
    }
}

#[test]
fn shard_and_master_bytes_are_the_plans_sizes() {
    use Placement::{Device, Host};
    let init = sharded_net(&plain_net(43));
    let meshes = [
        (flat(1), Sharding::Hierarchical),
        (flat(3), Sharding::Hierarchical),
        (flat(4), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hierarchical),
        (Mesh::new(2, 2).unwrap(), Sharding::Hsdp),
        (Mesh::new(2, 2).unwrap(), Sharding::Ddp),
    ];
    for (mesh, sharding) in meshes {
        for format in [
            RuntimeFormat::F32,
            RuntimeFormat::Bf16,
            RuntimeFormat::Mxfp8,
        ] {
            for placement in [Host, Device] {
                let config = config(mesh, sharding, format).with_master_placement(placement);
                let ranks = on_ranks(mesh.world_size(), |comm| {
                    let (_model, runtime) = shard_on(&init, config.clone(), comm);
                    let sizes = (
                        runtime.shard_bytes(),
                        runtime.master_bytes(),
                        runtime.device_master_bytes(),
                    );
                    (sizes, runtime.plan().clone())
                });
                let plan = &ranks[0].1;
                let what = format!("{mesh} {sharding:?} {format:?} masters on {placement:?}");
                // A runtime shard is `pieces_per_shard` pieces of every bucket, in the format's
                // bytes; the shard group's shards make up every bucket's buffer once.
                let shard: u64 = plan
                    .buckets()
                    .iter()
                    .map(|b| b.piece_bytes * plan.pieces_per_shard() as u64)
                    .sum();
                let buffers: u64 = (0..plan.buckets().len())
                    .map(|b| plan.buffer_bytes(b))
                    .sum();
                assert_eq!(shard * plan.runtime_shards() as u64, buffers, "{what}");
                // fp32 masters of this rank's piece: apart from the shard unless the shard is
                // them (f32 on the host).
                let masters = piece_bytes(plan);
                let (host, device) = match (placement, format) {
                    (Host, RuntimeFormat::F32) => (0, 0),
                    (Host, _) => (masters, 0),
                    (Device, _) => (0, masters),
                };
                for (rank, ((s, m, d), _)) in ranks.iter().enumerate() {
                    assert_eq!(*s, shard, "{what} rank {rank}: shard bytes");
                    assert_eq!(*m, host, "{what} rank {rank}: host master bytes");
                    assert_eq!(*d, device, "{what} rank {rank}: device master bytes");
                }
            }
        }
    }
}
