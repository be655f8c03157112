//! Optimizer state by *segment*: one Burn state record over a contiguous run of one piece's
//! update units that step together, so that an element-wise optimizer steps a whole piece in
//! one chain of tensor operations (a few launches per piece, however many parameters it
//! holds) instead of one chain per parameter plus the slices and the concatenation.
//!
//! Element-wise rules do not care how elements are grouped, so a segment's state is exactly
//! its units' states side by side — as long as its units have stepped at the same steps (the
//! same step count). Burn skips a parameter without a gradient (frozen, or unused by every
//! rank's graph) and leaves its state alone; a segment with such a unit is first split into
//! one state per unit ([`crate::state_codec`]: the record's arrays sliced, a host round trip),
//! and units whose states agree on every scalar are joined back into one segment at their next
//! step together (after a checkpoint load, which sets states unit by unit). Neither happens in a
//! steady run: splits and joins cost only on the step that changes who steps.
//!
//! A segment spans the padding between its units (and before its first and after its last
//! unit, when those are the piece's first and last), so that a piece whose units all step is
//! one segment covering the whole piece: no slice, no concatenation. Padding elements are
//! never read as parameters (views, checkpoints and the gradient norm see units only; a
//! padding element's gradient is zero), so what the optimizer writes there does not matter;
//! for the usual rules (SGD, Adam, AdamW) zeros stay zeros.

use std::collections::HashMap;
use std::ops::Range;

use burn::record::Record;
use burn::tensor::backend::Backend;

use sshsdp_backend::HsdpError;
use sshsdp_plan::UpdateUnit;

use crate::state_codec::{decode_state, encode_state, CodecError, EncodedState};

/// One update unit of a piece: a parameter and its positions in the piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    /// The parameter (its index in the plan).
    pub param: usize,
    /// Its positions in the piece.
    pub range: Range<usize>,
}

/// A run of one piece's units stepped as one, with their state (`None` before the first step).
#[derive(Clone, Debug)]
pub(crate) struct Block<S> {
    /// Positions in the piece the state covers (its units and the padding between them).
    pub range: Range<usize>,
    /// Its units, in piece order.
    pub members: Vec<Member>,
    /// Their joint state; `None` for units never stepped.
    pub state: Option<S>,
}

/// The states of one optimizer over this rank's pieces: segments (joint states) and loose
/// per-unit states (set by a checkpoint load, or split out of a segment), placed into segments
/// at their next step.
#[derive(Clone, Debug)]
pub(crate) struct SegmentStates<S> {
    /// Joint states, per bucket.
    segments: Vec<(usize, Block<S>)>,
    /// Per-parameter states not in a segment.
    loose: HashMap<usize, S>,
}

impl<S> Default for SegmentStates<S> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            loose: HashMap::new(),
        }
    }
}

