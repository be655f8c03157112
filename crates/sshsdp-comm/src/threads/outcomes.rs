//! Per-rank outcomes of an in-process world folded into one result: the ranks' values, or one
//! error naming the first rank that failed (an error it returned, or its panic).

use std::fmt;

use super::{ThreadComm, ThreadsConfig, ThreadsWorld};
use crate::CommError;

/// Why [`ThreadsWorld::try_run`] failed: the world could not be created, or a rank failed.
#[derive(Debug, Clone, PartialEq)]
pub enum RankFailure {
    /// The world could not be created.
    World(CommError),
    /// Rank `rank` returned an error (its `Display`) or panicked (its message).
    Rank {
        /// The first failed rank, in rank order.
        rank: usize,
        /// What it returned or the panic's message.
        message: String,
        /// Whether it panicked rather than returned an error.
        panicked: bool,
    },
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankFailure::World(e) => write!(f, "the threads world could not start: {e}"),
            RankFailure::Rank {
                rank,
                message,
                panicked: true,
            } => write!(f, "rank {rank} panicked: {message}"),
            RankFailure::Rank { rank, message, .. } => write!(f, "rank {rank} failed: {message}"),
        }
    }
}

impl std::error::Error for RankFailure {}

impl ThreadsWorld {
    /// [`ThreadsWorld::run`] for a closure that returns a `Result`: every rank's value in rank
    /// order, or one error naming the rank that failed — the first that panicked, else the
    /// first in rank order that returned an error. (When one rank fails its peers usually fail
    /// too, with communication errors naming it.)
    pub fn try_run<R, E, F>(size: usize, config: ThreadsConfig, f: F) -> Result<Vec<R>, RankFailure>
    where
        R: Send,
        E: fmt::Display + Send,
        F: Fn(ThreadComm) -> Result<R, E> + Sync,
    {
        let outcomes = Self::run(size, config, f).map_err(RankFailure::World)?;
        let mut values = Vec::with_capacity(size);
        let mut failures = Vec::new();
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(Ok(value)) => values.push(value),
                Ok(Err(e)) => failures.push((rank, e.to_string(), false)),
                Err(payload) => failures.push((rank, panic_message(payload.as_ref()), true)),
            }
        }
        // A panic first: its peers then fail with communication errors that echo it.
        let first = failures
            .iter()
            .find(|(_, _, panicked)| *panicked)
            .or(failures.first());
        match first {
            Some((rank, message, panicked)) => Err(RankFailure::Rank {
                rank: *rank,
                message: message.clone(),
                panicked: *panicked,
            }),
            None => Ok(values),
        }
    }
}

/// A panic payload's message (`&str` or `String`), or a placeholder.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Collective;

    #[test]
    fn values_in_rank_order_or_the_failing_rank() {
        let ok = ThreadsWorld::try_run(3, ThreadsConfig::default(), |comm| {
            Ok::<_, String>(comm.rank() * 10)
        });
        assert_eq!(ok.unwrap(), vec![0, 10, 20]);
        let err = ThreadsWorld::try_run(3, ThreadsConfig::default(), |comm| {
            if comm.rank() == 1 {
                Err(format!("bad data on rank {}", comm.rank()))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "rank 1 failed: bad data on rank 1");
        let err = ThreadsWorld::try_run(2, ThreadsConfig::default(), |comm| {
            if comm.rank() == 1 {
                panic!("boom");
            }
            Ok::<_, String>(())
        })
        .unwrap_err();
        assert!(
            matches!(
                err,
                RankFailure::Rank {
                    rank: 1,
                    panicked: true,
                    ..
                }
            ),
            "{err}"
        );
    }
}
