#!/usr/bin/env bash
# Device check of the CubeCL kernels (sshsdp-kernels) on an NVIDIA GPU (e.g. one H200): every
# kernel against the CPU references (sshsdp-mx, CPU matmul, AdamW formula) on fresh random
# data, then a table of quantise GB/s against a device-to-device copy (target >= 70%), MXFP8
# matmul TFLOP/s against the f32 GEMM of the same shape, Newton-Schulz step and AdamW rates.
#
# The binary is built beforehand (no Rust toolchain needed on the GPU machine):
#   cargo build --release -p sshsdp-kernels --features cuda --bin gpu_check
# and carried over at target/release/gpu_check (or pass its path as $1, or set GPU_CHECK_BIN).
# Extra arguments after the path go to the binary (`--small`, `--seed N`).
#
# cubecl's CUDA runtime loads libcuda and libnvrtc at run time and compiles kernels with NVRTC,
# which needs the CUDA headers (CUDA_PATH/include). This script:
#   1. uses CUDA_PATH, /usr/local/cuda or /opt/cuda when it has include/cuda_fp16.h, else
#      assembles a CUDA_PATH from python3's nvidia.* wheels (include/ and lib/ directories);
#   2. puts the directories holding libnvrtc.so* first on LD_LIBRARY_PATH, with a
#      libnvrtc.so -> libnvrtc.so.N symlink when only the versioned name exists;
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
    say "binary not found: $BIN (build it with: cargo build --release -p sshsdp-kernels --features cuda --bin gpu_check)"
    finish 3
fi
chmod +x "$BIN" 2>/dev/null || true

# --- python nvidia wheels (CUDA 12/13 layouts) ----------------------------------------------------
NV_DIRS=""
if command -v python3 >/dev/null 2>&1; then
    NV_DIRS="$(python3 - <<'PY' 2>/dev/null
import os, site, sys
roots = set()
for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    d = os.path.join(p, "nvidia")
    if os.path.isdir(d):
        roots.add(d)
for r in sorted(roots):
    for dirpath, dirnames, _ in os.walk(r):
        if os.path.basename(dirpath) in ("include", "lib", "lib64"):
            print(dirpath)
            dirnames[:] = []
PY
)"
fi

# --- CUDA headers (CUDA_PATH) -------------------------------------------------------------------
CUDA_DIR=""
for d in "${CUDA_PATH:-}" /usr/local/cuda /opt/cuda; do
    if [ -n "$d" ] && [ -f "$d/include/cuda_fp16.h" ]; then
        CUDA_DIR="$d"
        break
    fi
done
if [ -z "$CUDA_DIR" ]; then
    # merge the wheels' include directories into one CUDA_PATH/include
    mkdir -p "$WORK/cuda/include"
    for d in $NV_DIRS; do
        case "$d" in
            */include)
                for f in "$d"/*; do
                    [ -e "$WORK/cuda/include/$(basename "$f")" ] || ln -s "$f" "$WORK/cuda/include/"
                done
                ;;
        esac
    done
    if [ -f "$WORK/cuda/include/cuda_fp16.h" ]; then
        CUDA_DIR="$WORK/cuda"
    fi
fi
if [ -z "$CUDA_DIR" ]; then
    say "CUDA headers (include/cuda_fp16.h) not found: set CUDA_PATH, install the CUDA toolkit, or pip install nvidia-cuda-runtime and nvidia-cuda-nvrtc wheels"
    finish 3
fi
export CUDA_PATH="$CUDA_DIR"
say "CUDA_PATH=$CUDA_PATH"

# --- libnvrtc -----------------------------------------------------------------------------------
NVRTC=""
for d in "$CUDA_DIR/lib64" "$CUDA_DIR/lib" $NV_DIRS /usr/lib/x86_64-linux-gnu /usr/local/lib /usr/lib64; do
    [ -d "$d" ] || continue
    NVRTC="$(find "$d" -maxdepth 1 -name 'libnvrtc.so*' \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
    [ -n "$NVRTC" ] && break
done
if [ -z "$NVRTC" ]; then
    say "libnvrtc.so not found (looked in CUDA_PATH, python3's nvidia.* wheels and system library directories)"
    finish 3
fi
NVRTC_DIR="$(dirname "$NVRTC")"
mkdir -p "$WORK/lib"
if [ ! -e "$NVRTC_DIR/libnvrtc.so" ]; then
    ln -sf "$(readlink -f "$NVRTC")" "$WORK/lib/libnvrtc.so"
fi
export LD_LIBRARY_PATH="$WORK/lib:$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "libnvrtc: $NVRTC"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# --- machine basics -----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
        --format=csv 2>&1 | tee -a "$LOG"
else
    say "nvidia-smi not found"
fi
say "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so' || echo 'not in ldconfig cache')"

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
