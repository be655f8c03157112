#!/usr/bin/env bash
# NCCL engine check on a GPU machine (one NVIDIA H200, CUDA 13, NCCL from the Python package
# nvidia-nccl-cu13; no Rust toolchain, no network).
#
# The binary is built beforehand on an x86-64 build machine:
#   cargo build --release -p sshsdp-comm --features nccl --example nccl_conformance
# and carried over at target/release/examples/nccl_conformance (or pass its path as $1, or set
# NCCL_CONFORMANCE_BIN).
#
# What it does:
#   1-2. finds libnccl.so.2 (python3's nvidia.nccl package, else site-packages and the usual
#      library folders) and links it as libnccl.so (cudarc loads "libnccl.so", NCCL ships
#      "libnccl.so.2") in $NCCL_LIBDIR (kept) or a temporary folder, first on LD_LIBRARY_PATH
#      (scripts/device/cuda_env.sh);
#   3. prints the GPU, driver and library basics;
#   4. runs the binary with world size ${NCCL_CHECK_WORLD:-1} under timeout
#      ${NCCL_CHECK_TIMEOUT:-420} s, and copies its output to $OUT/ when OUT is set.
#
# Exit status: the binary's (0 all checks passed, 1 a check failed, 2 engine unavailable,
# 124 timed out), or 3 when this script could not set up (binary or libnccl.so.2 missing).

set -u
set -o pipefail

BIN="${1:-${NCCL_CONFORMANCE_BIN:-target/release/examples/nccl_conformance}}"
WORLD="${NCCL_CHECK_WORLD:-1}"
LIMIT="${NCCL_CHECK_TIMEOUT:-420}"
LOG="$(mktemp -t nccl_check.XXXXXX.log)"

say() { echo "$@" | tee -a "$LOG"; }

finish() {
    local rc="$1"
    say "== nccl_check: exit status $rc"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$LOG" "$OUT/nccl_check.log"
    fi
    exit "$rc"
}

say "== nccl_check on $(hostname) at $(date -u +%FT%TZ)"

# --- the binary -------------------------------------------------------------------------------
if [ ! -f "$BIN" ]; then
    say "binary not found: $BIN (build it with: cargo build --release -p sshsdp-comm --features nccl --example nccl_conformance)"
    finish 3
fi
chmod +x "$BIN" 2>/dev/null || true

# --- libnccl (scripts/device/cuda_env.sh) ------------------------------------------------------
# NCCL_LIBDIR: a folder that outlives this script (the link stays for later runs); else a
# temporary one, removed at the end.
# shellcheck source=cuda_env.sh
. "$(dirname "$0")/cuda_env.sh"
LIBDIR="${NCCL_LIBDIR:-}"
[ -z "$LIBDIR" ] && LIBDIR="$(mktemp -d -t nccl_lib.XXXXXX)" && TEMP_LIBDIR="$LIBDIR"
nccl_env_setup "$LIBDIR" "$LOG" || finish 3
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# --- machine basics -----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
        --format=csv 2>&1 | tee -a "$LOG"
    nvidia-smi 2>&1 | head -n 12 | tee -a "$LOG"
else
    say "nvidia-smi not found"
fi
say "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so' || echo 'not in ldconfig cache')"
say "== ldd $BIN"
ldd "$BIN" 2>&1 | tee -a "$LOG"

# --- the run ----------------------------------------------------------------------------------
say "== $BIN $WORLD (timeout ${LIMIT}s)"
timeout --kill-after=20 "$LIMIT" "$BIN" "$WORLD" 2>&1 | tee -a "$LOG"
RC="${PIPESTATUS[0]}"
case "$RC" in
    0) say "== all checks passed" ;;
    1) say "== a check FAILED" ;;
    2) say "== the NCCL engine reported itself unavailable" ;;
    124|137) say "== timed out after ${LIMIT}s" ;;
    *) say "== the binary exited with status $RC (crash?)" ;;
esac
[ -n "${TEMP_LIBDIR:-}" ] && rm -rf "$TEMP_LIBDIR"
finish "$RC"
