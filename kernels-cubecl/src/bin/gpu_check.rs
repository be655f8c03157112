//! Device check of every kernel on CUDA (the H200 run of `scripts/gpu_check.sh`): see
//! `sshsdp_kernels::check`. Usage: `gpu_check [--small] [--seed N]`; exit status 0 when every
//! check passes, 1 when one fails, 2 when there is no device.

fn main() -> std::process::ExitCode {
    sshsdp_kernels::check::main::<cubecl::cuda::CudaRuntime>(
        "no CUDA device (needs an NVIDIA GPU and its driver, libcuda.so)",
    )
}
