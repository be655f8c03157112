//! A bucket's whole runtime codec in one launch: the decode of every square-block MXFP8
//! rectangle and bf16 run of a gathered bucket into its `f32` compute buffer is one kernel
//! launch, and the encode of a piece two (every rectangle's scales, then every data word and
//! bf16 word), where [`dequantize_square`](crate::dequantize_square) and friends take one or two
//! launches per rectangle or run.
//!
//! Kernels cannot take tables of pointers (wgpu has no raw addresses), so the operations are a
//! table of 32-bit words on the device ([`CodecTable`]): one row per [`CodecEntry`] with where its
//! work starts in each launch. Every unit finds its row by a binary search over those starts
//! (a few dozen rows per bucket: five or six reads, cached), then does what the single-rectangle
//! kernels do for one value or word — the same `#[cube]` functions (`square.rs`, `bf16.rs`), so
//! the bits are theirs.

use cubecl::prelude::*;
use cubecl::server::Handle;
use sshsdp_mx::ScaleRule;

use crate::bf16::{narrow_bf16_word, widen_bf16_bits};
use crate::common::{grid, tile_grid};
use crate::error::{check_size, checked_shape, to_u32, KernelError};
use crate::square::{
    check_square_extents, square_data_word, square_scale_word, square_value_bits,
    square_value_index, SquareArgs, SquareAt,
};

/// One operation of a bucket's codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodecEntry {
    /// A square-block MXFP8 rectangle (as [`quantize_square`](crate::quantize_square) and
    /// [`dequantize_square`](crate::dequantize_square) take it; its input is `f32`).
    Square(SquareAt),
    /// A run of `n` bf16 values from byte `byte` of the byte buffer (even; a multiple of 4 to
    /// encode) and `f32` values from element `values`, as
    /// [`widen_bf16`](crate::widen_bf16) and [`narrow_bf16`](crate::narrow_bf16) take it.
    Bf16 {
        /// First byte.
        byte: usize,
        /// Number of values.
        n: usize,
        /// First `f32` element.
        values: usize,
    },
}

/// Words per table row.
const ROW: u32 = 10;
/// Row kinds (word 0).
const SQUARE: u32 = 0;
const BF16: u32 = 1;
/// Words 7, 8 and 9 of a row: its first item in the decode (values), in the encode's scales
/// launch (scale words) and in its data launch (data words and bf16 words).
const FIRST_VALUE: u32 = 7;
const FIRST_SCALE: u32 = 8;
const FIRST_DATA: u32 = 9;

/// A bucket's codec operations uploaded to the device (see the module docs): made once, used by
/// any number of [`decode_table`] or [`encode_table`] launches on its client's device. Entries
/// run in parallel, so no two may write the same value (decode) or word (encode): where they
/// did, the result would depend on the order of the writes (the plan's views never share one).
pub struct CodecTable {
    handle: Handle,
    rows: u32,
    /// Items of each launch: values decoded, scale words, data words.
    values: u32,
    scale_words: u32,
    data_words: u32,
    /// Bytes of the byte buffer and `f32` elements of the values buffer the entries reach.
    bytes_end: u64,
    values_end: u64,
    /// Whether every bf16 run starts on a word (what the encode needs).
    runs_on_words: bool,
}

