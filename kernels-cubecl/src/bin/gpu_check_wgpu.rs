//! Device check of every kernel on wgpu (e.g. Mesa's lavapipe: proves the code path, timings
//! are not meaningful): see `sshsdp_kernels::check`. Usage and exit status as `gpu_check`.

fn main() -> std::process::ExitCode {
    sshsdp_kernels::check::main::<cubecl::wgpu::WgpuRuntime>(
        "no wgpu adapter (install a Vulkan driver, e.g. `apt-get install mesa-vulkan-drivers \
         libvulkan1`, and set XDG_RUNTIME_DIR to a 0700 directory)",
    )
}