impl<S: Clone> SegmentStates<S> {
    /// The blocks to step in bucket `bucket`'s piece of `len` elements, whose units are
    /// `units` (every unit of the piece, in piece order) and of which those with
    /// `stepped(param)` step now; their states are taken out (give them back with
    /// [`Self::put`]). Splits segments of which only some units step, joins loose states that
    /// agree (see the module docs).
    pub fn take_blocks<B: Backend>(
        &mut self,
        bucket: usize,
        len: usize,
        units: &[Member],
        stepped: impl Fn(usize) -> bool,
        device: &B::Device,
    ) -> Result<Vec<Block<S>>, CodecError>
    where
        S: Record<B>,
    {
        // Segments of this piece that only partly step fall apart into loose unit states.
        let mut at = 0;
        while at < self.segments.len() {
            let (b, block) = &self.segments[at];
            let steps = block.members.iter().filter(|m| stepped(m.param)).count();
            if *b == bucket && steps > 0 && steps < block.members.len() {
                let (_, block) = self.segments.swap_remove(at);
                self.split(block, device)?;
            } else {
                at += 1;
            }
        }
        let first = units.first().map(|u| u.param);
        let last = units.last().map(|u| u.param);
        // Extent of a new block over `members`: out to the piece's ends when it holds them.
        let extent = |members: &[Member]| {
            let start = if Some(members[0].param) == first {
                0
            } else {
                members[0].range.start
            };
            let end = if members.last().map(|m| m.param) == last {
                len
            } else {
                members[members.len() - 1].range.end
            };
            start..end
        };
        let mut blocks = Vec::new();
        let mut fresh: Vec<Member> = Vec::new();
        let mut loose: Vec<(Member, S)> = Vec::new();
        for unit in units {
            let run_ends = !stepped(unit.param)
                || self.segment_of(bucket, unit.param).is_some()
                || self.loose.contains_key(&unit.param);
            if run_ends && !fresh.is_empty() {
                let members = std::mem::take(&mut fresh);
                blocks.push(Block {
                    range: extent(&members),
                    members,
                    state: None,
                });
            }
            let loose_continues = stepped(unit.param) && self.loose.contains_key(&unit.param);
            if !loose_continues && !loose.is_empty() {
                blocks.extend(join::<B, S>(std::mem::take(&mut loose), &extent, device)?);
            }
            if !stepped(unit.param) {
                continue;
            }
            if let Some(at) = self.segment_of(bucket, unit.param) {
                let (_, block) = self.segments.swap_remove(at);
                blocks.push(block);
            } else if let Some(state) = self.loose.remove(&unit.param) {
                loose.push((unit.clone(), state));
            } else if !blocks
                .iter()
                .any(|b: &Block<S>| b.members.iter().any(|m| m.param == unit.param))
            {
                fresh.push(unit.clone());
            }
        }
        if !fresh.is_empty() {
            blocks.push(Block {
                range: extent(&fresh),
                members: fresh,
                state: None,
            });
        }
        if !loose.is_empty() {
            blocks.extend(join::<B, S>(loose, &extent, device)?);
        }
        Ok(blocks)
    }

    /// [`Self::take_blocks`] over `units` (every update unit of bucket `bucket`'s piece of `len`
    /// elements, in piece order), with the error an update reports.
    pub fn take_unit_blocks<B: Backend>(
        &mut self,
        bucket: usize,
        len: usize,
        units: &[&UpdateUnit],
        stepped: impl Fn(usize) -> bool,
        device: &B::Device,
    ) -> Result<Vec<Block<S>>, HsdpError>
    where
        S: Record<B>,
    {
        let members: Vec<Member> = units
            .iter()
            .map(|u| Member {
                param: u.param,
                range: u.in_piece.clone(),
            })
            .collect();
        self.take_blocks::<B>(bucket, len, &members, stepped, device)
            .map_err(|e| HsdpError::Failed(format!("splitting optimizer state: {}", e.0)))
    }

    /// Keeps `block`'s state after its step (`None`: the optimizer keeps none for it).
    pub fn put(&mut self, bucket: usize, block: Block<S>) {
        if block.state.is_some() {
            self.segments.push((bucket, block));
        }
    }

    /// The state of parameter `param`'s unit (`None` before its first step), sliced out of
    /// its segment when it shares one.
    pub fn unit_state<B: Backend>(
        &self,
        param: usize,
        device: &B::Device,
    ) -> Result<Option<S>, CodecError>
    where
        S: Record<B>,
    {
        if let Some(state) = self.loose.get(&param) {
            return Ok(Some(state.clone()));
        }
        let Some((_, block)) = self
            .segments
            .iter()
            .find(|(_, b)| b.members.iter().any(|m| m.param == param))
        else {
            return Ok(None);
        };
        let member = block.members.iter().find(|m| m.param == param);
        let member = member.expect("found above");
        let state = block.state.clone().expect("segments hold a state");
        if block.members.len() == 1 && block.range == member.range {
            return Ok(Some(state));
        }
        let (arrays, scalars) = encode_state::<B, S>(state)?;
        let within = member.range.start - block.range.start..member.range.end - block.range.start;
        let arrays = arrays
            .into_iter()
            .map(|(name, values)| (name, values[within.clone()].to_vec()))
            .collect();
        decode_state::<B, S>(&arrays, &scalars, within.len(), device).map(Some)
    }

