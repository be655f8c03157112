//! The device path above world 1: ranks that share the wgpu device gather, reduce and rebuild on
//! device buffers through the threads engine's peers collectives (`sshsdp_comm::peers`), against
//! the staged path (collectives through host memory) on the same device.

use burn::backend::NdArray;
use sshsdp::backend::Placement;
use sshsdp::plan::RuntimeFormat;

use crate::harness::*;

/// With device masters, gradients and shards, a step of the device path moves no parameter or
/// gradient byte between host and device — at world 2, on a 2×2 mesh (hierarchical: each
/// shard rebuilt on the device from two replicas' pieces), at world 4, and on a 2×1 mesh (one
/// shard per group: a gather hands out the shard's own buffer) — where the staged path reads
/// shards and gradients back and uploads what the host collectives return; both train alike.
#[test]
fn the_device_path_moves_no_parameter_or_gradient_bytes_between_host_and_device() {
    let none = Checkpoints::default();
    for (mesh, format) in [
        ((1, 2), RuntimeFormat::Mxfp8),
        ((2, 2), RuntimeFormat::Bf16),
        ((1, 4), RuntimeFormat::F32),
        ((2, 1), RuntimeFormat::Mxfp8),
    ] {
        let device = Case {
            mesh,
            placement: (Placement::Device, Placement::Device),
            ..Case::new(format)
        };
        let staged = Case {
            staged: true,
            shards: Some(Placement::Device),
            ..device
        };
        let on_device = run::<Wgpu>(device, 0..2, none, Default::default());
        let through_host = run::<Wgpu>(staged, 0..2, none, Default::default());
        let what = format!("{format:?}, mesh {mesh:?}");
        eprintln!(
            "{what}: (uploaded, downloaded) bytes of a step: device path {:?}, staged {:?}; \
             losses {:?} / {:?}",
            on_device.traffic, through_host.traffic, on_device.losses, through_host.losses
        );
        assert!(on_device.on_device && on_device.shards.1, "{what}");
        assert!(!through_host.on_device && through_host.shards.1, "{what}");
        assert_eq!(
            on_device.traffic,
            (0, 4),
            "{what}: the gradient norm's f32 only"
        );
        assert!(
            through_host.traffic.0 > 0 && through_host.traffic.1 > 0,
            "{what}"
        );
        assert_eq!(on_device.gathered, through_host.gathered, "{what}");
        let tolerance = match format {
            RuntimeFormat::F32 => 1e-5,
            _ => 2e-3,
        };
        for (a, b) in on_device.losses.iter().zip(&through_host.losses) {
            assert!((a - b).abs() <= tolerance * b.abs(), "{what}: {a} vs {b}");
        }
    }
}

/// Distributed Muon, the default optimizer, on the device path: at world 1 (the verdict read at
/// commit), 2 and 2×2 a step reads nothing back but the gradient norm's 4 bytes, and the
/// optimizer itself neither reads nor uploads (momentum, Newton–Schulz and the split matrices'
/// exchange stay on device buffers: the peers engine's all-to-all-v above world 1); it trains like
/// Muon on NdArray over host views of the same model (`step_offloaded`: the host path) and like
/// `Hsdp<NdArray>` with host storage, with a matrix cut by a piece boundary at world 2.
#[test]
fn device_muon_reads_nothing_back_and_trains_like_host_muon() {
    let none = Checkpoints::default();
    for mesh in [(1, 1), (1, 2), (2, 2)] {
        let device = Case {
            mesh,
            optim: Opt::Muon,
            placement: (Placement::Device, Placement::Device),
            // Small buckets: pieces cut through matrices above world 1.
            bucket: Some(3000),
            ..Case::new(RuntimeFormat::F32)
        };
        let offloaded = Case {
            optim: Opt::MuonOnCpu,
            placement: (Placement::Host, Placement::Host),
            ..device
        };
        let what = format!("mesh {mesh:?}");
        let on_device = run::<Wgpu>(device, 0..5, none, Default::default());
        let on_host = run::<Wgpu>(offloaded, 0..5, none, Default::default());
        let cpu = run::<NdArray<f32>>(offloaded, 0..5, none, Default::default());
        eprintln!(
            "{what}: device Muon's last step: (uploaded, downloaded) {:?}, host reads {}, \
             optimizer {:?}; offloaded Muon: {:?}, {}, {:?}",
            on_device.traffic,
            on_device.reads,
            on_device.optimizer_traffic,
            on_host.traffic,
            on_host.reads,
            on_host.optimizer_traffic
        );
        assert_eq!(on_device.traffic, (0, 4), "{what}: the gradient norm only");
        assert_eq!(on_device.reads, 1, "{what}");
        assert!(on_device.optimizer_traffic.is_empty(), "{what}");
        // Above world 1 a matrix is cut by a piece boundary: the peers engine's all-to-all-v
        // took its slices to its owner and back on device buffers, as many as the host path.
        assert_eq!(on_device.exchanged.0 > 0, mesh.1 > 1, "{what}");
        assert_eq!(on_device.exchanged.1 > 0, mesh.1 > 1, "{what}");
        assert_eq!(on_device.exchanged, on_host.exchanged, "{what}");
        assert!(
            on_host.optimizer_traffic.reads > 0,
            "{what}: the host path reads"
        );
        for step in 0..5 {
            let (a, b, c) = (
                on_device.losses[step],
                on_host.losses[step],
                cpu.losses[step],
            );
            assert!(
                (a - b).abs() <= 1e-5 * b.abs() && (a - c).abs() <= 1e-5 * c.abs(),
                "{what} step {step}: device {a}, offloaded {b}, NdArray {c}"
            );
        }
        let (a, b) = (on_device.weights_by_path(), cpu.weights_by_path());
        let distance = relative_distance(&a, &b);
        assert!(distance <= 1e-4, "{what}: weights {distance}");
    }
}

