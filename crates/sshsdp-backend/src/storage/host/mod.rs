//! Host storage: buffers in host memory, and the views and reads that burn-ndarray lets share
//! them. The host codec is the bucket codec's own execution (`storage/codec.rs`).

pub(crate) mod views;
