//! Host storage: buffers in host memory, and the views and reads that burn-ndarray lets share
//! them, and the bucket codec run on the host.

pub(crate) mod codec;
pub(crate) mod views;
