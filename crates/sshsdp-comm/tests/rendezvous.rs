//! The TCP rendezvous across real local processes: this test binary re-runs itself as the
//! ranks (the `rendezvous_child` test, which does nothing unless its role variable is set),
//! and every case checks that every live rank finishes within the bound with the right
//! outcome. A child that overstays is killed and fails the test: nothing here can hang.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use sshsdp_comm::launch::{MasterAddr, TcpRendezvous};

/// `rank,world_size,host,port,timeout_ms,behaviour` for a child.
const ROLE: &str = "SSHSDP_RENDEZVOUS_TEST_ROLE";
/// Slack over the timeout for one `agree` (client grace, close grace, scheduling).
const SLACK: Duration = Duration::from_millis(1500);
/// Extra wall time for a child process (start-up of the test binary) before it is killed.
const SPAWN_SLACK: Duration = Duration::from_secs(10);

/// The child: plays one rank and prints `OUTCOME ok <ms> <hex>` or `OUTCOME err <ms> <msg>`.
#[test]
fn rendezvous_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let f: Vec<&str> = role.split(',').collect();
    let (rank, world, host, port, timeout_ms, behaviour) = (
        f[0].parse().unwrap(),
        f[1].parse().unwrap(),
        f[2],
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
        f[5],
    );
    let master = MasterAddr::new(host, port, "the test's role variable");
    let mut rdzv =
        TcpRendezvous::new(master, rank, world, Duration::from_millis(timeout_ms)).unwrap();
    if behaviour == "exit_after_hello" {
        rdzv = rdzv.exit_after_hello_for_tests(0);
    }
    let start = Instant::now();
    let result = rdzv.agree(|| match behaviour {
        "make_fails" => Err("the NCCL library is not installed (test)".into()),
        _ => Ok(pseudo_random_bytes(128)),
    });
    let ms = start.elapsed().as_millis();
    match result {
        Ok(bytes) => println!(
            "\nOUTCOME ok {ms} {}",
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
        Err(e) => println!("\nOUTCOME err {ms} {}", e.to_string().replace('\n', " ")),
    }
}

