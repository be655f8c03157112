//! The device path above world 1: ranks that share the wgpu device gather, reduce and rebuild on
//! device buffers through the threads engine's peers collectives (`sshsdp_comm::peers`), against
//! the staged path (collectives through host memory) on the same device.

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
