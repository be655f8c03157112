#!/usr/bin/env python3
"""Independent float64 Muon test vectors for the `sshsdp-optim` crate.

Written from the reference numerics of the design guide (not from the Rust code):

  Newton-Schulz (quintic, (a, b, c) = (3.4445, -4.7750, 2.0315)):
      X = G / (||G||_F + 1e-7); if rows > cols: X = X^T
      repeat steps: A = X X^T; B = b A + c A A; X = a X + B X
      transpose back if needed
  Muon step (momentum mu, Nesterov, decoupled weight decay wd):
      M = mu M + G  (M = 0 before the first step)
      U = G + mu M  (Nesterov)  or  U = M
      O = NS(U)
      W = W (1 - lr wd) - lr scale O
  Scales for a stored [s0, s1] matrix with fan_in / fan_out given by the layout
  ("input_output": Burn's Linear, fan_in = s0; "output_input": fan_in = s1):
      spectral_ratio = sqrt(max(1, fan_out / fan_in)); match_adamw = 0.2 sqrt(max(s0, s1)).

Inputs are rounded to float32 (so the Rust side sees exactly the same values); everything
else is computed in float64. Matrices are flattened row-major. Outputs are printed with 10
significant digits (far below the f32-vs-f64 tolerances of the tests).

Deterministic (fixed seed). Regenerate with:
    python3 crates/sshsdp-optim/tests/data/gen_muon_vectors.py \
        > crates/sshsdp-optim/tests/data/muon_vectors.json
"""

import json
import sys

import numpy as np

SEED = 20250301
A, B, C = 3.4445, -4.7750, 2.0315
EPS = 1e-7


def newton_schulz(g, steps):
    x = g / (np.linalg.norm(g) + EPS)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(steps):
        a = x @ x.T
        b = B * a + C * (a @ a)
        x = A * x + b @ x
    return x.T if transposed else x


def scale(rule, layout, shape):
    s0, s1 = shape
    fan_in, fan_out = (s0, s1) if layout == "input_output" else (s1, s0)
    if rule == "spectral_ratio":
        return np.sqrt(max(1.0, fan_out / fan_in))
    return 0.2 * np.sqrt(max(s0, s1))


def muon_steps(w, grads, lr, wd, mu, nesterov, rule, layout):
    m = np.zeros_like(w)
    out = []
    for g in grads:
        m = mu * m + g
        u = g + mu * m if nesterov else m
        o = newton_schulz(u, 5)
        w = w * (1.0 - lr * wd) - lr * scale(rule, layout, w.shape) * o
        out.append(w)
    return out


def f32(rng, shape, std=1.0):
    return (rng.standard_normal(shape) * std).astype(np.float32).astype(np.float64)


def inp(x):
    # float32 values: repr of the float32 round-trips exactly.
    return [float(np.float32(v)) for v in x.ravel()]


def out(x):
    return [float("%.10g" % v) for v in x.ravel()]


def main():
    rng = np.random.default_rng(SEED)
    doc = {"ns": [], "muon": None}

    for name, (rows, cols) in [("wide_24x40", (24, 40)), ("tall_40x24", (40, 24))]:
        g = f32(rng, (rows, cols), std=0.5)
        o = newton_schulz(g, 5)
        sv = np.linalg.svd(o, compute_uv=False)
        doc["ns"].append(
            {
                "name": name,
                "rows": rows,
                "cols": cols,
                "steps": 5,
                "g": inp(g),
                "o": out(o),
                "sv_min": float(sv.min()),
                "sv_max": float(sv.max()),
            }
        )

    rows, cols = 16, 48
    w0 = f32(rng, (rows, cols), std=0.1)
    # Second gradient partly aligned with the first so the momentum term is visible.
    g1 = f32(rng, (rows, cols), std=0.02)
    g2 = (0.5 * g1 + f32(rng, (rows, cols), std=0.02)).astype(np.float32).astype(np.float64)
    lr, wd, mu = 0.02, 0.1, 0.95
    cases = []
    for rule, layout, nesterov in [
        ("spectral_ratio", "input_output", True),
        ("spectral_ratio", "output_input", True),
        ("match_adamw", "input_output", True),
        ("spectral_ratio", "input_output", False),
    ]:
        ws = muon_steps(w0, [g1, g2], lr, wd, mu, nesterov, rule, layout)
        cases.append(
            {
                "scale": rule,
                "layout": layout,
                "nesterov": nesterov,
                "scale_value": float(scale(rule, layout, (rows, cols))),
                "w": [out(w) for w in ws],
            }
        )
    doc["muon"] = {
        "rows": rows,
        "cols": cols,
        "lr": lr,
        "weight_decay": wd,
        "momentum": mu,
        "ns_steps": 5,
        "w0": inp(w0),
        "grads": [inp(g1), inp(g2)],
        "cases": cases,
    }

    json.dump(doc, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
