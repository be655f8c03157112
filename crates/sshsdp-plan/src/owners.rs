//! Newton–Schulz owners for `Matrix` parameters (owner-compute Muon).
//!
//! A matrix that lies inside one piece is owned by that piece: its update is already
//! whole there and needs no gather. Every other matrix is assigned greedily, largest
//! Newton–Schulz cost first, to the least-loaded piece (LPT scheduling, within 4/3 of optimal),
//! ties broken by the lowest piece index so every rank computes the same owners.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{Bucket, PlannedParam, Role};

/// Floating-point operations of one Newton–Schulz iteration on a `rows × cols` matrix: with
/// `m = min(rows, cols)`, `n = max(rows, cols)`, the three matmuls `X Xᵀ` (`2·m²·n`), `A·A`
/// (`2·m³`) and `B·X` (`2·m²·n`) make `4·m²·n + 2·m³`.
pub fn newton_schulz_cost(rows: u64, cols: u64) -> u128 {
    let (m, n) = (rows.min(cols) as u128, rows.max(cols) as u128);
    4 * m * m * n + 2 * m * m * m
}

/// Cost of a matrix parameter, or 0 for element-wise ones.
pub(crate) fn param_cost(p: &PlannedParam) -> u128 {
    match p.spec.role {
        Role::Matrix => {
            let (rows, cols) = p.spec.matrix_dims();
            newton_schulz_cost(rows, cols)
        }
        Role::Elementwise => 0,
    }
}

/// Sets `ns_owner` on every `Matrix` parameter and returns the load of each piece.
pub(crate) fn assign(params: &mut [PlannedParam], buckets: &[Bucket], pieces: usize) -> Vec<u128> {
    let mut load = vec![0u128; pieces];
    let mut floating = Vec::new();
    for v in buckets.iter().flat_map(|b| b.views.iter().flatten()) {
        let p = &mut params[v.param];
        if p.spec.role != Role::Matrix {
            continue;
        }
        if p.split {
            if v.elements.start == 0 {
                floating.push(v.param);
            }
        } else {
            p.ns_owner = Some(v.piece);
            load[v.piece] += param_cost(p);
        }
    }
    floating.sort_by_key(|&i| (Reverse(param_cost(&params[i])), i));
    let mut heap: BinaryHeap<Reverse<(u128, usize)>> = load
        .iter()
        .enumerate()
        .map(|(piece, &l)| Reverse((l, piece)))
        .collect();
    for index in floating {
        let Reverse((l, piece)) = heap.pop().expect("at least one piece");
        let cost = param_cost(&params[index]);
        params[index].ns_owner = Some(piece);
        load[piece] = l + cost;
        heap.push(Reverse((l + cost, piece)));
    }
    load
}
