//! [`CallTag`]: what a collective call is for, carried with it so that ranks making different
//! calls get an error instead of a silent pairing.

use std::fmt;

/// The identity of a collective call beyond its operation and counts: the training step, the
/// bucket and the stage of the runtime that makes it. Set with [`crate::Collective::set_tag`]
/// before the calls it labels. Two buckets of the same size gathered in a different order on
/// two ranks, or a gather on one rank meeting another's reduction of the same count, differ in
/// their tags: engines that check tags (threads; MPI with call checks) report a
/// [`crate::CommError::Mismatch`] on every rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CallTag {
    /// The optimizer step the call belongs to (counted by the caller).
    pub step: u64,
    /// The bucket the call moves, if it moves one bucket.
    pub bucket: Option<u32>,
    /// The stage that makes the call (`"gather"`, `"reduce"`, …); empty when untagged.
    pub stage: &'static str,
}

impl CallTag {
    /// A call labelled with nothing but its operation and counts.
    pub const NONE: CallTag = CallTag {
        step: 0,
        bucket: None,
        stage: "",
    };

    /// A call of `stage` in `step`, about `bucket` if it moves one.
    pub fn new(step: u64, bucket: Option<usize>, stage: &'static str) -> Self {
        Self {
            step,
            bucket: bucket.map(|b| u32::try_from(b).unwrap_or(u32::MAX)),
            stage,
        }
    }

    /// The tag as numbers every engine can compare: step, bucket (−1 for none) and a stable
    /// 63-bit hash of the stage's name (FNV-1a, so equal names give equal numbers on every
    /// rank and build).
    pub fn to_words(&self) -> [i64; 3] {
        [
            i64::try_from(self.step).unwrap_or(i64::MAX),
            self.bucket.map_or(-1, i64::from),
            stable_hash(self.stage),
        ]
    }
}

/// A stable, non-negative 63-bit hash of a name (FNV-1a): equal names give equal numbers on
/// every rank and build, so engines can compare names as integers.
pub(crate) fn stable_hash(name: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash >> 1) as i64
}

impl fmt::Display for CallTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::NONE {
            return f.write_str("untagged");
        }
        write!(f, "step {}", self.step)?;
        if let Some(b) = self.bucket {
            write!(f, ", bucket {b}")?;
        }
        if !self.stage.is_empty() {
            write!(f, ", {}", self.stage)?;
        }
        Ok(())
    }
}
