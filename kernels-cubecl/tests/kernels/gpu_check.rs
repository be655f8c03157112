//! The device check (`sshsdp_kernels::check`, behind the `gpu_check` binaries) at small sizes
//! on wgpu: proves its code path and correctness checks on every CI run (the lab kernels'
//! checks too with `experimental`, as CI builds it).
#[test]
fn device_check_passes_on_wgpu() {
    let failures = sshsdp_kernels::check::run(crate::common::client(), true, 0x5EED_0301);
    assert_eq!(failures, 0, "gpu_check reported {failures} failed check(s)");
}
