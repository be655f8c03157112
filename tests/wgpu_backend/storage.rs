//! Device storage, runtime shards, CPU offload and checkpoints on `Hsdp<Wgpu>` against host
//! storage and against `Hsdp<NdArray>`.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::Backend;
use sshsdp::backend::{shard, Hsdp, HsdpConfig, Placement, Precision};
use sshsdp::comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp::models::Gpt;
use sshsdp::plan::{Mesh, RuntimeFormat, Sharding};

use crate::harness::*;

#[test]
fn device_masters_and_gradients_on_wgpu_train_bitwise_like_host_ones() {
    use Placement::{Device, Host};
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        // Staged: the path of engines that move host memory only (MPI), whose transfers this
        // test counts; the device path moves none (`the_device_path_moves_…`).
        let staged = |placement| Case {
            placement,
            staged: true,
            ..Case::new(format)
        };
        let none = Checkpoints::default();
        let steps = 0..3;
        let host = run::<Wgpu>(
            staged((Host, Host)),
            steps.clone(),
            none,
            Default::default(),
        );
        let device = run::<Wgpu>(staged((Device, Device)), steps, none, Default::default());
        assert!(!host.on_device && !device.on_device);
        assert_eq!(host.losses, device.losses, "{format:?}");
        assert_eq!(host.weights, device.weights, "{format:?}");
        assert!(device.losses[2] < device.losses[0], "{device:?}");
        assert_eq!(
            device.master_bytes.0, 0,
            "{format:?}: no master on the host"
        );
        assert!(device.master_bytes.1 > 0, "{format:?}");
        assert_eq!(host.master_bytes.1, 0, "{format:?}");
        // Host↔device bytes of a step: both upload the gathered buckets and download every
        // gradient once; device storage also uploads each piece's reduced gradient and
        // downloads each updated piece once for the host collectives that rebuild the shards:
        // the runtime bytes encoded on the device (bf16, MXFP8), or the master itself (f32,
        // whose runtime elements are the masters). (With host masters the optimizer's own
        // copies to its device are not the runtime's to count.)
        let m = device.master_bytes.1;
        let encoded = match format {
            RuntimeFormat::F32 => m,
            _ => device.piece_bytes,
        };
        eprintln!(
            "{format:?}: (uploaded, downloaded) host {:?}, device {:?}, masters {m}, encoded \
             pieces {encoded}",
            host.traffic, device.traffic
        );
        // (Device gradients are reduced from the device: the shard lane reads the members'
        // gradients back, as the host placement reads each one, and the replica lane uploads
        // the reduced piece; their norm is summed on the device, one f32 read back per step.)
        assert_eq!(device.traffic.0, host.traffic.0 + m, "{format:?}");
        assert_eq!(device.traffic.1, host.traffic.1 + encoded + 4, "{format:?}");
        if format != RuntimeFormat::F32 {
            assert!(
                2 * encoded < m + m / 10,
                "{format:?}: about half the master or less"
            );
        }
    }
}

/// Runtime shards in device memory train bitwise like host shards (device masters and
/// gradients both ways) in every format, on the staged path (collectives through the host, as
/// engines that move host memory only run them): on a flat mesh, where each update's piece
/// encoded on the device becomes the shard, and on a 2 × 2 mesh, whose shards are rebuilt from
/// two replicas' pieces (through the host), with and without resharding (MXFP8 then reads one
/// pass's part of the shard). Staged, a gather reads
/// this rank's part of the shard back and a rebuild moves the rebuilt shard up and this rank's
/// piece down; a host shard instead reads each piece's encoded bytes back once per update.
#[test]
fn device_runtime_shards_on_wgpu_train_bitwise_like_host_shards() {
    let device_storage = (Placement::Device, Placement::Device);
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        for (mesh, reshard) in [((1, 2), false), ((2, 2), false), ((1, 2), true)] {
            let on_host = Case {
                mesh,
                reshard,
                placement: device_storage,
                staged: true,
                ..Case::new(format)
            };
            let on_device = Case {
                shards: Some(Placement::Device),
                ..on_host
            };
            let none = Checkpoints::default();
            let host = run::<Wgpu>(on_host, 0..3, none, Default::default());
            let device = run::<Wgpu>(on_device, 0..3, none, Default::default());
            let what = format!("{format:?}, mesh {mesh:?}, reshard {reshard}");
            // Staged, by default the shards stay on the host.
            assert_eq!(host.shards, (device.shards.0, false), "{what}");
            assert!(device.shards.1, "{what}");
            assert_eq!(device.losses, host.losses, "{what}");
            assert_eq!(device.weights, host.weights, "{what}");
            // The same gathers; each reads this rank's part back (the bytes a peer receives
            // from it: what this rank receives, over the other shards).
            assert_eq!(device.gathered, host.gathered, "{what}");
            let parts = device.gathered.1 / (mesh.1 as u64 - 1);
            let rebuilt = if mesh.0 > 1 { device.shards.0 } else { 0 };
            let (up, down) = host.traffic;
            assert_eq!(
                device.traffic,
                (up + rebuilt, down - host.piece_bytes + parts + rebuilt / 2),
                "{what}: (up, down) bytes of a step ({} gathers)",
                device.gathered.0
            );
        }
    }
}

