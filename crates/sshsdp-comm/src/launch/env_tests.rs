//! Unit tests of [`super::env`]: every launcher, precedence, defaults and malformed values.

use std::collections::HashMap;

use super::env::*;
use crate::CommError;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

fn launch(pairs: &[(&str, &str)]) -> Option<LaunchEnv> {
    LaunchEnv::from_vars(vars(pairs)).unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
}

fn invalid(pairs: &[(&str, &str)]) -> String {
    match LaunchEnv::from_vars(vars(pairs)) {
        Err(CommError::InvalidArgument(m)) => m,
        other => panic!("{pairs:?}: expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn nothing_set_is_none() {
    assert_eq!(launch(&[]), None);
    assert_eq!(launch(&[("RANK", "1")]), None, "RANK alone is not a launch");
    assert_eq!(
        launch(&[("RANK", ""), ("WORLD_SIZE", "")]),
        None,
        "blank counts as unset"
    );
}

#[test]
fn torchrun() {
    let env = launch(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node07"),
        ("MASTER_PORT", "1234"),
    ])
    .unwrap();
    assert_eq!(env.launcher, Launcher::Torchrun);
    assert_eq!((env.rank, env.world_size, env.local_rank), (5, 8, 1));
    let master = env.master.unwrap();
    assert_eq!(master.to_string(), "node07:1234");
    assert_eq!(master.source, "MASTER_ADDR/MASTER_PORT");

    let env = launch(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
    ])
    .unwrap();
    assert_eq!(env.local_rank, 3, "LOCAL_RANK defaults to the rank");
    let master = env.master.unwrap();
    assert_eq!(master.port, 29500);
    assert!(master.source.contains("29500"), "{}", master.source);

    let env = launch(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "1")]).unwrap();
    assert_eq!(env.master, None, "no MASTER_ADDR, no master");
    assert_eq!(Launcher::Torchrun.name(), "torchrun");
}

#[test]
fn open_mpi_and_mpich() {
    let env = launch(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
        ("MASTER_ADDR", "head"),
    ])
    .unwrap();
    assert_eq!(env.launcher, Launcher::OpenMpi);
    assert_eq!((env.rank, env.world_size, env.local_rank), (2, 4, 2));
    assert_eq!(
        env.master, None,
        "MPI: master only when both variables are exported"
    );

    let env = launch(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "16"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "4000"),
    ])
    .unwrap();
    assert_eq!(env.launcher, Launcher::Mpich);
    assert_eq!((env.rank, env.world_size, env.local_rank), (3, 16, 0));
    assert_eq!(env.master.unwrap().to_string(), "head:4000");
    let env = launch(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "16"),
        ("MPI_LOCALRANKID", "3"),
    ])
    .unwrap();
    assert_eq!(env.local_rank, 3);
}

#[test]
fn slurm_srun_step() {
    let base = [
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_JOB_NODELIST", "gpu[01-04]"),
        ("SLURM_JOB_ID", "123456"),
    ];
    let env = launch(&base).unwrap();
    assert_eq!(env.launcher, Launcher::Slurm);
    assert_eq!((env.rank, env.world_size, env.local_rank), (6, 8, 2));
    let master = env.master.unwrap();
    assert_eq!(master.to_string(), "gpu01:32956");
    assert!(
        master
            .source
            .contains("SLURM_JOB_NODELIST (gpu[01-04] → gpu01)"),
        "{}",
        master.source
    );
    assert!(
        master.source.contains("SLURM_JOB_ID % 10000"),
        "{}",
        master.source
    );

    let mut exported = base.to_vec();
    exported.extend([("MASTER_ADDR", "login2"), ("MASTER_PORT", "7777")]);
    let master = launch(&exported).unwrap().master.unwrap();
    assert_eq!(master.to_string(), "login2:7777");
    assert!(
        master.source.contains("MASTER_ADDR exported"),
        "{}",
        master.source
    );

    let env = launch(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEPID", "1"),
        ("SLURM_NODELIST", "rack[3-4]-n[7-8]"),
    ])
    .unwrap();
    assert_eq!(env.local_rank, 0);
    assert_eq!(env.master.unwrap().to_string(), "rack3-n7:29500");

    let no_list = launch(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
    ]);
    assert_eq!(no_list.unwrap().master, None);
}

#[test]
fn slurm_batch_script_outside_srun_is_not_a_launch() {
    assert_eq!(
        launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_ID", "9")
        ]),
        None
    );
}

