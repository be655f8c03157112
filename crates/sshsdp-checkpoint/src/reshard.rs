//! Re-sharding: assemble any range of any parameter from the slices of old shards.
//!
//! [`Coverage`] indexes all slices once (per parameter, sorted by start with a running
//! maximum of the ends), so assembling a range costs `O(log s + k + len)` for `s` slices of
//! the parameter of which `k` intersect the range, whatever the old and new world sizes.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::PathBuf;

use crate::{CheckpointError, ShardFile, SliceEntry};

/// The name of the array holding a slice's fp32 master weights.
pub const MASTER: &str = "master";

/// The name of the array holding a module buffer's values (BatchNorm's running statistics):
/// a buffer is saved whole, by rank 0, as one slice holding this array alone.
pub const BUFFER: &str = "buffer";

/// An unsharded model: per parameter path, its shape and its row-major values.
pub type FullModel = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    end: usize,
    file: usize,
    slice: usize,
}

struct ParamIndex<'a> {
    shape: &'a [usize],
    numel: usize,
    /// Whether the first slice seen holds a [`BUFFER`] (a module buffer, not a parameter).
    buffer: bool,
    /// Sorted by `(start, end)`.
    pieces: Vec<Piece>,
    /// `max_end[i]` = the largest `end` among `pieces[..=i]` (non-decreasing).
    max_end: Vec<usize>,
}

/// An index of the slices of a set of shards (typically all shards of one checkpoint, but
/// any set works: the shards need not share a world size).
pub struct Coverage<'a> {
    files: &'a [ShardFile],
    params: BTreeMap<&'a str, ParamIndex<'a>>,
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

impl<'a> Coverage<'a> {
    /// Validates every shard ([`ShardFile::validate`]) and indexes its slices. Fails if two
    /// shards disagree on a parameter's shape.
    pub fn new(files: &'a [ShardFile]) -> Result<Self, CheckpointError> {
        let mut params: BTreeMap<&'a str, ParamIndex<'a>> = BTreeMap::new();
        for (fi, file) in files.iter().enumerate() {
            file.validate()?;
            for (si, s) in file.slices.iter().enumerate() {
                let index = params.entry(&s.path).or_insert_with(|| ParamIndex {
                    shape: &s.shape,
                    // `validate` checked that the shape's element count fits a usize.
                    numel: numel(&s.shape).unwrap_or(0),
                    buffer: s.arrays.contains_key(BUFFER),
                    pieces: Vec::new(),
                    max_end: Vec::new(),
                });
                if index.shape != s.shape.as_slice() {
                    return Err(CheckpointError::Mismatch {
                        file: PathBuf::from(file.file_name()),
                        reason: format!(
                            "parameter '{}' has shape {:?} here but {:?} in another shard",
                            s.path, s.shape, index.shape
                        ),
                    });
                }
                index.pieces.push(Piece {
                    start: s.start,
                    end: s.end,
                    file: fi,
                    slice: si,
                });
            }
        }
        for index in params.values_mut() {
            index.pieces.sort_unstable_by_key(|p| (p.start, p.end));
            let mut running = 0;
            index.max_end = index
                .pieces
                .iter()
                .map(|p| {
                    running = running.max(p.end);
                    running
                })
                .collect();
        }
        Ok(Self { files, params })
    }

