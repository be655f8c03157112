#!/usr/bin/env bash
# The GPU check (an H100 or an H200: the table names the device), in one call of the device tool
# (no Rust toolchain there).
# The call itself (command, carry list, timeout) is in docs/LAUNCH.md ("The H200 call").
#
# Stages, most important first (H200_STAGES selects some: names in brackets; default all); each
# runs under its own time cap and under a deadline for the whole script (H200_BUDGET_S, default
# 420 s): a stage that would not fit is skipped, and one that fails or times out leaves the other
# rows. Each row is appended to $OUT/h200.md the moment it is known, with the stage's seconds,
# and the logs are re-packed into $OUT/logs.tgz after every stage: $OUT never holds more than
# these two files (the tool returns at most 8). docs/H200.md has the first call's table.
#
#   0. [baseline] plain Burn as its users run it: the GPT unsharded on burn-cuda's default
#      `Cuda` (fusion and autotune on) against `--no-fusion` (what every earlier GPU figure was
#      measured against); the fused run is the baseline of every ratio below;
#      [uploads] the upload-queue micro-check (`upload_queue`): host memory held by a thread's
#      10 uploads of 256 MiB on cubecl-cuda, without and with the flush lanes now make;
#   1. [kernels] every CubeCL kernel against its CPU reference on fresh data (the square-block
#      MXFP8 codec the runtime uses included), their GB/s against a measured device copy, MX
#      matmul against the f32 GEMM (the lab kernels' rows need `sshsdp-kernels/experimental`
#      in the build below);
#   2. [nccl] NCCL conformance at world 1, with the fault checks (results printed before them;
#      the device path's reductions are Sum-only, Avg must be refused);
#      [ncclmem] NCCL's GPU memory for the runtime's communicators at world 1 (`nccl_memory`:
#      one world communicator, a split sharing its parent's resources, one with its own, the
#      lanes' whole set; per-peer buffers do not exist at one rank, so this row cannot show the
#      world-8 total) and the device a process picks from its launcher
#      (`CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=3` must use GPU 0);
#   3. [ncclgpt] the device path: GPT (12 × 768, seq 1024, batch 8) on Autodiff<Hsdp<Cuda>> (Burn's
#      default fused type) with
#      the runtime's lanes on NCCL (gathers and reductions on CubeCL's buffers, runtime shards
#      on the device): MXFP8 and bf16 runtime, bf16 compute; f32 runtime with --clip 0 against
#      the same GPT unsharded on plain burn-cuda (f32, Burn's AdamW): equal losses, target ratio
#      ≥ 0.97; tokens/s of the last 10 steps, MFU against 989 TFLOP/s, exposed communication,
#      host<->device bytes per step;
#   3b. [launches] the world-1 device step's kernel launches (the whole step and the update),
#      host reads and host syncs, counted from CubeCL's profiling log (scripts/count_launches);
#      the f32 NCCL row above also writes a --trace timeline into the logs;
#   4. [gpt, plain] the staged path: the same on the threads engine (host collectives, device
#      buffers staged through the host), and its price against plain Burn;
#   4b. [peersgpt] the device path above world 1 on one GPU: 2 in-process ranks and a 2×2 mesh
#      sharing GPU 0 exchange its buffers with CubeCL kernels (sshsdp::comm::peers); losses
#      against the staged run, step time against 1 rank;
#   5. the device path's losses against the staged path's, within a tolerance (clipping's norm
#      is summed with atomic adds: not bit-reproducible);
#   6. [torch] PyTorch on the same GPU, same GPT, data and AdamW, over the same last 10 steps:
#      like for like (explicit attention, bf16 autocast), what PyTorch users run (SDPA,
#      torch.compile), f32 with TF32 matmuls (what burn-cubecl's f32 matmul computes);
#   7. [f32] if time is left, ours in f32 compute on the staged path.
#
# CubeCL's PTX cache and autotune cache are on (a cubecl.toml in the work folder, which is every
# binary's working directory): after the first process, the others load their kernels and tuned
# choices instead of compiling and tuning again. Rates are taken over the last 10 of 20 steps,
# after autotune and compilation (the first process of a shape tunes in its first steps).
#
# Build on the x86-64 build machine (one cargo call: one feature set for every binary), stage:
#   cargo build --release -p sshsdp -p sshsdp-kernels -p sshsdp-comm \
#       --features sshsdp/cuda,sshsdp/nccl,sshsdp/wgpu,sshsdp-kernels/cuda,sshsdp-kernels/experimental \
#       --example train_gpt --example nccl_conformance --example nccl_memory \
#       --bin gpu_check --bin gpu_check_wgpu --bin upload_queue
#   scripts/device/h200.sh --stage device-bin   # the binaries, stripped and gzipped (< 64 MiB)
# On the GPU machine:  scripts/device/h200.sh --bin device-bin
# Rehearsal here, on wgpu over lavapipe with a tiny GPT and PyTorch on the CPU (no NCCL):
#   scripts/device/h200.sh --cpu            (binaries from target/release, or --bin DIR)
#
# Sizes (environment): H200_WIDTH (768), H200_LAYERS (12), H200_HEADS (12), H200_SEQ (1024),
# H200_BATCH (8), H200_STEPS (20; rates over the last 10). Exit status: 0 when every stage ran
# and passed, 1 otherwise.