/// Runtime shards on the device need device masters (each update encodes its piece from the
/// device master) and a CubeCL backend: anything else is a clear error at `shard`.
#[test]
fn device_runtime_shards_without_device_masters_or_a_cubecl_backend_are_refused() {
    fn shard_error<I: Backend>(masters: Placement) -> String {
        let record = initial_record();
        let errors = ThreadsWorld::run(1, ThreadsConfig::default(), |comm| {
            let device = I::Device::default();
            let model: Gpt<Autodiff<Hsdp<I>>> =
                crate::common::loaded(&device, record, |d| CONFIG.init(d));
            let config = HsdpConfig::new(Mesh::flat(1).unwrap())
                .with_master_placement(masters)
                .with_shard_placement(Placement::Device);
            match shard::<Autodiff<Hsdp<I>>, _, _>(model, config, comm, &device) {
                Ok(_) => "sharded".to_string(),
                Err(e) => e.to_string(),
            }
        })
        .unwrap();
        errors.into_iter().next().unwrap().unwrap()
    }
    let host_masters = shard_error::<Wgpu>(Placement::Host);
    assert!(
        host_masters.contains("with_master_placement"),
        "{host_masters}"
    );
    let on_ndarray = shard_error::<NdArray<f32>>(Placement::Device);
    assert!(on_ndarray.contains("CubeCL backend"), "{on_ndarray}");
}

/// MXFP8 with small buckets (each matrix a bucket of its own, vectors grouped) on Wgpu, host
/// and device storage, at world 1 and 2, trains like NdArray.
#[test]
fn mxfp8_in_many_buckets_on_wgpu_trains_like_ndarray() {
    for mesh in [(1, 1), (1, 2)] {
        for placement in [
            (Placement::Host, Placement::Host),
            (Placement::Device, Placement::Device),
        ] {
            let case = Case {
                mesh,
                placement,
                bucket: Some(5000),
                ..Case::new(RuntimeFormat::Mxfp8)
            };
            let none = Checkpoints::default();
            let cpu_case = Case {
                placement: (Placement::Host, Placement::Host),
                ..case
            };
            let cpu = run::<NdArray<f32>>(cpu_case, 0..3, none, Default::default());
            let gpu = run::<Wgpu>(case, 0..3, none, Default::default());
            eprintln!(
                "{case:?}\n  NdArray {:?}\n  Wgpu    {:?}",
                cpu.losses, gpu.losses
            );
            for (step, (a, b)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-3 * b.abs(),
                    "{case:?} step {step}: Wgpu {a} vs NdArray {b}"
                );
            }
        }
    }
}

/// The configurations of the pairwise subset: every pair of values of format (f32, bf16, MXFP8)
/// × mesh (flat 2, flat 4, 2×2) × sharding (hierarchical, HSDP) × optimizer (AdamW, Muon)
/// appears in at least one, from the orthogonal array L9(3⁴) (sharding and optimizer are its
/// 3-level columns folded onto 2 levels), reshard after forward alternating: 9 runs instead of
/// the full 72 (`SSHSDP_WGPU_MATRIX=full` runs the 24 of format × optimizer × flat 2 / 2×2 ×
/// reshard).
fn pairwise() -> Vec<Case> {
    use RuntimeFormat::{Bf16, Mxfp8, F32};
    const L9: [[usize; 4]; 9] = [
        [0, 0, 0, 0],
        [0, 1, 1, 1],
        [0, 2, 2, 2],
        [1, 0, 1, 2],
        [1, 1, 2, 0],
        [1, 2, 0, 1],
        [2, 0, 2, 1],
        [2, 1, 0, 2],
        [2, 2, 1, 0],
    ];
    L9.iter()
        .enumerate()
        .map(|(row, &[f, m, s, o])| {
            let format = [F32, Bf16, Mxfp8][f];
            Case {
                format,
                mesh: [(1, 2), (1, 4), (2, 2)][m],
                sharding: [
                    Sharding::Hierarchical,
                    Sharding::Hsdp,
                    Sharding::Hierarchical,
                ][s],
                optim: [Opt::AdamW, Opt::Muon, Opt::AdamW][o],
                reshard: row % 2 == 1,
                ..Case::new(format)
            }
        })
        .collect()
}

