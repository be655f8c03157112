//! The 32×32 tiles of a square-block MXFP8 matrix ([`crate::format`]): their order, their
//! encoded sizes, and which rectangles and row-major runs of the matrix a range of them covers.
//!
//! Tiles are numbered **band-major**: band `b` (rows `32b..32b + 32`) holds tiles
//! `b · tile_cols .. (b + 1) · tile_cols`, left to right. A piece of a bucket holds a range of
//! tiles of each matrix it touches, so its part of a matrix is at most three rectangles: the
//! tail of one band, whole bands, the head of another. Every rectangle starts on tile edges,
//! so it is itself a square-block matrix with the same tiles (`sshsdp-mx`'s `encode_square`
//! of the rectangle is the whole matrix's encoding there). The rectangles, each row-major and
//! in order, list exactly the range's elements in the matrix's row-major order: that is the
//! order of the piece's fp32 elements (masters, gradients, optimizer state).

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Side of a square-block MXFP8 tile (elements); one E8M0 scale per tile.
pub const TILE: u64 = 32;

/// A rectangle of a matrix's 2-D view: rows × columns (both end-exclusive).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rect {
    /// Rows of the matrix.
    pub rows: Range<u64>,
    /// Columns of the matrix.
    pub cols: Range<u64>,
}

impl Rect {
    /// Its height.
    pub fn height(&self) -> u64 {
        self.rows.end - self.rows.start
    }

    /// Its width.
    pub fn width(&self) -> u64 {
        self.cols.end - self.cols.start
    }

    /// Its elements.
    pub fn len(&self) -> u64 {
        self.height() * self.width()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of its square-block encoding: one byte per element, one scale per tile.
    pub fn encoded_bytes(&self) -> u64 {
        self.len() + self.height().div_ceil(TILE) * self.width().div_ceil(TILE)
    }
}

/// The tiles of a `rows × cols` matrix (its 2-D view; the last tile row and column may be
/// partial, their padding never stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TileGrid {
    /// Rows of the matrix.
    pub rows: u64,
    /// Columns of the matrix.
    pub cols: u64,
}

impl TileGrid {
    /// The tiles of a `rows × cols` matrix.
    pub fn new(rows: u64, cols: u64) -> Self {
        Self { rows, cols }
    }

    /// Bands (tile rows).
    pub fn tile_rows(&self) -> u64 {
        self.rows.div_ceil(TILE)
    }

    /// Tiles per band.
    pub fn tile_cols(&self) -> u64 {
        self.cols.div_ceil(TILE)
    }

    /// Tiles in all.
    pub fn tiles(&self) -> u64 {
        self.tile_rows() * self.tile_cols()
    }

    /// Bytes of the whole matrix's encoding.
    pub fn encoded_bytes(&self) -> u64 {
        self.rows * self.cols + self.tiles()
    }

    /// Rows of band `b` (32, or fewer in the last band).
    fn band_height(&self, b: u64) -> u64 {
        (self.rows - b * TILE).min(TILE)
    }

    /// Elements of tiles `0..t` (band-major). Every band before the last is full, and within
    /// a band only the last tile is narrow, so this is closed-form.
    pub fn elements_before(&self, t: u64) -> u64 {
        if t >= self.tiles() {
            return self.rows * self.cols;
        }
        let (b, j) = (t / self.tile_cols(), t % self.tile_cols());
        b * TILE * self.cols + j * TILE * self.band_height(b)
    }

    /// Encoded bytes of tiles `0..t` (their elements and one scale each).
    pub fn bytes_before(&self, t: u64) -> u64 {
        self.elements_before(t) + t.min(self.tiles())
    }

