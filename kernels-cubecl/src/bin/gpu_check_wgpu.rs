//! Device check of every kernel on wgpu (e.g. Mesa's lavapipe: proves the code path, timings are not meaningful): see
//! `sshsdp_kernels::check`. Usage: `gpu_check [--small] [--seed N]`; exit status 0 when every
//! check passes, 1 when one fails, 2 when there is no device.

use std::process::ExitCode;

/// Parses `--small` and `--seed N` (default: the clock).
pub fn args() -> (bool, u64) {
    let args: Vec<String> = std::env::args().collect();
    let small = args.iter().any(|a| a == "--small");
    let seed = args
        .iter()
        .position(|a| a == "--seed")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    (small, seed)
}

fn main() -> ExitCode {
    let (small, seed) = args();
    type R = cubecl::wgpu::WgpuRuntime;
    match sshsdp_kernels::check::try_client::<R>(&Default::default()) {
        Err(why) => {
            eprintln!(
                "gpu_check: no wgpu adapter (install a Vulkan driver, e.g. `apt-get install \
                 mesa-vulkan-drivers libvulkan1`, and set XDG_RUNTIME_DIR to a 0700 \
                 directory)\n  ({why})"
            );
            ExitCode::from(2)
        }
        Ok(client) => match sshsdp_kernels::check::run(client, small, seed) {
            0 => {
                println!("gpu_check: all checks passed");
                ExitCode::SUCCESS
            }
            n => {
                println!("gpu_check: {n} check(s) FAILED");
                ExitCode::from(1)
            }
        },
    }
}