impl CodecTable {
    /// Checks `entries` (shapes, 32-bit ranges, each rectangle's data apart from its scales)
    /// and uploads them to `client`'s device.
    pub fn new<R: Runtime>(
        client: &ComputeClient<R>,
        entries: &[CodecEntry],
    ) -> Result<Self, KernelError> {
        let mut words = Vec::with_capacity(entries.len() * ROW as usize);
        let (mut values, mut scale_words, mut data_words) = (0u64, 0u64, 0u64);
        let (mut bytes_end, mut values_end, mut runs_on_words) = (0u64, 0u64, true);
        for entry in entries {
            let row = match *entry {
                CodecEntry::Square(at) => {
                    let Some(shape) = checked_shape(at.rows, at.cols)? else {
                        continue;
                    };
                    let (bytes, end) = check_square_extents(&at)?;
                    bytes_end = bytes_end.max(bytes);
                    values_end = values_end.max(end);
                    let (data, scales) = at.words();
                    let row = [
                        SQUARE,
                        to_u32("rows", at.rows as u64)?,
                        to_u32("cols", at.cols as u64)?,
                        to_u32("values_offset", at.values_offset as u64)?,
                        to_u32("values_stride", at.values_stride as u64)?,
                        to_u32("data_word", at.data_word as u64)?,
                        to_u32("scales_word", at.scales_word as u64)?,
                    ];
                    let items = (shape.len() as u64, scales as u64, data as u64);
                    (row, items)
                }
                CodecEntry::Bf16 { byte, n, values } => {
                    if n == 0 {
                        continue;
                    }
                    if byte % 2 != 0 {
                        return Err(KernelError::Shape(format!(
                            "bf16 values start on an even byte, not {byte}"
                        )));
                    }
                    runs_on_words &= byte % 4 == 0;
                    let words_end = (byte / 2 + n).div_ceil(2) as u64;
                    bytes_end = bytes_end.max(4 * words_end);
                    values_end = values_end.max((values + n) as u64);
                    to_u32("bf16 run words", words_end)?;
                    let row = [
                        BF16,
                        to_u32("bf16 run length", n as u64)?,
                        0,
                        to_u32("bf16 run values", (values + n) as u64)? - n as u32,
                        0,
                        (byte / 2) as u32,
                        0,
                    ];
                    (row, (n as u64, 0, n.div_ceil(2) as u64))
                }
            };
            let (row, (v, s, d)) = row;
            words.extend(row);
            words.extend([
                to_u32("values in the table", values)?,
                to_u32("scale words in the table", scale_words)?,
                to_u32("data words in the table", data_words)?,
            ]);
            (values, scale_words, data_words) = (values + v, scale_words + s, data_words + d);
        }
        to_u32("values end", values_end)?;
        let rows = (words.len() / ROW as usize) as u32;
        // An empty table still gets a buffer (never read: nothing is launched).
        words.resize(words.len().max(1), 0);
        Ok(Self {
            handle: client.create_from_slice(u32::as_bytes(&words)),
            rows,
            values: to_u32("values in the table", values)?,
            scale_words: to_u32("scale words in the table", scale_words)?,
            data_words: to_u32("data words in the table", data_words)?,
            bytes_end,
            values_end,
            runs_on_words,
        })
    }

    /// Number of entries (empty ones left out).
    pub fn len(&self) -> usize {
        self.rows as usize
    }

    /// Whether there is nothing to launch.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The table's words as a kernel argument.
    fn arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY (at the launches): the kernels read rows below `self.rows` only.
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), (self.rows * ROW).max(1) as usize) }
    }
}

