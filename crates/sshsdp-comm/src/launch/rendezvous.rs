//! One round of agreement over TCP, like PyTorch's `TCPStore`: rank 0 makes some bytes (an
//! NCCL unique id) and every rank receives them, or every rank gets an error.
//!
//! Rank 0 listens on the master's port (on all interfaces) and every other rank connects to
//! `host:port`, retrying every 100 ms until the timeout because rank 0 may start later. The
//! messages are a serde enum framed with bincode 2, each at most [`MAX_MESSAGE_BYTES`] so that
//! an untrusted peer cannot make us allocate much:
//!
//! 1. each client sends `Hello { rank, world_size, protocol_version }`; rank 0 checks that the
//!    world size and protocol equal its own and that the rank is in range and not yet seen;
//! 2. once every rank has said hello, rank 0 calls `make` and sends `Payload(bytes)` to all;
//! 3. every client replies `Ack`; once all acks are in, rank 0 sends `Go`;
//! 4. clients return the payload only on `Go`.
//!
//! The two-phase end means that a rank dying mid-exchange (before `Go`) turns into an error on
//! every live rank instead of half the ranks going on into NCCL's initialisation and hanging
//! there. Rank 0 notices a client that disconnects while it waits (each accepted connection
//! has a reader thread) and tells every connected rank `Failed(reason)`; clients turn the
//! reason into the same [`CommError`] variant rank 0 returns. If a failure happens while ranks
//! are still arriving, rank 0 keeps answering late arrivals with the reason until every rank
//! has been told or the timeout expires, so no rank is left with a bare "unreachable".
//!
//! Every blocking call has a deadline: `agree` returns within the timeout plus about half a
//! second on every rank (clients wait that long past their timeout for rank 0's verdict, which
//! names the missing ranks). A `Go` that reaches only some ranks (a rank dying between its ack
//! and the go-ahead) is the one failure rank 0 can report but not prevent.

use std::io::{BufReader, Read};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::env::{LaunchEnv, MasterAddr};
use super::wire::{classify, read_message, write_message, Message, ReadError};
use crate::{CommError, CommResult};

/// Version of the message format; ranks with different versions refuse each other.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest encoded message either side accepts.
pub const MAX_MESSAGE_BYTES: usize = 65536;
/// Largest payload `make` may return (the rest of [`MAX_MESSAGE_BYTES`] is framing).
pub const MAX_PAYLOAD_BYTES: usize = 60 * 1024;
/// How long a client waits past its timeout for rank 0's verdict.
pub const CLIENT_GRACE: Duration = Duration::from_millis(500);

/// Pause between connection attempts of a client.
const RETRY: Duration = Duration::from_millis(100);

/// One round of agreement on some bytes between the ranks of a job, over TCP.
///
/// Only one [`agree`](Self::agree) per value is meant; rank 0's listening socket lives only
/// during that call.
#[derive(Debug, Clone)]
pub struct TcpRendezvous {
    pub(super) master: MasterAddr,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) timeout: Duration,
    exit_after_hello: Option<i32>,
}

