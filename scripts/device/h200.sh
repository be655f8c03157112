#!/usr/bin/env bash
# The H200 check of the device issue, in one call (about 8 minutes; no Rust toolchain there):
#
#   1. every CubeCL kernel against its CPU reference on fresh data, with quantise GB/s against a
#      device copy and MX matmul against the f32 GEMM (scripts/gpu_check.sh: gpu_check);
#   2. the NCCL engine's conformance at world 1 (scripts/device/nccl_check.sh);
#   3. a GPT training step on `Autodiff<Hsdp<Cuda>>` (train_gpt --backend cuda: one rank, device
#      storage, AdamW) with bf16 and with MXFP8 runtime parameters, computing in f32 and in bf16
#      (the mixed-precision policy: `--compute bf16`);
#   3a. the same GPT unsharded on plain Burn (train_gpt --unsharded) against one sharded rank
#      doing the same arithmetic (f32 runtime, no clipping): equal losses, and the decorator's
#      price as a tokens/s ratio (target ≥ 0.97);
#   3b. two of those runs again with `--nccl` (the runtime's lanes on NCCL; runtime shards,
#      all-gathers and gradient reductions on CubeCL's device buffers): their losses must equal
#      step 3's;
#   4. the same GPT, data and AdamW in PyTorch on the same GPU, eager and torch.compile, in the
#      same compute dtypes (f32; bf16 through torch.autocast);
#
# and writes one Markdown table of the results to $OUT/h200.md (stdout too); each step's log goes
# to $OUT/ (gpu_check.log, nccl_check.log, train_<format>_<compute>.log, torch.log).
#
# Build the binaries on the x86-64 build machine, then carry the folder:
#   cargo build --release -p sshsdp-kernels --features cuda --bin gpu_check
#   cargo build --release -p sshsdp-comm --features nccl --example nccl_conformance
#   cargo build --release --features cuda,nccl --example train_gpt
#   scripts/device/h200.sh --stage device-bin      # the three binaries there, stripped, gzipped
# On the GPU machine (device tool: carry ["device-bin"]):
#   scripts/device/h200.sh --bin device-bin
# Dry run on this machine, without a GPU: `scripts/device/h200.sh --cpu` builds nothing; it needs
#   cargo build --release -p sshsdp-kernels --bin gpu_check_wgpu
#   cargo build --release --features wgpu --example train_gpt
# and runs the same steps on wgpu (lavapipe) with a tiny GPT and PyTorch on the CPU (NCCL is
# skipped: it needs a GPU).
#
# Sizes (environment): H200_WIDTH (768), H200_LAYERS (12), H200_HEADS (12), H200_SEQ (1024),
# H200_BATCH (8), H200_STEPS (25; ours is timed over its last 10 steps, PyTorch after 5 warm-up
# steps). NCCL cannot put two ranks on
# one GPU, so this is world 1: the MXFP8-vs-bf16 communication gain is a multi-GPU figure (see
# docs/PROJECTION.md), not this table's.
#
# Exit status: 0 when every step ran and every check passed, 1 otherwise.

set -u
set -o pipefail
cd "$(dirname "$0")/../.."

MODE=cuda
BIN_DIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --bin) BIN_DIR="$2"; shift ;;
        --stage)
            mkdir -p "$2"
            for f in target/release/gpu_check target/release/examples/nccl_conformance \
                target/release/examples/train_gpt; do
                [ -f "$f" ] || { echo "missing $f: build it first (see this script's header)" >&2; exit 1; }
                cp "$f" "$2/"
                strip "$2/$(basename "$f")" 2>/dev/null || true
                # Compressed: the device tool carries at most 64 MiB.
                gzip -9f "$2/$(basename "$f")"
            done
            du -sh "$2"
            exit 0
            ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 1 ;;
    esac
    shift
done

