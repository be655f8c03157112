//! Multi-threaded variants of the encoders and decoders (`std::thread::scope`; the result is
//! byte-identical to the single-threaded functions for any thread count).

use crate::block::with_spec;
use crate::format::{ElemFormat, ScaleRule};
use crate::input::MxInput;
use crate::plane::{check_plane, decode_rows_impl, encode_cols_range, encode_rows_impl};
use crate::shape::{check_len, MxShape};
use crate::simd::dispatch;
use crate::tiled::{decode_tiles_impl, encode_tiled_range, Plane};
use crate::{MxError, BLOCK, TILE, TILE_BYTES};

/// Splits `n` units into at most `parts` contiguous, nearly equal ranges (none empty).
fn split(n: usize, parts: usize) -> impl Iterator<Item = (usize, usize)> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(move |i| (n * i / parts, n * (i + 1) / parts))
}

/// [`crate::encode_rows`] on `threads` threads (split by rows).
pub fn encode_rows_par<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
    threads: usize,
) -> Result<(), MxError> {
    check_plane(shape, Plane::Row, src.len(), data.len(), scales.len())?;
    let (cols, cols_p, nb) = (shape.cols, shape.cols_p(), shape.cols_p() / BLOCK);
    std::thread::scope(|s| {
        let (mut data, mut scales) = (data, scales);
        for (r0, r1) in split(shape.rows, threads) {
            let n = r1 - r0;
            let (d, rest) = std::mem::take(&mut data).split_at_mut(n * cols_p);
            data = rest;
            let (sc, rest) = std::mem::take(&mut scales).split_at_mut(n * nb);
            scales = rest;
            let x = &src[r0 * cols..r1 * cols];
            s.spawn(move || {
                dispatch!(with_spec!(fmt, S => encode_rows_impl::<T, S>(x, cols, rule, d, sc)))
            });
        }
    });
    Ok(())
}

/// [`crate::encode_cols`] on `threads` threads (split by 32-column groups).
pub fn encode_cols_par<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    data: &mut [u8],
    scales: &mut [u8],
    threads: usize,
) -> Result<(), MxError> {
    check_plane(shape, Plane::Col, src.len(), data.len(), scales.len())?;
    let (rows_p, nbr) = (shape.rows_p(), shape.rows_p() / BLOCK);
    std::thread::scope(|s| {
        let (mut data, mut scales) = (data, scales);
        for (g0, g1) in split(shape.cols.div_ceil(BLOCK), threads) {
            let (c0, c1) = (g0 * BLOCK, (g1 * BLOCK).min(shape.cols));
            let (d, rest) = std::mem::take(&mut data).split_at_mut((c1 - c0) * rows_p);
            data = rest;
            let (sc, rest) = std::mem::take(&mut scales).split_at_mut((c1 - c0) * nbr);
            scales = rest;
            s.spawn(move || {
                dispatch!(
                    with_spec!(fmt, S => encode_cols_range::<T, S>(src, shape, rule, c0, c1, d, sc))
                )
            });
        }
    });
    Ok(())
}

/// [`crate::encode_tiled`] on `threads` threads (split by tile ranges).
pub fn encode_tiled_par<T: MxInput>(
    src: &[T],
    shape: MxShape,
    fmt: ElemFormat,
    rule: ScaleRule,
    out: &mut [u8],
    threads: usize,
) -> Result<(), MxError> {
    shape.validate()?;
    check_len("src", shape.len(), src.len())?;
    check_len("out", shape.tiled_bytes(), out.len())?;
    std::thread::scope(|s| {
        let mut out = out;
        let mut handles = Vec::new();
        for (t0, t1) in split(shape.n_tiles(), threads) {
            let (o, rest) = std::mem::take(&mut out).split_at_mut((t1 - t0) * TILE_BYTES);
            out = rest;
            handles.push(s.spawn(move || encode_tiled_range(src, shape, fmt, rule, t0, t1, o)));
        }
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("encoder thread panicked"))
    })
}

/// [`crate::decode_rows`] on `threads` threads (split by rows).
pub fn decode_rows_par(
    data: &[u8],
    scales: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    out: &mut [f32],
    threads: usize,
) -> Result<(), MxError> {
    check_plane(shape, Plane::Row, out.len(), data.len(), scales.len())?;
    let (cols, cols_p, nb) = (shape.cols, shape.cols_p(), shape.cols_p() / BLOCK);
    std::thread::scope(|s| {
        let mut out = out;
        for (r0, r1) in split(shape.rows, threads) {
            let (o, rest) = std::mem::take(&mut out).split_at_mut((r1 - r0) * cols);
            out = rest;
            let d = &data[r0 * cols_p..r1 * cols_p];
            let sc = &scales[r0 * nb..r1 * nb];
            s.spawn(move || dispatch!(decode_rows_impl(d, sc, cols, fmt, o)));
        }
    });
    Ok(())
}

/// [`crate::decode_tiled`] on `threads` threads (split by tile rows).
pub fn decode_tiled_par(
    src: &[u8],
    shape: MxShape,
    fmt: ElemFormat,
    plane: Plane,
    out: &mut [f32],
    threads: usize,
) -> Result<(), MxError> {
    shape.validate()?;
    check_len("src", shape.tiled_bytes(), src.len())?;
    check_len("out", shape.len(), out.len())?;
    let tcols = shape.tile_cols();
    std::thread::scope(|s| {
        let mut out = out;
        for (a, b) in split(shape.tile_rows(), threads) {
            let (r0, r1) = (a * TILE, (b * TILE).min(shape.rows));
            let (o, rest) = std::mem::take(&mut out).split_at_mut((r1 - r0) * shape.cols);
            out = rest;
            let t0 = a * tcols;
            let tiles = &src[t0 * TILE_BYTES..b * tcols * TILE_BYTES];
            s.spawn(move || dispatch!(decode_tiles_impl(tiles, shape, fmt, plane, t0, o, r0)));
        }
    });
    Ok(())
}
