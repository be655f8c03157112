//! The peers exchange (`sshsdp_comm::peers`) with host memory: its conformance suite and fault
//! cases at world 2, 3 and 4 on the threads engine's rendezvous, executed by a host-memory
//! executor of the plan — the same suite the backend runs on CubeCL device buffers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use half::bf16;
use sshsdp_comm::peers::conformance::{self, sum_units, Fault, FaultOp, PeerMemory, Spans};
use sshsdp_comm::peers::{PeerExchange, PeerOp};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::{Collective, CommError, CommResult, ElementKind, ReduceOp};

/// Host buffers, read and written whole under their lock (never two locks at once).
type HostBuffer = Arc<Mutex<Vec<u8>>>;

/// What a rank publishes: its send buffer and the unit its data starts at.
struct HostPost {
    buffer: HostBuffer,
    at: usize,
}

/// Runs a plan on host memory.
struct HostMemory;

impl PeerMemory for HostMemory {
    type Buffer = HostBuffer;

    fn buffer(&self, bytes: &[u8]) -> CommResult<HostBuffer> {
        Ok(Arc::new(Mutex::new(bytes.to_vec())))
    }

    fn read(&self, buffer: &HostBuffer) -> CommResult<Vec<u8>> {
        Ok(buffer.lock().unwrap().clone())
    }

    fn collective(
        &self,
        peers: &dyn PeerExchange,
        op: PeerOp<'_>,
        kind: ElementKind,
        count: usize,
        spans: Spans<'_, HostBuffer>,
    ) -> CommResult<()> {
        let rank = peers.peer_rank();
        let (send, send_at, recv, recv_at, in_place) = match spans {
            Spans::Apart { send, recv } => (send.0, send.1, recv.0, recv.1, false),
            Spans::InPlace(buffer, at) => {
                let (s, r) = op.in_place_offsets(rank, count, at);
                (buffer, s, buffer, r, true)
            }
        };
        let post = Arc::new(HostPost {
            buffer: send.clone(),
            at: send_at,
        });
        let mut call = peers.exchange(op, kind, count, post)?;
        let plan = call.plan(op, count, in_place)?;
        let unit = kind.bytes();
        let staged: Vec<(usize, Vec<u8>)> = {
            let posts = call.posts_as::<HostPost>()?;
            let read = |q: usize, from: usize, len: usize| {
                let p = posts[q];
                let at = (p.at + from) * unit;
                p.buffer.lock().unwrap()[at..at + len * unit].to_vec()
            };
            plan.transfers
                .iter()
                .map(|t| {
                    let parts = t.sources.iter().map(|&(q, from)| read(q, from, t.len));
                    let bytes = if t.sources.len() == 1 || !op.sums() {
                        parts.take(1).flatten().collect()
                    } else {
                        sum_units(kind, parts)
                    };
                    (t.at, bytes)
                })
                .collect()
        };
        if plan.write_after_all_read {
            call.all_read();
        }
        let mut recv = recv.lock().unwrap();
        for (at, bytes) in staged {
            let at = (recv_at + at) * unit;
            recv[at..at + bytes.len()].copy_from_slice(&bytes);
        }
        drop(recv);
        call.finish()
    }
}

fn config(timeout: Duration) -> ThreadsConfig {
    ThreadsConfig { timeout }
}

#[test]
fn the_peers_suite_passes_on_host_memory_at_world_2_to_4() {
    for size in 2..=4 {
        let results = ThreadsWorld::run(size, config(Duration::from_secs(30)), |comm| {
            let peers = comm
                .peers()
                .expect("the threads engine offers peers collectives");
            conformance::run_all(&HostMemory, peers)
        })
        .unwrap();
        for (rank, result) in results.into_iter().enumerate() {
            let result = result.expect("no rank panics");
            assert!(result.len() > 60, "{} cases", result.len());
            for (name, outcome) in result {
                assert_eq!(outcome, Ok(()), "world {size} rank {rank}: {name}");
            }
        }
    }
}