    /// Replaces parameter `param`'s unit state (`None`: no state, as before a first step).
    pub fn set_unit_state<B: Backend>(
        &mut self,
        param: usize,
        state: Option<S>,
        device: &B::Device,
    ) -> Result<(), CodecError>
    where
        S: Record<B>,
    {
        if let Some(at) = self
            .segments
            .iter()
            .position(|(_, b)| b.members.iter().any(|m| m.param == param))
        {
            let (_, block) = self.segments.swap_remove(at);
            self.split(block, device)?;
        }
        match state {
            Some(state) => self.loose.insert(param, state),
            None => self.loose.remove(&param),
        };
        Ok(())
    }

    /// Number of joint states held (a steady run: one per piece whose units all step).
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// The segment of bucket `bucket` holding `param`, if any.
    fn segment_of(&self, bucket: usize, param: usize) -> Option<usize> {
        self.segments
            .iter()
            .position(|(b, s)| *b == bucket && s.members.iter().any(|m| m.param == param))
    }

    /// `block`'s state split into loose unit states.
    fn split<B: Backend>(&mut self, block: Block<S>, device: &B::Device) -> Result<(), CodecError>
    where
        S: Record<B>,
    {
        let state = block.state.expect("segments hold a state");
        if block.members.len() == 1 && block.range == block.members[0].range {
            self.loose.insert(block.members[0].param, state);
            return Ok(());
        }
        let (arrays, scalars) = encode_state::<B, S>(state)?;
        for member in block.members {
            let within =
                member.range.start - block.range.start..member.range.end - block.range.start;
            let arrays = arrays
                .iter()
                .map(|(name, values)| (name.clone(), values[within.clone()].to_vec()))
                .collect();
            let state = decode_state::<B, S>(&arrays, &scalars, within.len(), device)?;
            self.loose.insert(member.param, state);
        }
        Ok(())
    }
}

/// Consecutive loose unit states `run` as blocks: those next to each other whose records agree
/// on every scalar (the step count) and name the same arrays are joined into one (arrays laid
/// side by side over the block's extent, zero over padding); a unit alone keeps its state.
fn join<B: Backend, S: Record<B> + Clone>(
    run: Vec<(Member, S)>,
    extent: &dyn Fn(&[Member]) -> Range<usize>,
    device: &B::Device,
) -> Result<Vec<Block<S>>, CodecError> {
    let mut groups: Vec<Vec<(Member, S, EncodedState)>> = Vec::new();
    for (member, state) in run {
        let encoded = encode_state::<B, S>(state.clone())?;
        let agrees = groups.last().is_some_and(|g| {
            let (_, _, (arrays, scalars)) = &g[0];
            *scalars == encoded.1 && arrays.keys().eq(encoded.0.keys())
        });
        match groups.last_mut() {
            Some(group) if agrees => group.push((member, state, encoded)),
            _ => groups.push(vec![(member, state, encoded)]),
        }
    }
    let mut blocks = Vec::with_capacity(groups.len());
    for group in groups {
        if group.len() == 1 {
            let (member, state, _) = group.into_iter().next().expect("one");
            blocks.push(Block {
                range: member.range.clone(),
                members: vec![member],
                state: Some(state),
            });
            continue;
        }
        let members: Vec<Member> = group.iter().map(|(m, _, _)| m.clone()).collect();
        let range = extent(&members);
        let scalars = group[0].2 .1.clone();
        let mut arrays = group[0].2 .0.clone();
        for values in arrays.values_mut() {
            *values = vec![0.0; range.len()];
        }
        for (member, _, (unit_arrays, _)) in &group {
            let at = member.range.start - range.start..member.range.end - range.start;
            for (name, values) in unit_arrays {
                arrays.get_mut(name).expect("same names")[at.clone()].copy_from_slice(values);
            }
        }
        let state = decode_state::<B, S>(&arrays, &scalars, range.len(), device)?;
        blocks.push(Block {
            range,
            members,
            state: Some(state),
        });
    }
    Ok(blocks)
}

/// `t`'s elements `range` (`t` itself, no slice, when the range is all of it).
pub(crate) fn range_of<B: Backend>(
    t: &burn::tensor::Tensor<B, 1>,
    range: &Range<usize>,
) -> burn::tensor::Tensor<B, 1> {
    if *range == (0..t.dims()[0]) {
        t.clone()
    } else {
        t.clone().slice(range.clone())
    }
}