    /// The parameters held by the shards, with their shapes, in path order (buffers left
    /// out: [`Self::buffers`]).
    pub fn params(&self) -> impl Iterator<Item = (&'a str, &'a [usize])> + '_ {
        self.entries(false)
    }

    /// The module buffers held by the shards (paths whose slices hold a [`BUFFER`] array),
    /// with their shapes, in path order.
    pub fn buffers(&self) -> impl Iterator<Item = (&'a str, &'a [usize])> + '_ {
        self.entries(true)
    }

    fn entries(&self, buffers: bool) -> impl Iterator<Item = (&'a str, &'a [usize])> + '_ {
        self.params
            .iter()
            .filter(move |(_, index)| index.buffer == buffers)
            .map(|(path, index)| (*path, index.shape))
    }

    /// The shape of parameter or buffer `path`, if any shard holds a slice of it.
    pub fn shape(&self, path: &str) -> Option<&'a [usize]> {
        self.params.get(path).map(|index| index.shape)
    }

    /// Whether `path` is held as a module buffer ([`BUFFER`]) rather than a parameter.
    pub fn is_buffer(&self, path: &str) -> bool {
        self.params.get(path).is_some_and(|index| index.buffer)
    }

    fn slice_of(&self, piece: &Piece) -> &'a SliceEntry {
        &self.files[piece.file].slices[piece.slice]
    }

    fn rank_of(&self, piece: &Piece) -> usize {
        self.files[piece.file].rank
    }

    /// The index of `path` and the non-empty pieces intersecting `[start, end)`, in order
    /// of start, after checking the request against the parameter's shape.
    fn lookup(
        &self,
        path: &str,
        shape: Option<&[usize]>,
        start: usize,
        end: usize,
    ) -> Result<(&ParamIndex<'a>, Vec<Piece>), CheckpointError> {
        let index = self
            .params
            .get(path)
            .ok_or_else(|| CheckpointError::Missing {
                location: PathBuf::from("(shards)"),
                what: format!("parameter '{path}'"),
            })?;
        if let Some(shape) = shape {
            if shape != index.shape {
                let piece = &index.pieces[0];
                return Err(CheckpointError::Mismatch {
                    file: PathBuf::from(self.files[piece.file].file_name()),
                    reason: format!(
                        "parameter '{path}' has shape {:?}, requested {shape:?}",
                        index.shape
                    ),
                });
            }
        }
        if start > end || end > index.numel {
            return Err(CheckpointError::Invalid(format!(
                "range [{start}, {end}) outside parameter '{path}' of {} elements",
                index.numel
            )));
        }
        let lo = index.max_end.partition_point(|&e| e <= start);
        let hi = index.pieces.partition_point(|p| p.start < end);
        let pieces = index.pieces[lo..hi.max(lo)]
            .iter()
            .filter(|p| p.end > start && p.start < p.end)
            .copied()
            .collect();
        Ok((index, pieces))
    }

    /// The values of elements `[start, end)` of array `array` of parameter `path` (of shape
    /// `shape`), taken from whichever slices cover them. Several slices may cover an element
    /// (HSDP replicas) if they agree bit for bit. Errors: unknown parameter or shape
    /// mismatch, range outside the parameter, an element covered by no slice
    /// ([`CheckpointError::Uncovered`]), a covering slice without the array
    /// ([`CheckpointError::Missing`]), or different values ([`CheckpointError::Conflict`]).
    pub fn assemble(
        &self,
        path: &str,
        shape: &[usize],
        start: usize,
        end: usize,
        array: &str,
    ) -> Result<Vec<f32>, CheckpointError> {
        let (_, pieces) = self.lookup(path, Some(shape), start, end)?;
        self.assemble_pieces(path, &pieces, start, end, array)
    }

    fn assemble_pieces(
        &self,
        path: &str,
        pieces: &[Piece],
        start: usize,
        end: usize,
        array: &str,
    ) -> Result<Vec<f32>, CheckpointError> {
        // First check that the pieces cover the range and hold the array, allocating nothing
        // of the range's size: a shape read from a file can claim any number of elements, but
        // a covered range is at most the values the covering slices hold in memory.
        let mut sources = Vec::with_capacity(pieces.len());
        // Every element of `[start, reach)` is covered; pieces come in order of start, so a
        // piece starting after `reach` leaves a gap no later piece can fill.
        let mut reach = start;
        for piece in pieces {
            if piece.start > reach {
                return Err(self.uncovered(path, array, reach, piece.start));
            }
            let values =
                self.slice_of(piece)
                    .arrays
                    .get(array)
                    .ok_or_else(|| CheckpointError::Missing {
                        location: PathBuf::from(self.files[piece.file].file_name()),
                        what: format!(
                            "array '{array}' of slice [{}, {}) of '{path}'",
                            piece.start, piece.end
                        ),
                    })?;
            sources.push(values.as_slice());
            reach = reach.max(piece.end.min(end));
        }
        if reach < end {
            return Err(self.uncovered(path, array, reach, end));
        }

        let mut out = vec![0.0f32; end - start];
        // Every element of `[start, filled)` is set.
        let mut filled = start;
        for (pi, (piece, values)) in pieces.iter().zip(sources).enumerate() {
            let lo = piece.start.max(start);
            let hi = piece.end.min(end);
            let src = |i: usize| values[i - piece.start];
            // Already set: must agree.
            for i in lo..hi.min(filled) {
                if src(i).to_bits() != out[i - start].to_bits() {
                    return Err(self.conflict(path, array, &pieces[..pi], piece, i, src(i)));
                }
            }
            // New: copy.
            let from = lo.max(filled);
            if from < hi {
                out[from - start..hi - start]
                    .copy_from_slice(&values[from - piece.start..hi - piece.start]);
                filled = hi;
            }
        }
        Ok(out)
    }

    fn uncovered(&self, path: &str, array: &str, start: usize, end: usize) -> CheckpointError {
        CheckpointError::Uncovered {
            path: path.to_owned(),
            array: array.to_owned(),
            start,
            end,
        }
    }

    /// The conflict at element `index` (slow path: finds an earlier piece that disagrees).
    fn conflict(
        &self,
        path: &str,
        array: &str,
        earlier: &[Piece],
        piece: &Piece,
        index: usize,
        value: f32,
    ) -> CheckpointError {
        let first = earlier
            .iter()
            .find(|p| {
                p.start <= index
                    && index < p.end
                    && self
                        .slice_of(p)
                        .arrays
                        .get(array)
                        .is_some_and(|v| v[index - p.start].to_bits() != value.to_bits())
            })
            .unwrap_or(piece);
        CheckpointError::Conflict {
            path: path.to_owned(),
            array: array.to_owned(),
            index,
            first_rank: self.rank_of(first),
            second_rank: self.rank_of(piece),
        }
    }

    /// A new slice `[start, end)` of parameter `path` with every array that the covering
    /// slices hold (for an empty range: that any slice of the parameter holds), each
    /// assembled as by [`Self::assemble`].
    pub fn assemble_slice(
        &self,
        path: &str,
        start: usize,
        end: usize,
    ) -> Result<SliceEntry, CheckpointError> {
        let (index, pieces) = self.lookup(path, None, start, end)?;
        // An empty range intersects no slice: give it the arrays of every slice.
        let named = if start == end { &index.pieces } else { &pieces };
        let names: BTreeSet<&str> = named
            .iter()
            .flat_map(|p| self.slice_of(p).arrays.keys().map(String::as_str))
            .collect();
        let arrays = names
            .into_iter()
            .map(|name| {
                let values = self.assemble_pieces(path, &pieces, start, end, name)?;
                Ok((name.to_owned(), values))
            })
            .collect::<Result<_, CheckpointError>>()?;
        Ok(SliceEntry {
            path: path.to_owned(),
            shape: index.shape.to_vec(),
            start,
            end,
            arrays,
        })
    }

    /// Every parameter's whole array `array` (for [`MASTER`], the unsharded model's weights),
    /// or for [`BUFFER`] every buffer's values.
    pub fn export_full(&self, array: &str) -> Result<FullModel, CheckpointError> {
        self.params
            .iter()
            .filter(|(_, index)| index.buffer == (array == BUFFER))
            .map(|(path, index)| {
                let values = self.assemble(path, index.shape, 0, index.numel, array)?;
                Ok(((*path).to_owned(), (index.shape.to_vec(), values)))
            })
            .collect()
    }
}