/// The reference rule the suite checks sums against is the threads engine's own reduction, bit
/// for bit (f32 and bf16).
#[test]
fn the_suite_sums_as_the_threads_engine_reduces() {
    let size = 3;
    let results = ThreadsWorld::run(size, config(Duration::from_secs(30)), |comm| {
        let x = |q: usize, i: usize| ((q * 7919 + i * 104_729) % 1000) as f32 / 3.7 - 130.0;
        let mine: Vec<f32> = (0..size * 11).map(|i| x(comm.rank(), i)).collect();
        let mut got = vec![0f32; 11];
        comm.reduce_scatter(&mine, &mut got, ReduceOp::Sum).unwrap();
        let parts = (0..size).map(|q| {
            (comm.rank() * 11..(comm.rank() + 1) * 11)
                .flat_map(|i| x(q, i).to_le_bytes())
                .collect::<Vec<u8>>()
        });
        let want = sum_units(ElementKind::F32, parts);
        let got_bytes: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut mine16: Vec<bf16> = mine.iter().map(|&v| bf16::from_f32(v)).collect();
        comm.all_reduce(&mut mine16, ReduceOp::Sum).unwrap();
        let parts16 = (0..size).map(|q| {
            (0..size * 11)
                .flat_map(|i| bf16::from_f32(x(q, i)).to_le_bytes())
                .collect::<Vec<u8>>()
        });
        let want16 = sum_units(ElementKind::Bf16, parts16);
        let got16: Vec<u8> = mine16.iter().flat_map(|v| v.to_le_bytes()).collect();
        (got_bytes == want, got16 == want16)
    })
    .unwrap();
    for r in results {
        assert_eq!(r.unwrap(), (true, true));
    }
}

#[test]
fn a_rank_that_never_arrives_fails_or_panics_is_an_error_on_every_rank_in_bound() {
    let timeout = Duration::from_millis(1500);
    for fault in [
        Fault::NeverArrives,
        Fault::FailsMidCall,
        Fault::PanicsMidCall,
    ] {
        for (size, op) in [(2, FaultOp::AllGather), (4, FaultOp::AllToAllV)] {
            let results = ThreadsWorld::run(size, config(timeout), |comm| {
                let peers = comm.peers().unwrap();
                conformance::fault(&HostMemory, peers, fault, op, timeout * 2)
            })
            .unwrap();
            assert_eq!(conformance::check_fault_outcomes(fault, results), Ok(()));
        }
    }
}

#[test]
fn ranks_calling_different_peers_collectives_get_a_mismatch() {
    let results = ThreadsWorld::run(2, config(Duration::from_secs(30)), |comm| {
        let peers = comm.peers().unwrap();
        let count = 3 + comm.rank();
        peers
            .exchange(PeerOp::AllGather, ElementKind::F32, count, Arc::new(()))
            .map(|_| ())
    })
    .unwrap();
    let outcomes: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert!(outcomes.iter().all(|r| r.is_err()), "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .any(|r| matches!(r, Err(CommError::Mismatch(_)))),
        "{outcomes:?}"
    );
}

/// An all-to-all-v whose sender and receiver disagree on a count is a mismatch naming the pair
/// on every rank, before anything moves.
#[test]
fn all_to_all_v_counts_that_disagree_are_a_mismatch_on_every_rank() {
    let results = ThreadsWorld::run(3, config(Duration::from_secs(30)), |comm| {
        let peers = comm.peers().unwrap();
        let send = vec![2; 3];
        // Rank 2 expects one unit too many from rank 0.
        let recv = match comm.rank() {
            2 => vec![3, 2, 2],
            _ => vec![2; 3],
        };
        let op = PeerOp::AllToAllV {
            send: &send,
            recv: &recv,
        };
        peers
            .exchange(op, ElementKind::F32, 0, Arc::new(()))
            .map(|_| ())
    })
    .unwrap();
    for r in results {
        match r.unwrap() {
            Err(CommError::Mismatch(e)) => assert!(
                e.contains("rank 0 sends 2 units to rank 2, which expects 3"),
                "{e}"
            ),
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
}