/// The row of `table` whose items (counted from word `field`) hold `item`: the last row whose
/// first item is at most `item` (rows with no items never are, below the total).
#[cube]
fn row_of(table: &Array<u32>, rows: u32, item: u32, #[comptime] field: u32) -> u32 {
    let mut lo = 0u32;
    let mut hi = rows;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if table[(mid * ROW + field) as usize] <= item {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Row `e`'s rectangle.
#[cube]
fn square_of(table: &Array<u32>, e: u32) -> SquareArgs {
    let b = e * ROW;
    SquareArgs {
        rows: table[(b + 1) as usize],
        cols: table[(b + 2) as usize],
        values_offset: table[(b + 3) as usize],
        values_stride: table[(b + 4) as usize],
        data_word: table[(b + 5) as usize],
        scales_word: table[(b + 6) as usize],
    }
}

/// Where value `local` of row `e` goes in the values buffer.
#[cube]
fn decoded_index(table: &Array<u32>, e: u32, local: u32) -> u32 {
    let b = e * ROW;
    if table[b as usize] == SQUARE {
        square_value_index(square_of(table, e), local)
    } else {
        // A bf16 run's values are consecutive from word 3.
        table[(b + 3) as usize] + local
    }
}

/// The `f32` bits of value `local` of row `e`, decoded from `src`.
#[cube]
fn decoded_bits(table: &Array<u32>, src: &Array<u32>, e: u32, local: u32) -> u32 {
    let b = e * ROW;
    if table[b as usize] == SQUARE {
        square_value_bits(src, square_of(table, e), local)
    } else {
        widen_bf16_bits(src, table[(b + 5) as usize] + local)
    }
}

/// Decode: values `i, i + stride, ...` of every row, into `O`: the decoded `f32` bits as they
/// are where `bits` (`O = u32`: NaN payloads kept), else each value converted as a cast does
/// (`O` a 16-bit float).
#[cube(launch_unchecked)]
fn decode_table_kernel<O: CubePrimitive>(
    table: &Array<u32>,
    src: &Array<u32>,
    out: &mut Array<O>,
    rows: u32,
    total: u32,
    #[comptime] bits: bool,
) {
    let mut i = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while i < total {
        let e = row_of(table, rows, i, FIRST_VALUE);
        let local = i - table[(e * ROW + FIRST_VALUE) as usize];
        let decoded = decoded_bits(table, src, e, local);
        let at = decoded_index(table, e, local) as usize;
        if bits {
            out[at] = O::reinterpret(decoded);
        } else {
            out[at] = O::cast_from(f32::reinterpret(decoded));
        }
        i += stride;
    }
}

/// Encode, first launch: one cube per scale word of every rectangle.
#[cube(launch_unchecked)]
fn table_scales_kernel(
    table: &Array<u32>,
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    total: u32,
    #[comptime] rceil: bool,
) {
    let mut partial = SharedMemory::<u32>::new(1024usize);
    let mut w = CUBE_POS as u32;
    let stride = CUBE_COUNT as u32;
    while w < total {
        let e = row_of(table, rows, w, FIRST_SCALE);
        let local = w - table[(e * ROW + FIRST_SCALE) as usize];
        square_scale_word(
            input,
            out,
            &mut partial,
            square_of(table, e),
            local,
            rceil,
            false,
        );
        w += stride;
    }
}

/// Encode, second launch: every data word of every rectangle and every word of every bf16 run.
#[cube(launch_unchecked)]
fn table_data_kernel(
    table: &Array<u32>,
    input: &Array<u32>,
    out: &mut Array<u32>,
    rows: u32,
    total: u32,
) {
    let mut w = CUBE_POS as u32 * CUBE_DIM + UNIT_POS;
    let stride = CUBE_COUNT as u32 * CUBE_DIM;
    while w < total {
        let e = row_of(table, rows, w, FIRST_DATA);
        let b = e * ROW;
        let local = w - table[(b + FIRST_DATA) as usize];
        if table[b as usize] == SQUARE {
            square_data_word(input, out, square_of(table, e), local, false);
        } else {
            let n = table[(b + 1) as usize];
            let dst_word = table[(b + 5) as usize] / 2;
            narrow_bf16_word(input, out, n, table[(b + 3) as usize], dst_word, local);
        }
        w += stride;
    }
}

/// The element type [`decode_table`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeTo {
    /// `f32`: the decoded bits as they are.
    F32,
    /// `f16`, each decoded `f32` converted as a cast kernel converts it (CubeCL's `cast_from`:
    /// what Burn's cast runs), so decoding to `f16` equals decoding to `f32` and casting.
    F16,
    /// `bf16`, likewise (devices with bf16 storage: CUDA).
    Bf16,
}

impl DecodeTo {
    /// Bytes of one value.
    fn bytes(self) -> u64 {
        match self {
            DecodeTo::F32 => 4,
            DecodeTo::F16 | DecodeTo::Bf16 => 2,
        }
    }
}

/// Decodes every entry of `table` from the byte buffer `src` into the values of `out`, of
/// type `to` (values no entry reaches untouched), in one launch: in `f32`, bits equal to
/// [`dequantize_square`](crate::dequantize_square) and [`widen_bf16`](crate::widen_bf16)
/// entry by entry; in 16 bits, those values cast.
pub fn decode_table<R: Runtime>(
    client: &ComputeClient<R>,
    table: &CodecTable,
    src: &Handle,
    out: &Handle,
    to: DecodeTo,
) -> Result<(), KernelError> {
    if table.values == 0 {
        return Ok(());
    }
    check_size("src", src, table.bytes_end)?;
    check_size("out", out, to.bytes() * table.values_end)?;
    let (count, dim) = grid(table.values as usize);
    let src_words = (src.size_in_used() as usize).div_ceil(4);
    let out_len = (out.size_in_used() / to.bytes()) as usize;
    // SAFETY: every row's extents were checked against 32-bit indexing when the table was made
    // and are below the buffers' checked sizes (`src`'s last word may be half used).
    unsafe {
        let table_arg = table.arg::<R>();
        let src = ArrayArg::from_raw_parts(src.clone(), src_words);
        let out = ArrayArg::from_raw_parts(out.clone(), out_len);
        let (rows, total) = (table.rows, table.values);
        match to {
            DecodeTo::F32 => decode_table_kernel::launch_unchecked::<u32, R>(
                client, count, dim, table_arg, src, out, rows, total, true,
            ),
            DecodeTo::F16 => decode_table_kernel::launch_unchecked::<half::f16, R>(
                client, count, dim, table_arg, src, out, rows, total, false,
            ),
            DecodeTo::Bf16 => decode_table_kernel::launch_unchecked::<half::bf16, R>(
                client, count, dim, table_arg, src, out, rows, total, false,
            ),
        }
    }
    Ok(())
}

/// Encodes the `f32` values of `input` into every entry of `table` in the byte buffer `out`
/// with scale rule `rule` (words no entry writes untouched), in two launches: bits equal to
/// [`quantize_square`](crate::quantize_square) and [`narrow_bf16`](crate::narrow_bf16) entry by
/// entry. Every bf16 run must start on a word.
pub fn encode_table<R: Runtime>(
    client: &ComputeClient<R>,
    table: &CodecTable,
    rule: ScaleRule,
    input: &Handle,
    out: &Handle,
) -> Result<(), KernelError> {
    if !table.runs_on_words {
        return Err(KernelError::Shape(
            "a bf16 run to encode does not start on a word".into(),
        ));
    }
    if table.data_words == 0 {
        return Ok(());
    }
    check_size("input", input, 4 * table.values_end)?;
    check_size("out", out, table.bytes_end)?;
    let input_words = input.size_in_used() as usize / 4;
    let out_words = out.size_in_used() as usize / 4;
    if table.scale_words > 0 {
        let (count, dim) = tile_grid(table.scale_words);
        // SAFETY: as in `decode_table`.
        unsafe {
            table_scales_kernel::launch_unchecked::<R>(
                client,
                count,
                dim,
                table.arg::<R>(),
                ArrayArg::from_raw_parts(input.clone(), input_words),
                ArrayArg::from_raw_parts(out.clone(), out_words),
                table.rows,
                table.scale_words,
                rule == ScaleRule::Rceil,
            );
        }
    }
    let (count, dim) = grid(table.data_words as usize);
    // SAFETY: as above; the scales this launch reads were written by the one before it on the
    // same stream.
    unsafe {
        table_data_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            table.arg::<R>(),
            ArrayArg::from_raw_parts(input.clone(), input_words),
            ArrayArg::from_raw_parts(out.clone(), out_words),
            table.rows,
            table.data_words,
        );
    }
    Ok(())
}
