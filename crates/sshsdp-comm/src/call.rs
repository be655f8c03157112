//! [`CallDesc`]: one rank's collective call as the ranks must agree on it, compared by the
//! engines that check calls (the threads engine in its rendezvous, MPI in its call check).

use std::fmt;

use crate::{CallTag, Element, ElementKind, ReduceOp};

/// What a rank asked for: operation, element type and count per rank (none for calls without
/// data), root (broadcast), reduction, and the call's [`CallTag`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CallDesc {
    pub name: &'static str,
    pub kind: Option<ElementKind>,
    pub count: usize,
    pub root: usize,
    pub op: Option<ReduceOp>,
    pub tag: CallTag,
}

/// The names of [`CallDesc::words`]' entries, for error messages.
#[cfg(feature = "mpi")]
pub(crate) const WORD_NAMES: [&str; 8] = [
    "operation",
    "element type",
    "count",
    "root",
    "reduction",
    "step",
    "bucket",
    "stage",
];

impl CallDesc {
    /// A call moving `count` elements of `T` per rank.
    pub fn data<T: Element>(name: &'static str, count: usize, tag: CallTag) -> Self {
        Self {
            name,
            kind: Some(T::KIND),
            count,
            root: 0,
            op: None,
            tag,
        }
    }

    /// A reduction of `count` elements of `T` per rank with `op`.
    pub fn reduce<T: Element>(
        name: &'static str,
        count: usize,
        op: ReduceOp,
        tag: CallTag,
    ) -> Self {
        Self {
            op: Some(op),
            ..Self::data::<T>(name, count, tag)
        }
    }

    /// A call without data (barrier, split).
    pub fn control(name: &'static str, tag: CallTag) -> Self {
        Self {
            name,
            kind: None,
            count: 0,
            root: 0,
            op: None,
            tag,
        }
    }

    /// The call as numbers every rank computes alike (see [`WORD_NAMES`]).
    #[cfg(feature = "mpi")]
    pub fn words(&self) -> [i64; 8] {
        let [step, bucket, stage] = self.tag.to_words();
        [
            crate::tag::stable_hash(self.name),
            self.kind.map_or(-1, |k| k as i64),
            i64::try_from(self.count).unwrap_or(i64::MAX),
            i64::try_from(self.root).unwrap_or(i64::MAX),
            self.op.map_or(-1, |op| op as i64),
            step,
            bucket,
            stage,
        ]
    }
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        if let Some(kind) = self.kind {
            write!(f, "({kind:?} × {}", self.count)?;
            if let Some(op) = self.op {
                write!(f, ", {op:?}")?;
            }
            if self.name == "broadcast" {
                write!(f, ", root {}", self.root)?;
            }
            f.write_str(")")?;
        }
        write!(f, " [{}]", self.tag)
    }
}
