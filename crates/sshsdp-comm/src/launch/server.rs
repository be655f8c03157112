//! Rank 0's side of [`TcpRendezvous`](super::TcpRendezvous): accept, check hellos, hand out
//! the payload, collect acks, say go — or tell every rank why not.
//!
//! The listener is polled (non-blocking accepts every few milliseconds); each accepted
//! connection gets a reader thread that forwards its messages, or its end, over a channel, so
//! the main loop notices a rank that disconnects while it waits.

use std::io::{self, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use super::rendezvous::{make_payload, TcpRendezvous, PROTOCOL_VERSION};
use super::wire::{read_message, write_message, Failure, Message, ReadError};
use crate::{CommError, CommResult};

/// How often the listener is polled while ranks arrive.
const POLL: Duration = Duration::from_millis(10);
/// How long rank 0 waits, at the end, for the clients to close first (a clean TCP close).
const CLOSE_GRACE: Duration = Duration::from_millis(250);
/// Reader threads give up this long after the deadline even if nobody wakes them.
const READER_BACKSTOP: Duration = Duration::from_secs(2);

/// What a reader thread reports about its connection.
enum Event {
    Message(Message),
    /// The connection ended: `None` for a plain close or reset, else why.
    Closed(Option<String>),
}

/// One accepted connection.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    /// The rank it said hello as (in range of rank 0's world size).
    rank: Option<usize>,
    /// Its reader reported the end (or a write failed).
    closed: bool,
    acked: bool,
}

struct Server<'a> {
    rdzv: &'a TcpRendezvous,
    listener: TcpListener,
    deadline: Instant,
    conns: Vec<Conn>,
    tx: Sender<(usize, Event)>,
    rx: Receiver<(usize, Event)>,
    /// Ranks that said hello (index 0 unused).
    seen: Vec<bool>,
    /// After a failure: the message every connection gets, and the ranks told (or dead).
    failure: Option<Message>,
    told: Vec<bool>,
}

/// Serves the rendezvous as rank 0 until it completes or fails; the listener is closed on
/// return.
pub(super) fn serve(
    rdzv: &TcpRendezvous,
    deadline: Instant,
    make: impl FnOnce() -> Result<Vec<u8>, String>,
) -> CommResult<Vec<u8>> {
    let listener = bind(rdzv)?;
    let (tx, rx) = mpsc::channel();
    let mut server = Server {
        rdzv,
        listener,
        deadline,
        conns: Vec::new(),
        tx,
        rx,
        seen: vec![false; rdzv.world_size],
        failure: None,
        told: vec![false; rdzv.world_size],
    };
    let result = server.run(make);
    server.close();
    result
}

fn bind(rdzv: &TcpRendezvous) -> CommResult<TcpListener> {
    let host = rdzv
        .master
        .host
        .trim_start_matches('[')
        .trim_end_matches(']');
    let any = match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let unavailable = |e: io::Error| {
        CommError::Unavailable(format!(
            "rank 0 could not listen for the rendezvous at {} (port {} on all interfaces; address \
             from {}): {e}; if the port is in use (another job, or torchrun's own store on \
             MASTER_PORT), choose a free port with SSHSDP_RENDEZVOUS_PORT",
            rdzv.master, rdzv.master.port, rdzv.master.source
        ))
    };
    let listener = TcpListener::bind((any, rdzv.master.port)).map_err(unavailable)?;
    listener.set_nonblocking(true).map_err(unavailable)?;
    Ok(listener)
}

