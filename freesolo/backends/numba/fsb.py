"""FS-B selection with numba (spec §6): the result of `freesolo.reference.fsb`, fast.

Per (batch row, kv head) both forests are built once for every aligned dyadic segment (all
query blocks share them), in flat arrays; then one compiled loop runs the beam search and the
rerank for every query of the kv head's query heads.

Flat forest layout (one forest of M elements): the trees of height l are stored one after the
other from `height_base[l]`, tree m (segment [m 2^l, (m+1) 2^l)) at
`height_base[l] + m * (2^(l+1) - 1)`; inside a tree, nodes level by level (level 0 = the ordered
leaves first, `level_offset`). Node arrays: mu [N, D], rad [N], A [N], e [N] (int64 positions),
leaf_cell [N] (the cell of a level-0 node, -1 elsewhere).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ...config import FreeSoloConfig
from ...reference.forest import content_codes, hyperplanes
from ...reference.primitives import cell_stats

__all__ = [
    "FlatForest",
    "HeadForestsNumba",
    "build_flat_forest",
    "build_head_forests_numba",
    "cell_rho",
    "query_head_numba",
    "radix_argsort_numba",
    "select_cells_fsb_numba",
]


# ---- construction -----------------------------------------------------------------------------
@njit(cache=True)
def radix_argsort_numba(codes, key_bits):
    """Stable LSD radix sort (8-bit digits): permutation sorting int64 codes in [0, 2^key_bits)."""
    n = codes.shape[0]
    order = np.arange(n)
    spare = np.empty(n, np.int64)
    counts = np.empty(256, np.int64)
    shift = 0
    while shift < key_bits:
        counts[:] = 0
        for x in range(n):
            counts[(codes[order[x]] >> shift) & 255] += 1
        total = 0
        for d in range(256):
            c = counts[d]
            counts[d] = total
            total += c
        for x in range(n):
            element = order[x]
            d = (codes[element] >> shift) & 255
            spare[counts[d]] = element
            counts[d] += 1
        order, spare = spare, order
        shift += 8
    return order


@njit(cache=True)
def _level_offset(height, level):
    return (1 << (height + 1)) - (1 << (height - level + 1))


@njit(cache=True)
def _build_flat_forest(ekbar, ea, ecell, ecode, content, code_bits, cell):
    """Every aligned dyadic tree over elements ekbar [M, D], ea [M], ecell [M], ecode [M]."""
    M, D = ekbar.shape
    top = -1
    while (M >> (top + 1)) > 0:
        top += 1  # floor(log2 M), -1 when M == 0
    height_base = np.zeros(max(top + 1, 1), np.int64)
    total = 0
    for l in range(top + 1):
        height_base[l] = total
        total += (M >> l) * ((1 << (l + 1)) - 1)
    mu = np.zeros((total, D))
    rad = np.zeros(total)
    A = np.zeros(total)
    e = np.zeros(total, np.int64)
    leaf_cell = np.full(total, -1, np.int64)
    acc = np.zeros(D)
    for l in range(top + 1):
        size = 1 << l
        for m in range(M >> l):
            base = height_base[l] + m * (2 * size - 1)
            ranks = np.arange(m * size, (m + 1) * size)
            if content:
                ranks = ranks[radix_argsort_numba(ecode[ranks], code_bits)]
            for x in range(size):
                leaf_cell[base + x] = ecell[ranks[x]]
            for lv in range(l + 1):
                group = 1 << lv
                offset = base + _level_offset(l, lv)
                for index in range(size >> lv):
                    node = offset + index
                    first = index * group
                    acc[:] = 0.0
                    best_a = -np.inf
                    low = ecell[ranks[first]]
                    for x in range(group):
                        r = ranks[first + x]
                        for d in range(D):
                            acc[d] += ekbar[r, d]
                        best_a = max(best_a, ea[r])
                        low = min(low, ecell[r])
                    for d in range(D):
                        mu[node, d] = acc[d] / group
                    radius = 0.0
                    if group > 1:
                        for x in range(group):
                            r = ranks[first + x]
                            s = 0.0
                            for d in range(D):
                                diff = ekbar[r, d] - mu[node, d]
                                s += diff * diff
                            s = math.sqrt(s)
                            radius = max(radius, s)
                    rad[node] = radius
                    A[node] = best_a
                    e[node] = low * cell
    return height_base, mu, rad, A, e, leaf_cell


class FlatForest(NamedTuple):
    """All aligned dyadic trees of one forest (layout in the module docstring)."""

    height_base: np.ndarray  # int64 [floor(log2 M) + 1]
    mu: np.ndarray  # [N, D]
    rad: np.ndarray  # [N]
    A: np.ndarray  # [N]
    e: np.ndarray  # int64 [N]
    leaf_cell: np.ndarray  # int64 [N]


def build_flat_forest(kbar, a, cells, planes: np.ndarray | None, code_bits: int, cell: int) -> FlatForest:
    """Forest over the given cells (increasing). planes [r, D] int64 for content order, None for position."""
    cells = np.ascontiguousarray(cells, dtype=np.int64)
    ekbar = np.ascontiguousarray(kbar[cells], dtype=np.float64).reshape(len(cells), kbar.shape[1])
    ea = np.ascontiguousarray(a[cells], dtype=np.float64)
    content = planes is not None
    ecode = content_codes(ekbar, planes) if content else np.zeros(len(cells), np.int64)
    return FlatForest(*_build_flat_forest(ekbar, ea, cells, ecode, content, int(code_bits), int(cell)))


class HeadForestsNumba(NamedTuple):
    """Both FS-B forests of one (batch row, kv head) and high_prefix [C+1] (high cells among [0, n))."""

    all: FlatForest
    high: FlatForest
    high_prefix: np.ndarray


def build_head_forests_numba(k_g: np.ndarray, cfg: FreeSoloConfig, tau_g: float, planes_g) -> HeadForestsNumba:
    """k_g [T, D] float64 (one kv head), planes_g [r, D] int64 -> HeadForestsNumba."""
    kbar, a = cell_stats(k_g, cfg.cell)  # the oracle's cell statistics, bit for bit
    planes = planes_g if cfg.leaf_order == "content" else None
    high = a > tau_g
    high_cells = np.flatnonzero(high).astype(np.int64)
    high_prefix = np.concatenate([[0], np.cumsum(high)]).astype(np.int64)
    return HeadForestsNumba(
        build_flat_forest(kbar, a, np.arange(len(a)), planes, cfg.hash_bits, cfg.cell),
        build_flat_forest(kbar, a, high_cells, planes, cfg.hash_bits, cfg.cell),
        high_prefix,
    )


# ---- queries ------------------------------------------------------------------------------
@njit(cache=True)
def _beam(qv, q_norm, i, scale, sigma, lam, rw, cell, beam, n, height_base, mu, rad, A, e, leaf_cell, out):
    """Beam search over the forest of the first n elements; writes <= beam cells to out.

    Returns (cells written, node keys evaluated).
    """
    if n == 0:
        return 0, 0
    D = qv.shape[0]
    top = 0
    while (n >> (top + 1)) > 0:
        top += 1
    cap = 2 * beam + 1
    f_tree = np.empty(cap, np.int64)  # flat base of the node's tree
    f_height = np.empty(cap, np.int64)  # the tree's height
    f_start = np.empty(cap, np.int64)  # the tree's segment start
    f_index = np.empty(cap, np.int64)  # index in the level
    f_node = np.empty(cap, np.int64)  # flat node index
    c_tree = np.empty(cap, np.int64)
    c_height = np.empty(cap, np.int64)
    c_start = np.empty(cap, np.int64)
    c_index = np.empty(cap, np.int64)
    c_node = np.empty(cap, np.int64)
    c_key = np.empty(cap)
    order = np.empty(cap, np.int64)
    f_tree[0] = height_base[top]
    f_height[0] = top
    f_start[0] = 0
    f_index[0] = 0
    f_node[0] = height_base[top] + _level_offset(top, top)
    nf = 1
    evaluated = 0
    for level in range(top - 1, -1, -1):
        nc = 0
        for x in range(nf):
            for d in range(2):
                c_tree[nc] = f_tree[x]
                c_height[nc] = f_height[x]
                c_start[nc] = f_start[x]
                c_index[nc] = 2 * f_index[x] + d
                nc += 1
        if (n >> level) & 1:
            start = (n >> (level + 1)) << (level + 1)
            c_tree[nc] = height_base[level] + (start >> level) * ((1 << (level + 1)) - 1)
            c_height[nc] = level
            c_start[nc] = start
            c_index[nc] = 0
            nc += 1
        for x in range(nc):
            node = c_tree[x] + _level_offset(c_height[x], level) + c_index[x]
            c_node[x] = node
            dot = 0.0
            for d in range(D):
                dot += mu[node, d] * qv[d]
            prior = lam * A[node] * math.erf(sigma * (i - e[node]) / (2.0 * cell))
            c_key[x] = scale * (dot + rw * q_norm * rad[node]) + prior
            # insertion by (key desc, segment start asc, index asc)
            y = x
            while y > 0:
                o = order[y - 1]
                better = c_key[x] > c_key[o] or (
                    c_key[x] == c_key[o]
                    and (c_start[x] < c_start[o] or (c_start[x] == c_start[o] and c_index[x] < c_index[o]))
                )
                if not better:
                    break
                order[y] = o
                y -= 1
            order[y] = x
        evaluated += nc
        nf = min(beam, nc)
        for x in range(nf):
            o = order[x]
            f_tree[x] = c_tree[o]
            f_height[x] = c_height[o]
            f_start[x] = c_start[o]
            f_index[x] = c_index[o]
            f_node[x] = c_node[o]
    for x in range(nf):
        out[x] = leaf_cell[f_node[x]]
    return nf, evaluated


@njit(cache=True, inline="always")
def cell_rho(k_g, qv, c, cell, scale, logits):
    """rho of cell c for the query qv [D]: logsumexp over the cell's tokens of scale * (k . q).

    k_g [T, D] (one kv head's keys), logits [>= cell] scratch. The rerank's arithmetic, in one
    place: `benchmarks/fsb_recall.py` scores every cell with it, so its exhaustive reference is
    bit-equal to FS-B's rho (exact ties resolve alike).
    """
    D = qv.shape[0]
    best = -np.inf
    for t in range(cell):
        dot = 0.0
        for d in range(D):
            dot += k_g[c * cell + t, d] * qv[d]
        logits[t] = dot * scale
        best = max(best, logits[t])
    s = 0.0
    for t in range(cell):
        s += math.exp(logits[t] - best)
    return best + math.log(s)


@njit(cache=True)
def _add_unique(found, nfound, union, nu):
    """Append found[:nfound] to union[:nu], skipping cells already there; returns the new length."""
    for x in range(nfound):
        c = found[x]
        seen = False
        for y in range(nu):
            if union[y] == c:
                seen = True
                break
        if not seen:
            union[nu] = c
            nu += 1
    return nu


@njit(cache=True, parallel=True)
def _query_head(
    q_g,
    positions,
    k_g,
    sigma,
    lam,
    rw,
    cell,
    block,
    beam,
    top_k,
    hb_all,
    mu_all,
    rad_all,
    A_all,
    e_all,
    leaf_all,
    hb_high,
    mu_high,
    rad_high,
    A_high,
    e_high,
    leaf_high,
    high_prefix,
):
    """q_g [P, G, D] (queries of the G query heads of one kv head), positions [P], k_g [T, D].

    -> idx [P, G, K] (descending rho, ties larger c; -1 padded), node_keys [P, G], reranked [P, G].
    """
    P, G, D = q_g.shape
    scale = 1.0 / math.sqrt(D)
    idx = np.full((P, G, top_k), -1, np.int64)
    node_keys = np.zeros((P, G), np.int64)
    reranked = np.zeros((P, G), np.int64)
    for p in prange(P):  # queries are independent
        i = positions[p]
        n_avail = (i // block) * block // cell
        if n_avail == 0:
            continue
        found = np.empty(beam, np.int64)
        union = np.empty(2 * beam, np.int64)
        rho = np.empty(2 * beam)
        rank = np.empty(2 * beam, np.int64)
        logits = np.empty(cell)
        n_high = high_prefix[n_avail]
        for h in range(G):
            qv = q_g[p, h]
            qq = 0.0
            for d in range(D):
                qq += qv[d] * qv[d]
            q_norm = math.sqrt(qq)
            # all-cells forest, then the high-norm forest; the union keeps first occurrences
            nfound, keys_all = _beam(
                qv,
                q_norm,
                i,
                scale,
                sigma[h],
                lam[h],
                rw,
                cell,
                beam,
                n_avail,
                hb_all,
                mu_all,
                rad_all,
                A_all,
                e_all,
                leaf_all,
                found,
            )
            nu = _add_unique(found, nfound, union, 0)
            nfound, keys_high = _beam(
                qv,
                q_norm,
                i,
                scale,
                sigma[h],
                lam[h],
                rw,
                cell,
                beam,
                n_high,
                hb_high,
                mu_high,
                rad_high,
                A_high,
                e_high,
                leaf_high,
                found,
            )
            nu = _add_unique(found, nfound, union, nu)
            total_keys = keys_all + keys_high
            node_keys[p, h] = total_keys
            reranked[p, h] = nu
            for x in range(nu):  # rho = logsumexp over the cell's tokens
                c = union[x]
                rho[x] = cell_rho(k_g, qv, c, cell, scale, logits)
                y = x  # insertion by (rho desc, c desc)
                while y > 0:
                    o = rank[y - 1]
                    if not (rho[x] > rho[o] or (rho[x] == rho[o] and c > union[o])):
                        break
                    rank[y] = o
                    y -= 1
                rank[y] = x
            for x in range(min(top_k, nu)):
                idx[p, h, x] = union[rank[x]]
    return idx, node_keys, reranked


def query_head_numba(
    forests: HeadForestsNumba,
    q_g: np.ndarray,
    positions: np.ndarray,
    k_g: np.ndarray,
    sigma: np.ndarray,
    lam: np.ndarray,
    cfg: FreeSoloConfig,
):
    """FS-B for the G query heads of one kv head at the given query positions.

    q_g [P, G, D], positions int64 [P], k_g [T, D], sigma / lam [G]
    -> idx int64 [P, G, K], node_keys [P, G] (both forests), cells_reranked [P, G].
    """
    fa, fh = forests.all, forests.high
    return _query_head(
        np.ascontiguousarray(q_g, dtype=np.float64),
        np.ascontiguousarray(positions, dtype=np.int64),
        np.ascontiguousarray(k_g, dtype=np.float64),
        np.ascontiguousarray(sigma, dtype=np.float64),
        np.ascontiguousarray(lam, dtype=np.float64),
        float(cfg.radius_weight),
        int(cfg.cell),
        int(cfg.block),
        int(cfg.beam),
        int(cfg.top_k),
        fa.height_base,
        fa.mu,
        fa.rad,
        fa.A,
        fa.e,
        fa.leaf_cell,
        fh.height_base,
        fh.mu,
        fh.rad,
        fh.A,
        fh.e,
        fh.leaf_cell,
        forests.high_prefix,
    )


def select_cells_fsb_numba(
    q: np.ndarray,
    k: np.ndarray,
    cfg: FreeSoloConfig,
    positions: np.ndarray | None = None,
    return_costs: bool = False,
):
    """FS-B selection (spec §6), equal to the float64 oracle's.

    Args:
        q: [B, T, Hq, D] float64; k: [B, T, Hkv, D] float64; cfg with variant "fsb" and tau.
        positions: optional int64 [P] query positions (default: all T).
        return_costs: also return {"node_keys": [B, P, Hq], "cells_reranked": [B, P, Hq]}.
    Returns:
        idx int64 [B, P, Hq, K] (P = T by default), descending rho, -1 padded.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    tau = cfg.tau_array(Hkv)  # FS-B without tau: ValueError pointing to calibrate_tau
    G = Hq // Hkv
    positions = np.arange(T, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= T):
        raise ValueError(f"positions must lie in [0, T={T})")
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    planes = hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D)
    P = len(positions)
    idx = np.full((B, P, Hq, cfg.top_k), -1, dtype=np.int64)
    node_keys = np.zeros((B, P, Hq), dtype=np.int64)
    reranked = np.zeros((B, P, Hq), dtype=np.int64)
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    for b in range(B):
        for g in range(Hkv):
            heads = slice(g * G, (g + 1) * G)
            forests = build_head_forests_numba(k[b, :, g], cfg, tau[g], planes[g])
            out = query_head_numba(
                forests, q[b][positions][:, heads], positions, k[b, :, g], sigma[heads], lam[heads], cfg
            )
            idx[b, :, heads], node_keys[b, :, heads], reranked[b, :, heads] = out
    if return_costs:
        return idx, {"node_keys": node_keys, "cells_reranked": reranked}
    return idx