impl TcpRendezvous {
    /// A rendezvous of `world_size` ranks at `master`, this process being `rank`; `agree`
    /// returns within `timeout` (plus [`CLIENT_GRACE`] on clients) whatever happens.
    pub fn new(
        master: MasterAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> CommResult<Self> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument(
                "a rendezvous needs WORLD_SIZE of at least 1".into(),
            ));
        }
        if rank >= world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let far_enough = timeout
            .checked_add(CLIENT_GRACE)
            .and_then(|t| t.checked_add(Duration::from_secs(60)))
            .and_then(|t| Instant::now().checked_add(t));
        if timeout.is_zero() || far_enough.is_none() {
            return Err(CommError::InvalidArgument(format!(
                "rendezvous timeout {timeout:?} is zero or too large"
            )));
        }
        Ok(Self {
            master,
            rank,
            world_size,
            timeout,
            exit_after_hello: None,
        })
    }

    /// [`new`](Self::new) from the launch environment; an error if it names no master
    /// (set `MASTER_ADDR` and `MASTER_PORT`).
    pub fn from_launch(env: &LaunchEnv, timeout: Duration) -> CommResult<Self> {
        let master = env.master.clone().ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "the {} launch names no rendezvous address: export MASTER_ADDR and MASTER_PORT",
                env.launcher
            ))
        })?;
        Self::new(master, env.rank, env.world_size, timeout)
    }

    /// Where rank 0 serves.
    pub fn master(&self) -> &MasterAddr {
        &self.master
    }

    /// Test hook: a client exits the process with `code` right after sending its hello.
    #[doc(hidden)]
    pub fn exit_after_hello_for_tests(mut self, code: i32) -> Self {
        self.exit_after_hello = Some(code);
        self
    }

    /// Agrees on bytes: rank 0 calls `make` once every rank has arrived and every rank returns
    /// its bytes. Rank 0's `Err(reason)`, a missing, mismatched or dead rank, or an unreachable
    /// rank 0 is an error on every rank. With one rank: `make()`, without any socket.
    pub fn agree(&self, make: impl FnOnce() -> Result<Vec<u8>, String>) -> CommResult<Vec<u8>> {
        let start = Instant::now();
        let deadline = start + self.timeout; // checked in `new`
        if self.world_size == 1 {
            make_payload(make)
        } else if self.rank == 0 {
            super::server::serve(self, deadline, make)
        } else {
            self.client(deadline)
        }
    }

    fn client(&self, connect_deadline: Instant) -> CommResult<Vec<u8>> {
        let deadline = connect_deadline + CLIENT_GRACE;
        let stream = self.connect(connect_deadline)?;
        let _ = stream.set_nodelay(true);
        let hello = Message::Hello {
            rank: self.rank as u64,
            world_size: self.world_size as u64,
            protocol_version: PROTOCOL_VERSION,
        };
        self.send(&stream, &hello, deadline)?;
        if let Some(code) = self.exit_after_hello {
            std::process::exit(code);
        }
        let mut reader = BufReader::new(&stream);
        let payload = match self.receive(&mut reader, &stream, deadline, "the payload")? {
            Message::Payload(bytes) => bytes,
            Message::Failed(failure) => return Err(failure.into_error()),
            other => return Err(self.unexpected(&other, "the payload")),
        };
        self.send(&stream, &Message::Ack, deadline)?;
        match self.receive(&mut reader, &stream, deadline, "the go-ahead")? {
            Message::Go => Ok(payload),
            Message::Failed(failure) => Err(failure.into_error()),
            other => Err(self.unexpected(&other, "the go-ahead")),
        }
    }

    fn connect(&self, deadline: Instant) -> CommResult<TcpStream> {
        let mut last = String::from("no attempt finished in time");
        loop {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match resolve(&self.master, deadline - now) {
                Ok(addrs) => {
                    for addr in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                            Ok(stream) => return Ok(stream),
                            Err(e) => last = format!("connecting to {addr}: {e}"),
                        }
                    }
                }
                Err(e) => last = e,
            }
            thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())));
        }
        Err(CommError::PeerFailed(format!(
            "rank {} could not reach rank 0's rendezvous at {} (address from {}) within {:?} \
             ({last}): is rank 0 running, is the port open, is MASTER_ADDR right?",
            self.rank, self.master, self.master.source, self.timeout
        )))
    }

    fn send(&self, stream: &TcpStream, message: &Message, deadline: Instant) -> CommResult<()> {
        write_message(stream, message, deadline).map_err(|e| match classify(&e) {
            ReadError::Closed => self.closed(),
            _ => CommError::PeerFailed(format!(
                "rank {} could not send {} to rank 0 at {}: {e}",
                self.rank,
                message.kind(),
                self.master
            )),
        })
    }

    fn receive(
        &self,
        reader: &mut impl Read,
        stream: &TcpStream,
        deadline: Instant,
        what: &str,
    ) -> CommResult<Message> {
        read_message(reader, stream, deadline).map_err(|e| match e {
            ReadError::Closed => self.closed(),
            ReadError::TimedOut => CommError::PeerFailed(format!(
                "rank {} heard nothing from rank 0 at {} within {:?} (+{CLIENT_GRACE:?}) while \
                 waiting for {what}: rank 0 is stuck, or started later and still waits for \
                 other ranks",
                self.rank, self.master, self.timeout
            )),
            ReadError::Other(e) => CommError::PeerFailed(format!(
                "rank {} could not read {what} from {} (address from {}): {e}; is something \
                 other than this job's rank 0 listening there?",
                self.rank, self.master, self.master.source
            )),
        })
    }

    fn closed(&self) -> CommError {
        CommError::PeerFailed(format!(
            "rank 0 closed the rendezvous at {} before it completed (rank 0 failed or was \
             killed; its own error says why)",
            self.master
        ))
    }

    fn unexpected(&self, message: &Message, what: &str) -> CommError {
        CommError::PeerFailed(format!(
            "rank {} got {} from rank 0 at {} while waiting for {what}: a protocol error",
            self.rank,
            message.kind(),
            self.master
        ))
    }
}

/// Calls `make` and checks its payload; the error every rank gets if it fails.
pub(super) fn make_payload(make: impl FnOnce() -> Result<Vec<u8>, String>) -> CommResult<Vec<u8>> {
    match make() {
        Ok(bytes) if bytes.len() <= MAX_PAYLOAD_BYTES => Ok(bytes),
        Ok(bytes) => Err(CommError::InvalidArgument(format!(
            "rank 0's rendezvous payload is {} bytes; the rendezvous carries at most \
             {MAX_PAYLOAD_BYTES}",
            bytes.len()
        ))),
        Err(reason) => Err(CommError::Engine(format!(
            "rank 0 could not make the rendezvous payload: {reason}"
        ))),
    }
}

/// The master's addresses; name resolution runs on a helper thread so that a resolver that
/// hangs cannot hold the caller past `within`.
fn resolve(master: &MasterAddr, within: Duration) -> Result<Vec<SocketAddr>, String> {
    let host = master
        .host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, master.port)]);
    }
    let (tx, rx) = mpsc::channel();
    let port = master.port;
    let lookup = host.clone();
    thread::Builder::new()
        .name("rendezvous-resolve".into())
        .spawn(move || {
            let _ = tx.send(
                (lookup.as_str(), port)
                    .to_socket_addrs()
                    .map(Iterator::collect::<Vec<_>>),
            );
        })
        .map_err(|e| format!("could not start name resolution: {e}"))?;
    match rx.recv_timeout(within) {
        Ok(Ok(addrs)) if !addrs.is_empty() => Ok(addrs),
        Ok(Ok(_)) => Err(format!("{host} resolves to no address")),
        Ok(Err(e)) => Err(format!("resolving {host}: {e}")),
        Err(_) => Err(format!("resolving {host} did not finish in time")),
    }
}