    /// The tile edge (`0..=tiles`) whose [`Self::bytes_before`] is nearest `bytes` (the lower
    /// one on a tie).
    pub fn nearest_edge(&self, bytes: u64) -> u64 {
        // The last edge at or below `bytes` (bytes_before is increasing), then its successor.
        let (mut lo, mut hi) = (0, self.tiles());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.bytes_before(mid) <= bytes {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let next = (lo + 1).min(self.tiles());
        if self.bytes_before(next).abs_diff(bytes) < bytes.abs_diff(self.bytes_before(lo)) {
            next
        } else {
            lo
        }
    }

    /// Rows of bands `b0..b1`.
    fn band_rows(&self, b0: u64, b1: u64) -> Range<u64> {
        b0 * TILE..(b1 * TILE).min(self.rows)
    }

    /// Columns of tiles `j0..j1` of a band.
    fn tile_cols_range(&self, j0: u64, j1: u64) -> Range<u64> {
        j0 * TILE..(j1 * TILE).min(self.cols)
    }

    /// The rectangles tiles `tiles` cover (at most three, in the matrix's row-major order:
    /// the tail of the first band, whole bands, the head of the last band).
    pub fn rects(&self, tiles: Range<u64>) -> Vec<Rect> {
        let tiles = tiles.start..tiles.end.min(self.tiles());
        if tiles.is_empty() {
            return Vec::new();
        }
        let tc = self.tile_cols();
        let (b0, j0) = (tiles.start / tc, tiles.start % tc);
        let (b1, j1) = ((tiles.end - 1) / tc, (tiles.end - 1) % tc + 1);
        if b0 == b1 {
            return vec![Rect {
                rows: self.band_rows(b0, b0 + 1),
                cols: self.tile_cols_range(j0, j1),
            }];
        }
        let mut rects = Vec::with_capacity(3);
        let mut whole = b0..b1 + 1;
        if j0 > 0 {
            rects.push(Rect {
                rows: self.band_rows(b0, b0 + 1),
                cols: self.tile_cols_range(j0, tc),
            });
            whole.start += 1;
        }
        let tail = (j1 < tc).then(|| Rect {
            rows: self.band_rows(b1, b1 + 1),
            cols: self.tile_cols_range(0, j1),
        });
        if tail.is_some() {
            whole.end -= 1;
        }
        if !whole.is_empty() {
            rects.push(Rect {
                rows: self.band_rows(whole.start, whole.end),
                cols: 0..self.cols,
            });
        }
        rects.extend(tail);
        rects
    }

    /// The same elements as [`Self::rects`], as ascending row-major runs of the matrix (merged
    /// where they touch): the order of a piece's fp32 elements.
    pub fn runs(&self, tiles: Range<u64>) -> Vec<Range<u64>> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        let mut push = |run: Range<u64>| match runs.last_mut() {
            Some(last) if last.end == run.start => last.end = run.end,
            _ => runs.push(run),
        };
        for rect in self.rects(tiles) {
            if rect.cols == (0..self.cols) {
                push(rect.rows.start * self.cols..rect.rows.end * self.cols);
            } else {
                for r in rect.rows.clone() {
                    push(r * self.cols + rect.cols.start..r * self.cols + rect.cols.end);
                }
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile's elements, by brute force: `(row, col)` pairs in row-major order.
    fn brute(grid: TileGrid, tiles: Range<u64>) -> Vec<u64> {
        let tc = grid.tile_cols();
        let mut out: Vec<u64> = (0..grid.rows * grid.cols)
            .filter(|&i| {
                let (r, c) = (i / grid.cols, i % grid.cols);
                tiles.contains(&((r / TILE) * tc + c / TILE))
            })
            .collect();
        out.sort_unstable();
        out
    }

    #[test]
    fn rects_and_runs_list_a_tile_range_in_row_major_order() {
        for (rows, cols) in [(32, 32), (70, 96), (33, 1), (5, 200), (100, 65), (96, 64)] {
            let grid = TileGrid::new(rows, cols);
            let n = grid.tiles();
            for t0 in 0..=n {
                for t1 in t0..=n {
                    let expected = brute(grid, t0..t1);
                    let from_rects: Vec<u64> = grid
                        .rects(t0..t1)
                        .iter()
                        .flat_map(|r| {
                            r.rows
                                .clone()
                                .flat_map(move |i| r.cols.clone().map(move |j| i * cols + j))
                        })
                        .collect();
                    assert_eq!(from_rects, expected, "{rows}x{cols} tiles {t0}..{t1}");
                    let from_runs: Vec<u64> = grid.runs(t0..t1).into_iter().flatten().collect();
                    assert_eq!(from_runs, expected);
                    assert!(grid.rects(t0..t1).len() <= 3);
                    let len = grid.elements_before(t1) - grid.elements_before(t0);
                    assert_eq!(len, expected.len() as u64);
                    let bytes: u64 = grid.rects(t0..t1).iter().map(Rect::encoded_bytes).sum();
                    assert_eq!(bytes, grid.bytes_before(t1) - grid.bytes_before(t0));
                }
            }
            assert_eq!(grid.bytes_before(n), grid.encoded_bytes());
        }
    }

    #[test]
    fn the_nearest_edge_is_nearest() {
        let grid = TileGrid::new(70, 100);
        for bytes in 0..=grid.encoded_bytes() + 5 {
            let e = grid.nearest_edge(bytes);
            let d = |t: u64| grid.bytes_before(t).abs_diff(bytes);
            assert!((0..=grid.tiles()).all(|t| d(e) <= d(t)), "{bytes} -> {e}");
        }
    }
}
