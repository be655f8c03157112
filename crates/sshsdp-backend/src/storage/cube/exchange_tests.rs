//! The peers engine on device buffers (wgpu; lavapipe in CI): the conformance suite of
//! `sshsdp_comm::peers` — the one the host-memory executor passes — at world 2, 3 and 4, and its
//! fault cases, bounded.

use std::time::Duration;

use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::Runtime;
use sshsdp_comm::peers::conformance::{self, Fault, FaultOp, PeerMemory, Spans};
use sshsdp_comm::peers::{PeerExchange, PeerOp};
use sshsdp_comm::threads::{ThreadsConfig, ThreadsWorld};
use sshsdp_comm::{Collective, CommError, CommResult, ElementKind};

use super::exchange::{CubeBuffers, Span};
use crate::lanes::comm::{DeviceBuffers, DeviceGroup};

/// One rank's buffers on the shared wgpu device, used through its own thread's stream.
struct DeviceMemory {
    client: ComputeClient<WgpuRuntime>,
}

impl DeviceMemory {
    fn new() -> Self {
        Self {
            client: WgpuRuntime::client(&WgpuDevice::default()),
        }
    }
}

/// A device buffer and the bytes of it the suite uses (buffers are whole words).
struct Buffer {
    handle: Handle,
    len: usize,
}

impl PeerMemory for DeviceMemory {
    type Buffer = Buffer;

    fn buffer(&self, bytes: &[u8]) -> CommResult<Buffer> {
        let mut words = bytes.to_vec();
        words.resize(bytes.len().next_multiple_of(4).max(4), 0);
        Ok(Buffer {
            handle: self.client.create_from_slice(&words),
            len: bytes.len(),
        })
    }

    fn read(&self, buffer: &Buffer) -> CommResult<Vec<u8>> {
        let bytes = self
            .client
            .read_one(buffer.handle.clone())
            .map_err(|e| CommError::Engine(format!("{e:?}")))?;
        Ok(bytes[..buffer.len].to_vec())
    }

    fn collective(
        &self,
        peers: &dyn PeerExchange,
        op: PeerOp<'_>,
        kind: ElementKind,
        count: usize,
        spans: Spans<'_, Buffer>,
    ) -> CommResult<()> {
        let unit = kind.bytes() as u64;
        let span = |b: &Buffer, at: usize| Span {
            handle: b.handle.clone(),
            byte: at as u64 * unit,
        };
        let client = self.client.clone();
        let mut bufs = match spans {
            Spans::Apart { send, recv } => {
                CubeBuffers::apart(client, kind, span(send.0, send.1), span(recv.0, recv.1))
            }
            Spans::InPlace(buffer, at) => CubeBuffers::in_place(client, kind, span(buffer, at)),
        };
        bufs.run(DeviceGroup::Peers(peers), op, count)
    }
}

#[test]
fn the_peers_suite_passes_on_wgpu_device_buffers_at_world_2_to_4() {
    let config = ThreadsConfig {
        timeout: Duration::from_secs(120),
    };
    for size in 2..=4 {
        let results = ThreadsWorld::run(size, config, |comm| {
            let peers = comm
                .peers()
                .expect("the threads engine offers peers collectives");
            conformance::run_all(&DeviceMemory::new(), peers)
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

#[test]
fn a_rank_that_never_arrives_fails_or_panics_fails_every_device_rank_in_bound() {
    let timeout = Duration::from_secs(3);
    for fault in [
        Fault::NeverArrives,
        Fault::FailsMidCall,
        Fault::PanicsMidCall,
    ] {
        for op in [FaultOp::AllGather, FaultOp::AllToAllV] {
            let results = ThreadsWorld::run(2, ThreadsConfig { timeout }, |comm| {
                let peers = comm.peers().unwrap();
                conformance::fault(&DeviceMemory::new(), peers, fault, op, timeout * 2)
            })
            .unwrap();
            assert_eq!(
                conformance::check_fault_outcomes(fault, results),
                Ok(()),
                "{op:?}"
            );
        }
    }
}