#[test]
fn precedence() {
    let slurm = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
    ];
    let pmi = [("PMI_RANK", "3"), ("PMI_SIZE", "4")];
    let ompi = [("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "6")];
    let torch = [("RANK", "7"), ("WORLD_SIZE", "8")];
    let all: Vec<_> = [&slurm[..], &pmi, &ompi, &torch].concat();
    assert_eq!(launch(&all).unwrap().launcher, Launcher::Torchrun);
    assert_eq!(launch(&all[..7]).unwrap().launcher, Launcher::OpenMpi);
    assert_eq!(launch(&all[..5]).unwrap().launcher, Launcher::Mpich);
    assert_eq!(launch(&all[..3]).unwrap().launcher, Launcher::Slurm);
}

#[test]
fn malformed_values_name_the_variable() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("RANK", "one"), ("WORLD_SIZE", "4")], "RANK=\"one\""),
        (&[("RANK", "-1"), ("WORLD_SIZE", "4")], "RANK=\"-1\""),
        (&[("RANK", "4"), ("WORLD_SIZE", "4")], "WORLD_SIZE=4"),
        (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=\"0\""),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "x")],
            "LOCAL_RANK",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "2")],
            "LOCAL_RANK",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "70000"),
            ],
            "MASTER_PORT=\"70000\"",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "0"),
            ],
            "MASTER_PORT",
        ),
        (
            &[("OMPI_COMM_WORLD_RANK", "9"), ("OMPI_COMM_WORLD_SIZE", "4")],
            "OMPI_COMM_WORLD_RANK",
        ),
        (&[("PMI_RANK", "0"), ("PMI_SIZE", "4.5")], "PMI_SIZE"),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_JOB_NODELIST", "gpu[01-"),
            ],
            "SLURM_JOB_NODELIST=\"gpu[01-\"",
        ),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NODELIST", "a"),
                ("SLURM_JOB_ID", "j1"),
            ],
            "SLURM_JOB_ID",
        ),
    ];
    let empty_list = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_NODELIST", ""),
    ];
    assert!(invalid(&empty_list).contains("SLURM_JOB_NODELIST=\"\""));
    for (pairs, needle) in cases {
        let m = invalid(pairs);
        assert!(m.contains(needle), "{pairs:?}: {m:?} lacks {needle:?}");
    }
}

#[test]
fn node_local_rank_order() {
    assert_eq!(node_local_rank_from(vars(&[])), None);
    assert_eq!(
        node_local_rank_from(vars(&[("SLURM_LOCALID", "3")])),
        Some(3)
    );
    assert_eq!(
        node_local_rank_from(vars(&[("SLURM_LOCALID", "3"), ("MPI_LOCALRANKID", "2")])),
        Some(2)
    );
    let all = [
        ("SLURM_LOCALID", "3"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("LOCAL_RANK", "0"),
    ];
    assert_eq!(node_local_rank_from(vars(&all)), Some(0));
    assert_eq!(
        node_local_rank_from(vars(&[("LOCAL_RANK", "x"), ("SLURM_LOCALID", "5")])),
        Some(5)
    );
}

#[test]
fn local_device_wraps_over_visible_gpus() {
    for (local_rank, visible, device) in [
        (0, 1, 0),
        (3, 1, 0),
        (7, 1, 0),
        (9, 1, 0),
        (0, 4, 0),
        (3, 4, 3),
        (7, 4, 3),
        (9, 4, 1),
        (0, 8, 0),
        (3, 8, 3),
        (7, 8, 7),
        (9, 8, 1),
    ] {
        assert_eq!(
            local_device(local_rank, visible).unwrap(),
            device,
            "{local_rank} of {visible}"
        );
    }
    // CUDA_VISIBLE_DEVICES=0 with LOCAL_RANK=3: the process sees one GPU and uses it.
    let local = node_local_rank_from(vars(&[("CUDA_VISIBLE_DEVICES", "0"), ("LOCAL_RANK", "3")]));
    assert_eq!(local_device(local.unwrap(), 1).unwrap(), 0);
    match local_device(2, 0) {
        Err(CommError::Unavailable(m)) => assert!(m.contains("no GPU is visible"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn ipv6_master_displays_in_brackets() {
    assert_eq!(MasterAddr::new("::1", 80, "test").to_string(), "[::1]:80");
}

#[test]
fn torchruns_agent_keeps_master_port_and_the_port_can_be_overridden() {
    let torchrun = [
        ("RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    // Exported by hand: MASTER_PORT itself.
    let plain = LaunchEnv::from_vars(vars(&torchrun)).unwrap().unwrap();
    assert_eq!(plain.master.unwrap().to_string(), "node0:29500");
    // Under torchrun's agent, whose store holds MASTER_PORT: the next port, said so.
    let mut agent = torchrun.to_vec();
    agent.push(("TORCHELASTIC_RUN_ID", "none"));
    let master = LaunchEnv::from_vars(vars(&agent))
        .unwrap()
        .unwrap()
        .master
        .unwrap();
    assert_eq!(master.to_string(), "node0:29501");
    assert!(
        master.source.contains("MASTER_PORT + 1"),
        "{}",
        master.source
    );
    // SSHSDP_RENDEZVOUS_PORT wins everywhere.
    agent.push(("SSHSDP_RENDEZVOUS_PORT", "40000"));
    let master = LaunchEnv::from_vars(vars(&agent))
        .unwrap()
        .unwrap()
        .master
        .unwrap();
    assert_eq!(master.to_string(), "node0:40000");
    assert!(master.source.contains("SSHSDP_RENDEZVOUS_PORT"));
    agent.pop();
    agent.push(("SSHSDP_RENDEZVOUS_PORT", "many"));
    assert!(matches!(
        LaunchEnv::from_vars(vars(&agent)),
        Err(CommError::InvalidArgument(_))
    ));
}
