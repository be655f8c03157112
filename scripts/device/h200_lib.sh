# Sourced by scripts/device/h200.sh (and tested by scripts/device/selftest.sh): reading the
# numbers out of train_gpt's and the table's logs. Pure functions of their arguments.

# Tokens/s over the last (up to) 10 steps: the last "step N ... R tok/s" line of log $1.
rate_of() { sed -n 's/^step .* \([0-9.]*\) tok\/s.*/\1/p' "$1" | tail -n 1; }

# "first -> last" of log $1's train-loss line.
losses_of() { sed -n 's/^train loss *\([0-9.]* -> [0-9.]*\).*/\1/p' "$1"; }

# The model's parameters in millions, from log $1's "model" line.
params_of() { sed -n 's/^model *\([0-9.]*\)M parameters.*/\1/p' "$1" | head -n 1; }

# Model FLOPs per token of the byte-level GPT: 6 · non-embedding parameters + 12 · layers ·
# seq · width (attention scores and values, forward and backward: PaLM's count, no causal
# discount). Arguments: parameters in millions, width, layers, seq.
flops_per_token() {
    awk -v p="$1" -v w="$2" -v l="$3" -v s="$4" \
        'BEGIN { printf "%.0f", 6 * (p * 1e6 - 256 * w - s * w) + 12 * l * s * w }'
}

# Model-FLOPs utilisation of $1 tokens/s at $2 FLOPs per token against the H200's dense bf16
# peak (989 TFLOP/s).
mfu() { awk -v r="$1" -v f="$2" 'BEGIN { printf "%.1f %%", 100 * r * f / 989e12 }'; }

# "yes" when two "first -> last" loss strings agree within $3 (first) and $4 (last), else "no".
close() {
    awk -v a="$1" -v b="$2" -v t0="$3" -v t1="$4" 'BEGIN {
        if (a == "" || b == "") { print "no"; exit }
        split(a, x, " -> "); split(b, y, " -> ");
        d0 = x[1] - y[1]; d1 = x[2] - y[2]; if (d0 < 0) d0 = -d0; if (d1 < 0) d1 = -d1;
        print (d0 <= t0 && d1 <= t1) ? "yes" : "no" }'
}

# One line from gpu_check's log $1: the checks passed, and the copy and square-block kernels'
# rates ("d2d copy 4000 GB/s; quantize_square 81% of copy; ...").
kernel_summary() {
    local ok fails
    ok="$(grep -c '^check .* ok ' "$1")"
    fails="$(grep -c '^check .* FAIL ' "$1")"
    printf '%s checks ok, %s failed' "$ok" "$fails"
    awk '/^perf   (d2d copy|quantize_square|dequantize_square|mx_matmul)/ {
        line = $0; sub(/^perf +/, "", line); gsub(/   */, " ", line); sub(/ $/, "", line); printf "; %s", line }' "$1"
}