/// [`Coverage::assemble`] over `files` (indexes them first: for many requests build one
/// [`Coverage`]).
pub fn assemble(
    files: &[ShardFile],
    path: &str,
    shape: &[usize],
    start: usize,
    end: usize,
    array: &str,
) -> Result<Vec<f32>, CheckpointError> {
    Coverage::new(files)?.assemble(path, shape, start, end, array)
}

/// The unsharded model: every parameter's whole [`MASTER`] array and every buffer's
/// [`BUFFER`] array, by path (what [`crate::apply_full`] writes into a Burn module).
pub fn export_full(files: &[ShardFile]) -> Result<FullModel, CheckpointError> {
    let coverage = Coverage::new(files)?;
    let mut full = coverage.export_full(MASTER)?;
    full.extend(coverage.export_full(BUFFER)?);
    Ok(full)
}

/// Slices of an unsharded model (the inverse of [`export_full`]): one [`SliceEntry`] with a
/// [`MASTER`] array per requested `(path, range)`, e.g. the ranges a rank owns.
pub fn shard_full<S: AsRef<str>>(
    full: &FullModel,
    ranges: impl IntoIterator<Item = (S, Range<usize>)>,
) -> Result<Vec<SliceEntry>, CheckpointError> {
    ranges
        .into_iter()
        .map(|(path, range)| {
            let path = path.as_ref();
            let (shape, values) = full.get(path).ok_or_else(|| CheckpointError::Missing {
                location: PathBuf::from("(full model)"),
                what: format!("parameter '{path}'"),
            })?;
            if numel(shape) != Some(values.len()) {
                return Err(CheckpointError::Invalid(format!(
                    "parameter '{path}' has {} values for shape {shape:?}",
                    values.len()
                )));
            }
            let arrays = values
                .get(range.clone())
                .map(|v| BTreeMap::from([(MASTER.to_owned(), v.to_vec())]))
                .ok_or_else(|| {
                    CheckpointError::Invalid(format!(
                        "range {range:?} outside parameter '{path}' of {} elements",
                        values.len()
                    ))
                })?;
            Ok(SliceEntry {
                path: path.to_owned(),
                shape: shape.clone(),
                start: range.start,
                end: range.end,
                arrays,
            })
        })
        .collect()
}

