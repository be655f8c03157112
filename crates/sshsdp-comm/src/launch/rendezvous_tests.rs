//! Unit tests of the rendezvous: one rank, limits, and small in-process rounds on threads
//! (the multi-process cases live in `tests/rendezvous.rs`).

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::rendezvous::*;
use super::wire::*;
use super::MasterAddr;
use crate::CommError;

/// A port free when picked, below Linux's ephemeral range (from 32768), so that no client
/// connection of a parallel test can take it as its source port before rank 0 binds it; tests
/// of this process get different ports (a counter).
fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = (std::process::id() % 600) * 20;
    for _ in 0..1000 {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = u16::try_from(20_000 + (base + k * 7) % 12_000).expect("below 32768");
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 20000 and 32000");
}

fn local(port: u16) -> MasterAddr {
    MasterAddr::new("127.0.0.1", port, "the test")
}

/// Runs `world` ranks on threads; rank 0 makes `make`'s bytes.
fn run_threads(
    port: u16,
    world: usize,
    timeout: Duration,
    make: fn() -> Result<Vec<u8>, String>,
) -> Vec<Result<Vec<u8>, CommError>> {
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                TcpRendezvous::new(local(port), rank, world, timeout)
                    .unwrap()
                    .agree(make)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn one_rank_calls_make_without_a_socket() {
    // The port is held by someone else: one rank never binds it.
    let held = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let rdzv = TcpRendezvous::new(local(port), 0, 1, Duration::from_millis(100)).unwrap();
    let mut calls = 0;
    let bytes = rdzv
        .agree(|| {
            calls += 1;
            Ok(vec![7; 128])
        })
        .unwrap();
    assert_eq!((bytes, calls), (vec![7; 128], 1));
    match rdzv.agree(|| Err("no NCCL".into())) {
        Err(CommError::Engine(m)) => assert!(m.contains("no NCCL"), "{m}"),
        other => panic!("{other:?}"),
    }
    match rdzv.agree(|| Ok(vec![0; MAX_PAYLOAD_BYTES + 1])) {
        Err(CommError::InvalidArgument(m)) => assert!(m.contains("at most"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_arguments() {
    let t = Duration::from_secs(1);
    for (rank, world, timeout, needle) in [
        (0, 0, t, "WORLD_SIZE"),
        (3, 3, t, "WORLD_SIZE=3"),
        (0, 2, Duration::ZERO, "timeout"),
        (0, 2, Duration::MAX, "timeout"),
    ] {
        match TcpRendezvous::new(local(1), rank, world, timeout) {
            Err(CommError::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn messages_round_trip_and_are_limited() {
    let hello = Message::Hello {
        rank: 3,
        world_size: 4,
        protocol_version: PROTOCOL_VERSION,
    };
    let bytes = bincode::serde::encode_to_vec(&hello, config()).unwrap();
    let back: Message = bincode::serde::decode_from_std_read(&mut &bytes[..], config()).unwrap();
    assert_eq!(back, hello);

    let big =
        bincode::serde::encode_to_vec(Message::Payload(vec![1; MAX_MESSAGE_BYTES + 10]), config())
            .unwrap();
    let r: Result<Message, _> = bincode::serde::decode_from_std_read(&mut &big[..], config());
    assert!(
        matches!(r, Err(bincode::error::DecodeError::LimitExceeded)),
        "{r:?}"
    );

    // A forged length of 2^64-1 bytes: refused without allocating it.
    let mut forged = vec![1u8]; // variant Payload
    forged.push(255); // varint marker for a u64
    forged.extend_from_slice(&u64::MAX.to_le_bytes());
    forged.extend_from_slice(&[0; 64]);
    let r: Result<Message, _> = bincode::serde::decode_from_std_read(&mut &forged[..], config());
    assert!(r.is_err(), "{r:?}");

    // The largest payload fits a message.
    let max =
        bincode::serde::encode_to_vec(Message::Payload(vec![255; MAX_PAYLOAD_BYTES]), config())
            .unwrap();
    assert!(max.len() <= MAX_MESSAGE_BYTES);
    // Failures are clipped to fit too.
    let long = CommError::Timeout {
        op: "rendezvous",
        after: Duration::from_secs(1),
        missing: (0..100_000).collect(),
    };
    let wire = Message::Failed(Failure::from_error(&long));
    assert!(
        bincode::serde::encode_to_vec(&wire, config())
            .unwrap()
            .len()
            <= MAX_MESSAGE_BYTES
    );
    let text = Failure::from_error(&CommError::PeerFailed("x".repeat(100_000)));
    assert!(
        bincode::serde::encode_to_vec(Message::Failed(text), config())
            .unwrap()
            .len()
            <= MAX_MESSAGE_BYTES
    );
}

#[test]
fn four_threads_agree_and_the_port_is_freed() {
    let port = free_port();
    let results = run_threads(port, 4, Duration::from_secs(5), || {
        Ok((0..128).map(|i| i as u8).collect())
    });
    for r in &results {
        assert_eq!(
            r.as_ref().unwrap(),
            &(0..128).map(|i| i as u8).collect::<Vec<_>>()
        );
    }
    // The listener is gone: the port can be bound again, and a second round works.
    drop(TcpListener::bind(("0.0.0.0", port)).unwrap());
    let again = run_threads(port, 2, Duration::from_secs(5), || Ok(vec![1, 2, 3]));
    assert!(
        again.iter().all(|r| r.as_deref() == Ok(&[1, 2, 3][..])),
        "{again:?}"
    );
}

#[test]
fn make_failure_reaches_every_thread() {
    let results = run_threads(free_port(), 3, Duration::from_secs(5), || {
        Err("out of ids".into())
    });
    for r in results {
        match r {
            Err(CommError::Engine(m)) => assert!(m.contains("out of ids"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn port_in_use_names_the_address() {
    let held = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let rdzv = TcpRendezvous::new(local(port), 0, 2, Duration::from_secs(1)).unwrap();
    match rdzv.agree(|| Ok(vec![])) {
        Err(CommError::Unavailable(m)) => assert!(m.contains(&format!("127.0.0.1:{port}")), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unreachable_rank_0_names_address_source_and_hint() {
    let port = free_port();
    let timeout = Duration::from_millis(400);
    let start = Instant::now();
    let r = TcpRendezvous::new(local(port), 1, 2, timeout)
        .unwrap()
        .agree(|| Ok(vec![]));
    let took = start.elapsed();
    match r {
        Err(CommError::PeerFailed(m)) => {
            assert!(m.contains(&format!("127.0.0.1:{port}")), "{m}");
            assert!(
                m.contains("the test") && m.contains("is rank 0 running"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(1),
        "{took:?}"
    );
}

#[test]
fn stray_connections_do_not_disturb_the_round() {
    let port = free_port();
    let timeout = Duration::from_secs(5);
    let start = |rank| {
        thread::spawn(move || {
            let rdzv = TcpRendezvous::new(local(port), rank, 3, timeout).unwrap();
            rdzv.agree(|| Ok(vec![9; 16]))
        })
    };
    let early = [start(0), start(1)];
    // A port scanner and a peer speaking garbage connect while rank 2 is still missing.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut strays = Vec::new();
    while strays.len() < 2 && Instant::now() < deadline {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let garbage: &[u8] = if strays.is_empty() {
                b""
            } else {
                b"\xff\xff\xffGET / HTTP/1.1\r\n"
            };
            s.write_all(garbage).unwrap();
            strays.push(s);
        } else {
            thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(strays.len(), 2, "rank 0 never listened");
    thread::sleep(Duration::from_millis(50));
    let late = start(2);
    for rank in early.into_iter().chain([late]) {
        assert_eq!(rank.join().unwrap(), Ok(vec![9; 16]));
    }
}