set -u
set -o pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
T0=$(date +%s)

MODE=cuda
BIN_DIR=""
STAGED=(gpu_check gpu_check_wgpu nccl_conformance nccl_memory train_gpt upload_queue)
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --bin) BIN_DIR="$(cd "$2" && pwd)"; shift ;;
        --stage)
            mkdir -p "$2"
            for name in "${STAGED[@]}"; do
                f="$ROOT/target/release/$name"
                [ -f "$f" ] || f="$ROOT/target/release/examples/$name"
                [ -f "$f" ] || { echo "missing $name: build it first (see this script's header)" >&2; exit 1; }
                cp "$f" "$2/$name"
                strip "$2/$name" 2>/dev/null || true
                gzip -9f "$2/$name"
            done
            du -sh "$2"
            exit 0
            ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 1 ;;
    esac
    shift
done

WORK="${H200_WORK:-$(mktemp -d -t h200.XXXXXX)}"
LOGS="$WORK/logs"
mkdir -p "$LOGS" "$WORK/bin"
OUT_DIR="${OUT:-$WORK/out}"
mkdir -p "$OUT_DIR"
TABLE="$OUT_DIR/h200.md"
BUDGET="${H200_BUDGET_S:-420}"

# Binaries: staged (gzipped) ones unpacked into the work folder; else the build's own.
bin() {
    local name="$1"
    if [ -n "$BIN_DIR" ] && [ -f "$BIN_DIR/$name.gz" ]; then
        [ -x "$WORK/bin/$name" ] || { gunzip -c "$BIN_DIR/$name.gz" >"$WORK/bin/$name" && chmod +x "$WORK/bin/$name"; }
        echo "$WORK/bin/$name"
    elif [ -n "$BIN_DIR" ] && [ -f "$BIN_DIR/$name" ]; then
        echo "$BIN_DIR/$name"
    elif [ -f "$ROOT/target/release/$name" ]; then
        echo "$ROOT/target/release/$name"
    else
        echo "$ROOT/target/release/examples/$name"
    fi
}

if [ "$MODE" = cpu ]; then
    WIDTH="${H200_WIDTH:-64}" LAYERS="${H200_LAYERS:-2}" HEADS="${H200_HEADS:-4}"
    SEQ="${H200_SEQ:-64}" BATCH="${H200_BATCH:-4}" STEPS="${H200_STEPS:-12}"
    BACKEND=wgpu HALF=f16 TORCH_DEVICE=cpu
    KERNELS=("$(bin gpu_check_wgpu)" --small)
    PYTHON="${PYTHON:-python3}"
    [ -x /tmp/torchenv/bin/python ] && PYTHON="${PYTHON_CPU:-/tmp/torchenv/bin/python}"
    if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
        XDG_RUNTIME_DIR="$(mktemp -d)" && chmod 700 "$XDG_RUNTIME_DIR" && export XDG_RUNTIME_DIR
    fi
else
    WIDTH="${H200_WIDTH:-768}" LAYERS="${H200_LAYERS:-12}" HEADS="${H200_HEADS:-12}"
    SEQ="${H200_SEQ:-1024}" BATCH="${H200_BATCH:-8}" STEPS="${H200_STEPS:-20}"
    # lavapipe has no bf16: the rehearsal computes in f16 (the same cast-and-view path).
    BACKEND=cuda HALF=bf16 TORCH_DEVICE=cuda
    KERNELS=("$(bin gpu_check)")
    PYTHON="${PYTHON:-python3}"