/// Every combination of the pairwise subset's values.
fn full_matrix() -> Vec<Case> {
    let mut cases = Vec::new();
    for format in [
        RuntimeFormat::F32,
        RuntimeFormat::Bf16,
        RuntimeFormat::Mxfp8,
    ] {
        for optim in [Opt::AdamW, Opt::Muon] {
            for mesh in [(1, 2), (2, 2)] {
                for reshard in [false, true] {
                    cases.push(Case {
                        optim,
                        mesh,
                        reshard,
                        ..Case::new(format)
                    });
                }
            }
        }
    }
    cases
}

/// Steps of each configuration of the matrix.
const MATRIX_STEPS: usize = 5;

/// CPU offload: AdamW on NdArray over host views of a `Hsdp<Wgpu>` model's host masters
/// (its state never on the device) trains like AdamW on the device, and like NdArray
/// throughout, in f32 and MXFP8.
#[test]
fn adamw_on_the_cpu_under_a_wgpu_model_trains_like_adamw_on_the_device() {
    for format in [RuntimeFormat::F32, RuntimeFormat::Mxfp8] {
        let on_device = Case::new(format);
        let on_cpu = Case {
            optim: Opt::AdamWOnCpu,
            ..on_device
        };
        let none = Checkpoints::default();
        let gpu = run::<Wgpu>(on_device, 0..MATRIX_STEPS, none, Default::default());
        let offloaded = run::<Wgpu>(on_cpu, 0..MATRIX_STEPS, none, Default::default());
        let cpu = run::<NdArray<f32>>(on_device, 0..MATRIX_STEPS, none, Default::default());
        let tolerance = match format {
            RuntimeFormat::F32 => 1e-5,
            _ => 2e-3,
        };
        for step in 0..MATRIX_STEPS {
            let (a, b, c) = (offloaded.losses[step], gpu.losses[step], cpu.losses[step]);
            assert!(
                (a - b).abs() <= tolerance * b.abs() && (a - c).abs() <= tolerance * c.abs(),
                "{format:?} step {step}: offloaded {a}, on the device {b}, NdArray {c}"
            );
        }
        assert!(offloaded.losses[MATRIX_STEPS - 1] < offloaded.losses[0]);
    }
}

#[test]
fn device_storage_on_wgpu_trains_like_host_storage_on_ndarray_pairwise() {
    let cases = match std::env::var("SSHSDP_WGPU_MATRIX").as_deref() {
        Ok("full") => full_matrix(),
        _ => pairwise(),
    };
    let device_storage = (Placement::Device, Placement::Device);
    for case in cases {
        let cpu = run::<NdArray<f32>>(
            case,
            0..MATRIX_STEPS,
            Checkpoints::default(),
            Default::default(),
        );
        let gpu_case = Case {
            placement: device_storage,
            ..case
        };
        let gpu = run::<Wgpu>(
            gpu_case,
            0..MATRIX_STEPS,
            Checkpoints::default(),
            Default::default(),
        );
        eprintln!(
            "{case:?}\n  NdArray {:?}\n  Wgpu    {:?}",
            cpu.losses, gpu.losses
        );
        assert_eq!(gpu.master_bytes.0, 0, "{case:?}: no master on the host");
        // The ranks share the wgpu device: collectives on device buffers, shards there too.
        assert!(gpu.on_device && gpu.shards.1 && !cpu.on_device, "{case:?}");
        // f32 differs by the backends' float kernels only; bf16 and MXFP8 round the weights,
        // where one ulp of difference in a master can move a value across a rounding boundary.
        let tolerance = match case.format {
            RuntimeFormat::F32 => 1e-5,
            _ => 2e-3,
        };
        for (step, (a, b)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
            assert!(
                (a - b).abs() <= tolerance * b.abs(),
                "{case:?} step {step}: Wgpu {a} vs NdArray {b}"
            );
        }
        assert!(
            gpu.losses[MATRIX_STEPS - 1] < gpu.losses[0],
            "{case:?}: {gpu:?}"
        );
    }
}

