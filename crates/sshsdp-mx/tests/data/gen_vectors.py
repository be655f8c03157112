#!/usr/bin/env python3
"""Independent MXFP8 test vectors for the `sshsdp-mx` crate.

Element rounding uses ml_dtypes' float8_e4m3fn / float8_e5m2 casts (round-to-nearest-even;
the cast does not saturate, so values are clipped to +-max first: "satfinite"); the E8M0
scale exponent uses numpy (log2 / frexp). The 2-D layouts (row plane, column plane, tiled
bucket layout) are re-implemented here from their written specification.

Conventions shared with the crate (documented in its lib.rs):
  * all-zero block: scale byte 0x00, elements +-0 (sign of zero kept);
  * block containing NaN or +-inf: scale byte 0xFF, every element the NaN byte
    (0x7F for E4M3, 0x7E for E5M2).

Deterministic (fixed seed). Regenerate with:
    pip install numpy ml_dtypes
    python3 crates/sshsdp-mx/tests/data/gen_vectors.py > crates/sshsdp-mx/tests/data/vectors.json
"""

import json
import sys

import ml_dtypes
import numpy as np

SEED = 20240611
BLOCK = 32

FORMATS = {
    # name: (ml_dtypes type, max normal, emax, NaN byte)
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8, 0x7F),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15, 0x7E),
}
RULES = ("rceil", "floor")


def scale_exp(amax, fmt, rule):
    """Unbiased E8M0 exponent for a finite amax (float64), before clamping."""
    _, mx, emax, _ = FORMATS[fmt]
    if amax == 0.0:
        return -127  # log2(0) = -inf clamps to the minimum
    if rule == "rceil":
        q = amax / mx
        e = int(np.ceil(np.log2(q)))
        # cross-check with an exact frexp-based ceil(log2(q)); q = m * 2^ex, m in [0.5, 1)
        m, ex = np.frexp(q)
        exact = int(ex) - 1 if m == 0.5 else int(ex)
        assert e == exact, (amax, fmt, e, exact)
        return e
    e = int(np.floor(np.log2(amax)))
    m, ex = np.frexp(amax)
    assert e == int(ex) - 1, (amax, e, ex)
    return e - emax


def encode_block(x32, fmt, rule):
    """Returns (scale byte, element bytes uint8[32], decoded float32[32])."""
    dtype, mx, _, nan_byte = FORMATS[fmt]
    x = x32.astype(np.float64)
    if np.any(np.isnan(x)) or np.any(np.isinf(x)):
        q = np.full(BLOCK, nan_byte, dtype=np.uint8)
        return 0xFF, q, np.full(BLOCK, np.nan, dtype=np.float32)
    amax = float(np.max(np.abs(x)))
    s = int(np.clip(scale_exp(amax, fmt, rule) + 127, 0, 254))
    scale = 2.0 ** (s - 127)
    # x / scale is exact (power-of-two scale). ml_dtypes converts float64 through float32,
    # which is exact here except for magnitudes far below the element subnormals (-> +-0).
    y = np.clip(x / scale, -mx, mx)
    q8 = y.astype(dtype)
    q = q8.view(np.uint8)
    with np.errstate(over="ignore"):
        dec = (q8.astype(np.float64) * scale).astype(np.float32)
    return s, q, dec


def hex_f32(a):
    return "".join(f"{v:08x}" for v in np.asarray(a, dtype=np.float32).view(np.uint32))


def hex_u8(a):
    return bytes(np.asarray(a, dtype=np.uint8)).hex()


def to_bf16(a):
    """Round float32 values to bf16 (RNE via ml_dtypes) and back to float32."""
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def f32(vals):
    a = np.zeros(BLOCK, dtype=np.float32)
    v = np.asarray(vals, dtype=np.float32)
    a[: len(v)] = v
    return a


def representable(fmt):
    """Sorted non-negative finite values of a format (float64)."""
    dtype = FORMATS[fmt][0]
    v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    v = v[np.isfinite(v) & (v >= 0)]
    return np.unique(v)