/// A rank that gives up its update while its peer waits in the update group's device
/// all-reduce or all-to-all-v (the peers engine on device buffers, as Muon's exchanges of split
/// matrices use them): the peer gets an error within the engine's bound, not a hang, and both
/// runtimes fail.
#[test]
fn a_rank_abandoning_its_update_fails_the_peer_in_the_device_exchanges() {
    for all_to_all in [false, true] {
        abandon_during_exchange(all_to_all);
    }
}

fn abandon_during_exchange(all_to_all: bool) {
    use burn::backend::Autodiff;
    use burn::tensor::{Tensor, TensorPrimitive};
    use sshsdp::backend::{shard, Hsdp, HsdpConfig, HsdpError, Views};
    use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
    use sshsdp::comm::Collective;
    use sshsdp::models::Gpt;
    use sshsdp::plan::Mesh;
    use std::time::{Duration, Instant};
    type A = Autodiff<Hsdp<Wgpu>>;
    let record = initial_record();
    let start = Instant::now();
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    let outcomes = ThreadsWorld::run(2, config, |comm| {
        let device = Default::default();
        let rank = comm.rank();
        let model: Gpt<A> = crate::common::loaded(&device, record, |d| CONFIG.init(d));
        let config = HsdpConfig::new(Mesh::flat(2).unwrap())
            .with_master_placement(Placement::Device)
            .with_grad_placement(Placement::Device);
        let (model, runtime) = shard::<A, _, _>(model, config, comm, &device).unwrap();
        let tokens = crate::common::tokens::<A>(&CONFIG, 0, rank * 4, 4, &device);
        let _ = model.loss(tokens).backward();
        let mut update = runtime.begin_update(Views::AsStored).unwrap().unwrap();
        assert!(runtime.collectives_on_device());
        if rank == 1 {
            // Gives up before the all-reduce its peer makes.
            let e = update.abandon(HsdpError::Failed("rank 1 gives up".into()));
            return Err(e.to_string());
        }
        let (_, group) = update.parts();
        let ones = Tensor::<Wgpu, 1>::ones([64], &device)
            .into_primitive()
            .tensor();
        let summed = match all_to_all {
            false => group.all_reduce_sum_tensor::<Wgpu>(ones, &device),
            true => group
                .exchange_tensor::<Wgpu>(vec![vec![], vec![ones]], &[0, 64], &device)
                .map(|(t, _)| t),
        };
        let summed = summed.map(|t| Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(t)));
        let outcome = match summed {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        let committed = update.commit();
        assert!(committed.is_err(), "rank 0's step cannot commit");
        outcome
    })
    .unwrap();
    let elapsed = start.elapsed();
    let outcomes: Vec<_> = outcomes.into_iter().map(|o| o.expect("no panic")).collect();
    eprintln!("{outcomes:?} after {elapsed:?}");
    assert!(outcomes[1].is_err());
    assert!(
        outcomes[0].is_err(),
        "rank 0's exchange must fail (all-to-all: {all_to_all}): {:?}",
        outcomes[0]
    );
    assert!(elapsed < Duration::from_secs(60), "bounded: {elapsed:?}");
}