#[test]
fn a_checkpoint_of_device_storage_at_world_2_resumes_at_world_1_on_any_backend() {
    let case = Case {
        placement: (Placement::Device, Placement::Device),
        ..Case::new(RuntimeFormat::Mxfp8)
    };
    let dir = std::env::temp_dir().join(format!("sshsdp-wgpu-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (save, resume) = (3, 5);
    let first = run::<Wgpu>(
        case,
        0..save,
        Checkpoints {
            save: Some(&dir),
            ..Default::default()
        },
        Default::default(),
    );
    assert!(
        first.on_device && first.shards.1,
        "the device path at world 2"
    );
    let alone = Case {
        mesh: (1, 1),
        ..case
    };
    let resumed = run::<Wgpu>(
        alone,
        save..resume,
        Checkpoints {
            resume: Some(&dir),
            ..Default::default()
        },
        Default::default(),
    );
    // The checkpoint of the fused run does not depend on the backend that wrote it: it
    // resumes on `CubeBackend` without fusion and on NdArray (host storage) too.
    let resuming = Checkpoints {
        resume: Some(&dir),
        ..Default::default()
    };
    let unfused = run::<WgpuUnfused>(alone, save..resume, resuming, Default::default());
    let on_host = Case {
        placement: (Placement::Host, Placement::Host),
        ..alone
    };
    let ndarray = run::<NdArray<f32>>(on_host, save..resume, resuming, Default::default());
    let straight = run::<Wgpu>(case, 0..resume, Checkpoints::default(), Default::default());
    std::fs::remove_dir_all(&dir).unwrap();
    // The weights go through the checkpoint bit for bit (masters, re-derived at world 1),
    // whatever backend reads them.
    assert_eq!(resumed.initial, first.weights);
    assert_eq!(unfused.initial, first.weights);
    assert_eq!(ndarray.initial, first.weights);
    // MXFP8 on another backend: one ulp in a master can cross a rounding boundary (2e-3,
    // `fusion.rs`).
    for (other, what) in [(&unfused, "without fusion"), (&ndarray, "on NdArray")] {
        for (step, (a, b)) in other
            .losses
            .iter()
            .zip(&straight.losses[save..])
            .enumerate()
        {
            assert!(
                (a - b).abs() <= 2e-3 * b.abs(),
                "step {}: resumed {what} {a} vs straight {b}",
                save + step
            );
        }
    }
    // The optimizer state too: the resumed run goes on as the run that never stopped (the
    // same global batch; one rank averages it in another order than two).
    eprintln!(
        "resumed {:?}\nstraight {:?}",
        resumed.losses, straight.losses
    );
    for (step, (a, b)) in resumed
        .losses
        .iter()
        .zip(&straight.losses[save..])
        .enumerate()
    {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "step {}: resumed at world 1 {a} vs straight at world 2 {b}",
            save + step
        );
    }
}

#[test]
fn f16_compute_on_wgpu_with_device_storage_trains_like_f32_compute() {
    for format in [RuntimeFormat::Mxfp8, RuntimeFormat::F32] {
        // Staged: the uploads compared below are the staged path's (the device path has none).
        let case = |compute| Case {
            placement: (Placement::Device, Placement::Device),
            reshard: true,
            compute,
            staged: true,
            ..Case::new(format)
        };
        let f32 = run::<Wgpu>(
            case(Precision::F32),
            0..STEPS,
            Checkpoints::default(),
            Default::default(),
        );
        let f16 = run::<Wgpu>(
            case(Precision::F16),
            0..STEPS,
            Checkpoints::default(),
            Default::default(),
        );
        for (s, (a, b)) in f16.losses.iter().zip(&f32.losses).enumerate() {
            assert!(
                a.is_finite() && (a - b).abs() <= 0.02 * b.abs(),
                "{format:?} step {s}: {a} in f16 against {b} in f32 ({:?} vs {:?})",
                f16.losses,
                f32.losses
            );
        }
        assert!(
            f16.losses[STEPS - 1] < f16.losses[0] - 0.1,
            "{:?}",
            f16.losses
        );
        // The policy took effect: f16 arithmetic rounds differently.
        assert_ne!(f16.losses, f32.losses);
        // Gathered MXFP8 bytes are uploaded as they are and decoded (then cast) on the device;
        // an f32 bucket is narrowed on the host and uploaded in f16: fewer bytes.
        let (up16, up32) = (f16.traffic.0, f32.traffic.0);
        match format {
            RuntimeFormat::F32 => assert!(up16 < up32, "{up16} vs {up32}"),
            _ => assert_eq!(up16, up32),
        }
    }
}
