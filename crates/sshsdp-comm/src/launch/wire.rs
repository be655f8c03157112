//! The rendezvous's messages and their framing: a serde enum encoded with bincode 2, each
//! message at most [`MAX_MESSAGE_BYTES`], every read and write bounded by a deadline.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::rendezvous::MAX_MESSAGE_BYTES;
use crate::CommError;

/// Least time given to one write, even past the deadline (final messages are tiny).
const WRITE_FLOOR: Duration = Duration::from_millis(100);
/// Longest text a failure carries over the wire; the longest list of missing ranks.
const MAX_WIRE_TEXT: usize = 4096;
const MAX_WIRE_MISSING: usize = 1024;

/// The messages of the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Message {
    Hello {
        rank: u64,
        world_size: u64,
        protocol_version: u32,
    },
    Payload(Vec<u8>),
    Ack,
    Go,
    Failed(Failure),
}

impl Message {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::Payload(_) => "Payload",
            Message::Ack => "Ack",
            Message::Go => "Go",
            Message::Failed(_) => "Failed",
        }
    }
}

/// A [`CommError`] as rank 0 sends it to the other ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Failure {
    Timeout { after_ms: u64, missing: Vec<u64> },
    Mismatch(String),
    PeerFailed(String),
    InvalidArgument(String),
    Engine(String),
}

fn clip(text: &str) -> String {
    match text.char_indices().nth(MAX_WIRE_TEXT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

impl Failure {
    pub(super) fn from_error(e: &CommError) -> Self {
        match e {
            CommError::Timeout { after, missing, .. } => Failure::Timeout {
                after_ms: u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
                missing: missing
                    .iter()
                    .take(MAX_WIRE_MISSING)
                    .map(|&r| r as u64)
                    .collect(),
            },
            CommError::Mismatch(m) => Failure::Mismatch(clip(m)),
            CommError::PeerFailed(m) => Failure::PeerFailed(clip(m)),
            CommError::InvalidArgument(m) => Failure::InvalidArgument(clip(m)),
            CommError::Unavailable(m) | CommError::Engine(m) => Failure::Engine(clip(m)),
        }
    }

    pub(super) fn into_error(self) -> CommError {
        match self {
            Failure::Timeout { after_ms, missing } => CommError::Timeout {
                op: "rendezvous",
                after: Duration::from_millis(after_ms),
                missing: missing
                    .into_iter()
                    .map(|r| usize::try_from(r).unwrap_or(usize::MAX))
                    .collect(),
            },
            Failure::Mismatch(m) => CommError::Mismatch(m),
            Failure::PeerFailed(m) => CommError::PeerFailed(m),
            Failure::InvalidArgument(m) => CommError::InvalidArgument(m),
            Failure::Engine(m) => CommError::Engine(m),
        }
    }
}

/// bincode's standard configuration, limited to [`MAX_MESSAGE_BYTES`] per message.
pub(super) fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MESSAGE_BYTES>()
}

/// Why reading a message failed.
#[derive(Debug)]
pub(super) enum ReadError {
    /// The deadline passed.
    TimedOut,
    /// The peer closed or reset the connection.
    Closed,
    /// Anything else: an I/O error or bytes that are no message.
    Other(String),
}

pub(super) fn classify(e: &io::Error) -> ReadError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ReadError::TimedOut,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => ReadError::Closed,
        _ => ReadError::Other(e.to_string()),
    }
}

fn left(deadline: Instant, floor: Duration) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(floor)
}

/// Reads one message from `reader` (over `stream`), giving up at `deadline`.
pub(super) fn read_message(
    reader: &mut impl Read,
    stream: &TcpStream,
    deadline: Instant,
) -> Result<Message, ReadError> {
    stream
        .set_read_timeout(Some(left(deadline, Duration::from_millis(1))))
        .map_err(|e| classify(&e))?;
    bincode::serde::decode_from_std_read(reader, config()).map_err(|e| match e {
        bincode::error::DecodeError::Io { inner, .. } => classify(&inner),
        other => ReadError::Other(format!("malformed message: {other}")),
    })
}

/// Writes one message to `stream`, giving up at `deadline` (or after [`WRITE_FLOOR`]).
pub(super) fn write_message(
    stream: &TcpStream,
    message: &Message,
    deadline: Instant,
) -> io::Result<()> {
    let bytes = bincode::serde::encode_to_vec(message, config()).map_err(io::Error::other)?;
    stream.set_write_timeout(Some(left(deadline, WRITE_FLOOR)))?;
    let mut writer = stream;
    writer.write_all(&bytes)?;
    writer.flush()
}
