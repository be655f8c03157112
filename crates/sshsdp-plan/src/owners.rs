//! Newton–Schulz owners for `Matrix` parameters (owner-compute Muon).
//!
//! A matrix that lies inside one piece is owned by that piece: its update is already
//! whole there and needs no gather. Every other (split) matrix is assigned greedily, largest
//! Newton–Schulz cost first (LPT scheduling, within 4/3 of optimal): to the piece that holds
//! most of its rows among the holders whose load would stay within what LPT's choice (the
//! least-loaded piece) leaves as the largest load, else to the least-loaded piece — so the
//! exchange moves only the rows outside the biggest holder whenever balance allows, and the
//! largest load is what plain LPT gives at every step. Ties go to the lowest piece index, so
//! every rank computes the same owners.

use std::cmp::Reverse;
use std::collections::BTreeMap;

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
    // Per split matrix, the elements each holder piece has.
    let mut holders: BTreeMap<usize, Vec<(usize, u64)>> = BTreeMap::new();
    for v in buckets.iter().flat_map(|b| b.views.iter().flatten()) {
        let p = &mut params[v.param];
        if p.spec.role != Role::Matrix {
            continue;
        }
        if p.split {
            holders.entry(v.param).or_default().push((v.piece, v.len()));
        } else {
            p.ns_owner = Some(v.piece);
            load[v.piece] += param_cost(p);
        }
    }
    let mut floating: Vec<usize> = holders.keys().copied().collect();
    floating.sort_by_key(|&i| (Reverse(param_cost(&params[i])), i));
    for index in floating {
        let cost = param_cost(&params[index]);
        let (least, least_load) = (0..pieces)
            .map(|q| (q, load[q]))
            .min_by_key(|&(q, l)| (l, q))
            .expect("at least one piece");
        let makespan = load
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(least_load + cost);
        let owner = holders[&index]
            .iter()
            .filter(|&&(q, _)| load[q] + cost <= makespan)
            .max_by_key(|&&(q, rows)| (rows, Reverse(q)))
            .map_or(least, |&(q, _)| q);
        params[index].ns_owner = Some(owner);
        load[owner] += cost;
    }
    load
}
