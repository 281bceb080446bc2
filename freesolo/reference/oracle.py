"""The float64 NumPy oracle: loops over batch rows, heads and queries (spec §2-§7).

`select_cells`, `local_attention`, `long_range_readout` and `attention` take float64 arrays
q [B, T, Hq, D], k / v [B, T, Hkv, D] (validated by the caller) and a `FreeSoloConfig`.
"""

from __future__ import annotations

import numpy as np

from ..config import FreeSoloConfig
from .primitives import (
    available_cells,
    cell_scores,
    cell_stats,
    fsl_candidates,
    rmsnorm,
    rope,
    softmax_readout,
    top_k_cells,
)

__all__ = ["select_cells", "local_attention", "long_range_readout", "attention", "calibrate_tau"]


def _kv_head(h: int, num_heads: int, num_kv_heads: int) -> int:
    """GQA: query head h reads kv head h // (Hq // Hkv)."""
    return h // (num_heads // num_kv_heads)


def block_candidates(a: np.ndarray, n_avail: int, cfg: FreeSoloConfig) -> np.ndarray:
    """Candidate cells of a query block with n_avail available cells (FS, FS-L), sorted."""
    if cfg.variant == "fs":
        return np.arange(n_avail, dtype=np.int64)
    if cfg.variant == "fsl":
        return fsl_candidates(a, n_avail, cfg.pool, cfg.recent)
    raise ValueError(f"block_candidates serves fs and fsl, not variant={cfg.variant!r}")


def select_cells(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """Selected cells per query: int64 [B, T, Hq, K], descending final score, -1 padded (spec §7)."""
    if cfg.variant == "fsb":
        from .fsb import select_cells_fsb

        return select_cells_fsb(q, k, cfg)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    idx = np.full((B, T, Hq, cfg.top_k), -1, dtype=np.int64)
    for b in range(B):
        for h in range(Hq):
            g = _kv_head(h, Hq, Hkv)
            kbar, a = cell_stats(k[b, :, g], cfg.cell)  # [C, D], [C]
            for j in range((T + cfg.block - 1) // cfg.block):
                candidates = block_candidates(a, available_cells(j, cfg.block, cfg.cell), cfg)
                if len(candidates) == 0:
                    continue
                for i in range(j * cfg.block, min(T, (j + 1) * cfg.block)):
                    scores = cell_scores(q[b, i, h], i, candidates, kbar, a, sigma[h], lam[h], cfg.cell)
                    idx[b, i, h] = top_k_cells(candidates, scores, cfg.top_k)
    return idx


def local_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """RoPE sliding-window attention over keys i-w < t <= i. -> [B, T, Hq, D] (spec §2)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    positions = np.arange(T)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            g = _kv_head(h, Hq, Hkv)
            q_rot = rope(q[b, :, h], positions, cfg.rope_theta)  # [T, D]
            k_rot = rope(k[b, :, g], positions, cfg.rope_theta)  # [T, D]
            for i in range(T):
                lo = max(0, i - cfg.window + 1)
                out[b, i, h] = softmax_readout(q_rot[i], k_rot[lo : i + 1], v[b, lo : i + 1, g])
    return out


def long_range_readout(q: np.ndarray, k: np.ndarray, v: np.ndarray, idx: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """NoPE attention over the tokens of the selected cells idx [B, T, Hq, K] -> [B, T, Hq, D].

    A query with no selected cell gets 0.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            g = _kv_head(h, Hq, Hkv)
            for i in range(T):
                cells = [int(c) for c in idx[b, i, h] if c >= 0]
                if not cells:
                    continue
                tokens = np.concatenate([np.arange(c * cfg.cell, (c + 1) * cfg.cell) for c in cells])
                out[b, i, h] = softmax_readout(q[b, i, h], k[b, tokens, g], v[b, tokens, g])
    return out


def combine(o_loc: np.ndarray, o_long: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """o = o_loc + beta_h * rmsnorm(o_long) (rmsnorm over D). beta [Hq]."""
    out = o_loc.copy()
    B, T, Hq, _ = o_loc.shape
    for b in range(B):
        for i in range(T):
            for h in range(Hq):
                out[b, i, h] += beta[h] * rmsnorm(o_long[b, i, h], eps)
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: FreeSoloConfig, beta: np.ndarray) -> np.ndarray:
    """FreeSolo attention output [B, T, Hq, D] (spec §7)."""
    idx = select_cells(q, k, cfg)
    return combine(local_attention(q, k, v, cfg), long_range_readout(q, k, v, idx, cfg), beta, cfg.eps)


def calibrate_tau(k: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """Per kv head, the median of a_c over all complete cells of all batch rows. k [B, T, Hkv, D] -> [Hkv]."""
    B, T, Hkv, D = k.shape
    if T < cfg.cell:
        raise ValueError(f"calibrate_tau needs T >= cell, got T={T} < cell={cfg.cell}: no complete cell")
    tau = np.zeros(Hkv)
    for g in range(Hkv):
        norms = np.concatenate([cell_stats(k[b, :, g], cfg.cell)[1] for b in range(B)])
        tau[g] = np.median(norms)
    return tau
