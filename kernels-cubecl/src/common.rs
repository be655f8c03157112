//! What the production kernels share with the lab's (`experimental`): the quantisers' input
//! element type and its load, and the launch grids. Production code, so that the runtime's
//! kernels depend on nothing behind the feature.

use cubecl::prelude::*;

/// Element type of the quantiser's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum InputDType {
    /// `f32`, one per word.
    #[default]
    F32,
    /// `bf16`, two per word (element `2i` in the low half), as Burn stores bf16 tensors.
    Bf16,
}

/// Most cubes launched along one grid dimension (wgpu's limit); larger jobs loop.
const MAX_CUBES: u32 = 65_535;

/// Units per cube of the tile kernels: 32 x 8, one tile per cube at a time.
const TILE_CUBE: (u32, u32) = (32, 8);

/// Units per cube of the one-dimensional kernels ([`grid`]).
const UNITS: u32 = 256;

/// `f32` bits of element `idx` of the input (`bf16` widened exactly).
#[cube]
pub(crate) fn load_bits(input: &Array<u32>, idx: u32, #[comptime] bf16: bool) -> u32 {
    if bf16 {
        let w = input[(idx / 2) as usize];
        ((w >> ((idx & 1) * 16)) & 0xFFFF) << 16
    } else {
        input[idx as usize]
    }
}

/// Grid for `n_tiles` tiles: one cube per tile, at most [`MAX_CUBES`] (they loop).
pub(crate) fn tile_grid(n_tiles: u32) -> (CubeCount, CubeDim) {
    let cubes = n_tiles.clamp(1, MAX_CUBES);
    (
        CubeCount::Static(cubes, 1, 1),
        CubeDim::new_2d(TILE_CUBE.0, TILE_CUBE.1),
    )
}

/// Grid of `units` units of [`UNITS`] per cube, at most [`MAX_CUBES`] cubes (they loop).
pub(crate) fn grid(units: usize) -> (CubeCount, CubeDim) {
    let cubes = (units.div_ceil(UNITS as usize) as u32).clamp(1, MAX_CUBES);
    (CubeCount::Static(cubes, 1, 1), CubeDim::new_1d(UNITS))
}
