//! Agreement between ranks: every rank's verdict of a checkpoint phase (ok or the reason it
//! failed, plus a file's size and SHA-256 or a checkpoint's identity) reaches every rank
//! through one all-gather over the world, so that all ranks take the same decision.
//!
//! A verdict travels as a fixed-size record (every rank of an all-gather passes the same
//! length); a failure's reason is cut to fit.

use burn::tensor::backend::Backend;
use sha2::{Digest, Sha256};
use sshsdp_backend::HsdpRuntime;

use crate::CheckpointError;

/// Bytes of one rank's record.
const RECORD: usize = 512;
/// Bytes before the reason: ok flag, size, tag, digest, reason length.
const HEAD: usize = 1 + 8 + 8 + 32 + 2;
const MAX_REASON: usize = RECORD - HEAD;

/// One rank's verdict of a checkpoint phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// `Err(reason)` when this rank failed the phase.
    pub(crate) outcome: Result<(), String>,
    /// A size in bytes (the rank's shard file), or 0.
    pub(crate) size: u64,
    /// A number all ranks should agree on (the step), or 0.
    pub(crate) tag: u64,
    /// A SHA-256 (the rank's shard file, or the manifest read), or zeros.
    pub(crate) digest: [u8; 32],
}

impl Verdict {
    /// Success, with no data.
    pub(crate) fn ok() -> Self {
        Self {
            outcome: Ok(()),
            size: 0,
            tag: 0,
            digest: [0; 32],
        }
    }

    /// This rank's verdict from a result (its error's message as the reason).
    pub(crate) fn of<T>(result: &Result<T, CheckpointError>) -> Self {
        let mut v = Self::ok();
        if let Err(e) = result {
            v.outcome = Err(e.to_string());
        }
        v
    }

    /// The SHA-256 of `bytes`, for the digest.
    pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
        Sha256::digest(bytes).into()
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD);
        out.push(u8::from(self.outcome.is_ok()));
        out.extend(self.size.to_le_bytes());
        out.extend(self.tag.to_le_bytes());
        out.extend(self.digest);
        let reason = match &self.outcome {
            Ok(()) => "",
            Err(reason) => truncate(reason, MAX_REASON),
        };
        out.extend((reason.len() as u16).to_le_bytes());
        out.extend(reason.as_bytes());
        out.resize(RECORD, 0);
        out
    }

    fn decode(record: &[u8]) -> Result<Self, String> {
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&record[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut digest = [0; 32];
        digest.copy_from_slice(&record[17..49]);
        let len = usize::from(u16::from_le_bytes([record[49], record[50]]));
        if len > MAX_REASON {
            return Err(format!("reason of {len} bytes"));
        }
        let reason = String::from_utf8_lossy(&record[HEAD..HEAD + len]).into_owned();
        Ok(Self {
            outcome: match record[0] {
                1 => Ok(()),
                0 => Err(reason),
                flag => return Err(format!("flag {flag}")),
            },
            size: u64_at(1),
            tag: u64_at(9),
            digest,
        })
    }
}

/// The longest prefix of `s` of at most `max` bytes ending on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Every rank's verdict of `phase`, in rank order. A collective call: every rank calls it,
/// whatever its own verdict.
pub(crate) fn gather<B: Backend>(
    runtime: &HsdpRuntime<B>,
    phase: &str,
    mine: &Verdict,
) -> Result<Vec<Verdict>, CheckpointError> {
    let all = runtime
        .all_gather_world(mine.encode())
        .map_err(CheckpointError::Runtime)?;
    if all.is_empty() || all.len() % RECORD != 0 {
        return Err(CheckpointError::Invalid(format!(
            "checkpoint {phase}: the agreement returned {} bytes",
            all.len()
        )));
    }
    all.chunks_exact(RECORD)
        .enumerate()
        .map(|(rank, record)| {
            Verdict::decode(record).map_err(|e| {
                CheckpointError::Invalid(format!(
                    "checkpoint {phase}: rank {rank}'s verdict is malformed ({e})"
                ))
            })
        })
        .collect()
}

/// The decision of `phase` from every rank's verdict: `Ok` when all succeeded; else this
/// rank's own error when it failed (`mine`), or [`CheckpointError::Ranks`] naming the ranks
/// that failed and why.
pub(crate) fn decide<T>(
    phase: &str,
    verdicts: &[Verdict],
    mine: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    let mine = mine?;
    let failures: Vec<(usize, String)> = verdicts
        .iter()
        .enumerate()
        .filter_map(|(rank, v)| v.outcome.clone().err().map(|reason| (rank, reason)))
        .collect();
    if failures.is_empty() {
        Ok(mine)
    } else {
        Err(CheckpointError::Ranks {
            phase: phase.to_owned(),
            failures,
        })
    }
}

/// `verdict` then [`decide`]: the collective outcome of a phase whose result here is `mine`.
pub(crate) fn agree<B: Backend, T>(
    runtime: &HsdpRuntime<B>,
    phase: &str,
    verdict: Verdict,
    mine: Result<T, CheckpointError>,
) -> Result<(T, Vec<Verdict>), CheckpointError> {
    let verdicts = gather(runtime, phase, &verdict)?;
    let value = decide(phase, &verdicts, mine)?;
    Ok((value, verdicts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_round_trip_in_fixed_records() {
        let ok = Verdict {
            outcome: Ok(()),
            size: 1 << 40,
            tag: 7,
            digest: Verdict::sha256(b"x"),
        };
        let long = "é".repeat(400);
        let failed = Verdict {
            outcome: Err(long.clone()),
            ..Verdict::ok()
        };
        for v in [&ok, &failed] {
            assert_eq!(v.encode().len(), RECORD);
        }
        assert_eq!(Verdict::decode(&ok.encode()).unwrap(), ok);
        let back = Verdict::decode(&failed.encode()).unwrap();
        let reason = back.outcome.unwrap_err();
        assert!(long.starts_with(&reason) && reason.len() <= MAX_REASON && !reason.is_empty());
    }

    #[test]
    fn one_failure_fails_everyone() {
        let verdicts = vec![
            Verdict::ok(),
            Verdict::of::<()>(&Err(CheckpointError::Invalid("disk full".into()))),
        ];
        let err = decide("save", &verdicts, Ok(())).unwrap_err();
        assert!(
            err.to_string().contains("rank 1") && err.to_string().contains("disk full"),
            "{err}"
        );
        assert!(decide("save", &verdicts[..1], Ok(())).is_ok());
    }
}