fn pseudo_random_bytes(n: usize) -> Vec<u8> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut x = (nanos.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// What one child reported.
#[derive(Debug)]
enum Outcome {
    Ok {
        ms: u64,
        hex: String,
    },
    Err {
        ms: u64,
        message: String,
    },
    /// No OUTCOME line (the child exited early on purpose, or crashed).
    Silent {
        status: Option<i32>,
        output: String,
    },
}

impl Outcome {
    fn err(&self) -> &str {
        match self {
            Outcome::Err { message, .. } => message,
            Outcome::Silent { status, output } => {
                panic!("expected an error; the child exited ({status:?}) without one:\n{output}")
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }
    fn ms(&self) -> u64 {
        match self {
            Outcome::Ok { ms, .. } | Outcome::Err { ms, .. } => *ms,
            Outcome::Silent { .. } => 0,
        }
    }
}

/// A port for one case's rank 0, free when picked. Taken below Linux's ephemeral range
/// (32768 up): a port the kernel handed out (`bind(0)`) could be handed out again, as the
/// source port of another case's client connection, before rank 0 binds it. Cases of this
/// process get different ports (a counter); a port another process holds is skipped.
fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = 20_000 + (std::process::id() % 600) * 20;
    for _ in 0..1000 {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = 20_000 + (base - 20_000 + k * 7) % 12_000;
        let port = u16::try_from(port).expect("below 32768");
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 20000 and 32000");
}

struct Rank<'a> {
    rank: usize,
    world: usize,
    host: &'a str,
    behaviour: &'a str,
}

fn rank(rank: usize, world: usize) -> Rank<'static> {
    Rank {
        rank,
        world,
        host: "127.0.0.1",
        behaviour: "normal",
    }
}

fn spawn(r: &Rank<'_>, port: u16, timeout: Duration) -> Child {
    let role = format!(
        "{},{},{},{port},{},{}",
        r.rank,
        r.world,
        r.host,
        timeout.as_millis(),
        r.behaviour
    );
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rendezvous_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Spawns the ranks (those at `late` after a delay), waits for all with a deadline (killing
/// them all and failing if it passes), and parses each outcome, in the order given.
fn run(ranks: &[Rank<'_>], late: &[usize], timeout: Duration) -> Vec<Outcome> {
    let port = free_port();
    let mut children: Vec<Option<Child>> = ranks.iter().map(|_| None).collect();
    for (i, r) in ranks.iter().enumerate() {
        if !late.contains(&r.rank) {
            children[i] = Some(spawn(r, port, timeout));
        }
    }
    if !late.is_empty() {
        thread::sleep(Duration::from_millis(300));
        for (i, r) in ranks.iter().enumerate() {
            if late.contains(&r.rank) {
                children[i] = Some(spawn(r, port, timeout));
            }
        }
    }
    let mut children: Vec<Child> = children.into_iter().map(Option::unwrap).collect();
    let deadline = Instant::now() + timeout + SLACK + SPAWN_SLACK;
    let mut statuses = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(statuses.iter_mut()) {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            for child in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            panic!(
                "rendezvous children still running after {:?}: killed",
                timeout + SLACK + SPAWN_SLACK
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
    let outcomes: Vec<Outcome> = children
        .iter_mut()
        .zip(statuses)
        .map(|(child, status)| {
            let mut out = String::new();
            let _ = child.stdout.take().unwrap().read_to_string(&mut out);
            let _ = child.stderr.take().unwrap().read_to_string(&mut out);
            parse(&out, status.and_then(|s| s.code()))
        })
        .collect();
    eprintln!("{outcomes:#?}");
    outcomes
}

fn parse(out: &str, status: Option<i32>) -> Outcome {
    let Some(line) = out
        .lines()
        .find_map(|l| l.split_once("OUTCOME ").map(|(_, rest)| rest))
    else {
        return Outcome::Silent {
            status,
            output: out.to_string(),
        };
    };
    let mut parts = line.splitn(3, ' ');
    let (kind, ms, rest) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap_or(""),
    );
    let ms = ms.parse().unwrap();
    match kind {
        "ok" => Outcome::Ok {
            ms,
            hex: rest.to_string(),
        },
        _ => Outcome::Err {
            ms,
            message: rest.to_string(),
        },
    }
}

fn assert_within(outcomes: &[Outcome], timeout: Duration) {
    let bound = (timeout + SLACK).as_millis() as u64;
    for (i, o) in outcomes.iter().enumerate() {
        assert!(
            o.ms() <= bound,
            "child {i} took {} ms > {bound} ms: {o:?}",
            o.ms()
        );
    }
}

const TIMEOUT: Duration = Duration::from_millis(2500);

#[test]
fn four_ranks_get_the_same_bytes() {
    // Rank 0 starts last: the others retry until it listens. Success never waits for the
    // bound, so a generous one costs nothing and keeps a loaded machine from failing it.
    let timeout = Duration::from_secs(20);
    let out = run(
        &[rank(0, 4), rank(1, 4), rank(2, 4), rank(3, 4)],
        &[0],
        timeout,
    );
    assert_within(&out, timeout);
    let hexes: Vec<&str> = out
        .iter()
        .map(|o| match o {
            Outcome::Ok { hex, .. } => hex.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(hexes[0].len(), 256, "128 bytes");
    assert!(hexes.iter().all(|h| *h == hexes[0]), "{hexes:?}");
}

#[test]
fn a_rank_that_never_arrives() {
    let out = run(&[rank(0, 4), rank(1, 4), rank(2, 4)], &[], TIMEOUT);
    assert_within(&out, TIMEOUT);
    assert!(
        out[0].err().contains("rendezvous timed out") && out[0].err().contains("[3]"),
        "{out:?}"
    );
    for o in &out[1..] {
        assert!(
            o.err().contains("[3]"),
            "clients hear which rank is missing: {o:?}"
        );
    }
}

#[test]
fn a_rank_with_another_world_size() {
    // Ranks 2 and 3 come late: rank 0 has failed already and tells them as they arrive.
    for late in [&[][..], &[2, 3]] {
        let out = run(
            &[rank(0, 4), rank(1, 3), rank(2, 4), rank(3, 4)],
            late,
            TIMEOUT,
        );
        assert_within(&out, TIMEOUT);
        for o in &out {
            let m = o.err();
            assert!(
                m.contains("rank 1 was launched with WORLD_SIZE=3, rank 0 with WORLD_SIZE=4"),
                "{out:?}"
            );
            assert!(
                o.ms() < TIMEOUT.as_millis() as u64,
                "told before the timeout: {o:?}"
            );
        }
    }
}

#[test]
fn unreachable_rank_0() {
    let timeout = Duration::from_millis(1500);
    let nowhere = Rank {
        host: "no-such-host.invalid",
        ..rank(2, 3)
    };
    let out = run(&[rank(1, 3), nowhere], &[], timeout);
    assert_within(&out, timeout);
    for (o, host) in out.iter().zip(["127.0.0.1:", "no-such-host.invalid:"]) {
        let m = o.err();
        assert!(
            m.contains(host) && m.contains("the test's role variable"),
            "{m}"
        );
        assert!(
            m.contains("is rank 0 running, is the port open, is MASTER_ADDR right?"),
            "{m}"
        );
        assert!(
            o.ms() + 100 >= timeout.as_millis() as u64,
            "gave up early: {o:?}"
        );
    }
}

#[test]
fn a_rank_that_dies_mid_exchange() {
    // With ranks 1 and 2 late, rank 3 dies while rank 0 still waits for hellos; else (most
    // likely) while rank 0 waits for acks.
    for late in [&[][..], &[1, 2]] {
        let dying = Rank {
            behaviour: "exit_after_hello",
            ..rank(3, 4)
        };
        let out = run(&[rank(0, 4), rank(1, 4), rank(2, 4), dying], late, TIMEOUT);
        assert!(
            matches!(
                out[3],
                Outcome::Silent {
                    status: Some(0),
                    ..
                }
            ),
            "{:?}",
            out[3]
        );
        assert_within(&out[..3], TIMEOUT);
        for o in &out[..3] {
            let m = o.err();
            assert!(
                m.contains("rank 3 disconnected from the rendezvous at 127.0.0.1:"),
                "{out:?}"
            );
            assert!(
                o.ms() < TIMEOUT.as_millis() as u64,
                "noticed before the timeout: {o:?}"
            );
        }
    }
}

#[test]
fn rank_0_make_fails() {
    let failing = Rank {
        behaviour: "make_fails",
        ..rank(0, 4)
    };
    let out = run(&[failing, rank(1, 4), rank(2, 4), rank(3, 4)], &[], TIMEOUT);
    assert_within(&out, TIMEOUT);
    for o in &out {
        assert!(
            o.err().contains("the NCCL library is not installed (test)"),
            "{out:?}"
        );
    }
}