/// The scalars of `files`, which must all hold the same names with bit-identical values
/// (e.g. the step, which every rank of a synchronous run shares).
pub fn agreed_scalars(files: &[ShardFile]) -> Result<BTreeMap<String, f64>, CheckpointError> {
    let Some(first) = files.first() else {
        return Ok(BTreeMap::new());
    };
    for file in &files[1..] {
        let same = file.scalars.len() == first.scalars.len()
            && file
                .scalars
                .iter()
                .zip(&first.scalars)
                .all(|((k, v), (k0, v0))| k == k0 && v.to_bits() == v0.to_bits());
        if !same {
            return Err(CheckpointError::Mismatch {
                file: PathBuf::from(file.file_name()),
                reason: format!(
                    "scalars {:?} differ from rank {}'s {:?}",
                    file.scalars, first.rank, first.scalars
                ),
            });
        }
    }
    Ok(first.scalars.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(rank: usize, slices: Vec<(usize, usize, f32)>) -> ShardFile {
        ShardFile {
            rank,
            world: 8,
            plan_json: String::new(),
            slices: slices
                .into_iter()
                .map(|(start, end, fill)| SliceEntry {
                    path: "p".into(),
                    shape: vec![10],
                    start,
                    end,
                    arrays: BTreeMap::from([(MASTER.into(), vec![fill; end - start])]),
                })
                .collect(),
            scalars: BTreeMap::new(),
        }
    }

    #[test]
    fn lookup_skips_pieces_that_end_before_the_range() {
        let files = [
            shard(0, vec![(0, 2, 1.0), (6, 10, 1.0)]),
            shard(1, vec![(0, 9, 1.0)]),
            shard(2, vec![(2, 4, 1.0), (4, 4, 7.0)]),
        ];
        let cov = Coverage::new(&files).unwrap();
        let (_, pieces) = cov.lookup("p", None, 5, 6).unwrap();
        assert_eq!(pieces.len(), 1);
        assert_eq!((pieces[0].start, pieces[0].end), (0, 9));
        let (_, pieces) = cov.lookup("p", None, 9, 10).unwrap();
        assert_eq!(pieces.len(), 1);
        assert_eq!(cov.assemble("p", &[10], 0, 10, MASTER).unwrap(), [1.0; 10]);
        assert_eq!(cov.assemble("p", &[10], 4, 4, MASTER).unwrap(), [0.0; 0]);
    }

    #[test]
    fn conflict_names_both_ranks() {
        let files = [shard(3, vec![(0, 6, 1.0)]), shard(5, vec![(4, 10, 2.0)])];
        match Coverage::new(&files)
            .unwrap()
            .assemble("p", &[10], 0, 10, MASTER)
        {
            Err(CheckpointError::Conflict {
                index,
                first_rank,
                second_rank,
                ..
            }) => assert_eq!((index, first_rank, second_rank), (4, 3, 5)),
            other => panic!("expected a conflict, got {other:?}"),
        }
    }
}