def make_blocks(rng):
    blocks = []

    def add(name, x, kind="f32"):
        x = np.asarray(x, dtype=np.float32)
        assert x.shape == (BLOCK,)
        if kind == "bf16":
            assert np.array_equal(
                to_bf16(x).view(np.uint32), x.view(np.uint32)
            ) or np.any(np.isnan(x))
        blocks.append((name, kind, x))

    # normal values in a handful of ranges
    for lo, hi in [(0.5, 2.0), (-1.0, 1.0), (100.0, 500.0), (-3e4, 6e4), (1e-3, 1e-2)]:
        for _ in range(3):
            add(f"uniform[{lo},{hi}]", rng.uniform(lo, hi, BLOCK))
    # subnormal element results: one big value, the rest tiny relative to it
    for big in [448.0, 57344.0, 1.0, 3.0e5]:
        for _ in range(2):
            x = rng.uniform(-1, 1, BLOCK) * big * rng.choice([2.0**-8, 2.0**-12, 2.0**-17, 2.0**-20], BLOCK)
            x[rng.integers(BLOCK)] = big
            add(f"subnormal-results(big={big})", x)
    # exact subnormal codes at scale 1
    for fmt in FORMATS:
        reps = representable(fmt)
        mx = FORMATS[fmt][1]
        sub = reps[: 1 + (8 if fmt == "e4m3" else 4)]
        x = np.concatenate([[mx], sub, -sub])
        add(f"exact-subnormals-{fmt}", f32(x))
    # saturation: FLOOR with amax mantissa above 1.75; values just above max
    for fmt in FORMATS:
        mx = FORMATS[fmt][1]
        for k in [-20, 0, 7, 30]:
            x = rng.uniform(-1, 1, BLOCK) * mx * 2.0**k
            x[0] = 1.9 * mx / 1.75 * 2.0**k
            x[1] = -1.99 * mx / 1.75 * 2.0**k
            x[2] = np.nextafter(np.float32(mx * 2.0**k), np.float32(np.inf))
            add(f"saturate-{fmt}-k{k}", x)
    # RCEIL boundaries: amax exactly 1.75 * 2^k, one ulp below and above
    for fmt in FORMATS:
        mx = FORMATS[fmt][1]
        for k in [-130, -60, -3, 0, 5, 90, 110]:
            b = np.float32(mx * 2.0**k)
            for amax in [b, np.nextafter(b, np.float32(0)), np.nextafter(b, np.float32(np.inf))]:
                x = rng.uniform(-1, 1, BLOCK).astype(np.float32) * amax
                x[rng.integers(BLOCK)] = -amax
                add(f"rceil-boundary-{fmt}-k{k}", x)
    # powers of two (FLOOR boundaries)
    for k in [-149, -140, -126, -100, -1, 0, 1, 64, 127]:
        x = np.full(BLOCK, np.float32(2.0**k))
        x[1::2] *= -1
        x[3] = np.nextafter(np.float32(2.0**k), np.float32(0))
        add(f"pow2-k{k}", x)
    # extremes of the f32 range
    fmax = np.finfo(np.float32).max
    add("f32-max", f32([fmax, -fmax, fmax / 3, 1.0, 1e30]))
    tiny = np.float32(1e-45)
    add("f32-min-subnormal", f32([tiny, -tiny, 2 * tiny, 0.0]))
    add("f32-subnormals", rng.uniform(-1, 1, BLOCK).astype(np.float32) * np.float32(1e-39))
    # all-zero blocks (with signed zeros)
    add("zeros", np.zeros(BLOCK, dtype=np.float32))
    z = np.zeros(BLOCK, dtype=np.float32)
    z[::3] = -0.0
    add("signed-zeros", z)
    # NaN and Inf blocks
    for name, special in [("nan", np.nan), ("neg-nan", -np.nan), ("inf", np.inf), ("neg-inf", -np.inf)]:
        for pos in [0, 17, 31]:
            x = rng.standard_normal(BLOCK).astype(np.float32)
            x[pos] = special
            add(f"{name}@{pos}", x)
    x = np.zeros(BLOCK, dtype=np.float32)
    x[5] = np.inf
    x[6] = np.nan
    add("inf+nan", x)
    x = np.zeros(BLOCK, dtype=np.float32)
    x[9] = np.nan
    add("nan-in-zeros", x)
    # mixed magnitudes (log-uniform, random signs)
    for _ in range(10):
        e = rng.uniform(-60, 60, BLOCK)
        add("mixed-magnitudes", np.sign(rng.standard_normal(BLOCK)) * 2.0**e)
    for _ in range(4):
        e = rng.uniform(-149, 127, BLOCK)
        add("extreme-magnitudes", np.sign(rng.standard_normal(BLOCK)) * 2.0**e)
    # bf16-representable inputs
    for k in [-40, -5, 0, 3, 20]:
        add(f"bf16-gauss-1e{k}", to_bf16(rng.standard_normal(BLOCK) * 10.0**k), "bf16")
    for _ in range(3):
        add("bf16-mixed", to_bf16(np.sign(rng.standard_normal(BLOCK)) * 2.0 ** rng.uniform(-30, 30, BLOCK)), "bf16")
    x = to_bf16(rng.standard_normal(BLOCK))
    x[4] = np.nan
    add("bf16-nan", x, "bf16")
    # random Gaussian blocks of varying scale
    for k in range(-30, 31, 3):
        add(f"gauss-1e{k}", rng.standard_normal(BLOCK) * 10.0**k)
    # heavy-tailed
    for _ in range(4):
        add("cauchy", rng.standard_cauchy(BLOCK))
    # exact RNE ties: midpoints between consecutive representable values (scale 1 and 2^k)
    for fmt in FORMATS:
        reps = representable(fmt)
        mx = FORMATS[fmt][1]
        mids = (reps[:-1] + reps[1:]) / 2
        for shift in [1.0, 2.0**-100, 2.0**50]:
            for i in range(0, len(mids), BLOCK - 1):
                chunk = mids[i : i + BLOCK - 1]
                sign = np.where(rng.random(len(chunk)) < 0.5, -1.0, 1.0)
                x = np.concatenate([[mx], chunk * sign]) * shift
                add(f"ties-{fmt}-shift{shift:g}", f32(x))
        # midpoint above max: would round up beyond max, must saturate
        add(f"tie-above-max-{fmt}", f32([mx, mx * 1.0714285714285714, -mx * 1.0714285714285714]))
    # random finite f32 bit patterns
    for _ in range(6):
        bits = rng.integers(0, 2**32, BLOCK, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32).copy()
        x[~np.isfinite(x)] = 1.0
        add("random-bits", x)
    return blocks


