#!/usr/bin/env bash
# Tests of the device scripts' logic that need no GPU (run by .ci/run): the library search of
# cuda_env.sh on fake layouts (a toolkit whose lib64 is a link; NCCL shipped as libnccl.so.2
# only, as in PyTorch's wheel) and the log readers of h200_lib.sh. Exit status 0 when all pass.

set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=cuda_env.sh
. "$HERE/cuda_env.sh"
# shellcheck source=h200_lib.sh
. "$HERE/h200_lib.sh"

T="$(mktemp -d -t device_selftest.XXXXXX)"
trap 'rm -rf "$T"' EXIT
FAILED=0
expect() {
    local what="$1" got="$2" want="$3"
    if [ "$got" = "$want" ]; then
        echo "ok    $what"
    else
        echo "FAIL  $what: got '$got', want '$want'"
        FAILED=1
    fi
}

# --- NCCL from a wheel that ships only libnccl.so.2 ------------------------------------------------
mkdir -p "$T/site/nvidia/nccl/lib"
: >"$T/site/nvidia/nccl/__init__.py"
: >"$T/site/nvidia/nccl/lib/libnccl.so.2"
(
    export PYTHONPATH="$T/site" LD_LIBRARY_PATH=""
    nccl_env_setup "$T/lib" "$T/env.log" >/dev/null || exit 1
    echo "$(readlink -f "$T/lib/libnccl.so") ${LD_LIBRARY_PATH%%:*}"
) >"$T/nccl.out"
expect "libnccl.so links to the wheel's libnccl.so.2, its folder first on the path" \
    "$(cat "$T/nccl.out")" "$(readlink -f "$T/site/nvidia/nccl/lib/libnccl.so.2") $T/lib"
# The link outlives the call (a later process loads from it).
expect "the NCCL link stays after the setup" "$([ -L "$T/lib/libnccl.so" ] && echo kept)" kept

# --- NVRTC in a toolkit whose lib64 is a link ------------------------------------------------------
mkdir -p "$T/cuda/include" "$T/cuda-libs"
: >"$T/cuda/include/cuda_fp16.h"
: >"$T/cuda-libs/libnvrtc.so.13"
ln -s "$T/cuda-libs" "$T/cuda/lib64"
(
    export CUDA_PATH="$T/cuda" PYTHONPATH="$T/empty" LD_LIBRARY_PATH=""
    cuda_env_setup "$T/lib2" "$T/env2.log" >/dev/null || exit 1
    echo "$CUDA_PATH $(readlink -f "$T/lib2/libnvrtc.so")"
) >"$T/cuda.out"
expect "the toolkit's NVRTC is found through its linked lib64" \
    "$(cat "$T/cuda.out")" "$T/cuda $(readlink -f "$T/cuda-libs/libnvrtc.so.13")"
(
    export CUDA_PATH="$T/nowhere" PYTHONPATH="$T/empty" LD_LIBRARY_PATH=""
    cuda_env_setup "$T/lib3" "$T/env3.log" >/dev/null
    echo $?
) >"$T/missing.out"
# Only when no system toolkit is there either (a GPU machine has one).
if [ ! -f /usr/local/cuda/include/cuda_fp16.h ] && [ ! -f /opt/cuda/include/cuda_fp16.h ]; then
    expect "no CUDA: status 3, not a crash" "$(cat "$T/missing.out")" 3
fi

# --- log readers -----------------------------------------------------------------------------------
cat >"$T/train.log" <<'LOG'
model       85.06M parameters; GPT
step     0  loss 5.6000  lr 1.00e-04  51234 tok/s  rss 100 MiB
step    19  loss 2.1000  lr 1.00e-04  123456 tok/s  rss 100 MiB
train loss  5.6000 -> 2.1000 (global batch, first and last step); mean of the last 20 steps 3.0
LOG
expect "rate of the last step line" "$(rate_of "$T/train.log")" 123456
expect "losses" "$(losses_of "$T/train.log")" "5.6000 -> 2.1000"
expect "parameters" "$(params_of "$T/train.log")" 85.06
# 6 · (85.06e6 − 256·768 − 1024·768) + 12 · 12 · 1024 · 768
expect "FLOPs per token" "$(flops_per_token 85.06 768 12 1024)" 617707968
expect "MFU" "$(mfu 100000 617707968)" "6.2 %"
expect "losses within tolerance" "$(close "5.6000 -> 2.1000" "5.6001 -> 2.1040" 1e-3 5e-3)" yes
expect "losses outside tolerance" "$(close "5.6000 -> 2.1000" "5.6000 -> 2.1100" 1e-3 5e-3)" no
expect "a missing loss never agrees" "$(close "" "5.6000 -> 2.1000" 1 1)" no

exit "$FAILED"