impl Server<'_> {
    fn run(&mut self, make: impl FnOnce() -> Result<Vec<u8>, String>) -> CommResult<Vec<u8>> {
        if let Err(e) = self.gather_hellos() {
            self.fail_all(&e);
            self.linger();
            return Err(e);
        }
        let exchanged = make_payload(make).and_then(|payload| self.exchange(payload));
        let payload = match exchanged {
            Ok(payload) => payload,
            Err(e) => {
                self.fail_all(&e);
                return Err(e);
            }
        };
        let mut missed = Vec::new();
        for i in 0..self.conns.len() {
            if let Some(rank) = self.conns[i].rank {
                if !self.send(i, &Message::Go) {
                    missed.push(rank);
                }
            }
        }
        if missed.is_empty() {
            Ok(payload)
        } else {
            Err(CommError::PeerFailed(format!(
                "ranks {missed:?} disconnected from the rendezvous at {} after their ack, before \
                 the go-ahead reached them; the other ranks went ahead",
                self.rdzv.master
            )))
        }
    }

    /// Waits until every other rank said a valid hello.
    fn gather_hellos(&mut self) -> CommResult<()> {
        let mut hellos = 0;
        while hellos < self.rdzv.world_size - 1 {
            self.accept_pending();
            let now = Instant::now();
            if now >= self.deadline {
                return Err(self.timeout(|server, rank| server.seen[rank]));
            }
            match self.rx.recv_timeout(POLL.min(self.deadline - now)) {
                Ok((
                    i,
                    Event::Message(Message::Hello {
                        rank,
                        world_size,
                        protocol_version,
                    }),
                )) => {
                    if let Err(e) = self.hello(i, rank, world_size, protocol_version) {
                        // Its connection hears the failure with the others: it need not return.
                        if let Some(r) = usize::try_from(rank).ok().filter(|&r| r < self.told.len())
                        {
                            self.told[r] = true;
                        }
                        return Err(e);
                    }
                    hellos += 1;
                }
                Ok((i, event)) => self.unexpected(i, event, "hellos")?,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
        }
        Ok(())
    }

    /// Checks one hello and records its rank.
    fn hello(
        &mut self,
        i: usize,
        rank: u64,
        world_size: u64,
        protocol_version: u32,
    ) -> CommResult<()> {
        let ours = self.rdzv.world_size;
        let peer = self.conns[i].peer;
        let in_range = usize::try_from(rank).ok().filter(|&r| r > 0 && r < ours);
        if self.conns[i].rank.is_some() {
            return Err(CommError::Mismatch(format!(
                "rank {rank} (from {peer}) said hello twice"
            )));
        }
        if protocol_version != PROTOCOL_VERSION {
            return Err(CommError::Mismatch(format!(
                "rank {rank} (from {peer}) speaks rendezvous protocol {protocol_version}, rank 0 \
                 speaks {PROTOCOL_VERSION}: the ranks run different builds"
            )));
        }
        if world_size != ours as u64 {
            return Err(CommError::Mismatch(format!(
                "rank {rank} was launched with WORLD_SIZE={world_size}, rank 0 with \
                 WORLD_SIZE={ours}"
            )));
        }
        let Some(r) = in_range else {
            return Err(CommError::Mismatch(format!(
                "a process at {peer} says it is rank {rank} of WORLD_SIZE={ours}; rank 0 is this \
                 process, so the others must be 1..{ours}"
            )));
        };
        if self.seen[r] {
            return Err(CommError::Mismatch(format!(
                "two processes say they are rank {r} (the second from {peer})"
            )));
        }
        self.seen[r] = true;
        self.conns[i].rank = Some(r);
        Ok(())
    }

    /// Sends the payload to every rank and waits for every ack.
    fn exchange(&mut self, payload: Vec<u8>) -> CommResult<Vec<u8>> {
        let message = Message::Payload(payload.clone());
        for i in 0..self.conns.len() {
            if let Some(rank) = self.conns[i].rank {
                if !self.send(i, &message) {
                    return Err(self.disconnected(rank, None));
                }
            }
        }
        let mut acks = 0;
        while acks < self.rdzv.world_size - 1 {
            let now = Instant::now();
            if now >= self.deadline {
                return Err(self.timeout(|server, rank| {
                    server.conns.iter().any(|c| c.rank == Some(rank) && c.acked)
                }));
            }
            match self.rx.recv_timeout(self.deadline - now) {
                Ok((i, Event::Message(Message::Ack)))
                    if self.conns[i].rank.is_some() && !self.conns[i].acked =>
                {
                    self.conns[i].acked = true;
                    acks += 1;
                }
                Ok((i, event)) => self.unexpected(i, event, "acks")?,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
        }
        Ok(payload)
    }

    /// An event that is not what the phase waits for: an error if it comes from a rank.
    fn unexpected(&mut self, i: usize, event: Event, waiting_for: &str) -> CommResult<()> {
        let rank = self.conns[i].rank;
        match (event, rank) {
            (Event::Closed(why), Some(rank)) => {
                self.conns[i].closed = true;
                Err(self.disconnected(rank, why))
            }
            (Event::Message(m), Some(rank)) => Err(CommError::PeerFailed(format!(
                "rank {rank} sent {} while rank 0 waited for {waiting_for}: a protocol error",
                m.kind()
            ))),
            // A connection that never said hello is no rank: let it go.
            (Event::Closed(_), None) | (Event::Message(_), None) => {
                self.conns[i].closed = true;
                let _ = self.conns[i].stream.shutdown(std::net::Shutdown::Both);
                Ok(())
            }
        }
    }

    fn disconnected(&self, rank: usize, why: Option<String>) -> CommError {
        let why = why.map(|w| format!(" ({w})")).unwrap_or_default();
        CommError::PeerFailed(format!(
            "rank {rank} disconnected from the rendezvous at {} before it completed{why}",
            self.rdzv.master
        ))
    }

    /// The timeout error, naming the ranks for which `done` is false.
    fn timeout(&self, done: impl Fn(&Self, usize) -> bool) -> CommError {
        CommError::Timeout {
            op: "rendezvous",
            after: self.rdzv.timeout,
            missing: (1..self.rdzv.world_size)
                .filter(|&r| !done(self, r))
                .collect(),
        }
    }

    /// Accepts every pending connection and starts its reader; after a failure, tells it.
    fn accept_pending(&mut self) {
        while let Ok((stream, peer)) = self.listener.accept() {
            let i = self.conns.len();
            if self.start_reader(i, &stream).is_none() {
                continue;
            }
            self.conns.push(Conn {
                stream,
                peer,
                rank: None,
                closed: false,
                acked: false,
            });
            if let Some(failure) = self.failure.clone() {
                self.send(i, &failure);
            }
        }
    }

    /// Configures an accepted stream and starts the thread that reads it.
    /// The thread is left to end by itself (when the stream is shut down or at the backstop).
    fn start_reader(&self, i: usize, stream: &TcpStream) -> Option<()> {
        stream.set_nonblocking(false).ok()?;
        let _ = stream.set_nodelay(true);
        let clone = stream.try_clone().ok()?;
        let tx = self.tx.clone();
        let backstop = self.deadline + READER_BACKSTOP;
        thread::Builder::new()
            .name(format!("rendezvous-conn-{i}"))
            .stack_size(128 * 1024)
            .spawn(move || {
                let mut reader = BufReader::new(&clone);
                loop {
                    let event = match read_message(&mut reader, &clone, backstop) {
                        Ok(message) => Event::Message(message),
                        Err(ReadError::Closed) => Event::Closed(None),
                        Err(ReadError::TimedOut) => Event::Closed(Some("read timed out".into())),
                        Err(ReadError::Other(e)) => Event::Closed(Some(e)),
                    };
                    let end = matches!(event, Event::Closed(_));
                    if tx.send((i, event)).is_err() || end {
                        break;
                    }
                }
            })
            .ok()
            .map(drop)
    }

    /// Writes to connection `i`; false (and the connection marked closed) if that failed.
    fn send(&mut self, i: usize, message: &Message) -> bool {
        let conn = &mut self.conns[i];
        if conn.closed {
            return false;
        }
        let ok = write_message(&conn.stream, message, self.deadline).is_ok();
        conn.closed |= !ok;
        ok
    }

    /// Tells every connection (and, from now on, every new one) why the rendezvous failed.
    fn fail_all(&mut self, e: &CommError) {
        let failure = Message::Failed(Failure::from_error(e));
        for i in 0..self.conns.len() {
            self.send(i, &failure);
            if let Some(rank) = self.conns[i].rank {
                self.told[rank] = true;
            }
        }
        self.failure = Some(failure);
    }

    /// After a failure while ranks were arriving: answers late arrivals until every rank has
    /// been told (or is gone) or the deadline passes.
    fn linger(&mut self) {
        while (1..self.rdzv.world_size).any(|r| !self.told[r]) {
            self.accept_pending();
            let now = Instant::now();
            if now >= self.deadline {
                return;
            }
            match self.rx.recv_timeout(POLL.min(self.deadline - now)) {
                Ok((_, Event::Message(Message::Hello { rank, .. }))) => {
                    if let Some(r) = usize::try_from(rank).ok().filter(|&r| r < self.told.len()) {
                        self.told[r] = true;
                    }
                }
                Ok((i, Event::Closed(_))) => {
                    self.conns[i].closed = true;
                    if let Some(r) = self.conns[i].rank {
                        self.told[r] = true;
                    }
                }
                Ok((_, Event::Message(_))) | Err(_) => {}
            }
        }
    }

    /// Half-closes every connection, waits briefly for the clients to close first (so none of
    /// them sees a reset before reading the last message), then closes everything.
    fn close(mut self) {
        for conn in &self.conns {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        let grace = Instant::now() + CLOSE_GRACE;
        while self.conns.iter().any(|c| !c.closed) {
            let now = Instant::now();
            if now >= grace {
                break;
            }
            match self.rx.recv_timeout(grace - now) {
                Ok((i, Event::Closed(_))) => self.conns[i].closed = true,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        for conn in &self.conns {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        drop(self.listener);
    }
}
