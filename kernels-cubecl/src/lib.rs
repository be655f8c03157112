//! CubeCL kernels for SS-HSDP, generic over the CubeCL runtime (`wgpu` and `cuda` features).
//!
//! WIP
mod adamw;
pub mod check;
mod dequantize;
pub mod e4m3;
mod error;
mod gemm;
pub mod layout;
mod matmul;
mod newton_schulz;
mod quantize;

pub use adamw::{adamw_reference, adamw_step, AdamWFactors, AdamWParams};
pub use dequantize::dequantize_tiled;
pub use error::KernelError;
pub use gemm::{gemm, MatRef};
pub use matmul::mx_matmul;
pub use newton_schulz::{newton_schulz, ns_step, NsWorkspace, NS_COEFFICIENTS, NS_EPS};
pub use quantize::{quantize_tiled, InputDType};
pub use sshsdp_mx::{Plane, ScaleRule};
