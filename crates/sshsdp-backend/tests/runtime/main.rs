//! The backend's own integration tests: `Hsdp<NdArray>` on in-process ranks (threads engine)
//! against plain Burn, each step a few-line SGD through `HsdpRuntime::update` (host slices; no
//! optimizer crate). One binary, one module per area; `common` holds what they share.

mod common;
mod failure;
mod gather;
mod placement;
mod rederive;
mod reduce;
mod update_step;