# Binaries staged compressed (--stage) are unpacked into a temporary folder first.
if [ -n "$BIN_DIR" ] && compgen -G "$BIN_DIR/*.gz" >/dev/null; then
    UNPACKED="$(mktemp -d -t h200-bin.XXXXXX)"
    for f in "$BIN_DIR"/*.gz; do
        gunzip -c "$f" >"$UNPACKED/$(basename "$f" .gz)" && chmod +x "$UNPACKED/$(basename "$f" .gz)"
    done
    BIN_DIR="$UNPACKED"
fi
OUT_DIR="${OUT:-$(mktemp -d -t h200.XXXXXX)}"
mkdir -p "$OUT_DIR"
if [ "$MODE" = cpu ]; then
    WIDTH="${H200_WIDTH:-64}" LAYERS="${H200_LAYERS:-2}" HEADS="${H200_HEADS:-4}"
    SEQ="${H200_SEQ:-64}" BATCH="${H200_BATCH:-4}" STEPS="${H200_STEPS:-6}"
    WARM=2
    BACKEND=wgpu
    KERNELS="${BIN_DIR:-target/release}/gpu_check_wgpu"
    TRAIN="${BIN_DIR:-target/release/examples}/train_gpt"
    TORCH_DEVICE=cpu
    # Mesa and the Vulkan loader want a private runtime directory.
    if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
        XDG_RUNTIME_DIR="$(mktemp -d)"
        chmod 700 "$XDG_RUNTIME_DIR"
        export XDG_RUNTIME_DIR
    fi
else
    WIDTH="${H200_WIDTH:-768}" LAYERS="${H200_LAYERS:-12}" HEADS="${H200_HEADS:-12}"
    SEQ="${H200_SEQ:-1024}" BATCH="${H200_BATCH:-8}" STEPS="${H200_STEPS:-25}"
    WARM=5
    BACKEND=cuda
    KERNELS="${BIN_DIR:-target/release}/gpu_check"
    TRAIN="${BIN_DIR:-target/release/examples}/train_gpt"
    NCCL="${BIN_DIR:-target/release/examples}/nccl_conformance"
    TORCH_DEVICE=cuda
fi
PYTHON="${PYTHON:-python3}"
[ "$MODE" = cpu ] && [ -x /tmp/torchenv/bin/python ] && PYTHON="${PYTHON_CPU:-/tmp/torchenv/bin/python}"

STATUS=0
ROWS=()
row() { ROWS+=("| $1 | $2 | $3 |"); }

# A pass/fail check: LABEL LOG LINES, then the command (its output goes to $OUT_DIR/LOG, the
# last LINES lines of which are echoed); one table row.
check() {
    local label="$1" log="$2" lines="$3" rc
    shift 3
    echo "== $label: $*"
    "$@" >"$OUT_DIR/$log" 2>&1
    rc=$?
    tail -n "$lines" "$OUT_DIR/$log"
    if [ "$rc" = 0 ]; then
        row "$label" "pass" "$log"
    else
        row "$label" "FAIL (exit $rc)" "$log"
        STATUS=1
    fi
}

# --- 1. kernels (with quantise GB/s against a device copy and MX matmul rates) -----------------
if [ "$MODE" = cpu ]; then
    check "kernels against the CPU reference" gpu_check.log 40 timeout 600 "$KERNELS" --small
else
    check "kernels against the CPU reference" gpu_check.log 40 \
        env OUT="" GPU_CHECK_TIMEOUT=240 scripts/gpu_check.sh "$KERNELS"
fi

# --- 2. NCCL ------------------------------------------------------------------------------------
if [ "$MODE" = cuda ]; then
    check "NCCL conformance, world 1 (with the fault checks)" nccl_check.log 18 \
        env OUT="" NCCL_CHECK_TIMEOUT=120 NCCL_LIBDIR_OUT="$OUT_DIR/nccl_libdir" \
        scripts/device/nccl_check.sh "$NCCL"
else
    row "NCCL conformance, world 1" "skipped (--cpu)" "needs a GPU"
fi

# --- 3. GPT steps on Autodiff<Hsdp<B>> -----------------------------------------------------------
MODEL=(--width "$WIDTH" --layers "$LAYERS" --heads "$HEADS" --seq "$SEQ" --batch "$BATCH")
# tokens/s of the last 10 steps of a train_gpt log (its last "step N ... 12.3k tok/s" line: the
# summary's throughput would count the first steps' kernel compilation), as a plain number.
rate_of() {
    sed -n 's/^step .* \([0-9.]*\)\([kM]\?\) tok\/s.*/\1 \2/p' "$1" | tail -n 1 |
        awk '{ m = ($2 == "k") ? 1e3 : (($2 == "M") ? 1e6 : 1); printf "%.0f", $1 * m }'
}
declare -A RATE
# Runs train_gpt with ARGS, its output to LOG (under the GPU's watchdog wrapper on CUDA).
train() {
    local log="$1"
    shift
    if [ "$MODE" = cuda ]; then
        OUT="" GPU_CHECK_TIMEOUT=240 scripts/gpu_check.sh "$TRAIN" "$@" >"$log" 2>&1
    else
        timeout 600 "$TRAIN" "$@" >"$log" 2>&1
    fi
}
# "A -> B" of a log's train-loss line.
losses_of() { sed -n 's/^train loss *\([0-9.]* -> [0-9.]*\).*/\1/p' "$1"; }
# Compute dtypes: f32, and 16-bit compute (the precision policy): bf16 on CUDA; lavapipe has no
# bf16, so the dry run computes in f16 there (the same cast-and-view path).
if [ "$MODE" = cpu ]; then HALF=f16; else HALF=bf16; fi
for compute in f32 "$HALF"; do
    for format in bf16 mxfp8; do
        key="${format}_$compute"
        log="$OUT_DIR/train_$key.log"
        echo "== train_gpt --backend $BACKEND --format $format --compute $compute"
        args=(--backend "$BACKEND" --ranks 1 --optim adamw --format "$format" --compute "$compute"
            --steps "$STEPS" --eval-every 0 --sample-len 0 --out "$OUT_DIR/run_$key" "${MODEL[@]}")
        train "$log" "${args[@]}"
        rc=$?
        grep -E "^(train loss|throughput|memory|device|backend|sharding) " "$log"
        RATE[$key]="$(rate_of "$log")"
        label="GPT ${LAYERS}×${WIDTH}, seq $SEQ, batch $BATCH on Autodiff<Hsdp<$BACKEND>>, $format runtime, $compute compute"
        if [ "$rc" = 0 ] && [ -n "${RATE[$key]}" ]; then
            loss="$(losses_of "$log")"
            device="$(sed -n 's/^device *//p' "$log")"
            row "$label" "${RATE[$key]} tokens/s (last ≤ 10 steps)" "loss $loss; ${device:+$device; }train_$key.log"
        else
            row "$label" "FAIL (exit $rc)" "train_$key.log"
            STATUS=1
        fi
    done
    if [ -n "${RATE[bf16_$compute]:-}" ] && [ -n "${RATE[mxfp8_$compute]:-}" ]; then
        row "MXFP8 against bf16 runtime parameters (tokens/s), $compute compute" \
            "$(awk -v a="${RATE[mxfp8_$compute]}" -v b="${RATE[bf16_$compute]}" 'BEGIN { printf "%.2f", a / b }')" \
            "world 1: decode cost only, no communication saved"
    fi
