//! The schedule stage: which pass runs, the order forward first used the buckets (recorded
//! each step, it drives the next step's prefetch and backward's), what to prefetch next, and
//! which buckets to release (FSDP2's reshard after forward).

/// The order of bucket use and the pass in progress.
#[derive(Debug, Default)]
pub(super) struct Schedule {
    /// Release gathered buckets as soon as the pass moves on (and gather again in backward).
    reshard_after_forward: bool,
    /// Buckets in the order this step's forward first used them.
    order: Vec<usize>,
    /// That order from the previous step: it drives prefetch in forward.
    recorded: Vec<usize>,
    /// Whether a backward pass is running (between its start and its last gradient).
    in_backward: bool,
}

impl Schedule {
    /// A schedule that releases after forward or keeps buckets until the step ends.
    pub fn new(reshard_after_forward: bool) -> Self {
        Self {
            reshard_after_forward,
            ..Self::default()
        }
    }

    /// Whether buckets are released after forward.
    pub fn reshards(&self) -> bool {
        self.reshard_after_forward
    }

    /// Whether a backward pass is running.
    pub fn in_backward(&self) -> bool {
        self.in_backward
    }

    /// Marks whether a backward pass is running.
    pub fn set_backward(&mut self, running: bool) {
        self.in_backward = running;
    }

    /// Bucket `b` was gathered; returns the buckets to release now. In forward: `b` joins the
    /// order of use and, with resharding, every other bucket goes. In backward (which runs
    /// forward's order in reverse), with resharding: the buckets after `b` in that order are
    /// done (a late use gathers again).
    pub fn gathered(&mut self, b: usize, buckets: usize) -> Vec<usize> {
        if self.in_backward {
            if !self.reshard_after_forward {
                return Vec::new();
            }
            let Some(pos) = self.order.iter().position(|&x| x == b) else {
                return Vec::new();
            };
            let later: Vec<usize> = self.order.drain(pos + 1..).collect();
            self.order.extend(later.iter().copied());
            later
        } else {
            if !self.order.contains(&b) {
                self.order.push(b);
            }
            if self.reshard_after_forward {
                (0..buckets).filter(|&other| other != b).collect()
            } else {
                Vec::new()
            }
        }
    }

    /// The bucket expected after `b`: in forward the one that followed it in the previous
    /// step's order, in backward the one before it in this step's forward order. Every rank
    /// follows the same order, so every rank prefetches the same buckets.
    pub fn next_after(&self, b: usize) -> Option<usize> {
        if self.in_backward {
            let pos = self.order.iter().position(|&x| x == b)?;
            pos.checked_sub(1).map(|p| self.order[p])
        } else {
            let pos = self.recorded.iter().position(|&x| x == b)?;
            self.recorded.get(pos + 1).copied()
        }
    }

    /// The first bucket the last finished step's forward used (what the next forward needs
    /// first).
    pub fn first_forward(&self) -> Option<usize> {
        self.recorded.first().copied()
    }

    /// The last bucket forward used (the first backward needs).
    pub fn last_forward(&self) -> Option<usize> {
        self.order.last().copied()
    }

    /// Ends a step: its order of use drives the next step's prefetch.
    pub fn end_step(&mut self) {
        self.recorded = std::mem::take(&mut self.order);
        self.in_backward = false;
    }
}
