"""FS-B in the float64 oracle (spec §6): forests, node keys, height-aligned beam search, rerank.

Loops over batch rows, kv heads, query heads, blocks and queries, written for clarity. The
forests come from `forest.py` (batch construction, shared by all blocks through a cache keyed
by segment). Per query i and query head h:

    key(i, n) = scale * (q_i . mu_n + radius_weight * ||q_i|| * rad_n) + lam_h * A_n * erf(sigma_h (i - e_n) / 2s)
    rho(i, c) = logsumexp_{t in c} scale * q_i . k_t

The beam keeps, level by level, the `beam` nodes of largest key (ties: smaller segment start,
then smaller index in the level); the union of both forests' leaves is reranked by rho.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..config import FreeSoloConfig
from .forest import ForestElements, Tree, batch_forest, hyperplanes
from .primitives import available_cells, cell_stats, top_k_cells

__all__ = [
    "HeadForests",
    "beam_search",
    "fsb_costs",
    "fsb_node_keys_count",
    "head_forests",
    "node_key",
    "rerank_scores",
    "select_cells_fsb",
]


def node_key(
    q_i: np.ndarray,
    q_norm: float,
    i: int,
    tree: Tree,
    node: int,
    scale: float,
    sigma: float,
    lam: float,
    cell: int,
    radius_weight: float,
) -> float:
    """The beam key of a node (= UB_h(i, n) when radius_weight = 1; = score for a leaf)."""
    prior = lam * tree.A[node] * math.erf(sigma * (i - int(tree.e[node])) / (2.0 * cell))
    return scale * (float(tree.mu[node] @ q_i) + radius_weight * q_norm * tree.rad[node]) + prior


def beam_search(trees: list[Tree], key: Callable[[Tree, int, int], float], beam: int) -> tuple[list[int], int]:
    """Height-aligned beam search over one forest (spec §6.4).

    trees: the forest, largest first. key(tree, level, index) -> float.
    Returns (the <= beam cells kept at level 0, the number of node keys evaluated).
    """
    if not trees:
        return [], 0
    tree_of_height = {tree.height: tree for tree in trees}
    frontier = [(trees[0], 0)]  # (tree, index in level): the root of the tallest tree
    evaluated = 0
    for level in range(trees[0].height - 1, -1, -1):
        candidates = [(tree, 2 * m + d) for tree, m in frontier for d in (0, 1)]
        if level in tree_of_height:
            candidates.append((tree_of_height[level], 0))
        evaluated += len(candidates)
        ranked = sorted(
            ((key(tree, level, m), tree.start, m, tree) for tree, m in candidates),
            key=lambda x: (-x[0], x[1], x[2]),  # larger key, then smaller segment start, then smaller index
        )
        frontier = [(tree, m) for _, _, m, tree in ranked[:beam]]
    return [int(tree.cells[m]) for tree, m in frontier], evaluated


def fsb_node_keys_count(n_cells: int, beam: int) -> int:
    """Node keys one forest over n_cells elements evaluates per query (independent of the data).

    Level l (from the tallest height H - 1 down to 0) has 2 * |F_{l+1}| + bit_l(n) candidates and
    keeps |F_l| = min(beam, candidates) = min(beam, n >> l); the root of height H is taken without
    a key. Closed form: sum_{l=0}^{H-1} (2 * min(beam, n >> (l+1)) + bit_l(n)), H = floor(log2 n),
    so always <= 2*beam*H + popcount(n) - 1 <= 2*beam*(floor(log2 n)+1) + popcount(n) (lemma L9).
    """
    if n_cells <= 0:
        return 0
    kept, total = 1, 0
    for level in range(n_cells.bit_length() - 2, -1, -1):
        candidates = 2 * kept + (n_cells >> level & 1)
        total += candidates
        kept = min(beam, candidates)
    return total


def rerank_scores(q_i: np.ndarray, k_g: np.ndarray, cells, cell: int) -> np.ndarray:
    """rho(i, c) = logsumexp_{t in c}(scale * q_i . k_t). q_i [D], k_g [T, D] -> [len(cells)]."""
    scale = 1.0 / math.sqrt(q_i.shape[0])
    rho = np.zeros(len(cells))
    for n, c in enumerate(cells):
        logits = k_g[c * cell : (c + 1) * cell] @ q_i * scale  # [cell]
        top = logits.max()
        rho[n] = top + math.log(float(np.exp(logits - top).sum()))
    return rho


class HeadForests:
    """The forests of one (batch row, kv head): elements of both forests and a tree cache.

    forests(n_avail) -> (all-cells forest over [0, n_avail), high-norm forest over the high
    cells among [0, n_avail)), each a list of Trees, largest first.
    """

    def __init__(self, k_g: np.ndarray, cfg: FreeSoloConfig, tau_g: float, planes):
        self.cfg = cfg
        kbar, a = cell_stats(k_g, cfg.cell)  # [C, D], [C]
        self.kbar, self.a = kbar, a
        C = len(a)
        planes = planes if cfg.leaf_order == "content" else None
        self.high_cells = np.array([c for c in range(C) if a[c] > tau_g], dtype=np.int64)
        self.elems_all = ForestElements.from_cells(kbar, a, np.arange(C), planes)
        self.elems_high = ForestElements.from_cells(kbar, a, self.high_cells, planes)
        self._cache_all: dict = {}
        self._cache_high: dict = {}

    def forests(self, n_avail: int) -> tuple[list[Tree], list[Tree]]:
        cfg = self.cfg
        n_high = int(np.sum(self.high_cells < n_avail))
        build = {"leaf_order": cfg.leaf_order, "code_bits": cfg.hash_bits, "cell": cfg.cell}
        return (
            batch_forest(n_avail, self.elems_all, cache=self._cache_all, **build),
            batch_forest(n_high, self.elems_high, cache=self._cache_high, **build),
        )


def head_forests(k: np.ndarray, cfg: FreeSoloConfig) -> dict[tuple[int, int], HeadForests]:
    """HeadForests for every (b, g) of k [B, T, Hkv, D] (FS-B without tau raises ValueError)."""
    B, _, Hkv, D = k.shape
    tau = cfg.tau_array(Hkv)
    planes = hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D)  # [Hkv, r, D]
    return {(b, g): HeadForests(k[b, :, g], cfg, tau[g], planes[g]) for b in range(B) for g in range(Hkv)}


def _run(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig):
    """-> idx [B, T, Hq, K], node_keys [B, T, Hq], cells_reranked [B, T, Hq]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    forests = head_forests(k, cfg)  # raises without tau
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    scale = 1.0 / math.sqrt(D)
    idx = np.full((B, T, Hq, cfg.top_k), -1, dtype=np.int64)
    node_keys = np.zeros((B, T, Hq), dtype=np.int64)
    reranked = np.zeros((B, T, Hq), dtype=np.int64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            hf = forests[(b, g)]
            for j in range((T + cfg.block - 1) // cfg.block):
                n_avail = available_cells(j, cfg.block, cfg.cell)
                if n_avail == 0:
                    continue  # block 0: no cell, all -1
                trees_all, trees_high = hf.forests(n_avail)
                for i in range(j * cfg.block, min(T, (j + 1) * cfg.block)):
                    q_i = q[b, i, h]  # [D]
                    q_norm = math.sqrt(float(q_i @ q_i))

                    def key(tree, level, m, q_i=q_i, q_norm=q_norm, i=i, h=h):
                        return node_key(
                            q_i,
                            q_norm,
                            i,
                            tree,
                            tree.node(level, m),
                            scale,
                            sigma[h],
                            lam[h],
                            cfg.cell,
                            cfg.radius_weight,
                        )

                    found_all, n_all = beam_search(trees_all, key, cfg.beam)
                    found_high, n_high = beam_search(trees_high, key, cfg.beam)
                    union = sorted(set(found_all) | set(found_high))
                    rho = rerank_scores(q_i, k[b, :, g], union, cfg.cell)
                    idx[b, i, h] = top_k_cells(np.array(union, np.int64), rho, cfg.top_k)
                    node_keys[b, i, h] = n_all + n_high
                    reranked[b, i, h] = len(union)
    return idx, node_keys, reranked


def select_cells_fsb(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """FS-B selection (spec §6): q [B, T, Hq, D], k [B, T, Hkv, D] float64 -> int64 [B, T, Hq, K].

    Cells ordered by descending rho (ties: larger c first), -1 padded; block 0 gets all -1.
    """
    return _run(q, k, cfg)[0]


def fsb_costs(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> dict:
    """Per query and query head: "node_keys" [B, T, Hq] (both forests; equals
    fsb_node_keys_count(n_j) + fsb_node_keys_count(high cells among n_j)) and
    "cells_reranked" [B, T, Hq] (size of the union of the two forests' candidates)."""
    _, node_keys, reranked = _run(q, k, cfg)
    return {"node_keys": node_keys, "cells_reranked": reranked}