done

# --- 3a. the decorator's overhead: the same GPT, data and AdamW unsharded on plain Burn
# (`--unsharded`: no `shard`, Burn's AdamW, f32, no clipping) against one sharded rank with f32
# runtime parameters and no clipping, so both do the same arithmetic: the losses must agree, and
# the tokens/s ratio is the price of sharding at world 1 (target: the sharded step ≤ 1.03× the
# unsharded one, i.e. a ratio ≥ 0.97).
same=(--backend "$BACKEND" --optim adamw --steps "$STEPS" --eval-every 0 --sample-len 0 "${MODEL[@]}")
echo "== train_gpt --backend $BACKEND --unsharded, and --format f32 --clip 0 sharded"
train "$OUT_DIR/train_unsharded.log" --unsharded --out "$OUT_DIR/run_unsharded" "${same[@]}"
rc_plain=$?
train "$OUT_DIR/train_f32_noclip.log" --ranks 1 --format f32 --clip 0 --out "$OUT_DIR/run_f32_noclip" "${same[@]}"
rc_sharded=$?
grep -E "^(train loss|throughput) " "$OUT_DIR/train_unsharded.log" "$OUT_DIR/train_f32_noclip.log"
plain_rate="$(rate_of "$OUT_DIR/train_unsharded.log")"
sharded_rate="$(rate_of "$OUT_DIR/train_f32_noclip.log")"
plain_loss="$(losses_of "$OUT_DIR/train_unsharded.log")"
sharded_loss="$(losses_of "$OUT_DIR/train_f32_noclip.log")"
label="GPT ${LAYERS}×${WIDTH} sharded (f32 runtime, no clipping) against the same GPT unsharded on plain Burn (tokens/s)"
# Same first loss, last loss within 1e-3 (the two runs' kernels may sum in another order).
agree="$(awk -v a="$plain_loss" -v b="$sharded_loss" 'BEGIN {
    split(a, x, " -> "); split(b, y, " -> ");
    d0 = x[1] - y[1]; d1 = x[2] - y[2];
    print (a != "" && b != "" && d0 * d0 <= 1e-8 && d1 * d1 <= 1e-6) ? "yes" : "no" }')"
if [ "$rc_plain" = 0 ] && [ "$rc_sharded" = 0 ] && [ -n "$plain_rate" ] && [ -n "$sharded_rate" ] &&
    [ "$agree" = yes ]; then
    row "$label" "$(awk -v a="$sharded_rate" -v b="$plain_rate" 'BEGIN { printf "%.2f", a / b }')" \
        "target ≥ 0.97; $sharded_rate vs $plain_rate tokens/s; loss $sharded_loss vs $plain_loss; train_f32_noclip.log, train_unsharded.log"
