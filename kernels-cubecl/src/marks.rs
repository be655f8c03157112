//! Marks in a device queue for counting launches: two one-element kernels whose names stand
//! out in CubeCL's profiling log (`CUBECL_DEBUG_OPTION=profile-full`), launched by the backend
//! around an update when `SSHSDP_LAUNCH_MARKS=1` (`scripts/count_launches` counts the kernels
//! between them). Never launched otherwise.

use cubecl::prelude::*;
use cubecl::server::Handle;

/// Which mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchMark {
    /// Before an update's first kernel.
    UpdateBegin,
    /// After an update's last kernel.
    UpdateEnd,
}

#[cube(launch)]
fn sshsdp_mark_update_begin(out: &mut Array<u32>) {
    if ABSOLUTE_POS == 0 {
        out[0] = 1;
    }
}

#[cube(launch)]
fn sshsdp_mark_update_end(out: &mut Array<u32>) {
    if ABSOLUTE_POS == 0 {
        out[0] = 2;
    }
}

/// Launches `mark` on `client`'s stream, writing into `scratch` (4 bytes).
pub fn launch_mark<R: Runtime>(client: &ComputeClient<R>, scratch: &Handle, mark: LaunchMark) {
    let (count, dim) = (CubeCount::Static(1, 1, 1), CubeDim::new_1d(1));
    // SAFETY: one unit writes element 0 of a 4-byte buffer.
    let out = unsafe { ArrayArg::from_raw_parts(scratch.clone(), 1) };
    match mark {
        LaunchMark::UpdateBegin => sshsdp_mark_update_begin::launch::<R>(client, count, dim, out),
        LaunchMark::UpdateEnd => sshsdp_mark_update_end::launch::<R>(client, count, dim, out),
    }
}
