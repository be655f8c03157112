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
#   1. finds libnccl.so.2 (python3's nvidia.nccl package, else a search of site-packages and the
#      usual library directories);
#   2. makes a temporary directory holding the symlink libnccl.so -> libnccl.so.2 (cudarc loads
#      "libnccl.so", NCCL ships "libnccl.so.2") and puts it first on LD_LIBRARY_PATH;
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

# --- libnccl.so.2 -------------------------------------------------------------------------------
NCCL_SO=""
if command -v python3 >/dev/null 2>&1; then
    NCCL_SO="$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia.nccl as m
    dirs = list(getattr(m, "__path__", [])) or [os.path.dirname(m.__file__)]
    for d in dirs:
        for c in sorted(glob.glob(os.path.join(d, "lib", "libnccl.so*"))):
            if os.path.basename(c).startswith("libnccl.so.2"):
                print(c)
                raise SystemExit
except ImportError:
    pass
PY
)"
    if [ -z "$NCCL_SO" ]; then
        SITES="$(python3 -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")]))' 2>/dev/null)"
        for d in $SITES; do
            [ -d "$d" ] || continue
            NCCL_SO="$(find "$d" -name 'libnccl.so.2*' \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
            [ -n "$NCCL_SO" ] && break
        done
    fi
fi
if [ -z "$NCCL_SO" ]; then
    for d in /usr/lib/x86_64-linux-gnu /usr/local/lib /usr/lib64 /usr/local/cuda/lib64 /opt; do
        [ -d "$d" ] || continue
        NCCL_SO="$(find "$d" -name 'libnccl.so.2*' \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
        [ -n "$NCCL_SO" ] && break
    done
fi
if [ -z "$NCCL_SO" ]; then
    say "libnccl.so.2 not found (looked in python3's nvidia.nccl, site-packages and system library directories)"
    finish 3
fi
say "libnccl.so.2: $NCCL_SO"

LIBDIR="$(mktemp -d -t nccl_lib.XXXXXX)"
ln -sf "$(readlink -f "$NCCL_SO")" "$LIBDIR/libnccl.so"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# For callers that run other NCCL binaries afterwards (h200.sh's --nccl training step).
[ -n "${NCCL_LIBDIR_OUT:-}" ] && echo "$LIBDIR" >"$NCCL_LIBDIR_OUT"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

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
rm -rf "$LIBDIR"
finish "$RC"
