//! The configurations the table measures: the sharded modes at every world and the 2×2-mesh
//! modes at world 4, each with the mode its ratio is against.

use sshsdp::backend::{CopyMode, Placement};
use sshsdp::plan::{RuntimeFormat, Sharding};

/// A configuration of the sharded runs.
pub struct Mode {
    pub name: &'static str,
    pub sharding: Sharding,
    pub copy: CopyMode,
    pub format: RuntimeFormat,
    pub reshard: bool,
    /// Replicas of the mesh (1: flat).
    pub replicas: usize,
    /// Where masters and gradients live (and the optimizer state, with the optimizer on the
    /// model's backend).
    pub storage: Placement,
    /// Where the runtime shards live (`None`: the default, the host for the threads engine).
    pub shards: Option<Placement>,
    /// AdamW on the CPU (NdArray) over host views (`step_offloaded`): its state off the device.
    pub offload: bool,
    /// Burn's `BalancedCheckpointing` (activation checkpointing: memory-bound ops recomputed
    /// in backward) instead of keeping every activation.
    pub checkpointing: bool,
    /// Name of the mode this one's ratio is against.
    pub baseline: &'static str,
}

/// The 2×2-mesh rows, at world 4 only.
pub const MESH_MODES: [Mode; 2] = [
    Mode {
        name: "Fsdp2Style HSDP 2×2",
        sharding: Sharding::Hsdp,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 2,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style HSDP 2×2",
    },
    Mode {
        name: "SS-HSDP f32 2×2",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 2,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style HSDP 2×2",
    },
];

pub const MODES: [Mode; 9] = [
    Mode {
        name: "Ddp",
        sharding: Sharding::Ddp,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "Fsdp2Style",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP f32",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP f32 device storage",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: false,
        replicas: 1,
        storage: Placement::Device,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP bf16",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::Bf16,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "SS-HSDP MXFP8",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::Mxfp8,
        reshard: false,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style",
    },
    Mode {
        name: "Fsdp2Style reshard",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::Fsdp2Style,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style reshard",
    },
    Mode {
        name: "SS-HSDP f32 reshard",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: false,
        baseline: "Fsdp2Style reshard",
    },
    Mode {
        name: "SS-HSDP f32 reshard + activation checkpointing",
        sharding: Sharding::Hierarchical,
        copy: CopyMode::ZeroCopy,
        format: RuntimeFormat::F32,
        reshard: true,
        replicas: 1,
        storage: Placement::Host,
        shards: None,
        offload: false,
        checkpointing: true,
        baseline: "Fsdp2Style reshard",
    },
];
