//! The tiled bucket layout of `sshsdp-mx` in `u32` words: each 32x32 tile is 2112 bytes =
//! 528 words, `[row data 256][row scales 8][col data 256][col scales 8]`.

use sshsdp_mx::{TILE_BYTES, TILE_COL_DATA, TILE_COL_SCALES, TILE_ROW_SCALES};

/// Words per tile (`TILE_BYTES / 4`).
pub const TILE_WORDS: u32 = (TILE_BYTES / 4) as u32;
/// Word offset in a tile of the row-wise data (byte `r * 32 + c`).
pub const ROW_DATA_W: u32 = 0;
/// Word offset in a tile of the 32 row scales.
pub const ROW_SCALES_W: u32 = (TILE_ROW_SCALES / 4) as u32;
/// Word offset in a tile of the column-wise data (byte `c * 32 + r`).
pub const COL_DATA_W: u32 = (TILE_COL_DATA / 4) as u32;
/// Word offset in a tile of the 32 column scales.
pub const COL_SCALES_W: u32 = (TILE_COL_SCALES / 4) as u32;

const _: () = assert!(TILE_BYTES % 4 == 0 && TILE_COL_DATA % 4 == 0);