def row_plane(x, rows, cols, fmt, rule):
    cols_p = -(-cols // BLOCK) * BLOCK
    xp = np.zeros((rows, cols_p), dtype=np.float32)
    xp[:, :cols] = x
    data = np.zeros((rows, cols_p), dtype=np.uint8)
    scales = np.zeros((rows, cols_p // BLOCK), dtype=np.uint8)
    for r in range(rows):
        for b in range(cols_p // BLOCK):
            s, q, _ = encode_block(xp[r, b * BLOCK : (b + 1) * BLOCK], fmt, rule)
            data[r, b * BLOCK : (b + 1) * BLOCK] = q
            scales[r, b] = s
    return data, scales


def tiled(x, rows, cols, fmt, rule):
    rows_p = -(-rows // BLOCK) * BLOCK
    cols_p = -(-cols // BLOCK) * BLOCK
    xp = np.zeros((rows_p, cols_p), dtype=np.float32)
    xp[:rows, :cols] = x
    out = bytearray()
    for tr in range(rows_p // 32):
        for tc in range(cols_p // 32):
            t = xp[tr * 32 : (tr + 1) * 32, tc * 32 : (tc + 1) * 32]
            rd, rs = row_plane(t, 32, 32, fmt, rule)
            cd, cs = row_plane(t.T.copy(), 32, 32, fmt, rule)
            out += bytes(rd) + bytes(rs) + bytes(cd) + bytes(cs)
            assert len(out) % 2112 == 0
    return bytes(out)


def make_tensors(rng):
    tensors = []
    specs = [
        (1, 1, "e4m3", "rceil", "f32"),
        (33, 7, "e4m3", "rceil", "f32"),
        (33, 7, "e5m2", "floor", "bf16"),
        (40, 65, "e4m3", "floor", "f32"),
        (64, 65, "e5m2", "rceil", "f32"),
        (31, 33, "e4m3", "rceil", "bf16"),
    ]
    for rows, cols, fmt, rule, kind in specs:
        x = (rng.standard_normal((rows, cols)) * 2.0 ** rng.uniform(-8, 8, (rows, 1))).astype(np.float32)
        if rows * cols > 100:
            x[rng.integers(rows), rng.integers(cols)] = np.nan
            x[rng.integers(rows), :] = 0.0
        if kind == "bf16":
            x = to_bf16(x)
        rd, rs = row_plane(x, rows, cols, fmt, rule)
        # column plane = row plane of the transpose
        cd, cs = row_plane(x.T.copy(), cols, rows, fmt, rule)
        tensors.append(
            {
                "rows": rows,
                "cols": cols,
                "fmt": fmt,
                "rule": rule,
                "kind": kind,
                "x": hex_f32(x.reshape(-1)),
                "row_data": hex_u8(rd.reshape(-1)),
                "row_scales": hex_u8(rs.reshape(-1)),
                "col_data": hex_u8(cd.reshape(-1)),
                "col_scales": hex_u8(cs.reshape(-1)),
                "tiled": tiled(x, rows, cols, fmt, rule).hex(),
            }
        )
    return tensors


def main():
    rng = np.random.default_rng(SEED)
    out_blocks = []
    for name, kind, x in make_blocks(rng):
        res = {}
        for fmt in FORMATS:
            for rule in RULES:
                s, q, dec = encode_block(x, fmt, rule)
                res[f"{fmt}_{rule}"] = {"s": s, "q": hex_u8(q), "d": hex_f32(dec)}
        out_blocks.append({"name": name, "kind": kind, "x": hex_f32(x), "r": res})
    doc = {
        "generator": "crates/sshsdp-mx/tests/data/gen_vectors.py",
        "seed": SEED,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "nan_byte": {f: FORMATS[f][3] for f in FORMATS},
        "blocks": out_blocks,
        "tensors": make_tensors(rng),
    }
    json.dump(doc, sys.stdout, indent=0, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    with np.errstate(invalid="ignore", over="ignore"):
        main()