else
    row "$label" "FAIL (exit $rc_sharded/$rc_plain; loss ${sharded_loss:-?} vs ${plain_loss:-?})" \
        "train_f32_noclip.log, train_unsharded.log"
    STATUS=1
fi

# --- 3b. NCCL carrying the training step (world 1: the runtime's lanes on NCCL communicators;
# bucket all-gathers write straight into CubeCL's device buffers, which are decoded in place, and
# device gradients are reduce-scattered where they are). Same seed, data and model as the
# threads-engine runs above, so the losses must agree; the device line must say the collectives
# ran on device memory and the runtime shards were there (each update's piece encoded on the
# device becomes the shard; gathers read it there).
for pair in "bf16 bf16" "mxfp8 f32"; do
    read -r format compute <<<"$pair"
    label="NCCL carries the GPT step (--nccl, world 1), $format runtime, $compute compute"
    if [ "$MODE" != cuda ] || [ ! -s "$OUT_DIR/nccl_libdir" ]; then
        row "$label" "skipped" "needs a GPU and libnccl (step 2)"
        continue
    fi
    key="${format}_${compute}_nccl"
    log="$OUT_DIR/train_$key.log"
    echo "== train_gpt --backend cuda --nccl --format $format --compute $compute"
    LD_LIBRARY_PATH="$(cat "$OUT_DIR/nccl_libdir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        OUT="" GPU_CHECK_TIMEOUT=240 scripts/gpu_check.sh "$TRAIN" --backend cuda --nccl --ranks 1 \
        --optim adamw --format "$format" --compute "$compute" --steps "$STEPS" --eval-every 0 \
        --sample-len 0 --out "$OUT_DIR/run_$key" "${MODEL[@]}" >"$log" 2>&1
    rc=$?
    grep -E "^(train loss|throughput|device) " "$log"
    mine="$(losses_of "$log")"
    host="$(losses_of "$OUT_DIR/train_${format}_$compute.log" 2>/dev/null)"
    device="$(sed -n 's/^device *//p' "$log")"
    if [ "$rc" = 0 ] && [ -n "$mine" ] && [ "$mine" = "$host" ] &&
        grep -q "collectives on device memory" <<<"$device" &&
        grep -q "runtime shards on the device" <<<"$device"; then
        row "$label" "$(rate_of "$log") tokens/s" "loss $mine, equal to the threads-engine run; $device; train_$key.log"
    else
        row "$label" "FAIL (exit $rc; loss ${mine:-?} vs ${host:-?}; ${device:-no device line})" "train_$key.log"
        STATUS=1
    fi
done

# --- 4. PyTorch ---------------------------------------------------------------------------------
TORCH_ARGS=(--mode single --device "$TORCH_DEVICE" --steps "$STEPS" --warmup "$WARM" --width "$WIDTH"
    --layers "$LAYERS" --heads "$HEADS" --seq "$SEQ" --batch "$BATCH")
: >"$OUT_DIR/torch.log"
version="$($PYTHON -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
for dtype in f32 bf16; do
    # Ours in the same compute dtype (bf16 runtime parameters); f16 stands in for bf16 on lavapipe.
    ours_compute="$dtype"
    [ "$dtype" = bf16 ] && ours_compute="$HALF"
    for compiled in "" --compile; do
        kind="eager"
        [ -n "$compiled" ] && kind="torch.compile"
        name="PyTorch $version $kind, $dtype compute"
        echo "== $name"
        timeout 300 "$PYTHON" benches/pytorch_gpt.py "${TORCH_ARGS[@]}" --dtype "$dtype" $compiled \
            >>"$OUT_DIR/torch.log" 2>&1
        rc=$?
        rate="$(sed -n 's/^pytorch .*: \([0-9.]*\) tokens\/s.*/\1/p' "$OUT_DIR/torch.log" | tail -n 1)"
        if [ "$rc" = 0 ] && [ -n "$rate" ]; then
            ours="${RATE[bf16_$ours_compute]:-}"
            ratio="–"
            [ -n "$ours" ] && ratio="$(awk -v a="$ours" -v b="$rate" 'BEGIN { printf "%.2f", a / b }')"
            row "$name, same GPT and AdamW on $TORCH_DEVICE" "${rate%.*} tokens/s" \
                "ours (bf16 runtime, $ours_compute compute) / this: $ratio"
        else
            row "$name" "FAIL (exit $rc)" "torch.log"
            STATUS=1
        fi
    done
done

# --- the table ----------------------------------------------------------------------------------
{
    echo "## H200 check ($MODE) on $(hostname), $(date -u +%FT%TZ)"
    echo
    command -v nvidia-smi >/dev/null 2>&1 &&
        echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)" && echo
    echo "| check | result | notes |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$OUT_DIR/h200.md"
exit "$STATUS"
