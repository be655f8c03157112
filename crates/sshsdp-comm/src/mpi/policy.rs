//! How a reduce-scatter runs on MPI: the calls it can use and the measured choice by size.

/// Default size of a reduce-scatter's `send` buffer, in bytes, from which
/// [`Collective::reduce_scatter`](crate::Collective::reduce_scatter) runs as an all-reduce
/// into a scratch buffer instead of `MPI_Reduce_scatter` (measured; see the module docs).
pub const DEFAULT_ALLREDUCE_FROM_BYTES: usize = 32 << 20;

/// An MPI call a reduce-scatter can run as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceScatterAlgo {
    /// `MPI_Reduce_scatter_block(send, recv)`: no copy.
    Block,
    /// `MPI_Reduce_scatter(send, recv, counts)` with equal counts: no copy.
    Varcount,
    /// `MPI_Allreduce(send, scratch)` into a buffer kept by the communicator, then this rank's
    /// chunk is copied to `recv` (for `bf16`: in place on the widened `f32` copy).
    AllReduce,
}

/// Which [`ReduceScatterAlgo`] a reduce-scatter uses, by the size of `send` in bytes (as `f32`:
/// a `bf16` reduction is decided by its widened size). Must be equal on all ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReduceScatterPolicy {
    /// Used below `large_from_bytes`.
    pub small: ReduceScatterAlgo,
    /// Used from `large_from_bytes` on.
    pub large: ReduceScatterAlgo,
    /// The threshold, in bytes of `f32` `send`.
    pub large_from_bytes: usize,
}

impl ReduceScatterPolicy {
    /// One algorithm for every size.
    pub fn always(algo: ReduceScatterAlgo) -> Self {
        Self {
            small: algo,
            large: algo,
            large_from_bytes: 0,
        }
    }

    /// The algorithm for a `send` of `bytes`.
    pub fn algo(&self, bytes: usize) -> ReduceScatterAlgo {
        if bytes >= self.large_from_bytes {
            self.large
        } else {
            self.small
        }
    }
}

impl ReduceScatterPolicy {
    /// The measured default for a communicator of `ranks` ranks (see the module docs):
    /// `Varcount` below [`DEFAULT_ALLREDUCE_FROM_BYTES`]; from there on `AllReduce` for two
    /// ranks and `Block` for more.
    pub fn measured(ranks: usize) -> Self {
        Self {
            small: ReduceScatterAlgo::Varcount,
            large: if ranks <= 2 {
                ReduceScatterAlgo::AllReduce
            } else {
                ReduceScatterAlgo::Block
            },
            large_from_bytes: DEFAULT_ALLREDUCE_FROM_BYTES,
        }
    }
}
