#!/usr/bin/env bash
# Device check of the CubeCL kernels (sshsdp-kernels) on an NVIDIA GPU (e.g. one H200): every
# kernel against the CPU references (sshsdp-mx, CPU matmul, AdamW formula) on fresh random
# data, then a table of quantise GB/s against a device-to-device copy (target >= 70%), MXFP8
# matmul TFLOP/s against the f32 GEMM of the same shape, Newton-Schulz step and AdamW rates.
#
# The binary is built beforehand (no Rust toolchain needed on the GPU machine):
#   cargo build --release -p sshsdp-kernels --features cuda,experimental --bin gpu_check
# (`experimental`: the lab kernels' checks too, the tiled layout, MX matmul and Newton-Schulz;
# without it the binary checks the production kernels only: square-block codec and AdamW.)
# and carried over at target/release/gpu_check (or pass its path as $1, or set GPU_CHECK_BIN).
# Extra arguments after the path go to the binary (`--small`, `--seed N`).
#
# cubecl's CUDA runtime loads libcuda and libnvrtc at run time and compiles kernels with NVRTC,
# which needs the CUDA headers (CUDA_PATH/include). This script:
#   1. finds a CUDA_PATH and an NVRTC of the same CUDA release (a toolkit's, links followed;
#      else python3's nvidia.* wheels) and puts NVRTC first on LD_LIBRARY_PATH
#      (scripts/device/cuda_env.sh, which logs nvrtcVersion);
#   3. prints the GPU and library basics;
#   4. runs the binary under timeout ${GPU_CHECK_TIMEOUT:-420} s and copies its output to
#      $OUT/gpu_check.log when OUT is set.
#
# Exit status: the binary's (0 all checks passed, 1 a check failed, 2 no device, 124 timed out),
# or 3 when this script could not set up (binary, CUDA headers or libnvrtc missing).

set -u
set -o pipefail

BIN="${1:-${GPU_CHECK_BIN:-target/release/gpu_check}}"
shift || true
LIMIT="${GPU_CHECK_TIMEOUT:-420}"
LOG="$(mktemp -t gpu_check.XXXXXX.log)"
WORK="$(mktemp -d -t gpu_check_cuda.XXXXXX)"

say() { echo "$@" | tee -a "$LOG"; }

finish() {
    local rc="$1"
    say "== gpu_check: exit status $rc"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$LOG" "$OUT/gpu_check.log"
    fi
    rm -rf "$WORK"
    exit "$rc"
}

say "== gpu_check on $(hostname) at $(date -u +%FT%TZ)"

# --- the binary -------------------------------------------------------------------------------
if [ ! -f "$BIN" ]; then
    say "binary not found: $BIN (build it with: cargo build --release -p sshsdp-kernels --features cuda,experimental --bin gpu_check)"
    finish 3
fi
chmod +x "$BIN" 2>/dev/null || true

# --- CUDA headers and NVRTC (scripts/device/cuda_env.sh) ---------------------------------------
# shellcheck source=device/cuda_env.sh
. "$(dirname "$0")/device/cuda_env.sh"
cuda_env_setup "$WORK/lib" "$LOG" || finish 3

# --- machine basics -----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
        --format=csv 2>&1 | tee -a "$LOG"
else
    say "nvidia-smi not found"
fi

# --- the run ----------------------------------------------------------------------------------
say "== $BIN $* (timeout ${LIMIT}s)"
timeout --kill-after=20 "$LIMIT" "$BIN" "$@" 2>&1 | tee -a "$LOG"
RC="${PIPESTATUS[0]}"
case "$RC" in
    0) say "== all checks passed" ;;
    1) say "== a check FAILED" ;;
    2) say "== no CUDA device" ;;
    124|137) say "== timed out after ${LIMIT}s" ;;
    *) say "== the binary exited with status $RC (crash?)" ;;
esac
finish "$RC"