fi
TRAIN="$(bin train_gpt)"
TEXT="$ROOT/data/corpus.txt"
WARM=$((STEPS > 10 ? STEPS - 10 : STEPS / 2))

# shellcheck source=h200_lib.sh
. "$ROOT/scripts/device/h200_lib.sh"
STATUS=0
declare -A RATE LOSS

# --- the table, the logs, the clock --------------------------------------------------------------
{
    gpu="lavapipe (rehearsal)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
    fi
    echo "## GPU check ($MODE) on ${gpu:-an unnamed GPU}, $(hostname), $(date -u +%FT%TZ)"
    echo
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -n 1)"
        echo
    fi
    echo "GPT ${LAYERS}×${WIDTH}, ${HEADS} heads, seq $SEQ, batch $BATCH, $STEPS steps (rates: the last $((STEPS - WARM))); budget ${BUDGET} s"
    echo
    echo "| check | result | s | notes |"
    echo "|---|---|---|---|"
} >"$TABLE"
row() { echo "| $1 | $2 | $3 | $4 |" | tee -a "$TABLE"; }
# Whether stage $1 is selected (H200_STAGES: space-separated names, default all: baseline
# uploads kernels nccl ncclmem ncclgpt launches gpt peersgpt plain torch f32).
want() { case " ${H200_STAGES:-all} " in *" all "* | *" $1 "*) return 0 ;; *) return 1 ;; esac; }
pack() { tar -czf "$OUT_DIR/logs.tgz" -C "$WORK" logs 2>/dev/null; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# The cap of a stage: its own, or what the deadline leaves (minus a margin for packing up);
# 0 when too little is left to start it.
cap() {
    local own="$1" rest
    rest=$(($(left) - 10))
    if [ "$rest" -lt 20 ]; then echo 0; elif [ "$rest" -lt "$own" ]; then echo "$rest"; else echo "$own"; fi
}
stage_t0=0
begin() { stage_t0=$(date +%s); echo "== [$(($(date +%s) - T0)) s] $1"; }
took() { echo $(($(date +%s) - stage_t0)); }
# Runs "$@" in the work folder under cap $1, its output to log $2; returns its status.
run_capped() {
    local limit="$1" log="$2"
    shift 2
    (cd "$WORK" && timeout -k 10 "$limit" "$@") >"$LOGS/$log" 2>&1
}
trap pack EXIT

# --- environment ---------------------------------------------------------------------------------
# CubeCL reads cubecl.toml from its working directory up: the PTX cache, shared by every
# process of this script (NVRTC runs once per kernel, not once per process).
cat >"$WORK/cubecl.toml" <<EOF
[compilation]
cache = { file = "$WORK/cubecl-cache" }

[autotune]
cache = { file = "$WORK/autotune-cache" }
EOF
NCCL_READY=0
if [ "$MODE" = cuda ]; then
    begin "environment"
    # shellcheck source=cuda_env.sh
    . "$ROOT/scripts/device/cuda_env.sh"
    {
        nvidia-smi 2>&1 | head -n 15
        nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1
    } >"$LOGS/env.log"
    if cuda_env_setup "$WORK/lib" "$LOGS/env.log" >/dev/null; then
        nccl_env_setup "$WORK/lib" "$LOGS/env.log" >/dev/null && NCCL_READY=1
        row "CUDA environment" "ok" "$(took)" "$(sed -n 's/^libnvrtc: .*(nvrtcVersion \(.*\))/NVRTC \1/p' "$LOGS/env.log"); NCCL $([ $NCCL_READY = 1 ] && echo found || echo missing); env.log"
    else
        row "CUDA environment" "FAIL" "$(took)" "env.log"
        STATUS=1
    fi
fi

# --- GPT helpers ---------------------------------------------------------------------------------
MODEL=(--width "$WIDTH" --layers "$LAYERS" --heads "$HEADS" --seq "$SEQ" --batch "$BATCH" --text "$TEXT")
COMMON=(--backend "$BACKEND" --optim adamw --steps "$STEPS" --eval-every 0 --sample-len 0 "${MODEL[@]}")
# One sharded train_gpt run: KEY CAP then its arguments; sets RATE[KEY], LOSS[KEY]; its row.
train_row() {
    local key="$1" own="$2" label="$3" limit rc log="train_$1.log" device comm params
    shift 3
    begin "$label"
    limit=$(cap "$own")
    if [ "$limit" = 0 ]; then
        row "$label" "skipped (time)" 0 ""
        return 1
    fi
    run_capped "$limit" "$log" "$TRAIN" --out "$WORK/run_$key" "$@"
    rc=$?
    grep -E "^(model|sharding|train loss|throughput|memory|device|comm) " "$LOGS/$log"
    RATE[$key]="$(rate_of "$LOGS/$log")"
    LOSS[$key]="$(losses_of "$LOGS/$log")"
    if [ "$rc" != 0 ] || [ -z "${RATE[$key]}" ]; then
        row "$label" "FAIL (exit $rc)" "$(took)" "$(grep -m1 -iE 'error|panick' "$LOGS/$log" | head -c 200); $log"
        STATUS=1
        return 1
    fi
    device="$(sed -n 's/^device *//p' "$LOGS/$log" | sed 's/ (most seen after a step);/;/')"
    comm="$(sed -n 's/^comm *exposed \([0-9.]* ms per step = [0-9.]* %\).*/exposed comm \1/p' "$LOGS/$log")"
    params="$(params_of "$LOGS/$log")"
    local extra=""
    [ -n "$params" ] && extra="MFU $(mfu "${RATE[$key]}" "$(flops_per_token "$params" "$WIDTH" "$LAYERS" "$SEQ")") of 989 TFLOP/s; "
    row "$label" "${RATE[$key]} tokens/s" "$(took)" "loss ${LOSS[$key]}; ${extra}${comm:+$comm; }${device:+$device; }$log"
}

# The unsharded run on plain Burn (f32, Burn's AdamW, no clipping), once: PLAIN_RATE, PLAIN_LOSS.
PLAIN_RATE="" PLAIN_LOSS="" PLAIN_RC=""
plain_run() {
    [ -n "$PLAIN_RC" ] && return
    begin "unsharded on plain Burn"
    local limit
    limit=$(cap 90)
    [ "$limit" = 0 ] && { PLAIN_RC=skipped; return; }
    run_capped "$limit" train_unsharded.log "$TRAIN" --unsharded --out "$WORK/run_unsharded" "${COMMON[@]}"
    PLAIN_RC=$?
    PLAIN_RATE="$(rate_of "$LOGS/train_unsharded.log")"
    PLAIN_LOSS="$(losses_of "$LOGS/train_unsharded.log")"
    row "GPT unsharded on plain burn-$BACKEND (Burn's default: fusion, autotune), f32 compute, Burn's AdamW, no clipping" \
        "${PLAIN_RATE:-FAIL (exit $PLAIN_RC)} tokens/s" "$(took)" "loss ${PLAIN_LOSS:-?}; train_unsharded.log"
}
# The decorator's price: sharded run KEY (f32 runtime, --clip 0: the same arithmetic) against
# the unsharded one; losses must agree, target ratio ≥ 0.97 (sharded step ≤ 1.03×).
price_row() {
    local key="$1" what="$2" agree
    plain_run
    agree="$(close "$PLAIN_LOSS" "${LOSS[$key]:-}" 1e-4 1e-3)"
    local label="sharded ($what) against unsharded plain burn-$BACKEND, f32 compute (tokens/s ratio)"
    if [ "$PLAIN_RC" = 0 ] && [ -n "$PLAIN_RATE" ] && [ -n "${RATE[$key]:-}" ] && [ "$agree" = yes ]; then
        row "$label" "$(awk -v a="${RATE[$key]}" -v b="$PLAIN_RATE" 'BEGIN { printf "%.3f", a / b }')" 0 \
            "target ≥ 0.97; ${RATE[$key]} vs $PLAIN_RATE tokens/s; losses agree (${LOSS[$key]} vs $PLAIN_LOSS)"
    else
        row "$label" "FAIL (loss ${LOSS[$key]:-?} vs ${PLAIN_LOSS:-?})" 0 "train_$key.log, train_unsharded.log"
        STATUS=1
    fi
}

# --- 0. plain Burn as its users run it, and the upload queue -------------------------------------
if want baseline; then
    plain_run
    begin "unsharded on plain Burn without fusion"
    limit=$(cap 90)
    if [ "$limit" = 0 ]; then
        row "GPT unsharded on plain burn-$BACKEND --no-fusion" "skipped (time)" 0 ""
    else
        run_capped "$limit" train_unsharded_nofusion.log "$TRAIN" --unsharded --no-fusion \
            --out "$WORK/run_unsharded_nofusion" "${COMMON[@]}"
        rc=$?
        nofusion="$(rate_of "$LOGS/train_unsharded_nofusion.log")"
        row "GPT unsharded on plain burn-$BACKEND --no-fusion (CubeBackend, autotune on), f32" \
            "${nofusion:-FAIL (exit $rc)} tokens/s" "$(took)" \
            "loss $(losses_of "$LOGS/train_unsharded_nofusion.log"); train_unsharded_nofusion.log"
        if [ -n "$nofusion" ] && [ -n "$PLAIN_RATE" ]; then
            row "plain burn-$BACKEND: fused ÷ unfused (tokens/s)" \
                "$(awk -v a="$PLAIN_RATE" -v b="$nofusion" 'BEGIN { printf "%.3f", a / b }')" 0 \
                "what the old baseline (fusion and autotune off) left out"
        else
            STATUS=1
        fi
    fi
    pack
fi
if ! want uploads; then
    :
elif [ "$MODE" = cuda ]; then
    begin "upload queue"
    limit=$(cap 60)
    run_capped "$limit" uploads.log "$(bin upload_queue)" --count 10 --mib 256
    rc=$?
    cat "$LOGS/uploads.log"
    row "upload queue: RSS held by 10 × 256 MiB uploads from a thread without kernels" \
        "$([ "$rc" = 0 ] && echo bounded || echo "FAIL (exit $rc)")" "$(took)" \
        "$(sed -n 's/^upload queue: //p' "$LOGS/uploads.log"); uploads.log"
    [ "$rc" = 0 ] || STATUS=1
    pack
else
    row "upload queue" "skipped" 0 "needs CUDA (wgpu lanes share the model's stream)"
fi

# --- 1. kernels ----------------------------------------------------------------------------------
if want kernels; then
begin "kernels"
limit=$(cap 100)
if [ "$limit" = 0 ]; then
    row "kernels against the CPU reference" "skipped (time)" 0 ""
else
    run_capped "$limit" kernels.log "${KERNELS[@]}"
    rc=$?
    tail -n 30 "$LOGS/kernels.log"
    if [ "$rc" = 0 ]; then
        row "kernels against the CPU reference" "pass" "$(took)" "$(kernel_summary "$LOGS/kernels.log"); kernels.log"
    else
        row "kernels against the CPU reference" "FAIL (exit $rc)" "$(took)" "kernels.log"
        STATUS=1
    fi
fi
pack
fi

# --- 2. NCCL conformance -------------------------------------------------------------------------
if ! want nccl; then
    :
elif [ "$MODE" = cuda ] && [ "$NCCL_READY" = 1 ]; then
    begin "NCCL conformance"
    limit=$(cap 60)
    if [ "$limit" = 0 ]; then
        row "NCCL conformance, world 1" "skipped (time)" 0 ""
    else
        run_capped "$limit" nccl.log "$(bin nccl_conformance)" 1
        rc=$?
        tail -n 40 "$LOGS/nccl.log"
        if [ "$rc" = 0 ]; then
            row "NCCL conformance, world 1 (fault checks included)" "pass" "$(took)" "$(grep -m1 '^NCCL ' "$LOGS/nccl.log"); nccl.log"
        else
            row "NCCL conformance, world 1 (fault checks included)" "FAIL (exit $rc)" "$(took)" "$(grep -c ' ok$' "$LOGS/nccl.log") checks ok before it stopped; nccl.log"
            STATUS=1
        fi
    fi
    pack
else
    row "NCCL conformance, world 1" "skipped" 0 "$([ "$MODE" = cpu ] && echo 'needs a GPU' || echo 'libnccl not found: env.log')"
fi

# --- 2b. NCCL's memory for the runtime's communicators, and the device a launcher's rank picks -----
if ! want ncclmem; then
    :
elif [ "$MODE" = cuda ] && [ "$NCCL_READY" = 1 ]; then
    begin "NCCL memory"
    limit=$(cap 60)
    if [ "$limit" = 0 ]; then
        row "NCCL memory, world 1" "skipped (time)" 0 ""
    else
        NCCL_RUNTIME_CONNECT=0 run_capped "$limit" nccl_memory.log "$(bin nccl_memory)"
        rc=$?
        cat "$LOGS/nccl_memory.log"
        row "NCCL memory at world 1 (no peers: per-peer buffers absent)" "$([ "$rc" = 0 ] && echo ok || echo "FAIL (exit $rc)")" "$(took)" \
            "$(grep '^|' "$LOGS/nccl_memory.log" | sed 's/^| //; s/ |$//; s/ | /: /' | paste -sd ';' -); nccl_memory.log"
        [ "$rc" = 0 ] || STATUS=1
        begin "device choice"
        CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=3 run_capped 30 device_choice.log "$(bin nccl_memory)" --device-check
        rc=$?
        cat "$LOGS/device_choice.log"
        if [ "$rc" = 0 ] && grep -q "on GPU 0$" "$LOGS/device_choice.log"; then
            row "CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=3 picks GPU 0" "pass" "$(took)" "device_choice.log"
        else
            row "CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=3 picks GPU 0" "FAIL (exit $rc)" "$(took)" "device_choice.log"
            STATUS=1
        fi
    fi
    pack
else
    row "NCCL memory, device choice" "skipped" 0 "$([ "$MODE" = cpu ] && echo 'needs a GPU' || echo 'libnccl not found: env.log')"
fi

# --- 3. the device path: NCCL carrying the step --------------------------------------------------
# The runtime's lanes on NCCL communicators (world 1): bucket all-gathers write CubeCL's device
# buffers, gradients are reduce-scattered where they are, runtime shards live on the device.
if ! want ncclgpt; then
    :
elif [ "$MODE" = cuda ] && [ "$NCCL_READY" = 1 ]; then
    for format in mxfp8 bf16; do
        train_row "${format}_${HALF}_nccl" 150 "GPT on Autodiff<Hsdp<cuda>> over NCCL (device path), $format runtime, $HALF compute" \
            --nccl --ranks 1 --format "$format" --compute "$HALF" "${COMMON[@]}"
        pack
    done
    # --trace: the timeline of every step (docs/TROUBLESHOOTING.md), for the idle gaps left.
    train_row f32_noclip_nccl 90 "GPT on Autodiff<Hsdp<cuda>> over NCCL (device path), f32 runtime, f32 compute, no clipping" \
        --nccl --ranks 1 --format f32 --clip 0 --trace "$LOGS/trace_f32_noclip_nccl.json" "${COMMON[@]}"
    price_row f32_noclip_nccl "NCCL device path, f32 runtime, --clip 0"
    pack
else
    row "GPT over NCCL (device path)" "skipped" 0 "needs a GPU and libnccl"
fi

# --- 3b. [launches] the world-1 device step's kernel launches, host reads and host syncs -----------
# One short run under CubeCL's profiling log with the runtime's update marks (what
# scripts/count_launches does): train_gpt's summary counts the last whole step and its update.
# Profiling synchronises after every kernel: this run counts, it times nothing. Over NCCL where
# it is ready (world 1 makes no collective either way), bf16 and MXFP8 runtime, f32 compute.
if want launches; then
    for format in bf16 mxfp8; do
        label="world-1 device step, $format runtime: launches per step (in the update); host reads; host syncs"
        begin "$label"
        limit=$(cap 120)
        if [ "$limit" = 0 ]; then
            row "$label" "skipped (time)" 0 ""
            continue
        fi
        nccl=()
        [ "$MODE" = cuda ] && [ "$NCCL_READY" = 1 ] && nccl=(--nccl)
        log="launches_$format.log"
        (cd "$WORK" && CUBECL_DEBUG_OPTION=profile-full CUBECL_DEBUG_LOG="$WORK/profile.log" \
            SSHSDP_LAUNCH_MARKS=1 timeout -k 10 "$limit" "$TRAIN" --out "$WORK/run_launches" \
            "${nccl[@]}" --ranks 1 --format "$format" \
            --backend "$BACKEND" --optim adamw --steps 3 --eval-every 0 --sample-len 0 \
            "${MODEL[@]}") >"$LOGS/$log" 2>&1
        rc=$?
        rm -f "$WORK/profile.log"
        launches="$(sed -n 's/^launches *\([0-9]* per step, [0-9]* in the update\).*/\1/p' "$LOGS/$log")"
        reads="$(sed -n 's/^host reads *//p' "$LOGS/$log")"
        if [ "$rc" = 0 ] && [ -n "$launches" ]; then
            row "$label" "$launches" "$(took)" "${reads:-no host reads line}; $log"
        else
            row "$label" "FAIL (exit $rc)" "$(took)" "$(grep -m1 -iE 'error|panick' "$LOGS/$log" | head -c 200); $log"
            STATUS=1
        fi
        pack
    done
fi

# --- 4. the staged path: the threads engine (host collectives; device buffers staged) -------------
if want gpt; then
    for format in bf16 mxfp8; do
        train_row "${format}_$HALF" 150 "GPT on Autodiff<Hsdp<$BACKEND>>, threads engine (staged), $format runtime, $HALF compute" \
            --ranks 1 --staged --format "$format" --compute "$HALF" "${COMMON[@]}"
        pack
    done
    if [ -n "${RATE[bf16_$HALF]:-}" ] && [ -n "${RATE[mxfp8_$HALF]:-}" ]; then
        row "MXFP8 against bf16 runtime parameters (tokens/s), staged, $HALF compute" \
            "$(awk -v a="${RATE[mxfp8_$HALF]}" -v b="${RATE[bf16_$HALF]}" 'BEGIN { printf "%.3f", a / b }')" 0 \
            "world 1: no communication saved (docs/PROJECTION.md has the multi-GPU bytes)"
    fi
fi
if want plain; then
    train_row f32_noclip 90 "GPT on Autodiff<Hsdp<$BACKEND>>, threads engine (staged), f32 runtime, f32 compute, no clipping" \
        --ranks 1 --staged --format f32 --clip 0 "${COMMON[@]}"
    price_row f32_noclip "threads engine, f32 runtime, --clip 0"
    pack
fi

# --- 4b. the device path above world 1 on one GPU: in-process ranks sharing it (peers) ----------
# Two in-process ranks (and a 2×2 mesh) on GPU 0 exchange its buffers with CubeCL kernels
# (sshsdp::comm::peers): device gathers, reductions and rebuilds, runtime shards on the device.
# Losses against the staged run of the same world; step time against world 1.
if want peersgpt; then
    train_row peers_w1 120 "GPT on Autodiff<Hsdp<$BACKEND>>, 1 rank, device path (peers), bf16 runtime, $HALF compute" \
        --ranks 1 --format bf16 --compute "$HALF" "${COMMON[@]}"
    train_row peers_w2 150 "GPT on Autodiff<Hsdp<$BACKEND>>, 2 ranks on one GPU, device path (peers), bf16 runtime, $HALF compute" \
        --ranks 2 --format bf16 --compute "$HALF" "${COMMON[@]}"
    train_row peers_w2_staged 150 "the same, staged through the host (--staged)" \
        --ranks 2 --staged --format bf16 --compute "$HALF" "${COMMON[@]}"
    train_row peers_2x2 200 "GPT on Autodiff<Hsdp<$BACKEND>>, 2x2 mesh on one GPU, device path (peers), bf16 runtime, $HALF compute" \
        --mesh 2x2 --format bf16 --compute "$HALF" "${COMMON[@]}"
    a="${LOSS[peers_w2]:-}" b="${LOSS[peers_w2_staged]:-}"
    if [ -n "$a" ] && [ -n "$b" ] && [ "$(close "$a" "$b" 1e-3 5e-3)" = yes ]; then
        row "peers device path against staged, 2 ranks: losses" "agree" 0 "$a vs $b"
    else
        row "peers device path against staged, 2 ranks: losses" "FAIL" 0 "${a:-?} vs ${b:-?}"
        STATUS=1
    fi
    for key in peers_w2 peers_2x2; do
        if [ -n "${RATE[$key]:-}" ] && [ -n "${RATE[peers_w1]:-}" ]; then
            row "$key against 1 rank on the same GPU (tokens/s ratio)" \
                "$(awk -v a="${RATE[$key]}" -v b="${RATE[peers_w1]}" 'BEGIN { printf "%.3f", a / b }')" 0 \
                "one GPU shared: the ranks' compute serialises; the ratio prices the collectives"
        fi
    done
    pack
fi

# --- 5. the device path against the staged one: same seed, data and model ------------------------
# Losses within a tolerance (clipping's norm is summed with atomic adds: not bit-reproducible).
for format in mxfp8 bf16; do
    a="${LOSS[${format}_${HALF}_nccl]:-}" b="${LOSS[${format}_$HALF]:-}"
    [ -n "$a" ] && [ -n "$b" ] || continue
    if [ "$(close "$a" "$b" 1e-3 5e-3)" = yes ]; then
        row "NCCL device path against the threads engine, $format runtime: losses" "agree" 0 "$a vs $b (tolerance 1e-3 first, 5e-3 last)"
    else
        row "NCCL device path against the threads engine, $format runtime: losses" "FAIL" 0 "$a vs $b"
        STATUS=1
    fi
done

# --- 6. PyTorch ----------------------------------------------------------------------------------
version="$(cd "$WORK" && timeout 60 "$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
TORCH=(--mode single --device "$TORCH_DEVICE" --steps "$STEPS" --warmup "$WARM" --width "$WIDTH"
    --layers "$LAYERS" --heads "$HEADS" --seq "$SEQ" --batch "$BATCH" --text "$TEXT")
# KEY CAP LABEL OURS (the RATE keys to compare with, the first measured) then pytorch_gpt.py's
# options.
torch_row() {
    local key="$1" own="$2" label="$3" ours="$4" limit rc rate ratio="–"
    shift 4
    begin "$label"
    limit=$(cap "$own")
    if [ "$limit" = 0 ]; then
        row "$label" "skipped (time)" 0 ""
        return
    fi
    run_capped "$limit" "torch_$key.log" env PYTHONUNBUFFERED=1 "$PYTHON" "$ROOT/benches/pytorch_gpt.py" "${TORCH[@]}" "$@"
    rc=$?
    tail -n 2 "$LOGS/torch_$key.log"
    rate="$(sed -n 's/^pytorch .*: \([0-9.]*\) tokens\/s.*/\1/p' "$LOGS/torch_$key.log" | tail -n 1)"
    if [ "$rc" = 0 ] && [ -n "$rate" ]; then
        for key in $ours; do
            [ -n "${RATE[$key]:-}" ] || continue
            ratio="$(awk -v a="${RATE[$key]}" -v b="$rate" 'BEGIN { printf "%.3f", a / b }')"
            ours="$key"
            break
        done
        row "$label" "${rate%.*} tokens/s" "$(took)" "ours ($ours) / this: $ratio; torch_$key.log"
    else
        row "$label" "FAIL (exit $rc)" "$(took)" "torch_$key.log"
        STATUS=1
    fi
    pack
}
if want torch; then
torch_row bf16_manual 90 "PyTorch $version eager, bf16 autocast, explicit attention (like for like)" \
    "bf16_${HALF}_nccl bf16_$HALF" --dtype bf16 --attn manual
torch_row bf16_compiled 150 "PyTorch $version torch.compile, bf16 autocast, SDPA (what PyTorch users run)" \
    "bf16_${HALF}_nccl bf16_$HALF" --dtype bf16 --attn sdpa --compile
torch_row f32_tf32 90 "PyTorch $version eager, f32 with TF32 matmuls, explicit attention (like for like)" \
    "f32_noclip_nccl f32_noclip" --dtype f32 --tf32 --attn manual --clip 0
fi

# --- 7. ours in f32 compute, if time is left -----------------------------------------------------
want f32 && for format in bf16 mxfp8; do
    train_row "${format}_f32" 60 "GPT on Autodiff<Hsdp<$BACKEND>>, $format runtime, f32 compute" \
        --ranks 1 --format "$format" --compute f32 "${COMMON[@]}"
    pack
done

# --- timings -------------------------------------------------------------------------------------
{
    echo
    echo "Wall time $(($(date +%s) - T0)) s (budget $BUDGET s); exit status $STATUS."
} | tee -a "$TABLE"
pack
exit "$STATUS"
